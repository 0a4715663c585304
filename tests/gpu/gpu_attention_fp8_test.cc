// The float8 e4m3 forward (the hopper family's `_fp8` configurations) against a float64 reference over the
// dequantized inputs, on random data with the hard cases: sharp softmax (large logits), key norms rising along the
// sequence, outlier channels, GQA, every mask, odd lengths, per-head and per-tensor descales; on the whole grid and on
// 3 blocks. O and LSE are poisoned before every launch. Bounds (docs/kernels.md, "Float8 forward"): P is rounded to
// e4m3 before P V, a relative error of at most 2^-4 per probability, so |O - ref| <= 2^-4 max|V| of the head and, the
// roundings being independent, the RMS error far below it; LSE comes from the unrounded probabilities.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "attnd/fp8.h"
#include "attnd/half.h"
#include "attnd/kernels/attention.h"
#include "attnd/problem.h"
#include "gpu_test_util.h"

namespace attnd::kernels {
namespace {

using attnd::testing::DeviceBuffer;
using attnd::testing::OutlierChannel;

struct Fp8Case {
  std::string name;
  Shape shape;
  Mask mask = Mask::kNone;
  double q_gain = 1.0;     // > 1 sharpens the softmax
  bool key_ramp = false;   // key norms rise along the sequence
  bool outliers = false;   // channels 16x larger in Q and K
  bool per_tensor = false; // one descale for every head of a tensor
  int max_blocks = 0;
  uint32_t seed = 1;
};

std::vector<Fp8Case> Cases() {
  std::vector<Fp8Case> out;
  for (int64_t d : {128, 256}) {
    const std::string dn = "d" + std::to_string(d) + "_";
    out.push_back({dn + "sq1000_gqa", Shape{1, 1000, 1000, 4, 2, d}});
    out.push_back({dn + "causal_sq1000", Shape{1, 1000, 1000, 4, 2, d}, Mask::kCausalTopLeft});
    out.push_back({dn + "bottom_right_sq300_kv1000", Shape{2, 300, 1000, 2, 1, d}, Mask::kCausalBottomRight});
    out.push_back({dn + "bottom_right_sq1000_kv300", Shape{1, 1000, 300, 2, 2, d}, Mask::kCausalBottomRight});
    out.push_back({dn + "odd_sq65_kv77", Shape{3, 65, 77, 2, 1, d}});
    out.push_back({dn + "sharp_ramp", Shape{1, 512, 1500, 2, 2, d}, Mask::kNone, 6.0, true});
    out.push_back({dn + "outliers_causal", Shape{1, 700, 700, 4, 4, d}, Mask::kCausalTopLeft, 2.0, false, true});
    out.push_back({dn + "per_tensor", Shape{2, 256, 384, 4, 2, d}, Mask::kNone, 3.0, false, false, true});
    out.push_back({dn + "blocks3_causal", Shape{2, 1200, 1200, 2, 1, d}, Mask::kCausalTopLeft, 3.0, false, false,
                   false, 3});
    out.push_back({dn + "long_causal", Shape{1, 4096, 4096, 2, 1, d}, Mask::kCausalTopLeft, 2.0, true});
  }
  return out;
}

// Per-head descale so that the head's largest magnitude maps to 448 (or one value for the tensor).
std::vector<float> Descales(const std::vector<float>& x, int64_t heads, int64_t d, bool per_tensor) {
  std::vector<float> amax(heads, 0.f);
  for (size_t i = 0; i < x.size(); ++i) {
    const int64_t h = static_cast<int64_t>(i / d) % heads;
    amax[h] = std::max(amax[h], std::abs(x[i]));
  }
  if (per_tensor) {
    const float m = *std::max_element(amax.begin(), amax.end());
    std::fill(amax.begin(), amax.end(), m);
  }
  std::vector<float> out(heads);
  for (int64_t h = 0; h < heads; ++h) out[h] = std::max(amax[h], 1e-6f) / kFp8E4M3Max;
  return out;
}

// Codes of x / descale[head] and the values they stand for.
void Quantize(const std::vector<float>& x, int64_t heads, int64_t d, const std::vector<float>& descale,
              std::vector<uint8_t>* codes, std::vector<double>* values) {
  codes->resize(x.size());
  values->resize(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const int64_t h = static_cast<int64_t>(i / d) % heads;
    (*codes)[i] = FloatToFp8E4M3(x[i] / descale[h]);
    (*values)[i] = static_cast<double>(Fp8E4M3ToFloat((*codes)[i])) * descale[h];
  }
}

// Float64 attention over contiguous [B, S, H, D] values: O [B, Sq, Hq, D] and LSE [B, Hq, Sq] (natural log).
void Reference(const Problem& p, const std::vector<double>& q, const std::vector<double>& k,
               const std::vector<double>& v, std::vector<double>* o, std::vector<double>* lse) {
  const Shape& s = p.shape;
  const int64_t D = s.head_dim, group = s.q_heads / s.kv_heads;
  o->assign(QElems(s), 0.0);
  lse->assign(LseElems(s), -std::numeric_limits<double>::infinity());
  const int64_t rows = s.batch * s.q_heads * s.q_len;
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> pool;
  for (unsigned w = 0; w < threads; ++w) {
    pool.emplace_back([&, w] {
      std::vector<double> scores(s.kv_len);
      for (int64_t r = w; r < rows; r += threads) {
        const int64_t b = r / (s.q_heads * s.q_len), h = (r / s.q_len) % s.q_heads, i = r % s.q_len;
        const int64_t kh = h / group, last = LastVisibleKey(p.mask, s.q_len, s.kv_len, i);
        if (last < 0) continue;
        const double* qr = &q[((b * s.q_len + i) * s.q_heads + h) * D];
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j <= last; ++j) {
          const double* kr = &k[((b * s.kv_len + j) * s.kv_heads + kh) * D];
          double dot = 0;
          for (int64_t x = 0; x < D; ++x) dot += qr[x] * kr[x];
          scores[j] = dot * p.scale;
          mx = std::max(mx, scores[j]);
        }
        double sum = 0;
        for (int64_t j = 0; j <= last; ++j) sum += (scores[j] = std::exp(scores[j] - mx));
        double* orow = &(*o)[((b * s.q_len + i) * s.q_heads + h) * D];
        for (int64_t j = 0; j <= last; ++j) {
          const double* vr = &v[((b * s.kv_len + j) * s.kv_heads + kh) * D];
          for (int64_t x = 0; x < D; ++x) orow[x] += scores[j] / sum * vr[x];
        }
        (*lse)[(b * s.q_heads + h) * s.q_len + i] = mx + std::log(sum);
      }
    });
  }
  for (auto& t : pool) t.join();
}

bool HaveHopper() {
  int n = 0, major = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    cudaGetLastError();
    return false;
  }
  return cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0) == cudaSuccess && major == 9;
}

