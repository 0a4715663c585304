// bf16 / fp16 <-> float conversion on the host, round-to-nearest-even, NaN preserved.
// Hand-written because C++17 has no 16-bit float types and the host side must not need CUDA headers.
#pragma once

#include <cstdint>
#include <cstring>

#include "attnd/problem.h"

namespace attnd {

inline float Bf16ToFloat(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t FloatToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu) != 0) {
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);  // quiet NaN, sign kept
  }
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

float Fp16ToFloat(uint16_t h);
uint16_t FloatToFp16(float f);

inline float HalfToFloat(DType t, uint16_t h) { return t == DType::kBF16 ? Bf16ToFloat(h) : Fp16ToFloat(h); }
inline uint16_t FloatToHalf(DType t, float f) { return t == DType::kBF16 ? FloatToBf16(f) : FloatToFp16(f); }

}  // namespace attnd
