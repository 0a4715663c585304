// Append role: copies new K/V rows into the cache at key positions kv_len_b + t (through the block table for
// paged KV). Grid: x strides over the 16-byte chunks of one sequence's new rows, y is the sequence; consecutive
// threads copy consecutive chunks of a (row, kv head), so reads and writes are coalesced. Index arithmetic is
// 32-bit within a sequence (the plan bounds a sequence's chunks) and the chunk column a shift.
#pragma once

#include <cstdint>

#include "decode_params.h"

namespace attnd::kernels::decode {

constexpr int kAppendThreads = 256;

__global__ void __launch_bounds__(kAppendThreads) AppendKvKernel(const AppendParams p) {
  const int b = blockIdx.y;
  const uint32_t row_chunks = static_cast<uint32_t>(p.kv_heads) << p.chunk_shift;
  const uint32_t total = static_cast<uint32_t>(p.new_len) * row_chunks;
  const int base = p.kv_lens[b];
  const int32_t* table = p.block_table != nullptr ? p.block_table + static_cast<int64_t>(b) * p.max_pages_per_seq
                                                  : nullptr;
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
    const uint32_t t = i / row_chunks;
    const uint32_t rem = i - t * row_chunks;
    const int h = static_cast<int>(rem >> p.chunk_shift);
    const int64_t col = static_cast<int64_t>(rem & ((1u << p.chunk_shift) - 1)) * 8;
    const int key = base + static_cast<int>(t);
    int64_t slot, row;
    if (table != nullptr) {
      slot = table[key >> p.page_shift];
      row = key & ((1 << p.page_shift) - 1);
    } else {
      slot = b;
      row = key;
    }
    const uint16_t* nk = static_cast<const uint16_t*>(p.new_k) + b * p.nk_sb + t * p.nk_ss + h * p.nk_sh + col;
    const uint16_t* nv = static_cast<const uint16_t*>(p.new_v) + b * p.nv_sb + t * p.nv_ss + h * p.nv_sh + col;
    uint16_t* k = static_cast<uint16_t*>(p.k) + slot * p.k_sb + row * p.k_ss + h * p.k_sh + col;
    uint16_t* v = static_cast<uint16_t*>(p.v) + slot * p.v_sb + row * p.v_ss + h * p.v_sh + col;
    *reinterpret_cast<uint4*>(k) = *reinterpret_cast<const uint4*>(nk);
    *reinterpret_cast<uint4*>(v) = *reinterpret_cast<const uint4*>(nv);
  }
}

}  // namespace attnd::kernels::decode
