// The decode kernels' scalar arguments, shared by the host launcher and the device code (plain data).
#pragma once

#include <cstdint>

namespace attnd::kernels::decode {

struct DecodeParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* o = nullptr;
  float* lse = nullptr;                 // null: no LSE
  const int32_t* kv_lens = nullptr;
  const int32_t* block_table = nullptr;  // null: contiguous K/V
  float* o_part = nullptr;              // [batch, max_splits, q_len, q_heads, head_dim]: O / l of each split
  float* lse_part = nullptr;            // [batch, max_splits, q_len, q_heads]: log2 of each split's sum
  int32_t* split_counters = nullptr;    // [batch, kv_heads * m_blocks]: splits done; zero between launches
  int64_t q_sb = 0, q_ss = 0, q_sh = 0;  // element strides
  int64_t o_sb = 0, o_ss = 0, o_sh = 0;
  int64_t k_sb = 0, k_ss = 0, k_sh = 0;  // paged: page, row, head
  int64_t v_sb = 0, v_ss = 0, v_sh = 0;
  int batch = 0, q_len = 0, q_heads = 0, kv_heads = 0, group = 1;
  int rows = 0;       // group * q_len; row r is query position r / group of q head kv_head * group + r % group
  int m_blocks = 1;
  int causal = 0;     // bottom-right: row of position i sees keys < kv_len - q_len + i + 1
  float scale_log2 = 0.f;  // softmax scale * log2(e)
  int page_shift = 0;      // log2(page_size)
  int max_pages_per_seq = 0;
  int split_keys = 0;
  int max_splits = 1;
  int merge_in_kernel = 0;  // the last split block to finish merges (with split_counters); 0: a merge kernel does
  // Fused append (null: none): keys kv_len - q_len .. kv_len - 1 are read from these rows ([batch, q_len,
  // kv_heads, head_dim]) and written into k_cache / v_cache (k / v, writable) by the row-block-0 block of the
  // split holding them.
  const void* new_k = nullptr;
  const void* new_v = nullptr;
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  int64_t nk_sb = 0, nk_ss = 0, nk_sh = 0;
  int64_t nv_sb = 0, nv_ss = 0, nv_sh = 0;
  // Float8 K/V only: per kv head, the factor a stored code's value is multiplied by.
  const float* k_descale = nullptr;
  const float* v_descale = nullptr;
};

// Splits of a sequence of kv_len keys; the plan's split decision applied to the length read at launch.
#if defined(__CUDACC__)
__host__ __device__
#endif
inline int SplitsFor(int kv_len, int split_keys, int max_splits) {
  const int64_t n = (static_cast<int64_t>(kv_len) + split_keys - 1) / split_keys;
  return n < 1 ? 1 : (n > max_splits ? max_splits : static_cast<int>(n));
}

struct AppendParams {
  const void* new_k = nullptr;
  const void* new_v = nullptr;
  void* k = nullptr;
  void* v = nullptr;
  const int32_t* kv_lens = nullptr;
  const int32_t* block_table = nullptr;  // null: contiguous
  int64_t nk_sb = 0, nk_ss = 0, nk_sh = 0;
  int64_t nv_sb = 0, nv_ss = 0, nv_sh = 0;
  int64_t k_sb = 0, k_ss = 0, k_sh = 0;
  int64_t v_sb = 0, v_ss = 0, v_sh = 0;
  int batch = 0, new_len = 0, kv_heads = 0, head_dim = 0;
  int chunk_shift = 0;  // log2 of the 16-byte chunks of a cache head row: head_dim / 8, or head_dim / 16 for float8
  int page_shift = 0, max_pages_per_seq = 0;
  // Float8 cache (null: 16-bit, copied as is): the new rows (bf16 when new_bf16, else fp16) are divided by their kv
  // head's descale and rounded to e4m3, saturating at +-448.
  const float* k_descale = nullptr;
  const float* v_descale = nullptr;
  int new_bf16 = 1;
};

struct GatherParams {
  const void* k = nullptr;  // the paged pools
  const void* v = nullptr;
  void* out_k = nullptr;
  void* out_v = nullptr;
  const int32_t* kv_lens = nullptr;
  const int32_t* block_table = nullptr;
  int64_t k_sb = 0, k_ss = 0, k_sh = 0;  // page, row, head
  int64_t v_sb = 0, v_ss = 0, v_sh = 0;
  int64_t ok_sb = 0, ok_ss = 0, ok_sh = 0;  // batch, seq, head of the contiguous output
  int64_t ov_sb = 0, ov_ss = 0, ov_sh = 0;
  int batch = 0, capacity = 0, kv_heads = 0, head_dim = 0;
  int chunk_shift = 0;  // log2 of the 16-byte chunks of a pool head row: head_dim / 8, or head_dim / 16 for float8
  int max_kv_len = 0;   // the longest sequence at plan time: the grid's extent (longer ones loop)
  int page_shift = 0, max_pages_per_seq = 0;
  // Float8 pools (null: 16-bit, copied as is): each code times its kv head's descale, rounded to the output's type
  // (bf16 when out_bf16, else fp16).
  const float* k_descale = nullptr;
  const float* v_descale = nullptr;
  int out_bf16 = 1;
};

}  // namespace attnd::kernels::decode
