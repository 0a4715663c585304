// Compute and copy primitives of the decode kernels: common/'s mma.sync.m16n8k16 (fp32 accumulators),
// ldmatrix and exp2, plus 16-byte cp.async with zero fill and the tile swizzle (sm_80 instructions, available on
// sm_90a and sm_120a). Fragment layouts follow the PTX ISA's "mma.m16n8k16" figures: lane = 4 * g + t; an
// accumulator holds rows g and g + 8, columns 2t and 2t + 1 of its 16x8 tile.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "../common/mma_sm80.cuh"

namespace attnd::kernels::decode {

// The mma.sync / ldmatrix / exp2 primitives are common/'s (one implementation for every family).
template <typename Elem>
using ElemOps = common::ElemTraits<Elem>;
using common::Exp2;
using common::LdMatrixX4;
using common::LdMatrixX4Trans;

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, bypassing L1 (K/V are read once). valid == false fills zeros and reads nothing,
// so rows past kv_len (whose pages may not exist) contribute exact zeros to P.V rather than stale data.
__device__ __forceinline__ void CpAsync16(uint32_t smem_addr, const void* gmem, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr), "l"(gmem), "r"(src_bytes)
               : "memory");
}

__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

// Byte offset of 16-byte chunk `chunk` of row `row` in a tile of kRowBytes-wide rows. The chunk index is
// XOR-swizzled with the row's low 3 bits, so the 8 rows one ldmatrix phase reads (same chunk, consecutive
// rows) fall in 8 different bank groups, and so do the 8 chunks a cp.async phase writes.
template <int kRowBytes>
__device__ __forceinline__ uint32_t SwizzledOffset(int row, int chunk) {
  return static_cast<uint32_t>(row * kRowBytes + ((chunk ^ (row & 7)) << 4));
}

}  // namespace attnd::kernels::decode
