// The CPU reference attention (the oracle of every other test) checked against an independent, naive
// double-precision computation written plainly here, and the 16-bit float conversions it relies on.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "attnd/half.h"
#include "attnd/problem.h"
#include "attnd/reference.h"
#include "gtest/gtest.h"

namespace attnd {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

std::vector<uint16_t> RandomHalf(DType t, size_t n, std::mt19937_64& rng, float stddev = 1.0f) {
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<uint16_t> out(n);
  for (auto& x : out) x = FloatToHalf(t, dist(rng));
  return out;
}

// Whether query row i may see key j, written from the definitions in attention.proto rather than through
// LastVisibleKey, so that the reference's masking is checked too.
bool Visible(Mask m, int64_t lq, int64_t lk, int64_t i, int64_t j) {
  switch (m) {
    case Mask::kNone:
      return true;
    case Mask::kCausalTopLeft:
      return j <= i;
    case Mask::kCausalBottomRight:
      return j <= i + lk - lq;
  }
  return false;
}

// Naive attention in double: the full score matrix of each (batch, head) is materialised, masked entries
// are -inf, softmax row by row, then P.V. Contiguous inputs; O contiguous; LSE [b, h, q].
void NaiveAttention(const Problem& p, const std::vector<uint16_t>& q, const std::vector<uint16_t>& k,
                    const std::vector<uint16_t>& v, std::vector<double>* o, std::vector<double>* lse) {
  const Shape& s = p.shape;
  const int64_t group = s.q_heads / s.kv_heads, d = s.head_dim;
  o->assign(QElems(s), 0.0);
  lse->assign(LseElems(s), 0.0);
  std::vector<double> S(s.q_len * s.kv_len);
  const auto widen = [&](const std::vector<uint16_t>& in) {
    std::vector<double> out(in.size());
    for (size_t i = 0; i < in.size(); ++i) out[i] = HalfToFloat(p.dtype, in[i]);
    return out;
  };
  const std::vector<double> qd = widen(q), kd = widen(k), vd = widen(v);
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.q_heads; ++h) {
      const int64_t kh = h / group;
      for (int64_t i = 0; i < s.q_len; ++i) {
        for (int64_t j = 0; j < s.kv_len; ++j) {
          double dot = 0;
          for (int64_t x = 0; x < d; ++x) {
            dot += qd[((b * s.q_len + i) * s.q_heads + h) * d + x] * kd[((b * s.kv_len + j) * s.kv_heads + kh) * d + x];
          }
          S[i * s.kv_len + j] = Visible(p.mask, s.q_len, s.kv_len, i, j) ? dot * static_cast<double>(p.scale) : -kInf;
        }
      }
      for (int64_t i = 0; i < s.q_len; ++i) {
        double mx = -kInf;
        for (int64_t j = 0; j < s.kv_len; ++j) mx = std::max(mx, S[i * s.kv_len + j]);
        double* orow = &(*o)[((b * s.q_len + i) * s.q_heads + h) * d];
        double& l = (*lse)[(b * s.q_heads + h) * s.q_len + i];
        if (mx == -kInf) {  // no visible key: O = 0, LSE = -inf
          l = -kInf;
          continue;
        }
        double sum = 0;
        for (int64_t j = 0; j < s.kv_len; ++j) {
          double& e = S[i * s.kv_len + j];
          e = std::exp(e - mx);  // 0 for masked keys
          sum += e;
        }
        l = mx + std::log(sum);
        for (int64_t j = 0; j < s.kv_len; ++j) {
          const double pj = S[i * s.kv_len + j] / sum;
          if (pj == 0) continue;
          const double* vrow = &vd[((b * s.kv_len + j) * s.kv_heads + kh) * d];
          for (int64_t x = 0; x < d; ++x) orow[x] += pj * vrow[x];
        }
      }
    }
  }
}

struct Case {
  int64_t batch, q_len, kv_len, q_heads, kv_heads, head_dim;
  Mask mask;
  DType dtype = DType::kBF16;
  float scale = 0;  // 0: default
};

std::string Name(const Case& c) {
  return "b" + std::to_string(c.batch) + "_q" + std::to_string(c.q_len) + "_kv" + std::to_string(c.kv_len) + "_h" +
         std::to_string(c.q_heads) + "x" + std::to_string(c.kv_heads) + "_d" + std::to_string(c.head_dim) + "_" +
         MaskName(c.mask) + "_" + DTypeName(c.dtype);
}

