#include "attnd/server/queue_expiry.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace attnd::server {

QueueExpiry::QueueExpiry(Sweep sweep) : sweep_(std::move(sweep)), thread_([this] { Loop(); }) {}

QueueExpiry::~QueueExpiry() { Stop(); }

void QueueExpiry::Queued(absl::Time deadline) {
  if (deadline == absl::InfiniteFuture()) return;
  absl::MutexLock lock(&mu_);
  next_ = std::min(next_, deadline);
}

void QueueExpiry::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

void QueueExpiry::Loop() {
  mu_.Lock();
  for (;;) {
    waiting_until_ = next_;
    // Wakes when the sweep is due, on Stop, or when a job with an earlier deadline arrives.
    mu_.AwaitWithDeadline(absl::Condition(
                              +[](QueueExpiry* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) {
                                return self->stop_ || self->next_ < self->waiting_until_;
                              },
                              this),
                          waiting_until_);
    if (stop_) break;
    if (absl::Now() < next_) continue;
    // Deadlines queued during the sweep lower next_ again; the sweep reports those it left.
    next_ = absl::InfiniteFuture();
    mu_.Unlock();
    const absl::Time rest = sweep_(absl::Now());
    mu_.Lock();
    next_ = std::min(next_, rest);
  }
  mu_.Unlock();
}

absl::Status ExpiredInQueue(const ForwardJob& job, absl::Time now) {
  return absl::DeadlineExceededError(absl::StrCat("the deadline passed after ",
                                                  absl::ToInt64Microseconds(now - job.accepted),
                                                  " us in the queue; the computation was not started"));
}

}  // namespace attnd::server
