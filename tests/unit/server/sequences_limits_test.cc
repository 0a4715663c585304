// The limits of the KV-sequence core (Sequences) on the CPU backend: the page pool (full, and its memory on the
// way back), a step's messages, each client's share, one step in flight per sequence, the launches that steps of
// one layer join, and shutdown with steps waiting.
#include "attnd/server/sequences.h"

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "forwarding_backend.h"
#include "gtest/gtest.h"
#include "sequences_fixture.h"

namespace attnd::sequences_test {
namespace {

TEST_F(SequencesTest, PoolFullIsResourceExhaustedAndEvictsNothing) {
  SequenceOptions o;
  // Room for 10 pages of this shape: 16 tokens x 2 heads x 64 x 2 bytes x 2 (K, V) x 3 layers each.
  o.pool_bytes = 10 * 16 * kKvHeads * kHeadDim * 2 * 2 * kLayers;
  Start(o);
  const std::vector<std::string> ids = Open(2);
  StepAndVerify({ids[0]}, {100}, 0);  // 7 pages
  const uint64_t used = sequences_->stats().pages_used();
  EXPECT_EQ(used, 7u);
  // 4 more pages do not fit; the first sequence of the batch fits, and must be rolled back with the rest.
  const v1::StepRequest r = MakeStep({ids[1], ids[0]}, {40, 20}, 0);
  const Outcome out = Run(r);
  ExpectStatus(out.status, absl::StatusCode::kResourceExhausted, "kv pool");
  EXPECT_EQ(sequences_->stats().pages_used(), used);
  EXPECT_EQ(Info(ids[1]).pages(), 0);
  // The live sequence is intact and keeps working.
  StepAndVerify({ids[0]}, {1}, 0);
  EXPECT_EQ(Info(ids[0]).lengths(0), 101);
}

// The refusal says what the step needs against what is free, and names the flag that sizes the pool.
TEST_F(SequencesTest, PoolFullSaysWhatTheStepNeedsAndNamesTheFlag) {
  SequenceOptions o;
  o.pool_bytes = 10 * 16 * kKvHeads * kHeadDim * 2 * 2 * kLayers;  // 10 pages
  Start(o);
  const std::vector<std::string> ids = Open(2);
  StepAndVerify({ids[0]}, {100}, 0);  // 7 pages
  // 60 tokens need 4 pages; 3 are free.
  const Outcome short_of = Run(MakeStep({ids[1]}, {60}, 0));
  ExpectStatus(short_of.status, absl::StatusCode::kResourceExhausted, "kv pool");
  EXPECT_TRUE(absl::StrContains(short_of.status.message(), "needs 4 pages, 3 of the pool's 10 are free"))
      << short_of.status;
  EXPECT_FALSE(absl::StrContains(short_of.status.message(), "all 10 pages")) << short_of.status;
  EXPECT_TRUE(absl::StrContains(short_of.status.message(), "--kv_pool_mb")) << short_of.status;
  StepAndVerify({ids[1]}, {48}, 0);  // the last 3
  const Outcome none = Run(MakeStep({ids[1]}, {1}, 0));
  ExpectStatus(none.status, absl::StatusCode::kResourceExhausted, "kv pool");
  EXPECT_TRUE(absl::StrContains(none.status.message(), "all 10 pages are in use")) << none.status;
  EXPECT_TRUE(absl::StrContains(none.status.message(), "--kv_pool_mb")) << none.status;
  // A pool too small for one page names the flag too.
  TearDown();
  o.pool_bytes = 1000;
  Start(o);
  v1::OpenSequenceRequest r;
  r.mutable_shape()->set_layers(kLayers);
  r.mutable_shape()->set_kv_heads(kKvHeads);
  r.mutable_shape()->set_head_dim(kHeadDim);
  r.mutable_shape()->set_dtype(v1::DTYPE_BF16);
  const absl::Status tiny = sequences_->Open("alice", r).status();
  ExpectStatus(tiny, absl::StatusCode::kResourceExhausted, "kv pool");
  EXPECT_TRUE(absl::StrContains(tiny.message(), "--kv_pool_mb")) << tiny;
  EXPECT_FALSE(absl::StrContains(tiny.message(), "--kv_pool_bytes")) << tiny;
}

// Over gRPC a step's request (Q, K, V) and its reply (O, LSE) are two messages, each held to --max_message_bytes
// on its own; --max_request_bytes bounds all of them together.
TEST_F(SequencesTest, RequestAndReplyEachFitOneMessage) {
  limits_.max_message_bytes = 1 << 20;  // 983,040 bytes of tensors after the framing allowance
  Start();
  const std::vector<std::string> ids = Open(1);
  // Per row: Q and O 1,024 bytes each, K and V 256 each, LSE 32. 600 rows: a request of 921,600 bytes and a reply
  // of 633,600, 1,555,200 together.
  const v1::StepRequest both = MakeStep(ids, {600}, 0);
  const Outcome fits = Run(both, "alice", Via::kUnary);
  ASSERT_TRUE(fits.status.ok()) << fits.status;
  Record(both);
  Verify(both, fits);
  // 700 rows: a request of 1,075,200 bytes.
  const Outcome big_request = Run(MakeStep(ids, {700}, 0), "alice", Via::kUnary);
  ExpectStatus(big_request.status, absl::StatusCode::kResourceExhausted, "sequences:");
  EXPECT_TRUE(absl::StrContains(big_request.status.message(), "request")) << big_request.status;
  EXPECT_TRUE(absl::StrContains(big_request.status.message(), "1075200")) << big_request.status;
  EXPECT_TRUE(absl::StrContains(big_request.status.message(), "--max_message_bytes=1048576")) << big_request.status;
  // Attending without appending, 950 rows: a request of 972,800 bytes (Q) and a reply of 1,003,200 (O and LSE).
  const v1::StepRequest more = MakeStep(ids, {400}, 0, /*append=*/true, /*attend=*/false);
  ASSERT_TRUE(Run(more, "alice", Via::kUnary).status.ok());
  Record(more);
  const Outcome big_reply = Run(MakeStep(ids, {950}, 0, /*append=*/false), "alice", Via::kUnary);
  ExpectStatus(big_reply.status, absl::StatusCode::kResourceExhausted, "sequences:");
  EXPECT_TRUE(absl::StrContains(big_reply.status.message(), "reply")) << big_reply.status;
  EXPECT_TRUE(absl::StrContains(big_reply.status.message(), "1003200")) << big_reply.status;
  EXPECT_TRUE(absl::StrContains(big_reply.status.message(), "--max_message_bytes=1048576")) << big_reply.status;
  // Not over gRPC (the shared-memory channel): no message limit.
  EXPECT_TRUE(Run(MakeStep(ids, {950}, 0, /*append=*/false), "alice", Via::kShm).status.ok());
  EXPECT_EQ(Info(ids[0]).lengths(0), 1000);

  // The sum is --max_request_bytes's, on every transport.
  TearDown();
  limits_ = StepLimits();
  limits_.max_request_bytes = 1 << 20;
  Start();
  const std::vector<std::string> again = Open(1);
  const Outcome total = Run(MakeStep(again, {600}, 0), "alice", Via::kShm);
  ExpectStatus(total.status, absl::StatusCode::kResourceExhausted, "sequences:");
  EXPECT_TRUE(absl::StrContains(total.status.message(), "1555200")) << total.status;
  EXPECT_TRUE(absl::StrContains(total.status.message(), "--max_request_bytes=1048576")) << total.status;
}

// Pool memory as the CUDA backend has it: one budget, so a pool is refused while an earlier one is still alive,
// and a step's job keeps its pool for `linger` after the step's reply, as a CUDA job does until its batch's GPU
// work is over.
class OnePoolBudget final : public testing::ForwardingBackend {
 public:
  OnePoolBudget(std::unique_ptr<server::Backend> inner, absl::Duration linger)
      : ForwardingBackend(std::move(inner)), linger_(linger) {}
  ~OnePoolBudget() override {
    for (std::thread& t : lingering_) t.join();
  }
  absl::StatusOr<std::shared_ptr<server::KvPool>> MakeKvPool(const server::SequenceShape& shape, int page_tokens,
                                                             int32_t num_pages) override {
    absl::MutexLock lock(&mu_);
    if (!last_.expired()) return absl::ResourceExhaustedError("budget exhausted: an earlier pool is still held");
    absl::StatusOr<std::shared_ptr<server::KvPool>> pool = ForwardingBackend::MakeKvPool(shape, page_tokens, num_pages);
    if (pool.ok()) last_ = *pool;
    return pool;
  }
  absl::Status SubmitSteps(std::unique_ptr<server::StepBatch> batch) override {
    for (std::unique_ptr<StepJob>& job : batch->jobs) {
      job->done = [this, pool = job->pool, done = std::move(job->done)](absl::Status s) mutable {
        done(std::move(s));
        absl::MutexLock lock(&mu_);
        lingering_.emplace_back([pool = std::move(pool), linger = linger_]() mutable {
          absl::SleepFor(linger);
          pool.reset();
        });
      };
    }
    return ForwardingBackend::SubmitSteps(std::move(batch));
  }

