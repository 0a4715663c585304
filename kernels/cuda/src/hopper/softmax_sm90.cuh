// Softmax role of the Hopper family: online softmax over wgmma's m64nN accumulator layout, exp2 domain,
// with the mma.sync family's lazy rescale (the reference max only moves when a block's max beats it by 2^8).
//
// Layout: warp w of a consumer warpgroup holds rows 16w..16w+15; lane 4g+t holds rows g and g+8 and, of
// each 8-column group i, columns 8i+2t and 8i+2t+1: s[4i+0..1] are row g, s[4i+2..3] row g+8. So a row's
// reductions are two xor-shuffles across the quad, as in the mma.sync family (m16n8k16 has the same fragment).
//
// Unlike the mma.sync family's, Step() does not touch O: with intra-warpgroup overlap the previous block's P V
// is still accumulating into O while this block's softmax runs, so Step() returns the factor and the caller applies
// it once that GEMM has completed.
#pragma once

#include <math_constants.h>

#include "../common/mma_sm80.cuh"       // Exp2
#include "../common/softmax_quad.cuh"  // QuadMax, QuadSum, kRescaleThresholdLog2
#include "fp8_sm90.cuh"                // PackFp8x4

namespace attnd::kernels::hopper {

using common::Exp2;
using common::QuadMax;
using common::QuadSum;

// The default of the family's hooks (a callback that does nothing): the softmax's after_max, the mainloop's
// after_issue / after_first.
struct NoOp {
  __device__ __forceinline__ void operator()() const {}
};

template <int kBlockN>
struct SoftmaxSm90 {
  static constexpr int kRegs = kBlockN / 2;
  float m[2];  // reference max (scaled, log2 domain); -inf until the row has seen a visible key
  float l[2];  // this thread's share of the row sum; reduced over the quad at the end

  __device__ __forceinline__ void Init() {
    m[0] = m[1] = -CUDART_INF_F;
    l[0] = l[1] = 0.f;
  }

