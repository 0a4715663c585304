// The reference's float8 forward (ReferenceAttentionFp8) against a float64 attention over the dequantized inputs
// (tests/util/fp8_attention_util.h): every mask, GQA, head dims, large logits and outlier channels, strided inputs,
// and per-head descales that must be read per head.
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "attnd/fp8.h"
#include "attnd/half.h"
#include "attnd/reference.h"
#include "fp8_attention_util.h"
#include "gtest/gtest.h"

namespace attnd {
namespace {

using test_util::Fp8Data;
using test_util::Fp8Tensors;

struct Case {
  int64_t batch, q_len, kv_len, q_heads, kv_heads, head_dim;
  Mask mask;
  Fp8Data data = Fp8Data::kPlain;
};

std::string Name(const Case& c) {
  const char* data = c.data == Fp8Data::kPlain ? "plain" : c.data == Fp8Data::kLogits ? "logits" : "outliers";
  return "b" + std::to_string(c.batch) + "_q" + std::to_string(c.q_len) + "_kv" + std::to_string(c.kv_len) + "_h" +
         std::to_string(c.q_heads) + "x" + std::to_string(c.kv_heads) + "_d" + std::to_string(c.head_dim) + "_" +
         MaskName(c.mask) + "_" + data;
}

Problem MakeProblem(const Case& c) {
  Problem p;
  p.shape = Shape{c.batch, c.q_len, c.kv_len, c.q_heads, c.kv_heads, c.head_dim};
  p.dtype = DType::kFP8E4M3;
  p.mask = c.mask;
  p.scale = DefaultScale(c.head_dim);
  p.want_lse = true;
  return p;
}

// Runs the reference on q, k, v laid out as L says, with t's descales, into poisoned outputs: O as bf16 bytes, LSE
// as fp32 bytes.
void RunReference(const Problem& p, const Layout& L, const Fp8Tensors& t, const uint8_t* q, const uint8_t* k,
                  const uint8_t* v, std::string* o, std::string* lse) {
  std::vector<uint16_t> o16(static_cast<size_t>(QElems(p.shape)), 0x7fc1);
  std::vector<float> lse32(static_cast<size_t>(LseElems(p.shape)), std::numeric_limits<float>::quiet_NaN());
  ReferenceAttentionFp8(p, L, q, k, v, {t.q_descale.data(), t.k_descale.data(), t.v_descale.data()}, o16.data(),
                        lse32.data());
  o->assign(reinterpret_cast<const char*>(o16.data()), o16.size() * 2);
  lse->assign(reinterpret_cast<const char*>(lse32.data()), lse32.size() * 4);
}

class ReferenceFp8 : public ::testing::TestWithParam<Case> {};

TEST_P(ReferenceFp8, MatchesFloat64OverTheDequantizedInputs) {
  const Case& c = GetParam();
  const Problem p = MakeProblem(c);
  const Fp8Tensors t = test_util::RandomFp8Tensors(p.shape, c.data, 0xf8 + c.q_len * 31 + c.kv_len);
  std::string o, lse;
  RunReference(p, ContiguousLayout(p.shape), t, t.q.data(), t.k.data(), t.v.data(), &o, &lse);
  test_util::ExpectMatchesNaiveFp8(p, t, o, lse);
}

std::vector<Case> Cases() {
  std::vector<Case> cases;
  for (Mask m : {Mask::kNone, Mask::kCausalTopLeft, Mask::kCausalBottomRight})
    for (auto [lq, lk] : {std::pair<int64_t, int64_t>{1, 1}, {33, 33}, {65, 17}, {17, 65}})
      for (int64_t kv_heads : {4, 1}) cases.push_back({2, lq, lk, 4, kv_heads, 128, m});
  for (Fp8Data data : {Fp8Data::kLogits, Fp8Data::kOutliers}) {
    cases.push_back({1, 70, 70, 4, 2, 128, Mask::kCausalBottomRight, data});
    cases.push_back({2, 33, 100, 2, 1, 256, Mask::kNone, data});
    cases.push_back({1, 40, 40, 2, 2, 64, Mask::kCausalTopLeft, data});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Shapes, ReferenceFp8, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Case>& info) { return Name(info.param); });

// Each head reads its own descale: scaling one head's V codes' descale by 2 doubles that head's O and no other.
TEST(ReferenceFp8, EachHeadReadsItsOwnDescale) {
  const Problem p = MakeProblem({1, 9, 12, 4, 2, 64, Mask::kNone});
  Fp8Tensors t = test_util::RandomFp8Tensors(p.shape, Fp8Data::kPlain, 7);
  std::string o1, o2, lse1, lse2;
  RunReference(p, ContiguousLayout(p.shape), t, t.q.data(), t.k.data(), t.v.data(), &o1, &lse1);
  t.v_descale[1] *= 2;  // kv head 1: q heads 2 and 3
  RunReference(p, ContiguousLayout(p.shape), t, t.q.data(), t.k.data(), t.v.data(), &o2, &lse2);
  EXPECT_EQ(lse1, lse2);
  const auto at = [](const std::string& o, size_t i) {
    uint16_t h;
    std::memcpy(&h, o.data() + 2 * i, 2);
    return Bf16ToFloat(h);
  };
  for (size_t i = 0; i < o1.size() / 2; ++i) {
    const int64_t head = static_cast<int64_t>(i / 64) % 4;
    EXPECT_EQ(at(o2, i), head >= 2 ? at(o1, i) * 2 : at(o1, i)) << i;
  }
  t.q_descale[0] *= 2;  // q head 0 only: its logits double, its LSE changes
  RunReference(p, ContiguousLayout(p.shape), t, t.q.data(), t.k.data(), t.v.data(), &o1, &lse1);
  for (size_t row = 0; row < lse1.size() / 4; ++row) {
    const bool head0 = row / 9 == 0;
    EXPECT_EQ(std::memcmp(lse1.data() + 4 * row, lse2.data() + 4 * row, 4) == 0, !head0) << row;
  }
}

// Strided Q, K and V (heads interleaved with padding) give the contiguous result, bit for bit.
TEST(ReferenceFp8, StridedInputsMatchContiguous) {
  const Problem p = MakeProblem({2, 21, 30, 4, 2, 128, Mask::kCausalBottomRight});
  const Shape& s = p.shape;
  const Fp8Tensors t = test_util::RandomFp8Tensors(s, Fp8Data::kOutliers, 11);
  std::string want_o, want_lse;
  RunReference(p, ContiguousLayout(s), t, t.q.data(), t.k.data(), t.v.data(), &want_o, &want_lse);
  Layout L = ContiguousLayout(s);
  const int64_t pad = 16;
  L.q = Strides{s.q_len * s.q_heads * (s.head_dim + pad), s.q_heads * (s.head_dim + pad), s.head_dim + pad};
  L.k = L.v = Strides{s.kv_len * s.kv_heads * (s.head_dim + pad), s.kv_heads * (s.head_dim + pad), s.head_dim + pad};
  const auto spread = [&](const std::vector<uint8_t>& x, int64_t len, int64_t heads, const Strides& st) {
    std::vector<uint8_t> out(static_cast<size_t>(s.batch * st.batch), 0x7f);  // NaN where nothing may be read
    for (int64_t b = 0; b < s.batch; ++b)
      for (int64_t i = 0; i < len; ++i)
        for (int64_t h = 0; h < heads; ++h)
          std::memcpy(&out[b * st.batch + i * st.seq + h * st.head], &x[((b * len + i) * heads + h) * s.head_dim],
                      s.head_dim);
    return out;
  };
  const auto qs = spread(t.q, s.q_len, s.q_heads, L.q), ks = spread(t.k, s.kv_len, s.kv_heads, L.k),
             vs = spread(t.v, s.kv_len, s.kv_heads, L.v);
  std::string o, lse;
  RunReference(p, L, t, qs.data(), ks.data(), vs.data(), &o, &lse);
  EXPECT_EQ(o, want_o);
  EXPECT_EQ(lse, want_lse);
}

}  // namespace
}  // namespace attnd
