// Load role: K/V tiles of kBlockN keys gathered into shared memory with 16-byte cp.async, for contiguous and
// paged KV alike. A thread copies whole 16-byte chunks; consecutive threads take consecutive chunks of one
// key row, so each warp reads whole head rows (coalesced). For paged KV a key's row is found through the block
// table (page = table[key >> page_shift], row = key & (page_size - 1)); the table row is tiny and cached.
#pragma once

#include <cstdint>

#include "decode_params.h"
#include "mma_decode.cuh"

namespace attnd::kernels::decode {

// Element offset of key `key`'s row of kv head `kvh` in sequence `b`, K and V alike up to the strides.
struct KvRowOffsets {
  int64_t k = 0;
  int64_t v = 0;
};

__device__ __forceinline__ KvRowOffsets KvRow(const DecodeParams& p, int b, int kvh, int key) {
  int64_t slot, row;
  if (p.block_table != nullptr) {
    slot = __ldg(p.block_table + static_cast<int64_t>(b) * p.max_pages_per_seq + (key >> p.page_shift));
    row = key & ((1 << p.page_shift) - 1);
  } else {
    slot = b;
    row = key;
  }
  return KvRowOffsets{slot * p.k_sb + row * p.k_ss + kvh * p.k_sh, slot * p.v_sb + row * p.v_ss + kvh * p.v_sh};
}

template <typename Tile>
struct KvTileLoader {
  static constexpr int kChunksPerRow = Tile::kHeadDim / 8;
  static constexpr int kChunks = Tile::kBlockN * kChunksPerRow;
  static constexpr int kIters = kChunks / Tile::kThreads;
  static_assert(kChunks % Tile::kThreads == 0, "every thread copies the same number of chunks");
  static_assert(Tile::kThreads % kChunksPerRow == 0, "a thread keeps its chunk column across iterations");

  // Issues the copies of keys [key0, key0 + kBlockN) into one K and one V stage; keys at or past key_end are
  // zero-filled without touching global memory.
  __device__ __forceinline__ static void Load(const DecodeParams& p, int b, int kvh, int key0, int key_end,
                                              uint8_t* k_stage, uint8_t* v_stage) {
    const int tid = threadIdx.x;
    const int chunk = tid % kChunksPerRow;
    const uint16_t* k = static_cast<const uint16_t*>(p.k);
    const uint16_t* v = static_cast<const uint16_t*>(p.v);
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int row = tid / kChunksPerRow + it * (Tile::kThreads / kChunksPerRow);
      const int key = key0 + row;
      const bool valid = key < key_end;
      KvRowOffsets off;
      if (valid) off = KvRow(p, b, kvh, key);
      const uint32_t s = SwizzledOffset<Tile::kRowBytes>(row, chunk);
      CpAsync16(SmemAddr(k_stage + s), k + off.k + chunk * 8, valid);
      CpAsync16(SmemAddr(v_stage + s), v + off.v + chunk * 8, valid);
    }
  }
};

}  // namespace attnd::kernels::decode