  // s: raw scores in, P = exp2(s * scale_log2 - m) out. kMasked: keys past a row's limit are removed (key of
  // s[4i+e] = key0 + 8i + 2t + (e & 1)). Returns true (warp-uniform) when O must be scaled by f[0] / f[1].
  // after_max runs once the row maxima are known, before the exponentials (the step probes' mark; none otherwise).
  // kToRowMax: a row's reference moves to its max whenever the max is above it, not only past the threshold; for
  // the step after a failed TryStep (see there).
  template <bool kMasked, bool kToRowMax = false, typename AfterMax = NoOp>
  __device__ __forceinline__ bool Step(float (&s)[kRegs], float scale_log2, int key0, int limit0, int limit1,
                                       float (&f)[2], AfterMax after_max = {}) {
    constexpr float kThreshold = kToRowMax ? 0.f : common::kRescaleThresholdLog2;
    const int t = threadIdx.x & 3;
    // A positive scale commutes with the max: take it over the raw scores and fold the scale into the
    // exponent's FFMA (one FP32 op per score fewer, and the softmax is what bounds this kernel between
    // GEMMs). Zero or negative scales (allowed by the API) scale first.
    const bool fold = scale_log2 > 0.f;
    float mx0 = -CUDART_INF_F, mx1 = -CUDART_INF_F;
#pragma unroll
    for (int i = 0; i < kBlockN / 8; ++i) {
      if (!fold) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[4 * i + e] *= scale_log2;
      }
      if constexpr (kMasked) {
        const int key = key0 + 8 * i + 2 * t;
        if (key > limit0) s[4 * i + 0] = -CUDART_INF_F;
        if (key + 1 > limit0) s[4 * i + 1] = -CUDART_INF_F;
        if (key > limit1) s[4 * i + 2] = -CUDART_INF_F;
        if (key + 1 > limit1) s[4 * i + 3] = -CUDART_INF_F;
      }
      mx0 = fmaxf(mx0, fmaxf(s[4 * i + 0], s[4 * i + 1]));
      mx1 = fmaxf(mx1, fmaxf(s[4 * i + 2], s[4 * i + 3]));
    }
    if (fold) {  // -inf stays -inf; scaling by a positive factor commutes with the max, also after rounding
      mx0 *= scale_log2;
      mx1 *= scale_log2;
    }
    f[0] = f[1] = 1.f;
    // The reference max moves only when a row's max beats it by the threshold, and a row's max beats it only if one
    // of its four threads' partial maxima does: when no thread of the warp sees that (every block after the first few
    // of a tile), the quad maxima are not needed. Their two shuffle rounds sit between the S GEMM and the first exp2,
    // on the chain the other warpgroup's GEMMs have to cover (docs/tuning.md, "row max vote"). The outputs are the
    // same either way: without a move
    // the exponent's reference is m, as before.
    bool moved = false;
    const bool beyond = mx0 > m[0] + kThreshold || mx1 > m[1] + kThreshold;
    if (__any_sync(0xffffffffu, beyond)) {
      mx0 = QuadMax(mx0);
      mx1 = QuadMax(mx1);
      const bool move0 = mx0 > m[0] + kThreshold;
      const bool move1 = mx1 > m[1] + kThreshold;
      // exp2(-inf - mx) = 0 on a row's first visible block, where O and l are still zero.
      if (move0) {
        f[0] = Exp2(m[0] - mx0);
        m[0] = mx0;
        l[0] *= f[0];
      }
      if (move1) {
        f[1] = Exp2(m[1] - mx1);
        m[1] = mx1;
        l[1] *= f[1];
      }
      moved = __any_sync(0xffffffffu, move0 || move1);
    }
    // A row with no visible key yet keeps m = -inf; its scores are -inf and exp2(-inf - 0) = 0.
    const float b0 = m[0] == -CUDART_INF_F ? 0.f : m[0];
    const float b1 = m[1] == -CUDART_INF_F ? 0.f : m[1];
    const float k = fold ? scale_log2 : 1.f;  // masked scores are -inf either way: exp2 gives 0
    after_max();
#pragma unroll
    for (int i = 0; i < kBlockN / 8; ++i) {
      s[4 * i + 0] = Exp2(fmaf(s[4 * i + 0], k, -b0));
      s[4 * i + 1] = Exp2(fmaf(s[4 * i + 1], k, -b0));
      s[4 * i + 2] = Exp2(fmaf(s[4 * i + 2], k, -b1));
      s[4 * i + 3] = Exp2(fmaf(s[4 * i + 3], k, -b1));
      l[0] += s[4 * i + 0] + s[4 * i + 1];
      l[1] += s[4 * i + 2] + s[4 * i + 3];
    }
    return moved;
  }

