/* attnd's client library behind a C ABI (libattnd_client_c.so), for bindings that load it at run time (the
 * Python package `attnd` through ctypes). Every call goes through the C++ client (attnd/client/client.h,
 * shm_channel.h), so transports, streaming, the shared-memory channel, IPC registration and auth behave as in
 * `attn`.
 *
 * Conventions: functions return 0 (OK) or a gRPC status code and fill the caller's attnd_error when it is not
 * NULL. Strings the library returns (char*) are freed with attnd_free_string. Tensors are
 * [batch, seq, heads, head_dim] with element strides; head_dim must be contiguous. */
#ifndef ATTND_CLIENT_C_H_
#define ATTND_CLIENT_C_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define ATTND_C_ABI_VERSION 9

enum attnd_transport {
  ATTND_TRANSPORT_DEFAULT = -1, /* per call: the client's transport */
  ATTND_TRANSPORT_AUTO = 0,
  ATTND_TRANSPORT_UNARY = 1,
  ATTND_TRANSPORT_STREAM = 2,
  ATTND_TRANSPORT_SHM = 3, /* the server's --shm_socket (attnd_client_options.shm_socket) */
};
/* The ABI's own numbers; the library sends the proto's (attnd.v1.Dtype, MaskType) for them. FP8_E4M3: a Forward's
 * float8 e4m3 q, k and v (one byte an element, read through attnd_forward_args' descales), whose O is bf16. */
enum attnd_dtype { ATTND_DTYPE_BF16 = 0, ATTND_DTYPE_FP16 = 1, ATTND_DTYPE_FP8_E4M3 = 2 };
enum attnd_mask { ATTND_MASK_NONE = 0, ATTND_MASK_CAUSAL_TOP_LEFT = 1, ATTND_MASK_CAUSAL_BOTTOM_RIGHT = 2 };

typedef struct attnd_error {
  int32_t code;            /* gRPC status code; 0: OK */
  char request_id[128];    /* the call's request id when the error belongs to a Forward call */
  char message[2048];      /* truncated to fit, always NUL-terminated */
} attnd_error;

typedef struct attnd_client_options {
  const char* target;           /* host:port or unix:/path */
  int32_t transport;            /* enum attnd_transport (not DEFAULT) */
  const char* tls_ca_file;      /* PEM roots; non-empty: the channel speaks TLS */
  const char* tls_server_name;  /* name checked instead of the target's host; NULL/empty: the target's */
  const char* auth_token;       /* sent as "authorization: Bearer <token>" (gRPC and the shm channel) */
  const char* shm_socket;       /* the server's --shm_socket; needed for ATTND_TRANSPORT_SHM */
  double default_timeout_s;     /* <= 0: 120 s */
  uint64_t shm_max_bytes;       /* largest shm request/reply area; 0: 64 MiB (the server's default limit) */
  /* gRPC channel arguments "name=value" (gRPC's names, e.g. grpc.http2.bdp_probe=0), applied after attnd's own
   * settings as `attn --grpc_arg` does; the client's every channel takes them, those to a fleet's servers too. */
  const char* const* grpc_args;
  int32_t num_grpc_args;
  /* connections of its own to each server that moves by bytes take (attnd_sequence_move), up to 64; 0: the
   * library's default (8); negative: moves share the other calls' connections. */
  int32_t move_connections;
} attnd_client_options;

typedef struct attnd_client attnd_client;

/* A tensor: inline host memory (data) or a registered CUDA buffer (buffer_id + offset). strides are element
 * strides of batch, seq and head; all zero means contiguous. An inline tensor with other strides is gathered
 * into a contiguous copy before sending (inline tensors travel contiguous on every transport); a buffer
 * reference is sent with its strides (the server reads them in place). */
typedef struct attnd_tensor {
  const void* data;
  const char* buffer_id;
  uint64_t offset;
  int64_t strides[3];
} attnd_tensor;

