// Epilogue role: normalise O by the row sums, stage it through the warp's own rows of the Q buffer (in the
// same 128-byte swizzle, so both the fragment writes and the row reads are bank-conflict free) and write it
// with 16-byte stores, a warp covering whole rows; the LSE (natural log) is written per row.
#pragma once

#include <math_constants.h>

#include <cstdint>

#include "attnd/kernels/attention.h"
#include "../common/mma_sm80.cuh"
#include "../common/softmax_quad.cuh"
#include "../common/tma_sm90.cuh"

namespace attnd::kernels::mma_sync {

template <typename Tile, typename Elem, int kDTiles, typename Softmax>
__device__ __forceinline__ void StoreOutput(const LaunchParams& p, float (&acc_o)[kDTiles][4], const Softmax& sm,
                                            uint8_t* q_smem, int row16, int lane, int q0, int batch, int head) {
  constexpr int kPanelBytes = Tile::kBlockM * 128;
  const int g = lane >> 2, t = lane & 3;
  const float l0 = common::QuadSum(sm.l[0]);
  const float l1 = common::QuadSum(sm.l[1]);
  // A row that saw no key (bottom-right causal with q_len > kv_len) has l = 0: O = 0, LSE = -inf.
  const float inv0 = l0 > 0.f ? 1.f / l0 : 0.f;
  const float inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
  const int row_a = row16 + g;  // row within the block (row16: first of this 16-row atom)
  const int row_b = row_a + 8;

  // This warp's Q rows are dead here (the last QK^T is done), so these 16 rows of the buffer hold O.
  __syncwarp();
#pragma unroll
  for (int d = 0; d < kDTiles; ++d) {
    uint8_t* panel = q_smem + (d / 8) * kPanelBytes + t * 4;
    *reinterpret_cast<uint32_t*>(panel + common::Swizzle128(row_a, d % 8)) =
        common::ElemTraits<Elem>::Pack(acc_o[d][0] * inv0, acc_o[d][1] * inv0);
    *reinterpret_cast<uint32_t*>(panel + common::Swizzle128(row_b, d % 8)) =
        common::ElemTraits<Elem>::Pack(acc_o[d][2] * inv1, acc_o[d][3] * inv1);
  }
  __syncwarp();

  constexpr int kChunksPerRow = Tile::kHeadDim / 8;  // 16-byte chunks
  Elem* o = static_cast<Elem*>(p.o);
#pragma unroll
  for (int it = 0; it < 16 * kChunksPerRow / 32; ++it) {
    const int idx = it * 32 + lane;
    const int r = row16 + idx / kChunksPerRow;
    const int c = idx % kChunksPerRow;
    const int q_row = q0 + r;
    if (q_row < p.q_len) {
      const uint4 v = *reinterpret_cast<const uint4*>(q_smem + (c / 8) * kPanelBytes + common::Swizzle128(r, c % 8));
      const int64_t off = batch * p.o_stride_b + static_cast<int64_t>(q_row) * p.o_stride_s +
                          head * p.o_stride_h + c * 8;
      *reinterpret_cast<uint4*>(o + off) = v;
    }
  }

  if (p.lse != nullptr && t == 0) {
    constexpr float kLn2 = 0.693147180559945309f;
    const int64_t base = (static_cast<int64_t>(batch) * p.q_heads + head) * p.q_len;
    if (q0 + row_a < p.q_len) p.lse[base + q0 + row_a] = l0 > 0.f ? (sm.m[0] + log2f(l0)) * kLn2 : -CUDART_INF_F;
    if (q0 + row_b < p.q_len) p.lse[base + q0 + row_b] = l1 > 0.f ? (sm.m[1] + log2f(l1)) * kLn2 : -CUDART_INF_F;
  }
}

}  // namespace attnd::kernels::mma_sync
