// Softmax role: online softmax over the m16n8k16 accumulator layout, in the exp2 domain, with the seed's
// lazy rescale (common/softmax_quad.cuh). Each thread holds two rows of its warp's 16 (g and g + 8) and, of each 8-column tile, the
// columns 2t and 2t + 1; a row's four threads form a quad (lanes 4g..4g+3), so row reductions are two
// xor-shuffles.
#pragma once

#include <math_constants.h>

#include "../common/mma_sm80.cuh"
#include "../common/softmax_quad.cuh"

namespace attnd::kernels::seed {

template <int kNTiles>  // 8-column tiles of one S row block (block_n / 8)
struct OnlineSoftmax {
  float m[2];  // reference max, scaled log2 domain; -inf until the row has seen a visible key
  float l[2];  // this thread's share of the row sum of exp2(x - m); reduced over the quad at the end

  __device__ __forceinline__ void Init() {
    m[0] = m[1] = -CUDART_INF_F;
    l[0] = l[1] = 0.f;
  }

  // Turns raw scores S into P = exp2(S * scale_log2 - m) in place and rescales acc_o when m moves.
  // kMasked: keys past `limit` (per row; key index = key0 + 8 * i + 2t + e) are removed. The scale is applied
  // before the mask and the max, so any finite scale (also <= 0) is handled.
  template <bool kMasked, int kDTiles>
  __device__ __forceinline__ void Step(float (&s)[kNTiles][4], float (&acc_o)[kDTiles][4], float scale_log2,
                                       int key0, int limit0, int limit1) {
    const int t = threadIdx.x & 3;
    float mx0 = -CUDART_INF_F, mx1 = -CUDART_INF_F;
#pragma unroll
    for (int i = 0; i < kNTiles; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[i][e] *= scale_log2;
      if constexpr (kMasked) {
        const int key = key0 + 8 * i + 2 * t;
        if (key > limit0) s[i][0] = -CUDART_INF_F;
        if (key + 1 > limit0) s[i][1] = -CUDART_INF_F;
        if (key > limit1) s[i][2] = -CUDART_INF_F;
        if (key + 1 > limit1) s[i][3] = -CUDART_INF_F;
      }
      mx0 = fmaxf(mx0, fmaxf(s[i][0], s[i][1]));
      mx1 = fmaxf(mx1, fmaxf(s[i][2], s[i][3]));
    }
    mx0 = common::QuadMax(mx0);
    mx1 = common::QuadMax(mx1);
    const bool move0 = mx0 > m[0] + common::kRescaleThresholdLog2;
    const bool move1 = mx1 > m[1] + common::kRescaleThresholdLog2;
    if (__any_sync(0xffffffffu, move0 || move1)) {
      // exp2(-inf - mx) = 0 on a row's first visible tile: acc_o and l are still zero there.
      float f0 = 1.f, f1 = 1.f;
      if (move0) {
        f0 = common::Exp2(m[0] - mx0);
        m[0] = mx0;
        l[0] *= f0;
      }
      if (move1) {
        f1 = common::Exp2(m[1] - mx1);
        m[1] = mx1;
        l[1] *= f1;
      }
      common::RescaleRows(acc_o, f0, f1);
    }
    // A row with no visible key so far keeps m = -inf; its masked scores are -inf and exp2(-inf - 0) = 0.
    const float b0 = m[0] == -CUDART_INF_F ? 0.f : m[0];
    const float b1 = m[1] == -CUDART_INF_F ? 0.f : m[1];
#pragma unroll
    for (int i = 0; i < kNTiles; ++i) {
      s[i][0] = common::Exp2(s[i][0] - b0);
      s[i][1] = common::Exp2(s[i][1] - b0);
      s[i][2] = common::Exp2(s[i][2] - b1);
      s[i][3] = common::Exp2(s[i][3] - b1);
      l[0] += s[i][0] + s[i][1];
      l[1] += s[i][2] + s[i][3];
    }
  }
};

}  // namespace attnd::kernels::seed