typedef struct attnd_forward_args {
  int64_t batch, q_len, kv_len, q_heads, kv_heads, head_dim;
  int32_t dtype;      /* enum attnd_dtype */
  int32_t mask;       /* enum attnd_mask */
  int32_t has_scale;  /* 0: the server's 1/sqrt(head_dim) */
  float scale;
  int32_t want_lse;
  int32_t transport;  /* enum attnd_transport; DEFAULT: the client's */
  double timeout_s;   /* <= 0: the client's default */
  const char* request_id;  /* NULL/empty: the library makes one (so errors can name it) */
  attnd_tensor q, k, v;
  /* O: host memory of exactly batch*q_len*q_heads*head_dim elements (bf16 for a float8 call, else the dtype),
   * contiguous (o.data; strides must be zero), or a registered buffer (o.buffer_id, o.offset; contiguous on the
   * server's side too). */
  attnd_tensor o;
  float* lse;  /* fp32 [batch, q_heads, q_len] when want_lse */
  /* ATTND_DTYPE_FP8_E4M3 only (the server refuses them otherwise, and requires them there): fp32 descales, element
   * x of head h read as e4m3(x) * descale[h]; q_descale 1 or q_heads values, k_descale and v_descale 1 or kv_heads,
   * each finite and > 0. NULL with a count of 0. */
  const float* q_descale;
  const float* k_descale;
  const float* v_descale;
  int64_t q_descale_count, k_descale_count, v_descale_count;
} attnd_forward_args;

typedef struct attnd_forward_info {
  char request_id[128];
  char backend[16];
  char kernel[128];
  int32_t device;
  int32_t transport;  /* the one that carried the call */
  double queue_us, h2d_us, kernel_us, d2h_us, total_us;
  double latency_us;  /* client side */
} attnd_forward_info;

/* Runs once on a library thread when an async call finishes (must not block long). err->code 0: success. */
typedef void (*attnd_done_fn)(void* user, const attnd_error* err, const attnd_forward_info* info);

int32_t attnd_abi_version(void);
void attnd_free_string(char* s);

/* NULL on failure (err filled). */
attnd_client* attnd_client_create(const attnd_client_options* options, attnd_error* err);
/* Waits for the client's async calls in flight, then frees it. */
void attnd_client_destroy(attnd_client* client);

/* GetServerInfo / GetStats as JSON (protobuf's JSON mapping, field names in lowerCamelCase, enums as names);
 * NULL on failure. */
char* attnd_client_info_json(attnd_client* client, int32_t refresh, attnd_error* err);
char* attnd_client_stats_json(attnd_client* client, attnd_error* err);
/* grpc.health.v1 Check of `service` (NULL: the whole server): 0 when SERVING. */
int32_t attnd_client_health(attnd_client* client, const char* service, attnd_error* err);

/* Blocks until the call completes; O (and LSE) are in the caller's memory (or its O buffer) on success. */
int32_t attnd_forward(attnd_client* client, const attnd_forward_args* args, attnd_forward_info* info,
                      attnd_error* err);
/* Starts the call and returns 0 once it is on its way (`done` then runs exactly once), or an error code
 * without calling `done`. Every pointer in args must stay valid until `done` runs; args itself may go. */
int32_t attnd_forward_async(attnd_client* client, const attnd_forward_args* args, attnd_done_fn done, void* user,
                            attnd_error* err);

/* RegisterCudaBuffer: ipc_handle is the 64 bytes of a cudaIpcMemHandle_t of the allocation on `device` (as the
 * server numbers devices); the region is [offset, offset + byte_size). Writes the buffer id (NUL-terminated)
 * into buffer_id (capacity `cap`). */
int32_t attnd_register_cuda_buffer(attnd_client* client, const uint8_t* ipc_handle, int32_t device, uint64_t offset,
                                   uint64_t byte_size, const char* name, char* buffer_id, size_t cap,
                                   attnd_error* err);
int32_t attnd_unregister_cuda_buffer(attnd_client* client, const char* buffer_id, attnd_error* err);

/* ---- KV sequences (docs/sequences.md) ----------------------------------------------------------------------
 * Sequence ids are strings without whitespace; calls that return several give them one per line ('\n'
 * separated, no trailing newline) in a string freed with attnd_free_string. OpenSequence, ForkSequence,
 * TruncateSequence, CloseSequence and GetSequence go over gRPC; a Step goes over the shared-memory channel when
 * the call's transport is shm (the client's shm_socket), over the unary Step RPC when it is unary, else (auto,
 * stream) as one message on a StepStream the client keeps open (docs/sequences.md). */

/* How a sequence's cache stores K and V (docs/sequences.md, "Float8 caches"). */
enum attnd_kv_format {
  ATTND_KV_AS_DTYPE = 0, /* as the rows arrive: the shape's dtype */
  /* float8 e4m3 codes, half the bytes: an appended element x of kv head h at layer l is cached as the code nearest
   * x / descale[l, h] and every step's attention reads code * descale[l, h] */
  ATTND_KV_FP8_E4M3 = 1,
};