Problem MakeProblem(const Case& c) {
  Problem p;
  p.shape = Shape{c.batch, c.q_len, c.kv_len, c.q_heads, c.kv_heads, c.head_dim};
  p.dtype = c.dtype;
  p.mask = c.mask;
  p.scale = c.scale != 0 ? c.scale : DefaultScale(c.head_dim);
  p.want_lse = true;
  return p;
}

// Runs the fp32 reference, the double reference and (when `naive`) the naive computation on one case and
// checks them against each other.
void CheckCase(const Case& c, bool naive) {
  SCOPED_TRACE(Name(c));
  const Problem p = MakeProblem(c);
  const Shape& s = p.shape;
  std::mt19937_64 rng(0x5eed ^ static_cast<uint64_t>(s.q_len * 1315423911 + s.kv_len * 2654435761u + s.head_dim));
  const auto q = RandomHalf(p.dtype, QElems(s), rng), k = RandomHalf(p.dtype, KVElems(s), rng),
             v = RandomHalf(p.dtype, KVElems(s), rng);
  const Layout L = ContiguousLayout(s);

  // Poisoned outputs: every element must be written.
  std::vector<uint16_t> o32(QElems(s), 0x7fc1);
  std::vector<float> lse32(LseElems(s), std::numeric_limits<float>::quiet_NaN());
  ReferenceAttention(p, L, q.data(), k.data(), v.data(), o32.data(), lse32.data());
  std::vector<double> o64(QElems(s), std::nan("")), lse64(LseElems(s), std::nan(""));
  ReferenceAttentionF64(p, L, q.data(), k.data(), v.data(), o64.data(), lse64.data());

  if (naive) {
    std::vector<double> on, lsen;
    NaiveAttention(p, q, k, v, &on, &lsen);
    for (size_t i = 0; i < on.size(); ++i) {
      ASSERT_NEAR(o64[i], on[i], 1e-12 + 1e-9 * std::fabs(on[i])) << "O element " << i;
    }
    for (size_t i = 0; i < lsen.size(); ++i) {
      if (std::isinf(lsen[i])) {
        ASSERT_TRUE(std::isinf(lse64[i]) && lse64[i] < 0) << "LSE row " << i;
      } else {
        ASSERT_NEAR(lse64[i], lsen[i], 1e-9 * std::max(1.0, std::fabs(lsen[i]))) << "LSE row " << i;
      }
    }
  }

  // fp32 reference vs double: the stored O is rounded once to 16 bits, so its error is at most half an ulp of
  // the format (2^-9 relative for bf16, 2^-12 for fp16) plus the fp32 accumulation error.
  const double rel = p.dtype == DType::kBF16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -10);
  double max_abs = 0, max_err = 0;
  for (double x : o64) max_abs = std::max(max_abs, std::fabs(x));
  for (size_t i = 0; i < o64.size(); ++i) {
    const double got = HalfToFloat(p.dtype, o32[i]);
    ASSERT_TRUE(std::isfinite(got)) << "O element " << i << " was not written";
    const double err = std::fabs(got - o64[i]);
    max_err = std::max(max_err, err);
    ASSERT_LE(err, rel * std::fabs(o64[i]) + 1e-5 * max_abs + 1e-7) << "O element " << i << ": " << got << " vs "
                                                                     << o64[i];
  }
  for (size_t i = 0; i < lse64.size(); ++i) {
    if (std::isinf(lse64[i])) {
      ASSERT_TRUE(std::isinf(lse32[i]) && lse32[i] < 0) << "LSE row " << i;
    } else {
      ASSERT_NEAR(lse32[i], lse64[i], 2e-5 * std::max(1.0, std::fabs(lse64[i]))) << "LSE row " << i;
    }
  }
  // Rows that see no key: O exactly zero.
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t i = 0; i < s.q_len; ++i)
      if (LastVisibleKey(p.mask, s.q_len, s.kv_len, i) < 0) {
        for (int64_t h = 0; h < s.q_heads; ++h)
          for (int64_t x = 0; x < s.head_dim; ++x) {
            ASSERT_EQ(HalfToFloat(p.dtype, o32[((b * s.q_len + i) * s.q_heads + h) * s.head_dim + x]), 0.0f);
          }
      }
}

