// Softmax role: online softmax over one warp's m16 x kKeys score tile in the exp2 domain. Each thread holds
// rows g and g + 8 and, of each 8-key tile, keys 2t and 2t + 1; a row's four threads form a quad, so row
// reductions are two xor-shuffles. The max moves on every tile that raises it (the O rescale is a few FMAs on
// a kernel bound by memory, so the lazy rescale of the prefill kernels would buy nothing here).
#pragma once

#include <math_constants.h>

#include "../common/softmax_quad.cuh"
#include "mma_decode.cuh"

namespace attnd::kernels::decode {

using common::QuadMax;
using common::QuadSum;

template <int kNTiles>  // 8-key tiles of the warp's slice
struct OnlineSoftmax {
  float m[2];  // running max of the scaled scores (log2 domain); -inf while the row has seen no visible key
  float l[2];  // this thread's share of the row's sum of exp2(score - m); reduced over the quad at the end

  __device__ __forceinline__ void Init() {
    m[0] = m[1] = -CUDART_INF_F;
    l[0] = l[1] = 0.f;
  }

  // Turns raw scores S into P = exp2(S * scale_log2 - m) in place and rescales acc_o when m moves.
  // kMasked: key (key0 + 8 * i + 2t + e) is removed unless it is below its row's end (end0 for row g, end1
  // for row g + 8). The scale is applied before the max, so any finite scale (also <= 0) works.
  template <bool kMasked, int kDTiles>
  __device__ __forceinline__ void Step(float (&s)[kNTiles][4], float (&acc_o)[kDTiles][4], float scale_log2,
                                       int key0, int end0, int end1) {
    const int t = threadIdx.x & 3;
    float mx0 = m[0], mx1 = m[1];
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
    // A row that has seen no visible key keeps max -inf; subtracting 0 instead turns its -inf scores into
    // P = 0, and the factor exp2(-inf) = 0 leaves its (zero) accumulator at zero.
    const float b0 = mx0 == -CUDART_INF_F ? 0.f : mx0;
    const float b1 = mx1 == -CUDART_INF_F ? 0.f : mx1;
    const float f0 = Exp2(m[0] - b0);
    const float f1 = Exp2(m[1] - b1);
    m[0] = mx0;
    m[1] = mx1;
    l[0] *= f0;
    l[1] *= f1;
    common::RescaleRows(acc_o, f0, f1);
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
};

}  // namespace attnd::kernels::decode
