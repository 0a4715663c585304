#include "attnd/client/tensors.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "attnd/client/client.h"
#include "attnd/fp8.h"
#include "attnd/half.h"
#include "attnd/reference.h"

namespace attnd::client {
namespace {

const uint16_t* Halves(std::string_view s) { return reinterpret_cast<const uint16_t*>(s.data()); }

struct Errors {
  double max_abs = 0, rel_l2 = 0;
  int64_t bad = 0;
};

Errors CompareO(DType dtype, const uint16_t* o, const std::vector<double>& ref) {
  Errors e;
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double x = HalfToFloat(dtype, o[i]);
    if (!std::isfinite(x)) {
      ++e.bad;
      continue;
    }
    const double d = x - ref[i];
    e.max_abs = std::max(e.max_abs, std::abs(d));
    num += d * d;
    den += ref[i] * ref[i];
  }
  e.rel_l2 = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  return e;
}

Errors CompareLse(const float* lse, const std::vector<double>& ref) {
  Errors e;
  for (size_t i = 0; i < ref.size(); ++i) {
    const bool want_inf = std::isinf(ref[i]);
    if (std::isnan(lse[i]) || want_inf != std::isinf(lse[i])) {
      ++e.bad;
      continue;
    }
    if (!want_inf) e.max_abs = std::max(e.max_abs, std::abs(static_cast<double>(lse[i]) - ref[i]));
  }
  return e;
}

// Twice the rounding step of the dtype at 0.3: the absolute slack FA3's tests give a 16-bit output.
double Atol(DType dtype) { return dtype == DType::kBF16 ? 2.0 * std::ldexp(1.0, -10) : 2.0 * std::ldexp(1.0, -13); }

}  // namespace

std::string RandomTensor(DType dtype, int64_t elems, uint64_t seed) {
  std::string out(static_cast<size_t>(elems) * 2, '\0');
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.f, 1.f);
  auto* p = reinterpret_cast<uint16_t*>(out.data());
  for (int64_t i = 0; i < elems; ++i) p[i] = FloatToHalf(dtype, dist(rng));
  return out;
}

std::string RandomFp8Tensor(int64_t elems, int64_t heads, int64_t head_dim, uint64_t seed,
                            std::vector<float>* descale) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.f, 1.f);
  std::vector<float> x(static_cast<size_t>(elems));
  float amax = 0;
  for (float& e : x) {
    e = dist(rng);
    amax = std::max(amax, std::fabs(e));
  }
  if (descale->empty()) descale->push_back(amax > 0 ? amax / kFp8E4M3Max : 1.f);
  std::string out(x.size(), '\0');
  const bool per_head = descale->size() > 1;
  for (size_t i = 0; i < x.size(); ++i) {
    const float d = (*descale)[per_head ? (i / static_cast<size_t>(head_dim)) % static_cast<size_t>(heads) : 0];
    out[i] = static_cast<char>(FloatToFp8E4M3(x[i] / d));
  }
  return out;
}

absl::StatusOr<std::vector<float>> DescalesPerHead(const std::string& field, const std::vector<float>& given,
                                                   int64_t heads) {
  const size_t n = given.size(), h = static_cast<size_t>(heads);
  if (n == 1) return std::vector<float>(h, given[0]);
  if (n == h) return given;
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", n, " values, expected 1 or ", h, " (one per head)"));
}

std::string CachedRows(const SequenceShape& shape, const std::vector<float>& descale, int64_t layer,
                       std::string rows) {
  if (shape.kv_format != KvFormat::kFp8E4M3) return rows;
  auto* h = reinterpret_cast<uint16_t*>(rows.data());
  const size_t elems = rows.size() / 2, head_dim = static_cast<size_t>(shape.head_dim);
  for (size_t i = 0; i < elems; ++i) {
    const float d = shape.DescaleAt(descale, layer, static_cast<int64_t>((i / head_dim) % shape.kv_heads));
    h[i] = FloatToHalf(shape.dtype, Fp8E4M3ToFloat(FloatToFp8E4M3(HalfToFloat(shape.dtype, h[i]) / d)) * d);
  }
  return rows;
}

absl::StatusOr<std::string> ReadTensorFile(const std::string& path, uint64_t expected_bytes) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  const std::streamoff size = in.tellg();
  if (size < 0 || static_cast<uint64_t>(size) != expected_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": holds ", size, " bytes, the shape needs ", expected_bytes));
  }
  std::string out(static_cast<size_t>(size), '\0');
  in.seekg(0);
  if (!in.read(out.data(), size)) return absl::DataLossError(absl::StrCat(path, ": read failed"));
  return out;
}

absl::Status WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return absl::PermissionDeniedError(absl::StrCat(path, ": cannot create"));
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.close();
  if (!out) return absl::DataLossError(absl::StrCat(path, ": write failed"));
  return absl::OkStatus();
}

