// GPU tests of attnd::kernels::decode over a float8 e4m3 cache (KvFormat::kFp8E4M3).
//
// Each case: random K/V (never zeros; the hard cases too) rounded to the element type, per-kv-head descales from
// each head's largest magnitude (amax / 448, the usual calibration), the cache filled with the codes of
// attnd/fp8.h on the host except its last `append` rows a sequence, which LaunchAppend quantizes on the device from
// the element-type rows: those must be byte for byte the host's codes. Unused rows and pages hold the e4m3 NaN code,
// O, LSE and the workspace are poisoned. The answer is compared with a float64 attention over the dequantized
// cache (what the codes stand for):
//   max|O - O_f64| <= max|O_f64| / 128 + 1e-3 * max|V|   (O rounded to bf16 once; P in fp16)
// and LSE within 2e-3. Each case also prints RMSE and max error against float64 attention over the unquantized
// K/V: the cost of storing the cache in float8 (docs/kernels.md).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "attnd/fp8.h"
#include "attnd/half.h"
#include "attnd/kernels/decode.h"
#include "attnd/problem.h"
#include "gpu_test_util.h"

namespace attnd::kernels::decode {
namespace {

using ::attnd::testing::DeviceBuffer;
using ::attnd::testing::HaveSupportedGpu;
using ::attnd::testing::OutlierChannel;
using ::attnd::testing::RandomValue;

constexpr uint8_t kPoison8 = 0xFF;  // NaN in e4m3

struct Fp8Case {
  std::string name;
  int q_len = 1;
  int q_heads = 8;
  int kv_heads = 2;
  int head_dim = 128;
  DType dtype = DType::kBF16;
  std::vector<int32_t> lens;
  int page_size = 0;  // 0: contiguous
  int num_splits = 0;
  int append = 1;     // rows a sequence written by LaunchAppend
  float q_gain = 1.f;
  bool key_ramp = false;
  bool outliers = false;  // FA3's setup: a few channels of Q and K much larger than the rest
  uint32_t seed = 1;
};

void PrintTo(const Fp8Case& c, std::ostream* os) { *os << c.name; }

std::vector<Fp8Case> Cases() {
  std::vector<Fp8Case> out;
  uint32_t seed = 500;
  auto add = [&](std::string name, std::vector<int32_t> lens) -> Fp8Case& {
    Fp8Case c;
    c.name = std::move(name);
    c.lens = std::move(lens);
    c.seed = ++seed;
    out.push_back(c);
    return out.back();
  };
  for (int d : {64, 128, 256}) {
    for (int ps : {0, 16}) {
      for (int q : {1, 4}) {
        Fp8Case& c = add("d" + std::to_string(d) + (ps ? "_paged16" : "_contig") + "_q" + std::to_string(q),
                         {1, 17, 300, 1029});
        c.head_dim = d;
        c.page_size = ps;
        c.q_len = q;  // the one-key sequence takes a one-row append
      }
    }
  }
  for (int group : {1, 4, 8, 16}) {
    Fp8Case& c = add("gqa" + std::to_string(group), {33, 2000});
    c.q_heads = 2 * group;
    c.page_size = 64;
  }
  // 32 rows (8 q heads a kv head x 4 positions): the row block whose warps share each key slice two by two.
  for (int d : {64, 128, 256}) {
    Fp8Case& c = add("rows32_d" + std::to_string(d), {5, 300, 2100});
    c.head_dim = d;
    c.q_heads = 16;
    c.q_len = c.append = 4;
    c.page_size = 16;
  }
  // A d64 tile of 16 or 32 rows holds 128 keys, two of a split's 64-key units: 7 splits of 576 keys (9 units) each
  // end halfway through a tile, whose keys past the split's end must not count.
  for (int rows : {16, 32}) {
    for (int ps : {0, 16}) {
      Fp8Case& c = add("d64_rows" + std::to_string(rows) + (ps ? "_paged16" : "_contig") + "_splits7", {4000, 2500});
      c.head_dim = 64;
      c.q_heads = rows == 16 ? 8 : 16;
      c.q_len = c.append = 4;
      c.page_size = ps;
      c.num_splits = 7;
    }
  }
  {
    Fp8Case& c = add("fp16_d128_q16", {16, 40, 700});
    c.dtype = DType::kFP16;
    c.q_len = c.append = 16;
    c.page_size = 32;
  }
  for (int kind = 0; kind < 3; ++kind) {
    Fp8Case& c = add(kind == 0 ? "large_logits" : kind == 1 ? "rising_scores" : "outlier_channels", {5000, 3333});
    c.q_len = c.append = 4;
    c.num_splits = 7;
    c.page_size = kind == 1 ? 0 : 16;
    c.q_gain = kind == 0 ? 8.f : 1.5f;
    c.key_ramp = kind == 1;
    c.outliers = kind == 2;
  }
  {
    Fp8Case& c = add("long_ragged_paged16", {1, 2000, 32768});
    c.q_heads = 32;
    c.kv_heads = 8;
    c.page_size = 16;
  }
  return out;
}

// Float64 attention of one sequence: q [q_len, q_heads, D] (float values), k/v [len, kv_heads, D]; bottom-right
// causal when q_len > 1. o [q_len, q_heads, D], lse [q_heads, q_len].
void Attention64(const Fp8Case& c, int len, const std::vector<double>& q, const std::vector<double>& k,
                 const std::vector<double>& v, std::vector<double>& o, std::vector<double>& lse) {
  const int D = c.head_dim, Hq = c.q_heads, group = c.q_heads / c.kv_heads;
  const double scale = DefaultScale(D);
  o.assign(static_cast<size_t>(c.q_len) * Hq * D, 0.0);
  lse.assign(static_cast<size_t>(Hq) * c.q_len, -INFINITY);
  std::vector<double> s(len);
  for (int i = 0; i < c.q_len; ++i) {
    const int visible = c.q_len > 1 ? std::min(len, len - c.q_len + i + 1) : len;
    for (int h = 0; h < Hq; ++h) {
      const int kh = h / group;
      if (visible <= 0) continue;
      double m = -INFINITY;
      for (int j = 0; j < visible; ++j) {
        double dot = 0;
        const double* qr = &q[(static_cast<size_t>(i) * Hq + h) * D];
        const double* kr = &k[(static_cast<size_t>(j) * c.kv_heads + kh) * D];
        for (int d = 0; d < D; ++d) dot += qr[d] * kr[d];
        s[j] = dot * scale;
        m = std::max(m, s[j]);
      }
      double sum = 0;
      for (int j = 0; j < visible; ++j) sum += (s[j] = std::exp(s[j] - m));
      double* out = &o[(static_cast<size_t>(i) * Hq + h) * D];
      for (int j = 0; j < visible; ++j) {
        for (int d = 0; d < D; ++d) out[d] += s[j] / sum * v[(static_cast<size_t>(j) * c.kv_heads + kh) * D + d];
      }
      lse[static_cast<size_t>(h) * c.q_len + i] = m + std::log(sum);
    }
  }
}

// One case's host side: Q, each sequence's K/V, the per-kv-head descales, the layout and table, the cache as uploaded
// (the appended rows NaN) and as it must be after the append, the new rows, and K/V dequantized and unquantized.
struct Fp8Host {
  std::vector<uint16_t> q;
  BatchLayout layout;
  std::vector<int32_t> table;
  std::vector<float> k_descale, v_descale;
  std::vector<uint8_t> k_cache, v_cache, k_codes, v_codes;
  std::vector<std::vector<double>> kq, vq, kd, vd;  // per sequence: dequantized, and unquantized, as doubles
  std::vector<uint16_t> new_k, new_v;
  double v_max = 0;  // the largest dequantized |V|
};

// The case's layout over a float8 cache: contiguous with 3 spare rows, or pages drawn from a shuffled pool with 3
// spare pages; `table` and `cache_rows` (rows of K, as of V, the cache holds) filled.
BatchLayout Fp8Layout(const Fp8Case& c, std::mt19937& rng, std::vector<int32_t>* table, int64_t* cache_rows) {
  const int B = static_cast<int>(c.lens.size()), D = c.head_dim, Hq = c.q_heads, Hkv = c.kv_heads;
  BatchLayout l;
  l.batch = B;
  l.q_len = c.q_len;
  l.q_heads = Hq;
  l.kv_heads = Hkv;
  l.head_dim = D;
  l.dtype = c.dtype;
  l.mask = c.q_len > 1 ? Mask::kCausalBottomRight : Mask::kNone;
  l.scale = DefaultScale(D);
  l.want_lse = true;
  l.q = l.o = ContiguousStrides(c.q_len, Hq, D);
  l.kv_format = KvFormat::kFp8E4M3;
  const int max_len = *std::max_element(c.lens.begin(), c.lens.end());
  if (c.page_size == 0) {
    l.kv_storage = KvStorage::kContiguous;
    l.kv_capacity = max_len + 3;
    l.k = l.v = ContiguousStrides(l.kv_capacity, Hkv, D);
    *cache_rows = int64_t{B} * l.kv_capacity;
  } else {
    int pages = 0, max_pages = 0;
    for (int32_t n : c.lens) {
      pages += (n + c.page_size - 1) / c.page_size;
      max_pages = std::max(max_pages, (n + c.page_size - 1) / c.page_size);
    }
    l.kv_storage = KvStorage::kPaged;
    l.paged = PagedKv{c.page_size, pages + 3, max_pages + 1};
    l.k = l.v = ContiguousStrides(c.page_size, Hkv, D);
    std::vector<int32_t> pool(l.paged.num_pages);
    std::iota(pool.begin(), pool.end(), 0);
    std::shuffle(pool.begin(), pool.end(), rng);
    table->assign(static_cast<size_t>(B) * l.paged.max_pages_per_seq, -1);
    for (int b = 0, next = 0; b < B; ++b) {
      for (int j = 0; j * c.page_size < c.lens[b]; ++j) (*table)[b * l.paged.max_pages_per_seq + j] = pool[next++];
    }
    *cache_rows = int64_t{l.paged.num_pages} * c.page_size;
  }
  return l;
}

Fp8Host MakeFp8Host(const Fp8Case& c) {
  Fp8Host h;
  std::vector<uint16_t>& q = h.q;
  BatchLayout& l = h.layout;
  std::vector<int32_t>& table = h.table;
  std::vector<float>&k_descale = h.k_descale, &v_descale = h.v_descale;
  std::vector<uint8_t>&k_cache = h.k_cache, &v_cache = h.v_cache, &k_codes = h.k_codes, &v_codes = h.v_codes;
  std::vector<std::vector<double>>&kq = h.kq, &vq = h.vq, &kd = h.kd, &vd = h.vd;
  std::vector<uint16_t>&new_k = h.new_k, &new_v = h.new_v;
  double& v_max = h.v_max;
  const int B = static_cast<int>(c.lens.size()), D = c.head_dim, Hq = c.q_heads, Hkv = c.kv_heads;
  const int row = Hkv * D;
  std::mt19937 rng(c.seed);
  auto round = [&](float x) { return HalfToFloat(c.dtype, FloatToHalf(c.dtype, x)); };

  // Q, and each sequence's K/V in the element type's values.
  q.assign(static_cast<size_t>(B) * c.q_len * Hq * D, 0);
  for (size_t i = 0; i < q.size(); ++i) {
    float x = RandomValue(rng) * c.q_gain;
    if (c.outliers && OutlierChannel(static_cast<int>(i % D))) x *= 16.f;
    q[i] = FloatToHalf(c.dtype, x);
  }
  std::vector<std::vector<float>> k(B), v(B);
  std::vector<float> k_amax(Hkv, 0.f), v_amax(Hkv, 0.f);
  for (int b = 0; b < B; ++b) {
    k[b].resize(static_cast<size_t>(c.lens[b]) * row);
    v[b].resize(k[b].size());
    for (size_t i = 0; i < k[b].size(); ++i) {
      const size_t j = i / row;
      const int h = static_cast<int>(i % row / D), d = static_cast<int>(i % D);
      const float ramp = c.key_ramp ? 0.25f + 2.0f * static_cast<float>(j) / static_cast<float>(c.lens[b]) : 1.f;
      float kx = RandomValue(rng) * ramp;
      if (c.outliers && OutlierChannel(d)) kx *= 16.f;
      k[b][i] = round(kx);
      v[b][i] = round(RandomValue(rng));
      k_amax[h] = std::max(k_amax[h], std::abs(k[b][i]));
      v_amax[h] = std::max(v_amax[h], std::abs(v[b][i]));
    }
  }
  k_descale.resize(Hkv);
  v_descale.resize(Hkv);
  for (int h = 0; h < Hkv; ++h) {
    k_descale[h] = k_amax[h] / kFp8E4M3Max;
    v_descale[h] = v_amax[h] / kFp8E4M3Max;
  }

  // The cache: codes on the host, the appended rows left NaN for LaunchAppend.
  int64_t cache_rows = 0;
  l = Fp8Layout(c, rng, &table, &cache_rows);
  auto row_at = [&](int b, int j) -> size_t {
    if (c.page_size == 0) return (static_cast<size_t>(b) * l.kv_capacity + j) * row;
    return (static_cast<size_t>(table[b * l.paged.max_pages_per_seq + j / c.page_size]) * c.page_size +
            j % c.page_size) * row;
  };
  k_cache.assign(cache_rows * row, kPoison8);
  v_cache.assign(k_cache.size(), kPoison8);
  k_codes.assign(k_cache.size(), kPoison8);
  v_codes.assign(k_cache.size(), kPoison8);
  kq.resize(B);
  vq.resize(B);
  kd.resize(B);
  vd.resize(B);
  new_k.assign(static_cast<size_t>(B) * c.append * row, 0);
  new_v.assign(new_k.size(), 0);
  for (int b = 0; b < B; ++b) {
    kq[b].resize(k[b].size());
    vq[b].resize(k[b].size());
    kd[b].assign(k[b].begin(), k[b].end());
    vd[b].assign(v[b].begin(), v[b].end());
    for (int j = 0; j < c.lens[b]; ++j) {
      for (int e = 0; e < row; ++e) {
        const size_t i = static_cast<size_t>(j) * row + e;
        const int h = e / D;
        const uint8_t kc = FloatToFp8E4M3(k[b][i] / k_descale[h]), vc = FloatToFp8E4M3(v[b][i] / v_descale[h]);
        kq[b][i] = static_cast<double>(Fp8E4M3ToFloat(kc)) * k_descale[h];
        vq[b][i] = static_cast<double>(Fp8E4M3ToFloat(vc)) * v_descale[h];
        v_max = std::max(v_max, std::abs(vq[b][i]));
        k_codes[row_at(b, j) + e] = kc;
        v_codes[row_at(b, j) + e] = vc;
        const int t = j - (c.lens[b] - c.append);
        if (t >= 0) {
          const size_t n = (static_cast<size_t>(b) * c.append + t) * row + e;
          new_k[n] = FloatToHalf(c.dtype, k[b][i]);
          new_v[n] = FloatToHalf(c.dtype, v[b][i]);
        } else {
          k_cache[row_at(b, j) + e] = kc;
          v_cache[row_at(b, j) + e] = vc;
        }
      }
    }
  }

  return h;
}

// Float64 answers of each sequence: over the dequantized K/V (O and LSE), and O over the unquantized K/V.
struct Fp8Refs {
  std::vector<std::vector<double>> o64, lse64, o_exact;
};

// One launch's O and LSE against the references, sequence by sequence; with `print`, the format's error too.
void CheckFp8Outputs(const Fp8Case& c, const Fp8Host& host, const Fp8Refs& refs, const std::vector<uint16_t>& o,
                     const std::vector<float>& lse, const std::string& what, bool print) {
  const int B = static_cast<int>(c.lens.size()), D = c.head_dim, Hq = c.q_heads;
  const BatchLayout& l = host.layout;
  for (int b = 0; b < B; ++b) {
    double err = 0, o_max = 0, lse_err = 0, sq = 0, exact_max = 0;
    int64_t n = 0;
    for (int i = 0; i < c.q_len; ++i) {
      const bool sees_none = l.mask == Mask::kCausalBottomRight && LastVisibleKey(l.mask, c.q_len, c.lens[b], i) < 0;
      for (int h = 0; h < Hq; ++h) {
        for (int d = 0; d < D; ++d) {
          const size_t r = (static_cast<size_t>(i) * Hq + h) * D + d;
          const double x = HalfToFloat(c.dtype, o[b * refs.o64[b].size() + r]);
          ASSERT_FALSE(std::isnan(x)) << what << ": O not written at b " << b << " pos " << i << " head " << h;
          if (sees_none) {
            ASSERT_EQ(x, 0.0) << what << ": a row that sees no key must be 0";
            continue;
          }
          err = std::max(err, std::abs(x - refs.o64[b][r]));
          o_max = std::max(o_max, std::abs(refs.o64[b][r]));
          sq += (x - refs.o_exact[b][r]) * (x - refs.o_exact[b][r]);
          exact_max = std::max(exact_max, std::abs(x - refs.o_exact[b][r]));
          ++n;
        }
        const float got = lse[(static_cast<size_t>(b) * Hq + h) * c.q_len + i];
        ASSERT_FALSE(std::isnan(got)) << what << ": LSE not written";
        const double want = refs.lse64[b][static_cast<size_t>(h) * c.q_len + i];
        if (!sees_none) lse_err = std::max(lse_err, std::abs(got - want) / (2e-3 + 1e-5 * std::abs(want)));
      }
    }
    EXPECT_LE(err, o_max / 128 + 1e-3 * host.v_max)
        << what << ": sequence " << b << " (kv_len " << c.lens[b] << ") error " << err << " against the dequantized";
    EXPECT_LE(lse_err, 1.0) << what << ": sequence " << b << " LSE error over tolerance x" << lse_err;
    if (print && n > 0) {
      std::printf("[ fp8 kv   ] %s seq %d kv_len %d: vs unquantized RMSE %.3e max %.3e (vs dequantized max %.3e)\n",
                  c.name.c_str(), b, c.lens[b], std::sqrt(sq / n), exact_max, err);
    }
  }
}

class GpuDecodeFp8Test : public ::testing::TestWithParam<Fp8Case> {};

TEST_P(GpuDecodeFp8Test, MatchesTheDequantizedReference) {
  if (!HaveSupportedGpu()) GTEST_SKIP() << "no sm_90 / sm_120 GPU";
  const Fp8Case& c = GetParam();
  const int B = static_cast<int>(c.lens.size()), D = c.head_dim, Hq = c.q_heads, Hkv = c.kv_heads;
  const Fp8Host host = MakeFp8Host(c);
  const BatchLayout& l = host.layout;
  const std::vector<int32_t>& table = host.table;
  const std::vector<uint16_t>& q = host.q;

  DeviceBuffer<uint16_t> q_d, o_d, nk_d, nv_d;
  DeviceBuffer<uint8_t> k_d, v_d;
  DeviceBuffer<float> lse_d, kds_d, vds_d;
  DeviceBuffer<int32_t> lens_d, table_d;
  CUDA_OK(q_d.Alloc(q.size()));
  CUDA_OK(q_d.Upload(q));
  CUDA_OK(k_d.Alloc(host.k_cache.size()));
  CUDA_OK(k_d.Upload(host.k_cache));
  CUDA_OK(v_d.Alloc(host.v_cache.size()));
  CUDA_OK(v_d.Upload(host.v_cache));
  CUDA_OK(nk_d.Alloc(host.new_k.size()));
  CUDA_OK(nk_d.Upload(host.new_k));
  CUDA_OK(nv_d.Alloc(host.new_v.size()));
  CUDA_OK(nv_d.Upload(host.new_v));
  CUDA_OK(kds_d.Alloc(Hkv));
  CUDA_OK(kds_d.Upload(host.k_descale));
  CUDA_OK(vds_d.Alloc(Hkv));
  CUDA_OK(vds_d.Upload(host.v_descale));
  CUDA_OK(o_d.Alloc(q.size()));
  CUDA_OK(lse_d.Alloc(static_cast<size_t>(B) * Hq * c.q_len));
  CUDA_OK(lens_d.Alloc(B));
  CUDA_OK(table_d.Alloc(table.size()));
  if (!table.empty()) CUDA_OK(table_d.Upload(table));

  // The append quantizes on the device: the whole cache must then be the host's codes, NaN where no row is.
  std::vector<int32_t> before(c.lens);
  for (int32_t& n : before) n -= c.append;
  CUDA_OK(lens_d.Upload(before));
  const Strides rows = ContiguousStrides(c.append, Hkv, D);
  absl::StatusOr<AppendPlan> ap = MakeAppendPlan(l, c.append, rows, rows, before, table);
  ASSERT_TRUE(ap.ok()) << ap.status();
  AppendTensors at{nk_d.ptr, nv_d.ptr, k_d.ptr, v_d.ptr, lens_d.ptr, table.empty() ? nullptr : table_d.ptr};
  at.k_descale = kds_d.ptr;
  at.v_descale = vds_d.ptr;
  absl::Status st = LaunchAppend(*ap, at, nullptr);
  ASSERT_TRUE(st.ok()) << st;
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<uint8_t> got_k, got_v;
  CUDA_OK(k_d.Download(got_k));
  CUDA_OK(v_d.Download(got_v));
  int64_t wrong = 0;
  for (size_t i = 0; i < got_k.size(); ++i) wrong += (got_k[i] != host.k_codes[i]) + (got_v[i] != host.v_codes[i]);
  ASSERT_EQ(wrong, 0) << "cache bytes that differ from the host's e4m3 codes after the append";
  CUDA_OK(lens_d.Upload(c.lens));

  Fp8Refs refs;
  refs.o64.resize(B);
  refs.lse64.resize(B);
  refs.o_exact.resize(B);
  std::vector<double> unused_lse;
  for (int b = 0; b < B; ++b) {
    std::vector<double> qb(static_cast<size_t>(c.q_len) * Hq * D);
    for (size_t i = 0; i < qb.size(); ++i) qb[i] = HalfToFloat(c.dtype, q[b * qb.size() + i]);
    Attention64(c, c.lens[b], qb, host.kq[b], host.vq[b], refs.o64[b], refs.lse64[b]);
    Attention64(c, c.lens[b], qb, host.kd[b], host.vd[b], refs.o_exact[b], unused_lse);
  }

  for (const int num_splits : {c.num_splits, 1}) {
    DecodeOptions options;
    options.num_splits = num_splits;
    absl::StatusOr<DecodePlan> plan = MakeDecodePlan(l, c.lens, table, options);
    ASSERT_TRUE(plan.ok()) << plan.status();
    if (c.head_dim == 64 && num_splits == 7) {
      ASSERT_EQ(plan->split_keys % 128, 64) << "the case must end its splits halfway through a 128-key tile";
    }
    DeviceBuffer<uint8_t> ws;
    DeviceBuffer<int32_t> counters;
    CUDA_OK(ws.Alloc(plan->workspace_bytes));
    CUDA_OK(counters.Alloc(plan->counter_bytes / sizeof(int32_t)));
    CUDA_OK(cudaMemset(counters.ptr, 0, std::max<size_t>(plan->counter_bytes, 1)));
    CUDA_OK(cudaMemset(ws.ptr, 0xFF, std::max<size_t>(plan->workspace_bytes, 1)));
    CUDA_OK(cudaMemset(o_d.ptr, 0xFF, o_d.count * sizeof(uint16_t)));
    CUDA_OK(cudaMemset(lse_d.ptr, 0xFF, lse_d.count * sizeof(float)));
    DecodeTensors t{q_d.ptr, k_d.ptr, v_d.ptr, o_d.ptr, lse_d.ptr, lens_d.ptr, table.empty() ? nullptr : table_d.ptr};
    t.k_descale = kds_d.ptr;
    t.v_descale = vds_d.ptr;
    const DecodeWorkspace w{plan->workspace_bytes ? ws.ptr : nullptr, plan->counter_bytes ? counters.ptr : nullptr};
    st = LaunchDecode(*plan, t, w, nullptr);
    ASSERT_TRUE(st.ok()) << st;
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<uint16_t> o;
    std::vector<float> lse;
    CUDA_OK(o_d.Download(o));
    CUDA_OK(lse_d.Download(lse));
    CheckFp8Outputs(c, host, refs, o, lse, "splits " + std::to_string(plan->max_splits), num_splits == c.num_splits);
    if (HasFatalFailure()) return;
  }
}

INSTANTIATE_TEST_SUITE_P(DecodeFp8, GpuDecodeFp8Test, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Fp8Case>& info) { return info.param.name; });

// Float8 layouts and tensors checked before any kernel (no GPU needed).
TEST(DecodeFp8Validation, NamesTheField) {
  BatchLayout l;
  l.batch = 1;
  l.q_heads = l.kv_heads = 1;
  l.head_dim = 128;
  l.scale = 0.125f;
  l.q = l.o = ContiguousStrides(1, 1, 128);
  l.k = l.v = ContiguousStrides(64, 1, 128);
  l.kv_capacity = 64;
  l.kv_format = KvFormat::kFp8E4M3;
  DecodeOptions options;
  options.sm_count = 4;
  BatchLayout odd = l;
  odd.k.head = 8;  // a 16-byte copy of float8 is 16 elements
  EXPECT_EQ(MakeDecodePlan(odd, {64}, {}, options).status().message().substr(0, 13), "layout.k.head");
  BatchLayout fused = l;
  fused.append = true;
  fused.new_k = fused.new_v = ContiguousStrides(1, 1, 128);
  EXPECT_EQ(MakeDecodePlan(fused, {64}, {}, options).status().message().substr(0, 14), "layout.append:");
  absl::StatusOr<DecodePlan> plan = MakeDecodePlan(l, {64}, {}, options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  alignas(16) static uint16_t buf[128];
  alignas(16) static int32_t len[1] = {64};
  alignas(16) static float scales[4] = {1.f, 1.f, 1.f, 1.f};
  DecodeTensors t{buf, buf, buf, buf, nullptr, len, nullptr};
  EXPECT_EQ(LaunchDecode(*plan, t, {}, nullptr).message().substr(0, 18), "tensors.k_descale:");
  t.k_descale = scales;
  EXPECT_EQ(LaunchDecode(*plan, t, {}, nullptr).message().substr(0, 18), "tensors.v_descale:");
  t.v_descale = reinterpret_cast<const float*>(reinterpret_cast<const uint8_t*>(scales) + 2);
  EXPECT_EQ(LaunchDecode(*plan, t, {}, nullptr).message().substr(0, 18), "tensors.v_descale:");
  // A descale given for a 16-bit cache would be ignored: refused instead.
  BatchLayout bf16 = l;
  bf16.kv_format = KvFormat::kAsQuery;
  absl::StatusOr<DecodePlan> plain = MakeDecodePlan(bf16, {64}, {}, options);
  ASSERT_TRUE(plain.ok()) << plain.status();
  t.v_descale = nullptr;
  EXPECT_EQ(LaunchDecode(*plain, t, {}, nullptr).message().substr(0, 18), "tensors.k_descale:");
  // The gather out of a float8 cache needs its descales.
  BatchLayout paged = l;
  paged.kv_storage = KvStorage::kPaged;
  paged.paged = PagedKv{16, 4, 4};
  paged.k = paged.v = ContiguousStrides(16, 1, 128);
  absl::StatusOr<GatherPlan> gather = MakeGatherPlan(paged, 64, l.k, l.v, {64}, {0, 1, 2, 3});
  ASSERT_TRUE(gather.ok()) << gather.status();
  GatherTensors g{buf, buf, buf, buf, len, len};
  EXPECT_EQ(LaunchGather(*gather, g, nullptr).message().substr(0, 18), "tensors.k_descale:");
}

// The gather out of a float8 pool: every element of every gathered row is the host's dequantized code rounded to the
// element type, bit for bit; rows past a sequence's length keep their poison.
TEST(DecodeFp8Gather, DequantizesEveryKeyFromItsPage) {
  if (!HaveSupportedGpu()) GTEST_SKIP() << "no sm_90 / sm_120 GPU";
  for (const DType dtype : {DType::kBF16, DType::kFP16}) {
    for (const int head_dim : {64, 128, 256}) {
      SCOPED_TRACE(std::to_string(head_dim) + (dtype == DType::kBF16 ? " bf16" : " fp16"));
      const int kv_heads = 3, page = 16, num_pages = 24, max_pages = 5, capacity = 80, row = kv_heads * head_dim;
      const std::vector<int32_t> lens = {33, 0, 80, 1};
      const int batch = static_cast<int>(lens.size());
      std::mt19937 rng(head_dim);
      std::vector<int32_t> pages(num_pages);
      std::iota(pages.begin(), pages.end(), 0);
      std::shuffle(pages.begin(), pages.end(), rng);
      std::vector<int32_t> table(batch * max_pages, -1);
      for (int b = 0, next = 0; b < batch; ++b) {
        for (int j = 0; j * page < lens[b]; ++j) table[b * max_pages + j] = pages[next++];
      }
      std::vector<uint8_t> k(static_cast<size_t>(num_pages) * page * row), v(k.size());
      for (size_t i = 0; i < k.size(); ++i) {  // every finite code, NaN (0x7f / 0xff) left out
        k[i] = static_cast<uint8_t>(rng() % 255);
        v[i] = static_cast<uint8_t>(rng() % 255);
        if ((k[i] & 0x7f) == 0x7f) k[i] ^= 1;
        if ((v[i] & 0x7f) == 0x7f) v[i] ^= 1;
      }
      const std::vector<float> k_descale = {0.013f, 1.0f, 3.7f}, v_descale = {0.5f, 0.0021f, 11.f};
      BatchLayout cache;
      cache.batch = batch;
      cache.q_heads = cache.kv_heads = kv_heads;
      cache.head_dim = head_dim;
      cache.dtype = dtype;
      cache.kv_format = KvFormat::kFp8E4M3;
      cache.kv_storage = KvStorage::kPaged;
      cache.k = cache.v = ContiguousStrides(page, kv_heads, head_dim);
      cache.paged = PagedKv{page, num_pages, max_pages};
      const Strides out = ContiguousStrides(capacity, kv_heads, head_dim);
      absl::StatusOr<GatherPlan> plan = MakeGatherPlan(cache, capacity, out, out, lens, table);
      ASSERT_TRUE(plan.ok()) << plan.status();
      DeviceBuffer<uint8_t> dk, dv;
      DeviceBuffer<uint16_t> dok, dov;
      DeviceBuffer<int32_t> dlens, dtable;
      DeviceBuffer<float> dks, dvs;
      CUDA_OK(dk.Alloc(k.size()));
      CUDA_OK(dk.Upload(k));
      CUDA_OK(dv.Alloc(v.size()));
      CUDA_OK(dv.Upload(v));
      CUDA_OK(dok.Alloc(static_cast<size_t>(batch) * capacity * row));
      CUDA_OK(dov.Alloc(dok.count));
      CUDA_OK(cudaMemset(dok.ptr, 0xFF, dok.count * 2));
      CUDA_OK(cudaMemset(dov.ptr, 0xFF, dov.count * 2));
      CUDA_OK(dlens.Alloc(lens.size()));
      CUDA_OK(dlens.Upload(lens));
      CUDA_OK(dtable.Alloc(table.size()));
      CUDA_OK(dtable.Upload(table));
      CUDA_OK(dks.Alloc(kv_heads));
      CUDA_OK(dks.Upload(k_descale));
      CUDA_OK(dvs.Alloc(kv_heads));
      CUDA_OK(dvs.Upload(v_descale));
      GatherTensors t{dk.ptr, dv.ptr, dok.ptr, dov.ptr, dlens.ptr, dtable.ptr, dks.ptr, dvs.ptr};
      absl::Status st = LaunchGather(*plan, t, nullptr);
      ASSERT_TRUE(st.ok()) << st;
      CUDA_OK(cudaDeviceSynchronize());
      std::vector<uint16_t> ok, ov;
      CUDA_OK(dok.Download(ok));
      CUDA_OK(dov.Download(ov));
      int64_t wrong = 0, touched = 0;
      for (int b = 0; b < batch; ++b) {
        for (int key = 0; key < capacity; ++key) {
          for (int e = 0; e < row; ++e) {
            const size_t at = (static_cast<size_t>(b) * capacity + key) * row + e;
            if (key >= lens[b]) {
              touched += ok[at] != 0xFFFF || ov[at] != 0xFFFF;
              continue;
            }
            const size_t src = (static_cast<size_t>(table[b * max_pages + key / page]) * page + key % page) * row + e;
            const int h = e / head_dim;
            wrong += ok[at] != FloatToHalf(dtype, Fp8E4M3ToFloat(k[src]) * k_descale[h]);
            wrong += ov[at] != FloatToHalf(dtype, Fp8E4M3ToFloat(v[src]) * v_descale[h]);
          }
        }
      }
      EXPECT_EQ(wrong, 0) << "gathered elements that differ from the host's dequantized codes";
      EXPECT_EQ(touched, 0) << "elements written past a sequence's length";
    }
  }
}

}  // namespace
}  // namespace attnd::kernels::decode
