// Float8 Forward (DTYPE_FP8_E4M3 with per-head descales, O bf16) end to end against an in-process CPU server: the
// client library over unary and streamed calls on a loopback port and a unix socket, the shared-memory channel, and
// the attn binary's call and bench. Answers are checked by the client's oracle and, for the hard inputs (large
// logits, outlier channels), against a float64 attention written apart from the reference.
#include <sys/wait.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "attnd/client/bench.h"
#include "attnd/client/shm_channel.h"
#include "e2e_util.h"
#include "fp8_attention_util.h"
#include "server_test_util.h"

#ifndef ATTN_BINARY
#error "ATTN_BINARY (path of the built attn) must be defined by the build"
#endif

namespace attnd::e2e {
namespace {

client::RequestSpec Fp8Spec(int64_t batch, int64_t q_len, int64_t kv_len, int64_t q_heads, int64_t kv_heads,
                            int64_t head_dim, Mask mask = Mask::kNone, bool lse = false) {
  client::RequestSpec s = Spec(batch, q_len, kv_len, q_heads, kv_heads, head_dim, mask, lse);
  s.dtype = DType::kFP8E4M3;
  return s;
}

class Fp8ForwardTest : public SharedServerSuite<::testing::TestWithParam<Listener>> {
 protected:
  void SetUp() override {
    SharedServerSuite::SetUp();
    if (HasFatalFailure()) return;
    // Streams in chunks of 1000 bytes: every tensor crosses several, none on an element boundary of O's bf16.
    for (client::Transport t : {client::Transport::kUnary, client::Transport::kStream}) {
      clients_.push_back(Connect(server_->Target(GetParam()), t, 1000));
      ASSERT_NE(clients_.back(), nullptr);
    }
  }