class ReferenceSweep : public ::testing::TestWithParam<Case> {};

TEST_P(ReferenceSweep, MatchesNaiveDoubleAndF64) { CheckCase(GetParam(), /*naive=*/true); }

std::vector<Case> SweepCases() {
  std::vector<Case> cases;
  const std::pair<int64_t, int64_t> lengths[] = {{1, 1},   {17, 17}, {64, 64},  {65, 65}, {127, 127},
                                                 {17, 65}, {65, 17}, {1, 127},  {127, 1}, {64, 127}};
  for (Mask m : {Mask::kNone, Mask::kCausalTopLeft, Mask::kCausalBottomRight})
    for (int64_t kv_heads : {8, 2, 1})  // GQA ratios 1, 4, 8
      for (int64_t d : {64, 128})
        for (auto [lq, lk] : lengths) cases.push_back({2, lq, lk, 8, kv_heads, d, m});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Lengths, ReferenceSweep, ::testing::ValuesIn(SweepCases()),
                         [](const ::testing::TestParamInfo<Case>& info) { return Name(info.param); });

// Long sequences: 1000 (and unequal 1000/600 both ways) with the naive check, fewer heads to stay fast.
INSTANTIATE_TEST_SUITE_P(
    Long, ReferenceSweep,
    ::testing::Values(Case{1, 1000, 1000, 4, 1, 128, Mask::kNone}, Case{1, 1000, 1000, 4, 4, 64, Mask::kCausalTopLeft},
                      Case{1, 1000, 1000, 8, 1, 64, Mask::kCausalBottomRight},
                      Case{1, 1000, 600, 2, 2, 128, Mask::kCausalBottomRight},
                      Case{1, 600, 1000, 4, 1, 128, Mask::kCausalBottomRight},
                      Case{1, 1000, 600, 4, 1, 64, Mask::kCausalTopLeft}),
    [](const ::testing::TestParamInfo<Case>& info) { return Name(info.param); });

// fp16 inputs, a non-default (peaky) scale and head_dim 256.
INSTANTIATE_TEST_SUITE_P(
    Variants, ReferenceSweep,
    ::testing::Values(Case{2, 65, 65, 4, 2, 64, Mask::kNone, DType::kFP16},
                      Case{2, 65, 127, 4, 1, 128, Mask::kCausalBottomRight, DType::kFP16},
                      Case{1, 64, 64, 2, 2, 128, Mask::kCausalTopLeft, DType::kBF16, 0.5f},
                      Case{1, 33, 70, 2, 1, 256, Mask::kNone}),
    [](const ::testing::TestParamInfo<Case>& info) {
      return Name(info.param) + "_" + std::to_string(info.index);
    });

TEST(Reference, BottomRightFullyMaskedRowsGiveZeroAndMinusInfLse) {
  // q_len > kv_len with the bottom-right mask: the first q_len - kv_len rows see no key.
  const Problem p = MakeProblem({1, 9, 4, 2, 1, 64, Mask::kCausalBottomRight});
  std::mt19937_64 rng(7);
  const auto q = RandomHalf(p.dtype, QElems(p.shape), rng), k = RandomHalf(p.dtype, KVElems(p.shape), rng),
             v = RandomHalf(p.dtype, KVElems(p.shape), rng);
  std::vector<uint16_t> o(QElems(p.shape), 0x7fc1);
  std::vector<float> lse(LseElems(p.shape), 0.0f);
  ReferenceAttention(p, ContiguousLayout(p.shape), q.data(), k.data(), v.data(), o.data(), lse.data());
  for (int64_t h = 0; h < 2; ++h) {
    for (int64_t i = 0; i < 9; ++i) {
      const bool masked = i < 5;
      EXPECT_EQ(std::isinf(lse[h * 9 + i]) && lse[h * 9 + i] < 0, masked) << "row " << i;
      bool all_zero = true;
      for (int64_t x = 0; x < 64; ++x) all_zero &= Bf16ToFloat(o[(i * 2 + h) * 64 + x]) == 0.0f;
      EXPECT_EQ(all_zero, masked) << "row " << i;
    }
  }
}

