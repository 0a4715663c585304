// End to end over gRPC with the CUDA backend: every mask x GQA x head_dim against the double-precision
// oracle on both inline transports, the tensor-map cache on repeated shapes, 32 concurrent clients, concurrent
// requests on the shared compute stream, the memory budget (also for streams, which take their memory at the
// header), streams abandoned mid-upload, the stream preference the device sink advertises, the in-flight count
// right after a reply, and a shutdown with requests in flight. Skipped without a usable GPU.
#include <algorithm>
#include <atomic>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "attnd/client/client.h"
#include "attnd/kernels/attention.h"
#include "attnd/v1/attention.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gpu_server_util.h"
#include "gtest/gtest.h"

namespace attnd::gpu {
namespace {

using client::Transport;

TEST(GpuServerTest, ServerInfoReportsTheWarmDevice) {
  TestServer s;
  ATTND_START_CUDA_SERVER(s, CudaServerOptions{});
  auto c = Connect(s.Target(Listener::kTcp));
  auto info = c->ServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->backend(), "cuda");
  ASSERT_GE(info->devices_size(), 1);
  EXPECT_FALSE(info->devices(0).name().empty());
  EXPECT_GT(info->devices(0).multiprocessor_count(), 0);
  EXPECT_GE(info->kernels_size(), 3);  // one configuration per head_dim at least
  EXPECT_FALSE(info->cuda_ipc_enabled());
  // The device sink is on by default, so streams are preferred from the default 8 MiB of inline tensors.
  EXPECT_EQ(info->stream_preferred_from_bytes(), 8u << 20);
}

TEST(GpuServerTest, StreamsArePreferredOnlyWithTheDeviceSink) {
  // 32 MiB of K and V: above the default threshold, well inside the 256 MiB message limit.
  client::RequestSpec spec;
  spec.shape = Shape{1, 16, 16384, 4, 4, 128};
  const v1::ForwardRequest r = client::MakeForwardRequest(spec, std::string(spec.q_bytes(), '\0'),
                                                          std::string(spec.kv_bytes(), '\0'),
                                                          std::string(spec.kv_bytes(), '\0'));
  for (bool sink : {true, false}) {
    SCOPED_TRACE(sink ? "stream_to_device" : "no device sink");
    TestServer s;
    CudaServerOptions o;
    o.stream_to_device = sink;
    ATTND_START_CUDA_SERVER(s, o);
    auto c = Connect(s.Target(Listener::kTcp));
    auto info = c->ServerInfo();
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->stream_preferred_from_bytes(), sink ? 8u << 20 : 0u);
    auto chosen = c->ChooseTransport(r);
    ASSERT_TRUE(chosen.ok()) << chosen.status();
    EXPECT_EQ(*chosen, sink ? Transport::kStream : Transport::kUnary);
  }
}

TEST(GpuServerTest, EveryMaskGqaAndHeadDimMatchesTheOracle) {
  TestServer s;
  ATTND_START_CUDA_SERVER(s, CudaServerOptions{});
  auto unary = Connect(s.Target(Listener::kTcp), Transport::kUnary);
  auto stream = Connect(s.Target(Listener::kUnix), Transport::kStream, 256 * 1024);
  int n = 0;
  for (int64_t hd : {64, 128, 256}) {
    for (Mask m : {Mask::kNone, Mask::kCausalTopLeft, Mask::kCausalBottomRight}) {
      for (int64_t kvh : {8, 2, 1}) {
        // Lengths off the 64-row tiles; bottom-right with q_len > kv_len has rows that see no key.
        const bool more_queries = m == Mask::kCausalBottomRight && kvh == 1;
        client::RequestSpec spec = Spec(2, more_queries ? 333 : 200, more_queries ? 200 : 333, 8, kvh, hd, m, n % 2 == 0);
        if (n % 4 == 3) spec.dtype = DType::kFP16;
        const Case c = MakeCase(spec, 10 + n);
        client::Client& cl = n % 2 ? *stream : *unary;
        auto r = cl.Forward(*c.request);
        SCOPED_TRACE(absl::StrCat("head_dim ", hd, " ", MaskName(m), " kv_heads ", kvh, " ", DTypeName(spec.dtype),
                                  n % 2 ? " stream" : " unary", spec.want_lse ? " +lse" : ""));
        EXPECT_EQ(CheckReply(c, r), "");
        if (r.ok()) {
          EXPECT_EQ(r->backend, "cuda");
          EXPECT_EQ(r->device, 0);
          EXPECT_NE(r->kernel.find(absl::StrCat("d", hd)), std::string::npos) << r->kernel;
          EXPECT_GT(r->timing.kernel_us(), 0);
          EXPECT_GT(r->timing.h2d_us(), 0);
          EXPECT_GE(r->timing.total_us(), r->timing.kernel_us());
        }
        ++n;
      }
    }
  }
}

