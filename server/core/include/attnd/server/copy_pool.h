// Large host-memory copies spread over a few threads. A unary request's tensors go into pinned staging and
// its O comes back out of it on the request's worker thread: for a 1k request (25 MB in, 8 MB out) that was
// most of the CUDA backend's 6 ms hold of the request on the H200 host, at ~6 GB/s on one thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"

namespace attnd::server {

class CopyPool {
 public:
  struct Part {
    uint8_t* dst;
    const uint8_t* src;
    size_t bytes;
  };

  // `threads` helpers beside the callers (0: every copy runs on its caller alone).
  explicit CopyPool(int threads);
  ~CopyPool();  // waits for the helpers; no Copy may be running
  CopyPool(const CopyPool&) = delete;
  CopyPool& operator=(const CopyPool&) = delete;

  // Copies every part (they must not overlap), the calling thread taking a share; returns when all bytes are
  // in place. Safe to call from several threads at once: their batches share the helpers in arrival order.
  void Copy(absl::Span<const Part> parts);

  int threads() const { return static_cast<int>(helpers_.size()); }

  // Parts are cut into pieces of at most this many bytes, so that one large tensor spreads over the helpers.
  static constexpr size_t kChunkBytes = size_t{1} << 20;

 private:
  struct Batch;
  static void Run(Batch& batch);
  void HelperLoop();

  absl::Mutex mu_;
  std::deque<std::shared_ptr<Batch>> queue_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> helpers_;
};

// The helper count when none is configured: a quarter of the cores, at most 4 (the H200 host has 16; the
// 2-core CI machine gets none).
int DefaultCopyThreads();

}  // namespace attnd::server
