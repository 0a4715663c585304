// Float8 forward problems for the tests: random e4m3 inputs with per-head descales (plain, with large logits, with
// outlier channels), an attention over them in float64 written apart from the reference (its own decoding of the
// codes, its own loops), and the check of a bf16 O and an fp32 LSE against it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "attnd/fp8.h"
#include "attnd/half.h"
#include "attnd/problem.h"
#include "gtest/gtest.h"

namespace attnd::test_util {

enum class Fp8Data {
  kPlain,     // N(0, 1) elements
  kLogits,    // Q and K with stddev 6: logits in the hundreds, a softmax close to one-hot
  kOutliers,  // a few channels of every K and V head 40x the rest: the descale follows them, the rest is coarse
};

// Contiguous inputs: codes and the descales, one per head (what ForwardJob and the reference take).
struct Fp8Tensors {
  std::vector<uint8_t> q, k, v;
  std::vector<float> q_descale, k_descale, v_descale;
  std::string q_bytes() const { return std::string(q.begin(), q.end()); }
  std::string k_bytes() const { return std::string(k.begin(), k.end()); }
  std::string v_bytes() const { return std::string(v.begin(), v.end()); }
};

// Elements of [batch, len, heads, head_dim] quantized per head: each head's descale is its amax / 448, so that its
// largest element lands on the largest code.
inline void QuantizePerHead(const std::vector<float>& x, int64_t heads, int64_t head_dim, std::vector<uint8_t>* codes,
                            std::vector<float>* descale) {
  descale->assign(static_cast<size_t>(heads), 0.f);
  for (size_t i = 0; i < x.size(); ++i) {
    float& d = (*descale)[(i / head_dim) % heads];
    d = std::max(d, std::fabs(x[i]));
  }
  for (float& d : *descale) d = d > 0 ? d / kFp8E4M3Max : 1.f;
  codes->resize(x.size());
  for (size_t i = 0; i < x.size(); ++i) (*codes)[i] = FloatToFp8E4M3(x[i] / (*descale)[(i / head_dim) % heads]);
}

inline Fp8Tensors RandomFp8Tensors(const Shape& s, Fp8Data data, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const float qk_stddev = data == Fp8Data::kLogits ? 6.f : 1.f;
  const auto fill = [&](int64_t elems, float stddev, bool outliers) {
    std::normal_distribution<float> dist(0.f, stddev);
    std::vector<float> x(static_cast<size_t>(elems));
    for (size_t i = 0; i < x.size(); ++i) {
      const int64_t channel = static_cast<int64_t>(i) % s.head_dim;
      x[i] = dist(rng) * (outliers && (channel == 3 || channel == s.head_dim - 5) ? 40.f : 1.f);
    }
    return x;
  };
  const bool outliers = data == Fp8Data::kOutliers;
  Fp8Tensors t;
  QuantizePerHead(fill(QElems(s), qk_stddev, false), s.q_heads, s.head_dim, &t.q, &t.q_descale);
  QuantizePerHead(fill(KVElems(s), qk_stddev, outliers), s.kv_heads, s.head_dim, &t.k, &t.k_descale);
  QuantizePerHead(fill(KVElems(s), 1.f, outliers), s.kv_heads, s.head_dim, &t.v, &t.v_descale);
  return t;
}

// The value of an e4m3 code from its bits (NaN for S.1111.111).
inline double Fp8Value(uint8_t code) {
  const int sign = (code & 0x80) != 0 ? -1 : 1, exponent = (code >> 3) & 0xf, mantissa = code & 7;
  if (exponent == 15 && mantissa == 7) return std::numeric_limits<double>::quiet_NaN();
  return exponent == 0 ? sign * std::ldexp(mantissa, -9) : sign * std::ldexp(8 + mantissa, exponent - 10);
}

// Attention in float64 over the dequantized contiguous inputs: o [batch, q_len, q_heads, head_dim], lse
// [batch, q_heads, q_len] (-inf, and O 0, for a row that sees no key).
inline void NaiveFp8Attention(const Problem& p, const Fp8Tensors& t, std::vector<double>* o, std::vector<double>* lse) {
  const Shape& s = p.shape;
  const int64_t d = s.head_dim, group = s.q_heads / s.kv_heads;
  const auto at = [&](const std::vector<uint8_t>& x, const std::vector<float>& descale, int64_t len, int64_t heads,
                      int64_t b, int64_t row, int64_t h, int64_t c) {
    return Fp8Value(x[((b * len + row) * heads + h) * d + c]) * static_cast<double>(descale[h]);
  };
  o->assign(static_cast<size_t>(QElems(s)), 0.0);
  lse->assign(static_cast<size_t>(LseElems(s)), -std::numeric_limits<double>::infinity());
  std::vector<double> logits;
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.q_heads; ++h) {
      const int64_t kvh = h / group;
      for (int64_t i = 0; i < s.q_len; ++i) {
        logits.clear();
        for (int64_t j = 0; j < s.kv_len; ++j) {
          const bool visible = p.mask == Mask::kNone || (p.mask == Mask::kCausalTopLeft && j <= i) ||
                               (p.mask == Mask::kCausalBottomRight && j <= i + s.kv_len - s.q_len);
          if (!visible) break;
          double dot = 0;
          for (int64_t c = 0; c < d; ++c) {
            dot += at(t.q, t.q_descale, s.q_len, s.q_heads, b, i, h, c) *
                   at(t.k, t.k_descale, s.kv_len, s.kv_heads, b, j, kvh, c);
          }
          logits.push_back(dot * p.scale);
        }
        if (logits.empty()) continue;
        const double mx = *std::max_element(logits.begin(), logits.end());
        double sum = 0;
        double* orow = &(*o)[static_cast<size_t>(((b * s.q_len + i) * s.q_heads + h) * d)];
        for (size_t j = 0; j < logits.size(); ++j) {
          const double e = std::exp(logits[j] - mx);
          sum += e;
          for (int64_t c = 0; c < d; ++c) {
            orow[c] += e * at(t.v, t.v_descale, s.kv_len, s.kv_heads, b, static_cast<int64_t>(j), kvh, c);
          }
        }
        for (int64_t c = 0; c < d; ++c) orow[c] /= sum;
        (*lse)[static_cast<size_t>((b * s.q_heads + h) * s.q_len + i)] = mx + std::log(sum);
      }
    }
  }
}