  std::vector<std::unique_ptr<client::Client>> clients_;
};

TEST_P(Fp8ForwardTest, ServerInfoListsFloat8) {
  auto info = clients_[0]->ServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  bool fp8 = false;
  for (int t : info->supported_dtypes()) fp8 |= t == v1::DTYPE_FP8_E4M3;
  EXPECT_TRUE(fp8);
}

TEST_P(Fp8ForwardTest, MatchesTheReferenceOverUnaryAndStream) {
  struct Shape6 {
    int64_t b, lq, lk, hq, hkv, d;
  };
  const Shape6 shapes[] = {{1, 1, 1, 1, 1, 128}, {2, 17, 40, 4, 1, 128}, {1, 65, 33, 8, 2, 256}, {1, 30, 30, 2, 2, 64}};
  uint64_t seed = 500;
  for (const Shape6& s : shapes) {
    for (Mask m : {Mask::kNone, Mask::kCausalTopLeft, Mask::kCausalBottomRight}) {
      client::RequestSpec spec = Fp8Spec(s.b, s.lq, s.lk, s.hq, s.hkv, s.d, m, seed % 2 == 0);
      if (seed % 3 == 0) {  // one descale per head, far apart, instead of one for the tensor
        for (int64_t h = 0; h < s.hq; ++h) spec.q_descale.push_back(0.012f * static_cast<float>(h + 1));
        for (int64_t h = 0; h < s.hkv; ++h) spec.v_descale.push_back(0.04f / static_cast<float>(h + 1));
      }
      const Case c = MakeCase(spec, ++seed);
      for (size_t i = 0; i < clients_.size(); ++i) {
        SCOPED_TRACE(absl::StrCat("b=", s.b, " lq=", s.lq, " lk=", s.lk, " hq=", s.hq, " hkv=", s.hkv, " d=", s.d,
                                  " mask=", MaskName(m), i == 0 ? " unary" : " stream"));
        auto r = clients_[i]->Forward(*c.request);
        EXPECT_EQ(CheckReply(c, r), "");
        if (!r.ok()) continue;
        EXPECT_EQ(r->o_bytes().size(), c.spec.o_bytes());
        EXPECT_EQ(c.spec.o_bytes(), 2 * c.spec.q_bytes());  // bf16 O of float8 Q
        EXPECT_EQ(r->bytes_sent, c.spec.q_bytes() + 2 * c.spec.kv_bytes());
        EXPECT_EQ(r->transport, i == 0 ? client::Transport::kUnary : client::Transport::kStream);
      }
    }
  }
}

// Large logits and outlier channels, per-head descales, checked against the float64 attention over the dequantized
// inputs (and bit for bit against the fp32 reference the CPU backend runs).
TEST_P(Fp8ForwardTest, HardInputsMatchFloat64) {
  using test_util::Fp8Data;
  uint64_t seed = 900;
  for (Fp8Data data : {Fp8Data::kLogits, Fp8Data::kOutliers}) {
    for (const Shape& s : {Shape{1, 70, 90, 4, 2, 128}, Shape{2, 24, 24, 2, 1, 256}}) {
      const v1::ForwardRequest r = testing::MakeFp8Request(s, v1::MASK_TYPE_CAUSAL_BOTTOM_RIGHT, true, ++seed, data);
      for (auto& c : clients_) {
        auto res = c->Forward(r);
        ASSERT_TRUE(res.ok()) << res.status();
        testing::ExpectCorrectFp8(r, std::string(res->o_bytes()), std::string(res->lse_bytes()));
      }
    }
  }
}

// The server's refusals reach the caller with their code and field, over both RPCs.
TEST_P(Fp8ForwardTest, BadDescalesKeepTheirStatusThroughTheClient) {
  const Case c = MakeCase(Fp8Spec(1, 16, 16, 4, 2, 128), 41);
  const Case bf16 = MakeCase(Spec(1, 16, 16, 4, 2, 128), 42);
  struct Bad {
    const Case* base;
    std::function<void(v1::ForwardRequest&)> mutate;
    std::string field;
  };
  const Bad bad[] = {
      {&c, [](v1::ForwardRequest& r) { r.clear_k_descale(); }, "k_descale: missing"},
      {&c, [](v1::ForwardRequest& r) { r.set_v_descale(0, 0.f); }, "v_descale[0]:"},
      {&c, [](v1::ForwardRequest& r) { r.add_q_descale(1.f); }, "q_descale: 2 values"},
      {&bf16, [](v1::ForwardRequest& r) { r.add_q_descale(1.f); }, "q_descale: given for a bf16 request"},
  };
  for (auto& client : clients_) {
    for (const Bad& b : bad) {
      v1::ForwardRequest r = *b.base->request;
      b.mutate(r);
      auto res = client->Forward(r);
      EXPECT_EQ(res.status().code(), absl::StatusCode::kInvalidArgument) << res.status();
      EXPECT_TRUE(absl::StartsWith(res.status().message(), b.field)) << res.status();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Listeners, Fp8ForwardTest, ::testing::Values(Listener::kTcp, Listener::kUnix),
                         [](const ::testing::TestParamInfo<Listener>& i) { return ListenerName(i.param); });

TEST(Fp8ShmTest, ForwardOverTheSharedMemoryChannel) {
  TestServer server;
  StartServer(&server, 64ull << 20, /*threads=*/2, /*max_queue=*/256, /*shm=*/true);
  ASSERT_NE(server.server, nullptr);
  const Case c = MakeCase(Fp8Spec(2, 40, 56, 4, 2, 128, Mask::kCausalBottomRight, true), 61);
  auto so = client::ShmChannelOptionsFor(*c.request, server.shm_path, 64ull << 20);
  ASSERT_TRUE(so.ok()) << so.status();
  auto ch = client::ShmChannel::Connect(*so);
  ASSERT_TRUE(ch.ok()) << ch.status();
  absl::StatusOr<client::ForwardResult> r = client::ForwardOverShm(**ch, *c.request, absl::Seconds(60));
  EXPECT_EQ(CheckReply(c, r), "");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->transport, client::Transport::kShm);
  EXPECT_EQ(r->bytes_received, c.spec.o_bytes() + c.spec.lse_bytes());
  v1::ForwardRequest bad = *c.request;
  bad.clear_q_descale();
  absl::StatusOr<client::ForwardResult> refused = client::ForwardOverShm(**ch, bad, absl::Seconds(60));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_TRUE(absl::StartsWith(refused.status().message(), "q_descale: missing")) << refused.status();
  server.server->Shutdown();
}

class Fp8CliTest : public SharedServerSuite<> {
 protected:
  std::string Attn(const std::string& cmd, const std::string& flags) const {
    return absl::StrCat(ATTN_BINARY, " ", cmd, " --target=", server_->Target(Listener::kTcp),
                        " --dtype=fp8_e4m3 --batch=2 --q_len=33 --kv_len=47 --q_heads=4 --kv_heads=2 --head_dim=128 ",
                        flags);
  }
};

TEST_F(Fp8CliTest, CallAndBenchVerifyAgainstTheReference) {
  const std::string o_file = absl::StrCat(::testing::TempDir(), "/attnd_fp8_o_", ::getpid());
  // Descales from the random data (amax / 448), then given: one for Q, one per kv head for K and V.
  for (const std::string& flags : {std::string("--mask=causal_bottom_right --lse"),
                                   std::string("--q_descale=0.012 --k_descale=0.02,0.011 --v_descale=0.011,0.03")}) {
    auto [rc, out] =
        RunCommand(Attn("call", absl::StrCat("--verify --transport=stream --o_file=", o_file, " ", flags)));
    EXPECT_EQ(rc, 0) << out;
    EXPECT_TRUE(absl::StrContains(out, "fp8_e4m3")) << out;
    EXPECT_TRUE(absl::StrContains(out, "verify: PASS")) << out;
    std::ifstream of(o_file, std::ios::binary | std::ios::ate);
    EXPECT_EQ(static_cast<int64_t>(of.tellg()), 2 * 33 * 4 * 128 * 2);  // bf16 O
  }
  std::remove(o_file.c_str());
  auto [brc, bench] =
      RunCommand(Attn("bench", "--requests=6 --warmup=0s --verify_every=1 --concurrency=2 --progress=false"));
  EXPECT_EQ(brc, 0) << bench;
  EXPECT_FALSE(absl::StrContains(bench, "verification failures")) << bench;
}

TEST_F(Fp8CliTest, BadDescalesAreRefusedNamingTheFlagOrField) {
  auto [zero_rc, zero] = RunCommand(Attn("call", "--k_descale=0"));
  EXPECT_EQ(zero_rc, 1) << zero;
  EXPECT_TRUE(absl::StrContains(zero, "k_descale[0]")) << zero;
  auto [count_rc, count] = RunCommand(Attn("call", "--v_descale=1,1,1"));
  EXPECT_EQ(count_rc, 1) << count;
  EXPECT_TRUE(absl::StrContains(count, "v_descale")) << count;
  auto [bf16_rc, bf16] = RunCommand(absl::StrCat(ATTN_BINARY, " call --target=", server_->Target(Listener::kTcp),
                                                 " --dtype=bf16 --q_len=8 --q_descale=1"));
  EXPECT_EQ(bf16_rc, 1) << bf16;
  EXPECT_TRUE(absl::StrContains(bf16, "--q_descale: only with --dtype=fp8_e4m3")) << bf16;
  auto [files_rc, files] = RunCommand(Attn("call", "--q_file=/dev/null --k_file=/dev/null --v_file=/dev/null"));
  EXPECT_EQ(files_rc, 1) << files;
  EXPECT_TRUE(absl::StrContains(files, "required with --dtype=fp8_e4m3 and file inputs")) << files;
}

}  // namespace
}  // namespace attnd::e2e