typedef struct attnd_sequence_shape {
  int64_t layers, kv_heads, head_dim;
  int32_t dtype;     /* enum attnd_dtype: of q, O and the k/v rows a step sends */
  int32_t kv_format; /* enum attnd_kv_format */
  /* ATTND_KV_FP8_E4M3 only (the server refuses them otherwise): fp32 descales of K and of V, each finite and > 0:
   * 1 (for all), `layers` (one per layer) or layers * kv_heads (layer-major) values; NULL with a count of 0. */
  const float* k_descale;
  const float* v_descale;
  int64_t k_descale_count, v_descale_count;
} attnd_sequence_shape;

/* Opens `count` sequences (0 means 1) of `shape`; max_tokens 0: the server's limit. Returns their ids, NULL on
 * failure. max_tokens_out (the limit that applies) and page_tokens_out may be NULL. */
char* attnd_sequence_open(attnd_client* client, const attnd_sequence_shape* shape, int64_t max_tokens, uint32_t count,
                          int64_t* max_tokens_out, int32_t* page_tokens_out, attnd_error* err);

/* One Step: the rows of q, k, v and O are the sequences' rows back to back, T = sum of tokens. Tensors are host
 * memory, contiguous: q [T, q_heads, head_dim], k and v [T, kv_heads, head_dim] in the sequences' dtype; a NULL
 * q means append only (no O), NULL k and v mean attend only. */
typedef struct attnd_step_args {
  int64_t layer;
  int64_t q_heads;                  /* with q: a multiple of the sequences' kv_heads */
  int64_t count;                    /* sequences in the batch */
  const char* const* sequence_ids;  /* `count` ids */
  const int64_t* tokens;            /* `count` row counts, each >= 1 (the sequences' max_tokens bounds them) */
  int32_t has_scale;                /* 0: the server's 1/sqrt(head_dim) */
  float scale;
  int32_t want_lse;
  int32_t transport;     /* enum attnd_transport; DEFAULT: the client's */
  double timeout_s;      /* <= 0: the client's default */
  const char* request_id;  /* NULL/empty: the library makes one */
  const void* q;
  uint64_t q_bytes;
  const void* k;
  uint64_t k_bytes;
  const void* v;
  uint64_t v_bytes;
  void* o;           /* with q: O [T, q_heads, head_dim], so o_bytes must equal q_bytes */
  uint64_t o_bytes;
  float* lse;        /* with want_lse: fp32, per sequence [q_heads, tokens], back to back: 4 * T * q_heads bytes */
  uint64_t lse_bytes;
  int64_t* lengths;  /* NULL or `count` entries: each sequence's cached tokens at `layer` after the step */
} attnd_step_args;

/* Blocks until the step's reply; O, LSE and lengths are in the caller's memory on success. info may be NULL
 * (its queue/h2d/kernel/d2h/total are the step's timing). Buffer sizes are checked before the step is sent:
 * INVALID_ARGUMENT naming o_bytes or lse_bytes, and nothing is committed. */
int32_t attnd_step(attnd_client* client, const attnd_step_args* args, attnd_forward_info* info, attnd_error* err);

/* ---- Steps from CUDA memory, ordered on the caller's stream (docs/sequences.md, "Steps from CUDA memory") ---------
 * A batch names its sequences once; each step then passes device addresses and a stream. Tensors are contiguous,
 * rows of the batch's sequences back to back (`tokens` rows each): q and o [rows, q_heads, head_dim], k and v
 * [rows, kv_heads, head_dim]. The library registers each CUDA allocation a tensor lies in once (CUDA IPC, the
 * server must be on this host with --enable_cuda_ipc) and names tensors by their offset there. With a server that
 * offers stream order (the step's transport shm) work the caller queued on `stream` before the call runs before the
 * step reads its tensors, without the caller waiting for it; otherwise the library synchronises `stream` before
 * sending. Either way the call returns after the step has written O and appended K/V. */
typedef struct attnd_batch attnd_batch;

/* `count` sequence ids, stepped `tokens` rows each until a step says otherwise. NULL on failure. */
attnd_batch* attnd_batch_create(attnd_client* client, const char* const* sequence_ids, int64_t count, int64_t tokens,
                                attnd_error* err);
void attnd_batch_destroy(attnd_batch* batch);

