// Compute and copy primitives of the decode kernels: common/'s mma.sync.m16n8k16 (fp32 accumulators),
// ldmatrix and exp2, plus 16-byte cp.async with zero fill and the tile swizzle (sm_80 instructions, available on
// sm_90a and sm_120a), and the float8 -> fp16 conversion of float8 K/V tiles (sm_89 and later). Fragment layouts
// follow the PTX ISA's "mma.m16n8k16" figures: lane = 4 * g + t; an accumulator holds rows g and g + 8, columns
// 2t and 2t + 1 of its 16x8 tile.
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

// Float8 e4m3 -> fp16, two at a time (exact: every e4m3 value is an fp16 value). The low byte becomes the low half,
// so a word of four codes in memory order becomes two half2 in memory order.
__device__ __forceinline__ uint32_t Fp8x2ToHalf2(uint32_t two_codes) {
  uint32_t h;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(static_cast<uint16_t>(two_codes)));
  return h;
}

// bf16 pair -> fp16 pair, rounded to nearest (exact within fp16's range: fp16 has the longer mantissa).
__device__ __forceinline__ uint32_t Bf16x2ToHalf2(uint32_t x) {
  __nv_bfloat162 b;
  *reinterpret_cast<uint32_t*>(&b) = x;
  __half2 h = __float22half2_rn(__bfloat1622float2(b));
  return *reinterpret_cast<uint32_t*>(&h);
}

// Byte offset of 16-byte chunk `chunk` of row `row` in a float8 stage (rows of kKvRowBytes). The chunk is XOR-swizzled
// so that the 8 keys one 8-byte read of K fragments covers (same chunk, 8 consecutive rows) fall in 8 different bank
// groups: with the row's low 3 bits when a row has 8 chunks or more, with bits 1-2 at 4 chunks (two 64-byte rows share
// a 128-byte bank line).
template <int kKvRowBytes>
__device__ __forceinline__ uint32_t Fp8StageOffset(int row, int chunk) {
  constexpr int kChunks = kKvRowBytes / 16;
  static_assert(kChunks == 4 || kChunks % 8 == 0, "head_dim 64, 128 or 256");
  const int swizzle = kChunks >= 8 ? (row & 7) : ((row >> 1) & 3);
  return static_cast<uint32_t>(row * kKvRowBytes + ((chunk ^ swizzle) << 4));
}

// Where one thread's share of a float8 stage's V rows of key slice `wn` (the Tile::kKeysPerWarp rows that slice's
// kWarpsM warps read in P V) lies, computed once per block so that converting a tile costs loads, conversions and
// stores only. Thread u of the slice reads 8 codes (piece u % kPieces) of rows r0 + i * kRowStep, i < kItems, and
// writes them as one 16-byte chunk of fp16 at the 16-bit tile swizzle, for ldmatrix.trans; a warp reads 256
// consecutive bytes and writes 512 in the fewest shared-memory wavefronts. Both swizzles repeat every 8 rows, so
// kPeriod offsets serve every item: item i is item i % kPeriod moved down whole 8-row groups.
template <typename Tile>
struct Fp8VSliceMap {
  static constexpr int kPieces = Tile::kHeadDim / 8;
  static constexpr int kThreads = Tile::kWarpsM * 32;
  static constexpr int kRowStep = kThreads / kPieces;
  static constexpr int kItems = Tile::kKeysPerWarp * kPieces / kThreads;
  static constexpr int kPeriod = kRowStep >= 8 ? 1 : (kItems < 8 / kRowStep ? kItems : 8 / kRowStep);
  static_assert(kThreads % kPieces == 0 && (Tile::kKeysPerWarp * kPieces) % kThreads == 0,
                "every thread of the slice converts as many chunks, all of one piece");

  uint32_t src[kPeriod];  // byte offset of item k's codes in a stage
  uint32_t dst[kPeriod];  // byte offset of item k's chunk in the converted tile

  __device__ __forceinline__ Fp8VSliceMap(int wm, int wn, int lane) {
    const int u = wm * 32 + lane, piece = u % kPieces;
    const int r0 = wn * Tile::kKeysPerWarp + u / kPieces;
#pragma unroll
    for (int k = 0; k < kPeriod; ++k) {
      const int row = r0 + k * kRowStep;
      src[k] = Fp8StageOffset<Tile::kKvRowBytes>(row, piece >> 1) + (piece & 1) * 8;
      dst[k] = SwizzledOffset<Tile::kRowBytes>(row, piece);
    }
  }
  // Rows item i lies below item i % kPeriod: a whole number of 8-row groups.
  __host__ __device__ static constexpr int RowsBelow(int i) { return i / kPeriod * kPeriod * kRowStep; }
};

// What a 16-bit tile keeps in Fp8VSliceMap's place: nothing.
struct NoVSliceMap {
  __device__ __forceinline__ NoVSliceMap(int, int, int) {}
};

// A float8 stage's V rows of one key slice into fp16 rows (Fp8VSliceMap), by that slice's warps alone, so only
// they wait for it (SliceBarrier), not the block.
template <typename Tile>
__device__ __forceinline__ void ConvertFp8VSlice(const uint8_t* v_stage, uint8_t* v_tile,
                                                 const Fp8VSliceMap<Tile>& map) {
  using Map = Fp8VSliceMap<Tile>;
#pragma unroll
  for (int i = 0; i < Map::kItems; ++i) {
    const int k = i % Map::kPeriod;
    const uint2 v8 =
        *reinterpret_cast<const uint2*>(v_stage + map.src[k] + Map::RowsBelow(i) * Tile::kKvRowBytes);
    *reinterpret_cast<uint4*>(v_tile + map.dst[k] + Map::RowsBelow(i) * Tile::kRowBytes) =
        make_uint4(Fp8x2ToHalf2(v8.x), Fp8x2ToHalf2(v8.x >> 16), Fp8x2ToHalf2(v8.y), Fp8x2ToHalf2(v8.y >> 16));
  }
}

// The warps of key slice `wn` wait for each other's shared-memory writes: one warp syncs itself; several meet at
// named barrier 1 + wn (barrier 0 is __syncthreads').
template <typename Tile>
__device__ __forceinline__ void SliceBarrier(int wn) {
  if constexpr (Tile::kWarpsM == 1) {
    __syncwarp();
  } else {
    asm volatile("bar.sync %0, %1;" ::"r"(1 + wn), "n"(Tile::kWarpsM * 32) : "memory");
  }
}

}  // namespace attnd::kernels::decode
