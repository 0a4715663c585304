// Float8 (e4m3) pieces of the Hopper family: P's packing into the k32 A fragment, the key order of V^T that goes with
// it, and the transpose that writes V^T before every float8 launch (docs/kernels.md, "Float8 forward").
//
// wgmma takes float8 operands K-major only, so P V needs V with its keys contiguous: V^T, [batch, kv_heads,
// head_dim, keys]. The k32 A fragment of P holds, per thread, keys 4t..4t+3 and 16+4t..16+4t+3 of each 32 in one
// row, where S's accumulators give it keys 8i+2t and 8i+2t+1. Rather than shuffle P across the quad every block, the
// transpose stores V^T's keys in the accumulators' order: position c of every 32 keys holds key Fp8PKey(c), and the
// thread packs its own values as they lie. The sum over keys is the same in any order.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "attnd/kernels/attention.h"

namespace attnd::kernels::hopper {

// The key (0..31, within its group of 32) that position c of V^T's group holds. Position c = 16h + 4t + i is element
// i of thread t's register h (row g); that thread holds keys 8j + 2t, +1 of S's 8-key groups j = 2h, 2h+1.
__host__ __device__ constexpr int Fp8PKey(int c) {
  return 16 * (c / 16) + 8 * ((c % 4) / 2) + 2 * ((c % 16) / 4) + (c % 2);
}

// Four floats as e4m3 (round to nearest, saturating), a in the lowest byte.
__device__ __forceinline__ uint32_t PackFp8x4(float a, float b, float c, float d) {
  uint16_t lo, hi;
  // cvt's first source goes to the upper byte.
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(b), "f"(a));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(d), "f"(c));
  return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}

// One block: 32 keys of one (batch, kv head), all of head_dim. Reads V's rows (16 bytes a thread), writes V^T's
// head_dim rows of 32 keys in Fp8PKey order; keys past kv_len are written as zeros (the kernel masks their P).
template <int kHeadDim>
__global__ void __launch_bounds__(128) VTransposeFp8Kernel(const VTransposeParams p) {
  constexpr int kStride = kHeadDim + 16;  // bytes per staged key row: 16-byte stores, rows on different banks
  __shared__ alignas(16) uint8_t tile[32 * kStride];
  const int key0 = blockIdx.x * 32, head = blockIdx.y, batch = blockIdx.z;
  const uint8_t* v = static_cast<const uint8_t*>(p.v) + batch * p.v_stride_b + head * p.v_stride_h;
  for (int i = threadIdx.x; i < 32 * kHeadDim / 16; i += blockDim.x) {
    const int key = i / (kHeadDim / 16), chunk = i % (kHeadDim / 16);
    uint4 x = make_uint4(0, 0, 0, 0);
    if (key0 + key < p.kv_len) {
      x = *reinterpret_cast<const uint4*>(v + static_cast<int64_t>(key0 + key) * p.v_stride_s + 16 * chunk);
    }
    *reinterpret_cast<uint4*>(tile + key * kStride + 16 * chunk) = x;
  }
  __syncthreads();
  uint8_t* out = static_cast<uint8_t*>(p.v_t) +
                 ((static_cast<int64_t>(batch) * p.kv_heads + head) * kHeadDim) * p.kv_len_padded + key0;
  for (int i = threadIdx.x; i < kHeadDim * 2; i += blockDim.x) {
    const int d = i / 2, half = i % 2;
    uint32_t w[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      uint32_t x = 0;
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const int c = 16 * half + 4 * r + b;
        x |= static_cast<uint32_t>(tile[Fp8PKey(c) * kStride + d]) << (8 * b);
      }
      w[r] = x;
    }
    *reinterpret_cast<uint4*>(out + static_cast<int64_t>(d) * p.kv_len_padded + 16 * half) =
        make_uint4(w[0], w[1], w[2], w[3]);
  }
}

inline cudaError_t LaunchVTransposeFp8(const VTransposeParams& p, cudaStream_t stream) {
  const dim3 grid(p.kv_len_padded / 32, p.kv_heads, p.batch);
  if (p.head_dim == 128) {
    VTransposeFp8Kernel<128><<<grid, 128, 0, stream>>>(p);
  } else if (p.head_dim == 256) {
    VTransposeFp8Kernel<256><<<grid, 128, 0, stream>>>(p);
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace attnd::kernels::hopper