// The tensor maps one call of `kernel` looks up: Q, K and V, and O where the kernel stores it with TMA.
uint64_t MapsPerCall(const std::string& kernel) {
  for (const kernels::ConfigInfo& c : kernels::Configs()) {
    if (c.name == kernel) return c.stores_o_with_tma ? 4 : 3;
  }
  ADD_FAILURE() << "the server ran a kernel the library does not list: " << kernel;
  return 0;
}

TEST(GpuServerTest, RepeatedShapesHitTheTensorMapCache) {
  TestServer s;
  ATTND_START_CUDA_SERVER(s, CudaServerOptions{});
  auto c = Connect(s.Target(Listener::kTcp), Transport::kUnary);
  const client::RequestSpec spec = Spec(1, 512, 512, 8, 8, 128, Mask::kCausalTopLeft);
  auto before = c->Stats();
  ASSERT_TRUE(before.ok());
  const int kCalls = 8;
  uint64_t maps = 0;
  for (int i = 0; i < kCalls; ++i) {
    const Case k = MakeCase(spec, 500 + i);  // new inputs every time: stale outputs cannot pass
    const absl::StatusOr<client::ForwardResult> r = c->Forward(*k.request);
    EXPECT_EQ(CheckReply(k, r), "") << i;
    if (r.ok() && i == 0) maps = MapsPerCall(r->kernel);
  }
  ASSERT_GE(maps, 3u);
  auto after = c->Stats();
  ASSERT_TRUE(after.ok());
  const uint64_t misses = after->tensor_map_cache_misses() - before->tensor_map_cache_misses();
  const uint64_t hits = after->tensor_map_cache_hits() - before->tensor_map_cache_hits();
  // Only the first call of the shape may encode.
  EXPECT_LE(misses, maps);
  EXPECT_GE(hits, maps * (kCalls - 1));
}

TEST(GpuServerTest, WarmShapesAreEncodedBeforeTheFirstRequest) {
  TestServer s;
  CudaServerOptions o;
  o.warm_shapes = "1x1024x1024x16x16x128";
  ATTND_START_CUDA_SERVER(s, o);
  auto c = Connect(s.Target(Listener::kTcp), Transport::kUnary);
  auto before = c->Stats();
  ASSERT_TRUE(before.ok());
  const Case k = MakeCase(Spec(1, 1024, 1024, 16, 16, 128, Mask::kCausalTopLeft), 77);
  const absl::StatusOr<client::ForwardResult> r = c->Forward(*k.request);
  EXPECT_EQ(CheckReply(k, r), "");
  ASSERT_TRUE(r.ok());
  auto after = c->Stats();
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->tensor_map_cache_misses(), before->tensor_map_cache_misses());
  EXPECT_EQ(after->tensor_map_cache_hits() - before->tensor_map_cache_hits(), MapsPerCall(r->kernel));
}

