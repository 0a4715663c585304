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

__device__ __forceinline__ uint64_t MakeSmemDesc(uint32_t smem_addr, uint32_t leading_bytes, uint32_t stride_bytes) {
  uint64_t desc = 0;
  desc |= static_cast<uint64_t>((smem_addr >> 4) & 0x3FFF);
  desc |= static_cast<uint64_t>((leading_bytes >> 4) & 0x3FFF) << 16;
  desc |= static_cast<uint64_t>((stride_bytes >> 4) & 0x3FFF) << 32;
  desc |= static_cast<uint64_t>(1) << 62;  // 128-byte swizzle
  return desc;
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
