// Blocking work handed off by gRPC's callback reactions, which must not block: gRPC runs every reaction of the
// process on a few threads (half the cores, at least two), so a reaction that waits for a device copy holds one of
// them, and a few such reactions stall every other call's. A fixed set of threads, started on the first Run, takes
// the work in arrival order.
#pragma once

#include <deque>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/synchronization/mutex.h"

namespace attnd::server {

class WorkQueue {
 public:
  explicit WorkQueue(int threads);
  ~WorkQueue();  // runs what is queued, then joins its threads
  WorkQueue(const WorkQueue&) = delete;
  WorkQueue& operator=(const WorkQueue&) = delete;

  // Queues `work`; it runs on one of the queue's threads.
  void Run(absl::AnyInvocable<void() &&> work);

 private:
  void Loop();
  bool Ready() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !queue_.empty(); }

  const int threads_;
  absl::Mutex mu_;
  std::deque<absl::AnyInvocable<void() &&>> queue_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace attnd::server