TEST(Reference, CausalLastRowEqualsUnmaskedLastRow) {
  // With q_len == kv_len both causal alignments let the last row see every key: it must equal the
  // unmasked result bit for bit, while the first row differs (a mask that does nothing fails here).
  Problem p = MakeProblem({1, 50, 50, 2, 2, 64, Mask::kNone});
  std::mt19937_64 rng(11);
  const auto q = RandomHalf(p.dtype, QElems(p.shape), rng), k = RandomHalf(p.dtype, KVElems(p.shape), rng),
             v = RandomHalf(p.dtype, KVElems(p.shape), rng);
  const Layout L = ContiguousLayout(p.shape);
  std::vector<uint16_t> none(QElems(p.shape)), causal(QElems(p.shape));
  ReferenceAttention(p, L, q.data(), k.data(), v.data(), none.data(), nullptr);
  p.mask = Mask::kCausalTopLeft;
  ReferenceAttention(p, L, q.data(), k.data(), v.data(), causal.data(), nullptr);
  const size_t row = 2 * 64;
  EXPECT_TRUE(std::equal(none.end() - row, none.end(), causal.end() - row));
  EXPECT_FALSE(std::equal(none.begin(), none.begin() + row, causal.begin()));
}

TEST(Reference, StridedLayoutsMatchContiguous) {
  // Q with padded rows, K and V as [batch, heads, seq, head_dim], O with padded rows: same values, same
  // order of arithmetic, so the results must be bit-identical to the contiguous run.
  const Problem p = MakeProblem({2, 37, 53, 4, 2, 64, Mask::kCausalBottomRight});
  const Shape& s = p.shape;
  std::mt19937_64 rng(3);
  const auto q = RandomHalf(p.dtype, QElems(s), rng), k = RandomHalf(p.dtype, KVElems(s), rng),
             v = RandomHalf(p.dtype, KVElems(s), rng);
  const Layout C = ContiguousLayout(s);
  std::vector<uint16_t> o_ref(QElems(s));
  std::vector<float> lse_ref(LseElems(s));
  ReferenceAttention(p, C, q.data(), k.data(), v.data(), o_ref.data(), lse_ref.data());

  const int64_t d = s.head_dim, pad = 24;
  Layout L;
  L.q = Strides{s.q_len * (s.q_heads * d + pad), s.q_heads * d + pad, d};
  L.k = Strides{s.kv_heads * s.kv_len * d, d, s.kv_len * d};
  L.v = L.k;
  L.o = Strides{s.q_len * (s.q_heads * d + pad), s.q_heads * d + pad, d};
  std::vector<uint16_t> qs(s.batch * L.q.batch, 0x7fc1), ks(s.batch * L.k.batch, 0x7fc1), vs(ks.size(), 0x7fc1);
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t i = 0; i < s.q_len; ++i)
      for (int64_t h = 0; h < s.q_heads; ++h)
        std::memcpy(&qs[b * L.q.batch + i * L.q.seq + h * L.q.head], &q[b * C.q.batch + i * C.q.seq + h * C.q.head], d * 2);
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t j = 0; j < s.kv_len; ++j)
      for (int64_t h = 0; h < s.kv_heads; ++h) {
        std::memcpy(&ks[b * L.k.batch + j * L.k.seq + h * L.k.head], &k[b * C.k.batch + j * C.k.seq + h * C.k.head], d * 2);
        std::memcpy(&vs[b * L.v.batch + j * L.v.seq + h * L.v.head], &v[b * C.v.batch + j * C.v.seq + h * C.v.head], d * 2);
      }
  std::vector<uint16_t> os(s.batch * L.o.batch, 0x1234);
  std::vector<float> lse(LseElems(s));
  ReferenceAttention(p, L, qs.data(), ks.data(), vs.data(), os.data(), lse.data());
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t i = 0; i < s.q_len; ++i)
      for (int64_t h = 0; h < s.q_heads; ++h)
        for (int64_t x = 0; x < d; ++x)
          ASSERT_EQ(os[b * L.o.batch + i * L.o.seq + h * L.o.head + x], o_ref[b * C.o.batch + i * C.o.seq + h * C.o.head + x]);
  // The padding between rows is left untouched.
  EXPECT_EQ(os[s.q_heads * d], 0x1234);
  for (size_t i = 0; i < lse.size(); ++i) {
    if (std::isinf(lse_ref[i])) {
      EXPECT_TRUE(std::isinf(lse[i]));
    } else {
      EXPECT_EQ(lse[i], lse_ref[i]);
    }
  }
}

