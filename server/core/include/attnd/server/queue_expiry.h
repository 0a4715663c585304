// Queued jobs whose deadline passes while they wait are answered DEADLINE_EXCEEDED then, and give their queue
// slot back, rather than when a worker reaches them: a backend keeps one QueueExpiry per queue. It tells it the
// deadline of each job it queues (Queued); when the earliest of those comes, the QueueExpiry's thread calls the
// backend's `sweep`, which takes the expired jobs out of its queue, answers them with ExpiredInQueue, and returns
// the earliest deadline still queued.
#pragma once

#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "attnd/server/backend.h"

namespace attnd::server {

class QueueExpiry {
 public:
  // `sweep(now)`: called on the QueueExpiry's thread, without its lock held; returns the earliest deadline of
  // the jobs left in the queue (absl::InfiniteFuture() when none has one).
  using Sweep = std::function<absl::Time(absl::Time now)>;

  explicit QueueExpiry(Sweep sweep);
  ~QueueExpiry();  // Stop()
  QueueExpiry(const QueueExpiry&) = delete;
  QueueExpiry& operator=(const QueueExpiry&) = delete;

  // A job with this deadline was queued (an infinite one costs nothing).
  void Queued(absl::Time deadline);
  // Ends the thread; no sweep runs after it returns. Idempotent.
  void Stop();

 private:
  void Loop();

  const Sweep sweep_;
  absl::Mutex mu_;
  absl::Time next_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();  // when to sweep next
  absl::Time waiting_until_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// The answer of a job taken out of the queue by a sweep at `now`.
absl::Status ExpiredInQueue(const ForwardJob& job, absl::Time now);

}  // namespace attnd::server
