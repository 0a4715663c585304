// Process-wide allocator tuning for processes that move tensors of megabytes per request (attnd, attn).
#pragma once

#include <cstdint>
#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace attnd {

// glibc serves allocations above its mmap threshold (128 KiB, raised on the fly up to 32 MiB) with fresh
// mmaps and unmaps them on free, so every request's tensor buffers (the parsed message, the reply) are
// page-faulted in again: measured 15 ms of a unary Forward's 25 MB request at attnd's entry, 4 ms once
// freed memory stays in the heap. This keeps blocks up to 32 MiB (the most glibc accepts) in the heap and
// freed memory mapped up to 1 GiB; the process's resident size then stays near its peak instead of
// falling back after each request. Returns false where this is not glibc (nothing changed).
//
// `arenas` > 0 caps glibc's arenas (M_ARENA_MAX; 0 keeps its default of 8 per core). Each thread that meets
// contention gets an arena of its own, and what such an arena frees at its top stays mapped up to the 1 GiB trim
// threshold: malloc_trim hands back only the main arena's top. A server whose gRPC threads once buffered a hostile
// upload would keep it resident for good; with one arena the idle trim returns all of it. Call it before
// threads start.
bool RetainFreedHeapMemory(int arenas = 0);

// Hands the heap's free pages back to the system (malloc_trim); false where this is not glibc.
bool ReleaseFreedHeapMemory();

// What RetainFreedHeapMemory keeps is worth keeping while requests come, and only then: after a burst (or one
// hostile upload the transport buffered and dropped) an idle process would otherwise sit at its peak for good.
// Every `period` this looks at `activity` (a count that moves with every request); once it has not moved for a
// whole period, the freed heap is released, once per quiet spell.
class IdleHeapTrimmer {
 public:
  IdleHeapTrimmer(std::function<uint64_t()> activity, absl::Duration period);
  ~IdleHeapTrimmer();
  IdleHeapTrimmer(const IdleHeapTrimmer&) = delete;
  IdleHeapTrimmer& operator=(const IdleHeapTrimmer&) = delete;
  // Releases since the start.
  uint64_t releases() const;

 private:
  void Run();
  const std::function<uint64_t()> activity_;
  const absl::Duration period_;
  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t releases_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

}  // namespace attnd