  // The exponentials first, the check after: for a block past a tile's first few, the reference max almost never
  // moves, and then the row max (FMNMX chains and the vote, on the chain the other warpgroup's GEMMs have to
  // cover) decides nothing. P = exp2(s * scale_log2 - m) is taken with
  // the current reference and packed into `pk`; the block is accepted when each of this thread's two row partial
  // sums is at most 2^threshold, which bounds every P by what the lazy rescale allows, so it is the P the full Step
  // computes when no row moves. Otherwise (some P may be past the bound, NaN, or a row has no reference yet)
  // nothing has changed, `s` still holds the raw scores and the caller runs the full Step<..., kToRowMax = true>.
  // Unmasked blocks only. Returns true (warp-uniform) when accepted.
  // Why the full step after a rejection moves the reference to the row max: a row can be rejected with its max
  // inside the threshold (a sum past 2^8 from many P near 2^5, say), and a full step with the usual threshold
  // leaves its reference where it was, so every later block of the tile is rejected again and pays for the
  // exponentials twice. Causal tiles hit this: their first block is the diagonal, where a tile's top rows see one
  // key or a few, so their reference is the max of a few scores. Moved to the row max, such a tile is rejected
  // about once (docs/tuning.md, "TryStep").
  template <int kPSteps, typename Pack>
  __device__ __forceinline__ bool TryStep(const float (&s)[kRegs], float scale_log2, uint32_t (&pk)[kPSteps][4],
                                          Pack pack) {
    static_assert(kPSteps * 8 == kRegs, "P holds the block's 16-key steps");
    constexpr float kBound = 256.f;  // 2^kRescaleThresholdLog2
    static_assert(kBound == (1 << static_cast<int>(common::kRescaleThresholdLog2)), "bound and threshold agree");
    float bs0 = 0.f, bs1 = 0.f;
#pragma unroll
    for (int i = 0; i < kBlockN / 8; ++i) {
      const float p0 = Exp2(fmaf(s[4 * i + 0], scale_log2, -m[0]));
      const float p1 = Exp2(fmaf(s[4 * i + 1], scale_log2, -m[0]));
      const float p2 = Exp2(fmaf(s[4 * i + 2], scale_log2, -m[1]));
      const float p3 = Exp2(fmaf(s[4 * i + 3], scale_log2, -m[1]));
      bs0 += p0 + p1;
      bs1 += p2 + p3;
      // 8-column group i is half of 16-key step i / 2: A register 2 (i % 2) holds its row-g pair, the next its row g+8.
      pk[i / 2][2 * (i % 2) + 0] = pack(p0, p1);
      pk[i / 2][2 * (i % 2) + 1] = pack(p2, p3);
    }
    // m = -inf (no visible key yet) gives exp2(s - (-inf)) = inf: rejected by the bound, as NaN is.
    const bool ok = bs0 <= kBound && bs1 <= kBound;
    if (!__all_sync(0xffffffffu, ok)) return false;
    l[0] += bs0;
    l[1] += bs1;
    return true;
  }

  // TryStep for float8 P: the k32 A fragment packs two 8-column groups' pairs per register (ConsumerSm90::ConvertP).
  template <int kPSteps>
  __device__ __forceinline__ bool TryStepFp8(const float (&s)[kRegs], float scale_log2, uint32_t (&pk)[kPSteps][4]) {
    static_assert(kPSteps * 16 == kRegs, "P holds the block's 32-key steps");
    constexpr float kBound = 256.f;  // 2^kRescaleThresholdLog2, within e4m3's 448
    float bs0 = 0.f, bs1 = 0.f;
#pragma unroll
    for (int i = 0; i < kBlockN / 8; i += 2) {
      float p[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) p[e] = Exp2(fmaf(s[4 * i + e], scale_log2, -m[(e / 2) % 2]));
      bs0 += p[0] + p[1] + p[4] + p[5];
      bs1 += p[2] + p[3] + p[6] + p[7];
      // Groups i and i + 1 are one half of 32-key step i / 4: registers 2 ((i / 2) % 2) (row g) and the next (g+8).
      pk[i / 4][2 * ((i / 2) % 2) + 0] = PackFp8x4(p[0], p[1], p[4], p[5]);
      pk[i / 4][2 * ((i / 2) % 2) + 1] = PackFp8x4(p[2], p[3], p[6], p[7]);
    }
    const bool ok = bs0 <= kBound && bs1 <= kBound;
    if (!__all_sync(0xffffffffu, ok)) return false;
    l[0] += bs0;
    l[1] += bs1;
    return true;
  }

  template <int kORegs>
  __device__ __forceinline__ static void Rescale(float (&o)[kORegs], const float (&f)[2]) {
#pragma unroll
    for (int i = 0; i < kORegs / 4; ++i) {
      o[4 * i + 0] *= f[0];
      o[4 * i + 1] *= f[0];
      o[4 * i + 2] *= f[1];
      o[4 * i + 3] *= f[1];
    }
  }
};

}  // namespace attnd::kernels::hopper
