// The CLI's pieces end to end: the bench engine against a live server (closed and open loop, bounded), its
// reports, percentiles, the oracle's ability to reject wrong answers, and the built `attn` binary itself.
#include <sys/wait.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "attnd/client/bench.h"
#include "attnd/half.h"
#include "attnd/reference.h"
#include "e2e_util.h"

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

// Runs a command, returns its exit status and its stdout+stderr.
std::pair<int, std::string> RunCommand(const std::string& cmd) {
  std::string out;
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  if (p == nullptr) return {-1, "popen failed"};
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int st = ::pclose(p);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, out};
}

TEST_F(BenchTest, AttnBinaryInfoCallVerifyAndBench) {
  const std::string attn = ATTN_BINARY;
  const std::string target = server_->Target(Listener::kTcp);

  auto [info_rc, info] = RunCommand(absl::StrCat(attn, " info --target=", target));
  EXPECT_EQ(info_rc, 0) << info;
  EXPECT_TRUE(absl::StrContains(info, "backend: cpu")) << info;
  EXPECT_TRUE(absl::StrContains(info, "health: SERVING")) << info;

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

}  // namespace
}  // namespace attnd::e2e
