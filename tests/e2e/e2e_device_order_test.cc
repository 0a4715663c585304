// Steps ordered by the device (StreamOrder.device) without a GPU: a backend that does on its host what the CUDA
// backend queues on a stream (wait for the channel's wait word, run, write the done word), behind a real server and
// its shared-memory channels. The pipelined pattern a caller's stream produces over two channels (the second step
// sent once the first shows in its channel's admitted word, admitted behind it, each running once its word comes),
// and a word that never comes (the server writes it itself, the step fails, nothing is kept).
#include <unistd.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "attnd/client/shm_channel.h"
#include "e2e_sequences_util.h"
#include "e2e_util.h"
#include "forwarding_backend.h"
#include "gtest/gtest.h"

namespace attnd::e2e {
namespace {

// The CUDA backend's device order, played on the host: each device-ordered step is taken on a thread of its own,
// reported queued at once (as a stream takes it), held until its word holds its value, run on the CPU backend, and
// followed by the write of its done word. Its "device addresses" are the host's.
class HostPlaysDevice final : public testing::ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  ~HostPlaysDevice() override {
    std::vector<std::thread> streams;
    {
      absl::MutexLock lock(&mu_);
      streams.swap(streams_);
    }
    for (std::thread& t : streams) t.join();
  }
  bool device_order() const override { return true; }
  absl::StatusOr<MappedHostMemory> MapHostMemory(void* page, size_t bytes) override {
    (void)bytes;
    return MappedHostMemory{reinterpret_cast<uint64_t>(page), nullptr};
  }
  absl::Status SubmitSteps(std::unique_ptr<server::StepBatch> batch) override {
    server::StepJob& job = *batch->jobs.front();
    if (!job.device_order.has_value()) return ForwardingBackend::SubmitSteps(std::move(batch));
    EXPECT_EQ(batch->jobs.size(), 1u) << "a device-ordered step runs alone";
    const server::StepJob::DeviceOrder order = *job.device_order;
    job.done = [done = std::move(job.done), order](absl::Status s) {
      reinterpret_cast<std::atomic<uint64_t>*>(order.done_word)->store(order.value);
      done(std::move(s));
    };
    if (job.enqueued) job.enqueued();
    // Steps of different channels are submitted from different server threads.
    absl::MutexLock lock(&mu_);
    streams_.emplace_back([this, order, b = std::shared_ptr<server::StepBatch>(std::move(batch))]() mutable {
      const auto* word = reinterpret_cast<const std::atomic<uint64_t>*>(order.wait_word);
      while (static_cast<int64_t>(word->load() - order.value) < 0) absl::SleepFor(absl::Microseconds(100));
      auto run = std::make_unique<server::StepBatch>();
      run->jobs = std::move(b->jobs);
      ASSERT_TRUE(ForwardingBackend::SubmitSteps(std::move(run)).ok());
    });
    return absl::OkStatus();
  }

 private:
  absl::Mutex mu_;
  std::vector<std::thread> streams_ ABSL_GUARDED_BY(mu_);
};

class DeviceOrder : public ::testing::Test {
 protected:
  void SetUp() override {
    so_.network.listen = "127.0.0.1:0";
    so_.network.unix_socket = absl::StrCat(::testing::TempDir(), "/attnd_dorder_", ::getpid(), ".sock");
    so_.shm.socket = absl::StrCat(::testing::TempDir(), "/attnd_dorder_", ::getpid(), ".shm");
    so_.sequences.order_timeout = absl::Milliseconds(300);
    server::BackendOptions bo;
    // A worker for each step in flight (one, and the one admitted behind it): on a GPU each step that reports
    // itself queued holds its stream, but here it still needs a worker once its word comes. The step behind may
    // run first (the server released its word before the other's) and its end waits on its worker for the one
    // before it; with one worker, that one would never run.
    bo.threads = 2;
    auto cpu = server::MakeBackend("cpu", bo);
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    auto srv = server::Server::Create(so_, std::make_unique<HostPlaysDevice>(std::move(*cpu)));
    ASSERT_TRUE(srv.ok()) << srv.status();
    server_ = std::move(*srv);
    client_ = Connect(absl::StrCat("unix:", so_.network.unix_socket));
    for (auto& ch : channels_) {
      client::ShmChannelOptions co;
      co.socket_path = so_.shm.socket;
      auto c = client::ShmChannel::Connect(co);
      ASSERT_TRUE(c.ok()) << c.status();
      ch = std::move(*c);
    }
  }
  void TearDown() override {
    for (auto& ch : channels_) ch.reset();
    if (server_ != nullptr) server_->Shutdown();
  }
  static v1::StepRequest Ordered(const OneTokenStep& step, uint64_t value) {
    auto made = client::MakeStepRequest(step.spec);
    EXPECT_TRUE(made.ok()) << made.status();
    v1::StepRequest r = *std::move(made);
    r.mutable_order()->set_wait_value(value);
    r.mutable_order()->set_device(true);
    return r;
  }
  static void AwaitWord(const std::atomic<uint64_t>* word, uint64_t value) {
    const absl::Time give_up = absl::Now() + absl::Seconds(10);
    while (word->load() < value && absl::Now() < give_up) absl::SleepFor(absl::Microseconds(100));
    ASSERT_GE(word->load(), value);
  }

