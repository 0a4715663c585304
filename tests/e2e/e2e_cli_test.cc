// The CLI's pieces end to end: the bench engine against a live server (closed and open loop, bounded), its
// reports, percentiles, the oracle's ability to reject wrong answers, and the built `attn` binary itself; the
// same over the same-host shared-memory channel (--transport=shm --shm_socket).
#include <sys/wait.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "attnd/client/bench.h"
#include "attnd/client/shm_channel.h"
#include "attnd/half.h"
#include "attnd/reference.h"
#include "e2e_util.h"
#include "forwarding_backend.h"

#ifndef ATTN_BINARY
#error "ATTN_BINARY (path of the built attn) must be defined by the build"
#endif

namespace attnd::e2e {
namespace {

TEST(Percentile, NearestRank) {
  std::vector<double> v;
  for (int i = 1; i <= 100; ++i) v.push_back(i);
  EXPECT_EQ(client::Percentile(v, 50), 50);
  EXPECT_EQ(client::Percentile(v, 90), 90);
  EXPECT_EQ(client::Percentile(v, 99), 99);
  EXPECT_EQ(client::Percentile(v, 100), 100);
  EXPECT_EQ(client::Percentile({7}, 50), 7);
  EXPECT_EQ(client::Percentile({1, 2, 3}, 50), 2);
  EXPECT_EQ(client::Percentile({}, 50), 0);
}

// The verifier must be able to fail: perturbed, zeroed and NaN answers are all rejected.
TEST(Oracle, RejectsWrongAnswers) {
  const client::RequestSpec spec = Spec(1, 33, 40, 4, 2, 64, Mask::kCausalTopLeft, true);
  const std::string q = client::RandomTensor(spec.dtype, QElems(spec.shape), 1);
  const std::string k = client::RandomTensor(spec.dtype, KVElems(spec.shape), 2);
  const std::string v = client::RandomTensor(spec.dtype, KVElems(spec.shape), 3);
  auto oracle = client::Oracle::Compute(spec.ToProblem(), q, k, v);
  ASSERT_TRUE(oracle.ok()) << oracle.status();
  // The right answer: the fp32 reference itself.
  std::string o(spec.o_bytes(), '\0'), lse(spec.lse_bytes(), '\0');
  const Problem p = spec.ToProblem();
  ReferenceAttention(p, ContiguousLayout(p.shape), reinterpret_cast<const uint16_t*>(q.data()),
                     reinterpret_cast<const uint16_t*>(k.data()), reinterpret_cast<const uint16_t*>(v.data()),
                     reinterpret_cast<uint16_t*>(o.data()), reinterpret_cast<float*>(lse.data()));
  const client::VerifyReport good = oracle->Check(o, lse);
  EXPECT_TRUE(good.pass) << good.detail;
  EXPECT_GT(good.rel_l2_err, 0);  // bf16 output cannot be exact

  auto* o16 = reinterpret_cast<uint16_t*>(o.data());
  std::string bumped = o;
  auto* b16 = reinterpret_cast<uint16_t*>(bumped.data());
  b16[77] = FloatToBf16(Bf16ToFloat(o16[77]) + 0.05f);
  EXPECT_FALSE(oracle->Check(bumped, lse).pass);
  EXPECT_FALSE(oracle->Check(std::string(o.size(), '\0'), lse).pass);
  std::string nan = o;
  reinterpret_cast<uint16_t*>(nan.data())[5] = 0x7fc0;
  EXPECT_FALSE(oracle->Check(nan, lse).pass);
  std::string lse_bad = lse;
  reinterpret_cast<float*>(lse_bad.data())[3] += 0.01f;
  EXPECT_FALSE(oracle->Check(o, lse_bad).pass);
  EXPECT_FALSE(oracle->Check(o.substr(2), lse).pass);
}

class BenchTest : public SharedServerSuite<> {};

// Every call verified, three in flight: a buffer handed to two calls at once, or back before its reply was
// checked, would show as a failure. Fresh memory per call is the other way; the report says which ran.
TEST_F(BenchTest, OutputsIntoReusedBuffersOrFreshMemoryAllVerifyOverBothRpcs) {
  auto client = Connect(server_->Target(Listener::kTcp));
  ASSERT_NE(client, nullptr);
  const Case c = MakeCase(Spec(1, 48, 80, 4, 2, 64, Mask::kCausalBottomRight, true), 2);
  for (bool reuse : {true, false}) {
    for (client::Transport t : {client::Transport::kUnary, client::Transport::kStream}) {
      SCOPED_TRACE(::testing::Message() << "reuse " << reuse << ", " << client::TransportName(t));
      client::BenchOptions opt;
      opt.concurrency = 3;
      opt.requests = 30;
      opt.warmup = absl::ZeroDuration();
      opt.verify_every = 1;
      opt.reuse_outputs = reuse;
      opt.call.transport = t;
      auto r = client::RunBench(*client, c.request, c.oracle.get(), opt);
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(r->ok, 30);
      EXPECT_EQ(r->errors, 0) << r->first_error;
      EXPECT_EQ(r->verified, 30);
      EXPECT_EQ(r->verify_failures, 0) << r->first_verify_failure;
      EXPECT_EQ(r->reuse_outputs, reuse);
      EXPECT_TRUE(absl::StrContains(client::FormatBenchReport(*r), reuse ? "reused buffers" : "fresh memory"));
      EXPECT_TRUE(absl::StrContains(client::BenchReportCsv(*r), reuse ? ",true\n" : ",false\n"));
    }
  }
}

TEST_F(BenchTest, ClosedLoopRequestsReportSaneNumbers) {
  auto client = Connect(server_->Target(Listener::kTcp));
  ASSERT_NE(client, nullptr);
  const Case c = MakeCase(Spec(1, 64, 64, 4, 4, 64, Mask::kCausalTopLeft, true), 1);
  client::BenchOptions opt;
  opt.concurrency = 4;
  opt.requests = 24;
  opt.warmup = absl::Milliseconds(100);
  opt.verify_every = 3;
  int progress_lines = 0;
  opt.progress = [&](const std::string&) { ++progress_lines; };
  const absl::Time t0 = absl::Now();
  auto r = client::RunBench(*client, c.request, c.oracle.get(), opt);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_LT(absl::Now() - t0, absl::Seconds(60));
  EXPECT_EQ(r->ok, 24);
  EXPECT_EQ(r->errors, 0) << r->first_error;
  EXPECT_GE(r->warmup_requests, 0);
  EXPECT_EQ(r->verified, 8);
  EXPECT_EQ(r->verify_failures, 0) << r->first_verify_failure;
  EXPECT_GT(r->req_per_s, 0);
  EXPECT_GT(r->tflops, 0);
  EXPECT_GT(r->gbps, 0);
  EXPECT_GT(r->lat_min_us, 0);
  EXPECT_LE(r->lat_min_us, r->lat_p50_us);
  EXPECT_LE(r->lat_p50_us, r->lat_p90_us);
  EXPECT_LE(r->lat_p90_us, r->lat_p95_us);
  EXPECT_LE(r->lat_p95_us, r->lat_p99_us);
  EXPECT_LE(r->lat_p99_us, r->lat_max_us);
  EXPECT_GT(r->srv_kernel_us, 0);
  EXPECT_GE(r->srv_total_us, r->srv_kernel_us);
  // The client-side latency includes the server's time.
  EXPECT_GE(r->lat_mean_us, r->srv_total_us * 0.99);
  EXPECT_EQ(r->backend, "cpu");
  EXPECT_EQ(r->transport, "unary");
  // Throughput is consistent with the count and the span.
  EXPECT_NEAR(r->req_per_s * r->elapsed_s, 24, 0.01);
  // Q+K+V up, O and LSE down: exactly the tensors' bytes.
  EXPECT_EQ(r->bytes_per_request, static_cast<double>(c.spec.q_bytes() + 2 * c.spec.kv_bytes() + c.spec.o_bytes() +
                                                      c.spec.lse_bytes()));
  EXPECT_NEAR(r->gbps, r->bytes_per_request * r->req_per_s / 1e9, 1e-9 + 1e-6 * r->gbps);
  EXPECT_EQ(r->tcp_p50_us, 0);
  EXPECT_FALSE(absl::StrContains(client::FormatBenchReport(*r), "TCP loopback"));
  EXPECT_FALSE(absl::StrContains(client::FormatBenchReport(*r), "RPC floor"));

  // The floor of the same channel: a real round trip (timing comparisons with the bench would be flaky on
  // a loaded CI machine, so only sanity bounds).
  absl::StatusOr<double> floor = client::MeasureRpcFloor(*client, 100);
  ASSERT_TRUE(floor.ok()) << floor.status();
  EXPECT_GT(*floor, 0);
  EXPECT_LT(*floor, 5e6);
  EXPECT_EQ(client::MeasureRpcFloor(*client, 0).status().code(), absl::StatusCode::kInvalidArgument);
  client::BenchReport f;
  f.lat_p50_us = 900;
  f.rpc_floor_us = 300;
  EXPECT_TRUE(absl::StrContains(client::FormatBenchReport(f), "p50 0.300 ms; this call's p50 is 0.600 ms above it"))
      << client::FormatBenchReport(f);
  const double flops = ForwardFlops(c.spec.ToProblem());
  EXPECT_NEAR(r->tflops, flops * r->req_per_s / 1e12, 1e-9 + 1e-6 * r->tflops);

  const std::string json = client::BenchReportJson(*r);
  EXPECT_TRUE(absl::StrContains(json, "\"ok\": 24")) << json;
  EXPECT_TRUE(absl::StrContains(json, "\"lat_p99_us\": ")) << json;
  const std::string csv = client::BenchReportCsv(*r);
  std::vector<std::string> lines = absl::StrSplit(csv, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 2u) << csv;
  EXPECT_EQ(std::vector<std::string>(absl::StrSplit(lines[0], ',')).size(),
            std::vector<std::string>(absl::StrSplit(lines[1], ',')).size());
  EXPECT_TRUE(absl::StrContains(client::FormatBenchReport(*r), "p99"));
}

TEST(TcpLoopback, MovesTheBytesAndTimesTheRoundTrip) {
  // 3 MB up and 1 MB back, several times: a p50 that is positive and not absurd for loopback.
  absl::StatusOr<double> p50 = client::MeasureTcpLoopback(3 << 20, 1 << 20, 5);
  ASSERT_TRUE(p50.ok()) << p50.status();
  EXPECT_GT(*p50, 0);
  EXPECT_LT(*p50, 5e6);
  // Sizes of zero in one direction are a valid (one-way) transfer.
  absl::StatusOr<double> one_way = client::MeasureTcpLoopback(1 << 20, 0, 3);
  ASSERT_TRUE(one_way.ok()) << one_way.status();
  EXPECT_EQ(client::MeasureTcpLoopback(1, 1, 0).status().code(), absl::StatusCode::kInvalidArgument);

  client::BenchReport r;
  r.bytes_per_request = 4e6;
  r.lat_p50_us = 8000;  // 0.5 GB/s
  r.gbps = 1.0;
  r.tcp_p50_us = 2000;  // 2 GB/s
  const std::string text = client::FormatBenchReport(r);
  EXPECT_TRUE(absl::StrContains(text, "TCP p50 2.000 ms = 2.000 GB/s")) << text;
  EXPECT_TRUE(absl::StrContains(text, "0.500 GB/s per call at p50 (0.25x)")) << text;
  EXPECT_TRUE(absl::StrContains(text, "1.000 GB/s aggregate (0.50x)")) << text;
}

TEST_F(BenchTest, OpenLoopDurationIsBoundedAndPaced) {
  auto client = Connect(server_->Target(Listener::kUnix));
  ASSERT_NE(client, nullptr);
  const Case c = MakeCase(Spec(1, 32, 32, 2, 2, 64), 2);
  client::BenchOptions opt;
  opt.concurrency = 4;
  opt.rate = 40;
  opt.duration = absl::Seconds(1);
  opt.warmup = absl::Milliseconds(200);
  const absl::Time t0 = absl::Now();
  auto r = client::RunBench(*client, c.request, nullptr, opt);
  const absl::Duration took = absl::Now() - t0;
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_LT(took, absl::Seconds(10));
  EXPECT_GE(took, absl::Milliseconds(1150));
  EXPECT_EQ(r->errors, 0) << r->first_error;
  // 40 req/s for 1 s: the schedule fixes the count at 40; a loaded machine may start the last few after the
  // window closes, never more than 40 (+2 for rounding at the window's edges).
  EXPECT_GE(r->ok, 30);
  EXPECT_LE(r->ok, 42);
  EXPECT_LE(r->lat_p50_us, r->lat_p99_us);
}

TEST_F(BenchTest, MaxDurationStopsARunThatAsksForTooMuch) {
  auto client = Connect(server_->Target(Listener::kTcp));
  ASSERT_NE(client, nullptr);
  const Case c = MakeCase(Spec(1, 16, 16, 2, 2, 64), 3);
  client::BenchOptions opt;
  opt.requests = 1000000000;
  opt.warmup = absl::ZeroDuration();
  opt.max_duration = absl::Milliseconds(500);
  const absl::Time t0 = absl::Now();
  auto r = client::RunBench(*client, c.request, nullptr, opt);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_LT(absl::Now() - t0, absl::Seconds(10));
  EXPECT_TRUE(r->hit_max_duration);
  EXPECT_GT(r->ok, 0);
}

TEST_F(BenchTest, BadOptionsAreRefused) {
  auto client = Connect(server_->Target(Listener::kTcp));
  ASSERT_NE(client, nullptr);
  const Case c = MakeCase(Spec(1, 16, 16, 2, 2, 64), 4);
  client::BenchOptions opt;
  opt.concurrency = 0;
  EXPECT_EQ(client::RunBench(*client, c.request, nullptr, opt).status().code(), absl::StatusCode::kInvalidArgument);
  opt.concurrency = 1;
  opt.verify_every = 2;
  EXPECT_EQ(client::RunBench(*client, c.request, nullptr, opt).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(BenchTest, AttnBinaryInfoCallVerifyAndBench) {
  const std::string attn = ATTN_BINARY;
  const std::string target = server_->Target(Listener::kTcp);

  auto [info_rc, info] = RunCommand(absl::StrCat(attn, " info --target=", target));
  EXPECT_EQ(info_rc, 0) << info;
  EXPECT_TRUE(absl::StrContains(info, "backend: cpu")) << info;
  EXPECT_TRUE(absl::StrContains(info, "health: SERVING")) << info;
  EXPECT_TRUE(absl::StrContains(info, "stream preferred from: none")) << info;

  auto [call_rc, call] = RunCommand(absl::StrCat(attn, " call --verify --target=", target,
                                          " --batch=2 --q_len=100 --kv_len=130 --q_heads=8 --kv_heads=2 "
                                          "--head_dim=128 --mask=causal_bottom_right --lse"));
  EXPECT_EQ(call_rc, 0) << call;
  EXPECT_TRUE(absl::StrContains(call, "verify: PASS")) << call;

  // Over the unix socket, through the streaming RPC, with O written to a file of exactly the right size.
  const std::string ofile = absl::StrCat(::testing::TempDir(), "/attn_o_", ::getpid(), ".bin");
  auto [s_rc, s_out] = RunCommand(absl::StrCat(attn, " call --verify --transport=stream --chunk_bytes=5000 --target=",
                                        server_->Target(Listener::kUnix),
                                        " --q_len=77 --q_heads=4 --head_dim=64 --causal --o_file=", ofile));
  EXPECT_EQ(s_rc, 0) << s_out;
  EXPECT_TRUE(absl::StrContains(s_out, "transport stream")) << s_out;
  std::ifstream of(ofile, std::ios::binary | std::ios::ate);
  EXPECT_EQ(static_cast<int64_t>(of.tellg()), 77 * 4 * 64 * 2);

  // Inputs from raw files: the right sizes verify; a file of the wrong size is refused before any call.
  const client::RequestSpec fs = Spec(1, 50, 70, 4, 2, 64);
  const std::string dir = ::testing::TempDir();
  const std::string qf = absl::StrCat(dir, "/attn_q_", ::getpid()), kf = absl::StrCat(dir, "/attn_k_", ::getpid()),
                    vf = absl::StrCat(dir, "/attn_v_", ::getpid());
  ASSERT_TRUE(client::WriteFile(qf, client::RandomTensor(fs.dtype, QElems(fs.shape), 21)).ok());
  ASSERT_TRUE(client::WriteFile(kf, client::RandomTensor(fs.dtype, KVElems(fs.shape), 22)).ok());
  ASSERT_TRUE(client::WriteFile(vf, client::RandomTensor(fs.dtype, KVElems(fs.shape), 23)).ok());
  const std::string file_args = absl::StrCat(" --q_file=", qf, " --k_file=", kf, " --v_file=", vf);
  auto [f_rc, f_out] = RunCommand(absl::StrCat(attn, " call --verify --target=", target,
                                               " --q_len=50 --kv_len=70 --q_heads=4 --kv_heads=2 --head_dim=64",
                                               file_args));
  EXPECT_EQ(f_rc, 0) << f_out;
  EXPECT_TRUE(absl::StrContains(f_out, "verify: PASS")) << f_out;
  auto [fw_rc, fw_out] = RunCommand(absl::StrCat(attn, " call --target=", target,
                                                 " --q_len=51 --kv_len=70 --q_heads=4 --kv_heads=2 --head_dim=64",
                                                 file_args));
  EXPECT_EQ(fw_rc, 1) << fw_out;
  EXPECT_TRUE(absl::StrContains(fw_out, "the shape needs")) << fw_out;

  // A shape the server refuses: non-zero exit and the server's message.
  auto [bad_rc, bad] = RunCommand(absl::StrCat(attn, " call --target=", target, " --q_len=8 --head_dim=7"));
  EXPECT_NE(bad_rc, 0) << bad;
  EXPECT_TRUE(absl::StrContains(bad, "INVALID_ARGUMENT")) << bad;
  EXPECT_TRUE(absl::StrContains(bad, "head_dim")) << bad;

  const std::string json = absl::StrCat(::testing::TempDir(), "/attn_bench_", ::getpid(), ".json");
  const std::string csv = absl::StrCat(::testing::TempDir(), "/attn_bench_", ::getpid(), ".csv");
  auto [b_rc, b_out] = RunCommand(absl::StrCat(attn, " bench --target=", target,
                                        " --q_len=64 --q_heads=4 --head_dim=64 --concurrency=2 --connections=2 --requests=10 "
                                        "--warmup=0s --verify_every=2 --tcp_baseline --rpc_floor --json=",
                                        json, " --csv=", csv));
  EXPECT_EQ(b_rc, 0) << b_out;
  EXPECT_TRUE(absl::StrContains(b_out, "10 ok, 0 errors")) << b_out;
  EXPECT_TRUE(absl::StrContains(b_out, "concurrency 2 over 2 connections")) << b_out;
  EXPECT_TRUE(absl::StrContains(b_out, "verified: 5 replies, 0 failed")) << b_out;
  EXPECT_TRUE(absl::StrContains(b_out, "vs TCP loopback of the same")) << b_out;
  EXPECT_TRUE(absl::StrContains(b_out, "RPC floor (GetStats round trip on this channel)")) << b_out;
  std::stringstream js;
  js << std::ifstream(json).rdbuf();
  EXPECT_TRUE(absl::StrContains(js.str(), "\"ok\": 10")) << js.str();
  std::stringstream cs;
  cs << std::ifstream(csv).rdbuf();
  EXPECT_TRUE(absl::StrContains(cs.str(), "lat_p50_us")) << cs.str();

  auto [st_rc, st] = RunCommand(absl::StrCat(attn, " stats --target=", target));
  EXPECT_EQ(st_rc, 0) << st;
  EXPECT_TRUE(absl::StrContains(st, "Forward")) << st;

  auto [u_rc, u] = RunCommand(absl::StrCat(attn, " frobnicate"));
  EXPECT_EQ(u_rc, 2) << u;
  auto [down_rc, down] = RunCommand(absl::StrCat(attn, " info --deadline_ms=3000 --target=127.0.0.1:1"));
  EXPECT_EQ(down_rc, 1) << down;
  EXPECT_TRUE(absl::StrContains(down, "UNAVAILABLE")) << down;
}

TEST(AttnInfo, ShowsTheServersStreamPreference) {
  // What the CUDA backend reports by default under --stream_to_device.
  class PrefersStreams final : public testing::ForwardingBackend {
   public:
    using ForwardingBackend::ForwardingBackend;
    uint64_t stream_preferred_from_bytes() const override { return 8388608; }
  };
  TestServer srv;
  StartServer(&srv, 64ull << 20, 2, 256, false, [](std::unique_ptr<server::Backend> cpu) {
    return std::unique_ptr<server::Backend>(new PrefersStreams(std::move(cpu)));
  });
  ASSERT_NE(srv.server, nullptr);
  auto [rc, info] = RunCommand(absl::StrCat(ATTN_BINARY, " info --target=", srv.Target(Listener::kTcp)));
  EXPECT_EQ(rc, 0) << info;
  EXPECT_TRUE(absl::StrContains(info, "stream preferred from: 8388608 bytes of inline tensors")) << info;
}

// --transport=shm: a server with shared-memory channels (--shm_socket) beside its gRPC listeners.
class ShmCliTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    server_ = new TestServer;
    StartServer(server_, 64ull << 20, /*threads=*/2, /*max_queue=*/256, /*shm=*/true);
  }
  static void TearDownTestSuite() {
    if (server_->server) server_->server->Shutdown();
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override {
    ASSERT_NE(server_->server, nullptr);
    ASSERT_FALSE(server_->shm_path.empty());
  }

  static inline TestServer* server_ = nullptr;
};

// The CSV report (header + one row) as column -> value; fails the test when the two lines do not match.
std::map<std::string, std::string> CsvRow(const std::string& csv) {
  std::vector<std::string> lines = absl::StrSplit(csv, '\n', absl::SkipEmpty());
  EXPECT_EQ(lines.size(), 2u) << csv;
  if (lines.size() != 2) return {};
  const std::vector<std::string> keys = absl::StrSplit(lines[0], ','), values = absl::StrSplit(lines[1], ',');
  EXPECT_EQ(keys.size(), values.size()) << csv;
  std::map<std::string, std::string> row;
  for (size_t i = 0; i < keys.size() && i < values.size(); ++i) row[keys[i]] = values[i];
  return row;
}

int64_t CsvInt(const std::map<std::string, std::string>& row, const std::string& key) {
  int64_t v = -1;
  auto it = row.find(key);
  EXPECT_TRUE(it != row.end() && absl::SimpleAtoi(it->second, &v)) << key << " missing or not an integer";
  return v;
}

TEST_F(ShmCliTest, CallOverShmVerifiesAgainstTheReference) {
  const Case c = MakeCase(Spec(2, 40, 56, 4, 2, 64, Mask::kCausalBottomRight, true), 31);
  auto so = client::ShmChannelOptionsFor(*c.request, server_->shm_path, 64ull << 20);
  ASSERT_TRUE(so.ok()) << so.status();
  // Sized from the request: its serialization exactly, O and LSE plus slack for the reply.
  EXPECT_EQ(so->request_capacity, c.request->ByteSizeLong());
  EXPECT_EQ(so->reply_capacity, c.spec.o_bytes() + c.spec.lse_bytes() + client::kShmReplySlackBytes +
                                    c.request->request_id().size());
  auto ch = client::ShmChannel::Connect(*so);
  ASSERT_TRUE(ch.ok()) << ch.status();
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<client::ForwardResult> r = client::ForwardOverShm(**ch, *c.request, absl::Seconds(60));
    EXPECT_EQ(CheckReply(c, r), "");
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->transport, client::Transport::kShm);
    EXPECT_EQ(r->backend, "cpu");
    EXPECT_EQ(r->bytes_sent, c.spec.q_bytes() + 2 * c.spec.kv_bytes());
    EXPECT_EQ(r->bytes_received, c.spec.o_bytes() + c.spec.lse_bytes());
    EXPECT_GT(r->timing.kernel_us(), 0);
    EXPECT_GT(r->latency, absl::ZeroDuration());
  }
  // A server error comes back as the status, field named, and the channel stays usable.
  v1::ForwardRequest bad = *c.request;
  bad.mutable_shape()->set_head_dim(7);
  absl::StatusOr<client::ForwardResult> refused = client::ForwardOverShm(**ch, bad, absl::Seconds(60));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "head_dim")) << refused.status();
  EXPECT_EQ(CheckReply(c, client::ForwardOverShm(**ch, *c.request, absl::Seconds(60))), "");

  // Areas above the cap are refused before any channel is opened, naming the flag.
  auto capped = client::ShmChannelOptionsFor(*c.request, server_->shm_path, 4096);
  EXPECT_EQ(capped.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(capped.status().message(), "--shm_max_bytes=4096")) << capped.status();
  EXPECT_TRUE(absl::StrContains(capped.status().message(), "request area")) << capped.status();

  // The gRPC client does not carry shm: a clear refusal rather than a hang or a silent fallback.
  auto grpc_client = Connect(server_->Target(Listener::kTcp), client::Transport::kShm);
  ASSERT_NE(grpc_client, nullptr);
  absl::StatusOr<client::ForwardResult> via_grpc = grpc_client->Forward(*c.request);
  EXPECT_EQ(via_grpc.status().code(), absl::StatusCode::kInvalidArgument) << via_grpc.status();
  EXPECT_TRUE(absl::StrContains(via_grpc.status().message(), "ShmChannel")) << via_grpc.status();
  client::BenchOptions opt;
  opt.requests = 1;
  EXPECT_EQ(client::RunBench(*grpc_client, c.request, nullptr, opt).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(ShmCliTest, BenchOverShmClosedLoopHasNoErrorsAndVerifies) {
  const Case c = MakeCase(Spec(1, 48, 64, 4, 2, 64, Mask::kCausalTopLeft, true), 32);
  auto so = client::ShmChannelOptionsFor(*c.request, server_->shm_path, 64ull << 20);
  ASSERT_TRUE(so.ok()) << so.status();
  auto callers = client::OpenShmCallers(*so, 4, absl::Seconds(60));
  ASSERT_TRUE(callers.ok()) << callers.status();
  ASSERT_EQ(callers->size(), 4u);
  client::BenchOptions opt;
  opt.concurrency = 4;
  opt.duration = absl::Milliseconds(1500);
  opt.warmup = absl::Milliseconds(100);
  opt.verify_every = 1;
  int progress_lines = 0;
  opt.progress = [&](const std::string&) { ++progress_lines; };
  const absl::Time t0 = absl::Now();
  auto r = client::RunBench(*callers, server_->shm_path, c.request, c.oracle.get(), opt);
  const absl::Duration took = absl::Now() - t0;
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_GE(took, absl::Milliseconds(1600));
  EXPECT_LT(took, absl::Seconds(30));
  EXPECT_GE(progress_lines, 1);
  EXPECT_EQ(r->errors, 0) << r->first_error;
  EXPECT_GT(r->ok, 4);
  EXPECT_EQ(r->verified, r->ok);  // every measured reply checked against the oracle
  EXPECT_EQ(r->verify_failures, 0) << r->first_verify_failure;
  EXPECT_EQ(r->transport, "shm");
  EXPECT_EQ(r->target, server_->shm_path);
  EXPECT_EQ(r->backend, "cpu");
  EXPECT_EQ(r->concurrency, 4);
  EXPECT_EQ(r->connections, 4);
  EXPECT_FALSE(r->hit_max_duration);
  EXPECT_GT(r->lat_min_us, 0);
  EXPECT_LE(r->lat_min_us, r->lat_p50_us);
  EXPECT_LE(r->lat_p50_us, r->lat_p99_us);
  EXPECT_LE(r->lat_p99_us, r->lat_max_us);
  EXPECT_GT(r->srv_kernel_us, 0);
  EXPECT_GE(r->lat_mean_us, r->srv_total_us * 0.99);
  EXPECT_NEAR(r->req_per_s * r->elapsed_s, static_cast<double>(r->ok), 0.01);
  EXPECT_EQ(r->bytes_per_request, static_cast<double>(c.spec.q_bytes() + 2 * c.spec.kv_bytes() + c.spec.o_bytes() +
                                                      c.spec.lse_bytes()));
  const std::map<std::string, std::string> row = CsvRow(client::BenchReportCsv(*r));
  EXPECT_EQ(row.at("transport"), "shm");
  EXPECT_EQ(CsvInt(row, "ok"), r->ok);
  EXPECT_EQ(CsvInt(row, "errors"), 0);

  // The engine's own checks: one caller per call in flight.
  opt.concurrency = 3;
  EXPECT_EQ(client::RunBench(*callers, server_->shm_path, c.request, c.oracle.get(), opt).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(ShmCliTest, BenchOverShmOpenLoopIsPaced) {
  const Case c = MakeCase(Spec(1, 32, 32, 2, 2, 64), 33);
  auto so = client::ShmChannelOptionsFor(*c.request, server_->shm_path, 64ull << 20);
  ASSERT_TRUE(so.ok()) << so.status();
  auto callers = client::OpenShmCallers(*so, 4, absl::Seconds(60));
  ASSERT_TRUE(callers.ok()) << callers.status();
  client::BenchOptions opt;
  opt.concurrency = 4;
  opt.rate = 40;
  opt.duration = absl::Seconds(1);
  opt.warmup = absl::Milliseconds(200);
  const absl::Time t0 = absl::Now();
  auto r = client::RunBench(*callers, server_->shm_path, c.request, nullptr, opt);
  const absl::Duration took = absl::Now() - t0;
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_GE(took, absl::Milliseconds(1150));
  EXPECT_LT(took, absl::Seconds(10));
  EXPECT_EQ(r->errors, 0) << r->first_error;
  // 40 req/s for 1 s, as over gRPC (OpenLoopDurationIsBoundedAndPaced).
  EXPECT_GE(r->ok, 30);
  EXPECT_LE(r->ok, 42);
  EXPECT_GE(r->warmup_requests, 4);
  EXPECT_LE(r->warmup_requests, 10);
}

TEST_F(ShmCliTest, ATimedOutChannelIsReplacedForTheNextCall) {
  // Big enough that the CPU backend takes far longer than the channel's 300 us of polling (milliseconds).
  const Case c = MakeCase(Spec(1, 256, 256, 4, 4, 64), 34);
  auto so = client::ShmChannelOptionsFor(*c.request, server_->shm_path, 64ull << 20);
  ASSERT_TRUE(so.ok()) << so.status();
  auto callers = client::OpenShmCallers(*so, 1, absl::Microseconds(1));
  ASSERT_TRUE(callers.ok()) << callers.status();
  const client::SyncForward& forward = (*callers)[0];
  // Abandoned calls leave their channel unusable (FAILED_PRECONDITION were it reused): each next call gets a
  // fresh channel and times out the same way.
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<client::ForwardResult> r = forward(*c.request);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << i << ": " << r.status();
  }
  auto patient = client::OpenShmCallers(*so, 1, absl::Seconds(60));
  ASSERT_TRUE(patient.ok()) << patient.status();
  EXPECT_EQ(CheckReply(c, (*patient)[0](*c.request)), "");
}

TEST_F(ShmCliTest, AttnBinaryCallAndBenchOverShm) {
  const std::string attn = ATTN_BINARY;
  const std::string common = absl::StrCat(" --target=", server_->Target(Listener::kTcp),
                                          " --transport=shm --shm_socket=", server_->shm_path);

  auto [call_rc, call] = RunCommand(absl::StrCat(attn, " call --verify", common,
                                                 " --batch=2 --q_len=100 --kv_len=130 --q_heads=8 --kv_heads=2 "
                                                 "--head_dim=128 --mask=causal_bottom_right --lse"));
  EXPECT_EQ(call_rc, 0) << call;
  EXPECT_TRUE(absl::StrContains(call, "transport shm")) << call;
  EXPECT_TRUE(absl::StrContains(call, "verify: PASS")) << call;
  EXPECT_TRUE(absl::StrContains(call, absl::StrCat(2 * 100 * 8 * 128 * 2, " bytes of O"))) << call;

  const std::string csv = absl::StrCat(::testing::TempDir(), "/attn_shm_bench_", ::getpid(), ".csv");
  auto [b_rc, b_out] = RunCommand(absl::StrCat(attn, " bench", common,
                                               " --q_len=64 --q_heads=4 --head_dim=64 --lse --concurrency=4 "
                                               "--duration=1s --warmup=0s --verify_every=1 --connections=3 "
                                               "--rpc_floor --progress=false --csv=",
                                               csv));
  EXPECT_EQ(b_rc, 0) << b_out;
  EXPECT_TRUE(absl::StrContains(b_out, "transport shm")) << b_out;
  EXPECT_TRUE(absl::StrContains(b_out, "concurrency 4 over 4 connections")) << b_out;
  EXPECT_TRUE(absl::StrContains(b_out, "note: --connections ignored with --transport=shm")) << b_out;
  EXPECT_TRUE(absl::StrContains(b_out, "note: --rpc_floor ignored with --transport=shm")) << b_out;
  EXPECT_FALSE(absl::StrContains(b_out, "RPC floor (GetStats")) << b_out;
  std::stringstream cs;
  cs << std::ifstream(csv).rdbuf();
  const std::map<std::string, std::string> row = CsvRow(cs.str());
  ASSERT_FALSE(row.empty()) << cs.str();
  EXPECT_EQ(row.at("transport"), "shm");
  EXPECT_EQ(row.at("target"), server_->shm_path);
  EXPECT_EQ(row.at("backend"), "cpu");
  EXPECT_EQ(CsvInt(row, "concurrency"), 4);
  EXPECT_EQ(CsvInt(row, "errors"), 0);
  EXPECT_EQ(CsvInt(row, "verify_failures"), 0);
  const int64_t ok = CsvInt(row, "ok");
  EXPECT_GT(ok, 4);
  EXPECT_EQ(CsvInt(row, "verified"), ok);
  EXPECT_EQ(row.at("rpc_floor_us"), "0");
  EXPECT_TRUE(absl::StrContains(b_out, absl::StrCat(ok, " ok, 0 errors"))) << b_out;
  EXPECT_TRUE(absl::StrContains(b_out, absl::StrCat("verified: ", ok, " replies, 0 failed"))) << b_out;
  // The same columns as any other run's report.
  const std::string header = cs.str().substr(0, cs.str().find('\n'));
  const std::string any = client::BenchReportCsv(client::BenchReport{});
  EXPECT_EQ(header, any.substr(0, any.find('\n')));

  // A server error is printed as a gRPC one is: "attn: Forward: CODE: message".
  auto [bad_rc, bad] = RunCommand(absl::StrCat(attn, " call", common, " --q_len=8 --head_dim=7"));
  EXPECT_EQ(bad_rc, 1) << bad;
  EXPECT_TRUE(absl::StrContains(bad, "attn: Forward: INVALID_ARGUMENT")) << bad;
  EXPECT_TRUE(absl::StrContains(bad, "head_dim")) << bad;

  // A request larger than the channel cap: refused before anything is sent, naming the flag.
  auto [big_rc, big] = RunCommand(absl::StrCat(attn, " call", common, " --q_len=64 --shm_max_bytes=65536"));
  EXPECT_EQ(big_rc, 1) << big;
  EXPECT_TRUE(absl::StrContains(big, "--shm_max_bytes=65536")) << big;

  // No server at the socket: the path and the reason.
  auto [gone_rc, gone] = RunCommand(absl::StrCat(attn, " call --transport=shm --q_len=8 --shm_socket=",
                                                 ::testing::TempDir(), "/attnd_no_such_", ::getpid(), ".shm"));
  EXPECT_EQ(gone_rc, 1) << gone;
  EXPECT_TRUE(absl::StrContains(gone, "attn: --shm_socket: UNAVAILABLE")) << gone;
  EXPECT_TRUE(absl::StrContains(gone, "attnd_no_such_")) << gone;
}

TEST(AttnBinary, ShmTransportWithoutSocketIsAUsageError) {
  const std::string attn = ATTN_BINARY;
  for (const char* cmd : {"call --verify", "bench --requests=1"}) {
    SCOPED_TRACE(cmd);
    // No server is needed (and none is at the target): the flags are refused first.
    auto [rc, out] = RunCommand(absl::StrCat(attn, " ", cmd, " --transport=shm --target=127.0.0.1:1 --q_len=8"));
    EXPECT_EQ(rc, 2) << out;
    EXPECT_TRUE(absl::StrContains(out, "--shm_socket")) << out;
    EXPECT_TRUE(absl::StrContains(out, "--transport=shm")) << out;
  }
  auto [rc, out] = RunCommand(absl::StrCat(attn, " call --transport=carrier-pigeon --target=127.0.0.1:1"));
  EXPECT_EQ(rc, 2) << out;
  EXPECT_TRUE(absl::StrContains(out, "auto, unary, stream, shm")) << out;
}

TEST(AttnBinary, HelpListsTheFlagsAndExitsZero) {
  auto [rc, out] = RunCommand(absl::StrCat(ATTN_BINARY, " --help"));
  EXPECT_EQ(rc, 0) << out;
  EXPECT_TRUE(absl::StrContains(out, "attn info")) << out;  // the usage message
  EXPECT_TRUE(absl::StrContains(out, "--target (")) << out;
  EXPECT_TRUE(absl::StrContains(out, "--transport (")) << out;
  EXPECT_FALSE(absl::StrContains(out, "No flags matched")) << out;
}

}  // namespace
}  // namespace attnd::e2e
