// Process-wide allocator tuning for processes that move tensors of megabytes per request (attnd, attn).
#pragma once

#include <cstdint>
#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace attnd {

// Whether this process's malloc is jemalloc's: attnd links it (server/jemalloc_conf.cc); attn, the client
// libraries and the tests use the C library's.
bool HeapIsJemalloc();

// Keeps freed tensor-sized blocks for the next request instead of handing their pages back, so requests do not
// page-fault their buffers in anew (measured 15 ms of a unary Forward's 25 MB request at attnd's entry, 4 ms once
// freed memory stays). The process's resident size then stays near its peak while requests come; IdleHeapTrimmer
// hands it back once they stop. Returns false where the allocator cannot be tuned (nothing changed).
//
// jemalloc: every arena keeps what it frees for 10 s (dirty_decay_ms), then purges it a little at a time; blocks
// of every size stay in the arenas (oversize_threshold:0, set in server/jemalloc_conf.cc).
// glibc: blocks up to 32 MiB (the most glibc accepts; its default mmaps from 128 KiB and unmaps on free) stay in
// the heap and freed memory stays mapped up to 1 GiB. Each thread that meets contention gets an arena of its own,
// and what such an arena frees at its top stays mapped up to that threshold: malloc_trim hands back only the main
// arena's top, so a process whose threads once buffered a large upload keeps part of it resident for good.
bool RetainFreedHeapMemory();

// jemalloc: every arena hands back what it frees at once (dirty decay 0): attnd's --retain_heap=false. glibc:
// nothing to change, its defaults already do. Returns false where the allocator cannot be tuned.
bool ReturnFreedHeapMemoryAtOnce();

// Hands the heap's free pages back to the system: jemalloc purges every arena; glibc's malloc_trim releases the
// main arena's top and the free chunks inside every arena. False where neither is the allocator.
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
