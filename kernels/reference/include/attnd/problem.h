// The attention problem as every layer of attnd sees it: shape, element type, mask, scale, layout.
// Plain C++ (no CUDA, no gRPC), so the server, the kernels, the client and the tests share one definition.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>

namespace attnd {

// kFP8E4M3 (float8 e4m3, attnd/fp8.h): inputs of the Hopper family's float8 forward, whose O is bf16
// (OutputDType) and whose Q, K and V carry descale factors (attnd::kernels::DeviceTensors).
enum class DType { kBF16, kFP16, kFP8E4M3 };
enum class Mask { kNone, kCausalTopLeft, kCausalBottomRight };
// How a KV sequence's cache stores K and V (SequenceShape.kv_dtype in attention.proto).
enum class KvFormat {
  kAsDtype,  // as the rows arrive, in the sequence's dtype
  // float8 e4m3 codes, half the bytes: element x of kv head h at layer l stored as FloatToFp8E4M3(x / descale[l, h])
  // and read back by every step's attention as Fp8E4M3ToFloat(code) * descale[l, h] (attnd/fp8.h).
  kFp8E4M3,
};

inline int64_t DTypeBytes(DType t) { return t == DType::kFP8E4M3 ? 1 : 2; }
// The element type of O (and of the 16-bit reference's inputs) for inputs of type t.
inline DType OutputDType(DType t) { return t == DType::kFP8E4M3 ? DType::kBF16 : t; }
const char* DTypeName(DType t);
const char* MaskName(Mask m);

struct Shape {
  int64_t batch = 0;
  int64_t q_len = 0;
  int64_t kv_len = 0;
  int64_t q_heads = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
};

// Element strides of a [batch, seq, heads, head_dim] tensor; head_dim is always contiguous (stride 1).
struct Strides {
  int64_t batch = 0;
  int64_t seq = 0;
  int64_t head = 0;
};

inline Strides ContiguousStrides(int64_t seq_len, int64_t heads, int64_t head_dim) {
  return Strides{seq_len * heads * head_dim, heads * head_dim, head_dim};
}

struct Layout {
  Strides q, k, v, o;
};

inline Layout ContiguousLayout(const Shape& s) {
  return Layout{ContiguousStrides(s.q_len, s.q_heads, s.head_dim), ContiguousStrides(s.kv_len, s.kv_heads, s.head_dim),
                ContiguousStrides(s.kv_len, s.kv_heads, s.head_dim), ContiguousStrides(s.q_len, s.q_heads, s.head_dim)};
}

struct Problem {
  Shape shape;
  DType dtype = DType::kBF16;
  Mask mask = Mask::kNone;
  float scale = 0.f;  // softmax scale applied to Q.K
  bool want_lse = false;
};

// The head dims every kernel family is built for. The CPU reference serves the same set, so that a client sees one
// API whichever backend answers.
inline constexpr std::array<int64_t, 3> kHeadDims = {64, 128, 256};
inline bool IsSupportedHeadDim(int64_t head_dim) {
  return std::find(kHeadDims.begin(), kHeadDims.end(), head_dim) != kHeadDims.end();
}

inline float DefaultScale(int64_t head_dim) { return 1.0f / std::sqrt(static_cast<float>(head_dim)); }

// Element counts of the contiguous tensors (callers validate the shape first; these do not check overflow).
inline int64_t QElems(const Shape& s) { return s.batch * s.q_len * s.q_heads * s.head_dim; }
inline int64_t KVElems(const Shape& s) { return s.batch * s.kv_len * s.kv_heads * s.head_dim; }
inline int64_t LseElems(const Shape& s) { return s.batch * s.q_heads * s.q_len; }

// Last key index query row `i` may see, or -1 when it sees none. Keys 0..LastVisibleKey are visible.
inline int64_t LastVisibleKey(Mask m, int64_t q_len, int64_t kv_len, int64_t i) {
  switch (m) {
    case Mask::kNone:
      return kv_len - 1;
    case Mask::kCausalTopLeft:
      return i < kv_len - 1 ? i : kv_len - 1;
    case Mask::kCausalBottomRight: {
      const int64_t last = i + kv_len - q_len;
      return last < kv_len - 1 ? (last < -1 ? -1 : last) : kv_len - 1;
    }
  }
  return -1;
}

// (query, key) pairs the mask lets through, summed over one head of one sequence.
int64_t VisiblePairs(Mask m, int64_t q_len, int64_t kv_len);

// Floating-point operations of the forward pass over the visible pairs (QK^T and PV, 2 flops per MAC).
inline double ForwardFlops(const Problem& p) {
  const Shape& s = p.shape;
  return 4.0 * static_cast<double>(s.batch) * static_cast<double>(s.q_heads) * static_cast<double>(s.head_dim) *
         static_cast<double>(VisiblePairs(p.mask, s.q_len, s.kv_len));
}

}  // namespace attnd
