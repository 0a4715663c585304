// WorkQueue: work runs off the caller's thread, at most `threads` at once, and everything queued runs before the
// queue is gone.
#include "attnd/server/work_queue.h"

#include <atomic>
#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace attnd::server {
namespace {

TEST(WorkQueue, RunsOffTheCallersThreadAtMostThreadsAtOnce) {
  std::atomic<int> running{0}, most{0}, done{0};
  absl::Notification release;
  const std::thread::id caller = std::this_thread::get_id();
  std::atomic<bool> on_caller{false};
  {
    WorkQueue queue(3);
    for (int i = 0; i < 8; ++i) {
      queue.Run([&] {
        if (std::this_thread::get_id() == caller) on_caller = true;
        const int now = ++running;
        for (int m = most.load(); now > m && !most.compare_exchange_weak(m, now);) {
        }
        release.WaitForNotificationWithTimeout(absl::Seconds(10));
        --running;
        ++done;
      });
    }
    // Three take work and block; the other five wait in the queue.
    for (int i = 0; i < 1000 && running.load() < 3; ++i) absl::SleepFor(absl::Milliseconds(5));
    absl::SleepFor(absl::Milliseconds(50));
    EXPECT_EQ(running.load(), 3);
    EXPECT_EQ(done.load(), 0);
    release.Notify();
  }  // the destructor runs what is queued
  EXPECT_EQ(done.load(), 8);
  EXPECT_EQ(most.load(), 3);
  EXPECT_FALSE(on_caller.load());
}

TEST(WorkQueue, AQueueNeverUsedStartsNoThread) {
  WorkQueue queue(4);  // constructed and destroyed without work: nothing to join, nothing hangs
}

}  // namespace
}  // namespace attnd::server
