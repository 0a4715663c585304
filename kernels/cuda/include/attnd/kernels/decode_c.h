/* attnd::kernels::decode as a C ABI (libattnd_decode_c.so), for callers such as Python/ctypes that hand in
 * raw device pointers (torch tensors' data_ptr()) and a stream. Plan once per batch layout, launch many times.
 * Functions return 0 on success, otherwise an absl::StatusCode value with a message in err. */
#ifndef ATTND_KERNELS_DECODE_C_H_
#define ATTND_KERNELS_DECODE_C_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct attnd_decode_plan attnd_decode_plan;

/* attnd::kernels::decode::BatchLayout. Strides are element strides (batch, seq, head); for paged KV the k/v
 * strides are (page, row, head). */
typedef struct attnd_decode_layout {
  int32_t batch, q_len, q_heads, kv_heads, head_dim;
  int32_t dtype;    /* 0 bf16, 1 fp16 */
  int32_t causal;   /* 0 none, 1 bottom-right */
  int32_t want_lse; /* 1: write fp32 LSE [batch, q_heads, q_len] */
  float scale;
  int64_t q_strides[3], o_strides[3], k_strides[3], v_strides[3];
  int32_t paged;    /* 0 contiguous K/V [batch, kv_capacity, kv_heads, head_dim], 1 paged */
  int32_t kv_capacity;
  int32_t page_size, num_pages, max_pages_per_seq;
  int32_t kv_format; /* 0: K/V of dtype; 1: float8 e4m3 K/V with per-kv-head descales (the calls' k/v_descale) */
} attnd_decode_layout;

/* kv_lens: host copy [batch]; block_table: host copy [batch * max_pages_per_seq] (NULL for contiguous).
 * num_splits: 0 for the heuristic; sm_count: 0 to query the current device. */
int attnd_decode_plan_create(const attnd_decode_layout* layout, const int32_t* kv_lens, const int32_t* block_table,
                             int num_splits, int sm_count, attnd_decode_plan** out, char* err, size_t err_len);
/* Bytes of workspace each launch needs (16-byte aligned; no initialisation needed). */
size_t attnd_decode_plan_workspace_bytes(const attnd_decode_plan* plan);
/* Bytes of split counters each launch needs (int32, 0 without splits). They must be zero when a launch starts and
 * every launch leaves them zero: zero the buffer once when allocating it. Not the workspace's memory. */
size_t attnd_decode_plan_counter_bytes(const attnd_decode_plan* plan);
/* Splits of the longest sequence (1: no merge). */
int attnd_decode_plan_num_splits(const attnd_decode_plan* plan);
/* Enqueues the decode kernel (the last block of each split sequence merges it) on `stream` (a cudaStream_t;
 * NULL: the legacy default stream). kv_lens and block_table are device pointers (block_table NULL for
 * contiguous); k_descale / v_descale NULL for a 16-bit cache, and for a float8 one (layout kv_format 1) device fp32
 * [kv_heads], the factors a stored code's value is multiplied by; workspace and counters as sized above (NULL when
 * 0). */
int attnd_decode_launch(const attnd_decode_plan* plan, const void* q, const void* k, const void* v, void* o,
                        float* lse, const int32_t* kv_lens, const int32_t* block_table, const float* k_descale,
                        const float* v_descale, void* workspace, int32_t* counters, void* stream, char* err,
                        size_t err_len);
void attnd_decode_plan_destroy(attnd_decode_plan* plan);

/* Writes new_k/new_v [batch, new_len, kv_heads, head_dim] (contiguous) into the cache described by `layout`
 * at positions kv_len_b.. (host kv_lens / block_table validate, device ones are read by the kernel). Into a float8
 * cache (layout kv_format 1, device fp32 [kv_heads] descales; NULL for 16-bit) each element x of kv head h is stored
 * as the e4m3 code nearest to x / descale[h], saturating at +-448. */
int attnd_decode_append(const attnd_decode_layout* layout, int new_len, const int32_t* host_kv_lens,
                        const int32_t* host_block_table, const void* new_k, const void* new_v, void* k, void* v,
                        const int32_t* kv_lens, const int32_t* block_table, const float* k_descale,
                        const float* v_descale, void* stream, char* err, size_t err_len);

/* Copies keys 0 .. kv_len_b - 1 of each sequence of the paged cache described by `layout` into rows 0 ..
 * kv_len_b - 1 of out_k/out_v [batch, capacity, kv_heads, head_dim] (contiguous); for the prefill kernels, which
 * read one contiguous K/V. Host kv_lens / block_table validate, device ones are read by the kernel. Out of a float8
 * cache (descales as for the append) the rows are dequantized into the layout's dtype. */
int attnd_decode_gather(const attnd_decode_layout* layout, int capacity, const int32_t* host_kv_lens,
                        const int32_t* host_block_table, const void* k, const void* v, void* out_k, void* out_v,
                        const int32_t* kv_lens, const int32_t* block_table, const float* k_descale,
                        const float* v_descale, void* stream, char* err, size_t err_len);

#ifdef __cplusplus
}
#endif

#endif /* ATTND_KERNELS_DECODE_C_H_ */
