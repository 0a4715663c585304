#include "attnd/server/cuda/block_cache.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace attnd::server::cuda {
namespace {

constexpr uint64_t kSmallGranule = 64 * 1024;     // below 2 MiB: powers of two from 64 KiB
constexpr uint64_t kLargeGranule = 2 * 1024 * 1024;

}  // namespace

BlockCache::BlockCache(RawAllocator raw, uint64_t budget_bytes) : raw_(std::move(raw)), budget_(budget_bytes) {}

BlockCache::~BlockCache() {
  absl::MutexLock lock(&mu_);
  FreeCachedLocked();
}

uint64_t BlockCache::SizeClass(uint64_t bytes) {
  if (bytes <= kSmallGranule) return kSmallGranule;
  if (bytes < kLargeGranule) {
    uint64_t c = kSmallGranule;
    while (c < bytes) c <<= 1;
    return c;
  }
  // Callers validated sizes far below 2^63, so this cannot wrap.
  return (bytes + kLargeGranule - 1) / kLargeGranule * kLargeGranule;
}

absl::StatusOr<Block> BlockCache::Acquire(uint64_t bytes) {
  const uint64_t size = SizeClass(bytes);
  absl::MutexLock lock(&mu_);
  // Reuse a cached block of the same class, or one at most 25% larger (a bigger one would waste budget that
  // another request may need).
  auto it = free_.lower_bound(size);
  if (it != free_.end() && it->first <= size + size / 4) {
    Block b{it->second, it->first};
    free_.erase(it);
    in_use_ += b.size;
    ++reuses_;
    return b;
  }
  return AllocateLocked(size);
}

absl::StatusOr<Block> BlockCache::AllocateLocked(uint64_t size) {
  if (size > budget_) {
    return absl::ResourceExhaustedError(absl::StrCat("a request needs ", size, " bytes of ", raw_.what,
                                                     ", more than the whole budget of ", budget_,
                                                     " bytes (--memory_budget_mb)"));
  }
  if (held_ + size > budget_) FreeCachedLocked();  // give cached blocks back before refusing
  if (held_ + size > budget_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        raw_.what, " budget exhausted: ", in_use_, " of ", budget_, " bytes in use by running requests, ", size,
        " more needed (--memory_budget_mb; fewer --streams or smaller requests also help)"));
  }
  absl::StatusOr<void*> p = raw_.alloc(size);
  if (!p.ok()) {
    // The budget is a bound, not a promise: another process may have taken the memory.
    return absl::ResourceExhaustedError(absl::StrCat("allocating ", size, " bytes of ", raw_.what, " failed: ",
                                                     p.status().message()));
  }
  held_ += size;
  in_use_ += size;
  ++allocations_;
  return Block{*p, size};
}

void BlockCache::Release(Block block) {
  if (block.ptr == nullptr) return;
  absl::MutexLock lock(&mu_);
  in_use_ -= block.size;
  // Before its equals, so lower_bound finds it first (last released, first reused).
  free_.emplace_hint(free_.lower_bound(block.size), block.size, block.ptr);
}

absl::StatusOr<Block> BlockCache::AcquireFresh(uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  return AllocateLocked(SizeClass(bytes));
}

void BlockCache::Drop(Block block) {
  if (block.ptr == nullptr) return;
  absl::MutexLock lock(&mu_);
  raw_.free(block.ptr);
  in_use_ -= block.size;
  held_ -= block.size;
}

void BlockCache::FreeCachedLocked() {
  for (auto& [size, ptr] : free_) {
    raw_.free(ptr);
    held_ -= size;
  }
  free_.clear();
}

BlockCacheStats BlockCache::stats() const {
  absl::MutexLock lock(&mu_);
  return BlockCacheStats{held_, in_use_, budget_, allocations_, reuses_};
}

}  // namespace attnd::server::cuda
