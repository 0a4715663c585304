// A caching allocator for one device's buffers (device memory or pinned host staging). Requests take a
// block and give it back; given-back blocks are kept for reuse, so after warm-up no request calls
// cudaMalloc/cudaMallocHost. The bytes held (in use + cached) never exceed the budget: a request that cannot
// fit even after the cache is emptied is RESOURCE_EXHAUSTED, never an allocation failure.
//
// The raw allocation functions are injected, so the accounting is testable without a GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace attnd::server::cuda {

struct Block {
  void* ptr = nullptr;
  uint64_t size = 0;  // the block's real size, >= the size asked for
};

struct RawAllocator {
  std::string what;                                       // "device memory" / "pinned host memory", for messages
  std::function<absl::StatusOr<void*>(uint64_t)> alloc;   // cudaMalloc / cudaMallocHost
  std::function<void(void*)> free;                        // cudaFree / cudaFreeHost
};

struct BlockCacheStats {
  uint64_t held_bytes = 0, in_use_bytes = 0, budget_bytes = 0;
  uint64_t allocations = 0;  // raw allocations made (warm-up included); flat under steady load
  uint64_t reuses = 0;       // requests served from the cache
};

class BlockCache {
 public:
  BlockCache(RawAllocator raw, uint64_t budget_bytes);
  ~BlockCache();  // frees every cached block; blocks still in use are the caller's bug (and leak)
  BlockCache(const BlockCache&) = delete;
  BlockCache& operator=(const BlockCache&) = delete;

  // A block of at least `bytes` bytes. RESOURCE_EXHAUSTED when the budget cannot hold it.
  absl::StatusOr<Block> Acquire(uint64_t bytes);
  void Release(Block block);
  // A block of its own allocation, never a cached one, under the same budget; Drop frees it instead of caching it.
  // For memory another process maps (a move's device rows): it carries no earlier request's bytes out, and no
  // later request's bytes reach a mapping that outlives it.
  absl::StatusOr<Block> AcquireFresh(uint64_t bytes);
  void Drop(Block block);
  // Rounds a request up to the size class that Acquire allocates, so nearby sizes share blocks.
  static uint64_t SizeClass(uint64_t bytes);

  BlockCacheStats stats() const;

 private:
  void FreeCachedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Room for `size` more bytes held (cached blocks freed first), then a raw allocation of them.
  absl::StatusOr<Block> AllocateLocked(uint64_t size) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const RawAllocator raw_;
  const uint64_t budget_;
  mutable absl::Mutex mu_;
  // Free blocks by size; the most recently released one of a size comes back first, so a request stream
  // of one shape keeps landing on the same addresses (and so on cached tensor maps).
  std::multimap<uint64_t, void*> free_ ABSL_GUARDED_BY(mu_);
  uint64_t held_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t in_use_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t allocations_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t reuses_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace attnd::server::cuda
