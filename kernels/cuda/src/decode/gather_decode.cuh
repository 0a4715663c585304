// Gather role: copies keys [0, kv_len_b) of each sequence out of the paged K/V pools into contiguous rows, for
// kernels that read K/V through TMA boxes over one contiguous tensor (the prefill kernels of attention.h). The
// mirror of append: grid x strides over the 16-byte chunks of one sequence's keys (as many as it has, not the
// output's capacity), y is the sequence; consecutive threads copy consecutive chunks of a (key, kv head) row.
#pragma once

#include <cstdint>

#include "decode_params.h"

namespace attnd::kernels::decode {

constexpr int kGatherThreads = 256;

__global__ void __launch_bounds__(kGatherThreads) GatherKvKernel(const GatherParams p) {
  const int b = blockIdx.y;
  const uint32_t row_chunks = static_cast<uint32_t>(p.kv_heads) << p.chunk_shift;
  const uint32_t total = static_cast<uint32_t>(min(p.kv_lens[b], p.capacity)) * row_chunks;
  const int32_t* table = p.block_table + static_cast<int64_t>(b) * p.max_pages_per_seq;
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
    const uint32_t key = i / row_chunks;
    const uint32_t rem = i - key * row_chunks;
    const int h = static_cast<int>(rem >> p.chunk_shift);
    const int64_t col = static_cast<int64_t>(rem & ((1u << p.chunk_shift) - 1)) * 8;
    const int64_t page = table[key >> p.page_shift];
    const int64_t row = key & ((1u << p.page_shift) - 1);
    const uint16_t* k = static_cast<const uint16_t*>(p.k) + page * p.k_sb + row * p.k_ss + h * p.k_sh + col;
    const uint16_t* v = static_cast<const uint16_t*>(p.v) + page * p.v_sb + row * p.v_ss + h * p.v_sh + col;
    uint16_t* ok = static_cast<uint16_t*>(p.out_k) + b * p.ok_sb + key * p.ok_ss + h * p.ok_sh + col;
    uint16_t* ov = static_cast<uint16_t*>(p.out_v) + b * p.ov_sb + key * p.ov_ss + h * p.ov_sh + col;
    *reinterpret_cast<uint4*>(ok) = *reinterpret_cast<const uint4*>(k);
    *reinterpret_cast<uint4*>(ov) = *reinterpret_cast<const uint4*>(v);
  }
}

}  // namespace attnd::kernels::decode
