// Softmax role of the mma.sync kernels (the mma_sync prefill family and decode): online softmax over the
// m16n8k16 accumulator layout, in the exp2 domain. Each thread holds two rows of its warp's 16 (g and g + 8) and,
// of each 8-key tile, the keys 2t and 2t + 1; a row's four threads form a quad (lanes 4g..4g+3), so row reductions
// are two xor-shuffles.
#pragma once

#include <math_constants.h>

#include "mma_sm80.cuh"
#include "softmax_quad.cuh"

namespace attnd::kernels::common {

// When the running max m moves and the O accumulator is rescaled:
//   kLazy   only when a tile's max exceeds m by more than kRescaleThresholdLog2 (softmax_quad.cuh): the prefill
//           kernels, where a rescale on every tile costs FMAs the tensor cores wait for;
//   kEager  on every tile that raises it: the decode kernels, bound by memory, where those FMAs are free and the
//           lazy test would buy nothing.
enum class Rescale { kLazy, kEager };

template <int kNTiles, Rescale kRescale>  // 8-key tiles of one score row block
struct OnlineSoftmax {
  float m[2];  // running max of the scaled scores (log2 domain); -inf while the row has seen no visible key
  float l[2];  // this thread's share of the row's sum of exp2(score - m); reduced over the quad at the end

  __device__ __forceinline__ void Init() {
    m[0] = m[1] = -CUDART_INF_F;
    l[0] = l[1] = 0.f;
  }

  // Turns raw scores S into P = exp2(S * scale_log2 - m) in place and rescales acc_o when m moves. kMasked: key
  // (key0 + 8 * i + 2t + e) is removed unless it is below its row's end (end0 for row g, end1 for row g + 8). The
  // scale is applied before the mask and the max, so any finite scale (also <= 0) works.
  template <bool kMasked, int kDTiles>
  __device__ __forceinline__ void Step(float (&s)[kNTiles][4], float (&acc_o)[kDTiles][4], float scale_log2,
                                       int key0, int end0, int end1) {
    float mx0 = kRescale == Rescale::kEager ? m[0] : -CUDART_INF_F;
    float mx1 = kRescale == Rescale::kEager ? m[1] : -CUDART_INF_F;
    ScaleMaskMax<kMasked>(s, scale_log2, key0, end0, end1, mx0, mx1);
    float b0, b1;  // what P subtracts: the row's max, or 0 for a row that has seen no visible key
    if constexpr (kRescale == Rescale::kEager) {
      // Subtracting 0 from a row whose max is still -inf turns its -inf scores into P = 0, and the factor
      // exp2(-inf) = 0 leaves its (zero) accumulator at zero.
      b0 = mx0 == -CUDART_INF_F ? 0.f : mx0;
      b1 = mx1 == -CUDART_INF_F ? 0.f : mx1;
      const float f0 = Exp2(m[0] - b0);
      const float f1 = Exp2(m[1] - b1);
      m[0] = mx0;
      m[1] = mx1;
      l[0] *= f0;
      l[1] *= f1;
      RescaleRows(acc_o, f0, f1);
    } else {
      MoveLazily(acc_o, mx0, mx1);
      // A row with no visible key so far keeps m = -inf; its masked scores are -inf and exp2(-inf - 0) = 0.
      b0 = m[0] == -CUDART_INF_F ? 0.f : m[0];
      b1 = m[1] == -CUDART_INF_F ? 0.f : m[1];
    }
#pragma unroll
    for (int i = 0; i < kNTiles; ++i) {
      s[i][0] = Exp2(s[i][0] - b0);
      s[i][1] = Exp2(s[i][1] - b0);
      s[i][2] = Exp2(s[i][2] - b1);
      s[i][3] = Exp2(s[i][3] - b1);
      l[0] += s[i][0] + s[i][1];
      l[1] += s[i][2] + s[i][3];
    }
  }

 private:
  // Scales the scores in place, masks them, and folds the rows' maxima, reduced over the quad, into mx0 / mx1.
  template <bool kMasked>
  __device__ __forceinline__ static void ScaleMaskMax(float (&s)[kNTiles][4], float scale_log2, int key0, int end0,
                                                      int end1, float& mx0, float& mx1) {
    const int t = threadIdx.x & 3;
#pragma unroll
    for (int i = 0; i < kNTiles; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[i][e] *= scale_log2;
      if constexpr (kMasked) {
        const int key = key0 + 8 * i + 2 * t;
        if (key >= end0) s[i][0] = -CUDART_INF_F;
        if (key + 1 >= end0) s[i][1] = -CUDART_INF_F;
        if (key >= end1) s[i][2] = -CUDART_INF_F;
        if (key + 1 >= end1) s[i][3] = -CUDART_INF_F;
      }
      mx0 = fmaxf(mx0, fmaxf(s[i][0], s[i][1]));
      mx1 = fmaxf(mx1, fmaxf(s[i][2], s[i][3]));
    }
    mx0 = QuadMax(mx0);
    mx1 = QuadMax(mx1);
  }

  // The lazy rescale: m moves only where the tile's max mx exceeds it by more than the threshold, and the warp
  // rescales acc_o only when one of its rows moved. exp2(-inf - mx) = 0 on a row's first visible tile: acc_o and l
  // are still zero there.
  template <int kDTiles>
  __device__ __forceinline__ void MoveLazily(float (&acc_o)[kDTiles][4], float mx0, float mx1) {
    const bool move0 = mx0 > m[0] + kRescaleThresholdLog2;
    const bool move1 = mx1 > m[1] + kRescaleThresholdLog2;
    if (!__any_sync(0xffffffffu, move0 || move1)) return;
    float f0 = 1.f, f1 = 1.f;
    if (move0) {
      f0 = Exp2(m[0] - mx0);
      m[0] = mx0;
      l[0] *= f0;
    }
    if (move1) {
      f1 = Exp2(m[1] - mx1);
      m[1] = mx1;
      l[1] *= f1;
    }
    RescaleRows(acc_o, f0, f1);
  }
};

}  // namespace attnd::kernels::common
