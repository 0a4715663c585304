// Epilogue role: normalise O by the row sums and write it, and the LSE (natural log), straight from the
// accumulator registers. Each quad writes 16 contiguous bytes of a row per 8-column group; staging through
// shared memory would widen that, but the Q buffer is already being refilled for the next tile by then.
#pragma once

#include <math_constants.h>

#include <cstdint>

#include "../seed/mma_sm80.cuh"  // ElemTraits<Elem>::Pack
#include "attnd/kernels/attention.h"
#include "softmax_sm90.cuh"

namespace attnd::kernels::hopper {

// row0: this thread's first row (the second is row0 + 8); zero: the block saw no key at all.
template <int kHeadDim, typename Elem, int kBlockN>
__device__ __forceinline__ void StoreOutputSm90(const LaunchParams& p, const float (&o)[kHeadDim / 2],
                                                const SoftmaxSm90<kBlockN>& sm, int row0, int head, int batch) {
  const int t = threadIdx.x & 3;
  const float l0 = QuadSum(sm.l[0]);
  const float l1 = QuadSum(sm.l[1]);
  // A row that saw no key (bottom-right causal with q_len > kv_len) has l = 0: O = 0, LSE = -inf.
  const float inv0 = l0 > 0.f ? 1.f / l0 : 0.f;
  const float inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
  const int row1 = row0 + 8;
  Elem* out = static_cast<Elem*>(p.o);
  const int64_t head_off = static_cast<int64_t>(batch) * p.o_stride_b + static_cast<int64_t>(head) * p.o_stride_h;
  Elem* r0 = out + head_off + static_cast<int64_t>(row0) * p.o_stride_s + 2 * t;
  Elem* r1 = out + head_off + static_cast<int64_t>(row1) * p.o_stride_s + 2 * t;
  const bool in0 = row0 < p.q_len, in1 = row1 < p.q_len;
#pragma unroll
  for (int i = 0; i < kHeadDim / 8; ++i) {
    if (in0) {
      *reinterpret_cast<uint32_t*>(r0 + 8 * i) = seed::ElemTraits<Elem>::Pack(o[4 * i] * inv0, o[4 * i + 1] * inv0);
    }
    if (in1) {
      *reinterpret_cast<uint32_t*>(r1 + 8 * i) =
          seed::ElemTraits<Elem>::Pack(o[4 * i + 2] * inv1, o[4 * i + 3] * inv1);
    }
  }
  if (p.lse != nullptr && t == 0) {
    constexpr float kLn2 = 0.693147180559945309f;
    const int64_t base = (static_cast<int64_t>(batch) * p.q_heads + head) * p.q_len;
    if (in0) p.lse[base + row0] = l0 > 0.f ? (sm.m[0] + log2f(l0)) * kLn2 : -CUDART_INF_F;
    if (in1) p.lse[base + row1] = l1 > 0.f ? (sm.m[1] + log2f(l1)) * kLn2 : -CUDART_INF_F;
  }
}

}  // namespace attnd::kernels::hopper
