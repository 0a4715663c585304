// Split tail role (tile_scheduler_sm90.cuh, TailPartAt): a part of a tile whose key blocks several blocks share.
// Each consumer warp writes its rows' unnormalised O, row max and row sum (the accumulator registers as they are)
// to the part's workspace slot, then counts the part's key blocks into the tile's counter; the warp that
// completes the count reads every part of its rows back, combines them (the online softmax's merge), and writes
// O and LSE through the ordinary epilogue. Warps are independent: counters are per (tile, warp), so no warp
// waits for another and nothing blocks (a finisher only ever reads parts that are already written).
#pragma once

#include <math_constants.h>

#include <cstdint>

#include "attnd/kernels/attention.h"
#include "epilogue_fwd_sm90.cuh"
#include "softmax_sm90.cuh"
#include "tile_scheduler_sm90.cuh"

namespace attnd::kernels::hopper {

// Workspace floats per (slot, consumer warp): each lane's O registers and its rows' max and sum, as float4s
// interleaved across lanes so that a warp's store covers 512 contiguous bytes.
template <int kHeadDim>
constexpr int TailSlotFloatsPerWarp() {
  return 32 * (kHeadDim / 2 + 4);
}

// Bytes of workspace and counters a split launch needs (laid out in the plan's workspace, launch_plan_sm90.h).
template <int kHeadDim, int kConsumerWarps>
constexpr size_t TailWorkspaceBytes(int grid) {
  return size_t(grid) * kMaxTailPartsPerBlock * kConsumerWarps * TailSlotFloatsPerWarp<kHeadDim>() * sizeof(float);
}
template <int kConsumerWarps>
constexpr size_t TailCounterBytes(int split_tiles) {
  return size_t(split_tiles) * kConsumerWarps * kTailCounterWords * sizeof(unsigned);
}

// `slot`: this part's workspace slot (block * kMaxTailPartsPerBlock + its index among the block's parts);
// `warp`: the consumer warp (0 .. kConsumerWarps - 1); row0: this thread's first row.
template <int kHeadDim, typename Elem, int kBlockN, int kConsumerWarps,
          bool kVectorStores = true>  // StoreOutputSm90's
__device__ __forceinline__ void StoreTailPartSm90(const LaunchParams& p, const SchedulerParams& sp, const TailPart& part,
                                                  int slot, float (&o)[kHeadDim / 2], SoftmaxSm90<kBlockN>& sm,
                                                  int row0, int head, int batch, int warp) {
  constexpr int kChunks = kHeadDim / 8 + 1;  // float4s per lane: O, then (m0, m1, l0, l1)
  const int lane = threadIdx.x & 31;
  float4* const ws = reinterpret_cast<float4*>(sp.split_ws);
  {
    float4* dst = ws + (size_t(slot) * kConsumerWarps + warp) * kChunks * 32 + lane;
#pragma unroll
    for (int j = 0; j < kChunks - 1; ++j) __stcg(dst + j * 32, make_float4(o[4 * j], o[4 * j + 1], o[4 * j + 2], o[4 * j + 3]));
    __stcg(dst + (kChunks - 1) * 32, make_float4(sm.m[0], sm.m[1], sm.l[0], sm.l[1]));
  }
  unsigned* const c = sp.split_counters + (size_t(part.tile - sp.tail_tile) * kConsumerWarps + warp) * kTailCounterWords;
  __syncwarp();
  unsigned last = 0;
  if (lane == 0) {
    __threadfence();  // the warp's partial before its registration
    const unsigned k = atomicAdd(&c[0], 1u);
    __stcg(&c[2 + k], static_cast<unsigned>(slot));
    __threadfence();  // the registration before the count that may complete the tile
    const unsigned blocks = static_cast<unsigned>(part.end - part.first);
    last = atomicAdd(&c[1], blocks) + blocks == static_cast<unsigned>(part.tile_blocks) ? 1u : 0u;
  }
  if (__shfl_sync(0xffffffffu, last, 0) == 0) return;
  // This warp completed the tile: every other part's rows and registration are visible after the fence.
  __threadfence();
  unsigned n = 0;
  if (lane == 0) n = __ldcg(&c[0]);
  n = __shfl_sync(0xffffffffu, n, 0);
  // The row maxima over the parts first; then O a group of kGroup float4s at a time, summed over the parts with
  // their final factors, the loop over parts kept rolled. Only O, one group of one part's values and the running
  // sums are live: unrolled, or combining a whole part's O at a time, ptxas spilled (the paired d128 kernels, and
  // d256, whose O alone is 128 registers).
  constexpr int kGroup = 8;
  static_assert((kChunks - 1) % kGroup == 0, "O's float4s come in whole groups");
  const auto part_src = [&](unsigned k) {
    unsigned slot_k = 0;
    if (lane == 0) slot_k = __ldcg(&c[2 + k]);
    slot_k = __shfl_sync(0xffffffffu, slot_k, 0);
    return ws + (size_t(slot_k) * kConsumerWarps + warp) * kChunks * 32 + lane;
  };
  float m[2] = {-CUDART_INF_F, -CUDART_INF_F}, l[2] = {0.f, 0.f};
#pragma unroll 1
  for (unsigned k = 0; k < n; ++k) {
    const float4 ml = __ldcg(part_src(k) + (kChunks - 1) * 32);
    m[0] = fmaxf(m[0], ml.x);
    m[1] = fmaxf(m[1], ml.y);
  }
#pragma unroll
  for (int i = 0; i < kHeadDim / 2; ++i) o[i] = 0.f;
#pragma unroll
  for (int g = 0; g < kChunks - 1; g += kGroup) {
#pragma unroll 1
    for (unsigned k = 0; k < n; ++k) {
      const float4* src = part_src(k);
      const float4 ml = __ldcg(src + (kChunks - 1) * 32);
      // A part that saw no key of a row adds nothing to it (and a row no part saw keeps m = -inf: O = 0, l = 0).
      const float f0 = ml.x == -CUDART_INF_F ? 0.f : exp2f(ml.x - m[0]);
      const float f1 = ml.y == -CUDART_INF_F ? 0.f : exp2f(ml.y - m[1]);
      if (g == 0) {
        l[0] += ml.z * f0;
        l[1] += ml.w * f1;
      }
#pragma unroll
      for (int j = g; j < g + kGroup; ++j) {
        const float4 v = __ldcg(src + j * 32);
        o[4 * j] += v.x * f0;
        o[4 * j + 1] += v.y * f0;
        o[4 * j + 2] += v.z * f1;
        o[4 * j + 3] += v.w * f1;
      }
    }
  }
  // Zero for the next launch on this workspace (the tile has no other part left to count).
  if (lane == 0) {
    __stcg(&c[0], 0u);
    __stcg(&c[1], 0u);
  }
  sm.m[0] = m[0];
  sm.m[1] = m[1];
  sm.l[0] = l[0];
  sm.l[1] = l[1];
  StoreOutputSm90<kHeadDim, Elem, kBlockN, kVectorStores>(p, o, sm, row0, head, batch);
}

}  // namespace attnd::kernels::hopper
