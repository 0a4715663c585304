// Copy roles: the K/V append, which copies new rows into the cache at key positions kv_len_b + t (through the
// block table for paged KV), and its mirror, the gather, which copies keys [0, kv_len_b) of each sequence out of
// the paged pools into contiguous rows, for kernels that read K/V through TMA boxes over one contiguous tensor (the
// prefill kernels of attention.h). Grid: x strides over the 16-byte chunks of one sequence's rows (for the gather,
// as many as it has, not the output's capacity), y is the sequence; consecutive threads copy consecutive chunks of
// a (row, kv head), so reads and writes are coalesced. Index arithmetic is 32-bit within a sequence (the plan
// bounds a sequence's chunks) and the chunk column a shift.
// Into a float8 cache the append quantizes: a chunk is 16 codes from 16 new elements (two 16-byte loads); out of
// one the gather dequantizes (16 codes into 16 elements).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "decode_params.h"

namespace attnd::kernels::decode {

constexpr int kCopyThreads = 256;

// Chunk i of a sequence's rows, of row_chunks (kv_heads << chunk_shift) 16-byte chunks each.
struct Chunk {
  uint32_t row;
  int head;
  int64_t col;  // in elements
};

template <int kChunkElems = 8>
__device__ __forceinline__ Chunk ChunkAt(uint32_t i, uint32_t row_chunks, int chunk_shift) {
  const uint32_t row = i / row_chunks;
  const uint32_t rem = i - row * row_chunks;
  return Chunk{row, static_cast<int>(rem >> chunk_shift),
               static_cast<int64_t>(rem & ((1u << chunk_shift) - 1)) * kChunkElems};
}

__device__ __forceinline__ void CopyChunk(void* to, const void* from) {
  *reinterpret_cast<uint4*>(to) = *reinterpret_cast<const uint4*>(from);
}

// 16 new elements (bf16 or fp16) at `from` -> 16 e4m3 codes at `to`, each divided by `descale` first.
template <typename Src>
__device__ __forceinline__ void QuantizeChunk(uint8_t* to, const Src* from, float descale) {
  const uint4 lo = *reinterpret_cast<const uint4*>(from), hi = *reinterpret_cast<const uint4*>(from + 8);
  const uint32_t words[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
  uint32_t codes[4];
#pragma unroll
  for (int w = 0; w < 8; w += 2) {
    float2 a, b;
    if constexpr (std::is_same_v<Src, __nv_bfloat16>) {
      a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&words[w]));
      b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&words[w + 1]));
    } else {
      a = __half22float2(*reinterpret_cast<const __half2*>(&words[w]));
      b = __half22float2(*reinterpret_cast<const __half2*>(&words[w + 1]));
    }
    const uint32_t c0 = __nv_cvt_float2_to_fp8x2(make_float2(__fdiv_rn(a.x, descale), __fdiv_rn(a.y, descale)),
                                                 __NV_SATFINITE, __NV_E4M3);
    const uint32_t c1 = __nv_cvt_float2_to_fp8x2(make_float2(__fdiv_rn(b.x, descale), __fdiv_rn(b.y, descale)),
                                                 __NV_SATFINITE, __NV_E4M3);
    codes[w / 2] = c0 | (c1 << 16);
  }
  *reinterpret_cast<uint4*>(to) = make_uint4(codes[0], codes[1], codes[2], codes[3]);
}

// 16 e4m3 codes at `from` -> 16 elements (bf16 or fp16) at `to`, each code's value times `descale`.
template <typename Out>
__device__ __forceinline__ void DequantizeChunk(Out* to, const uint8_t* from, float descale) {
  const uint4 codes = *reinterpret_cast<const uint4*>(from);
  const uint32_t words[4] = {codes.x, codes.y, codes.z, codes.w};
  uint32_t out[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const __nv_fp8x2_storage_t two = static_cast<__nv_fp8x2_storage_t>(words[i / 2] >> (16 * (i % 2)));
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(two, __NV_E4M3);
    float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
    f.x *= descale;
    f.y *= descale;
    if constexpr (std::is_same_v<Out, __nv_bfloat16>) {
      const __nv_bfloat162 b = __floats2bfloat162_rn(f.x, f.y);
      out[i] = *reinterpret_cast<const uint32_t*>(&b);
    } else {
      const __half2 b = __floats2half2_rn(f.x, f.y);
      out[i] = *reinterpret_cast<const uint32_t*>(&b);
    }
  }
  *reinterpret_cast<uint4*>(to) = make_uint4(out[0], out[1], out[2], out[3]);
  *reinterpret_cast<uint4*>(to + 8) = make_uint4(out[4], out[5], out[6], out[7]);
}

// The append's walk over the new rows' chunks of sequence b = blockIdx.y: fn(b, page slot (b when contiguous), row
// in it, new row t, kv head h, column) for each chunk of kChunkElems elements.
template <int kChunkElems, typename Fn>
__device__ __forceinline__ void ForEachAppendChunk(const AppendParams& p, Fn fn) {
  const int b = blockIdx.y;
  const uint32_t row_chunks = static_cast<uint32_t>(p.kv_heads) << p.chunk_shift;
  const uint32_t total = static_cast<uint32_t>(p.new_len) * row_chunks;
  const int base = p.kv_lens[b];
  const int32_t* table = p.block_table != nullptr ? p.block_table + static_cast<int64_t>(b) * p.max_pages_per_seq
                                                  : nullptr;
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
    const Chunk c = ChunkAt<kChunkElems>(i, row_chunks, p.chunk_shift);
    const int key = base + static_cast<int>(c.row);
    int64_t slot, row;
    if (table != nullptr) {
      slot = table[key >> p.page_shift];
      row = key & ((1 << p.page_shift) - 1);
    } else {
      slot = b;
      row = key;
    }
    fn(b, slot, row, c.row, c.head, c.col);
  }
}

