// Admission and lifecycle: a full queue answers RESOURCE_EXHAUSTED, an expired deadline or a cancelled
// call starts no computation, and a shutdown with requests in flight answers every one of them. A hook on
// the CPU backend holds its single worker so that each situation is set up deterministically.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "server_raw_call.h"
#include "server_test_util.h"

namespace attnd {
namespace {

using testing::ExpectCorrect;
using testing::Gate;
using testing::WaitFor;
using testing::MakeRequest;
using testing::TestServer;

// A Forward call on its own thread.
struct AsyncCall {
  AsyncCall(v1::Attention::Stub* stub, v1::ForwardRequest req,
            std::function<void(grpc::ClientContext&)> setup = nullptr)
      : request(std::move(req)) {
    if (setup) setup(ctx);
    thread = std::thread([this, stub] { status = stub->Forward(&ctx, request, &response); });
  }
  ~AsyncCall() {
    if (thread.joinable()) thread.join();
  }
  void Join() { thread.join(); }

  v1::ForwardRequest request;
  grpc::ClientContext ctx;
  v1::ForwardResponse response;
  grpc::Status status;
  std::thread thread;
};

server::BackendOptions OneWorker(uint32_t max_queue) {
  server::BackendOptions o;
  o.threads = 1;
  o.max_queue = max_queue;
  return o;
}

TEST(Admission, FullQueueIsResourceExhausted) {
  Gate gate;
  TestServer ts({}, OneWorker(1), gate.Hooks());
  ASSERT_NE(ts.server, nullptr);
  auto stub = ts.Stub();
  AsyncCall running(stub.get(), MakeRequest({1, 16, 16, 2, 1, 64}, v1::MASK_TYPE_NONE, false, 1));
  ASSERT_TRUE(WaitFor([&] { return gate.entered() == 1; }));
  AsyncCall queued(stub.get(), MakeRequest({1, 16, 16, 2, 1, 64}, v1::MASK_TYPE_NONE, false, 2));
  ASSERT_TRUE(WaitFor([&] { return ts.cpu->queue_depth() == 1; }));
  // The queue (1) is full and the worker busy: the third is refused at once.
  grpc::ClientContext ctx;
  v1::ForwardResponse resp;
  const grpc::Status s = stub->Forward(&ctx, MakeRequest({1, 16, 16, 2, 1, 64}, v1::MASK_TYPE_NONE, false, 3), &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_NE(s.error_message().find("max_queue"), std::string::npos) << s.error_message();
  gate.Open();
  running.Join();
  queued.Join();
  ASSERT_TRUE(running.status.ok()) << running.status.error_message();
  ASSERT_TRUE(queued.status.ok()) << queued.status.error_message();
  ExpectCorrect(running.request, running.response.o(), running.response.lse());
  ExpectCorrect(queued.request, queued.response.o(), queued.response.lse());
  EXPECT_GT(queued.response.timing().queue_us(), 0);
  EXPECT_EQ(ts.cpu->jobs_computed(), 2u);
}

TEST(Admission, ExpiredDeadlineStartsNoWork) {
  Gate gate;
  TestServer ts({}, OneWorker(8), gate.Hooks());
  ASSERT_NE(ts.server, nullptr);
  auto stub = ts.Stub();
  AsyncCall running(stub.get(), MakeRequest({1, 16, 16, 2, 1, 64}, v1::MASK_TYPE_NONE, false, 1));
  ASSERT_TRUE(WaitFor([&] { return gate.entered() == 1; }));
  // Queued behind the held worker with a 300 ms deadline: it expires while waiting.
  AsyncCall late(stub.get(), MakeRequest({1, 16, 16, 2, 1, 64}, v1::MASK_TYPE_NONE, false, 2),
                 [](grpc::ClientContext& c) {
                   c.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(300));
                 });
  ASSERT_TRUE(WaitFor([&] { return ts.cpu->queue_depth() == 1; }));
  late.Join();
  EXPECT_EQ(late.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  // The server's copy of the deadline runs from when the call reached it, a little after the client's: give
  // it time to expire there too before the worker is released.
  absl::SleepFor(absl::Milliseconds(500));
  gate.Open();
  running.Join();
  ASSERT_TRUE(running.status.ok());
  ASSERT_TRUE(WaitFor([&] { return ts.cpu->in_flight() == 0; }));
  EXPECT_EQ(ts.cpu->jobs_computed(), 1u) << "the expired request was computed";
  EXPECT_EQ(gate.entered(), 1);
  // The server recorded the refusal under Forward.
  grpc::ClientContext ctx;
  v1::ServerStats stats;
  ASSERT_TRUE(stub->GetStats(&ctx, v1::GetStatsRequest(), &stats).ok());
  for (const auto& r : stats.rpcs()) {
    if (r.method() == "Forward") {
      EXPECT_EQ(r.count(), 2u);
      EXPECT_EQ(r.errors_by_code().count("DEADLINE_EXCEEDED") + r.errors_by_code().count("CANCELLED"), 1u);
    }
  }
}

TEST(Admission, CancelledCallStartsNoWork) {
  Gate gate;
  TestServer ts({}, OneWorker(8), gate.Hooks());
  ASSERT_NE(ts.server, nullptr);
  auto stub = ts.Stub();
  AsyncCall running(stub.get(), MakeRequest({1, 16, 16, 2, 1, 64}, v1::MASK_TYPE_NONE, false, 1));
  ASSERT_TRUE(WaitFor([&] { return gate.entered() == 1; }));
  AsyncCall cancelled(stub.get(), MakeRequest({1, 16, 16, 2, 1, 64}, v1::MASK_TYPE_NONE, false, 2));
  ASSERT_TRUE(WaitFor([&] { return ts.cpu->queue_depth() == 1; }));
  cancelled.ctx.TryCancel();
  cancelled.Join();
  EXPECT_EQ(cancelled.status.error_code(), grpc::StatusCode::CANCELLED);
  absl::SleepFor(absl::Milliseconds(500));  // let the cancellation reach the server
  gate.Open();
  running.Join();
  ASSERT_TRUE(running.status.ok());
  ASSERT_TRUE(WaitFor([&] { return ts.cpu->in_flight() == 0; }));
  EXPECT_EQ(ts.cpu->jobs_computed(), 1u) << "the cancelled request was computed";
}

TEST(Shutdown, RequestsInFlightAreAllAnswered) {
  Gate gate;
  TestServer ts({}, OneWorker(64), gate.Hooks());
  ASSERT_NE(ts.server, nullptr);
  auto stub = ts.Stub();
  constexpr int kCalls = 8;
  std::vector<std::unique_ptr<AsyncCall>> calls;
  for (int i = 0; i < kCalls; ++i) {
    calls.push_back(std::make_unique<AsyncCall>(
        stub.get(), MakeRequest({1, 20 + i, 24, 4, 2, 64}, v1::MASK_TYPE_CAUSAL_TOP_LEFT, true, 100 + i)));
  }
  ASSERT_TRUE(WaitFor([&] { return ts.cpu->in_flight() == kCalls; }));

  // Health is watched from before the shutdown: it must turn NOT_SERVING.
  testing::RawResult watch;
  std::thread watcher([&] {
    watch = testing::RawCall(ts.Channel(), "/grpc.health.v1.Health/Watch", testing::HealthRequest(""));
  });
  absl::SleepFor(absl::Milliseconds(100));  // the watch has its first (SERVING) reply

  std::atomic<bool> shutdown_returned{false};
  std::thread stopper([&] {
    ts.server->Shutdown();
    shutdown_returned = true;
  });
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_FALSE(shutdown_returned.load()) << "Shutdown returned with requests unanswered";
  // A new call is refused while the accepted ones wait.
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::ForwardResponse resp;
    const grpc::Status s = stub->Forward(&ctx, MakeRequest({1, 8, 8, 2, 1, 64}), &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  }
  // Health answers NOT_SERVING meanwhile, for the server and for the service.
  for (const std::string service : {"", "attnd.v1.Attention"}) {
    const testing::RawResult r =
        testing::RawCall(ts.Channel(), "/grpc.health.v1.Health/Check", testing::HealthRequest(service));
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();
    ASSERT_EQ(r.messages.size(), 1u);
    EXPECT_EQ(testing::HealthStatus(r.messages[0]), 2) << "service '" << service << "'";
  }
  gate.Open();
  for (auto& c : calls) c->Join();
  stopper.join();
  watcher.join();
  EXPECT_TRUE(shutdown_returned.load());
  for (auto& c : calls) {
    ASSERT_TRUE(c->status.ok()) << c->status.error_message();
    ExpectCorrect(c->request, c->response.o(), c->response.lse());
  }
  EXPECT_EQ(ts.cpu->jobs_computed(), static_cast<uint64_t>(kCalls));
  ASSERT_GE(watch.messages.size(), 1u);
  EXPECT_EQ(testing::HealthStatus(watch.messages[0]), 1);
  ASSERT_EQ(watch.messages.size(), 2u) << "no health update during shutdown";
  EXPECT_EQ(testing::HealthStatus(watch.messages[1]), 2);
  // The server ended the watch when it stopped.
  EXPECT_EQ(watch.status.error_code(), grpc::StatusCode::CANCELLED) << watch.status.error_message();
  EXPECT_TRUE(absl::StrContains(watch.status.error_message(), "shutting down")) << watch.status.error_message();
  ts.server->Wait();   // returns at once: Shutdown completed
  ts.server->Shutdown();  // idempotent
}

TEST(Shutdown, StreamInFlightIsAnswered) {
  Gate gate;
  TestServer ts({}, OneWorker(4), gate.Hooks());
  ASSERT_NE(ts.server, nullptr);
  auto stub = ts.Stub();
  const v1::ForwardRequest r = MakeRequest({1, 64, 64, 4, 1, 128}, v1::MASK_TYPE_NONE, true, 9);
  grpc::ClientContext ctx;
  auto stream = stub->ForwardStream(&ctx);
  v1::ForwardStreamRequest h;
  *h.mutable_header() = r;
  h.mutable_header()->clear_q();
  h.mutable_header()->clear_k();
  h.mutable_header()->clear_v();
  ASSERT_TRUE(stream->Write(h));
  const std::pair<v1::TensorName, const std::string*> parts[] = {
      {v1::TENSOR_NAME_Q, &r.q().data()}, {v1::TENSOR_NAME_K, &r.k().data()}, {v1::TENSOR_NAME_V, &r.v().data()}};
  for (const auto& [name, bytes] : parts) {
    v1::ForwardStreamRequest c;
    c.mutable_chunk()->set_tensor(name);
    c.mutable_chunk()->set_data(*bytes);
    ASSERT_TRUE(stream->Write(c));
  }
  ASSERT_TRUE(stream->WritesDone());
  ASSERT_TRUE(WaitFor([&] { return gate.entered() == 1; }));
  std::thread stopper([&] { ts.server->Shutdown(); });
  absl::SleepFor(absl::Milliseconds(100));
  gate.Open();
  v1::ForwardStreamResponse m;
  std::string o, lse;
  ASSERT_TRUE(stream->Read(&m));
  ASSERT_TRUE(m.has_header());
  while (stream->Read(&m)) (m.chunk().tensor() == v1::TENSOR_NAME_O ? o : lse) += m.chunk().data();
  const grpc::Status s = stream->Finish();
  stopper.join();
  ASSERT_TRUE(s.ok()) << s.error_message();
  ExpectCorrect(r, o, lse);
}

TEST(Shutdown, GraceRunsOutAndTheUnfinishedCallIsCancelledNotHung) {
  // The worker is held past --shutdown_grace: the client gets an error once the grace is spent, not a hang,
  // and the server still stops once the backend lets go.
  Gate gate;
  server::ServerOptions options;
  options.timeouts.shutdown_grace = absl::Milliseconds(300);
  TestServer ts(options, OneWorker(4), gate.Hooks());
  ASSERT_NE(ts.server, nullptr);
  auto stub = ts.Stub();
  AsyncCall call(stub.get(), MakeRequest({1, 8, 8, 2, 1, 64}, v1::MASK_TYPE_NONE, false, 31));
  ASSERT_TRUE(WaitFor([&] { return gate.entered() == 1; }));
  const absl::Time start = absl::Now();
  std::thread stopper([&] { ts.server->Shutdown(); });
  call.Join();
  const absl::Duration waited = absl::Now() - start;
  gate.Open();
  stopper.join();
  EXPECT_FALSE(call.status.ok());
  EXPECT_TRUE(call.status.error_code() == grpc::StatusCode::CANCELLED ||
              call.status.error_code() == grpc::StatusCode::UNAVAILABLE)
      << call.status.error_code() << " " << call.status.error_message();
  EXPECT_GE(waited, absl::Milliseconds(250)) << "cancelled before the grace was spent";
  EXPECT_LT(waited, absl::Seconds(5));
}

TEST(Shutdown, IdleStreamsAndConnectionsDoNotHoldTheExit) {
  // Nothing accepted is in flight: a health Watch, an idle HTTP/2 connection and a TCP connection that never
  // sent a byte must not keep Shutdown waiting for the (long) grace.
  server::ServerOptions options;
  options.timeouts.shutdown_grace = absl::Seconds(20);
  TestServer ts(options, OneWorker(4));
  ASSERT_NE(ts.server, nullptr);
  auto channel = ts.Channel();
  auto stub = v1::Attention::NewStub(channel);
  {
    grpc::ClientContext ctx;
    v1::ServerInfo info;
    ASSERT_TRUE(stub->GetServerInfo(&ctx, v1::GetServerInfoRequest(), &info).ok());
  }
  testing::RawResult watch;
  std::thread watcher([&] {
    watch = testing::RawCall(ts.Channel(), "/grpc.health.v1.Health/Watch", testing::HealthRequest(""), 16,
                             std::chrono::seconds(60));
  });
  const int raw = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(raw, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(ts.server->tcp_port()));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::connect(raw, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  // The watch is open once the server holds a call that is not a Forward: GetStats counts finished calls only,
  // so wait for its first (SERVING) answer through a second watch of our own.
  ASSERT_TRUE(testing::WaitFor([&] {
    const testing::RawResult r = testing::RawCall(ts.Channel(), "/grpc.health.v1.Health/Watch",
                                                  testing::HealthRequest(""), 1, std::chrono::seconds(2));
    return r.messages.size() == 1;
  }));
  absl::SleepFor(absl::Milliseconds(100));  // the watcher's call, started before ours, is open by now
  const absl::Time start = absl::Now();
  ts.server->Shutdown();
  const absl::Duration took = absl::Now() - start;
  watcher.join();
  ::close(raw);
  EXPECT_LT(took, absl::Seconds(2)) << "an idle stream or connection held the shutdown";
  ASSERT_EQ(watch.messages.size(), 2u);
  EXPECT_EQ(testing::HealthStatus(watch.messages[0]), 1);
  EXPECT_EQ(testing::HealthStatus(watch.messages[1]), 2) << "the watch did not see NOT_SERVING";
  EXPECT_EQ(watch.status.error_code(), grpc::StatusCode::CANCELLED) << watch.status.error_message();
  EXPECT_TRUE(absl::StrContains(watch.status.error_message(), "shutting down")) << watch.status.error_message();
}

TEST(Shutdown, BackendDrainsItsQueue) {
  // Directly on the backend: Shutdown runs every queued job's done, and Submit afterwards is UNAVAILABLE.
  Gate gate;
  server::CpuBackend backend(OneWorker(16), gate.Hooks());
  std::vector<v1::ForwardRequest> requests;
  for (int i = 0; i < 5; ++i) requests.push_back(MakeRequest({1, 10, 12, 2, 2, 64}, v1::MASK_TYPE_NONE, false, 50 + i));
  std::atomic<int> ok{0};
  std::vector<std::string> outputs(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    auto job = std::make_unique<server::ForwardJob>();
    job->problem = testing::ProblemOf(requests[i]);
    const Layout L = ContiguousLayout(job->problem.shape);
    for (auto [src, in, strides] : {std::tuple{&job->q, &requests[i].q(), L.q}, std::tuple{&job->k, &requests[i].k(), L.k},
                                    std::tuple{&job->v, &requests[i].v(), L.v}}) {
      src->host = reinterpret_cast<const uint8_t*>(in->data().data());
      src->host_bytes = in->data().size();
      src->strides = strides;
    }
    job->accepted = absl::Now();
    server::ForwardJob* j = job.get();
    job->done = [&, i, j](absl::Status s) {
      if (s.ok()) ok.fetch_add(1);
      outputs[i] = std::move(j->o);
    };
    ASSERT_TRUE(backend.Submit(std::move(job)).ok());
  }
  std::thread stopper([&] { backend.Shutdown(); });
  ASSERT_TRUE(WaitFor([&] { return gate.entered() == 1; }));
  gate.Open();
  stopper.join();
  EXPECT_EQ(ok.load(), 5);
  for (size_t i = 0; i < requests.size(); ++i) ExpectCorrect(requests[i], outputs[i], "");
  EXPECT_EQ(backend.in_flight(), 0u);
  EXPECT_TRUE(absl::IsUnavailable(backend.Submit(std::make_unique<server::ForwardJob>())));
}

TEST(Admission, WorkingMemoryOverBudgetIsResourceExhausted) {
  // The reference widens one head's K and V to fp32 per thread: with a tiny budget a long kv_len is refused
  // cleanly instead of failing an allocation inside a compute thread.
  server::BackendOptions o = OneWorker(4);
  o.memory_budget_bytes = 64 * 1024;
  server::CpuBackend backend(o);
  const v1::ForwardRequest r = MakeRequest({1, 4, 1024, 1, 1, 64}, v1::MASK_TYPE_NONE, false, 5);
  auto job = std::make_unique<server::ForwardJob>();
  job->problem = testing::ProblemOf(r);
  const Layout L = ContiguousLayout(job->problem.shape);
  job->q = {reinterpret_cast<const uint8_t*>(r.q().data().data()), r.q().data().size(), "", 0, L.q, {}};
  job->k = {reinterpret_cast<const uint8_t*>(r.k().data().data()), r.k().data().size(), "", 0, L.k, {}};
  job->v = {reinterpret_cast<const uint8_t*>(r.v().data().data()), r.v().data().size(), "", 0, L.v, {}};
  job->accepted = absl::Now();
  absl::Notification done;
  absl::Status status;
  job->done = [&](absl::Status s) {
    status = s;
    done.Notify();
  };
  ASSERT_TRUE(backend.Submit(std::move(job)).ok());
  done.WaitForNotification();
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_EQ(status.message().substr(0, 13), "shape.kv_len:") << status;
  EXPECT_EQ(backend.jobs_computed(), 0u);
}

}  // namespace
}  // namespace attnd
