// Float8 Forward on the CUDA backend over gRPC: where the served device lists DTYPE_FP8_E4M3 (a float8 kernel warmed
// up), masks x GQA x head_dim 128 / 256 on both inline transports, per-head descales and hard inputs, against the
// float64 attention over the dequantized inputs; where it does not, the refusal naming dtype. Skipped without a
// usable GPU.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "fp8_attention_util.h"
#include "gpu_server_util.h"
#include "gtest/gtest.h"
#include "server_test_util.h"

namespace attnd::gpu {
namespace {

using client::Transport;

bool ListsFp8(client::Client& c) {
  auto info = c.ServerInfo();
  EXPECT_TRUE(info.ok()) << info.status();
  if (!info.ok()) return false;
  for (int t : info->supported_dtypes()) {
    if (t == v1::DTYPE_FP8_E4M3) return true;
  }
  return false;
}

// O (bf16) against the float64 attention over the dequantized inputs. The kernel rounds P to e4m3 before P V (at most
// 2^-4 of each probability), so an element errs by at most 2^-4 max|V| plus O's bf16 rounding (docs/kernels.md,
// "Float8 forward"); the float8 accumulation of S adds a share of that on the large-logit and outlier inputs, which
// the factor 2 covers. The relative L2 error of random inputs stays under 3% (measured), bounded at 5%.
void ExpectCloseToFloat64(const v1::ForwardRequest& r, const std::string& o) {
  const Problem p = testing::ProblemOf(r);
  const test_util::Fp8Tensors t = testing::Fp8TensorsOf(r);
  std::vector<double> want, lse;
  test_util::NaiveFp8Attention(p, t, &want, &lse);
  ASSERT_EQ(o.size(), want.size() * 2);
  double v_max = 0;
  for (size_t i = 0; i < t.v.size(); ++i) {
    const size_t head = (i / p.shape.head_dim) % p.shape.kv_heads;
    v_max = std::max(v_max, std::fabs(test_util::Fp8Value(t.v[i]) * t.v_descale[t.v_descale.size() == 1 ? 0 : head]));
  }
  double num = 0, den = 0, worst = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    uint16_t h;
    std::memcpy(&h, o.data() + 2 * i, 2);
    const double got = Bf16ToFloat(h);
    ASSERT_TRUE(std::isfinite(got)) << "O element " << i;
    num += (got - want[i]) * (got - want[i]);
    den += want[i] * want[i];
    worst = std::max(worst, std::fabs(got - want[i]) / (2 * 0.0625 * v_max + std::ldexp(std::fabs(want[i]), -8)));
  }
  EXPECT_LE(std::sqrt(num / std::max(den, 1e-30)), 0.05);
  EXPECT_LE(worst, 1.0) << "an element beyond P's e4m3 rounding";
}

TEST(GpuServerFp8Test, Float8ForwardMatchesFloat64OrIsRefusedNamingDtype) {
  TestServer s;
  ATTND_START_CUDA_SERVER(s, CudaServerOptions{});
  auto unary = Connect(s.Target(Listener::kTcp), Transport::kUnary);
  auto stream = Connect(s.Target(Listener::kUnix), Transport::kStream, 256 * 1024);
  if (!ListsFp8(*unary)) {
    const v1::ForwardRequest r = testing::MakeFp8Request(Shape{1, 64, 64, 2, 2, 128});
    auto refused = unary->Forward(r);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
    EXPECT_TRUE(absl::StartsWith(refused.status().message(), "dtype: fp8_e4m3 is not supported")) << refused.status();
    GTEST_SKIP() << "no float8 kernel on this device: the refusal is checked, the answers are not";
  }
  using test_util::Fp8Data;
  uint64_t seed = 1;
  for (int64_t hd : {128, 256}) {
    for (Mask m : {Mask::kNone, Mask::kCausalTopLeft, Mask::kCausalBottomRight}) {
      for (int64_t kvh : {8, 2}) {
        const Fp8Data data = seed % 3 == 0 ? Fp8Data::kOutliers : seed % 3 == 1 ? Fp8Data::kPlain : Fp8Data::kLogits;
        const v1::MaskType mask = m == Mask::kNone            ? v1::MASK_TYPE_NONE
                                  : m == Mask::kCausalTopLeft ? v1::MASK_TYPE_CAUSAL_TOP_LEFT
                                                              : v1::MASK_TYPE_CAUSAL_BOTTOM_RIGHT;
        const v1::ForwardRequest r = testing::MakeFp8Request(Shape{2, 200, 333, 8, kvh, hd}, mask, true, ++seed, data);
        client::Client& c = seed % 2 ? *stream : *unary;
        SCOPED_TRACE(absl::StrCat("head_dim ", hd, " ", MaskName(m), " kv_heads ", kvh, seed % 2 ? " stream" : " unary",
                                  " seed ", seed));
        auto res = c.Forward(r);
        ASSERT_TRUE(res.ok()) << res.status();
        EXPECT_EQ(res->backend, "cuda");
        ExpectCloseToFloat64(r, std::string(res->o_bytes()));
      }
    }
  }
  // Descales are required, and read per head: a missing one is refused naming it.
  v1::ForwardRequest r = testing::MakeFp8Request(Shape{1, 64, 64, 2, 2, 128});
  r.clear_v_descale();
  auto refused = unary->Forward(r);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_TRUE(absl::StartsWith(refused.status().message(), "v_descale: missing")) << refused.status();
}

}  // namespace
}  // namespace attnd::gpu
