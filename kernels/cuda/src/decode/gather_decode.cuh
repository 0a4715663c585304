// Gather role: copies keys [0, kv_len_b) of each sequence out of the paged K/V pools into contiguous rows, for
// kernels that read K/V through TMA boxes over one contiguous tensor (the prefill kernels of attention.h). The
// mirror of append: one thread per 16-byte chunk of a (sequence, key, kv head) row, for K and V; consecutive
// threads copy consecutive chunks of a row, so reads and writes are coalesced.
#pragma once

#include <cstdint>

#include "decode_params.h"

namespace attnd::kernels::decode {

constexpr int kGatherThreads = 256;

__global__ void __launch_bounds__(kGatherThreads) GatherKvKernel(const GatherParams p) {
  const int cpr = p.head_dim / 8;
  const int64_t total = static_cast<int64_t>(p.batch) * p.capacity * p.kv_heads * cpr;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int chunk = static_cast<int>(idx % cpr);
    int64_t rest = idx / cpr;
    const int h = static_cast<int>(rest % p.kv_heads);
    rest /= p.kv_heads;
    const int key = static_cast<int>(rest % p.capacity);
    const int b = static_cast<int>(rest / p.capacity);
    if (key >= p.kv_lens[b]) continue;  // rows past the sequence's length are left as they are
    const int64_t page = p.block_table[static_cast<int64_t>(b) * p.max_pages_per_seq + (key >> p.page_shift)];
    const int64_t row = key & ((1 << p.page_shift) - 1);
    const int64_t col = static_cast<int64_t>(chunk) * 8;
    const uint16_t* k = static_cast<const uint16_t*>(p.k) + page * p.k_sb + row * p.k_ss + h * p.k_sh + col;
    const uint16_t* v = static_cast<const uint16_t*>(p.v) + page * p.v_sb + row * p.v_ss + h * p.v_sh + col;
    uint16_t* ok = static_cast<uint16_t*>(p.out_k) + b * p.ok_sb + key * p.ok_ss + h * p.ok_sh + col;
    uint16_t* ov = static_cast<uint16_t*>(p.out_v) + b * p.ov_sb + key * p.ov_ss + h * p.ov_sh + col;
    *reinterpret_cast<uint4*>(ok) = *reinterpret_cast<const uint4*>(k);
    *reinterpret_cast<uint4*>(ov) = *reinterpret_cast<const uint4*>(v);
  }
}

}  // namespace attnd::kernels::decode
