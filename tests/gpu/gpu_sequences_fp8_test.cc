// GPU tests of the CUDA backend's KV sequences over float8 e4m3 caches (SequenceShape::kv_format kFp8E4M3). Every
// step runs on the CUDA backend and then, with the same page tables and copy-on-write copies, on the CPU backend,
// whose semantics define the format (cpu_backend.cc: an append stores FloatToFp8E4M3(x / descale); every step's
// attention reads code x descale, rounded to the dtype). After each step:
//  - every cached row of every sequence, layer, K and V, read with CopyKvRows, is byte for byte the CPU backend's
//    (the GPU's append is bit-exact with the host's FloatToFp8E4M3; copy-on-write copies whole float8 pages);
//  - O and LSE, per sequence, against float64 attention over the cache's values:
//      max|O - O64| <= kTolFactor * max|O_cpu - O64| + kAtol + max|O64 - O64x|
//      max|LSE - LSE64| <= kLseAtol + max|LSE64 - LSE64x|
//    O64 attends over the rows as the CPU backend reads them (code x descale rounded to the dtype, which the GPU's
//    gather also writes for its prefill kernels); O64x over code x descale unrounded, which the decode kernel
//    computes with (it folds the K descale into the softmax scale and the V descale into O, in fp32). The first two
//    terms are the 16-bit suite's bound on a kernel's own error (O_cpu is the plain fp32 reference, O rounded
//    once); the last is the measured distance between the two readings of the cache: by the triangle inequality,
//    what a decode result within that bound of O64x may be further from O64.
// The descales differ per layer and kv head, so a launch given another layer's or head's slice fails the check;
// the CUDA pool starts NaN-filled (0xFF is NaN in e4m3), so reading a row no append wrote shows as NaN.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "attnd/fp8.h"
#include "attnd/half.h"
#include "attnd/problem.h"
#include "attnd/server/backend.h"
#include "attnd/server/cpu_backend.h"
#include "attnd/server/step.h"
#include "cuda_device.h"
#include "gpu_sequences_util.h"
#include "gpu_test_util.h"

