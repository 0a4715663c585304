// attnd::kernels::decode — decode and short-query attention over a KV cache, contiguous or paged.
//
// Plan, then run: MakeDecodePlan() validates a batch layout against host copies of the per-sequence KV lengths
// (and, for paged KV, the block table), picks the split of each sequence's keys across blocks and sizes the
// caller's workspace; it touches no device memory, and needs no device at all when options.sm_count is given.
// LaunchDecode() then enqueues the kernels any number of times (every layer of a step): it allocates nothing
// and never synchronises, so it can be captured in a CUDA graph.
//
// Each query row attends to keys [0, kv_len) of its sequence (kv_len read from the device copy at launch);
// with Mask::kCausalBottomRight, query row i of q_len sees keys [0, kv_len - q_len + i]. The q heads sharing a
// kv head are computed together, so every K/V byte is read once per kv head.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "attnd/problem.h"

namespace attnd::kernels::decode {

enum class KvStorage {
  kContiguous,  // K and V: [batch, kv_capacity, kv_heads, head_dim], element strides (batch, seq, head)
  kPaged,       // K and V: [num_pages, page_size, kv_heads, head_dim], element strides (page, row, head)
};

// How K and V are stored. Float8 halves the bytes a decode step reads, the most of its time.
enum class KvFormat {
  kAsQuery,  // layout.dtype, as Q and O
  // float8 e4m3 codes (torch.float8_e4m3fn): code c of kv head h stands for Fp8E4M3ToFloat(c) * descale[h]
  // (attnd/fp8.h), with fp32 descales [kv_heads] for K and for V in device memory (the tensors' k_descale and
  // v_descale). Q, O and appended rows stay layout.dtype; the attention runs in fp16 with fp32 accumulators.
  kFp8E4M3,
};

struct PagedKv {
  int page_size = 16;          // keys per page; a power of two from 16 to 256
  int num_pages = 0;           // pages in the K pool (the V pool has as many)
  int max_pages_per_seq = 0;   // columns of the block table [batch, max_pages_per_seq] (int32 page indices)
};

// Strides are in elements and head_dim is contiguous. Every stride must be a multiple of 8 (of 16 for float8 K/V)
// and every base pointer 16-byte aligned: rows move in 16-byte copies.
struct BatchLayout {
  int batch = 0;
  int q_len = 1;      // query rows per sequence, 1 to 16 (speculative / chunked decode)
  int q_heads = 0;
  int kv_heads = 0;   // divides q_heads
  int head_dim = 0;   // 64, 128 or 256
  DType dtype = DType::kBF16;
  Mask mask = Mask::kNone;  // kNone or kCausalBottomRight
  float scale = 0.f;        // softmax scale applied to Q.K (finite; DefaultScale(head_dim) is the usual one)
  bool want_lse = false;    // also write LSE: fp32 [batch, q_heads, q_len], natural log
  Strides q, o;             // [batch, q_len, q_heads, head_dim] (batch, seq, head strides)
  KvStorage kv_storage = KvStorage::kContiguous;
  KvFormat kv_format = KvFormat::kAsQuery;
  Strides k, v;             // contiguous: (batch, seq, head); paged: (page, row, head)
  int kv_capacity = 0;      // contiguous only: key rows each sequence's K/V buffer holds
  PagedKv paged;            // paged only
  // Append fused into the attention launch (a decode step): each sequence's last q_len keys, kv_len - q_len ..
  // kv_len - 1, are its new rows, read from tensors.new_k / new_v ([batch, q_len, kv_heads, head_dim] at these
  // strides) rather than from the cache, and the launch also writes them into the cache (tensors.k and v must
  // then be writable). kv_len counts them, as it does for a separate LaunchAppend followed by LaunchDecode, and
  // must be at least q_len. Not with float8 K/V (LaunchAppend quantizes, then LaunchDecode).
  bool append = false;
  Strides new_k, new_v;     // append only: element strides (batch, seq, head) of the new rows
};

struct DecodeOptions {
  // Splits of the longest sequence's keys: 0 lets the heuristic choose from batch x kv_heads, the lengths and
  // the SM count; n >= 1 forces n (1: no split and no merge, the reference the split path is tested against).
  int num_splits = 0;
  // Streaming multiprocessors to plan for: 0 queries `device`; > 0 plans without touching a device.
  int sm_count = 0;
  int device = -1;  // -1: the current device (only read when sm_count is 0)
  // The heuristic's target: blocks per SM it tries to fill (0: the tile's own, one for 16-bit head_dim 128 and two
  // otherwise), and the fewest keys a split may hold (a shorter split costs more in its merge than it gains in
  // parallelism).
  int target_blocks_per_sm = 0;
  int min_split_keys = 256;
  // The most partial bytes (rows of a block x splits x head_dim x 4) the last block of a split sequence merges
  // itself; above it a merge kernel spreads the merge over the GPU. In the kernel the merge costs no second
  // launch and no wait for the whole grid, but one block per (sequence, kv head, row block) then reads all of
  // its partials alone (docs/tuning.md, "Decode family").
  size_t max_fused_merge_bytes = 64 * 1024;
};

// A validated layout with its split decision. Plain data; valid for any lengths up to the capacity the
// validated table allows (splits follow the device lengths at launch: a sequence longer than planned puts
// the excess in its last split).
struct DecodePlan {
  BatchLayout layout;
  int rows = 0;         // query rows per (sequence, kv head): group * q_len
  int row_block = 0;    // rows one block computes: 16, 32 or 64
  int m_blocks = 0;     // blocks per (sequence, kv head, split) along the rows: ceil(rows / row_block)
  int block_n = 0;      // keys per pipeline stage of the chosen tile shape
  int split_keys = 0;   // keys per split (a multiple of block_n); sequence b has ceil(kv_len_b / split_keys)
                        // splits, at most max_splits, the last one taking the remainder
  int max_splits = 1;   // 1: no split, no merge, no workspace
  int sm_count = 0;
  bool merge_in_kernel = false;  // the last block of each split sequence merges; false: a merge kernel runs after
  size_t workspace_bytes = 0;  // fp32 partial O and LSE of every split; 0 when max_splits == 1
  size_t counter_bytes = 0;    // splits done per (sequence, kv head, row block); 0 unless merge_in_kernel
};

// A launch's scratch, owned by the caller. The partials need no initialisation. The counters must be zero when a
// launch starts and every launch leaves them zero, so a buffer zeroed once when it is allocated serves any plan
// whose counter_bytes it holds (partials and counters are apart so that no launch's partials land on them).
// Neither may serve two launches in flight.
struct DecodeWorkspace {
  void* partials = nullptr;      // plan.workspace_bytes, 16-byte aligned; null when 0
  int32_t* counters = nullptr;   // plan.counter_bytes, zero; null when 0
};

// Device pointers of one launch.
struct DecodeTensors {
  const void* q = nullptr;
  const void* k = nullptr;        // contiguous K, or the K page pool
  const void* v = nullptr;
  void* o = nullptr;
  float* lse = nullptr;           // only with want_lse
  const int32_t* kv_lens = nullptr;      // [batch] keys of each sequence (both storages)
  const int32_t* block_table = nullptr;  // paged only: [batch, max_pages_per_seq]
  const void* new_k = nullptr;    // layout.append only: the new rows
  const void* new_v = nullptr;
  const float* k_descale = nullptr;  // float8 K/V only: [kv_heads], 4-byte aligned
  const float* v_descale = nullptr;
};

// kv_lens: host copy of the per-sequence lengths ([batch]). block_table: host copy of the table
// ([batch * max_pages_per_seq], row-major; empty for contiguous KV); only the entries a sequence uses
// (ceil(kv_len / page_size)) are checked. Bad input is INVALID_ARGUMENT naming the field.
absl::StatusOr<DecodePlan> MakeDecodePlan(const BatchLayout& layout, absl::Span<const int32_t> kv_lens,
                                          absl::Span<const int32_t> block_table = {},
                                          const DecodeOptions& options = {});

// Enqueues the attention kernel on `stream` (current device); when the plan splits, the last block of each
// (sequence, kv head, row block) to finish merges the splits, or (plan.merge_in_kernel false) a merge kernel
// does. Asynchronous errors surface at the caller's next sync.
absl::Status LaunchDecode(const DecodePlan& plan, const DecodeTensors& tensors, const DecodeWorkspace& workspace,
                          cudaStream_t stream);

// Appending new K/V rows: new_k/new_v [batch, new_len, kv_heads, head_dim] are written to key positions
// kv_len_b .. kv_len_b + new_len - 1 of each sequence (its pages, for paged KV). The kernel reads kv_lens and
// does not change them: the caller advances them after the append. Into a float8 cache each element x of kv head
// h is stored as the e4m3 code nearest to x / descale[h] (ties to even), saturating at +-448.
struct AppendPlan {
  BatchLayout layout;  // the cache's layout (q, o, mask and scale are not used)
  int new_len = 0;
  Strides new_k, new_v;  // element strides (batch, seq, head) of the new rows
};

struct AppendTensors {
  const void* new_k = nullptr;
  const void* new_v = nullptr;
  void* k = nullptr;  // the cache written into: contiguous K, or the K page pool
  void* v = nullptr;
  const int32_t* kv_lens = nullptr;      // [batch] lengths before the append
  const int32_t* block_table = nullptr;  // paged only
  const float* k_descale = nullptr;      // float8 cache only: [kv_heads]
  const float* v_descale = nullptr;
};

// Validates that kv_len_b + new_len fits each sequence's buffer or table and that the pages the new rows land
// in are in range (host copies, as MakeDecodePlan).
absl::StatusOr<AppendPlan> MakeAppendPlan(const BatchLayout& cache, int new_len, const Strides& new_k,
                                          const Strides& new_v, absl::Span<const int32_t> kv_lens,
                                          absl::Span<const int32_t> block_table = {});
absl::Status LaunchAppend(const AppendPlan& plan, const AppendTensors& tensors, cudaStream_t stream);

// Gathering a paged cache into contiguous K/V, for kernels that read only contiguous tensors (the prefill
// kernels of attention.h, whose TMA boxes cannot follow a block table): keys 0 .. kv_len_b - 1 of each
// sequence are copied from its pages to rows 0 .. kv_len_b - 1 of out_k/out_v [batch, capacity, kv_heads,
// head_dim]; rows from kv_len_b on are left as they are. Out of a float8 cache the rows come out dequantized, in
// layout.dtype (each code's value times its kv head's descale, rounded once).
struct GatherPlan {
  BatchLayout layout;  // the paged cache's layout (q, o, mask and scale are not used)
  int capacity = 0;    // rows per sequence in out_k/out_v
  Strides out_k, out_v;  // element strides (batch, seq, head) of the output
  int max_kv_len = 0;  // the longest sequence of the host lengths: how many rows the launch's grid covers
};

struct GatherTensors {
  const void* k = nullptr;  // the K page pool
  const void* v = nullptr;
  void* out_k = nullptr;
  void* out_v = nullptr;
  const int32_t* kv_lens = nullptr;      // [batch] keys to gather
  const int32_t* block_table = nullptr;  // [batch, max_pages_per_seq]
  const float* k_descale = nullptr;      // float8 cache only: [kv_heads]
  const float* v_descale = nullptr;
};

// Validates the paged layout, that kv_len_b fits `capacity` and the table, and that the table entries of those
// keys name existing pages (host copies, as MakeDecodePlan).
absl::StatusOr<GatherPlan> MakeGatherPlan(const BatchLayout& cache, int capacity, const Strides& out_k,
                                          const Strides& out_v, absl::Span<const int32_t> kv_lens,
                                          absl::Span<const int32_t> block_table);
absl::Status LaunchGather(const GatherPlan& plan, const GatherTensors& tensors, cudaStream_t stream);

}  // namespace attnd::kernels::decode
