#include "attnd/server/work_queue.h"

#include <algorithm>
#include <utility>

namespace attnd::server {

WorkQueue::WorkQueue(int threads) : threads_(std::max(1, threads)) {}

WorkQueue::~WorkQueue() {
  std::vector<std::thread> workers;
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    workers.swap(workers_);
  }
  for (std::thread& t : workers) t.join();
}

void WorkQueue::Run(absl::AnyInvocable<void() &&> work) {
  absl::MutexLock lock(&mu_);
  queue_.push_back(std::move(work));
  if (workers_.size() < static_cast<size_t>(threads_)) {
    workers_.emplace_back([this] { Loop(); });
  }
}

void WorkQueue::Loop() {
  while (true) {
    absl::AnyInvocable<void() &&> work;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &WorkQueue::Ready));
      if (queue_.empty()) return;  // stopping, and nothing left
      work = std::move(queue_.front());
      queue_.pop_front();
    }
    std::move(work)();
  }
}

}  // namespace attnd::server