 private:
  const absl::Duration linger_;
  absl::Mutex mu_;
  std::weak_ptr<server::KvPool> last_;
  std::vector<std::thread> lingering_;
};

// Closing a shape's last sequence gives its pool back once the last step that ran on it is dropped, which may be
// after that step's reply: an open right then waits for the memory instead of being refused for it.
TEST_F(SequencesTest, AnOpenWaitsForPoolMemoryOnItsWayBack) {
  wrap_ = [](std::unique_ptr<server::Backend> inner) {
    return std::make_unique<OnePoolBudget>(std::move(inner), absl::Milliseconds(200));
  };
  Start();
  const std::vector<std::string> first = Open(1);
  ASSERT_EQ(first.size(), 1u);
  StepAndVerify(first, {3}, 0);
  v1::CloseSequenceRequest close;
  close.add_sequence_ids(first[0]);
  ASSERT_TRUE(sequences_->Close("alice", close).ok());
  const absl::Time start = absl::Now();
  const std::vector<std::string> second = Open(1);
  ASSERT_EQ(second.size(), 1u);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  StepAndVerify(second, {2}, 0);
}

TEST_F(SequencesTest, PerClientLimits) {
  SequenceOptions o;
  o.max_per_client = 2;
  o.max_pages_per_client = 3;
  Start(o);
  const std::vector<std::string> ids = Open(2);
  v1::OpenSequenceRequest r;
  r.mutable_shape()->set_layers(kLayers);
  r.mutable_shape()->set_kv_heads(kKvHeads);
  r.mutable_shape()->set_head_dim(kHeadDim);
  r.mutable_shape()->set_dtype(v1::DTYPE_BF16);
  ExpectStatus(sequences_->Open("alice", r).status(), absl::StatusCode::kResourceExhausted, "count:");
  EXPECT_TRUE(sequences_->Open("bob", r).ok());  // another client is not affected
  StepAndVerify({ids[0]}, {40}, 0);  // 3 pages
  ExpectStatus(Run(MakeStep({ids[1]}, {1}, 0)).status, absl::StatusCode::kResourceExhausted, "kv pool");
}

TEST_F(SequencesTest, OneStepInFlightPerSequenceAndDeferredClose) {
  Start();
  const std::vector<std::string> ids = Open(2);
  StepAndVerify(ids, {1, 1}, 0);
  gate_->Gate();
  const v1::StepRequest first = MakeStep({ids[0]}, {1}, 0);
  auto first_out = std::make_shared<Outcome>();
  absl::Notification first_done;
  sequences_->Step("alice", first, Via::kShm, CallFor(), [&](absl::Status s, StepJob* job) {
    first_out->status = s;
    if (job != nullptr) first_out->o = job->o;
    first_done.Notify();
  });
  ASSERT_TRUE(testing::WaitFor([&] { return gate_->held_batch_sizes().size() == 1; }));
  // A second step of the same sequence, a fork and a truncate are refused while the first runs.
  ExpectStatus(Run(MakeStep({ids[0]}, {1}, 1)).status, absl::StatusCode::kAborted, "sequences[0].sequence_id:");
  v1::ForkSequenceRequest fr;
  fr.set_sequence_id(ids[0]);
  ExpectStatus(sequences_->Fork("alice", fr).status(), absl::StatusCode::kAborted, "sequence_id:");
  EXPECT_TRUE(Info(ids[0]).step_in_flight());
  // Closing it now is deferred: it is gone for callers at once, its pages return when the step ends.
  v1::CloseSequenceRequest close;
  close.add_sequence_ids(ids[0]);
  ASSERT_TRUE(sequences_->Close("alice", close).ok());
  EXPECT_EQ(sequences_->stats().open(), 2u);
  gate_->Open();
  first_done.WaitForNotification();
  EXPECT_TRUE(first_out->status.ok()) << first_out->status;
  EXPECT_EQ(sequences_->stats().open(), 1u);
  v1::GetSequenceRequest g;
  g.set_sequence_id(ids[0]);
  EXPECT_EQ(sequences_->Get("alice", g).status().code(), absl::StatusCode::kNotFound);
  StepAndVerify({ids[1]}, {2}, 0);
}

TEST_F(SequencesTest, ConcurrentStepsOfOneLayerJoinOneLaunch) {
  SequenceOptions o;
  o.launches_in_flight = 1;
  Start(o);
  const std::vector<std::string> ids = Open(4);
  StepAndVerify(ids, {3, 3, 3, 3}, 0);
  gate_->Gate();
  // The first launches alone (nothing was running); the three that arrive while it runs wait and then go
  // together.
  StepsInFlight f = StepEach(ids);
  EXPECT_EQ(gate_->held_batch_sizes(), std::vector<size_t>{1});
  EXPECT_EQ(sequences_->waiting(), 3u);
  gate_->Open();
  f.Await();
  EXPECT_EQ(f.outs[0]->batch_requests, 1u);
  for (int i = 1; i < 4; ++i) {
    EXPECT_EQ(f.outs[i]->batch_requests, 3u);
    EXPECT_EQ(f.outs[i]->batch_sequences, 3u);
  }
  for (int i = 0; i < 4; ++i) {
    Record(f.steps[i]);
    Verify(f.steps[i], *f.outs[i]);
  }
  EXPECT_EQ(sequences_->stats().launches(), 3u);  // the first verified step, the lone one, the joined three
}

TEST_F(SequencesTest, TwoLaunchesOfOneLayerRunAtOnceAndTheRestJoinTheNext) {
  SequenceOptions o;
  o.launches_in_flight = 2;
  Start(o);
  const std::vector<std::string> ids = Open(5);
  StepAndVerify(ids, {3, 3, 3, 3, 3}, 0);
  gate_->Gate();
  StepsInFlight f = StepEach(ids);
  // The first two launch at once, each alone; the three that arrive while both run wait for one of them.
  EXPECT_EQ(gate_->held_batch_sizes(), (std::vector<size_t>{1, 1}));
  EXPECT_EQ(sequences_->waiting(), 3u);
  gate_->Open();
  f.Await();
  for (int i = 0; i < 5; ++i) {
    ASSERT_TRUE(f.outs[i]->status.ok()) << i << ": " << f.outs[i]->status;
    EXPECT_EQ(f.outs[i]->batch_requests, i < 2 ? 1u : 3u) << i;
    Record(f.steps[i]);
    Verify(f.steps[i], *f.outs[i]);
  }
  EXPECT_EQ(sequences_->stats().launches(), 4u);  // the first verified step, the two alone, the joined three
  EXPECT_EQ(sequences_->limits().launches_in_flight(), 2u);
}

TEST_F(SequencesTest, ShutdownAnswersWaitingStepsAndRefusesNewOnes) {
  Start();
  const std::vector<std::string> ids = Open(2);
  gate_->Gate();
  absl::Notification a, b;
  absl::Status sa, sb;
  sequences_->Step("alice", MakeStep({ids[0]}, {2}, 0), Via::kShm, CallFor(), [&](absl::Status s, StepJob*) {
    sa = s;
    a.Notify();
  });
  sequences_->Step("alice", MakeStep({ids[1]}, {2}, 0), Via::kShm, CallFor(), [&](absl::Status s, StepJob*) {
    sb = s;
    b.Notify();
  });
  std::thread opener([&] {
    absl::SleepFor(absl::Milliseconds(50));
    gate_->Open();
  });
  sequences_->Shutdown();  // returns once both are answered
  EXPECT_TRUE(a.HasBeenNotified() && b.HasBeenNotified());
  EXPECT_TRUE(sa.ok()) << sa;
  EXPECT_TRUE(sb.ok()) << sb;
  opener.join();
  ExpectStatus(Run(MakeStep({ids[0]}, {1}, 0)).status, absl::StatusCode::kUnavailable, "the server is shutting down");
}

}  // namespace
}  // namespace attnd::sequences_test