  server::ServerOptions so_;
  std::unique_ptr<server::Server> server_;
  std::unique_ptr<client::Client> client_;
  std::unique_ptr<client::ShmChannel> channels_[2];
};

TEST_F(DeviceOrder, TwoChannelsCarryAStreamsStepsAndEachRunsWhenItsWordComes) {
  auto info = client_->ServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_TRUE(info->device_ordered_steps());
  const client::SequenceShape shape = TestShape(1);
  auto opened = client_->OpenSequence(shape);
  ASSERT_TRUE(opened.ok()) << opened.status();
  const std::string id = opened->ids[0];
  const OneTokenStep first(shape, id, 10), second(shape, id, 20);
  absl::StatusOr<v1::StepResponse> got[2];
  // The stream's first step on channel 0; its second on channel 1 once the first is in (the admitted word).
  std::thread a([&] { got[0] = channels_[0]->Step(Ordered(first, 1)); });
  AwaitWord(channels_[0]->admitted_word(), 1);
  std::thread b([&] { got[1] = channels_[1]->Step(Ordered(second, 2)); });
  AwaitWord(channels_[1]->admitted_word(), 2);  // admitted behind the first, launched: both wait for their words
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(channels_[0]->done_word()->load(), 0u);
  EXPECT_EQ(channels_[1]->done_word()->load(), 0u);
  // The caller's stream: the first step's producers are done; the second's only after the first's done word.
  channels_[0]->wait_word()->store(1);
  AwaitWord(channels_[0]->done_word(), 1);
  EXPECT_EQ(channels_[1]->done_word()->load(), 0u);
  channels_[1]->wait_word()->store(2);
  AwaitWord(channels_[1]->done_word(), 2);
  a.join();
  b.join();
  ASSERT_TRUE(got[0].ok()) << got[0].status();
  ASSERT_TRUE(got[1].ok()) << got[1].status();
  EXPECT_EQ(got[0]->lengths(0), 1);
  EXPECT_EQ(got[1]->lengths(0), 2);
  EXPECT_EQ(CheckRows(shape, kQHeads, first.q, first.k, first.v, got[0]->o(), "", false), "");
  EXPECT_EQ(CheckRows(shape, kQHeads, second.q, first.k + second.k, first.v + second.v, got[1]->o(), "", false), "");
}

TEST_F(DeviceOrder, AWordThatNeverComesIsWrittenByTheServerAndTheStepsFailWithNothingKept) {
  const client::SequenceShape shape = TestShape(1);
  auto opened = client_->OpenSequence(shape);
  ASSERT_TRUE(opened.ok()) << opened.status();
  const std::string id = opened->ids[0];
  const OneTokenStep first(shape, id, 30), second(shape, id, 40);
  absl::StatusOr<v1::StepResponse> got[2];
  std::thread a([&] { got[0] = channels_[0]->Step(Ordered(first, 1)); });
  AwaitWord(channels_[0]->admitted_word(), 1);
  std::thread b([&] { got[1] = channels_[1]->Step(Ordered(second, 2)); });
  a.join();
  // The producer never wrote the first step's word: the server did, after --step_order_timeout_s.
  EXPECT_EQ(got[0].status().code(), absl::StatusCode::kDeadlineExceeded) << got[0].status();
  EXPECT_TRUE(absl::StrContains(got[0].status().message(), "order.wait_value")) << got[0].status();
  EXPECT_EQ(channels_[0]->wait_word()->load(), 1u);
  channels_[1]->wait_word()->store(2);
  b.join();
  EXPECT_EQ(got[1].status().code(), absl::StatusCode::kAborted) << got[1].status();
  auto seq = client_->GetSequence(id);
  ASSERT_TRUE(seq.ok()) << seq.status();
  EXPECT_EQ(seq->lengths(0), 0);
  EXPECT_FALSE(seq->step_in_flight());
  // The channels serve on.
  const OneTokenStep third(shape, id, 50);
  channels_[0]->wait_word()->store(3);
  auto ok = channels_[0]->Step(Ordered(third, 3));
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->lengths(0), 1);
  EXPECT_EQ(CheckRows(shape, kQHeads, third.q, third.k, third.v, ok->o(), "", false), "");
}

}  // namespace
}  // namespace attnd::e2e
