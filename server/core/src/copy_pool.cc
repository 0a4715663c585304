#include "attnd/server/copy_pool.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <utility>

namespace attnd::server {

struct CopyPool::Batch {
  std::vector<Part> pieces;
  std::atomic<size_t> next{0};  // the next piece to take
  std::atomic<size_t> done{0};  // pieces copied
  absl::Mutex mu;
  bool finished ABSL_GUARDED_BY(mu) = false;
};

CopyPool::CopyPool(int threads) {
  for (int i = 0; i < threads; ++i) helpers_.emplace_back([this] { HelperLoop(); });
}

CopyPool::~CopyPool() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  for (std::thread& t : helpers_) t.join();
}

void CopyPool::Run(Batch& batch) {
  const size_t n = batch.pieces.size();
  for (size_t i; (i = batch.next.fetch_add(1, std::memory_order_relaxed)) < n;) {
    const Part& p = batch.pieces[i];
    std::memcpy(p.dst, p.src, p.bytes);
    // acq_rel: the thread that sees the last piece done also sees every other piece's bytes written.
    if (batch.done.fetch_add(1, std::memory_order_acq_rel) + 1 == n) {
      absl::MutexLock lock(&batch.mu);
      batch.finished = true;
    }
  }
}

void CopyPool::HelperLoop() {
  for (;;) {
    std::shared_ptr<Batch> batch;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](CopyPool* pool) ABSL_EXCLUSIVE_LOCKS_REQUIRED(pool->mu_) { return pool->stop_ || !pool->queue_.empty(); },
          this));
      if (queue_.empty()) return;  // stopping
      batch = queue_.front();
    }
    Run(*batch);
    // Every piece has been taken: the batch leaves the queue (its caller may still be waiting for the copies
    // in flight on other threads).
    absl::MutexLock lock(&mu_);
    if (!queue_.empty() && queue_.front() == batch) queue_.pop_front();
  }
}

void CopyPool::Copy(absl::Span<const Part> parts) {
  size_t total = 0;
  for (const Part& p : parts) total += p.bytes;
  if (helpers_.empty() || total <= kChunkBytes) {
    for (const Part& p : parts) std::memcpy(p.dst, p.src, p.bytes);
    return;
  }
  auto batch = std::make_shared<Batch>();
  for (const Part& p : parts) {
    for (size_t at = 0; at < p.bytes; at += kChunkBytes) {
      batch->pieces.push_back(Part{p.dst + at, p.src + at, std::min(kChunkBytes, p.bytes - at)});
    }
  }
  {
    absl::MutexLock lock(&mu_);
    queue_.push_back(batch);
  }
  Run(*batch);
  {
    absl::MutexLock lock(&batch->mu);
    batch->mu.Await(absl::Condition(&batch->finished));
  }
  absl::MutexLock lock(&mu_);
  const auto it = std::find(queue_.begin(), queue_.end(), batch);
  if (it != queue_.end()) queue_.erase(it);
}

int DefaultCopyThreads() {
  const unsigned cores = std::thread::hardware_concurrency();
  return static_cast<int>(std::min(4u, cores / 4));
}

}  // namespace attnd::server
