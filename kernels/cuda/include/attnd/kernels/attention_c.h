/* attnd::kernels as a C ABI (libattnd_kernels_c.so), for callers such as Python/ctypes that hand in raw
 * device pointers (e.g. torch tensors' data_ptr()) and a stream. Plan once, launch many times.
 * Functions return 0 on success, otherwise an absl::StatusCode value with a message in err. */
#ifndef ATTND_KERNELS_ATTENTION_C_H_
#define ATTND_KERNELS_ATTENTION_C_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct attnd_kernels_plan attnd_kernels_plan;

/* The hopper family's schedule (attnd::kernels::HopperScheduleOptions). Start from
 * attnd_kernels_hopper_options_default(), which sets the tuned defaults, and change what a test or sweep needs. */
typedef struct attnd_kernels_hopper_options {
  int32_t max_blocks;                  /* cap on the persistent grid; 0: one block per SM */
  int32_t split_tail;                  /* 0 off, 1 auto (where it pays), 2 always (wherever the shape allows) */
  int32_t causal_order;                /* 0 dynamic (tile counter), 1 static */
  int32_t max_paired_q_tiles;          /* causal problems with at most this many q tiles per head run in pairs */
  int64_t l2_section_bytes;            /* K + V bytes one section of heads may span; <= 0: one section */
  int64_t paired_kv_bytes;             /* causal problems whose K + V exceed this run in pairs; < 0: never */
  int32_t tail_tiles_per_block;        /* dynamic order: the last section's length, in longest tiles per block */
  int32_t dynamic_min_tiles_per_block; /* the dynamic order needs at least this many tiles per block */
} attnd_kernels_hopper_options;

void attnd_kernels_hopper_options_default(attnd_kernels_hopper_options* out);

/* shape: batch, q_len, kv_len, q_heads, kv_heads, head_dim. dtype: 0 bf16, 1 fp16.
 * mask: 0 none, 1 causal top-left, 2 causal bottom-right. strides: element strides (batch, seq, head) of
 * q, k, v, o in that order (12 values). lse: fp32 [batch, q_heads, q_len] or NULL. config: a configuration
 * name, "" / NULL for the default, "mma_sync" or "hopper" for a family.
 * The plan owns the workspace its launches need (allocated and zeroed here, on the current device; freed by
 * attnd_kernels_plan_destroy), so its launches must not overlap: one stream, or one at a time. */
int attnd_kernels_plan_create(const int64_t shape[6], int dtype, int mask, float scale, const int64_t strides[12],
                              const void* q, const void* k, const void* v, void* o, float* lse, const char* config,
                              attnd_kernels_plan** out, char* err, size_t err_len);
/* As attnd_kernels_plan_create, with the hopper family's schedule (NULL: the defaults). own_workspace: 1 as
 * attnd_kernels_plan_create; 0 allocates nothing, and the caller passes the workspace to
 * attnd_kernels_plan_launch_with_workspace. */
int attnd_kernels_plan_create_with_options(const int64_t shape[6], int dtype, int mask, float scale,
                                           const int64_t strides[12], const void* q, const void* k, const void* v,
                                           void* o, float* lse, const char* config,
                                           const attnd_kernels_hopper_options* hopper, int own_workspace,
                                           attnd_kernels_plan** out, char* err, size_t err_len);
/* Float8 e4m3 forward (the hopper family: compute capability 9.0, head_dim 128 or 256). q, k, v hold e4m3 codes
 * (torch.float8_e4m3fn; their strides count bytes), o is bf16 (its strides count bf16 elements). q_descale
 * (q_heads floats), k_descale and v_descale (kv_heads floats each) are device pointers: element x of head h is read
 * as x * descale[h]. The plan owns its workspace and the V^T scratch its launches write (freed by destroy). */
int attnd_kernels_plan_create_fp8(const int64_t shape[6], int mask, float scale, const int64_t strides[12],
                                  const void* q, const void* k, const void* v, void* o, float* lse,
                                  const float* q_descale, const float* k_descale, const float* v_descale,
                                  const char* config, const attnd_kernels_hopper_options* hopper,
                                  attnd_kernels_plan** out, char* err, size_t err_len);
/* Enqueues the planned kernel on `stream` (a cudaStream_t; NULL: the legacy default stream) with the plan's own
 * workspace. */
int attnd_kernels_plan_launch(const attnd_kernels_plan* plan, void* stream, char* err, size_t err_len);
/* Bytes of device memory each launch needs (0: none). A caller's workspace is 256-byte aligned, zero before its
 * first launch (each launch leaves it zero) and used by one launch at a time. */
size_t attnd_kernels_plan_workspace_bytes(const attnd_kernels_plan* plan);
/* Enqueues the planned kernel with the caller's workspace (NULL when the plan needs none). */
int attnd_kernels_plan_launch_with_workspace(const attnd_kernels_plan* plan, void* workspace, void* stream, char* err,
                                             size_t err_len);
const char* attnd_kernels_plan_config(const attnd_kernels_plan* plan);
void attnd_kernels_plan_destroy(attnd_kernels_plan* plan);

int attnd_kernels_config_count(void);
const char* attnd_kernels_config_name(int index);
/* 0 when the current device can run these kernels; otherwise a status code and the reason in err. */
int attnd_kernels_check_device(char* err, size_t err_len);

#ifdef __cplusplus
}
#endif

#endif /* ATTND_KERNELS_ATTENTION_C_H_ */
