// The float8 e4m3 forward (the hopper family's `_fp8` configurations) against a float64 reference over the
// dequantized inputs, on random data with the hard cases: sharp softmax (large logits), key norms rising along the
// sequence, outlier channels, GQA, every mask, odd lengths, per-head and per-tensor descales; on the whole grid and on
// 3 blocks; every float8 configuration. O and LSE are poisoned before every launch. Bounds (docs/kernels.md, "Float8
// forward"): P is rounded to e4m3 before P V, a relative error of at most 2^-4 per probability, so O's error is at
// most 2^-4 sum_j p_j |v_j| <= 2^-4 max|V| and its RMS at most 2^-4 sqrt(mean sum_j (p_j v_j)^2); the tensor cores sum
// float8 products with a short accumulator, which errs on a score by up to kAccumulation times the sum of the absolute
// products (q, k large in the same channels: the outlier case), and moves P by as much in relative terms; O leaves
// rounded to bf16 (2^-9).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
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

// The score error of the float8 tensor cores' accumulation, as a fraction of the sum of the absolute products: up to
// 1.5e-3 measured (H100, the outlier case at head_dim 256), bounded here by 2^-8.
constexpr double kAccumulation = 1.0 / 256;

struct RefOut {
  std::vector<double> o, lse;
  std::vector<double> pv2;      // per O element: sum_j (p_j v_j)^2, the scale of P's rounding error
  std::vector<double> abs_dot;  // per row (as LSE): max_j scale * sum_x |q_x k_jx|
};

// Float64 attention over contiguous [B, S, H, D] values: O [B, Sq, Hq, D] and LSE [B, Hq, Sq] (natural log).
void Reference(const Problem& p, const std::vector<double>& q, const std::vector<double>& k,
               const std::vector<double>& v, RefOut* out) {
  const Shape& s = p.shape;
  const int64_t D = s.head_dim, group = s.q_heads / s.kv_heads;
  std::vector<double>* o = &out->o;
  std::vector<double>* lse = &out->lse;
  o->assign(QElems(s), 0.0);
  out->pv2.assign(QElems(s), 0.0);
  out->abs_dot.assign(LseElems(s), 0.0);
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
        double mx = -std::numeric_limits<double>::infinity(), abs_dot = 0;
        for (int64_t j = 0; j <= last; ++j) {
          const double* kr = &k[((b * s.kv_len + j) * s.kv_heads + kh) * D];
          double dot = 0, abs = 0;
          for (int64_t x = 0; x < D; ++x) {
            dot += qr[x] * kr[x];
            abs += std::abs(qr[x] * kr[x]);
          }
          scores[j] = dot * p.scale;
          mx = std::max(mx, scores[j]);
          abs_dot = std::max(abs_dot, abs * p.scale);
        }
        out->abs_dot[(b * s.q_heads + h) * s.q_len + i] = abs_dot;
        double sum = 0;
        for (int64_t j = 0; j <= last; ++j) sum += (scores[j] = std::exp(scores[j] - mx));
        double* orow = &(*o)[((b * s.q_len + i) * s.q_heads + h) * D];
        double* prow = &out->pv2[((b * s.q_len + i) * s.q_heads + h) * D];
        for (int64_t j = 0; j <= last; ++j) {
          const double* vr = &v[((b * s.kv_len + j) * s.kv_heads + kh) * D];
          for (int64_t x = 0; x < D; ++x) {
            const double pv = scores[j] / sum * vr[x];
            orow[x] += pv;
            prow[x] += pv * pv;
          }
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

// The bytes of V^T ([batch, kv_heads, head_dim, kv_len rounded up to 32]) that differ from what the layout says
// (fp8_sm90.cuh): in every 32 keys, position c holds key 16 (c / 16) + 8 ((c % 4) / 2) + 2 ((c % 16) / 4) + c % 2,
// the order of P's k32 fragment; keys past kv_len are zeros.
int64_t VTransposeMismatches(const Shape& s, const std::vector<uint8_t>& v8, const std::vector<uint8_t>& vt) {
  const int64_t D = s.head_dim, padded = (s.kv_len + 31) / 32 * 32;
  if (static_cast<int64_t>(vt.size()) != s.batch * s.kv_heads * D * padded) return -1;
  int64_t bad = 0;
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.kv_heads; ++h) {
      for (int64_t d = 0; d < D; ++d) {
        for (int64_t c = 0; c < padded; ++c) {
          const int64_t i = c % 32;
          const int64_t key = 32 * (c / 32) + 16 * (i / 16) + 8 * ((i % 4) / 2) + 2 * ((i % 16) / 4) + i % 2;
          const uint8_t want = key < s.kv_len ? v8[((b * s.kv_len + key) * s.kv_heads + h) * D + d] : 0;
          bad += vt[((b * s.kv_heads + h) * D + d) * padded + c] != want;
        }
      }
    }
  }
  return bad;
}

