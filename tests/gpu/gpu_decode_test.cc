// GPU tests of attnd::kernels::decode against the double-precision CPU reference, sequence by sequence.
//
// Each case: random inputs (never zeros); O, LSE and the workspace poisoned with NaN before the launch, and
// the K/V rows and pages no sequence owns filled with NaN too (a kernel that reads past kv_len or through an
// unused table entry turns the output into NaN). Then, per sequence:
//   max|O - O_f64| <= kTolFactor * max|O_ref - O_f64| + kAtol
// where O_ref is the plain reference (fp32 math, O rounded once to the element type); no NaN anywhere (every
// element was written) and the padding between O's heads untouched; rows that see no key exactly 0 with
// LSE -inf; LSE close to the f64 one. Split cases are also run unsplit (num_splits = 1) and compared.
// Without a GPU the tests skip. For compute-sanitizer, --gtest_filter='-*long*' leaves the long cases out.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "attnd/half.h"
#include "attnd/kernels/decode.h"
#include "attnd/problem.h"
#include "attnd/reference.h"
#include "gpu_test_util.h"

namespace attnd::kernels::decode {
namespace {

using ::attnd::testing::DeviceBuffer;
using ::attnd::testing::HaveSupportedGpu;
using ::attnd::testing::OutlierChannel;
using ::attnd::testing::RandomValue;

constexpr double kTolFactor = 3.0;
constexpr double kAtol = 1e-3;
constexpr double kLseAtol = 2e-3;
constexpr uint16_t kPoison16 = 0xFFFF;  // NaN in bf16 and fp16

struct DecodeCase {
  std::string name;
  int q_len = 1;
  int q_heads = 8;
  int kv_heads = 2;
  int head_dim = 128;
  DType dtype = DType::kBF16;
  bool causal = false;
  bool lse = true;
  std::vector<int32_t> lens;
  bool paged = false;
  int page_size = 16;
  int shared_pages = 0;  // sequences 1.. share the first pages of sequence 0 (a common prefix)
  int num_splits = 0;    // 0: the heuristic
  bool compare_unsplit = true;
  bool padded = false;   // Q and O heads padded by 8 elements, K/V with spare capacity rows
  int append = 0;        // the last `append` rows of each sequence are written by LaunchAppend first
  double q_gain = 1.0;   // > 1 sharpens the softmax (large logits)
  bool key_ramp = false;  // key norms grow along the sequence: the running max keeps moving
  bool outliers = false;  // three channels of Q and K 16x larger
  uint32_t seed = 1;
};

void PrintTo(const DecodeCase& c, std::ostream* os) { *os << c.name; }

std::vector<DecodeCase> Cases() {
  std::vector<DecodeCase> out;
  uint32_t seed = 100;
  auto add = [&](std::string name, std::vector<int32_t> lens) -> DecodeCase& {
    DecodeCase c;
    c.name = std::move(name);
    c.lens = std::move(lens);
    c.seed = ++seed;
    out.push_back(c);
    return out.back();
  };
  // q_len 1, 2, 4, 16 (bottom-right causal when > 1), kv_len 1 and 17 and a few hundred in one batch.
  for (int q : {1, 2, 4, 16}) {
    DecodeCase& c = add("q" + std::to_string(q) + "_contig", {1, 17, 300});
    c.q_len = q;
    c.causal = q > 1;
    DecodeCase& p = add("q" + std::to_string(q) + "_paged16", {1, 17, 300});
    p.q_len = q;
    p.causal = q > 1;
    p.paged = true;
  }
  // Every head_dim in both dtypes, paged, a ragged batch.
  for (int d : {64, 128, 256}) {
    for (DType t : {DType::kBF16, DType::kFP16}) {
      DecodeCase& c = add("d" + std::to_string(d) + (t == DType::kBF16 ? "_bf16" : "_fp16"), {5, 1000, 4099});
      c.head_dim = d;
      c.dtype = t;
      c.paged = true;
      c.page_size = 64;
      c.q_len = 2;
      c.causal = true;
    }
  }
  // GQA groups 1, 4, 8, 16 with q_len 1 and 4 (rows up to 64), and 16 x 16 = 256 rows (four row blocks).
  for (int group : {1, 4, 8, 16}) {
    for (int q : {1, 4}) {
      DecodeCase& c = add("gqa" + std::to_string(group) + "_q" + std::to_string(q), {33, 2000});
      c.q_heads = 2 * group;
      c.kv_heads = 2;
      c.q_len = q;
      c.causal = q > 1;
      c.paged = true;
    }
  }
  for (int d : {64, 128, 256}) {
    DecodeCase& c = add("rows256_d" + std::to_string(d), {40, 700});
    c.q_heads = 16;
    c.kv_heads = 1;
    c.q_len = 16;
    c.causal = true;
    c.head_dim = d;
  }
  // Page-boundary lengths: full pages, one past (a page holding one token), one short.
  for (int ps : {16, 64, 256}) {
    DecodeCase& c = add("pages" + std::to_string(ps), {ps, ps + 1, 2 * ps - 1, 3 * ps, 1});
    c.paged = true;
    c.page_size = ps;
    c.q_len = 4;
    c.causal = true;
  }
  // Shared prefix pages, shuffled in the pool (every paged case shuffles its pages).
  {
    DecodeCase& c = add("shared_prefix", {700, 650, 513, 1030});
    c.paged = true;
    c.page_size = 32;
    c.shared_pages = 16;
  }
  // Fewer keys than query rows: the first rows see no key.
  {
    DecodeCase& c = add("kv_shorter_than_q", {1, 5, 16, 20});
    c.q_len = 16;
    c.causal = true;
    c.paged = true;
  }
  // Hard data, forced into several splits and compared with one.
  for (int kind = 0; kind < 3; ++kind) {
    DecodeCase& c = add(kind == 0 ? "large_logits" : kind == 1 ? "rising_scores" : "outlier_channels", {5000, 3333});
    c.q_len = 4;
    c.causal = true;
    c.num_splits = 7;
    c.q_gain = kind == 0 ? 8.0 : 1.5;
    c.key_ramp = kind == 1;
    c.outliers = kind == 2;
    c.paged = kind != 1;
  }
  {
    DecodeCase& c = add("fp16_large_logits", {4096});
    c.dtype = DType::kFP16;
    c.q_gain = 8.0;
    c.num_splits = 5;
  }
  // Strided Q/O (padded heads) and K/V buffers longer than the sequences.
  {
    DecodeCase& c = add("padded_strides", {100, 1, 999});
    c.padded = true;
    c.q_len = 3;
    c.causal = true;
  }
  // Append: the last rows of each sequence go through LaunchAppend, across a page boundary.
  {
    DecodeCase& c = add("append_paged", {16, 30, 47});
    c.paged = true;
    c.append = 3;
    c.q_len = 3;
    c.causal = true;
  }
  {
    DecodeCase& c = add("append_contig", {5, 64});
    c.append = 4;
    c.q_len = 4;
    c.causal = true;
  }
  // Fused appends: new rows straddling a split boundary (130 keys, two splits of 128), four row blocks reading
  // them, the largest head_dim in fp16, one token per step on a GQA group of 4 with many splits.
  {
    DecodeCase& c = add("append_split_boundary", {130, 7, 64});
    c.paged = true;
    c.append = c.q_len = 4;
    c.causal = true;
    c.num_splits = 2;
  }
  {
    DecodeCase& c = add("append_rows256", {40, 700});
    c.q_heads = 16;
    c.kv_heads = 1;
    c.append = c.q_len = 16;
    c.causal = true;
    c.paged = true;
    c.num_splits = 3;
  }
  {
    DecodeCase& c = add("append_d256_fp16", {5, 1000});
    c.head_dim = 256;
    c.dtype = DType::kFP16;
    c.append = c.q_len = 2;
    c.causal = true;
    c.paged = true;
    c.page_size = 64;
  }
  {
    DecodeCase& c = add("append_decode_step", {4096, 1, 4097});
    c.q_heads = 32;
    c.kv_heads = 8;
    c.append = c.q_len = 1;
    c.paged = true;
  }
  // Long and ragged: lengths from 1 to 32k in one launch, the split heuristic at work, and one 128k sequence.
  {
    DecodeCase& c = add("long_ragged_paged16", {1, 7, 2000, 8191, 32768});
    c.paged = true;
    c.q_heads = 32;
    c.kv_heads = 8;
  }
  {
    DecodeCase& c = add("long_ragged_q4_paged64", {300, 32768, 4097, 16});
    c.paged = true;
    c.page_size = 64;
    c.q_len = 4;
    c.causal = true;
  }
  {
    DecodeCase& c = add("long_32k_contig_d64", {32768, 32768});
    c.head_dim = 64;
    c.dtype = DType::kFP16;
  }
  {
    DecodeCase& c = add("long_128k_paged16", {131072});
    c.paged = true;
    c.q_heads = 8;
    c.kv_heads = 1;
  }
  return out;
}

// One case's inputs on the host: Q, each sequence's logical K/V rows, the cache layout they are stored in.
struct HostCase {
  BatchLayout layout;
  std::vector<uint16_t> q;                     // layout.q strides
  std::vector<std::vector<uint16_t>> k, v;     // per sequence [len, kv_heads, head_dim]
  std::vector<uint16_t> k_cache, v_cache;      // contiguous buffers or page pools; unused rows NaN
  std::vector<int32_t> table;                  // paged only
  size_t o_elems = 0;
};

HostCase MakeHostCase(const DecodeCase& c) {
  HostCase h;
  const int B = static_cast<int>(c.lens.size()), D = c.head_dim, Hq = c.q_heads, Hkv = c.kv_heads;
  BatchLayout& l = h.layout;
  l.batch = B;
  l.q_len = c.q_len;
  l.q_heads = Hq;
  l.kv_heads = Hkv;
  l.head_dim = D;
  l.dtype = c.dtype;
  l.mask = c.causal ? Mask::kCausalBottomRight : Mask::kNone;
  l.scale = DefaultScale(D);
  l.want_lse = c.lse;
  const int head_stride = c.padded ? D + 8 : D;
  l.q = l.o = Strides{int64_t{c.q_len} * Hq * head_stride, int64_t{Hq} * head_stride, head_stride};
  h.o_elems = static_cast<size_t>(B) * l.o.batch;

  std::mt19937 rng(c.seed);
  auto elem = [&](float x) { return FloatToHalf(c.dtype, x); };
  h.q.assign(static_cast<size_t>(B) * l.q.batch, kPoison16);
  for (int b = 0; b < B; ++b) {
    for (int i = 0; i < c.q_len; ++i) {
      for (int hh = 0; hh < Hq; ++hh) {
        for (int d = 0; d < D; ++d) {
          float x = RandomValue(rng) * static_cast<float>(c.q_gain);
          if (c.outliers && OutlierChannel(d)) x *= 16.f;
          h.q[b * l.q.batch + i * l.q.seq + hh * l.q.head + d] = elem(x);
        }
      }
    }
  }
  h.k.resize(B);
  h.v.resize(B);
  const int share_rows = c.shared_pages * c.page_size;
  for (int b = 0; b < B; ++b) {
    const int len = c.lens[b];
    h.k[b].resize(static_cast<size_t>(len) * Hkv * D);
    h.v[b].resize(h.k[b].size());
    for (int j = 0; j < len; ++j) {
      const float ramp = c.key_ramp ? 0.25f + 2.0f * static_cast<float>(j) / static_cast<float>(len) : 1.f;
      for (int hh = 0; hh < Hkv; ++hh) {
        for (int d = 0; d < D; ++d) {
          const size_t at = (static_cast<size_t>(j) * Hkv + hh) * D + d;
          if (b > 0 && j < share_rows) {  // the shared prefix: the same rows as sequence 0
            h.k[b][at] = h.k[0][at];
            h.v[b][at] = h.v[0][at];
            continue;
          }
          float kx = RandomValue(rng) * ramp;
          if (c.outliers && OutlierChannel(d)) kx *= 16.f;
          h.k[b][at] = elem(kx);
          h.v[b][at] = elem(RandomValue(rng));
        }
      }
    }
  }

  const int row_elems = Hkv * D;
  if (!c.paged) {
    const int capacity = *std::max_element(c.lens.begin(), c.lens.end()) + (c.padded ? 40 : 0);
    l.kv_storage = KvStorage::kContiguous;
    l.kv_capacity = capacity;
    l.k = l.v = ContiguousStrides(capacity, Hkv, D);
    h.k_cache.assign(static_cast<size_t>(B) * capacity * row_elems, kPoison16);
    h.v_cache.assign(h.k_cache.size(), kPoison16);
    for (int b = 0; b < B; ++b) {
      std::copy(h.k[b].begin(), h.k[b].end(), h.k_cache.begin() + static_cast<size_t>(b) * capacity * row_elems);
      std::copy(h.v[b].begin(), h.v[b].end(), h.v_cache.begin() + static_cast<size_t>(b) * capacity * row_elems);
    }
    return h;
  }

  // Paged: each sequence's pages are drawn from a shuffled pool with spare pages (left NaN); sequences 1..
  // point their first shared_pages entries at sequence 0's pages.
  const int ps = c.page_size;
  std::vector<int> needed(B);
  int max_needed = 0, distinct = 0;
  for (int b = 0; b < B; ++b) {
    needed[b] = (c.lens[b] + ps - 1) / ps;
    max_needed = std::max(max_needed, needed[b]);
    distinct += b > 0 ? needed[b] - std::min(needed[b], c.shared_pages) : needed[b];
  }
  const int num_pages = distinct + 5;
  std::vector<int32_t> pool(num_pages);
  std::iota(pool.begin(), pool.end(), 0);
  std::shuffle(pool.begin(), pool.end(), rng);
  l.kv_storage = KvStorage::kPaged;
  l.paged = PagedKv{ps, num_pages, max_needed + 1};
  l.k = l.v = ContiguousStrides(ps, Hkv, D);  // (page, row, head)
  h.table.assign(static_cast<size_t>(B) * l.paged.max_pages_per_seq, -1);
  h.k_cache.assign(static_cast<size_t>(num_pages) * ps * row_elems, kPoison16);
  h.v_cache.assign(h.k_cache.size(), kPoison16);
  int next = 0;
  for (int b = 0; b < B; ++b) {
    for (int j = 0; j < needed[b]; ++j) {
      int32_t page;
      if (b > 0 && j < c.shared_pages) {
        page = h.table[j];
      } else {
        page = pool[next++];
      }
      h.table[static_cast<size_t>(b) * l.paged.max_pages_per_seq + j] = page;
    }
    for (int j = 0; j < c.lens[b]; ++j) {
      const int32_t page = h.table[static_cast<size_t>(b) * l.paged.max_pages_per_seq + j / ps];
      const size_t dst = (static_cast<size_t>(page) * ps + j % ps) * row_elems;
      std::copy_n(h.k[b].begin() + static_cast<size_t>(j) * row_elems, row_elems, h.k_cache.begin() + dst);
      std::copy_n(h.v[b].begin() + static_cast<size_t>(j) * row_elems, row_elems, h.v_cache.begin() + dst);
    }
  }
  return h;
}

// Blanks the rows an append will write (keys len - append .. len - 1 of each sequence) back to NaN and
// returns them as [batch, append, kv_heads, head_dim] new rows.
void SplitOffAppend(const DecodeCase& c, HostCase& h, std::vector<uint16_t>& new_k, std::vector<uint16_t>& new_v) {
  const BatchLayout& l = h.layout;
  const int B = l.batch, n = c.append, row_elems = l.kv_heads * l.head_dim;
  new_k.assign(static_cast<size_t>(B) * n * row_elems, 0);
  new_v.assign(new_k.size(), 0);
  for (int b = 0; b < B; ++b) {
    for (int t = 0; t < n; ++t) {
      const int j = c.lens[b] - n + t;
      size_t dst;
      if (l.kv_storage == KvStorage::kPaged) {
        const int32_t page = h.table[static_cast<size_t>(b) * l.paged.max_pages_per_seq + j / l.paged.page_size];
        dst = (static_cast<size_t>(page) * l.paged.page_size + j % l.paged.page_size) * row_elems;
      } else {
        dst = (static_cast<size_t>(b) * l.kv_capacity + j) * row_elems;
      }
      const size_t src = (static_cast<size_t>(b) * n + t) * row_elems;
      std::copy_n(h.k_cache.begin() + dst, row_elems, new_k.begin() + src);
      std::copy_n(h.v_cache.begin() + dst, row_elems, new_v.begin() + src);
      std::fill_n(h.k_cache.begin() + dst, row_elems, kPoison16);
      std::fill_n(h.v_cache.begin() + dst, row_elems, kPoison16);
    }
  }
}

struct Outputs {
  std::vector<uint16_t> o;
  std::vector<float> lse;
};

// The CPU answers for sequence b: f64 (O and LSE) and the plain reference's O rounded to the element type.
struct SeqReference {
  std::vector<double> o64, lse64;  // [q_len, q_heads, head_dim], [q_heads, q_len]
  std::vector<uint16_t> o_ref;
};

SeqReference Reference(const HostCase& h, int b, int len) {
  const BatchLayout& l = h.layout;
  Problem p;
  p.shape = Shape{1, l.q_len, len, l.q_heads, l.kv_heads, l.head_dim};
  p.dtype = l.dtype;
  p.mask = l.mask;
  p.scale = l.scale;
  p.want_lse = true;
  Layout lay;
  lay.q = l.q;
  lay.k = lay.v = ContiguousStrides(len, l.kv_heads, l.head_dim);
  lay.o = ContiguousStrides(l.q_len, l.q_heads, l.head_dim);
  SeqReference r;
  const size_t o_elems = static_cast<size_t>(l.q_len) * l.q_heads * l.head_dim;
  r.o64.resize(o_elems);
  r.lse64.resize(static_cast<size_t>(l.q_heads) * l.q_len);
  r.o_ref.resize(o_elems);
  std::vector<float> lse32(r.lse64.size());
  const uint16_t* q = h.q.data() + static_cast<size_t>(b) * l.q.batch;
  ReferenceAttentionF64(p, lay, q, h.k[b].data(), h.v[b].data(), r.o64.data(), r.lse64.data());
  ReferenceAttention(p, lay, q, h.k[b].data(), h.v[b].data(), r.o_ref.data(), lse32.data());
  return r;
}

// Compares one launch's outputs with the references; `what` names the run in failures.
void Check(const HostCase& h, const std::vector<int32_t>& lens, const std::vector<SeqReference>& refs,
           const Outputs& out, const std::string& what) {
  const BatchLayout& l = h.layout;
  const int D = l.head_dim;
  for (int b = 0; b < l.batch; ++b) {
    const SeqReference& r = refs[b];
    double err = 0, ref_err = 0, lse_err = 0;
    for (int i = 0; i < l.q_len; ++i) {
      const bool sees_none = l.mask == Mask::kCausalBottomRight && LastVisibleKey(l.mask, l.q_len, lens[b], i) < 0;
      for (int hh = 0; hh < l.q_heads; ++hh) {
        for (int d = 0; d < D; ++d) {
          const size_t at = static_cast<size_t>(b) * l.o.batch + i * l.o.seq + hh * l.o.head + d;
          const double x = HalfToFloat(l.dtype, out.o[at]);
          ASSERT_FALSE(std::isnan(x)) << what << ": O not written at b " << b << " pos " << i << " head " << hh
                                      << " col " << d;
          if (sees_none) {
            ASSERT_EQ(x, 0.0) << what << ": a row that sees no key must be 0 (b " << b << " pos " << i << ")";
            continue;
          }
          const size_t ra = (static_cast<size_t>(i) * l.q_heads + hh) * D + d;
          err = std::max(err, std::abs(x - r.o64[ra]));
          ref_err = std::max(ref_err, std::abs(HalfToFloat(l.dtype, r.o_ref[ra]) - r.o64[ra]));
        }
        // Padding between heads stays as poisoned.
        for (int64_t d = D; d < l.o.head; ++d) {
          ASSERT_EQ(out.o[static_cast<size_t>(b) * l.o.batch + i * l.o.seq + hh * l.o.head + d], kPoison16)
              << what << ": wrote O padding";
        }
        if (l.want_lse) {
          const float got = out.lse[(static_cast<size_t>(b) * l.q_heads + hh) * l.q_len + i];
          const double want = r.lse64[static_cast<size_t>(hh) * l.q_len + i];
          ASSERT_FALSE(std::isnan(got)) << what << ": LSE not written";
          if (sees_none) {
            ASSERT_TRUE(std::isinf(got) && got < 0) << what << ": LSE of a row that sees no key must be -inf";
          } else {
            lse_err = std::max(lse_err, std::abs(got - want) / (kLseAtol + 1e-5 * std::abs(want)));
          }
        }
      }
    }
    EXPECT_LE(err, kTolFactor * ref_err + kAtol)
        << what << ": sequence " << b << " (kv_len " << lens[b] << ") error " << err << ", reference error " << ref_err;
    EXPECT_LE(lse_err, 1.0) << what << ": sequence " << b << " LSE error over tolerance x" << lse_err;
  }
}

class GpuDecodeTest : public ::testing::TestWithParam<DecodeCase> {};

TEST_P(GpuDecodeTest, MatchesReference) {
  if (!HaveSupportedGpu()) GTEST_SKIP() << "no sm_90 / sm_120 GPU";
  const DecodeCase& c = GetParam();
  HostCase h = MakeHostCase(c);
  const BatchLayout& l = h.layout;
  const int B = l.batch;

  std::vector<SeqReference> refs(B);
  for (int b = 0; b < B; ++b) refs[b] = Reference(h, b, c.lens[b]);

  std::vector<uint16_t> new_k, new_v;
  if (c.append > 0) SplitOffAppend(c, h, new_k, new_v);

  DeviceBuffer<uint16_t> q, k, v, o, nk, nv;
  DeviceBuffer<float> lse;
  DeviceBuffer<int32_t> lens_d, table_d;
  CUDA_OK(q.Alloc(h.q.size()));
  CUDA_OK(q.Upload(h.q));
  CUDA_OK(k.Alloc(h.k_cache.size()));
  CUDA_OK(k.Upload(h.k_cache));
  CUDA_OK(v.Alloc(h.v_cache.size()));
  CUDA_OK(v.Upload(h.v_cache));
  CUDA_OK(o.Alloc(h.o_elems));
  CUDA_OK(lse.Alloc(static_cast<size_t>(B) * l.q_heads * l.q_len));
  CUDA_OK(lens_d.Alloc(B));
  if (l.kv_storage == KvStorage::kPaged) {
    CUDA_OK(table_d.Alloc(h.table.size()));
    CUDA_OK(table_d.Upload(h.table));
  }

  if (c.append > 0) {
    // The cache holds len - append rows; append the rest, then attend over all of them.
    std::vector<int32_t> before(c.lens);
    for (int32_t& n : before) n -= c.append;
    CUDA_OK(lens_d.Upload(before));
    CUDA_OK(nk.Alloc(new_k.size()));
    CUDA_OK(nk.Upload(new_k));
    CUDA_OK(nv.Alloc(new_v.size()));
    CUDA_OK(nv.Upload(new_v));
    const Strides rows = ContiguousStrides(c.append, l.kv_heads, l.head_dim);
    absl::StatusOr<AppendPlan> ap = MakeAppendPlan(l, c.append, rows, rows, before, h.table);
    ASSERT_TRUE(ap.ok()) << ap.status();
    absl::Status st = LaunchAppend(*ap, AppendTensors{nk.ptr, nv.ptr, k.ptr, v.ptr, lens_d.ptr, table_d.ptr}, nullptr);
    ASSERT_TRUE(st.ok()) << st;
    CUDA_OK(cudaDeviceSynchronize());
  }
  CUDA_OK(lens_d.Upload(c.lens));

  // The layout launched: the case's, or with the append fused into the decode launch.
  BatchLayout run_layout = l;
  // fused_merge: -1 the plan's choice, 0 the merge kernel, 1 the last split block merges.
  auto run = [&](int num_splits, int fused_merge, Outputs& out, int* splits_used, bool* merged_in_kernel) {
    DecodeOptions options;
    options.num_splits = num_splits;
    if (fused_merge >= 0) options.max_fused_merge_bytes = fused_merge == 1 ? SIZE_MAX : 0;
    absl::StatusOr<DecodePlan> plan = MakeDecodePlan(run_layout, c.lens, h.table, options);
    ASSERT_TRUE(plan.ok()) << plan.status();
    *splits_used = plan->max_splits;
    *merged_in_kernel = plan->merge_in_kernel;
    DeviceBuffer<uint8_t> ws;
    CUDA_OK(ws.Alloc(plan->workspace_bytes));
    DeviceBuffer<int32_t> counters;
    const size_t n_counters = plan->counter_bytes / sizeof(int32_t);
    CUDA_OK(counters.Alloc(n_counters));
    CUDA_OK(cudaMemset(counters.ptr, 0, std::max<size_t>(plan->counter_bytes, 1)));
    const DecodeTensors t{q.ptr, k.ptr, v.ptr, o.ptr, lse.ptr, lens_d.ptr, table_d.ptr, nk.ptr, nv.ptr};
    const DecodeWorkspace w{plan->workspace_bytes > 0 ? ws.ptr : nullptr, n_counters > 0 ? counters.ptr : nullptr};
    // Twice, poisoned before each: the second launch runs on the counters the first left, which must be zero.
    for (int launch = 0; launch < 2; ++launch) {
      CUDA_OK(cudaMemset(ws.ptr, 0xFF, std::max<size_t>(plan->workspace_bytes, 1)));  // NaN partials
      CUDA_OK(cudaMemset(o.ptr, 0xFF, h.o_elems * sizeof(uint16_t)));
      CUDA_OK(cudaMemset(lse.ptr, 0xFF, lse.count * sizeof(float)));
      absl::Status st = LaunchDecode(*plan, t, w, nullptr);
      ASSERT_TRUE(st.ok()) << st;
      CUDA_OK(cudaDeviceSynchronize());
      std::vector<int32_t> left(n_counters);
      CUDA_OK(counters.Download(left));
      for (size_t i = 0; i < left.size(); ++i) ASSERT_EQ(left[i], 0) << "split counter " << i << " after launch " << launch;
    }
    CUDA_OK(o.Download(out.o));
    CUDA_OK(lse.Download(out.lse));
  };

  Outputs split_out;
  int splits = 0;
  bool fused = false;
  run(c.num_splits, -1, split_out, &splits, &fused);
  if (HasFatalFailure()) return;
  Check(h, c.lens, refs, split_out, "splits " + std::to_string(splits) + (fused ? ", merged in kernel" : ""));
  if (splits > 1) {
    // The other merge path on the same split.
    Outputs other;
    int same = 0;
    bool other_fused = fused;
    run(c.num_splits, fused ? 0 : 1, other, &same, &other_fused);
    if (HasFatalFailure()) return;
    ASSERT_EQ(same, splits);
    ASSERT_NE(other_fused, fused);
    Check(h, c.lens, refs, other, other_fused ? "merged in kernel" : "merge kernel");
  }
  if (splits > 1 && c.compare_unsplit) {
    Outputs single;
    int one = 0;
    bool unused = false;
    run(1, -1, single, &one, &unused);
    if (HasFatalFailure()) return;
    ASSERT_EQ(one, 1);
    Check(h, c.lens, refs, single, "unsplit");
    // The merge is exact up to fp32 rounding and the final rounding to the element type.
    double diff = 0;
    for (size_t i = 0; i < single.o.size(); ++i) {
      if (single.o[i] == kPoison16) continue;
      diff = std::max(diff, std::abs(static_cast<double>(HalfToFloat(l.dtype, single.o[i])) -
                                     HalfToFloat(l.dtype, split_out.o[i])));
    }
    EXPECT_LE(diff, 2 * kAtol + 1e-2) << "split vs unsplit";
  }

  if (c.append > 0 && c.append == c.q_len) {
    // The same step with the append fused into the decode launch, from the cache as it was before the append:
    // the same answer, and the cache afterwards byte for byte what LaunchAppend left.
    std::vector<uint16_t> appended_k, appended_v;
    CUDA_OK(k.Download(appended_k));
    CUDA_OK(v.Download(appended_v));
    run_layout.append = true;
    run_layout.new_k = run_layout.new_v = ContiguousStrides(c.append, l.kv_heads, l.head_dim);
    for (const int num_splits : {c.num_splits, 1}) {
      CUDA_OK(k.Upload(h.k_cache));
      CUDA_OK(v.Upload(h.v_cache));
      Outputs fused_out;
      int used = 0;
      bool in_kernel = false;
      run(num_splits, -1, fused_out, &used, &in_kernel);
      if (HasFatalFailure()) return;
      Check(h, c.lens, refs, fused_out, "append fused, splits " + std::to_string(used));
      std::vector<uint16_t> got_k, got_v;
      CUDA_OK(k.Download(got_k));
      CUDA_OK(v.Download(got_v));
      const std::string after = " after the fused append (splits " + std::to_string(used) + ")";
      for (size_t i = 0; i < got_k.size(); ++i) {
        ASSERT_EQ(got_k[i], appended_k[i]) << "K cache element " << i << after;
        ASSERT_EQ(got_v[i], appended_v[i]) << "V cache element " << i << after;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Decode, GpuDecodeTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<DecodeCase>& info) { return info.param.name; });

// Launch-time checks (no kernel runs, so they need no GPU).
TEST(DecodeLaunchValidation, NamesTheBadTensor) {
  BatchLayout l;
  l.batch = 1;
  l.q_heads = l.kv_heads = 1;
  l.head_dim = 64;
  l.scale = 0.125f;
  l.q = l.o = ContiguousStrides(1, 1, 64);
  l.k = l.v = ContiguousStrides(64, 1, 64);
  l.kv_capacity = 64;
  l.want_lse = true;
  DecodeOptions options;
  options.sm_count = 4;
  absl::StatusOr<DecodePlan> plan = MakeDecodePlan(l, {64}, {}, options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  alignas(16) static uint16_t buf[64];
  alignas(16) static int32_t len[1] = {64};
  alignas(16) static float lse_buf[4];
  DecodeTensors t{buf, buf, buf, buf, lse_buf, len, nullptr};
  t.q = nullptr;
  EXPECT_EQ(LaunchDecode(*plan, t, {}, nullptr).message().substr(0, 10), "tensors.q:");
  t.q = buf;
  t.k = reinterpret_cast<const uint8_t*>(buf) + 2;
  EXPECT_EQ(LaunchDecode(*plan, t, {}, nullptr).message().substr(0, 10), "tensors.k:");
  t.k = buf;
  t.lse = nullptr;
  EXPECT_EQ(LaunchDecode(*plan, t, {}, nullptr).message().substr(0, 12), "tensors.lse:");
  t.lse = lse_buf;
  t.kv_lens = nullptr;
  EXPECT_EQ(LaunchDecode(*plan, t, {}, nullptr).message().substr(0, 16), "tensors.kv_lens:");
  t.kv_lens = len;
  // A fused append needs its new rows.
  BatchLayout appending = l;
  appending.append = true;
  appending.new_k = appending.new_v = ContiguousStrides(1, 1, 64);
  absl::StatusOr<DecodePlan> append_plan = MakeDecodePlan(appending, {64}, {}, options);
  ASSERT_TRUE(append_plan.ok()) << append_plan.status();
  EXPECT_EQ(LaunchDecode(*append_plan, t, {}, nullptr).message().substr(0, 14), "tensors.new_k:");
  t.new_k = buf;
  EXPECT_EQ(LaunchDecode(*append_plan, t, {}, nullptr).message().substr(0, 14), "tensors.new_v:");
  t.new_k = nullptr;

  // A split plan that merges in the kernel needs both scratch buffers.
  options.max_fused_merge_bytes = SIZE_MAX;
  BatchLayout longer = l;
  longer.k = longer.v = ContiguousStrides(256, 1, 64);
  longer.kv_capacity = 256;
  options.num_splits = 2;
  absl::StatusOr<DecodePlan> split = MakeDecodePlan(longer, {256}, {}, options);
  ASSERT_TRUE(split.ok()) << split.status();
  ASSERT_GT(split->max_splits, 1);
  ASSERT_TRUE(split->merge_in_kernel);
  ASSERT_GT(split->counter_bytes, 0u);
  alignas(16) static int32_t scratch[4];
  EXPECT_EQ(LaunchDecode(*split, t, {}, nullptr).message().substr(0, 19), "workspace.partials:");
  EXPECT_EQ(LaunchDecode(*split, t, {scratch, nullptr}, nullptr).message().substr(0, 19), "workspace.counters:");
}

// The gather: every key of every sequence comes from its page and row, in K and V, and the output rows past a
// sequence's length keep what they held. Pages are scattered and the pool is filled with distinct values, so a
// wrong page, row or head shows as a byte mismatch.
TEST(GatherTest, CopiesEveryKeyFromItsPageAndNothingElse) {
  if (!HaveSupportedGpu()) GTEST_SKIP() << "no CUDA device";
  for (const int head_dim : {64, 128, 256}) {
    SCOPED_TRACE(head_dim);
    const int kv_heads = 3, page = 16, num_pages = 24, max_pages = 5, capacity = 80;
    const std::vector<int32_t> lens = {33, 0, 80, 1};
    const int batch = static_cast<int>(lens.size());
    std::vector<int32_t> pages(num_pages);
    std::iota(pages.begin(), pages.end(), 0);
    std::mt19937 rng(head_dim);
    std::shuffle(pages.begin(), pages.end(), rng);
    std::vector<int32_t> table(batch * max_pages, -1);
    for (int b = 0, next = 0; b < batch; ++b) {
      for (int j = 0; j * page < lens[b]; ++j) table[b * max_pages + j] = pages[next++];
    }
    const int64_t row = int64_t{kv_heads} * head_dim;
    const int64_t pool_elems = int64_t{num_pages} * page * row, out_elems = int64_t{batch} * capacity * row;
    std::vector<uint16_t> k(pool_elems), v(pool_elems);
    for (int64_t i = 0; i < pool_elems; ++i) {
      k[i] = static_cast<uint16_t>(i * 7 + 1);
      v[i] = static_cast<uint16_t>(i * 13 + 5);
    }
    BatchLayout cache;
    cache.batch = batch;
    cache.q_heads = kv_heads;
    cache.kv_heads = kv_heads;
    cache.head_dim = head_dim;
    cache.kv_storage = KvStorage::kPaged;
    cache.k = cache.v = ContiguousStrides(page, kv_heads, head_dim);
    cache.paged = PagedKv{page, num_pages, max_pages};
    const Strides out = ContiguousStrides(capacity, kv_heads, head_dim);
    absl::StatusOr<GatherPlan> plan = MakeGatherPlan(cache, capacity, out, out, lens, table);
    ASSERT_TRUE(plan.ok()) << plan.status();
    void *dk = nullptr, *dv = nullptr, *dok = nullptr, *dov = nullptr, *dlens = nullptr, *dtable = nullptr;
    CUDA_OK(cudaMalloc(&dk, pool_elems * 2));
    CUDA_OK(cudaMalloc(&dv, pool_elems * 2));
    CUDA_OK(cudaMalloc(&dok, out_elems * 2));
    CUDA_OK(cudaMalloc(&dov, out_elems * 2));
    CUDA_OK(cudaMalloc(&dlens, lens.size() * 4));
    CUDA_OK(cudaMalloc(&dtable, table.size() * 4));
    CUDA_OK(cudaMemcpy(dk, k.data(), pool_elems * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dv, v.data(), pool_elems * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemset(dok, 0xFF, out_elems * 2));
    CUDA_OK(cudaMemset(dov, 0xFF, out_elems * 2));
    CUDA_OK(cudaMemcpy(dlens, lens.data(), lens.size() * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dtable, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
    GatherTensors t{dk, dv, dok, dov, static_cast<const int32_t*>(dlens), static_cast<const int32_t*>(dtable)};
    ASSERT_TRUE(LaunchGather(*plan, t, nullptr).ok());
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<uint16_t> ok(out_elems), ov(out_elems);
    CUDA_OK(cudaMemcpy(ok.data(), dok, out_elems * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(ov.data(), dov, out_elems * 2, cudaMemcpyDeviceToHost));
    int64_t wrong = 0, touched = 0;
    for (int b = 0; b < batch; ++b) {
      for (int key = 0; key < capacity; ++key) {
        const uint16_t* gk = ok.data() + (int64_t{b} * capacity + key) * row;
        const uint16_t* gv = ov.data() + (int64_t{b} * capacity + key) * row;
        if (key < lens[b]) {
          const int64_t src = (int64_t{table[b * max_pages + key / page]} * page + key % page) * row;
          wrong += std::memcmp(gk, k.data() + src, row * 2) != 0;
          wrong += std::memcmp(gv, v.data() + src, row * 2) != 0;
        } else {
          for (int64_t e = 0; e < row; ++e) touched += gk[e] != kPoison16 || gv[e] != kPoison16;
        }
      }
    }
    EXPECT_EQ(wrong, 0) << "gathered rows that differ from their page's";
    EXPECT_EQ(touched, 0) << "elements written past a sequence's length";
    for (void* p : {dk, dv, dok, dov, dlens, dtable}) cudaFree(p);
  }
}

}  // namespace
}  // namespace attnd::kernels::decode