TEST(Reference, ThreadCountDoesNotChangeTheResult) {
  const Problem p = MakeProblem({2, 130, 70, 4, 1, 64, Mask::kCausalTopLeft});
  std::mt19937_64 rng(5);
  const auto q = RandomHalf(p.dtype, QElems(p.shape), rng), k = RandomHalf(p.dtype, KVElems(p.shape), rng),
             v = RandomHalf(p.dtype, KVElems(p.shape), rng);
  std::vector<uint16_t> o1(QElems(p.shape)), o4(QElems(p.shape));
  ReferenceOptions one, four;
  one.num_threads = 1;
  four.num_threads = 4;
  ReferenceAttention(p, ContiguousLayout(p.shape), q.data(), k.data(), v.data(), o1.data(), nullptr, one);
  ReferenceAttention(p, ContiguousLayout(p.shape), q.data(), k.data(), v.data(), o4.data(), nullptr, four);
  EXPECT_EQ(o1, o4);
}

TEST(Reference, LseMergesPartialAttention) {
  // What LSE is for: attention over keys [0, n) equals the LSE-weighted merge of attention over [0, m) and
  // [m, n).
  const Problem full = MakeProblem({1, 16, 96, 2, 1, 64, Mask::kNone});
  std::mt19937_64 rng(13);
  const auto q = RandomHalf(full.dtype, QElems(full.shape), rng), k = RandomHalf(full.dtype, KVElems(full.shape), rng),
             v = RandomHalf(full.dtype, KVElems(full.shape), rng);
  std::vector<double> o(QElems(full.shape)), lse(LseElems(full.shape));
  ReferenceAttentionF64(full, ContiguousLayout(full.shape), q.data(), k.data(), v.data(), o.data(), lse.data());
  Problem part = full;
  part.shape.kv_len = 40;
  std::vector<double> o1(QElems(part.shape)), l1(LseElems(part.shape)), o2(o1.size()), l2(l1.size());
  const int64_t kv_row = part.shape.kv_heads * part.shape.head_dim;
  ReferenceAttentionF64(part, ContiguousLayout(part.shape), q.data(), k.data(), v.data(), o1.data(), l1.data());
  part.shape.kv_len = 56;
  ReferenceAttentionF64(part, ContiguousLayout(part.shape), q.data(), k.data() + 40 * kv_row, v.data() + 40 * kv_row,
                        o2.data(), l2.data());
  const Shape& s = full.shape;
  for (int64_t i = 0; i < s.q_len; ++i)
    for (int64_t h = 0; h < s.q_heads; ++h) {
      const size_t r = h * s.q_len + i;
      const double m = std::max(l1[r], l2[r]);
      const double w1 = std::exp(l1[r] - m), w2 = std::exp(l2[r] - m);
      EXPECT_NEAR(m + std::log(w1 + w2), lse[r], 1e-10);
      for (int64_t x = 0; x < s.head_dim; ++x) {
        const size_t e = (i * s.q_heads + h) * s.head_dim + x;
        EXPECT_NEAR((w1 * o1[e] + w2 * o2[e]) / (w1 + w2), o[e], 1e-10);
      }
    }
}

// ---- 16-bit conversions --------------------------------------------------------------------------------

uint16_t BitsOf(_Float16 h) {
  uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}

_Float16 FromBits(uint16_t b) {
  _Float16 h;
  std::memcpy(&h, &b, 2);
  return h;
}

float FloatFromBits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

TEST(Half, Fp16ToFloatMatchesFloat16ForAllPatterns) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const float ours = Fp16ToFloat(static_cast<uint16_t>(b));
    const float theirs = static_cast<float>(FromBits(static_cast<uint16_t>(b)));
    if (std::isnan(theirs)) {
      ASSERT_TRUE(std::isnan(ours)) << std::hex << b;
    } else {
      ASSERT_EQ(std::memcmp(&ours, &theirs, 4), 0) << std::hex << b << ": " << ours << " vs " << theirs;
    }
  }
}

