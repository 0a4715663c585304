#include "attnd/reference.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

#include "attnd/fp8.h"
#include "attnd/half.h"

namespace attnd {

const char* DTypeName(DType t) {
  switch (t) {
    case DType::kBF16:
      return "bf16";
    case DType::kFP16:
      return "fp16";
    case DType::kFP8E4M3:
      return "fp8_e4m3";
  }
  return "?";
}

const char* MaskName(Mask m) {
  switch (m) {
    case Mask::kNone:
      return "none";
    case Mask::kCausalTopLeft:
      return "causal";
    case Mask::kCausalBottomRight:
      return "causal_bottom_right";
  }
  return "?";
}

int64_t VisiblePairs(Mask m, int64_t q_len, int64_t kv_len) {
  if (m == Mask::kNone) return q_len * kv_len;
  int64_t pairs = 0;
  for (int64_t i = 0; i < q_len; ++i) pairs += LastVisibleKey(m, q_len, kv_len, i) + 1;
  return pairs;
}

float Fp8E4M3ToFloat(uint8_t v) {
  const float sign = (v & 0x80) != 0 ? -1.0f : 1.0f;
  const int exponent = (v >> 3) & 0xf, mantissa = v & 0x7;
  if (exponent == 0xf && mantissa == 0x7) return std::numeric_limits<float>::quiet_NaN();
  if (exponent == 0) return sign * std::ldexp(static_cast<float>(mantissa), -9);  // subnormal: m * 2^-6 / 8
  return sign * std::ldexp(1.0f + static_cast<float>(mantissa) / 8.0f, exponent - 7);
}

uint8_t FloatToFp8E4M3(float f) {
  const uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
  if (std::isnan(f)) return sign | 0x7f;
  const double a = std::fabs(static_cast<double>(f));
  if (a >= kFp8E4M3Max) return sign | 0x7e;  // satfinite (infinities included)
  // Below 2^-6 the step is 2^-9 everywhere (subnormals), and the code is the count of steps: rounding up to 8
  // steps lands on the smallest normal, code 8.
  if (a < std::ldexp(1.0, -6)) return sign | static_cast<uint8_t>(std::nearbyint(a * 512.0));
  int e;
  const double m = std::frexp(a, &e);              // a = m * 2^e, m in [0.5, 1)
  const double steps = std::nearbyint((2.0 * m - 1.0) * 8.0);  // of 1/8 above 1.0, ties to even (the default mode)
  int exponent = e - 1 + 7, mantissa = static_cast<int>(steps);
  if (mantissa == 8) ++exponent, mantissa = 0;
  if (exponent > 15 || (exponent == 15 && mantissa == 7)) return sign | 0x7e;  // rounded past 448
  return sign | static_cast<uint8_t>((exponent << 3) | mantissa);
}

float Fp16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exp = 113;
    while ((man & 0x400u) == 0) {
      man <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

uint16_t FloatToFp16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs >= 0x7f800000u) return sign | (abs > 0x7f800000u ? 0x7e00u : 0x7c00u);
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: infinity
  if (abs < 0x38800000u) {                        // below the smallest normal half: subnormal or zero
    if (abs < 0x33000000u) return sign;           // below half the smallest subnormal
    const uint32_t e = abs >> 23;
    const uint32_t man = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;  // 14 + (113 - e) - 1 ... places the value in units of 2^-24
    uint32_t res = man >> (shift);
    const uint32_t rem = man & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (res & 1u))) ++res;
    return sign | static_cast<uint16_t>(res);
  }
  uint32_t res = ((abs >> 13) - (112u << 10));
  const uint32_t rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (res & 1u))) ++res;
  return sign | static_cast<uint16_t>(res);
}

