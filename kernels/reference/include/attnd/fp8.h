// float8 e4m3 <-> float on the host, the format of Hopper's fp8 wgmma and of torch.float8_e4m3fn: 1 sign bit, 4
// exponent bits (bias 7), 3 mantissa bits; no infinities, S.1111.111 is NaN, the largest finite value is 448 and
// the smallest subnormal 2^-9. Encoding rounds to nearest, ties to even, and saturates as the hardware's
// cvt.rn.satfinite does: finite values and infinities beyond 448 become +-448, NaN stays NaN. The fp8 tests' inputs
// and their float64 references come from here.
#pragma once

#include <cstdint>

namespace attnd {

inline constexpr float kFp8E4M3Max = 448.0f;

float Fp8E4M3ToFloat(uint8_t v);
uint8_t FloatToFp8E4M3(float f);

}  // namespace attnd