namespace attnd::server {
namespace {

using ::attnd::testing::HaveSupportedGpu;
using ::attnd::testing::OutlierChannel;
using ::attnd::testing::RandomValue;
using sequences_testing::Outcome;
using sequences_testing::Part;
using sequences_testing::RunBatch;
using sequences_testing::SequenceLife;
using sequences_testing::SequenceOps;
using sequences_testing::SharedBackend;

constexpr double kTolFactor = 3.0;
constexpr double kAtol = 1e-3;
constexpr double kLseAtol = 2e-3;

struct Fp8SeqCase {
  std::string name;
  int head_dim = 128;
  DType dtype = DType::kBF16;
  int kv_heads = 2;
  int group = 4;  // q_heads / kv_heads
  int layers = 2;
  int page_tokens = 16;
  float q_gain = 1.f;     // large logits: Q this many times larger
  bool outliers = false;  // a few channels of Q and K 16 times larger (OutlierChannel), the K descales to match
  uint32_t seed = 1;
};
void PrintTo(const Fp8SeqCase& c, std::ostream* os) { *os << c.name; }

// Float64 attention of one sequence: q [tokens, q_heads, D], k/v [keys, kv_heads, D], bottom-right causal (row i
// sees keys [0, keys - tokens + i]); o [tokens, q_heads, D], lse [q_heads, tokens] (natural log).
void Attention64(const std::vector<double>& q, const std::vector<double>& k, const std::vector<double>& v,
                 int tokens, int keys, int q_heads, int kv_heads, int D, double scale, std::vector<double>& o,
                 std::vector<double>& lse) {
  const int group = q_heads / kv_heads;
  o.assign(static_cast<size_t>(tokens) * q_heads * D, 0.0);
  lse.assign(static_cast<size_t>(q_heads) * tokens, 0.0);
  std::vector<double> s(keys);
  for (int i = 0; i < tokens; ++i) {
    const int visible = keys - tokens + i + 1;
    for (int h = 0; h < q_heads; ++h) {
      const double* qr = &q[(static_cast<size_t>(i) * q_heads + h) * D];
      double m = -std::numeric_limits<double>::infinity();
      for (int j = 0; j < visible; ++j) {
        const double* kr = &k[(static_cast<size_t>(j) * kv_heads + h / group) * D];
        double dot = 0;
        for (int d = 0; d < D; ++d) dot += qr[d] * kr[d];
        s[j] = dot * scale;
        m = std::max(m, s[j]);
      }
      double sum = 0;
      for (int j = 0; j < visible; ++j) sum += (s[j] = std::exp(s[j] - m));
      double* out = &o[(static_cast<size_t>(i) * q_heads + h) * D];
      for (int j = 0; j < visible; ++j) {
        const double* vr = &v[(static_cast<size_t>(j) * kv_heads + h / group) * D];
        for (int d = 0; d < D; ++d) out[d] += s[j] / sum * vr[d];
      }
      lse[static_cast<size_t>(h) * tokens + i] = m + std::log(sum);
    }
  }
}

class SequencesFp8Test : public ::testing::TestWithParam<Fp8SeqCase> {
 protected:
  void SetUp() override {
    if (!HaveSupportedGpu()) GTEST_SKIP() << "no CUDA device";
    gpu_ = SharedBackend();
    ASSERT_NE(gpu_, nullptr) << "the CUDA backend did not start";
    BackendOptions options;
    options.threads = 2;
    cpu_ = std::make_unique<CpuBackend>(options);
    c_ = GetParam();
    rng_.seed(c_.seed);
    shape_.layers = c_.layers;
    shape_.kv_heads = c_.kv_heads;
    shape_.head_dim = c_.head_dim;
    shape_.dtype = c_.dtype;
    shape_.kv_format = KvFormat::kFp8E4M3;
    // About amax / 448 (the usual calibration), different for every layer and kv head; the smallest K descale
    // puts the inputs' largest values past 448, where they saturate.
    const float k_amax = c_.outliers ? 16.f : 1.f;
    for (int l = 0; l < c_.layers; ++l) {
      for (int h = 0; h < c_.kv_heads; ++h) {
        shape_.k_descale.push_back(k_amax * (0.75f + 0.5f * l + 0.25f * h) / kFp8E4M3Max);
        shape_.v_descale.push_back((1.5f - 0.25f * l + 0.5f * h) / kFp8E4M3Max);
      }
    }
    absl::StatusOr<std::shared_ptr<KvPool>> pool = gpu_->MakeKvPool(shape_, c_.page_tokens, kPages);
    ASSERT_TRUE(pool.ok()) << pool.status();
    gpu_pool_ = *pool;
    pool = cpu_->MakeKvPool(shape_, c_.page_tokens, kPages);
    ASSERT_TRUE(pool.ok()) << pool.status();
    cpu_pool_ = *pool;
    CUDA_OK(cudaSetDevice(gpu_->devices().front().index));
    CUDA_OK(cudaMemset(cuda::KvPoolData(*gpu_pool_), 0xFF, shape_.page_bytes(c_.page_tokens) * kPages));
    CUDA_OK(cudaDeviceSynchronize());
    free_.resize(kPages);
    std::iota(free_.begin(), free_.end(), 0);
    std::shuffle(free_.begin(), free_.end(), rng_);  // sequences get scattered pages
    refs_.assign(kPages, 0);
  }