namespace {

// One task: query rows [row_begin, row_end) of one (batch, q_head).
struct Task {
  int64_t b, h, row_begin, row_end;
};

constexpr int64_t kRowsPerTask = 64;

// Runs the problem on opts.num_threads threads; each row's unnormalised O goes to store_o(b, i, h, acc, sum) and its
// LSE, natural log, to lse[b][h][i] (unless lse is null). decode(tensor, head, x) is the value of element x of
// `head` of q (tensor 0), k (1) or v (2).
template <typename Acc, typename Elem, typename Decode, typename StoreO>
void RunTasks(const Problem& p, const Layout& L, const Elem* q, const Elem* k, const Elem* v, Decode decode,
              const ReferenceOptions& opts, StoreO store_o, Acc* lse) {
  auto store_lse = [&](int64_t b, int64_t h, int64_t i, Acc value) {
    if (lse != nullptr) lse[(b * p.shape.q_heads + h) * p.shape.q_len + i] = value;
  };
  const Shape& s = p.shape;
  const int64_t group = s.q_heads / s.kv_heads;
  const int64_t d = s.head_dim;
  std::vector<Task> tasks;
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.q_heads; ++h)
      for (int64_t r = 0; r < s.q_len; r += kRowsPerTask) tasks.push_back({b, h, r, std::min(s.q_len, r + kRowsPerTask)});

  std::atomic<size_t> next{0};
  auto worker = [&]() {
    std::vector<Acc> kf, vf, qrow(d), scores(s.kv_len), acc(d);
    int64_t cached_b = -1, cached_kvh = -1;
    for (size_t t = next.fetch_add(1); t < tasks.size(); t = next.fetch_add(1)) {
      const Task& task = tasks[t];
      const int64_t kvh = task.h / group;
      if (task.b != cached_b || kvh != cached_kvh) {  // widen this head's K and V once per task run
        kf.resize(s.kv_len * d);
        vf.resize(s.kv_len * d);
        for (int64_t j = 0; j < s.kv_len; ++j) {
          const Elem* kr = k + task.b * L.k.batch + j * L.k.seq + kvh * L.k.head;
          const Elem* vr = v + task.b * L.v.batch + j * L.v.seq + kvh * L.v.head;
          for (int64_t x = 0; x < d; ++x) {
            kf[j * d + x] = static_cast<Acc>(decode(1, kvh, kr[x]));
            vf[j * d + x] = static_cast<Acc>(decode(2, kvh, vr[x]));
          }
        }
        cached_b = task.b;
        cached_kvh = kvh;
      }
      for (int64_t i = task.row_begin; i < task.row_end; ++i) {
        const Elem* qr = q + task.b * L.q.batch + i * L.q.seq + task.h * L.q.head;
        for (int64_t x = 0; x < d; ++x) qrow[x] = static_cast<Acc>(decode(0, task.h, qr[x]));
        const int64_t last = LastVisibleKey(p.mask, s.q_len, s.kv_len, i);
        std::fill(acc.begin(), acc.end(), Acc(0));
        if (last < 0) {
          store_o(task.b, i, task.h, acc.data(), Acc(1));
          store_lse(task.b, task.h, i, -std::numeric_limits<Acc>::infinity());
          continue;
        }
        Acc mx = -std::numeric_limits<Acc>::infinity();
        for (int64_t j = 0; j <= last; ++j) {
          const Acc* kr = &kf[j * d];
          Acc dot = 0;
          for (int64_t x = 0; x < d; ++x) dot += qrow[x] * kr[x];
          scores[j] = dot * static_cast<Acc>(p.scale);
          mx = std::max(mx, scores[j]);
        }
        Acc sum = 0;
        for (int64_t j = 0; j <= last; ++j) {
          const Acc e = std::exp(scores[j] - mx);
          sum += e;
          const Acc* vr = &vf[j * d];
          for (int64_t x = 0; x < d; ++x) acc[x] += e * vr[x];
        }
        store_o(task.b, i, task.h, acc.data(), sum);
        store_lse(task.b, task.h, i, mx + std::log(sum));
      }
    }
  };
  int threads = opts.num_threads > 0 ? opts.num_threads : static_cast<int>(std::thread::hardware_concurrency());
  threads = std::max(1, std::min<int>(threads, static_cast<int>(tasks.size())));
  std::vector<std::thread> pool;
  for (int i = 1; i < threads; ++i) pool.emplace_back(worker);
  worker();
  for (auto& th : pool) th.join();
}