absl::StatusOr<Oracle> Oracle::Compute(const Problem& p, const std::string& q, const std::string& k,
                                       const std::string& v, int num_threads) {
  if (p.dtype == DType::kFP8E4M3) {
    return absl::InvalidArgumentError("dtype: float8 inputs are read through their descales (pass the RequestSpec)");
  }
  return Run(p, q, k, v, {}, num_threads);
}

absl::StatusOr<Oracle> Oracle::Compute(const RequestSpec& spec, const std::string& q, const std::string& k,
                                       const std::string& v, int num_threads) {
  Descales d;
  if (spec.dtype == DType::kFP8E4M3) {
    const auto spread = [](const char* field, const std::vector<float>& given, int64_t heads,
                           std::vector<float>* out) -> absl::Status {
      absl::StatusOr<std::vector<float>> per_head = DescalesPerHead(field, given, heads);
      if (!per_head.ok()) return per_head.status();
      *out = *std::move(per_head);
      return absl::OkStatus();
    };
    for (absl::Status st : {spread("q_descale", spec.q_descale, spec.shape.q_heads, &d.q),
                            spread("k_descale", spec.k_descale, spec.shape.kv_heads, &d.k),
                            spread("v_descale", spec.v_descale, spec.shape.kv_heads, &d.v)}) {
      if (!st.ok()) return st;
    }
  }
  return Run(spec.ToProblem(), q, k, v, d, num_threads);
}

absl::StatusOr<Oracle> Oracle::Run(const Problem& p, const std::string& q, const std::string& k, const std::string& v,
                                   const Descales& descales, int num_threads) {
  const Shape& s = p.shape;
  if (s.batch <= 0 || s.q_len <= 0 || s.kv_len <= 0 || s.q_heads <= 0 || s.kv_heads <= 0 || s.head_dim <= 0 ||
      s.q_heads % s.kv_heads != 0) {
    return absl::InvalidArgumentError("shape: every dim must be positive and q_heads a multiple of kv_heads");
  }
  const uint64_t eb = static_cast<uint64_t>(DTypeBytes(p.dtype));
  const uint64_t qb = static_cast<uint64_t>(QElems(s)) * eb, kvb = static_cast<uint64_t>(KVElems(s)) * eb;
  if (q.size() != qb) return absl::InvalidArgumentError(absl::StrCat("q: ", q.size(), " bytes, expected ", qb));
  if (k.size() != kvb) return absl::InvalidArgumentError(absl::StrCat("k: ", k.size(), " bytes, expected ", kvb));
  if (v.size() != kvb) return absl::InvalidArgumentError(absl::StrCat("v: ", v.size(), " bytes, expected ", kvb));

  Oracle o;
  o.problem_ = p;
  o.problem_.want_lse = true;  // always computed: LSE checks cost nothing extra here
  const Layout layout = ContiguousLayout(s);
  ReferenceOptions opts;
  opts.num_threads = num_threads;
  o.o64_.assign(static_cast<size_t>(QElems(s)), std::numeric_limits<double>::quiet_NaN());
  o.lse64_.assign(static_cast<size_t>(LseElems(s)), std::numeric_limits<double>::quiet_NaN());
  // The plain reference's outputs, poisoned first so that an element it fails to write cannot pass unnoticed.
  std::vector<uint16_t> o16(static_cast<size_t>(QElems(s)), 0x7fc1);
  std::vector<float> lse32(static_cast<size_t>(LseElems(s)), std::numeric_limits<float>::quiet_NaN());
  if (p.dtype == DType::kFP8E4M3) {
    const auto* q8 = reinterpret_cast<const uint8_t*>(q.data());
    const auto* k8 = reinterpret_cast<const uint8_t*>(k.data());
    const auto* v8 = reinterpret_cast<const uint8_t*>(v.data());
    const Fp8Descales d{descales.q.data(), descales.k.data(), descales.v.data()};
    ReferenceAttentionFp8F64(o.problem_, layout, q8, k8, v8, d, o.o64_.data(), o.lse64_.data(), opts);
    ReferenceAttentionFp8(o.problem_, layout, q8, k8, v8, d, o16.data(), lse32.data(), opts);
  } else {
    ReferenceAttentionF64(o.problem_, layout, Halves(q), Halves(k), Halves(v), o.o64_.data(), o.lse64_.data(), opts);
    ReferenceAttention(o.problem_, layout, Halves(q), Halves(k), Halves(v), o16.data(), lse32.data(), opts);
  }
  if (p.dtype == DType::kFP8E4M3) {
    // The float8 kernels round P to e4m3 before P V, at most 2^-4 of each probability, so an element of O moves by at
    // most 2^-4 max|V| (the relative L2 error of random inputs stays under 3%); their accumulation of S errs by up to
    // ~1.5e-3 of sum_x |q_x k_x| <= |q| |k| (docs/kernels.md, "Float8 forward"), which moves the LSE as much and O by
    // a share of the same bound. Doubled, as the fp32 reference's error is.
    const Shape& sh = p.shape;
    const auto* q8 = reinterpret_cast<const uint8_t*>(q.data());
    const auto* k8 = reinterpret_cast<const uint8_t*>(k.data());
    const auto* v8 = reinterpret_cast<const uint8_t*>(v.data());
    auto max_row_norm = [&](const uint8_t* x, int64_t rows, int64_t heads, const std::vector<float>& d) {
      double best = 0;
      for (int64_t r = 0; r < rows * heads; ++r) {
        double n = 0;
        for (int64_t c = 0; c < sh.head_dim; ++c) {
          const double e = Fp8E4M3ToFloat(x[r * sh.head_dim + c]) * static_cast<double>(d[r % heads]);
          n += e * e;
        }
        best = std::max(best, std::sqrt(n));
      }
      return best;
    };
    double v_max = 0;
    for (int64_t i = 0; i < KVElems(sh); ++i) {
      v_max = std::max(v_max, std::abs(Fp8E4M3ToFloat(v8[i]) *
                                       static_cast<double>(descales.v[(i / sh.head_dim) % sh.kv_heads])));
    }
    const double qk = max_row_norm(q8, sh.batch * sh.q_len, sh.q_heads, descales.q) *
                      max_row_norm(k8, sh.batch * sh.kv_len, sh.kv_heads, descales.k) * std::abs(p.scale);
    o.fp8_o_slack_ = 2 * 0.0625 * v_max;
    o.fp8_rel_l2_slack_ = 0.06;
    o.fp8_lse_slack_ = 2 * qk / 512;
  }
  const Errors eo = CompareO(OutputDType(p.dtype), o16.data(), o.o64_);
  const Errors el = CompareLse(lse32.data(), o.lse64_);
  if (eo.bad || el.bad) return absl::InternalError("the fp32 reference produced non-finite values");
  o.ref_max_abs_ = eo.max_abs;
  o.ref_rel_l2_ = eo.rel_l2;
  o.ref_lse_ = el.max_abs;
  return o;
}

