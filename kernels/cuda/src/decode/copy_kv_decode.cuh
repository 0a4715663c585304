// Copy roles: the K/V append, which copies new rows into the cache at key positions kv_len_b + t (through the
// block table for paged KV), and its mirror, the gather, which copies keys [0, kv_len_b) of each sequence out of
// the paged pools into contiguous rows, for kernels that read K/V through TMA boxes over one contiguous tensor (the
// prefill kernels of attention.h). Grid: x strides over the 16-byte chunks of one sequence's rows (for the gather,
// as many as it has, not the output's capacity), y is the sequence; consecutive threads copy consecutive chunks of
// a (row, kv head), so reads and writes are coalesced. Index arithmetic is 32-bit within a sequence (the plan
// bounds a sequence's chunks) and the chunk column a shift.
#pragma once

#include <cstdint>

#include "decode_params.h"

namespace attnd::kernels::decode {

constexpr int kCopyThreads = 256;

// Chunk i of a sequence's rows, of row_chunks (kv_heads << chunk_shift) 16-byte chunks each.
struct Chunk {
  uint32_t row;
  int head;
  int64_t col;  // in elements
};

__device__ __forceinline__ Chunk ChunkAt(uint32_t i, uint32_t row_chunks, int chunk_shift) {
  const uint32_t row = i / row_chunks;
  const uint32_t rem = i - row * row_chunks;
  return Chunk{row, static_cast<int>(rem >> chunk_shift), static_cast<int64_t>(rem & ((1u << chunk_shift) - 1)) * 8};
}

__device__ __forceinline__ void CopyChunk(void* to, const void* from) {
  *reinterpret_cast<uint4*>(to) = *reinterpret_cast<const uint4*>(from);
}

__global__ void __launch_bounds__(kCopyThreads) AppendKvKernel(const AppendParams p) {
  const int b = blockIdx.y;
  const uint32_t row_chunks = static_cast<uint32_t>(p.kv_heads) << p.chunk_shift;
  const uint32_t total = static_cast<uint32_t>(p.new_len) * row_chunks;
  const int base = p.kv_lens[b];
  const int32_t* table = p.block_table != nullptr ? p.block_table + static_cast<int64_t>(b) * p.max_pages_per_seq
                                                  : nullptr;
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
    const Chunk c = ChunkAt(i, row_chunks, p.chunk_shift);
    const int key = base + static_cast<int>(c.row);
    int64_t slot, row;
    if (table != nullptr) {
      slot = table[key >> p.page_shift];
      row = key & ((1 << p.page_shift) - 1);
    } else {
      slot = b;
      row = key;
    }
    const uint32_t t = c.row;
    const int h = c.head;
    const uint16_t* nk = static_cast<const uint16_t*>(p.new_k) + b * p.nk_sb + t * p.nk_ss + h * p.nk_sh + c.col;
    const uint16_t* nv = static_cast<const uint16_t*>(p.new_v) + b * p.nv_sb + t * p.nv_ss + h * p.nv_sh + c.col;
    uint16_t* k = static_cast<uint16_t*>(p.k) + slot * p.k_sb + row * p.k_ss + h * p.k_sh + c.col;
    uint16_t* v = static_cast<uint16_t*>(p.v) + slot * p.v_sb + row * p.v_ss + h * p.v_sh + c.col;
    CopyChunk(k, nk);
    CopyChunk(v, nv);
  }
}

__global__ void __launch_bounds__(kCopyThreads) GatherKvKernel(const GatherParams p) {
  const int b = blockIdx.y;
  const uint32_t row_chunks = static_cast<uint32_t>(p.kv_heads) << p.chunk_shift;
  const uint32_t total = static_cast<uint32_t>(min(p.kv_lens[b], p.capacity)) * row_chunks;
  const int32_t* table = p.block_table + static_cast<int64_t>(b) * p.max_pages_per_seq;
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
    const Chunk c = ChunkAt(i, row_chunks, p.chunk_shift);
    const int64_t page = table[c.row >> p.page_shift];
    const int64_t row = c.row & ((1u << p.page_shift) - 1);
    const int64_t key = c.row, h = c.head;
    CopyChunk(static_cast<uint16_t*>(p.out_k) + b * p.ok_sb + key * p.ok_ss + h * p.ok_sh + c.col,
              static_cast<const uint16_t*>(p.k) + page * p.k_sb + row * p.k_ss + h * p.k_sh + c.col);
    CopyChunk(static_cast<uint16_t*>(p.out_v) + b * p.ov_sb + key * p.ov_ss + h * p.ov_sh + c.col,
              static_cast<const uint16_t*>(p.v) + page * p.v_sb + row * p.v_ss + h * p.v_sh + c.col);
  }
}

}  // namespace attnd::kernels::decode