// A client that reads the stats right after its reply must not find its own request still in flight: the device
// worker counts the request finished before the reply goes out. The other order loses the race only when the
// worker is preempted between the two, so busy threads on every core give the scheduler reasons to.
TEST(GpuServerTest, NoRequestInFlightAfterItsReply) {
  TestServer s;
  ATTND_START_CUDA_SERVER(s, CudaServerOptions{});
  auto c = Connect(s.Target(Listener::kUnix), Transport::kUnary);
  const Case k = MakeCase(Spec(1, 64, 64, 2, 2, 64, Mask::kNone), 91);
  std::atomic<bool> stop{false};
  std::vector<std::thread> spinners;
  for (unsigned i = 0; i < 2 * std::max(1u, std::thread::hardware_concurrency()); ++i) {
    spinners.emplace_back([&] {
      while (!stop.load(std::memory_order_relaxed)) {
      }
    });
  }
  int busy = 0, calls = 0;
  std::string failure;
  for (; calls < 200 && failure.empty(); ++calls) {
    failure = CheckReply(k, c->Forward(*k.request));
    auto st = c->Stats();
    if (!st.ok()) failure = st.status().ToString();
    else if (st->in_flight() != 0) ++busy;
  }
  stop = true;
  for (auto& t : spinners) t.join();
  EXPECT_EQ(failure, "") << "call " << calls;
  EXPECT_EQ(busy, 0) << "of " << calls << " calls, found still in flight right after their reply";
}

TEST(GpuServerTest, ThirtyTwoConcurrentClientsAllCorrect) {
  TestServer s;
  ATTND_START_CUDA_SERVER(s, CudaServerOptions{});
  const int kClients = 32, kPerClient = 3;
  std::vector<std::thread> threads;
  std::vector<std::string> failures(kClients);
  for (int t = 0; t < kClients; ++t) {
    threads.emplace_back([&, t] {
      auto c = Connect(s.Target(t % 2 ? Listener::kUnix : Listener::kTcp), t % 3 ? Transport::kUnary : Transport::kStream,
                       128 * 1024, /*own_connection=*/true);
      for (int i = 0; i < kPerClient; ++i) {
        const client::RequestSpec spec =
            Spec(1 + t % 2, 64 + 37 * ((t + i) % 7), 96 + 53 * (t % 5), 4, t % 4 ? 4 : 1, 64 << (t % 3),
                 static_cast<Mask>((t + i) % 3), i == 1);
        const Case k = MakeCase(spec, 1000 + t * 10 + i);
        const std::string why = CheckReply(k, c->Forward(*k.request));
        if (!why.empty() && failures[t].empty()) failures[t] = absl::StrCat("client ", t, " call ", i, ": ", why);
      }
    });
  }
  for (auto& th : threads) th.join();
  for (const std::string& f : failures) EXPECT_EQ(f, "");
}

TEST(GpuServerTest, SharedComputeStreamConcurrentRequestsAllCorrect) {
  TestServer s;
  CudaServerOptions o;
  o.streams = 4;
  o.shared_compute_stream = true;
  ATTND_START_CUDA_SERVER(s, o);
  std::vector<std::unique_ptr<client::Client>> clients;
  for (int i = 0; i < 4; ++i) {
    clients.push_back(Connect(s.Target(i % 2 ? Listener::kUnix : Listener::kTcp), Transport::kUnary, 0, true));
  }
  // Every case is built before the first call (the CPU oracle is slow), so that the calls reach the server
  // together: with more calls than slots, kernels queue on the compute stream while other slots copy, and a
  // copy not ordered against its kernel reads poisoned outputs or stale inputs.
  const int kCalls = 12;
  std::vector<Case> cases;
  for (int i = 0; i < kCalls; ++i) {
    const int64_t q_len = i % 4 == 0 ? 1024 : 64 + 37 * (i % 7), kv_len = i % 4 == 0 ? 1024 : 96 + 53 * (i % 5);
    client::RequestSpec spec = Spec(1 + i % 2, q_len, kv_len, 4, i % 4 ? 4 : 1, 64 << (i % 3),
                                    static_cast<Mask>(i % 3), i % 2 == 1);
    if (i % 4 == 3) spec.dtype = DType::kFP16;
    cases.push_back(MakeCase(spec, 3000 + i));
  }
  const absl::Time start = absl::Now();
  std::vector<std::future<absl::StatusOr<client::ForwardResult>>> futures;
  for (int i = 0; i < kCalls; ++i) futures.push_back(clients[i % 4]->ForwardFuture(cases[i].request));
  std::vector<absl::StatusOr<client::ForwardResult>> replies;
  for (auto& f : futures) replies.push_back(f.get());
  const double span_us = absl::ToDoubleMicroseconds(absl::Now() - start);
  double kernel_sum_us = 0;
  for (int i = 0; i < kCalls; ++i) {
    const client::RequestSpec& spec = cases[i].spec;
    SCOPED_TRACE(absl::StrCat("call ", i, ": ", spec.shape.batch, "x", spec.shape.q_len, "x", spec.shape.kv_len,
                              " kv_heads ", spec.shape.kv_heads, " head_dim ", spec.shape.head_dim, " ",
                              MaskName(spec.mask), " ", DTypeName(spec.dtype), spec.want_lse ? " +lse" : ""));
    EXPECT_EQ(CheckReply(cases[i], replies[i]), "");
    if (!replies[i].ok()) continue;
    const auto& t = replies[i]->timing;
    EXPECT_GT(t.kernel_us(), 0);
    EXPECT_GT(t.h2d_us(), 0);
    EXPECT_GT(t.d2h_us(), 0);
    EXPECT_GE(t.total_us(), t.kernel_us());
    kernel_sum_us += t.kernel_us();
  }
  // Each kernel time runs from an event recorded on the compute stream right before its launch, so the
  // kernels' times do not overlap and add up to less than the whole burst; timed from the arrival of the
  // inputs instead, they would count the waits behind each other.
  EXPECT_LE(kernel_sum_us, span_us);
}