  // The sequences core in miniature: page tables over a shuffled free list, forks sharing pages, copy-on-write.
  struct Seq {
    std::vector<int32_t> pages;
    std::vector<int32_t> len;  // per layer
  };
  int Open() {
    seqs_.push_back(Seq{{}, std::vector<int32_t>(c_.layers, 0)});
    return static_cast<int>(seqs_.size()) - 1;
  }
  int Fork(int parent) {
    seqs_.push_back(seqs_[parent]);
    for (int32_t p : seqs_.back().pages) ++refs_[p];
    return static_cast<int>(seqs_.size()) - 1;
  }
  int32_t Take() {
    EXPECT_FALSE(free_.empty()) << "the test's pool is too small";
    const int32_t p = free_.back();
    free_.pop_back();
    ++refs_[p];
    return p;
  }
  StepSequence Admit(int i, int layer, int tokens, bool append, std::vector<PageCopy>* copies) {
    Seq& s = seqs_[i];
    const int64_t end = int64_t{s.len[layer]} + tokens;
    if (append) {
      while (static_cast<int64_t>(s.pages.size()) * c_.page_tokens < end) s.pages.push_back(Take());
      for (int64_t j = s.len[layer] / c_.page_tokens; j * c_.page_tokens < end; ++j) {
        int32_t& page = s.pages[j];
        if (refs_[page] == 1) continue;
        const int32_t fresh = Take();
        copies->push_back({page, fresh});
        --refs_[page];
        page = fresh;
      }
    }
    StepSequence out;
    out.cached = s.len[layer];
    out.tokens = tokens;
    out.pages = s.pages;
    return out;
  }

  // `n` inputs of the dtype; with `hard`, the case's outlier channels of Q and K.
  std::vector<uint16_t> Random(int64_t n, float gain, bool hard) {
    std::vector<uint16_t> out(n);
    for (int64_t i = 0; i < n; ++i) {
      const float big = hard && c_.outliers && OutlierChannel(static_cast<int>(i % c_.head_dim)) ? 16.f : 1.f;
      out[i] = FloatToHalf(c_.dtype, RandomValue(rng_) * gain * big);
    }
    return out;
  }

  // One batch of requests at `layer` on both backends, then the caches and the outputs checked.
  void Step(int layer, const std::vector<Part>& parts, bool append, bool attend, const std::string& what);
  // Every cached row of every sequence, layer, K and V: the CUDA pool's bytes are the CPU pool's.
  void CheckCaches();
  // One sequence's rows [0, keys) of `layer`'s K or V as the CPU backend holds them: as doubles, code x descale
  // unrounded (`exact`) and rounded to the dtype (`rounded`).
  void CachedValues(const StepSequence& s, int keys, int layer, int kv, std::vector<double>* exact,
                    std::vector<double>* rounded);
  void CheckSequence(const StepSequence& s, int keys, int layer, const uint16_t* q, const uint16_t* o_gpu,
                     const uint16_t* o_cpu, const float* lse_gpu, bool lse);

