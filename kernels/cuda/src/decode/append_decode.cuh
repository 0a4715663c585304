// Append role: copies new K/V rows into the cache at key positions kv_len_b + t (through the block table for
// paged KV). One thread per 16-byte chunk of a (sequence, new row, kv head) row, for K and V; consecutive
// threads copy consecutive chunks of a row, so reads and writes are coalesced.
#pragma once

#include <cstdint>

#include "decode_params.h"

namespace attnd::kernels::decode {

constexpr int kAppendThreads = 256;

__global__ void __launch_bounds__(kAppendThreads) AppendKvKernel(const AppendParams p) {
  const int cpr = p.head_dim / 8;
  const int64_t total = static_cast<int64_t>(p.batch) * p.new_len * p.kv_heads * cpr;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int chunk = static_cast<int>(idx % cpr);
    int64_t rest = idx / cpr;
    const int h = static_cast<int>(rest % p.kv_heads);
    rest /= p.kv_heads;
    const int t = static_cast<int>(rest % p.new_len);
    const int b = static_cast<int>(rest / p.new_len);
    const int key = p.kv_lens[b] + t;
    int64_t slot, row;
    if (p.block_table != nullptr) {
      slot = p.block_table[static_cast<int64_t>(b) * p.max_pages_per_seq + (key >> p.page_shift)];
      row = key & ((1 << p.page_shift) - 1);
    } else {
      slot = b;
      row = key;
    }
    const int64_t col = static_cast<int64_t>(chunk) * 8;
    const uint16_t* nk = static_cast<const uint16_t*>(p.new_k) + b * p.nk_sb + t * p.nk_ss + h * p.nk_sh + col;
    const uint16_t* nv = static_cast<const uint16_t*>(p.new_v) + b * p.nv_sb + t * p.nv_ss + h * p.nv_sh + col;
    uint16_t* k = static_cast<uint16_t*>(p.k) + slot * p.k_sb + row * p.k_ss + h * p.k_sh + col;
    uint16_t* v = static_cast<uint16_t*>(p.v) + slot * p.v_sb + row * p.v_ss + h * p.v_sh + col;
    *reinterpret_cast<uint4*>(k) = *reinterpret_cast<const uint4*>(nk);
    *reinterpret_cast<uint4*>(v) = *reinterpret_cast<const uint4*>(nv);
  }
}

}  // namespace attnd::kernels::decode