TEST(GpuServerTest, OverTheMemoryBudgetIsResourceExhausted) {
  TestServer s;
  CudaServerOptions o;
  o.memory_budget_bytes = 8 << 20;
  ATTND_START_CUDA_SERVER(s, o);
  auto c = Connect(s.Target(Listener::kTcp), Transport::kUnary);
  const Case big = MakeCase(Spec(1, 2048, 2048, 8, 8, 128), 3);  // 4 MiB per tensor: 16 MiB in all
  auto r = c->Forward(*big.request);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  EXPECT_NE(r.status().message().find("budget"), std::string::npos) << r.status();
  // A stream takes its blocks at its header (its chunks go to the device as they arrive): refused there.
  auto stream = Connect(s.Target(Listener::kTcp), Transport::kStream);
  auto rs = stream->Forward(*big.request);
  ASSERT_FALSE(rs.ok());
  EXPECT_EQ(rs.status().code(), absl::StatusCode::kResourceExhausted) << rs.status();
  EXPECT_NE(rs.status().message().find("budget"), std::string::npos) << rs.status();
  const Case small = MakeCase(Spec(1, 256, 256, 8, 8, 128), 4);
  EXPECT_EQ(CheckReply(small, c->Forward(*small.request)), "");
  EXPECT_EQ(CheckReply(small, stream->Forward(*small.request)), "");
}