// O (bf16 bytes, contiguous) and LSE (fp32, may be empty) against the float64 attention: O within half a bf16 ulp
// plus the fp32 accumulation's error, LSE within the fp32 error of the logits.
inline void ExpectMatchesNaiveFp8(const Problem& p, const Fp8Tensors& t, const std::string& o,
                                  const std::string& lse) {
  std::vector<double> want_o, want_lse;
  NaiveFp8Attention(p, t, &want_o, &want_lse);
  ASSERT_EQ(o.size(), want_o.size() * 2) << "O is bf16";
  double max_abs = 0;
  for (double x : want_o) max_abs = std::max(max_abs, std::fabs(x));
  for (size_t i = 0; i < want_o.size(); ++i) {
    uint16_t h;
    std::memcpy(&h, o.data() + 2 * i, 2);
    const double got = Bf16ToFloat(h);
    ASSERT_TRUE(std::isfinite(got)) << "O element " << i;
    ASSERT_LE(std::fabs(got - want_o[i]), std::ldexp(1.0, -8) * std::fabs(want_o[i]) + 1e-5 * max_abs + 1e-7)
        << "O element " << i << ": " << got << " vs " << want_o[i];
  }
  if (!p.want_lse) return;
  ASSERT_EQ(lse.size(), want_lse.size() * 4);
  for (size_t i = 0; i < want_lse.size(); ++i) {
    float got;
    std::memcpy(&got, lse.data() + 4 * i, 4);
    if (std::isinf(want_lse[i])) {
      ASSERT_TRUE(std::isinf(got) && got < 0) << "LSE row " << i;
    } else {
      ASSERT_NEAR(got, want_lse[i], 2e-5 * std::max(1.0, std::fabs(want_lse[i]))) << "LSE row " << i;
    }
  }
}

}  // namespace attnd::test_util
