// float8 e4m3 conversion (attnd/fp8.h): every code decoded to the value its bits define, and encoding checked
// against the nearest code found by search over all 254 finite codes (ties to the even code, beyond 448 to
// +-448), on every code, every midpoint between neighbours and a million random floats of every magnitude.
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "attnd/fp8.h"
#include "gtest/gtest.h"

namespace attnd {
namespace {

// The value of a finite code from its bits, in double.
double Value(int code) {
  const int sign = code & 0x80 ? -1 : 1, exponent = (code >> 3) & 0xf, mantissa = code & 7;
  return exponent == 0 ? sign * std::ldexp(mantissa, -9) : sign * std::ldexp(8 + mantissa, exponent - 10);
}
bool IsNan(int code) { return (code & 0x7f) == 0x7f; }

// The code a correct encoder gives `f`: the nearest finite one, ties to the even code; saturated past 448.
uint8_t Nearest(double f) {
  if (std::fabs(f) >= 448) return f < 0 ? 0xfe : 0x7e;
  int best = -1;
  double best_error = std::numeric_limits<double>::infinity();
  for (int code = 0; code < 256; ++code) {
    if (IsNan(code) || (code & 0x80) != (std::signbit(f) ? 0x80 : 0)) continue;
    const double error = std::fabs(Value(code) - f);
    if (error < best_error || (error == best_error && (code & 1) == 0)) best = code, best_error = error;
  }
  return static_cast<uint8_t>(best);
}

TEST(Fp8E4M3, EveryCodeDecodesToItsValue) {
  for (int code = 0; code < 256; ++code) {
    const float f = Fp8E4M3ToFloat(static_cast<uint8_t>(code));
    if (IsNan(code)) {
      EXPECT_TRUE(std::isnan(f)) << code;
    } else {
      EXPECT_EQ(static_cast<double>(f), Value(code)) << code;
    }
  }
  EXPECT_EQ(Fp8E4M3ToFloat(0x7e), kFp8E4M3Max);
  EXPECT_EQ(Fp8E4M3ToFloat(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(Fp8E4M3ToFloat(0x08), std::ldexp(1.0f, -6));
  EXPECT_TRUE(std::signbit(Fp8E4M3ToFloat(0x80)));
}

TEST(Fp8E4M3, EveryCodeRoundTrips) {
  for (int code = 0; code < 256; ++code) {
    if (IsNan(code)) continue;
    EXPECT_EQ(FloatToFp8E4M3(Fp8E4M3ToFloat(static_cast<uint8_t>(code))), code) << code;
  }
}

TEST(Fp8E4M3, MidpointsGoToTheEvenCodeAndJustPastThemToTheNearer) {
  for (int code = 0; code < 0x7e; ++code) {  // positive neighbours code, code + 1
    const double lo = Value(code), hi = Value(code + 1), mid = (lo + hi) / 2;
    const uint8_t even = static_cast<uint8_t>(code % 2 == 0 ? code : code + 1);
    EXPECT_EQ(FloatToFp8E4M3(static_cast<float>(mid)), even) << code;
    EXPECT_EQ(FloatToFp8E4M3(std::nextafter(static_cast<float>(mid), 0.0f)), code) << code;
    EXPECT_EQ(FloatToFp8E4M3(std::nextafter(static_cast<float>(mid), 1e9f)), code + 1) << code;
    EXPECT_EQ(FloatToFp8E4M3(-static_cast<float>(mid)), even | 0x80) << code;
  }
}

TEST(Fp8E4M3, SaturatesLikeSatfiniteAndKeepsNan) {
  for (float f : {448.0f, 449.0f, 463.9f, 464.0f, 480.0f, 1e6f, std::numeric_limits<float>::max(),
                  std::numeric_limits<float>::infinity()}) {
    EXPECT_EQ(FloatToFp8E4M3(f), 0x7e) << f;
    EXPECT_EQ(FloatToFp8E4M3(-f), 0xfe) << f;
  }
  EXPECT_TRUE(IsNan(FloatToFp8E4M3(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_EQ(FloatToFp8E4M3(0.0f), 0x00);
  EXPECT_EQ(FloatToFp8E4M3(-0.0f), 0x80);
  EXPECT_EQ(FloatToFp8E4M3(std::ldexp(1.0f, -11)), 0x00);  // a quarter step: to zero
  EXPECT_EQ(FloatToFp8E4M3(std::ldexp(3.0f, -11)), 0x01);  // three quarters: to the smallest subnormal
}

TEST(Fp8E4M3, RandomFloatsOfEveryMagnitudeEncodeToTheNearestCode) {
  std::mt19937 rng(8);
  std::uniform_real_distribution<double> log2_magnitude(-14, 10);
  for (int i = 0; i < 1000000; ++i) {
    const float f = static_cast<float>((rng() & 1 ? -1 : 1) * std::exp2(log2_magnitude(rng)));
    ASSERT_EQ(FloatToFp8E4M3(f), Nearest(f)) << f;
  }
}

}  // namespace
}  // namespace attnd
