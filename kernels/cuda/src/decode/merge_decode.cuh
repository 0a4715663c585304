// Merge role: combines the splits of a query row through their LSEs, exactly, in fp32:
//   lse = log2(sum_s 2^lse_s),  O = sum_s 2^(lse_s - lse) * O_s
// where O_s is split s's normalised output and lse_s the log2 of its softmax sum (scaled scores, log2 domain).
// A split with no visible key has lse_s = -inf and weight 0. It runs either in the decode kernel's last block of
// each (sequence, kv head, row block) to finish, or, when that block would merge too many bytes alone, in a
// kernel of its own over every row. Partials are read from L2 (ld.global.cg): in the decode kernel they were
// written by other SMs, and this SM's L1 may still hold lines of the same workspace from an earlier launch.
#pragma once

#include <math_constants.h>

#include <cstdint>

#include "decode_params.h"
#include "mma_decode.cuh"

namespace attnd::kernels::decode {

// Writes O (4 columns from c) and, for c == 0, the LSE of query position `pos`, q head `qh` of sequence b,
// from its n splits' partials.
template <int D, typename Elem, int kBatch>
__device__ __forceinline__ void MergeSplitsRowIn(const DecodeParams& p, int b, int pos, int qh, int c, int n) {
  const int64_t per_seq = static_cast<int64_t>(p.q_len) * p.q_heads;  // rows of a split: (pos, q head)
  const int64_t first = static_cast<int64_t>(b) * p.max_splits * per_seq + static_cast<int64_t>(pos) * p.q_heads + qh;
  // Splits in batches of kBatch: each batch's loads are issued together, so a row waits for L2 about twice per
  // batch (its LSEs, then its O partials) rather than once per split, and only the batch maxima rescale the sum.
  float m = -CUDART_INF_F, l = 0.f;
  for (int s0 = 0; s0 < n; s0 += kBatch) {
    // Past the last split the loads repeat it (always in bounds, so nothing predicates them) and weigh 0.
    float ls[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const float x = __ldcg(p.lse_part + first + min(s0 + i, n - 1) * per_seq);
      ls[i] = s0 + i < n ? x : -CUDART_INF_F;
    }
    float bm = ls[0];
#pragma unroll
    for (int i = 1; i < kBatch; ++i) bm = fmaxf(bm, ls[i]);
    const float mn = fmaxf(m, bm);
    if (mn == -CUDART_INF_F) continue;  // no split so far sees a key
    float bs = 0.f;
#pragma unroll
    for (int i = 0; i < kBatch; ++i) bs += exp2f(ls[i] - mn);  // 0 for a split with no visible key
    l = (m == -CUDART_INF_F ? 0.f : l * exp2f(m - mn)) + bs;
    m = mn;
  }
  const float lse2 = l > 0.f ? m + log2f(l) : -CUDART_INF_F;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  if (l > 0.f) {
    for (int s0 = 0; s0 < n; s0 += kBatch) {
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int64_t at = first + min(s0 + i, n - 1) * per_seq;
        const float ls = __ldcg(p.lse_part + at);
        const float4 x = __ldcg(reinterpret_cast<const float4*>(p.o_part + at * D + c));
        const float w = s0 + i < n ? exp2f(ls - lse2) : 0.f;
        acc.x += w * x.x;
        acc.y += w * x.y;
        acc.z += w * x.z;
        acc.w += w * x.w;
      }
    }
  }
  uint2 packed;
  packed.x = ElemOps<Elem>::Pack(acc.x, acc.y);
  packed.y = ElemOps<Elem>::Pack(acc.z, acc.w);
  uint16_t* o = static_cast<uint16_t*>(p.o);
  *reinterpret_cast<uint2*>(o + b * p.o_sb + pos * p.o_ss + qh * p.o_sh + c) = packed;
  if (p.lse != nullptr && c == 0) {
    p.lse[(static_cast<int64_t>(b) * p.q_heads + qh) * p.q_len + pos] = lse2 * 0.6931471805599453f;
  }
}

// Batches of 32 above 16 splits (one batch where the plan's heuristic gives 17-32), of 16 otherwise: a batch
// wider than the splits issues loads that weigh nothing, which cost more at 16 splits than a second batch does.
template <int D, typename Elem>
__device__ __forceinline__ void MergeSplitsRow(const DecodeParams& p, int b, int pos, int qh, int c, int n) {
  if (n > 16) {
    MergeSplitsRowIn<D, Elem, 32>(p, b, pos, qh, c, n);
  } else {
    MergeSplitsRowIn<D, Elem, 16>(p, b, pos, qh, c, n);
  }
}

constexpr int kMergeThreads = 128;

// The merge as a kernel of its own: each thread owns 4 columns of one row (sequence, position, q head); a block
// holds kMergeThreads / (D / 4) rows. Sequences planned into one split were written by the decode kernel and are
// skipped.
template <int D, typename Elem>
__global__ void __launch_bounds__(kMergeThreads) MergeSplitsKernel(const DecodeParams p) {
  constexpr int kThreadsPerRow = D / 4;
  constexpr int kRowsPerBlock = kMergeThreads / kThreadsPerRow;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kThreadsPerRow;
  const int c = (threadIdx.x % kThreadsPerRow) * 4;
  const int64_t per_seq = static_cast<int64_t>(p.q_len) * p.q_heads;
  if (row >= p.batch * per_seq) return;
  const int b = static_cast<int>(row / per_seq);
  const int64_t within = row - b * per_seq;
  const int n = SplitsFor(p.kv_lens[b], p.split_keys, p.max_splits);
  if (n == 1) return;
  MergeSplitsRow<D, Elem>(p, b, static_cast<int>(within / p.q_heads), static_cast<int>(within % p.q_heads), c, n);
}

}  // namespace attnd::kernels::decode