  static constexpr int32_t kPages = 512;
  Fp8SeqCase c_;
  Backend* gpu_ = nullptr;
  std::unique_ptr<CpuBackend> cpu_;
  std::mt19937 rng_;
  SequenceShape shape_;
  std::shared_ptr<KvPool> gpu_pool_, cpu_pool_;
  std::vector<Seq> seqs_;
  std::vector<int> refs_;
  std::vector<int32_t> free_;
};

void SequencesFp8Test::Step(int layer, const std::vector<Part>& parts, bool append, bool attend,
                            const std::string& what) {
  SCOPED_TRACE(what);
  const int q_heads = c_.kv_heads * c_.group;
  const int64_t row_q = int64_t{q_heads} * c_.head_dim, row_kv = int64_t{c_.kv_heads} * c_.head_dim;
  struct Inputs {
    std::vector<uint16_t> q, k, v;
    std::vector<StepSequence> seqs;
  };
  std::vector<Inputs> in(parts.size());
  std::vector<std::unique_ptr<StepJob>> gpu_jobs, cpu_jobs;
  for (size_t j = 0; j < parts.size(); ++j) {
    std::vector<PageCopy> copies;
    int64_t rows = 0;
    for (size_t i = 0; i < parts[j].seqs.size(); ++i) {
      in[j].seqs.push_back(Admit(parts[j].seqs[i], layer, parts[j].tokens[i], append, &copies));
      rows += parts[j].tokens[i];
    }
    if (attend) in[j].q = Random(rows * row_q, c_.q_gain, true);
    if (append) in[j].k = Random(rows * row_kv, 1.f, true), in[j].v = Random(rows * row_kv, 1.f, false);
    for (int backend = 0; backend < 2; ++backend) {
      auto job = std::make_unique<StepJob>();
      job->request_id = absl::StrCat(what, "/", j);
      job->pool = backend == 0 ? gpu_pool_ : cpu_pool_;
      job->layer = layer;
      job->q_heads = attend ? q_heads : 0;
      job->scale = DefaultScale(c_.head_dim);
      job->want_lse = attend && c_.group > 1;
      job->append = append;
      job->attend = attend;
      job->sequences = in[j].seqs;
      job->copies = copies;
      job->rows = rows;
      const auto bind = [](const std::vector<uint16_t>& data, TensorSource* src) {
        src->host = reinterpret_cast<const uint8_t*>(data.data());
        src->host_bytes = data.size() * 2;
      };
      if (attend) bind(in[j].q, &job->q);
      if (append) bind(in[j].k, &job->k), bind(in[j].v, &job->v);
      job->accepted = absl::Now();
      const absl::Status accepted = (backend == 0 ? static_cast<Backend*>(gpu_) : cpu_.get())->AcceptStep(*job);
      ASSERT_TRUE(accepted.ok()) << accepted;
      (backend == 0 ? gpu_jobs : cpu_jobs).push_back(std::move(job));
    }
  }
  const std::vector<Outcome> gpu = RunBatch(*gpu_, std::move(gpu_jobs));
  const std::vector<Outcome> cpu = RunBatch(*cpu_, std::move(cpu_jobs));
  ASSERT_EQ(gpu.size(), parts.size());
  ASSERT_EQ(cpu.size(), parts.size());
  for (size_t j = 0; j < parts.size(); ++j) {
    ASSERT_TRUE(gpu[j].status.ok()) << "request " << j << ": " << gpu[j].status;
    ASSERT_TRUE(cpu[j].status.ok()) << "request " << j << " on the CPU backend: " << cpu[j].status;
    // Float8 pages are written by the append kernel, then read by the float8 decode launch or gathered.
    if (append) {
      EXPECT_EQ(gpu[j].kernel.rfind("append", 0), 0u) << gpu[j].kernel;
    }
    if (attend) {
      EXPECT_NE(gpu[j].kernel.find("fp8"), std::string::npos) << gpu[j].kernel;
    }
  }
  if (append) {
    for (const Part& part : parts) {
      for (size_t i = 0; i < part.seqs.size(); ++i) seqs_[part.seqs[i]].len[layer] += part.tokens[i];
    }
  }
  CheckCaches();
  if (!attend) return;
  for (size_t j = 0; j < parts.size(); ++j) {
    const int64_t rows = std::accumulate(parts[j].tokens.begin(), parts[j].tokens.end(), int64_t{0});
    ASSERT_EQ(gpu[j].o.size(), static_cast<size_t>(rows * row_q) * 2);
    ASSERT_EQ(cpu[j].o.size(), gpu[j].o.size());
    const bool lse = c_.group > 1;
    ASSERT_EQ(gpu[j].lse.size(), lse ? static_cast<size_t>(rows * q_heads) * sizeof(float) : 0);
    const auto* o_gpu = reinterpret_cast<const uint16_t*>(gpu[j].o.data());
    const auto* o_cpu = reinterpret_cast<const uint16_t*>(cpu[j].o.data());
    const auto* lse_gpu = reinterpret_cast<const float*>(gpu[j].lse.data());
    int64_t row = 0;
    for (size_t i = 0; i < parts[j].seqs.size(); ++i) {
      const StepSequence& s = in[j].seqs[i];
      SCOPED_TRACE(absl::StrCat("request ", j, " sequence ", i, ": ", s.tokens, " tokens over ", s.keys(append),
                                " keys"));
      CheckSequence(s, s.keys(append), layer, in[j].q.data() + row * row_q, o_gpu + row * row_q,
                    o_cpu + row * row_q, lse ? lse_gpu + row * q_heads : nullptr, lse);
      row += s.tokens;
    }
  }
}

void SequencesFp8Test::CheckCaches() {
  const uint64_t row_bytes = shape_.row_bytes();
  int64_t checked = 0, wrong = 0;
  for (const Seq& s : seqs_) {
    for (int layer = 0; layer < c_.layers; ++layer) {
      if (s.len[layer] == 0) continue;
      for (int kv = 0; kv < 2; ++kv) {
        std::vector<uint8_t> got(s.len[layer] * row_bytes), want(got.size());
        ASSERT_TRUE(gpu_->CopyKvRows(*gpu_pool_, s.pages, layer, kv, 0, s.len[layer], true, got.data()).ok());
        ASSERT_TRUE(cpu_->CopyKvRows(*cpu_pool_, s.pages, layer, kv, 0, s.len[layer], true, want.data()).ok());
        for (int32_t t = 0; t < s.len[layer]; ++t) {
          wrong += std::memcmp(got.data() + t * row_bytes, want.data() + t * row_bytes, row_bytes) != 0;
          ++checked;
        }
      }
    }
  }
  EXPECT_EQ(wrong, 0) << "of " << checked << " cached rows differ from the CPU backend's codes";
}

void SequencesFp8Test::CachedValues(const StepSequence& s, int keys, int layer, int kv, std::vector<double>* exact,
                                    std::vector<double>* rounded) {
  const int64_t row = int64_t{c_.kv_heads} * c_.head_dim;
  std::vector<uint8_t> codes(keys * row);
  ASSERT_TRUE(cpu_->CopyKvRows(*cpu_pool_, s.pages, layer, kv, 0, keys, true, codes.data()).ok());
  const float* descale = (kv == 0 ? shape_.k_descale : shape_.v_descale).data() + int64_t{layer} * c_.kv_heads;
  exact->resize(codes.size());
  rounded->resize(codes.size());
  for (size_t e = 0; e < codes.size(); ++e) {
    const float d = descale[(e % row) / c_.head_dim];
    (*exact)[e] = static_cast<double>(Fp8E4M3ToFloat(codes[e])) * d;
    (*rounded)[e] = HalfToFloat(c_.dtype, FloatToHalf(c_.dtype, Fp8E4M3ToFloat(codes[e]) * d));
  }
}

void SequencesFp8Test::CheckSequence(const StepSequence& s, int keys, int layer, const uint16_t* q,
                                     const uint16_t* o_gpu, const uint16_t* o_cpu, const float* lse_gpu, bool lse) {
  const int q_heads = c_.kv_heads * c_.group, D = c_.head_dim;
  std::vector<double> kx, kr, vx, vr;
  CachedValues(s, keys, layer, 0, &kx, &kr);
  CachedValues(s, keys, layer, 1, &vx, &vr);
  std::vector<double> qd(static_cast<size_t>(s.tokens) * q_heads * D);
  for (size_t e = 0; e < qd.size(); ++e) qd[e] = HalfToFloat(c_.dtype, q[e]);
  std::vector<double> o64, lse64, o64x, lse64x;
  const double scale = DefaultScale(D);
  Attention64(qd, kr, vr, s.tokens, keys, q_heads, c_.kv_heads, D, scale, o64, lse64);
  Attention64(qd, kx, vx, s.tokens, keys, q_heads, c_.kv_heads, D, scale, o64x, lse64x);
  double err = 0, err_cpu = 0, readings = 0;
  int64_t nans = 0;
  for (size_t e = 0; e < o64.size(); ++e) {
    const double g = HalfToFloat(c_.dtype, o_gpu[e]);
    readings = std::max(readings, std::abs(o64[e] - o64x[e]));
    err_cpu = std::max(err_cpu, std::abs(HalfToFloat(c_.dtype, o_cpu[e]) - o64[e]));
    if (!std::isfinite(g)) {
      ++nans;
      continue;
    }
    err = std::max(err, std::abs(g - o64[e]));
  }
  EXPECT_EQ(nans, 0) << "unwritten (poisoned) or non-finite O";
  EXPECT_LE(err, kTolFactor * err_cpu + kAtol + readings)
      << "CPU backend's error " << err_cpu << ", rounded vs unrounded cache " << readings;
  if (!lse) return;
  double lse_err = 0, lse_readings = 0;
  for (size_t e = 0; e < lse64.size(); ++e) {
    lse_readings = std::max(lse_readings, std::abs(lse64[e] - lse64x[e]));
    lse_err = std::isfinite(lse_gpu[e]) ? std::max(lse_err, std::abs(lse_gpu[e] - lse64[e])) : 1e30;
  }
  EXPECT_LE(lse_err, kLseAtol + lse_readings) << "LSE ([q_heads, tokens] per sequence)";
}

// The 16-bit suite's life of a few sequences (SequenceLife) over float8 pages: long prompts into empty caches are
// gathered from the pages their own append just wrote.
TEST_P(SequencesFp8Test, PrefillForkDecodeChunkReattend) {
  const SequenceOps ops{[this] { return Open(); }, [this](int parent) { return Fork(parent); },
                        [this](int layer, const std::vector<Part>& parts, bool append, bool attend,
                               const std::string& what) { Step(layer, parts, append, attend, what); }};
  SequenceLife(c_.layers, ops);
}

std::vector<Fp8SeqCase> Fp8Cases() {
  std::vector<Fp8SeqCase> out;
  uint32_t seed = 300;
  for (int hd : {64, 128, 256}) {
    for (DType dt : {DType::kBF16, DType::kFP16}) {
      Fp8SeqCase c;
      c.head_dim = hd;
      c.dtype = dt;
      c.seed = seed++;
      c.name = absl::StrCat("d", hd, "_", DTypeName(dt), "_g4");
      out.push_back(c);
    }
  }
  Fp8SeqCase g1;  // no LSE
  g1.name = "d128_fp16_g1";
  g1.dtype = DType::kFP16;
  g1.group = 1;
  g1.seed = seed++;
  out.push_back(g1);
  Fp8SeqCase g8;
  g8.name = "d64_bf16_g8_kv1";
  g8.head_dim = 64;
  g8.group = 8;
  g8.kv_heads = 1;
  g8.seed = seed++;
  out.push_back(g8);
  Fp8SeqCase pages64;
  pages64.name = "d128_bf16_page64_layers3_kv4";
  pages64.page_tokens = 64;
  pages64.layers = 3;
  pages64.kv_heads = 4;
  pages64.group = 2;
  pages64.seed = seed++;
  out.push_back(pages64);
  for (int hd : {128, 256}) {
    Fp8SeqCase large;
    large.name = absl::StrCat("d", hd, "_large_logits");
    large.head_dim = hd;
    large.dtype = hd == 128 ? DType::kBF16 : DType::kFP16;
    large.q_gain = 8.f;
    large.seed = seed++;
    out.push_back(large);
    Fp8SeqCase outliers = large;
    outliers.name = absl::StrCat("d", hd, "_outlier_channels");
    outliers.q_gain = 1.f;
    outliers.outliers = true;
    outliers.seed = seed++;
    out.push_back(outliers);
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Fp8Steps, SequencesFp8Test, ::testing::ValuesIn(Fp8Cases()),
                         [](const ::testing::TestParamInfo<Fp8SeqCase>& i) { return i.param.name; });

}  // namespace
}  // namespace attnd::server