VerifyReport Oracle::Check(std::string_view o, std::string_view lse) const {
  VerifyReport r;
  r.ref_max_abs_err = ref_max_abs_;
  r.ref_rel_l2_err = ref_rel_l2_;
  r.ref_lse_max_abs_err = ref_lse_;
  const double atol = Atol(OutputDType(problem_.dtype));
  r.bound_max_abs = 2 * ref_max_abs_ + atol + fp8_o_slack_;
  r.bound_rel_l2 = 2 * ref_rel_l2_ + atol + fp8_rel_l2_slack_;
  r.bound_lse = 2 * ref_lse_ + 1e-3 + fp8_lse_slack_;
  if (o.size() != o64_.size() * 2) {
    r.detail = absl::StrCat("O has ", o.size(), " bytes, expected ", o64_.size() * 2);
    return r;
  }
  const Errors eo = CompareO(OutputDType(problem_.dtype), Halves(o), o64_);
  r.max_abs_err = eo.max_abs;
  r.rel_l2_err = eo.rel_l2;
  r.bad_values = eo.bad;
  if (!lse.empty()) {
    if (lse.size() != lse64_.size() * 4) {
      r.detail = absl::StrCat("LSE has ", lse.size(), " bytes, expected ", lse64_.size() * 4);
      return r;
    }
    std::vector<float> l(lse64_.size());
    std::memcpy(l.data(), lse.data(), lse.size());
    const Errors el = CompareLse(l.data(), lse64_);
    r.lse_max_abs_err = el.max_abs;
    r.bad_values += el.bad;
  }
  if (r.bad_values > 0) {
    r.detail = absl::StrCat(r.bad_values, " non-finite or wrongly (non-)infinite values");
  } else if (r.max_abs_err > r.bound_max_abs) {
    r.detail = absl::StrFormat("max abs error %.3g above the bound %.3g", r.max_abs_err, r.bound_max_abs);
  } else if (r.rel_l2_err > r.bound_rel_l2) {
    r.detail = absl::StrFormat("relative L2 error %.3g above the bound %.3g", r.rel_l2_err, r.bound_rel_l2);
  } else if (r.lse_max_abs_err > r.bound_lse) {
    r.detail = absl::StrFormat("LSE max abs error %.3g above the bound %.3g", r.lse_max_abs_err, r.bound_lse);
  } else {
    r.pass = true;
  }
  return r;
}

}  // namespace attnd::client