typedef struct attnd_cuda_step_args {
  int64_t layer;
  int64_t q_heads;       /* with q: a multiple of the sequences' kv_heads */
  int64_t tokens;        /* rows per sequence in this step; 0: as in the batch's last step */
  int32_t has_scale;     /* 0: the server's 1/sqrt(head_dim) */
  float scale;
  int32_t transport;     /* enum attnd_transport; DEFAULT: the client's */
  double timeout_s;      /* <= 0: the client's default */
  const char* request_id;  /* NULL/empty: the library makes one */
  uint64_t stream;       /* the caller's cudaStream_t; 0: the legacy default stream */
  uint64_t q, k, v, o;   /* device addresses; 0: absent (q with o: attend; k with v: append) */
  uint64_t q_bytes;      /* of q, and of o */
  uint64_t kv_bytes;     /* of k, and of v */
  int64_t* lengths;      /* NULL or the batch's count of entries: each sequence's cached tokens at `layer` after */
} attnd_cuda_step_args;

/* One step of the batch's sequences; returns after the step ran. The tensors are in the CUDA context current on the
 * thread of the client's first CUDA step (else device 0's primary context, which torch uses too). info may be
 * NULL. */
int32_t attnd_batch_step_cuda(attnd_batch* batch, const attnd_cuda_step_args* args, attnd_forward_info* info,
                              attnd_error* err);
/* The same step without waiting for it (attnd::client::CudaSteps::Submit): returns once the step is queued to the
 * stream's sender, and work queued on `stream` afterwards waits on the GPU until the step has been answered. A
 * failed step's O is filled with NaN, steps submitted behind it on the stream are not sent, and the failure is
 * returned by the next call on the stream (submit, step or attnd_cuda_sync). `lengths` is not filled. Host order:
 * as attnd_batch_step_cuda. */
int32_t attnd_batch_submit_cuda(attnd_batch* batch, const attnd_cuda_step_args* args, attnd_error* err);
/* Waits on the host until every step submitted on `stream` is answered; the first failure not yet reported. */
int32_t attnd_cuda_sync(attnd_client* client, uint64_t stream, attnd_error* err);
/* 1 when this client's CUDA steps are stream-ordered, 0 when host-ordered; the gRPC status code negated on error. */
int32_t attnd_cuda_stream_ordered(attnd_client* client, attnd_error* err);

/* Returns the ids of `count` (0 means 1) new sequences sharing the parent's tokens; NULL on failure. */
char* attnd_sequence_fork(attnd_client* client, const char* sequence_id, uint32_t count, attnd_error* err);
/* Keeps the first `tokens` of every layer. Writes the per-layer lengths after it into lengths (capacity `cap`;
 * NULL with cap 0 to skip them) and their number into *layers_out (may be NULL). */
int32_t attnd_sequence_truncate(attnd_client* client, const char* sequence_id, int64_t tokens, int64_t* lengths,
                                size_t cap, size_t* layers_out, attnd_error* err);
/* Closes all of `count` ids, or none of them on failure. */
int32_t attnd_sequence_close(attnd_client* client, const char* const* sequence_ids, size_t count, attnd_error* err);
/* GetSequence as JSON (SequenceInfo, as attnd_client_info_json writes it); NULL on failure. */
char* attnd_sequence_info_json(attnd_client* client, const char* sequence_id, attnd_error* err);
/* Moves a sequence to the server at `to` (Client::MoveSequence): returns its new id, NULL on failure (the sequence
 * then stays where it was). */
char* attnd_sequence_move(attnd_client* client, const char* sequence_id, const char* to, attnd_error* err);
/* The same with the path chosen (MoveOptions): `path` 0 automatic, 1 bytes, 2 device; `*path_used` (when not NULL)
 * gets the path that carried the rows, 1 bytes or 2 device. */
char* attnd_sequence_move_path(attnd_client* client, const char* sequence_id, const char* to, int32_t path,
                               int32_t* path_used, attnd_error* err);
/* The id `sequence_id` goes by for this client now (Client::CurrentSequenceId): itself, or the id a call of this
 * client followed it to after its server moved it (docs/sequences.md, "Drain"). */
char* attnd_sequence_current_id(attnd_client* client, const char* sequence_id);
/* Moves this client has followed (Client::moves_followed): a change says that held ids may have new current ids. */
uint64_t attnd_client_moves_followed(attnd_client* client);

#ifdef __cplusplus
}
#endif
#endif /* ATTND_CLIENT_C_H_ */
