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

/* shape: batch, q_len, kv_len, q_heads, kv_heads, head_dim. dtype: 0 bf16, 1 fp16.
 * mask: 0 none, 1 causal top-left, 2 causal bottom-right. strides: element strides (batch, seq, head) of
 * q, k, v, o in that order (12 values). lse: fp32 [batch, q_heads, q_len] or NULL. config: a configuration
 * name, "" / NULL for the default, "seed" or "hopper" for a family. */
int attnd_kernels_plan_create(const int64_t shape[6], int dtype, int mask, float scale, const int64_t strides[12],
                              const void* q, const void* k, const void* v, void* o, float* lse, const char* config,
                              attnd_kernels_plan** out, char* err, size_t err_len);
/* Enqueues the planned kernel on `stream` (a cudaStream_t; NULL: the legacy default stream). */
int attnd_kernels_plan_launch(const attnd_kernels_plan* plan, void* stream, char* err, size_t err_len);
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
