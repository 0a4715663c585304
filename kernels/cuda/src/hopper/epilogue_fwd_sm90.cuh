// Epilogue role: normalise O by the row sums and write it, and the LSE (natural log), straight from the
// accumulator registers. Shared memory is all K/V ring and Q (already being refilled for the next tile), so O
// does not go through it: instead a 4x4 transpose inside each quad (shuffles) gives every thread 16 contiguous
// bytes of its row, and a warp's store writes 64 contiguous bytes of 8 rows: the epilogue's cost is the number of
// store instructions, not bytes (docs/tuning.md, "register epilogue").
#pragma once

#include <math_constants.h>

#include <cstdint>

#include "../common/mma_sm80.cuh"  // ElemTraits<Elem>::Pack
#include "../common/tma_sm90.cuh"  // Swizzle128
#include "attnd/kernels/attention.h"
#include "softmax_sm90.cuh"

namespace attnd::kernels::hopper {

// The quad's four threads each hold 4 bytes of four consecutive 8-column groups (a[k]: group k, columns
// 2t, 2t+1); returns the 16 bytes of group t (columns 0..7, in order). Two butterfly rounds, two shuffles each:
// after the round on bit m, element k comes from the thread and slot with bit m swapped where t and k differ.
__device__ __forceinline__ uint4 QuadTranspose(const uint32_t (&a)[4], int t) {
  uint32_t x[4], y[4];
  const bool odd = (t & 1) != 0;
#pragma unroll
  for (int k = 0; k < 4; k += 2) {
    const uint32_t got = __shfl_xor_sync(0xffffffffu, odd ? a[k] : a[k + 1], 1);
    x[k] = odd ? got : a[k];
    x[k + 1] = odd ? a[k + 1] : got;
  }
  const bool high = (t & 2) != 0;
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const uint32_t got = __shfl_xor_sync(0xffffffffu, high ? x[k] : x[k + 2], 2);
    y[k] = high ? got : x[k];
    y[k + 2] = high ? x[k + 2] : got;
  }
  return make_uint4(y[0], y[1], y[2], y[3]);
}

// One 16-byte global store when `store` holds. Through PTX's vector store, so that it stays one instruction: from a
// plain uint4 assignment ptxas split d64's first two of four stores into four 4-byte stores each (their shuffled
// sources were not in four consecutive registers), and each of those writes a quarter of the same sectors. The guard
// is a predicate inside the asm: a C++ branch around it put each store in a branch of its own.
__device__ __forceinline__ void StoreGlobal16If(bool store, void* ptr, const uint4& v) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n @p st.global.v4.b32 [%0], {%1, %2, %3, %4};\n}" ::"l"(ptr),
      "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(static_cast<uint32_t>(store))
      : "memory");
}

// row0: this thread's first row (the second is row0 + 8); zero: the block saw no key at all. O's pointer and
// strides are 16-byte multiples (plan.cc checks them). kVectorStores false: plain uint4 assignments, for the kernels
// whose O normally leaves through shared memory and which run this only for edge tiles; there four consecutive
// source registers made d128 s3 `_osk_p2`'s paired split-tail kernel spill (6 LDL/STL).
template <int kHeadDim, typename Elem, int kBlockN, bool kVectorStores = true>
__device__ __forceinline__ void StoreOutputSm90(const LaunchParams& p, const float (&o)[kHeadDim / 2],
                                                const SoftmaxSm90<kBlockN>& sm, int row0, int head, int batch) {
  static_assert(kHeadDim % 32 == 0, "the quad transpose takes four 8-column groups at a time");
  const int t = threadIdx.x & 3;
  const float l0 = QuadSum(sm.l[0]);
  const float l1 = QuadSum(sm.l[1]);
  // A row that saw no key (bottom-right causal with q_len > kv_len) has l = 0: O = 0, LSE = -inf.
  const float inv0 = l0 > 0.f ? 1.f / l0 : 0.f;
  const float inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
  const int row1 = row0 + 8;
  Elem* out = static_cast<Elem*>(p.o);
  const int64_t head_off = static_cast<int64_t>(batch) * p.o_stride_b + static_cast<int64_t>(head) * p.o_stride_h;
  Elem* r0 = out + head_off + static_cast<int64_t>(row0) * p.o_stride_s;
  Elem* r1 = out + head_off + static_cast<int64_t>(row1) * p.o_stride_s;
  const bool in0 = row0 < p.q_len, in1 = row1 < p.q_len;
  // Every lane shuffles (the row guards only skip stores).
#pragma unroll
  for (int j = 0; j < kHeadDim / 32; ++j) {
    uint32_t a0[4], a1[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int i = 4 * j + k;  // 8-column group
      a0[k] = common::ElemTraits<Elem>::Pack(o[4 * i] * inv0, o[4 * i + 1] * inv0);
      a1[k] = common::ElemTraits<Elem>::Pack(o[4 * i + 2] * inv1, o[4 * i + 3] * inv1);
    }
    const uint4 w0 = QuadTranspose(a0, t);
    const uint4 w1 = QuadTranspose(a1, t);
    if constexpr (kVectorStores) {
      StoreGlobal16If(in0, r0 + 8 * (4 * j + t), w0);
      StoreGlobal16If(in1, r1 + 8 * (4 * j + t), w1);
    } else {
      if (in0) *reinterpret_cast<uint4*>(r0 + 8 * (4 * j + t)) = w0;
      if (in1) *reinterpret_cast<uint4*>(r1 + 8 * (4 * j + t)) = w1;
    }
  }
  if (p.lse != nullptr && t == 0) {
    constexpr float kLn2 = 0.693147180559945309f;
    const int64_t base = (static_cast<int64_t>(batch) * p.q_heads + head) * p.q_len;
    if (in0) p.lse[base + row0] = l0 > 0.f ? (sm.m[0] + log2f(l0)) * kLn2 : -CUDART_INF_F;
    if (in1) p.lse[base + row1] = l1 > 0.f ? (sm.m[1] + log2f(l1)) * kLn2 : -CUDART_INF_F;
  }
}