class GpuAttentionFp8Test : public ::testing::TestWithParam<Fp8Case> {};

TEST_P(GpuAttentionFp8Test, MatchesDoubleReferenceOverTheDequantizedInputs) {
  if (!HaveHopper()) GTEST_SKIP() << "float8 runs on the hopper family (compute capability 9.0)";
  const Fp8Case& c = GetParam();
  const Shape& s = c.shape;
  const int64_t D = s.head_dim;
  Problem p;
  p.shape = s;
  p.dtype = DType::kFP8E4M3;
  p.mask = c.mask;
  p.scale = DefaultScale(D);
  p.want_lse = true;

  std::mt19937 rng(c.seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> q(QElems(s)), k(KVElems(s)), v(KVElems(s));
  for (auto& x : q) x = normal(rng) * static_cast<float>(c.q_gain);
  for (auto& x : k) x = normal(rng);
  for (auto& x : v) x = normal(rng);
  for (size_t i = 0; i < k.size(); ++i) {
    const int64_t row = static_cast<int64_t>(i / (s.kv_heads * D)) % s.kv_len;
    if (c.key_ramp) k[i] *= 0.25f + 3.0f * static_cast<float>(row) / static_cast<float>(s.kv_len);
    if (c.outliers && OutlierChannel(static_cast<int>(i % D))) k[i] *= 16.f;
  }
  if (c.outliers) {
    for (size_t i = 0; i < q.size(); ++i) {
      if (OutlierChannel(static_cast<int>(i % D))) q[i] *= 16.f;
    }
  }
  const std::vector<float> qd = Descales(q, s.q_heads, D, c.per_tensor);
  const std::vector<float> kd = Descales(k, s.kv_heads, D, c.per_tensor);
  const std::vector<float> vd = Descales(v, s.kv_heads, D, c.per_tensor);
  std::vector<uint8_t> q8, k8, v8;
  std::vector<double> qv, kv, vv;
  Quantize(q, s.q_heads, D, qd, &q8, &qv);
  Quantize(k, s.kv_heads, D, kd, &k8, &kv);
  Quantize(v, s.kv_heads, D, vd, &v8, &vv);
  std::vector<double> ref_o, ref_lse;
  Reference(p, qv, kv, vv, &ref_o, &ref_lse);

  DeviceBuffer<uint8_t> dq, dk, dv, dvt;
  DeviceBuffer<uint16_t> dout;
  DeviceBuffer<float> dlse, dqd, dkd, dvd;
  CUDA_OK(dq.Alloc(q8.size()));
  CUDA_OK(dk.Alloc(k8.size()));
  CUDA_OK(dv.Alloc(v8.size()));
  CUDA_OK(dvt.Alloc(static_cast<size_t>(VTransposedBytes(s, p.dtype))));
  CUDA_OK(dout.Alloc(QElems(s)));
  CUDA_OK(dlse.Alloc(LseElems(s)));
  CUDA_OK(dqd.Alloc(qd.size()));
  CUDA_OK(dkd.Alloc(kd.size()));
  CUDA_OK(dvd.Alloc(vd.size()));
  CUDA_OK(dq.Upload(q8));
  CUDA_OK(dk.Upload(k8));
  CUDA_OK(dv.Upload(v8));
  CUDA_OK(dqd.Upload(qd));
  CUDA_OK(dkd.Upload(kd));
  CUDA_OK(dvd.Upload(vd));
  // Stale V^T from an earlier case must not matter: the transpose writes all of it.
  CUDA_OK(cudaMemset(dvt.ptr, 0x7f, dvt.count));

  DeviceTensors t{dq.ptr, dk.ptr, dv.ptr, dout.ptr, dlse.ptr};
  t.q_descale = dqd.ptr;
  t.k_descale = dkd.ptr;
  t.v_descale = dvd.ptr;
  t.v_t = dvt.ptr;
  PlanOptions options;
  options.hopper.max_blocks = c.max_blocks;
  absl::StatusOr<Plan> plan = MakePlan(p, ContiguousLayout(s), t, options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(plan->info().fp8) << plan->info().name;
  DeviceBuffer<uint8_t> ws;
  if (plan->workspace_bytes > 0) {
    CUDA_OK(ws.Alloc(plan->workspace_bytes));
    ASSERT_TRUE(ZeroWorkspace(*plan, ws.ptr, nullptr).ok());
  }
  for (int run = 0; run < 2; ++run) {  // twice: the second launch finds the workspace as the first left it
    CUDA_OK(cudaMemset(dout.ptr, 0xff, dout.count * 2));  // NaN in bf16
    CUDA_OK(cudaMemset(dlse.ptr, 0xff, dlse.count * 4));
    const absl::Status st = Launch(*plan, ws.ptr, nullptr);
    ASSERT_TRUE(st.ok()) << st;
    CUDA_OK(cudaDeviceSynchronize());
  }
  std::vector<uint16_t> o16;
  std::vector<float> lse;
  CUDA_OK(dout.Download(o16));
  CUDA_OK(dlse.Download(lse));

  // Per kv head's max |V| (the bound's scale), then the errors.
  std::vector<double> vmax(s.kv_heads, 0.0);
  for (size_t i = 0; i < vv.size(); ++i) {
    const int64_t h = static_cast<int64_t>(i / D) % s.kv_heads;
    vmax[h] = std::max(vmax[h], std::abs(vv[i]));
  }
  double max_ratio = 0, sq = 0, ref_sq = 0, lse_err = 0;
  int64_t bad = 0;
  const int64_t group = s.q_heads / s.kv_heads;
  for (size_t i = 0; i < o16.size(); ++i) {
    const double got = Bf16ToFloat(o16[i]);
    const int64_t h = static_cast<int64_t>(i / D) % s.q_heads;
    const double err = std::abs(got - ref_o[i]);
    if (!std::isfinite(got)) ++bad;
    max_ratio = std::max(max_ratio, err / vmax[h / group]);
    sq += err * err;
    ref_sq += ref_o[i] * ref_o[i];
  }
  for (size_t i = 0; i < lse.size(); ++i) {
    if (std::isinf(ref_lse[i])) {
      if (!(std::isinf(lse[i]) && lse[i] < 0)) ++bad;
      continue;
    }
    const double e = std::abs(lse[i] - ref_lse[i]) / (1.0 + std::abs(ref_lse[i]));
    if (!std::isfinite(lse[i])) ++bad;
    lse_err = std::max(lse_err, e);
  }
  const double rmse = std::sqrt(sq / o16.size()), rms = std::sqrt(ref_sq / o16.size());
  std::printf("[fp8] %-34s %s: max |err| / max|V| %.5f, RMSE %.3e (RMS of O %.3e, relative %.4f), LSE %.2e\n",
              c.name.c_str(), plan->info().name.c_str(), max_ratio, rmse, rms, rmse / rms, lse_err);
  EXPECT_EQ(bad, 0) << "non-finite outputs, or a row without keys not -inf";
  EXPECT_LE(max_ratio, 0.0625 + 0.01) << "beyond P's e4m3 rounding (2^-4 of max |V|) plus O's bf16 rounding";
  EXPECT_LE(rmse, 0.02 * rms + 1e-4);
  EXPECT_LE(lse_err, 2e-3);
}

std::string CaseName(const ::testing::TestParamInfo<Fp8Case>& info) { return info.param.name; }

INSTANTIATE_TEST_SUITE_P(Fp8, GpuAttentionFp8Test, ::testing::ValuesIn(Cases()), CaseName);

TEST(KernelApiFp8, RefusesWhatItCannotRunNamingTheField) {
  Problem p;
  p.shape = Shape{1, 256, 256, 4, 2, 64};
  p.dtype = DType::kFP8E4M3;
  p.scale = DefaultScale(64);
  if (!HaveHopper()) GTEST_SKIP() << "planning needs a compute capability 9.0 device";
  absl::StatusOr<Selection> sel = Select(p, ContiguousLayout(p.shape));
  EXPECT_EQ(sel.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(sel.status().message().find("shape.head_dim"), std::string::npos) << sel.status();
  p.shape.head_dim = 128;
  PlanOptions mma_sync;
  mma_sync.family = Family::kMmaSync;
  EXPECT_EQ(Select(p, ContiguousLayout(p.shape), mma_sync).status().code(), absl::StatusCode::kFailedPrecondition);
  PlanOptions bf16_config;
  bf16_config.config = "hopper_sm90_d128_m128n128s3_osk_p2";
  sel = Select(p, ContiguousLayout(p.shape), bf16_config);
  EXPECT_EQ(sel.status().code(), absl::StatusCode::kInvalidArgument) << sel.status();
  Layout l = ContiguousLayout(p.shape);
  l.k.seq = 264;  // a multiple of 8 elements, but float8 elements: 264 bytes, not a multiple of 16
  sel = Select(p, l);
  EXPECT_EQ(sel.status().code(), absl::StatusCode::kInvalidArgument) << sel.status();
  EXPECT_NE(sel.status().message().find("layout.k.seq"), std::string::npos) << sel.status();
  sel = Select(p, ContiguousLayout(p.shape));
  ASSERT_TRUE(sel.ok()) << sel.status();
  DeviceTensors t{reinterpret_cast<const void*>(0x1000), reinterpret_cast<const void*>(0x2000),
                  reinterpret_cast<const void*>(0x3000), reinterpret_cast<void*>(0x4000), nullptr};
  absl::StatusOr<TensorMapKeys> keys = MapKeys(*sel, t);
  EXPECT_EQ(keys.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(keys.status().message().find("q_descale"), std::string::npos) << keys.status();
}

}  // namespace
}  // namespace attnd::kernels
