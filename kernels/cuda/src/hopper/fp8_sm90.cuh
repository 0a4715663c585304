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

// Bytes b of w[0..3] as out[b]'s bytes 0..3: a 4x4 byte transpose in eight PRMTs.
__device__ __forceinline__ void Transpose4x4Bytes(const uint32_t (&w)[4], uint32_t (&out)[4]) {
  const uint32_t lo01 = __byte_perm(w[0], w[1], 0x5140);  // w0.0 w1.0 w0.1 w1.1
  const uint32_t hi01 = __byte_perm(w[0], w[1], 0x7362);  // w0.2 w1.2 w0.3 w1.3
  const uint32_t lo23 = __byte_perm(w[2], w[3], 0x5140);
  const uint32_t hi23 = __byte_perm(w[2], w[3], 0x7362);
  out[0] = __byte_perm(lo01, lo23, 0x5410);
  out[1] = __byte_perm(lo01, lo23, 0x7632);
  out[2] = __byte_perm(hi01, hi23, 0x5410);
  out[3] = __byte_perm(hi01, hi23, 0x7632);
}

// One block: 128 keys of one (batch, kv head), all of head_dim, 256 threads. V's rows come in as 16-byte loads and
// go to shared memory; each thread then takes 16 positions (V^T's 16-byte chunk, in Fp8PKey order) of 4 head dims at
// a time: 16 four-byte reads (4 dims of one key each), four 4x4 byte transposes, four 16-byte stores, one per dim.
// A warp's stores are 4 whole 128-byte rows of V^T. Keys past kv_len are written as zeros (the kernel masks their P).
// Word w of key k sits at w ^ (4 (k / 16 % 8)): a warp's reads (one key of each of 8 sixteen-key groups, 4 words
// each) then fall on 32 banks, and a 16-byte chunk stays whole.
template <int kHeadDim>
__global__ void __launch_bounds__(256) VTransposeFp8Kernel(const VTransposeParams p) {
  constexpr int kKeys = 128, kThreads = 256;
  constexpr int kWords = kHeadDim / 4, kChunks = kHeadDim / 16, kLoads = kKeys * kChunks / kThreads;
  __shared__ alignas(16) uint32_t tile[kKeys * kWords];
  const auto slot = [](int key, int word) { return key * kWords + (word ^ (4 * ((key / 16) % 8))); };
  const int key0 = blockIdx.x * kKeys, head = blockIdx.y, batch = blockIdx.z;
  const uint8_t* v = static_cast<const uint8_t*>(p.v) + batch * p.v_stride_b + head * p.v_stride_h;
  uint4 x[kLoads];
#pragma unroll
  for (int i = 0; i < kLoads; ++i) {
    const int key = (threadIdx.x + kThreads * i) / kChunks, chunk = (threadIdx.x + kThreads * i) % kChunks;
    x[i] = make_uint4(0, 0, 0, 0);
    if (key0 + key < p.kv_len) {
      x[i] = *reinterpret_cast<const uint4*>(v + static_cast<int64_t>(key0 + key) * p.v_stride_s + 16 * chunk);
    }
  }
#pragma unroll
  for (int i = 0; i < kLoads; ++i) {
    const int key = (threadIdx.x + kThreads * i) / kChunks, chunk = (threadIdx.x + kThreads * i) % kChunks;
    *reinterpret_cast<uint4*>(&tile[slot(key, 4 * chunk)]) = x[i];
  }
  __syncthreads();
  const int pos = 16 * (threadIdx.x % 8);  // this thread's 16 positions of the block
  if (key0 + pos >= p.kv_len_padded) return;
  uint8_t* out = static_cast<uint8_t*>(p.v_t) +
                 ((static_cast<int64_t>(batch) * p.kv_heads + head) * kHeadDim) * p.kv_len_padded + key0 + pos;
#pragma unroll
  for (int word = threadIdx.x / 8; word < kWords; word += kThreads / 8) {
    uint32_t o[4][4];  // [dim 4 word + j][positions 4r..4r+3]
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      uint32_t w[4], t[4];
#pragma unroll
      for (int b = 0; b < 4; ++b) w[b] = tile[slot(pos + Fp8PKey(4 * r + b), word)];
      Transpose4x4Bytes(w, t);
#pragma unroll
      for (int j = 0; j < 4; ++j) o[j][r] = t[j];
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      *reinterpret_cast<uint4*>(out + static_cast<int64_t>(4 * word + j) * p.kv_len_padded) =
          make_uint4(o[j][0], o[j][1], o[j][2], o[j][3]);
    }
  }
}

inline cudaError_t LaunchVTransposeFp8(const VTransposeParams& p, cudaStream_t stream) {
  const dim3 grid((p.kv_len_padded + 127) / 128, p.kv_heads, p.batch);
  if (p.head_dim == 128) {
    VTransposeFp8Kernel<128><<<grid, 256, 0, stream>>>(p);
  } else if (p.head_dim == 256) {
    VTransposeFp8Kernel<256><<<grid, 256, 0, stream>>>(p);
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace attnd::kernels::hopper