// One case's inputs (codes, descales, the values they stand for) and reference, shared by the configurations.
struct Fp8Data {
  std::vector<float> qd, kd, vd;
  std::vector<uint8_t> q8, k8, v8;
  std::vector<double> vv;
  RefOut ref;
};

std::shared_ptr<const Fp8Data> Prepare(const Fp8Case& c, const Problem& p) {
  static std::mutex mu;
  static std::map<std::string, std::shared_ptr<const Fp8Data>> cache;
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = cache.find(c.name); it != cache.end()) return it->second;
  const Shape& s = c.shape;
  const int64_t D = s.head_dim;
  auto data = std::make_shared<Fp8Data>();

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
  data->qd = Descales(q, s.q_heads, D, c.per_tensor);
  data->kd = Descales(k, s.kv_heads, D, c.per_tensor);
  data->vd = Descales(v, s.kv_heads, D, c.per_tensor);
  std::vector<double> qv, kv;
  Quantize(q, s.q_heads, D, data->qd, &data->q8, &qv);
  Quantize(k, s.kv_heads, D, data->kd, &data->k8, &kv);
  Quantize(v, s.kv_heads, D, data->vd, &data->v8, &data->vv);
  Reference(p, qv, kv, data->vv, &data->ref);
  cache[c.name] = data;
  return data;
}

struct Fp8Param {
  std::string config;
  Fp8Case c;
};

void PrintTo(const Fp8Param& p, std::ostream* os) { *os << p.config << "/" << p.c.name; }

class GpuAttentionFp8Test : public ::testing::TestWithParam<Fp8Param> {};

