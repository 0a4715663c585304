// The Attention service in-process over loopback TCP and a unix socket, called with the generated stub:
// correct results, an idle connection's close, health, reflection, GetServerInfo and GetStats, the queue's
// deadlines, and what Create and MakeBackend refuse. ForwardStream has server_stream_test.cc.
#include <unistd.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "server_raw_call.h"
#include "server_test_util.h"

namespace attnd {
namespace {

using testing::ExpectCorrect;
using testing::MakeRequest;
using testing::TestServer;

struct FwdCase {
  Shape shape;
  v1::MaskType mask;
  bool lse;
  v1::Dtype dtype;
};

TEST(ServerForward, CorrectOverTcp) {
  TestServer ts;
  ASSERT_NE(ts.server, nullptr);
  auto stub = ts.Stub();
  const FwdCase cases[] = {
      {{1, 1, 1, 1, 1, 64}, v1::MASK_TYPE_NONE, false, v1::DTYPE_BF16},
      {{2, 65, 65, 8, 2, 128}, v1::MASK_TYPE_CAUSAL_TOP_LEFT, true, v1::DTYPE_BF16},
      {{1, 127, 64, 8, 1, 64}, v1::MASK_TYPE_CAUSAL_BOTTOM_RIGHT, true, v1::DTYPE_BF16},  // fully masked rows
      {{2, 17, 100, 4, 4, 64}, v1::MASK_TYPE_CAUSAL_BOTTOM_RIGHT, true, v1::DTYPE_BF16},
      {{1, 33, 47, 4, 1, 256}, v1::MASK_TYPE_NONE, true, v1::DTYPE_FP16},
  };
  uint64_t seed = 10;
  for (const FwdCase& c : cases) {
    SCOPED_TRACE(seed);
    const v1::ForwardRequest r = MakeRequest(c.shape, c.mask, c.lse, ++seed, c.dtype);
    grpc::ClientContext ctx;
    v1::ForwardResponse resp;
    const grpc::Status s = stub->Forward(&ctx, r, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    ExpectCorrect(r, resp.o(), resp.lse());
    EXPECT_EQ(resp.request_id(), r.request_id());
    EXPECT_EQ(resp.backend(), "cpu");
    EXPECT_EQ(resp.kernel(), server::CpuBackend::kKernelName);
    EXPECT_EQ(resp.device(), -1);
    EXPECT_GT(resp.timing().kernel_us(), 0);
    EXPECT_GE(resp.timing().total_us(), resp.timing().kernel_us() + resp.timing().queue_us());
  }
  // A custom scale is honoured (and differs from the default).
  v1::ForwardRequest r = MakeRequest({1, 20, 20, 2, 2, 64}, v1::MASK_TYPE_NONE, true, 99);
  r.set_softmax_scale(0.9f);
  grpc::ClientContext ctx;
  v1::ForwardResponse resp;
  ASSERT_TRUE(stub->Forward(&ctx, r, &resp).ok());
  ExpectCorrect(r, resp.o(), resp.lse());
  v1::ForwardRequest d = r;
  d.clear_softmax_scale();
  grpc::ClientContext ctx2;
  v1::ForwardResponse resp2;
  ASSERT_TRUE(stub->Forward(&ctx2, d, &resp2).ok());
  EXPECT_NE(resp.o(), resp2.o());
}

TEST(ServerForward, CorrectOverUnixSocket) {
  server::ServerOptions o;
  o.network.listen = "";
  o.network.unix_socket = "/tmp/attnd_test_" + std::to_string(::getpid()) + ".sock";
  TestServer ts(o);
  ASSERT_NE(ts.server, nullptr);
  EXPECT_EQ(ts.server->tcp_port(), 0);
  auto stub = ts.Stub("unix:" + o.network.unix_socket);
  const v1::ForwardRequest r = MakeRequest({2, 40, 70, 4, 2, 128}, v1::MASK_TYPE_CAUSAL_BOTTOM_RIGHT, true, 5);
  grpc::ClientContext ctx;
  v1::ForwardResponse resp;
  const grpc::Status s = stub->Forward(&ctx, r, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ExpectCorrect(r, resp.o(), resp.lse());
  ts.server->Shutdown();
  EXPECT_NE(::access(o.network.unix_socket.c_str(), F_OK), 0) << "socket file left behind";
}

TEST(ServerForward, SixteenConcurrentClientsAllCorrect) {
  server::BackendOptions bo;
  bo.threads = 2;
  TestServer ts({}, bo);
  ASSERT_NE(ts.server, nullptr);
  std::atomic<int> correct{0};
  std::vector<std::thread> clients;
  for (int c = 0; c < 16; ++c) {
    clients.emplace_back([&, c] {
      auto stub = ts.Stub();  // own channel each: 16 connections
      const v1::MaskType masks[3] = {v1::MASK_TYPE_NONE, v1::MASK_TYPE_CAUSAL_TOP_LEFT,
                                     v1::MASK_TYPE_CAUSAL_BOTTOM_RIGHT};
      for (int i = 0; i < 3; ++i) {
        const v1::ForwardRequest r = MakeRequest({1, 30 + c, 50 + i, 4, 1, 64}, masks[i], true, 1000 + c * 10 + i);
        grpc::ClientContext ctx;
        v1::ForwardResponse resp;
        const grpc::Status s = stub->Forward(&ctx, r, &resp);
        EXPECT_TRUE(s.ok()) << s.error_message();
        if (!s.ok()) return;
        ExpectCorrect(r, resp.o(), resp.lse());
        if (!::testing::Test::HasFailure()) correct.fetch_add(1);
      }
    });
  }
  for (auto& t : clients) t.join();
  EXPECT_EQ(correct.load(), 48);
}

TEST(ServerConnections, AnIdleConnectionIsClosedAndTheClientReconnects) {
  server::ServerOptions opts;
  opts.timeouts.max_connection_idle = absl::Milliseconds(300);
  TestServer ts(opts);
  ASSERT_NE(ts.server, nullptr);
  auto channel = ts.Channel();
  auto stub = v1::Attention::NewStub(channel);
  {
    grpc::ClientContext ctx;
    v1::ServerInfo info;
    ASSERT_TRUE(stub->GetServerInfo(&ctx, v1::GetServerInfoRequest(), &info).ok());
  }
  ASSERT_EQ(channel->GetState(false), GRPC_CHANNEL_READY);
  // The server's GOAWAY takes the channel out of READY without any call of ours.
  EXPECT_TRUE(channel->WaitForStateChange(GRPC_CHANNEL_READY, std::chrono::system_clock::now() + std::chrono::seconds(5)));
  EXPECT_NE(channel->GetState(false), GRPC_CHANNEL_READY);
  grpc::ClientContext ctx;
  v1::ServerInfo info;
  EXPECT_TRUE(stub->GetServerInfo(&ctx, v1::GetServerInfoRequest(), &info).ok());
}


// ---- health, reflection, info, stats ---------------------------------------------------------------------

TEST(ServerMeta, HealthServing) {
  TestServer ts;
  ASSERT_NE(ts.server, nullptr);
  for (const std::string service : {"", "attnd.v1.Attention"}) {
    const testing::RawResult r =
        testing::RawCall(ts.Channel(), "/grpc.health.v1.Health/Check", testing::HealthRequest(service));
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();
    ASSERT_EQ(r.messages.size(), 1u);
    EXPECT_EQ(testing::HealthStatus(r.messages[0]), 1) << "service '" << service << "' not SERVING";
  }
  const testing::RawResult unknown =
      testing::RawCall(ts.Channel(), "/grpc.health.v1.Health/Check", testing::HealthRequest("no.such.Service"));
  EXPECT_EQ(unknown.status.error_code(), grpc::StatusCode::NOT_FOUND);
  // Fields HealthCheckRequest does not have are skipped, as protobuf skips them.
  const testing::RawResult extra = testing::RawCall(ts.Channel(), "/grpc.health.v1.Health/Check",
                                                    testing::HealthRequest("attnd.v1.Attention") + "\x10\x07");
  ASSERT_TRUE(extra.status.ok()) << extra.status.error_message();
  ASSERT_EQ(extra.messages.size(), 1u);
  EXPECT_EQ(testing::HealthStatus(extra.messages[0]), 1);
}

TEST(ServerMeta, HealthRefusesWhatItCannotAnswer) {
  TestServer ts;
  ASSERT_NE(ts.server, nullptr);
  const std::string truncated("\x0a\x05" "ab", 4);  // a service name of 5 bytes, 2 of them sent
  for (const char* method : {"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"}) {
    const testing::RawResult bad = testing::RawCall(ts.Channel(), method, truncated);
    EXPECT_EQ(bad.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << method << bad.status.error_message();
    EXPECT_TRUE(bad.messages.empty()) << method;
    const testing::RawResult none = testing::RawCall(ts.Channel(), method, std::vector<std::string>{});
    EXPECT_EQ(none.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << method << none.status.error_message();
  }
  // A watch of a service the server does not know is told so and kept open (grpc.health.v1: it may appear later).
  const testing::RawResult watch = testing::RawCall(ts.Channel(), "/grpc.health.v1.Health/Watch",
                                                    testing::HealthRequest("no.such.Service"), 2,
                                                    std::chrono::milliseconds(500));
  EXPECT_EQ(watch.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << watch.status.error_message();
  ASSERT_EQ(watch.messages.size(), 1u);
  EXPECT_EQ(testing::HealthStatus(watch.messages[0]), 3);
  // Methods the server does not have, in its services or not.
  for (const char* method :
       {"/attnd.v1.Attention/NoSuchMethod", "/grpc.health.v1.Health/List", "/no.such.Service/Call"}) {
    const testing::RawResult r = testing::RawCall(ts.Channel(), method, testing::HealthRequest(""));
    EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNIMPLEMENTED) << method << ": " << r.status.error_message();
  }
}

TEST(ServerMeta, ReflectionListsTheServicesWhenAskedFor) {
  server::ServerOptions options;
  options.security.reflection = true;
  TestServer ts(options);
  ASSERT_NE(ts.server, nullptr);
  // ServerReflectionRequest{list_services: ""}: field 7, length-delimited, empty.
  const std::string list_services("\x3a\x00", 2);
  const testing::RawResult r = testing::RawCall(
      ts.Channel(), "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", list_services);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  ASSERT_EQ(r.messages.size(), 1u);
  EXPECT_TRUE(absl::StrContains(r.messages[0], "attnd.v1.Attention"));
  EXPECT_TRUE(absl::StrContains(r.messages[0], "grpc.health.v1.Health"));
  // file_containing_symbol (field 4) returns the descriptor of attention.proto.
  const std::string sym = "attnd.v1.Attention";
  const std::string file_req = std::string("\x22", 1) + static_cast<char>(sym.size()) + sym;
  const testing::RawResult f = testing::RawCall(
      ts.Channel(), "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", file_req);
  ASSERT_TRUE(f.status.ok()) << f.status.error_message();
  ASSERT_EQ(f.messages.size(), 1u);
  EXPECT_TRUE(absl::StrContains(f.messages[0], "attnd/v1/attention.proto"));
  EXPECT_TRUE(absl::StrContains(f.messages[0], "ForwardStream"));
}

// Off by default, also in a process where another server served it (the option is per server, not global).
TEST(ServerMeta, ReflectionIsNotServedByDefault) {
  server::ServerOptions with;
  with.security.reflection = true;
  TestServer first(with);
  ASSERT_NE(first.server, nullptr);
  TestServer ts;
  ASSERT_NE(ts.server, nullptr);
  const testing::RawResult r = testing::RawCall(
      ts.Channel(), "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", std::string("\x3a\x00", 2));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNIMPLEMENTED) << r.status.error_message();
}

TEST(ServerMeta, ServerInfoDescribesTheCpuBackend) {
  server::ServerOptions o;
  o.limits.max_request_bytes = 123456789;
  o.limits.max_message_bytes = 1 << 20;
  server::BackendOptions bo;
  bo.max_queue = 17;
  TestServer ts(o, bo);
  ASSERT_NE(ts.server, nullptr);
  auto stub = ts.Stub();
  grpc::ClientContext ctx;
  v1::ServerInfo info;
  ASSERT_TRUE(stub->GetServerInfo(&ctx, v1::GetServerInfoRequest(), &info).ok());
  EXPECT_FALSE(info.version().empty());
  EXPECT_EQ(info.backend(), "cpu");
  EXPECT_EQ(info.devices_size(), 0);
  EXPECT_EQ(std::vector<int64_t>(info.supported_head_dims().begin(), info.supported_head_dims().end()),
            (std::vector<int64_t>{64, 128, 256}));
  EXPECT_EQ(std::vector<int>(info.supported_dtypes().begin(), info.supported_dtypes().end()),
            (std::vector<int>{v1::DTYPE_BF16, v1::DTYPE_FP16, v1::DTYPE_FP8_E4M3}));
  EXPECT_EQ(info.limits().max_request_bytes(), 123456789u);
  EXPECT_EQ(info.limits().max_message_bytes(), 1u << 20);
  EXPECT_EQ(info.limits().max_queue(), 17u);
  EXPECT_EQ(info.limits().max_head_dim(), 256);
  EXPECT_FALSE(info.cuda_ipc_enabled());
  ASSERT_EQ(info.kernels_size(), 1);
  EXPECT_EQ(info.kernels(0), server::CpuBackend::kKernelName);
  // Its streams land in host memory and nothing overlaps the upload, whatever BackendOptions says.
  EXPECT_GT(bo.stream_preferred_from_bytes, 0u);
  EXPECT_EQ(info.stream_preferred_from_bytes(), 0u);
}

TEST(ServerMeta, CudaIpcIsRefusedOnTheCpuBackend) {
  TestServer ts;
  ASSERT_NE(ts.server, nullptr);
  auto stub = ts.Stub();
  v1::RegisterCudaBufferRequest reg;
  reg.set_ipc_handle(std::string(64, '\1'));
  reg.set_byte_size(4096);
  grpc::ClientContext c1;
  v1::RegisterCudaBufferResponse r1;
  grpc::Status s = stub->RegisterCudaBuffer(&c1, reg, &r1);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  reg.set_ipc_handle("short");
  grpc::ClientContext c2;
  s = stub->RegisterCudaBuffer(&c2, reg, &r1);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  v1::UnregisterCudaBufferRequest un;
  un.set_buffer_id("x");
  grpc::ClientContext c3;
  v1::UnregisterCudaBufferResponse r3;
  EXPECT_EQ(stub->UnregisterCudaBuffer(&c3, un, &r3).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  grpc::ClientContext c4;
  v1::ListCudaBuffersResponse r4;
  ASSERT_TRUE(stub->ListCudaBuffers(&c4, v1::ListCudaBuffersRequest(), &r4).ok());
  EXPECT_EQ(r4.buffers_size(), 0);
}

TEST(ServerMeta, StatsCountCallsErrorsAndBytes) {
  TestServer ts;
  ASSERT_NE(ts.server, nullptr);
  auto stub = ts.Stub();
  const v1::ForwardRequest good = MakeRequest({1, 16, 16, 2, 2, 64}, v1::MASK_TYPE_NONE, false, 8);
  for (int i = 0; i < 3; ++i) {
    grpc::ClientContext ctx;
    v1::ForwardResponse resp;
    ASSERT_TRUE(stub->Forward(&ctx, good, &resp).ok());
  }
  v1::ForwardRequest bad = good;
  bad.mutable_shape()->set_head_dim(7);
  for (int i = 0; i < 2; ++i) {
    grpc::ClientContext ctx;
    v1::ForwardResponse resp;
    ASSERT_FALSE(stub->Forward(&ctx, bad, &resp).ok());
  }
  grpc::ClientContext ctx;
  v1::ServerStats stats;
  ASSERT_TRUE(stub->GetStats(&ctx, v1::GetStatsRequest(), &stats).ok());
  const v1::RpcStats* fwd = nullptr;
  for (const auto& r : stats.rpcs()) {
    if (r.method() == "Forward") fwd = &r;
  }
  ASSERT_NE(fwd, nullptr);
  EXPECT_EQ(fwd->count(), 5u);
  EXPECT_EQ(fwd->errors(), 2u);
  ASSERT_EQ(fwd->errors_by_code().count("INVALID_ARGUMENT"), 1u);
  EXPECT_EQ(fwd->errors_by_code().at("INVALID_ARGUMENT"), 2u);
  EXPECT_GT(fwd->total_duration_us(), 0);
  const uint64_t in = good.q().data().size() + good.k().data().size() + good.v().data().size();
  EXPECT_EQ(stats.bytes_in(), 3 * in);
  EXPECT_EQ(stats.bytes_out(), 3 * good.q().data().size());
  EXPECT_EQ(stats.queue_depth(), 0u);
  EXPECT_EQ(stats.in_flight(), 0u);
  EXPECT_GT(stats.uptime_s(), 0);
  EXPECT_EQ(stats.rpcs_size(), 7);
}

// A call whose deadline passes while it waits in the queue is answered then and gives its slot back, also
// while every worker is busy with a long job.
TEST(ServerQueue, ADeadlinePassingInTheQueueFreesTheSlotAtOnce) {
  testing::Gate gate;
  server::BackendOptions bo;
  bo.threads = 1;
  bo.max_queue = 1;
  TestServer ts({}, bo, gate.Hooks());
  ASSERT_NE(ts.server, nullptr);
  auto stub = ts.Stub();
  grpc::Status long_status;
  std::thread long_call([&] {
    grpc::ClientContext ctx;
    v1::ForwardResponse resp;
    long_status = stub->Forward(&ctx, MakeRequest({1, 16, 16, 2, 2, 64}, v1::MASK_TYPE_NONE, false, 1), &resp);
  });
  ASSERT_TRUE(testing::WaitFor([&] { return gate.entered() == 1; }));

  const absl::Time start = absl::Now();
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(start + absl::Milliseconds(300)));
  v1::ForwardResponse resp;
  EXPECT_EQ(stub->Forward(&ctx, MakeRequest({1, 16, 16, 2, 2, 64}), &resp).error_code(),
            grpc::StatusCode::DEADLINE_EXCEEDED);
  // The server's side: the queue is empty again while the worker is still held.
  ASSERT_TRUE(testing::WaitFor([&] { return ts.cpu->queue_depth() == 0; }));
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  EXPECT_EQ(gate.entered(), 1);
  // And the slot takes another call (--max_queue=1: it would be refused were the expired one still queued).
  grpc::Status queued_status;
  std::thread queued_call([&] {
    grpc::ClientContext c;
    v1::ForwardResponse r;
    queued_status = stub->Forward(&c, MakeRequest({1, 16, 16, 2, 2, 64}, v1::MASK_TYPE_NONE, false, 2), &r);
  });
  ASSERT_TRUE(testing::WaitFor([&] { return ts.cpu->queue_depth() == 1; }));
  gate.Open();
  long_call.join();
  queued_call.join();
  EXPECT_TRUE(long_status.ok()) << long_status.error_message();
  EXPECT_TRUE(queued_status.ok()) << queued_status.error_message();
  EXPECT_EQ(ts.cpu->jobs_computed(), 2u);  // the expired one never ran

  grpc::ClientContext stats_ctx;
  v1::ServerStats stats;
  ASSERT_TRUE(stub->GetStats(&stats_ctx, v1::GetStatsRequest(), &stats).ok());
  for (const v1::RpcStats& r : stats.rpcs()) {
    if (r.method() != "Forward") continue;
    EXPECT_EQ(r.count(), 3u);
    EXPECT_EQ(r.errors(), 1u);
    EXPECT_EQ(r.errors_by_code().count("DEADLINE_EXCEEDED"), 1u);
  }
}

TEST(ServerCreate, MessageLimitIsCappedAtWhatGrpcCanCount) {
  server::ServerOptions o;
  o.limits.max_message_bytes = 8ull << 30;
  TestServer ts(o);
  ASSERT_NE(ts.server, nullptr);
  grpc::ClientContext ctx;
  v1::ServerInfo info;
  ASSERT_TRUE(ts.Stub()->GetServerInfo(&ctx, v1::GetServerInfoRequest(), &info).ok());
  EXPECT_EQ(info.limits().max_message_bytes(), 2147483647u);
}

TEST(ServerCreate, RefusesBadOptions) {
  server::BackendOptions bo;
  bo.threads = 1;
  server::ServerOptions none;
  none.network.listen = "";
  EXPECT_EQ(server::Server::Create(none, std::make_unique<server::CpuBackend>(bo)).status().code(),
            absl::StatusCode::kInvalidArgument);
  server::ServerOptions bad_addr;
  bad_addr.network.listen = "256.1.1.1:99999";
  EXPECT_EQ(server::Server::Create(bad_addr, std::make_unique<server::CpuBackend>(bo)).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(server::Server::Create({}, nullptr).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ServerCreate, GrpcArgsReachTheServerAndBadOnesAreRefused) {
  // A header limit of one byte: the server refuses every call, which shows the argument was applied.
  server::ServerOptions tight;
  tight.network.grpc_args = {"grpc.max_metadata_size=1"};
  TestServer ts(tight);
  ASSERT_NE(ts.server, nullptr);
  {
    grpc::ClientContext ctx;
    v1::ServerInfo info;
    EXPECT_FALSE(ts.Stub()->GetServerInfo(&ctx, v1::GetServerInfoRequest(), &info).ok());
  }
  server::ServerOptions tuned;  // a string and an integer argument that leave the service working
  tuned.network.grpc_args = {"grpc.primary_user_agent=attnd-test", "grpc.http2.lookahead_bytes=8388608"};
  TestServer ok(tuned);
  ASSERT_NE(ok.server, nullptr);
  {
    grpc::ClientContext ctx;
    v1::ServerInfo info;
    EXPECT_TRUE(ok.Stub()->GetServerInfo(&ctx, v1::GetServerInfoRequest(), &info).ok());
  }
  server::BackendOptions bo;
  bo.threads = 1;
  for (const char* bad : {"no_equals", "=5", "grpc.max_receive_message_length=1000"}) {
    server::ServerOptions o;
    o.network.listen = "127.0.0.1:0";
    o.network.grpc_args = {bad};
    absl::StatusOr<std::unique_ptr<server::Server>> s = server::Server::Create(o, std::make_unique<server::CpuBackend>(bo));
    ASSERT_FALSE(s.ok()) << bad;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << s.status();
    EXPECT_TRUE(absl::StrContains(s.status().message(), "grpc_arg")) << s.status();
  }
}

TEST(MakeBackend, Kinds) {
  server::BackendOptions bo;
  bo.threads = 1;
  auto cpu = server::MakeBackend("cpu", bo);
  ASSERT_TRUE(cpu.ok());
  EXPECT_EQ((*cpu)->name(), "cpu");
  auto automatic = server::MakeBackend("auto", bo);
  ASSERT_TRUE(automatic.ok()) << automatic.status();
  auto cuda = server::MakeBackend("cuda", bo);
  if (!cuda.ok()) {
    // Without a CUDA backend in the build (or without a GPU) the answer is explicit, never a CPU fallback.
    EXPECT_TRUE(absl::IsFailedPrecondition(cuda.status()) || absl::IsUnavailable(cuda.status())) << cuda.status();
    EXPECT_EQ((*automatic)->name(), "cpu");
  } else {
    EXPECT_EQ((*cuda)->name(), "cuda");
  }
  EXPECT_TRUE(absl::IsInvalidArgument(server::MakeBackend("tpu", bo).status()));
  bo.max_queue = 0;
  EXPECT_TRUE(absl::IsInvalidArgument(server::MakeBackend("cpu", bo).status()));
}

}  // namespace
}  // namespace attnd