TEST(GpuServerTest, StreamsAbandonedMidUploadGiveTheirMemoryBack) {
  TestServer s;
  CudaServerOptions o;
  o.memory_budget_bytes = 40 << 20;
  ATTND_START_CUDA_SERVER(s, o);
  // 4 MiB per tensor: from its header on, a stream holds 16 MiB of the 40 (Q, K, V and O).
  const Case k = MakeCase(Spec(1, 2048, 2048, 8, 8, 128), 6);
  auto stub = v1::Attention::NewStub(grpc::CreateChannel(s.Target(Listener::kTcp), grpc::InsecureChannelCredentials()));
  for (int i = 0; i < 4; ++i) {
    grpc::ClientContext ctx;
    auto stream = stub->ForwardStream(&ctx);
    v1::ForwardStreamRequest header;
    *header.mutable_header() = *k.request;
    header.mutable_header()->clear_q();
    header.mutable_header()->clear_k();
    header.mutable_header()->clear_v();
    ASSERT_TRUE(stream->Write(header));
    // 3 MiB of Q: at least one piece is copied to the device before the client gives up.
    v1::ForwardStreamRequest chunk;
    chunk.mutable_chunk()->set_tensor(v1::TENSOR_NAME_Q);
    chunk.mutable_chunk()->set_data(k.request->q().data().substr(0, 3 << 20));
    ASSERT_TRUE(stream->Write(chunk));
    absl::SleepFor(absl::Milliseconds(50));
    ctx.TryCancel();
    EXPECT_FALSE(stream->Finish().ok());
  }
  // Had the abandoned streams kept their blocks, the budget would hold no further request. A cancelled call
  // ends on the server a moment after the client has seen it end, so the first attempt may still find the
  // last one's blocks taken.
  auto c = Connect(s.Target(Listener::kTcp), Transport::kStream);
  absl::StatusOr<client::ForwardResult> r;
  for (absl::Time until = absl::Now() + absl::Seconds(10);;) {
    r = c->Forward(*k.request);
    if (r.ok() || !absl::IsResourceExhausted(r.status()) || absl::Now() > until) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(CheckReply(k, r), "");
  EXPECT_GT(r.ok() ? r->timing.h2d_us() : 0, 0);  // the copy of the last piece
}

TEST(GpuServerTest, ReferencesWithoutIpcAreRefused) {
  TestServer s;
  ATTND_START_CUDA_SERVER(s, CudaServerOptions{});
  auto c = Connect(s.Target(Listener::kUnix), Transport::kUnary);
  Case k = MakeCase(Spec(1, 64, 64, 2, 2, 64), 5);
  v1::ForwardRequest req = *k.request;
  req.mutable_q()->mutable_ref()->set_buffer_id("cuda-1-0000000000000000");
  auto r = c->Forward(req);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  v1::RegisterCudaBufferRequest reg;
  reg.set_ipc_handle(std::string(64, 'x'));
  reg.set_byte_size(1024);
  EXPECT_EQ(c->RegisterCudaBuffer(reg).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(GpuServerTest, ShutdownWithRequestsInFlightLosesNone) {
  TestServer s;
  AcceptCounter counter;
  CudaServerOptions o;
  o.streams = 2;
  o.counter = &counter;
  ATTND_START_CUDA_SERVER(s, o);
  // Four connections, so that requests reach the server side by side rather than one upload at a time.
  std::vector<std::unique_ptr<client::Client>> clients;
  for (int i = 0; i < 4; ++i) clients.push_back(Connect(s.Target(Listener::kTcp), Transport::kUnary, 0, true));
  auto& c = clients[0];
  const int kCalls = 24;
  // One input set for all calls keeps the CPU oracle affordable; the server NaN-fills every output before
  // its launch (CudaBackendHooks::poison_outputs), so a call cannot pass on another call's result.
  const Case k = MakeCase(Spec(1, 2048, 2048, 16, 4, 128, Mask::kNone), 900);
  std::vector<std::future<absl::StatusOr<client::ForwardResult>>> futures;
  for (int i = 0; i < kCalls; ++i) futures.push_back(clients[i % 4]->ForwardFuture(k.request));
  // Shut down once the server holds requests (queued or running).
  uint32_t seen = 0;
  for (absl::Time until = absl::Now() + absl::Seconds(20); absl::Now() < until && seen < 1;) {
    auto st = c->Stats();
    if (st.ok()) seen = std::max(seen, st->in_flight());
  }
  ASSERT_GE(seen, 1u) << "the requests never reached the server";
  s.server->Shutdown();
  int ok = 0, refused = 0;
  for (int i = 0; i < kCalls; ++i) {
    auto r = futures[i].get();
    if (r.ok()) {
      EXPECT_EQ(CheckReply(k, r), "") << i;
      ++ok;
    } else {
      // Calls not yet accepted may be turned away: UNAVAILABLE from the service, or CANCELLED by gRPC for a
      // call still arriving when the listener closed. Whether none of them had been accepted is checked below.
      EXPECT_TRUE(absl::IsUnavailable(r.status()) || absl::IsCancelled(r.status())) << i << ": " << r.status();
      ++refused;
    }
  }
  // Every job the backend accepted finished OK and its reply reached the client: none was lost.
  EXPECT_EQ(counter.done_error.load(), 0);
  EXPECT_EQ(counter.done_ok.load(), counter.accepted.load());
  EXPECT_EQ(ok, counter.accepted.load());
  EXPECT_GE(ok, static_cast<int>(seen));
  EXPECT_EQ(ok + refused, kCalls);
}

}  // namespace
}  // namespace attnd::gpu
