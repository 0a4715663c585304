#include "attnd/server/cuda/tensor_map_cache.h"

#include <algorithm>
#include <utility>

namespace attnd::server::cuda {

TensorMapCache::TensorMapCache(size_t capacity, Encoder encode)
    : capacity_(std::max<size_t>(capacity, 1)),
      encode_(encode ? std::move(encode) : Encoder(&kernels::EncodeTensorMap)) {}

absl::StatusOr<CUtensorMap> TensorMapCache::Get(const kernels::TensorMapKey& key) {
  absl::MutexLock lock(&mu_);
  auto it = index_.find(key);
  if (it != index_.end()) {
    hits_.fetch_add(1, std::memory_order_relaxed);
    lru_.splice(lru_.begin(), lru_, it->second);
    return it->second->second;
  }
  misses_.fetch_add(1, std::memory_order_relaxed);
  // Encoding is a few microseconds of host work; doing it under the lock keeps one encode per key even when
  // several streams miss on the same buffer at once.
  absl::StatusOr<CUtensorMap> map = encode_(key);
  if (!map.ok()) return map.status();
  if (lru_.size() >= capacity_) {
    index_.erase(lru_.back().first);
    lru_.pop_back();
  }
  lru_.emplace_front(key, *map);
  index_.emplace(key, lru_.begin());
  return *map;
}

size_t TensorMapCache::size() const {
  absl::MutexLock lock(&mu_);
  return lru_.size();
}

}  // namespace attnd::server::cuda