// --- The shared-memory epilogue (HopperTileFeatures::kSmemEpilogue) ----------------------------------------------------
// The register epilogue above costs over half a block step a tile at d128 (quad shuffles, their selects, eight
// 16-byte stores a thread, then the stores' drain charged to the next tile). Here each warpgroup writes its
// normalised O with stmatrix, which takes the accumulator layout as it is, into the V stage its last P V has just
// read, and one thread stores it with TMA; nobody waits for global memory.

// stmatrix x4: four 8x8 b16 matrices from the mma accumulator layout (register k: matrix k, row lane / 4,
// columns 2 (lane % 4), +1); lane l gives the shared-memory address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void StMatrixX4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
}
// TMA store of one box from shared memory, and the bulk-group bookkeeping of the issuing thread.
__device__ __forceinline__ void TmaStore4d(const CUtensorMap* map, uint32_t src, int c0, int c1, int c2, int c3) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
}
__device__ __forceinline__ void BulkCommit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// The bulk copies this thread issued have read their shared memory (it may be overwritten).
__device__ __forceinline__ void BulkWaitRead() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
// ... and have written global memory.
__device__ __forceinline__ void BulkWaitAll() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
// This thread's shared-memory writes are visible to the TMA unit (the async proxy).
__device__ __forceinline__ void FenceProxyAsyncShared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Writes this warpgroup's 64 normalised rows of O into `o_smem` (its 64 x head_dim part of a V stage, as 64-row
// boxes of 64 columns, 128-byte swizzled like every panel) and the LSE to global memory. The caller makes sure no
// wgmma still reads that stage, and stores the boxes with TMA after every thread's writes are fenced.
template <int kHeadDim, typename Elem, int kBlockN>
__device__ __forceinline__ void WriteOutputSmemSm90(const LaunchParams& p, const float (&o)[kHeadDim / 2],
                                                    const SoftmaxSm90<kBlockN>& sm, int row0, int head, int batch,
                                                    uint32_t o_smem) {
  constexpr int kBoxBytes = 64 * 128;
  const int lane = threadIdx.x & 31;
  const int t = lane & 3;
  const float l0 = QuadSum(sm.l[0]);
  const float l1 = QuadSum(sm.l[1]);
  const float inv0 = l0 > 0.f ? 1.f / l0 : 0.f;
  const float inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
  // Lane l addresses row l % 8 (+8 for matrices 1 and 3) of the warp's 16 rows, 8-column group 2 j + l / 16.
  const int row = ((threadIdx.x / 32) & 3) * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
  for (int j = 0; j < kHeadDim / 16; ++j) {
    const int g = 2 * j + (lane >> 4);  // this lane's 8-column group
    const uint32_t addr = o_smem + (g / 8) * kBoxBytes + common::Swizzle128(row, g % 8);
    const int i0 = 2 * j, i1 = 2 * j + 1;  // the two 8-column groups of this stmatrix
    StMatrixX4(addr, common::ElemTraits<Elem>::Pack(o[4 * i0] * inv0, o[4 * i0 + 1] * inv0),
               common::ElemTraits<Elem>::Pack(o[4 * i0 + 2] * inv1, o[4 * i0 + 3] * inv1),
               common::ElemTraits<Elem>::Pack(o[4 * i1] * inv0, o[4 * i1 + 1] * inv0),
               common::ElemTraits<Elem>::Pack(o[4 * i1 + 2] * inv1, o[4 * i1 + 3] * inv1));
  }
  if (p.lse != nullptr && t == 0) {
    constexpr float kLn2 = 0.693147180559945309f;
    const int64_t base = (static_cast<int64_t>(batch) * p.q_heads + head) * p.q_len;
    const int row1 = row0 + 8;
    if (row0 < p.q_len) p.lse[base + row0] = l0 > 0.f ? (sm.m[0] + log2f(l0)) * kLn2 : -CUDART_INF_F;
    if (row1 < p.q_len) p.lse[base + row1] = l1 > 0.f ? (sm.m[1] + log2f(l1)) * kLn2 : -CUDART_INF_F;
  }
}

}  // namespace attnd::kernels::hopper
