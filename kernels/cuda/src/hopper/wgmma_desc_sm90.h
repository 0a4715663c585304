// wgmma plumbing: shared-memory matrix descriptors, the fences and group waits, and the operand fence that
// keeps the compiler from touching registers an in-flight wgmma still reads or writes.
//
// Descriptor (64 bits): [0,14) start address >> 4, [16,30) leading byte offset >> 4, [32,46) stride byte
// offset >> 4, [49,52) base offset (0: every tile starts on a 1024-byte swizzle atom), [62,64) layout
// (1 = 128-byte swizzle). For our 128-byte-swizzled 64-element panels (TMA's layout):
//   K-major (Q and K in S = Q K^T): 8-row groups of 1024 bytes -> stride offset 1024; the leading offset is
//     unused with swizzling. A k16 step inside the 128-byte row moves the start address by 32 bytes.
//   MN-major (V in O += P V, head_dim contiguous): 8 keys x 64 head_dim values per 1024-byte atom; the next
//     8 keys are 1024 bytes on (stride offset), the next 64 head_dim values one panel on (leading offset).
#pragma once

#include <cstdint>

namespace attnd::kernels::hopper {

// The descriptor's low word for a tile at `smem_addr` (a shared-window address, below 2^18, so its >> 4 fits
// the 14-bit field): k-step and panel offsets are then one 32-bit add (DescAt) instead of the whole encoding
// per wgmma, which kept the operands' descriptors in vector registers and moved them to uniform ones (R2UR)
// before every HGMMA.
__device__ __forceinline__ uint32_t SmemDescLo(uint32_t smem_addr, uint32_t leading_bytes) {
  return (smem_addr >> 4) | ((leading_bytes >> 4) & 0x3FFF) << 16;
}
// The high word: stride byte offset and 128-byte swizzle (base offset 0), a constant.
__host__ __device__ constexpr uint32_t SmemDescHi(uint32_t stride_bytes) {
  return ((stride_bytes >> 4) & 0x3FFF) | (uint32_t{1} << 30);
}
// The descriptor of the operand `byte_offset` bytes past the tile whose low word is `lo` (offsets are multiples
// of 16 and stay inside shared memory, so the address field does not carry into the leading offset).
template <uint32_t kHi>
__device__ __forceinline__ uint64_t DescAt(uint32_t lo, uint32_t byte_offset) {
  return (static_cast<uint64_t>(kHi) << 32) | (lo + (byte_offset >> 4));
}

// Orders this thread's earlier register writes (accumulators, A fragments) before the next wgmma reads them.
__device__ __forceinline__ void WgmmaFence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void WgmmaCommit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// The compiler sees a wgmma's registers as read and written at issue; these empty asm statements, placed
// after the wait, tell it the values are only final (and the sources only free) from here on.
template <int N>
__device__ __forceinline__ void FenceOperand(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void FenceOperand(uint32_t (&r)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(r[i][e])::"memory");
  }
}

template <int kRegs>
__device__ __forceinline__ void SetMaxRegsInc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void SetMaxRegsDec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}

}  // namespace attnd::kernels::hopper
