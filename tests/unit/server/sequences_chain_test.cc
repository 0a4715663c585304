// Steps admitted behind a step in flight (CallInfo::chain, a caller that pipelines its steps) on the CPU backend:
// they see the rows the step before them appends, they wait for it, they fail with it and leave nothing behind,
// and the limits around them (one behind another at most, no fork or truncate meanwhile, close deferred).
#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "forwarding_backend.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "sequences_fixture.h"

namespace attnd::sequences_test {
namespace {

// A step started without waiting for its reply, on a thread of its own: a chained step's Step call returns only
// once the step before it has ended.
struct Started {
  std::shared_ptr<Outcome> out = std::make_shared<Outcome>();
  std::shared_ptr<absl::Notification> done = std::make_shared<absl::Notification>();
  std::thread thread;
  Outcome Await() {
    done->WaitForNotification();
    thread.join();
    return *out;
  }
};

class ChainTest : public SequencesTest {
 protected:
  static CallInfo Chained(std::shared_ptr<std::atomic<bool>> cancelled = nullptr) {
    CallInfo call = CallFor();
    call.chain = true;
    if (cancelled != nullptr) call.cancelled = [cancelled] { return cancelled->load(); };
    return call;
  }
  // `request` must outlive the reply.
  Started Begin(const v1::StepRequest& request, CallInfo call) {
    Started s;
    s.thread = std::thread([this, &request, call, out = s.out, done = s.done] {
      sequences_->Step("alice", request, Via::kShm, call, [out, done](absl::Status st, StepJob* job) {
        out->status = st;
        if (job != nullptr && st.ok()) {
          out->o = job->o;
          out->lse = job->lse;
        }
        done->Notify();
      });
    });
    return s;
  }
  // The pages the pool has handed out.
  uint64_t PagesUsed() { return sequences_->stats().pages_used(); }
};

TEST_F(ChainTest, AStepBehindTheOneInFlightSeesItsRowsAtEitherLayer) {
  Start();
  const std::vector<std::string> ids = Open(2);
  StepAndVerify(ids, {20, 15}, 0);
  StepAndVerify(ids, {20, 15}, 1);
  for (int next_layer : {0, 1}) {
    SCOPED_TRACE(next_layer);
    gate_->Gate();
    const v1::StepRequest first = MakeStep(ids, {1, 1}, 0), second = MakeStep(ids, {1, 1}, next_layer);
    Started a = Begin(first, Chained());
    while (gate_->held_batch_sizes().empty()) absl::SleepFor(absl::Milliseconds(1));
    Started b = Begin(second, Chained());
    absl::SleepFor(absl::Milliseconds(50));
    EXPECT_FALSE(b.done->HasBeenNotified()) << "launched before the step it follows ended";
    EXPECT_TRUE(Info(ids[0]).step_in_flight());
    EXPECT_EQ(Info(ids[0]).lengths(0), next_layer == 0 ? 20 : 22);  // committed rows only
    // At most one step behind another; a caller that does not pipeline is refused as before.
    const v1::StepRequest third = MakeStep({ids[1]}, {1}, 0);
    Started c = Begin(third, Chained());
    ExpectStatus(c.Await().status, absl::StatusCode::kAborted, "sequences[0].sequence_id: sequence ");
    EXPECT_NE(c.out->status.message().find("two steps in flight"), std::string::npos) << c.out->status;
    ExpectStatus(Run(third).status, absl::StatusCode::kAborted, "sequences[0].sequence_id: sequence ");
    v1::TruncateSequenceRequest t;
    t.set_sequence_id(ids[0]);
    t.set_tokens(1);
    EXPECT_EQ(sequences_->Truncate("alice", t).status().code(), absl::StatusCode::kAborted);
    gate_->Open();
    const Outcome oa = a.Await(), ob = b.Await();
    Record(first);
    Verify(first, oa);
    Record(second);
    Verify(second, ob);
  }
  EXPECT_EQ(Info(ids[0]).lengths(0), 23);
  EXPECT_EQ(Info(ids[0]).lengths(1), 21);
  EXPECT_FALSE(Info(ids[0]).step_in_flight());
  StepAndVerify(ids, {1, 1}, 1);
}

TEST_F(ChainTest, AStepBehindAFailedStepFailsAndLeavesNothing) {
  Start();
  const std::vector<std::string> ids = Open(1);
  StepAndVerify(ids, {20}, 0);  // 2 pages, the second one partly filled
  v1::ForkSequenceRequest fr;
  fr.set_sequence_id(ids[0]);
  absl::StatusOr<v1::ForkSequenceResponse> forked = sequences_->Fork("alice", fr);
  ASSERT_TRUE(forked.ok()) << forked.status();
  const std::string child = forked->sequence_ids(0);
  history_[child] = history_[ids[0]];
  const uint64_t pages = PagesUsed();
  ASSERT_EQ(pages, 2u);
  gate_->Gate();
  // The first step copies the shared page it appends into; the second appends behind it (a new page) at layer 0.
  auto cancelled = std::make_shared<std::atomic<bool>>(false);
  const v1::StepRequest first = MakeStep(ids, {1}, 0), second = MakeStep(ids, {12}, 0);
  Started a = Begin(first, Chained(cancelled));
  while (gate_->held_batch_sizes().empty()) absl::SleepFor(absl::Milliseconds(1));
  Started b = Begin(second, Chained());
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_EQ(PagesUsed(), pages + 2);  // the copy and the page the second step's last rows need
  cancelled->store(true);
  gate_->Open();
  ExpectStatus(a.Await().status, absl::StatusCode::kCancelled, "");
  const Outcome ob = b.Await();
  ExpectStatus(ob.status, absl::StatusCode::kAborted, "the step before it on the same sequences failed");
  // Nothing of either: the lengths, the pages and the shared page as they were, both sequences step on right.
  EXPECT_EQ(Info(ids[0]).lengths(0), 20);
  EXPECT_EQ(PagesUsed(), pages);
  StepAndVerify({child}, {3}, 0);
  StepAndVerify(ids, {3}, 0);
  StepAndVerify({child, ids[0]}, {1, 1}, 0);
}

TEST_F(ChainTest, ClosingASequenceWithTwoStepsInFlightFreesItAfterBoth) {
  Start();
  const std::vector<std::string> ids = Open(1);
  StepAndVerify(ids, {5}, 0);
  gate_->Gate();
  const v1::StepRequest first = MakeStep(ids, {1}, 0), second = MakeStep(ids, {1}, 0);
  Started a = Begin(first, Chained());
  while (gate_->held_batch_sizes().empty()) absl::SleepFor(absl::Milliseconds(1));
  Started b = Begin(second, Chained());
  absl::SleepFor(absl::Milliseconds(20));
  v1::CloseSequenceRequest cr;
  cr.add_sequence_ids(ids[0]);
  ASSERT_TRUE(sequences_->Close("alice", cr).ok());
  EXPECT_EQ(PagesUsed(), 1u);
  gate_->Open();
  EXPECT_TRUE(a.Await().status.ok());
  const Outcome ob = b.Await();
  EXPECT_TRUE(ob.status.ok() || ob.status.code() == absl::StatusCode::kNotFound) << ob.status;
  EXPECT_EQ(PagesUsed(), 0u);
  v1::GetSequenceRequest g;
  g.set_sequence_id(ids[0]);
  EXPECT_EQ(sequences_->Get("alice", g).status().code(), absl::StatusCode::kNotFound);
}

// Ordered by the device: a backend that says each job's GPU work is queued as soon as it has it, in front of one
// worker, so that steps run in the order they were launched (as on one GPU stream behind their words).
class QueuedAtSubmit final : public testing::ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  absl::Status SubmitSteps(std::unique_ptr<server::StepBatch> batch) override {
    for (auto& job : batch->jobs) {
      if (job->enqueued) job->enqueued();
    }
    return ForwardingBackend::SubmitSteps(std::move(batch));
  }
};

class DeviceOrderTest : public ChainTest {
 protected:
  void SetUp() override {
    backend_threads_ = 1;
    wrap_ = [](std::unique_ptr<server::Backend> b) { return std::make_unique<QueuedAtSubmit>(std::move(b)); };
    Start();
  }
  static CallInfo Ordered(uint64_t value, std::function<absl::Status()> outcome = [] { return absl::OkStatus(); }) {
    CallInfo call = Chained();
    call.device_order = CallInfo::DeviceOrder{0, 0, value, std::move(outcome)};
    return call;
  }
  void AwaitHeld(size_t launches) {
    while (gate_->held_batch_sizes().size() < launches) absl::SleepFor(absl::Milliseconds(1));
  }
};

TEST_F(DeviceOrderTest, AStepLaunchesOnceTheOneBeforeItIsQueuedAndEachRunsAlone) {
  const std::vector<std::string> ids = Open(2);
  StepAndVerify(ids, {20, 7}, 0);
  gate_->Gate();
  const v1::StepRequest first = MakeStep(ids, {1, 1}, 0), second = MakeStep(ids, {1, 1}, 0);
  const v1::StepRequest other = MakeStep(Open(1), {3}, 0);
  Started a = Begin(first, Ordered(1));
  AwaitHeld(1);
  Started b = Begin(second, Ordered(2));
  AwaitHeld(2);  // launched while the first is still held: the device keeps their order
  Started c = Begin(other, Ordered(1));
  AwaitHeld(3);  // not batched with them
  EXPECT_EQ(gate_->held_batch_sizes(), std::vector<size_t>({1, 1, 1}));
  gate_->Open();
  const Outcome oa = a.Await(), ob = b.Await();
  ASSERT_TRUE(c.Await().status.ok()) << c.out->status;
  Record(first);
  Verify(first, oa);
  Record(second);
  Verify(second, ob);
  EXPECT_EQ(Info(ids[1]).lengths(0), 9);
}

TEST_F(DeviceOrderTest, WhenTheServerReleasesAWaitTheStepAndTheOneBehindItFailAndLeaveNothing) {
  const std::vector<std::string> ids = Open(1);
  StepAndVerify(ids, {20}, 0);
  v1::ForkSequenceRequest fr;
  fr.set_sequence_id(ids[0]);
  const std::string child = sequences_->Fork("alice", fr)->sequence_ids(0);
  history_[child] = history_[ids[0]];
  const uint64_t pages = PagesUsed();
  gate_->Gate();
  const v1::StepRequest first = MakeStep(ids, {1}, 0), second = MakeStep(ids, {12}, 0);
  // The first step's copy-on-write and the rows of both run: the second one ran on rows never committed.
  Started a = Begin(first, Ordered(1, [] {
    return absl::DeadlineExceededError("order.wait_value: released by the server");
  }));
  AwaitHeld(1);
  Started b = Begin(second, Ordered(2));
  AwaitHeld(2);
  gate_->Open();
  ExpectStatus(a.Await().status, absl::StatusCode::kDeadlineExceeded, "order.wait_value");
  ExpectStatus(b.Await().status, absl::StatusCode::kAborted, "the step before it on the same sequences failed");
  EXPECT_EQ(Info(ids[0]).lengths(0), 20);
  EXPECT_EQ(PagesUsed(), pages);
  StepAndVerify({child}, {3}, 0);
  StepAndVerify(ids, {3}, 0);
}

}  // namespace
}  // namespace attnd::sequences_test