TEST_P(GpuAttentionFp8Test, MatchesDoubleReferenceOverTheDequantizedInputs) {
  if (!HaveHopper()) GTEST_SKIP() << "float8 runs on the hopper family (compute capability 9.0)";
  const Fp8Case& c = GetParam().c;
  const Shape& s = c.shape;
  const int64_t D = s.head_dim;
  Problem p;
  p.shape = s;
  p.dtype = DType::kFP8E4M3;
  p.mask = c.mask;
  p.scale = DefaultScale(D);
  p.want_lse = true;
  const std::shared_ptr<const Fp8Data> data = Prepare(c, p);
  const std::vector<float>&qd = data->qd, &kd = data->kd, &vd = data->vd;
  const std::vector<uint8_t>&q8 = data->q8, &k8 = data->k8, &v8 = data->v8;
  const std::vector<double>&vv = data->vv, &ref_o = data->ref.o, &ref_lse = data->ref.lse;

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
  options.config = GetParam().config;
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
  std::vector<uint8_t> vt;
  CUDA_OK(dvt.Download(vt));
  EXPECT_EQ(VTransposeMismatches(s, v8, vt), 0) << "V^T bytes not as the layout says (fp8_sm90.cuh)";

  // Per kv head's max |V| (the bounds' scale), then the errors against the bounds of the file's comment.
  std::vector<double> vmax(s.kv_heads, 0.0);
  for (size_t i = 0; i < vv.size(); ++i) {
    const int64_t h = static_cast<int64_t>(i / D) % s.kv_heads;
    vmax[h] = std::max(vmax[h], std::abs(vv[i]));
  }
  const RefOut& ref = data->ref;
  double worst = 0, sq = 0, pv2 = 0, ref_sq = 0, acc_sq = 0, lse_worst = 0, lse_acc = 0;
  int64_t bad = 0;
  const int64_t group = s.q_heads / s.kv_heads;
  for (size_t i = 0; i < o16.size(); ++i) {
    const double got = Bf16ToFloat(o16[i]);
    const int64_t h = static_cast<int64_t>(i / D) % s.q_heads;
    const int64_t b = static_cast<int64_t>(i) / (s.q_len * s.q_heads * D);
    const int64_t row = (static_cast<int64_t>(i) / (s.q_heads * D)) % s.q_len;
    const double acc = kAccumulation * ref.abs_dot[(b * s.q_heads + h) * s.q_len + row];
    const double err = std::abs(got - ref_o[i]);
    if (!std::isfinite(got)) ++bad;
    const double bound = (0.0625 + 2 * acc) * vmax[h / group] + std::ldexp(std::abs(ref_o[i]), -8);
    worst = std::max(worst, err / bound);
    sq += err * err;
    pv2 += ref.pv2[i];
    ref_sq += ref_o[i] * ref_o[i];
    acc_sq += std::pow(2 * acc * vmax[h / group], 2);
  }
  for (size_t i = 0; i < lse.size(); ++i) {
    if (std::isinf(ref_lse[i])) {
      if (!(std::isinf(lse[i]) && lse[i] < 0)) ++bad;
      continue;
    }
    if (!std::isfinite(lse[i])) ++bad;
    const double e = std::abs(lse[i] - ref_lse[i]);
    lse_worst = std::max(lse_worst, e / (kAccumulation * ref.abs_dot[i] + 1e-4 * (1 + std::abs(ref_lse[i]))));
    lse_acc = std::max(lse_acc, e / std::max(ref.abs_dot[i], 1e-30));
  }
  const double n = static_cast<double>(o16.size());
  const double rmse = std::sqrt(sq / n), rms = std::sqrt(ref_sq / n);
  const double rmse_bound = 0.0625 * std::sqrt(pv2 / n) + std::sqrt(acc_sq / n) + std::ldexp(rms, -8);
  std::printf("[fp8] %-32s %s: max err / bound %.3f, RMSE %.3e (bound %.3e, RMS of O %.3e), LSE err / bound %.3f "
              "(max |dLSE| / sum|qk| %.2e)\n",
              c.name.c_str(), plan->info().name.c_str(), worst, rmse, rmse_bound, rms, lse_worst, lse_acc);
  EXPECT_EQ(bad, 0) << "non-finite outputs, or a row without keys whose LSE is not -inf";
  EXPECT_LE(worst, 1.0) << "O beyond P's e4m3 rounding, the accumulation's error and O's bf16 rounding";
  EXPECT_LE(rmse, rmse_bound);
  EXPECT_LE(lse_worst, 1.0);
}

// Every float8 configuration on every case of its head_dim.
std::vector<Fp8Param> Params() {
  std::vector<Fp8Param> out;
  for (const ConfigInfo& info : Configs()) {
    if (!info.fp8) continue;
    for (const Fp8Case& c : Cases()) {
      if (c.shape.head_dim == info.head_dim) out.push_back({info.name, c});
    }
  }
  return out;
}

std::string ParamName(const ::testing::TestParamInfo<Fp8Param>& info) {
  return info.param.config + "_" + info.param.c.name;
}

INSTANTIATE_TEST_SUITE_P(Fp8, GpuAttentionFp8Test, ::testing::ValuesIn(Params()), ParamName);

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