__global__ void __launch_bounds__(kCopyThreads) AppendKvKernel(const AppendParams p) {
  ForEachAppendChunk<8>(p, [&](int b, int64_t slot, int64_t row, uint32_t t, int h, int64_t col) {
    const uint16_t* nk = static_cast<const uint16_t*>(p.new_k) + b * p.nk_sb + t * p.nk_ss + h * p.nk_sh + col;
    const uint16_t* nv = static_cast<const uint16_t*>(p.new_v) + b * p.nv_sb + t * p.nv_ss + h * p.nv_sh + col;
    uint16_t* k = static_cast<uint16_t*>(p.k) + slot * p.k_sb + row * p.k_ss + h * p.k_sh + col;
    uint16_t* v = static_cast<uint16_t*>(p.v) + slot * p.v_sb + row * p.v_ss + h * p.v_sh + col;
    CopyChunk(k, nk);
    CopyChunk(v, nv);
  });
}

template <typename Src>
__global__ void __launch_bounds__(kCopyThreads) AppendKvFp8Kernel(const AppendParams p) {
  ForEachAppendChunk<16>(p, [&](int b, int64_t slot, int64_t row, uint32_t t, int h, int64_t col) {
    const Src* nk = static_cast<const Src*>(p.new_k) + b * p.nk_sb + t * p.nk_ss + h * p.nk_sh + col;
    const Src* nv = static_cast<const Src*>(p.new_v) + b * p.nv_sb + t * p.nv_ss + h * p.nv_sh + col;
    QuantizeChunk(static_cast<uint8_t*>(p.k) + slot * p.k_sb + row * p.k_ss + h * p.k_sh + col, nk, p.k_descale[h]);
    QuantizeChunk(static_cast<uint8_t*>(p.v) + slot * p.v_sb + row * p.v_ss + h * p.v_sh + col, nv, p.v_descale[h]);
  });
}

// The gather's walk over keys [0, kv_len) of sequence b = blockIdx.y: fn(b, page, row in it, key, kv head h,
// column) for each chunk of kChunkElems elements.
template <int kChunkElems, typename Fn>
__device__ __forceinline__ void ForEachGatherChunk(const GatherParams& p, Fn fn) {
  const int b = blockIdx.y;
  const uint32_t row_chunks = static_cast<uint32_t>(p.kv_heads) << p.chunk_shift;
  const uint32_t total = static_cast<uint32_t>(min(p.kv_lens[b], p.capacity)) * row_chunks;
  const int32_t* table = p.block_table + static_cast<int64_t>(b) * p.max_pages_per_seq;
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
    const Chunk c = ChunkAt<kChunkElems>(i, row_chunks, p.chunk_shift);
    const int64_t page = table[c.row >> p.page_shift];
    const int64_t row = c.row & ((1u << p.page_shift) - 1);
    fn(b, page, row, static_cast<int64_t>(c.row), static_cast<int64_t>(c.head), c.col);
  }
}

__global__ void __launch_bounds__(kCopyThreads) GatherKvKernel(const GatherParams p) {
  ForEachGatherChunk<8>(p, [&](int b, int64_t page, int64_t row, int64_t key, int64_t h, int64_t col) {
    CopyChunk(static_cast<uint16_t*>(p.out_k) + b * p.ok_sb + key * p.ok_ss + h * p.ok_sh + col,
              static_cast<const uint16_t*>(p.k) + page * p.k_sb + row * p.k_ss + h * p.k_sh + col);
    CopyChunk(static_cast<uint16_t*>(p.out_v) + b * p.ov_sb + key * p.ov_ss + h * p.ov_sh + col,
              static_cast<const uint16_t*>(p.v) + page * p.v_sb + row * p.v_ss + h * p.v_sh + col);
  });
}

// The gather out of a float8 pool: dequantized into 16-bit rows (a chunk: 16 codes in, 32 bytes out).
template <typename Out>
__global__ void __launch_bounds__(kCopyThreads) GatherKvFp8Kernel(const GatherParams p) {
  ForEachGatherChunk<16>(p, [&](int b, int64_t page, int64_t row, int64_t key, int64_t h, int64_t col) {
    DequantizeChunk(static_cast<Out*>(p.out_k) + b * p.ok_sb + key * p.ok_ss + h * p.ok_sh + col,
                    static_cast<const uint8_t*>(p.k) + page * p.k_sb + row * p.k_ss + h * p.k_sh + col,
                    p.k_descale[h]);
    DequantizeChunk(static_cast<Out*>(p.out_v) + b * p.ov_sb + key * p.ov_ss + h * p.ov_sh + col,
                    static_cast<const uint8_t*>(p.v) + page * p.v_sb + row * p.v_ss + h * p.v_sh + col,
                    p.v_descale[h]);
  });
}

}  // namespace attnd::kernels::decode