// Floats whose fp16/bf16 rounding is delicate: around every 16-bit value (the value, the ties exactly
// between neighbours, one float ulp either side), subnormals, overflow boundaries, inf and NaN; plus random
// bit patterns.
std::vector<float> ConversionProbes(bool bf16) {
  std::vector<float> probes;
  for (uint32_t b = 0; b < 65536; ++b) {
    const double lo = bf16 ? Bf16ToFloat(static_cast<uint16_t>(b)) : Fp16ToFloat(static_cast<uint16_t>(b));
    const double hi = bf16 ? Bf16ToFloat(static_cast<uint16_t>(b + 1)) : Fp16ToFloat(static_cast<uint16_t>(b + 1));
    probes.push_back(static_cast<float>(lo));
    if (std::isfinite(lo) && std::isfinite(hi) && (b & 0x7fff) != 0x7fff) {
      const float tie = static_cast<float>((lo + hi) / 2);  // exact in float for both formats
      probes.push_back(tie);
      probes.push_back(std::nextafter(tie, 0.0f));
      probes.push_back(std::nextafter(tie, tie * 2));
    }
  }
  for (float f : {65504.0f, 65519.99f, 65520.0f, 65536.0f, 1e-8f, 2.98e-8f, 2.9802322e-8f, 5.96e-8f, 6.1e-5f,
                  3.3895314e38f, 3.4028235e38f, std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::quiet_NaN(),
                  FloatFromBits(0x7f800001u), FloatFromBits(0xffc12345u)}) {
    probes.push_back(f);
    probes.push_back(-f);
  }
  std::mt19937 rng(42);
  for (int i = 0; i < 1000000; ++i) probes.push_back(FloatFromBits(static_cast<uint32_t>(rng())));
  return probes;
}

TEST(Half, FloatToFp16MatchesFloat16) {
  for (float f : ConversionProbes(/*bf16=*/false)) {
    const uint16_t ours = FloatToFp16(f);
    const uint16_t theirs = BitsOf(static_cast<_Float16>(f));
    if (std::isnan(f)) {
      ASSERT_TRUE(std::isnan(Fp16ToFloat(ours))) << f;
      ASSERT_EQ(ours & 0x8000, theirs & 0x8000) << "NaN sign";
    } else {
      ASSERT_EQ(ours, theirs) << std::hexfloat << f;
    }
  }
}

TEST(Half, FloatToBf16RoundsToNearestEven) {
  // GCC 12 has no bf16 arithmetic type; the rounding is checked from its definition instead: the result is
  // the nearer of the two bf16 neighbours of f (computed in double), ties to the even mantissa, overflow to inf.
  for (float f : ConversionProbes(/*bf16=*/true)) {
    const uint16_t r = FloatToBf16(f);
    if (std::isnan(f)) {
      ASSERT_TRUE(std::isnan(Bf16ToFloat(r))) << f;
      ASSERT_EQ(r >> 15, std::signbit(f) ? 1 : 0);
      continue;
    }
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    const uint16_t down = static_cast<uint16_t>(bits >> 16);  // truncation: toward zero
    const uint16_t up = static_cast<uint16_t>(down + 1);      // next away from zero (may be inf)
    if ((bits & 0xffffu) == 0) {
      ASSERT_EQ(r, down) << std::hexfloat << f;
      continue;
    }
    const double dd = std::fabs(static_cast<double>(f) - Bf16ToFloat(down));
    // Past the largest finite bf16 the next value up is infinity, which IEEE rounding treats as 2^128.
    const double up_value = std::isinf(Bf16ToFloat(up)) ? std::copysign(std::ldexp(1.0, 128), f) : Bf16ToFloat(up);
    const double du = std::fabs(static_cast<double>(f) - up_value);
    const uint16_t expect = dd < du ? down : du < dd ? up : ((down & 1) ? up : down);
    ASSERT_EQ(r, expect) << std::hexfloat << f;
  }
}

TEST(Half, RoundTripIsExact) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const uint16_t h = static_cast<uint16_t>(b);
    if (!std::isnan(Bf16ToFloat(h))) {
      ASSERT_EQ(FloatToBf16(Bf16ToFloat(h)), h) << std::hex << b;
    }
    if (!std::isnan(Fp16ToFloat(h))) {
      ASSERT_EQ(FloatToFp16(Fp16ToFloat(h)), h) << std::hex << b;
    }
  }
}

}  // namespace
}  // namespace attnd