// O's rows in `dtype` as `layout` places them, each rounded once from the fp32 accumulator.
auto StoreRounded(const Problem& p, const Layout& layout, DType dtype, uint16_t* o) {
  return [&p, &layout, dtype, o](int64_t b, int64_t i, int64_t h, const float* acc, float sum) {
    uint16_t* orow = o + b * layout.o.batch + i * layout.o.seq + h * layout.o.head;
    const float inv = 1.0f / sum;
    for (int64_t x = 0; x < p.shape.head_dim; ++x) orow[x] = FloatToHalf(dtype, acc[x] * inv);
  };
}

// O's rows in double, contiguous [batch, q_len, q_heads, head_dim].
auto StoreUnrounded(const Problem& p, double* o) {
  return [&p, o](int64_t b, int64_t i, int64_t h, const double* acc, double sum) {
    const Shape& s = p.shape;
    double* orow = o + ((b * s.q_len + i) * s.q_heads + h) * s.head_dim;
    for (int64_t x = 0; x < s.head_dim; ++x) orow[x] = acc[x] / sum;
  };
}

// Every e4m3 code's value, so that a row is decoded by lookups.
const std::array<float, 256>& Fp8Values() {
  static const std::array<float, 256> values = [] {
    std::array<float, 256> v{};
    for (int c = 0; c < 256; ++c) v[c] = Fp8E4M3ToFloat(static_cast<uint8_t>(c));
    return v;
  }();
  return values;
}

}  // namespace

void ReferenceAttention(const Problem& p, const Layout& layout, const uint16_t* q, const uint16_t* k,
                        const uint16_t* v, uint16_t* o, float* lse, const ReferenceOptions& opts) {
  const auto decode = [dtype = p.dtype](int, int64_t, uint16_t x) { return HalfToFloat(dtype, x); };
  RunTasks<float>(p, layout, q, k, v, decode, opts, StoreRounded(p, layout, p.dtype, o), p.want_lse ? lse : nullptr);
}

void ReferenceAttentionFp8(const Problem& p, const Layout& layout, const uint8_t* q, const uint8_t* k,
                           const uint8_t* v, const Fp8Descales& descales, uint16_t* o, float* lse,
                           const ReferenceOptions& opts) {
  const std::array<float, 256>& values = Fp8Values();
  const float* scales[3] = {descales.q, descales.k, descales.v};
  const auto decode = [&](int tensor, int64_t head, uint8_t x) { return values[x] * scales[tensor][head]; };
  RunTasks<float>(p, layout, q, k, v, decode, opts, StoreRounded(p, layout, OutputDType(p.dtype), o),
                  p.want_lse ? lse : nullptr);
}

void ReferenceAttentionF64(const Problem& p, const Layout& layout, const uint16_t* q, const uint16_t* k,
                           const uint16_t* v, double* o, double* lse, const ReferenceOptions& opts) {
  RunTasks<double>(
      p, layout, q, k, v, [dtype = p.dtype](int, int64_t, uint16_t x) { return HalfToFloat(dtype, x); }, opts,
      StoreUnrounded(p, o), lse);
}

void ReferenceAttentionFp8F64(const Problem& p, const Layout& layout, const uint8_t* q, const uint8_t* k,
                              const uint8_t* v, const Fp8Descales& descales, double* o, double* lse,
                              const ReferenceOptions& opts) {
  const std::array<float, 256>& values = Fp8Values();
  const float* scales[3] = {descales.q, descales.k, descales.v};
  const auto decode = [&](int tensor, int64_t head, uint8_t x) {
    return static_cast<double>(values[x]) * static_cast<double>(scales[tensor][head]);
  };
  RunTasks<double>(p, layout, q, k, v, decode, opts, StoreUnrounded(p, o), lse);
}

}  // namespace attnd
