// KV sequence steps on the CUDA backend (docs/sequences.md, "On the CUDA backend"; the page pools are in
// kv_pool.cc). A batch of steps runs on one slot, every part of it on the
// slot's stream in this order: the inputs and the per-sequence arrays copied in (one H2D from pinned staging,
// plus device-to-device copies of registered buffers when several requests share the batch), the copy-on-write
// page copies, the appends, the attention (decode launches for runs of sequences of up to 16 tokens, the prefill
// kernels for longer ones), the copy back. A batch's kernels are short and depend on each other, so they do not
// go to the shared compute stream (BackendOptions::shared_compute_stream), whose purpose is to queue the
// persistent grids of Forward requests behind each other.
// A float8 pool's attention reads only its cache, as the CPU backend's does: the append kernel quantizes the new
// rows first, the decode launches read the codes, the prefill kernels the keys gathered and dequantized.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/types/span.h"
#include "attnd/kernels/attention.h"
#include "attnd/kernels/decode.h"
#include "attnd/server/status_util.h"
#include "cuda_device.h"
#include "stream_words.h"
#include "spdlog/spdlog.h"

namespace attnd::server::cuda {
namespace {

namespace dk = kernels::decode;

// Query rows per sequence from which a sequence runs on the prefill kernels instead of the decode kernel (whose
// q_len is 1 to 16).
constexpr int kMaxDecodeTokens = 16;

// A reference of a step: on the pool's device (once resolved), contiguous [rows, heads, head_dim], and 16-byte
// aligned (the kernels move rows in 16-byte copies and TMA boxes).
absl::Status CheckRef(const TensorSource& src, const std::string& field, int heads, int head_dim, int device,
                      bool must_be_resolved) {
  if (!src.is_reference()) return absl::OkStatus();
  const Strides contiguous{0, int64_t{heads} * head_dim, head_dim};
  const bool default_strides = src.strides.seq == 0 && src.strides.head == 0;
  if (!default_strides && (src.strides.seq != contiguous.seq || src.strides.head != contiguous.head)) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": a step's tensors are contiguous [rows, ", heads,
                                                   ", ", head_dim, "] on the CUDA backend"));
  }
  if (src.device_data == nullptr) {
    if (must_be_resolved) return absl::InternalError(absl::StrCat(field, ": the registered buffer was not resolved"));
    return absl::OkStatus();
  }
  if (src.device != device) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": the registered buffer is on device ", src.device,
                                                   "; the sequences live on device ", device));
  }
  if (reinterpret_cast<uintptr_t>(src.device_data) % 16 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": the buffer address plus offset is not 16-byte aligned"));
  }
  return absl::OkStatus();
}

absl::Status CheckRefs(const StepJob& job, const SequenceShape& shape, int device, bool must_be_resolved) {
  if (job.attend) {
    ATTND_RETURN_IF_ERROR(CheckRef(job.q, "q", job.q_heads, shape.head_dim, device, must_be_resolved));
    if (job.o_to_buffer) {
      ATTND_RETURN_IF_ERROR(CheckRef(job.o_ref, "o_ref", job.q_heads, shape.head_dim, device, must_be_resolved));
    }
  }
  if (job.append) {
    ATTND_RETURN_IF_ERROR(CheckRef(job.k, "k", shape.kv_heads, shape.head_dim, device, must_be_resolved));
    ATTND_RETURN_IF_ERROR(CheckRef(job.v, "v", shape.kv_heads, shape.head_dim, device, must_be_resolved));
  }
  return absl::OkStatus();
}

// The problem a sequence of more than kMaxDecodeTokens query rows gives the prefill kernels: its rows over its
// keys, bottom-right causal (row r at position keys - tokens + r).
Problem PrefillProblem(const StepJob& job, const SequenceShape& shape, int32_t tokens, int32_t keys) {
  Problem p;
  p.shape = Shape{1, tokens, keys, job.q_heads, shape.kv_heads, shape.head_dim};
  p.dtype = shape.dtype;
  p.mask = Mask::kCausalBottomRight;
  p.scale = job.scale;
  p.want_lse = job.want_lse;
  return p;
}

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A job about to run on `device`: its pool there and its references resolved onto it.
absl::Status CheckJobHere(const StepJob& job, int device) {
  const auto* pool = dynamic_cast<const CudaKvPool*>(job.pool.get());
  if (pool == nullptr || pool->device() != device) return absl::InternalError("step: the pool is not this device's");
  return CheckRefs(job, pool->shape(), device, true);
}

}  // namespace

absl::Status AcceptStepJob(const StepJob& job) {
  const auto* pool = dynamic_cast<const CudaKvPool*>(job.pool.get());
  if (pool == nullptr) return absl::FailedPreconditionError("step: the sequences' pool is not the CUDA backend's");
  const SequenceShape& shape = pool->shape();
  ATTND_RETURN_IF_ERROR(CheckKvShape(shape));
  // References are checked again when the batch runs, where the core has resolved them.
  ATTND_RETURN_IF_ERROR(CheckRefs(job, shape, pool->device(), false));
  if (!job.attend) return absl::OkStatus();
  // Sequences of many rows run on the prefill kernels: their problems must be ones those kernels take.
  for (size_t i = 0; i < job.sequences.size(); ++i) {
    const StepSequence& s = job.sequences[i];
    if (s.tokens <= kMaxDecodeTokens) continue;
    const Problem p = PrefillProblem(job, shape, s.tokens, s.keys(job.append));
    kernels::PlanOptions po;
    po.device = pool->device();
    absl::StatusOr<kernels::Selection> sel = kernels::Select(p, ContiguousLayout(p.shape), po);
    if (!sel.ok()) {
      return absl::Status(sel.status().code(), absl::StrCat("sequences[", i, "]: ", sel.status().message()));
    }
  }
  return absl::OkStatus();
}

// One batch of steps while it runs on a slot.
struct CudaDevice::StepWork {
  StepWork(StepBatch& b, Slot& s) : batch(b), slot(s) {}
  StepBatch& batch;
  Slot& slot;
  std::vector<StepJob*> jobs;        // the jobs that run: not cancelled, not expired
  std::vector<size_t> job_index;     // their places in batch.jobs
  const CudaKvPool* pool = nullptr;
  StepJob* first = nullptr;          // the batch's common parameters (layer, q_heads, scale, modes)
  int head_dim = 0, kv_heads = 0, q_heads = 0;
  int64_t row_q = 0, row_kv = 0;     // elements of one row of q / o and of k / v

  // Every sequence of the batch, in batch order.
  struct Seq {
    size_t job = 0;                  // index into `jobs`
    const StepSequence* s = nullptr;
    int64_t row = 0;                 // first row in the batch's tensors
    int64_t lse = 0;                 // first LSE element
  };
  std::vector<Seq> seqs;
  std::vector<int64_t> job_row, job_lse;  // each job's first row and first LSE element
  int64_t rows = 0;
  int max_pages = 1;                 // columns of the block table

  // Byte offsets in the device block and, at the same offsets, the pinned block.
  static constexpr uint64_t kAbsent = Placement::kAbsent;
  uint64_t table_at = 0, keys_at = 0, q_at = kAbsent, k_at = kAbsent, v_at = kAbsent, in_bytes = 0;
  uint64_t o_at = kAbsent, lse_at = kAbsent, out_from = 0, total = 0;
  Block dblock, hblock;
  Block gather;                      // contiguous K and V of the longest sequence gathered for the prefill kernels
  int64_t gather_keys = 0;

  // Where the batch's tensors are on the device (a region of the block, or one job's registered buffer).
  uint8_t *q = nullptr, *k = nullptr, *v = nullptr, *o = nullptr;
  float* lse = nullptr;
  int32_t *d_cached = nullptr, *d_keys = nullptr, *d_table = nullptr;
  int32_t *h_cached = nullptr, *h_keys = nullptr, *h_table = nullptr;

  bool ref_in = false;   // registered inputs copied into the block (several jobs, or one mixing inline and not)
  bool ref_out = false;  // O copied from the block into registered buffers (several jobs)
  uint64_t out_bytes = 0;      // copied back after the kernels
  bool enqueued = false;       // GPU work may be in flight on the slot's stream
  std::vector<std::vector<std::string>> kernels;  // per job: the kernels its sequences ran

  uint8_t* dev() const { return static_cast<uint8_t*>(dblock.ptr); }
  // The page-table rows of `count` sequences from `first`, as staged in the pinned block.
  absl::Span<const int32_t> TableOf(size_t first, size_t count) const {
    return absl::MakeConstSpan(h_table + first * max_pages, count * max_pages);
  }
  // The K/V side of the decode kernels' layout over the pool's pages at the step's layer (the batch, q_len and
  // query strides are the launch's).
  dk::BatchLayout PagedLayout(int layout_q_heads) const {
    const SequenceShape& shape = pool->shape();
    dk::BatchLayout l;
    l.q_heads = layout_q_heads;
    l.kv_heads = kv_heads;
    l.head_dim = head_dim;
    l.dtype = shape.dtype;
    l.kv_storage = dk::KvStorage::kPaged;
    if (pool->fp8()) l.kv_format = dk::KvFormat::kFp8E4M3;
    l.k = l.v = Strides{shape.page_elems(pool->page_tokens()), row_kv, head_dim};
    l.paged = dk::PagedKv{pool->page_tokens(), pool->num_pages(), max_pages};
    return l;
  }
  // The halves of `gather`: K, then V.
  uint8_t* gather_k() const { return static_cast<uint8_t*>(gather.ptr); }
  uint8_t* gather_v() const { return gather_k() + (gather.ptr != nullptr ? gather.size / 2 : 0); }
  uint8_t* host() const { return static_cast<uint8_t*>(hblock.ptr); }
  void AddKernel(size_t job, const std::string& name) {
    std::vector<std::string>& names = kernels[job];
    if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
  }
};

void CudaDevice::RunSteps(Slot& slot, StepBatch& batch, std::vector<absl::Status>& statuses) {
  const absl::Time start = absl::Now();
  statuses.assign(batch.jobs.size(), absl::OkStatus());
  StepWork w(batch, slot);
  for (size_t i = 0; i < batch.jobs.size(); ++i) {
    StepJob& job = *batch.jobs[i];
    job.timing.queue_us = Micros(start - job.accepted);
    job.device = index_;
    if (job.cancelled && job.cancelled()) {
      statuses[i] = absl::CancelledError("the call was cancelled before its step started");
    } else if (start >= job.deadline) {
      statuses[i] = absl::DeadlineExceededError(absl::StrCat(
          "the deadline expired after ", Micros(start - job.accepted), " us in the queue; the step was not started"));
    } else if (absl::Status st = CheckJobHere(job, index_); !st.ok()) {
      statuses[i] = st;  // its registered buffers, resolved now: the job alone fails
    } else {
      w.jobs.push_back(&job);
      w.job_index.push_back(i);
    }
  }
  if (w.jobs.empty()) return;
  absl::Status status = PlaceSteps(w);
  if (status.ok()) status = StageSteps(w);
  if (status.ok()) status = EnqueueSteps(w);
  if (status.ok()) {
    for (StepJob* job : w.jobs) {
      if (job->enqueued) job->enqueued();
    }
    status = CollectSteps(w);
  }
  if (!status.ok()) {
    ReleaseSteps(w);
    if (absl::IsInternal(status)) {
      spdlog::error("device {}: step batch of {} requests ('{}' first): {}", index_, w.jobs.size(),
                    w.jobs.front()->request_id, std::string(status.message()));
    }
    for (size_t i : w.job_index) statuses[i] = status;
    return;
  }
  const absl::Time end = absl::Now();
  for (StepJob* job : w.jobs) job->timing.total_us = Micros(end - job->accepted);
}

absl::Status CudaDevice::PlaceSteps(StepWork& w) {
  // The core batches steps of one pool, layer, q_heads, scale and mode; a batch that is not is its bug.
  StepJob& f = *w.jobs.front();
  w.first = &f;
  w.pool = dynamic_cast<const CudaKvPool*>(f.pool.get());
  if (w.pool == nullptr || w.pool->device() != index_) {
    return absl::InternalError("steps: the pool is not this device's");
  }
  const SequenceShape& shape = w.pool->shape();
  for (const StepJob* j : w.jobs) {
    if (j->pool.get() != f.pool.get() || j->layer != f.layer || j->attend != f.attend || j->append != f.append ||
        (f.attend && (j->q_heads != f.q_heads || j->scale != f.scale || j->want_lse != f.want_lse))) {
      return absl::InternalError("steps: a batch mixes pools, layers or step parameters");
    }
  }
  if (f.layer < 0 || f.layer >= shape.layers) {
    return absl::InternalError(absl::StrCat("steps: layer ", f.layer, " of a pool of ", shape.layers, " layers"));
  }
  if (!f.attend && !f.append) return absl::InternalError("steps: neither append nor attend");
  if (f.attend && (f.q_heads < 1 || f.q_heads % shape.kv_heads != 0)) {
    return absl::InternalError(absl::StrCat("steps: q_heads ", f.q_heads, " with ", shape.kv_heads, " kv heads"));
  }
  w.head_dim = shape.head_dim;
  w.kv_heads = shape.kv_heads;
  w.q_heads = f.attend ? f.q_heads : 0;
  w.row_q = int64_t{w.q_heads} * w.head_dim;
  w.row_kv = int64_t{w.kv_heads} * w.head_dim;
  const int page = w.pool->page_tokens();
  w.kernels.assign(w.jobs.size(), {});

  int64_t lse = 0;
  for (size_t j = 0; j < w.jobs.size(); ++j) {
    const StepJob& job = *w.jobs[j];
    w.job_row.push_back(w.rows);
    w.job_lse.push_back(lse);
    int64_t job_rows = 0;
    for (const StepSequence& s : job.sequences) {
      const int64_t keys = s.keys(job.append);
      if (s.tokens < 1 || s.cached < 0 || keys < s.tokens) {
        return absl::InternalError(absl::StrCat("steps: a sequence of ", s.cached, " cached keys and ", s.tokens,
                                                " tokens in '", job.request_id, "'"));
      }
      // Every page the step reads or writes must be in the table: a missing one would read as page 0.
      if (static_cast<int64_t>(s.pages.size()) < CeilDiv(keys, page)) {
        return absl::InternalError(absl::StrCat("steps: a page table of ", s.pages.size(), " pages for ", keys,
                                                " keys in '", job.request_id, "'"));
      }
      w.seqs.push_back({j, &s, w.rows, lse});
      w.max_pages = std::max(w.max_pages, static_cast<int>(s.pages.size()));
      w.rows += s.tokens;
      job_rows += s.tokens;
      lse += int64_t{w.q_heads} * s.tokens;
      if (job.attend && s.tokens > kMaxDecodeTokens && (w.pool->fp8() || !(job.append && s.cached == 0))) {
        w.gather_keys = std::max(w.gather_keys, keys);
      }
    }
    if (job_rows != job.rows) {
      return absl::InternalError(absl::StrCat("steps: '", job.request_id, "' has ", job.rows,
                                              " rows, its sequences ", job_rows));
    }
  }

  // Placement: the per-sequence arrays, then the inputs (one H2D moves them all), then O and LSE (one D2H).
  const bool multi = w.jobs.size() > 1;
  bool inline_q = false, inline_kv = false, inline_o = false;
  for (const StepJob* j : w.jobs) {
    inline_q = inline_q || (f.attend && !j->q.is_reference());
    inline_kv = inline_kv || (f.append && (!j->k.is_reference() || !j->v.is_reference()));
    inline_o = inline_o || (f.attend && !j->o_to_buffer);
  }
  // A registered tensor is read (or O written) in place only when it is the batch's whole tensor: one job, and
  // for K and V both registered. Otherwise it is copied into (out of) the block's region.
  for (const StepJob* j : w.jobs) {
    w.ref_in = w.ref_in || (f.attend && j->q.is_reference() && (multi || inline_q)) ||
               (f.append && (j->k.is_reference() || j->v.is_reference()) && (multi || inline_kv));
    w.ref_out = w.ref_out || (f.attend && j->o_to_buffer && (multi || inline_o));
  }
  const uint64_t n = w.seqs.size();
  const uint64_t qb = static_cast<uint64_t>(w.rows * w.row_q) * 2, kvb = static_cast<uint64_t>(w.rows * w.row_kv) * 2;
  uint64_t at = 0;
  w.keys_at = n * sizeof(int32_t);
  w.table_at = 2 * n * sizeof(int32_t);
  at = Align(w.table_at + n * static_cast<uint64_t>(w.max_pages) * sizeof(int32_t));
  if (f.attend && (multi || inline_q)) w.q_at = at, at = Align(at + qb);
  if (f.append && (multi || inline_kv)) {
    w.k_at = at, at = Align(at + kvb);
    w.v_at = at, at = Align(at + kvb);
  }
  w.in_bytes = at;
  if (f.attend && (multi || inline_o)) w.o_at = at, at = Align(at + qb);
  if (f.attend && f.want_lse) w.lse_at = at, at = Align(at + static_cast<uint64_t>(w.rows * w.q_heads) * sizeof(float));
  w.total = at;
  w.out_from = inline_o ? w.o_at : (w.lse_at != StepWork::kAbsent ? w.lse_at : w.total);
  w.out_bytes = w.total - w.out_from;

  absl::StatusOr<std::pair<Block, Block>> blocks = AcquireBlocks(w.total);
  if (!blocks.ok()) return blocks.status();
  std::tie(w.dblock, w.hblock) = *blocks;
  if (w.gather_keys > 0) {
    absl::StatusOr<Block> g = device_mem_->Acquire(2 * Align(static_cast<uint64_t>(w.gather_keys * w.row_kv) * 2));
    if (!g.ok()) return g.status();
    w.gather = *g;
  }
  uint8_t* dev = w.dev();
  uint8_t* host = w.host();
  const auto at_or = [dev](uint64_t off, const TensorSource& one) {
    return off != StepWork::kAbsent ? dev + off : one.device_data;
  };
  if (f.attend) w.q = at_or(w.q_at, f.q);
  if (f.append) w.k = at_or(w.k_at, f.k), w.v = at_or(w.v_at, f.v);
  if (f.attend) w.o = at_or(w.o_at, f.o_ref);
  if (w.lse_at != StepWork::kAbsent) w.lse = reinterpret_cast<float*>(dev + w.lse_at);
  w.d_cached = reinterpret_cast<int32_t*>(dev);
  w.d_keys = reinterpret_cast<int32_t*>(dev + w.keys_at);
  w.d_table = reinterpret_cast<int32_t*>(dev + w.table_at);
  w.h_cached = reinterpret_cast<int32_t*>(host);
  w.h_keys = reinterpret_cast<int32_t*>(host + w.keys_at);
  w.h_table = reinterpret_cast<int32_t*>(host + w.table_at);
  return absl::OkStatus();
}

absl::Status CudaDevice::StageSteps(StepWork& w) {
  const StepJob& f = *w.first;
  const int32_t num_pages = w.pool->num_pages();
  for (size_t i = 0; i < w.seqs.size(); ++i) {
    const StepSequence& s = *w.seqs[i].s;
    w.h_cached[i] = s.cached;
    w.h_keys[i] = s.keys(f.append);
    int32_t* row = w.h_table + i * w.max_pages;
    std::copy(s.pages.begin(), s.pages.end(), row);
    // Columns past a sequence's pages are never read (the kernels stop at its length); 0 keeps them in range.
    std::fill(row + s.pages.size(), row + w.max_pages, 0);
  }
  for (const StepJob* j : w.jobs) {
    for (const PageCopy& c : j->copies) {
      if (c.from < 0 || c.from >= num_pages || c.to < 0 || c.to >= num_pages || c.from == c.to) {
        return absl::InternalError(absl::StrCat("steps: a page copy ", c.from, " -> ", c.to, " in a pool of ",
                                                num_pages, " pages"));
      }
    }
  }
  // The inline inputs into pinned memory at their rows, so that one H2D copy at full DMA speed moves them all.
  std::vector<CopyPool::Part> parts;
  absl::Status status;
  const auto stage = [&](const TensorSource& src, uint64_t region, int64_t row, int64_t row_elems,
                         const StepJob& job, const char* field) {
    if (src.is_reference() || region == StepWork::kAbsent) return;
    const uint64_t bytes = static_cast<uint64_t>(job.rows * row_elems) * 2;
    if (src.host_bytes != bytes) {
      status = absl::InternalError(absl::StrCat("steps: '", job.request_id, "' has ", src.host_bytes, " bytes of ",
                                                field, ", its shape ", bytes));
      return;
    }
    uint8_t* dst = w.host() + region + static_cast<uint64_t>(row * row_elems) * 2;
    ForEachInlineRun(src, [&](const uint8_t* data, uint64_t size) {
      parts.push_back({dst, data, size});
      dst += size;
    });
  };
  for (size_t j = 0; j < w.jobs.size(); ++j) {
    const StepJob& job = *w.jobs[j];
    if (f.attend) stage(job.q, w.q_at, w.job_row[j], w.row_q, job, "q");
    if (f.append) {
      stage(job.k, w.k_at, w.job_row[j], w.row_kv, job, "k");
      stage(job.v, w.v_at, w.job_row[j], w.row_kv, job, "v");
    }
  }
  ATTND_RETURN_IF_ERROR(status);
  copies_->Copy(parts);

  cudaStream_t st = w.slot.stream;
  w.enqueued = true;
  if (hooks_.poison_outputs && w.o_at != StepWork::kAbsent) {
    // Test mode: NaN-fill O and LSE so that a launch that writes nothing cannot pass on stale results.
    ATTND_RETURN_IF_ERROR(CudaStatus("poison", cudaMemsetAsync(w.dev() + w.o_at, 0xFF, w.total - w.o_at, st)));
  } else if (hooks_.poison_outputs && w.lse_at != StepWork::kAbsent) {
    ATTND_RETURN_IF_ERROR(CudaStatus("poison", cudaMemsetAsync(w.dev() + w.lse_at, 0xFF, w.total - w.lse_at, st)));
  }
  ATTND_RETURN_IF_ERROR(CudaStatus("cudaEventRecord", cudaEventRecord(w.slot.ev[0], st)));
  ATTND_RETURN_IF_ERROR(
      CudaStatus("H2D copy (steps)", cudaMemcpyAsync(w.dev(), w.host(), w.in_bytes, cudaMemcpyHostToDevice, st)));
  if (f.device_order.has_value()) {
    // Ordered by the device (it runs alone): nothing of the caller's is read before its stream has got here.
    ATTND_RETURN_IF_ERROR(WaitWord(st, f.device_order->wait_word, f.device_order->value));
  }
  if (w.ref_in) {
    // Registered inputs join the inline ones in the block, so that every launch reads one tensor in batch order.
    // After the H2D copy, which also covers (and would overwrite) their rows.
    for (size_t j = 0; j < w.jobs.size(); ++j) {
      const StepJob& job = *w.jobs[j];
      const auto copy_in = [&](const TensorSource& src, uint64_t region, int64_t row_elems) -> absl::Status {
        if (!src.is_reference() || region == StepWork::kAbsent) return absl::OkStatus();
        const uint64_t off = static_cast<uint64_t>(w.job_row[j] * row_elems) * 2;
        return CudaStatus("D2D copy (registered step input)",
                          cudaMemcpyAsync(w.dev() + region + off, src.device_data,
                                          static_cast<uint64_t>(job.rows * row_elems) * 2,
                                          cudaMemcpyDeviceToDevice, st));
      };
      if (f.attend) ATTND_RETURN_IF_ERROR(copy_in(job.q, w.q_at, w.row_q));
      if (f.append) {
        ATTND_RETURN_IF_ERROR(copy_in(job.k, w.k_at, w.row_kv));
        ATTND_RETURN_IF_ERROR(copy_in(job.v, w.v_at, w.row_kv));
      }
    }
  }
  // The end of the inputs is the start of the kernels (one event: each record is host time on every step).
  return CudaStatus("cudaEventRecord", cudaEventRecord(w.slot.kernel_start, st));
}

absl::Status CudaDevice::EnqueueSteps(StepWork& w) {
  const StepJob& f = *w.first;
  Slot& slot = w.slot;
  cudaStream_t st = slot.stream;

  // Copy-on-write before anything writes: page `from` into page `to` at every layer, K and V. The pool is
  // 2 x layers page pools of num_pages pages each, so one 2D copy does it: a row per page pool.
  const SequenceShape& shape = w.pool->shape();
  const uint64_t page_bytes = static_cast<uint64_t>(shape.page_elems(w.pool->page_tokens())) * shape.kv_bytes();
  const uint64_t pitch = page_bytes * static_cast<uint64_t>(w.pool->num_pages());
  uint8_t* base = w.pool->pool(0, 0);
  for (const StepJob* j : w.jobs) {
    for (const PageCopy& c : j->copies) {
      ATTND_RETURN_IF_ERROR(CudaStatus(
          "copy-on-write page copy",
          cudaMemcpy2DAsync(base + static_cast<uint64_t>(c.to) * page_bytes, pitch,
                            base + static_cast<uint64_t>(c.from) * page_bytes, pitch, page_bytes,
                            2 * static_cast<size_t>(shape.layers), cudaMemcpyDeviceToDevice, st)));
    }
  }

  if (f.append) {
    // One launch per run of consecutive sequences with equal tokens: their new rows are evenly strided. A run
    // that attends on the decode kernel is appended by that launch (EnqueueAttention), except into float8 pages,
    // which only the append kernel quantizes.
    for (size_t a = 0; a < w.seqs.size();) {
      const int32_t tokens = w.seqs[a].s->tokens;
      size_t b = a + 1;
      while (b < w.seqs.size() && w.seqs[b].s->tokens == tokens) ++b;
      if (f.attend && tokens <= kMaxDecodeTokens && !w.pool->fp8()) {
        a = b;
        continue;
      }
      const int count = static_cast<int>(b - a);
      dk::BatchLayout cache = w.PagedLayout(w.kv_heads);
      cache.batch = count;
      const Strides rows{tokens * w.row_kv, w.row_kv, w.head_dim};
      absl::StatusOr<dk::AppendPlan> plan =
          dk::MakeAppendPlan(cache, tokens, rows, rows, absl::MakeConstSpan(w.h_cached + a, count),
                             absl::MakeConstSpan(w.h_table + a * w.max_pages,
                                                 static_cast<size_t>(count) * w.max_pages));
      if (!plan.ok()) return absl::InternalError(absl::StrCat("steps: append: ", plan.status().message()));
      dk::AppendTensors t;
      const uint64_t off = static_cast<uint64_t>(w.seqs[a].row * w.row_kv) * 2;
      t.new_k = w.k + off;
      t.new_v = w.v + off;
      t.k = w.pool->pool(f.layer, 0);
      t.v = w.pool->pool(f.layer, 1);
      t.kv_lens = w.d_cached + a;
      t.block_table = w.d_table + a * w.max_pages;
      t.k_descale = w.pool->k_descale(f.layer);
      t.v_descale = w.pool->v_descale(f.layer);
      ATTND_RETURN_IF_ERROR(dk::LaunchAppend(*plan, t, st));
      for (size_t i = a; i < b; ++i) w.AddKernel(w.seqs[i].job, "append");
      a = b;
    }
  }
  if (f.attend) ATTND_RETURN_IF_ERROR(EnqueueAttention(w));
  ATTND_RETURN_IF_ERROR(CudaStatus("cudaEventRecord", cudaEventRecord(slot.ev[2], st)));
  if (w.ref_out) {
    for (size_t j = 0; j < w.jobs.size(); ++j) {
      const StepJob& job = *w.jobs[j];
      if (!job.o_to_buffer || w.o_at == StepWork::kAbsent) continue;
      ATTND_RETURN_IF_ERROR(CudaStatus(
          "D2D copy (O into a registered buffer)",
          cudaMemcpyAsync(job.o_ref.device_data, w.o + static_cast<uint64_t>(w.job_row[j] * w.row_q) * 2,
                          static_cast<uint64_t>(job.rows * w.row_q) * 2, cudaMemcpyDeviceToDevice, st)));
    }
  }
  // Ordered by the device: the caller's stream goes on once O and the appended rows are written.
  if (f.device_order.has_value()) {
    ATTND_RETURN_IF_ERROR(WriteWord(st, f.device_order->done_word, f.device_order->value));
  }
  return absl::OkStatus();
}

// One launch of a batch's attention: a decode launch for a run of sequences of equal (short) q_len, or the
// prefill kernels for one long sequence, with the gather of its keys from the pages first when it had some (or
// its pages are float8).
struct CudaDevice::StepLaunch {
  size_t first = 0, count = 0;
  bool decode = false;
  dk::DecodePlan decode_plan;
  bool gather = false;
  dk::GatherPlan gather_plan;
  kernels::Plan prefill_plan;
  std::string name;
};

absl::Status CudaDevice::EnqueueAttention(StepWork& w) {
  cudaStream_t st = w.slot.stream;
  // Every launch is planned before any is enqueued, so that each workspace grows once, before its first use:
  // growing gives the old block back to the allocator while an earlier launch of this batch may still use it.
  const dk::BatchLayout cache = w.PagedLayout(w.q_heads);
  std::vector<StepLaunch> launches;
  size_t decode_ws = 0, decode_counters = 0;
  for (size_t a = 0; a < w.seqs.size();) {
    StepLaunch l;
    l.first = a;
    if (w.seqs[a].s->tokens <= kMaxDecodeTokens) {
      ATTND_RETURN_IF_ERROR(PlanDecodeLaunch(w, cache, l));
      decode_ws = std::max(decode_ws, l.decode_plan.workspace_bytes);
      decode_counters = std::max(decode_counters, l.decode_plan.counter_bytes);
    } else {
      ATTND_RETURN_IF_ERROR(PlanPrefillLaunch(w, cache, l));
    }
    launches.push_back(std::move(l));
    a += launches.back().count;
  }
  const kernels::Plan* largest_prefill = nullptr;
  for (const StepLaunch& l : launches) {
    if (l.decode) continue;
    if (largest_prefill == nullptr || l.prefill_plan.workspace_bytes > largest_prefill->workspace_bytes) {
      largest_prefill = &l.prefill_plan;
    }
  }
  absl::StatusOr<kernels::decode::DecodeWorkspace> dws = SlotDecodeWorkspace(w.slot, decode_ws, decode_counters, st);
  if (!dws.ok()) return dws.status();
  void* pws = nullptr;
  if (largest_prefill != nullptr) {
    absl::StatusOr<void*> ws = SlotWorkspace(w.slot, *largest_prefill, st);
    if (!ws.ok()) return ws.status();
    pws = *ws;
  }
  for (const StepLaunch& l : launches) {
    ATTND_RETURN_IF_ERROR(EnqueueLaunch(w, l, *dws, pws));
    for (size_t i = l.first; i < l.first + l.count; ++i) w.AddKernel(w.seqs[i].job, l.name);
  }
  return absl::OkStatus();
}

absl::Status CudaDevice::PlanDecodeLaunch(StepWork& w, const dk::BatchLayout& cache, StepLaunch& l) {
  const StepJob& f = *w.first;
  const size_t a = l.first;
  const int32_t tokens = w.seqs[a].s->tokens;
  // A run of consecutive sequences with equal tokens is one decode launch: their rows are evenly strided.
  size_t b = a + 1;
  while (b < w.seqs.size() && w.seqs[b].s->tokens == tokens) ++b;
  l.count = b - a;
  l.decode = true;
  dk::BatchLayout layout = cache;
  layout.batch = static_cast<int>(l.count);
  layout.q_len = tokens;
  layout.mask = Mask::kCausalBottomRight;
  layout.scale = f.scale;
  layout.want_lse = f.want_lse;
  layout.q = layout.o = Strides{tokens * w.row_q, w.row_q, w.head_dim};
  // The step's new rows are the last `tokens` keys of each sequence: the decode launch writes them into
  // their pages and reads them from the step's rows, so no append kernel runs before it; into float8 pages the
  // append kernel has written them (EnqueueSteps), and the launch reads them back from the cache.
  layout.append = f.append && !w.pool->fp8();
  layout.new_k = layout.new_v = Strides{tokens * w.row_kv, w.row_kv, w.head_dim};
  dk::DecodeOptions opts;
  opts.sm_count = desc_.multiprocessor_count;
  opts.device = index_;
  absl::StatusOr<dk::DecodePlan> plan = dk::MakeDecodePlan(layout, absl::MakeConstSpan(w.h_keys + a, l.count),
                                                           w.TableOf(a, l.count), opts);
  if (!plan.ok()) return absl::InternalError(absl::StrCat("steps: decode: ", plan.status().message()));
  l.decode_plan = *plan;
  l.name = absl::StrCat("decode_paged_d", w.head_dim, "_q", tokens, layout.append ? "_append" : "",
                        w.pool->fp8() ? "_fp8" : "");
  return absl::OkStatus();
}

absl::Status CudaDevice::PlanPrefillLaunch(StepWork& w, const dk::BatchLayout& cache, StepLaunch& l) {
  // A long query runs on the prefill kernels, which read contiguous K/V: its own new rows when the sequence
  // was empty, else its keys gathered from the pages (after this step's append). Float8 pages are always gathered:
  // the attention reads the cache's values, not the rows before quantization.
  const StepJob& f = *w.first;
  const size_t a = l.first;
  l.count = 1;
  const StepSequence& s = *w.seqs[a].s;
  const int32_t keys = s.keys(f.append);
  const uint64_t q_off = static_cast<uint64_t>(w.seqs[a].row * w.row_q) * 2;
  kernels::DeviceTensors t;
  t.q = w.q + q_off;
  t.o = w.o + q_off;
  t.lse = w.lse != nullptr ? w.lse + w.seqs[a].lse : nullptr;
  if (f.append && s.cached == 0 && !w.pool->fp8()) {
    const uint64_t kv_off = static_cast<uint64_t>(w.seqs[a].row * w.row_kv) * 2;
    t.k = w.k + kv_off;
    t.v = w.v + kv_off;
  } else {
    l.gather = true;
    dk::BatchLayout one = cache;
    one.batch = 1;
    const Strides out{keys * w.row_kv, w.row_kv, w.head_dim};
    absl::StatusOr<dk::GatherPlan> plan =
        dk::MakeGatherPlan(one, keys, out, out, absl::MakeConstSpan(w.h_keys + a, 1), w.TableOf(a, 1));
    if (!plan.ok()) return absl::InternalError(absl::StrCat("steps: gather: ", plan.status().message()));
    l.gather_plan = *plan;
    t.k = w.gather_k();
    t.v = w.gather_v();
  }
  const Problem p = PrefillProblem(f, w.pool->shape(), s.tokens, keys);
  kernels::PlanOptions po;
  po.device = index_;
  absl::StatusOr<kernels::Selection> sel = kernels::Select(p, ContiguousLayout(p.shape), po);
  if (!sel.ok()) return sel.status();
  absl::StatusOr<kernels::Plan> plan = PlanLaunch(*sel, t);
  if (!plan.ok()) return plan.status();
  l.prefill_plan = *std::move(plan);
  l.name = l.gather ? absl::StrCat(w.pool->fp8() ? "gather_fp8+" : "gather+", sel->info().name) : sel->info().name;
  return absl::OkStatus();
}

absl::Status CudaDevice::EnqueueLaunch(StepWork& w, const StepLaunch& l, const dk::DecodeWorkspace& dws,
                                       void* prefill_workspace) {
  const StepJob& f = *w.first;
  cudaStream_t st = w.slot.stream;
  if (l.decode) {
    const uint64_t q_off = static_cast<uint64_t>(w.seqs[l.first].row * w.row_q) * 2;
    dk::DecodeTensors t;
    t.q = w.q + q_off;
    t.k = w.pool->pool(f.layer, 0);
    t.v = w.pool->pool(f.layer, 1);
    t.o = w.o + q_off;
    t.lse = w.lse != nullptr ? w.lse + w.seqs[l.first].lse : nullptr;
    t.kv_lens = w.d_keys + l.first;
    t.block_table = w.d_table + l.first * w.max_pages;
    t.k_descale = w.pool->k_descale(f.layer);
    t.v_descale = w.pool->v_descale(f.layer);
    if (l.decode_plan.layout.append) {
      const uint64_t kv_off = static_cast<uint64_t>(w.seqs[l.first].row * w.row_kv) * 2;
      t.new_k = w.k + kv_off;
      t.new_v = w.v + kv_off;
    }
    return dk::LaunchDecode(l.decode_plan, t, dws, st);
  }
  if (l.gather) {
    dk::GatherTensors t;
    t.k = w.pool->pool(f.layer, 0);
    t.v = w.pool->pool(f.layer, 1);
    t.out_k = w.gather_k();
    t.out_v = w.gather_v();
    t.kv_lens = w.d_keys + l.first;
    t.block_table = w.d_table + l.first * w.max_pages;
    t.k_descale = w.pool->k_descale(f.layer);
    t.v_descale = w.pool->v_descale(f.layer);
    ATTND_RETURN_IF_ERROR(dk::LaunchGather(l.gather_plan, t, st));
  }
  return kernels::Launch(l.prefill_plan, l.prefill_plan.workspace_bytes > 0 ? prefill_workspace : nullptr, st);
}

absl::Status CudaDevice::CollectSteps(StepWork& w) {
  const StepJob& f = *w.first;
  Slot& slot = w.slot;
  cudaStream_t st = slot.stream;
  if (w.out_bytes > 0) {
    ATTND_RETURN_IF_ERROR(CudaStatus("D2H copy (steps)", cudaMemcpyAsync(w.host() + w.out_from, w.dev() + w.out_from,
                                                                         w.out_bytes, cudaMemcpyDeviceToHost, st)));
  }
  // ev[2] (after the kernels) ends the step unless something is copied out after them.
  const bool copies_out = w.out_bytes > 0 || w.ref_out;
  cudaEvent_t last = copies_out ? slot.ev[3] : slot.ev[2];
  if (copies_out) ATTND_RETURN_IF_ERROR(CudaStatus("cudaEventRecord", cudaEventRecord(last, st)));
  ATTND_RETURN_IF_ERROR(AwaitCompletion(slot, last));
  w.enqueued = false;
  float h2d = 0, kernel = 0, d2h = 0;
  cudaEventElapsedTime(&h2d, slot.ev[0], slot.kernel_start);
  cudaEventElapsedTime(&kernel, slot.kernel_start, slot.ev[2]);
  if (copies_out) cudaEventElapsedTime(&d2h, slot.ev[2], slot.ev[3]);
  std::vector<CopyPool::Part> parts;
  for (size_t j = 0; j < w.jobs.size(); ++j) {
    StepJob& job = *w.jobs[j];
    job.timing.h2d_us = h2d * 1e3;
    job.timing.kernel_us = kernel * 1e3;
    job.timing.d2h_us = copies_out ? d2h * 1e3 : 0;
    job.kernel = absl::StrJoin(w.kernels[j], "+");
    job.batch_sequences = static_cast<uint32_t>(w.seqs.size());
    job.batch_requests = static_cast<uint32_t>(w.jobs.size());
    if (f.attend && !job.o_to_buffer) {
      const uint64_t bytes = static_cast<uint64_t>(job.rows * w.row_q) * 2;
      job.o.resize(bytes);
      parts.push_back({reinterpret_cast<uint8_t*>(job.o.data()),
                       w.host() + w.o_at + static_cast<uint64_t>(w.job_row[j] * w.row_q) * 2, bytes});
    }
    if (f.attend && f.want_lse) {
      job.lse.assign(reinterpret_cast<const char*>(w.host() + w.lse_at) + w.job_lse[j] * sizeof(float),
                     static_cast<uint64_t>(job.rows * w.q_heads) * sizeof(float));
    }
  }
  copies_->Copy(parts);
  ReleaseSteps(w);
  return absl::OkStatus();
}

void CudaDevice::ReleaseSteps(StepWork& w) {
  // After an error the batch's copies or kernels may still be queued on the slot's stream, writing the blocks.
  if (w.enqueued) cudaStreamSynchronize(w.slot.stream);
  w.enqueued = false;
  ReleaseBlocks(w.dblock, w.hblock);
  w.dblock = w.hblock = Block{};
  if (w.gather.ptr != nullptr) device_mem_->Release(w.gather);
  w.gather = Block{};
}

absl::StatusOr<kernels::decode::DecodeWorkspace> CudaDevice::SlotDecodeWorkspace(Slot& slot, size_t partial_bytes,
                                                                                   size_t counter_bytes,
                                                                                   cudaStream_t stream) {
  // Replaces `block` by one of `bytes` when it holds less; true when it did.
  const auto grow = [&](Block& block, size_t bytes) -> absl::StatusOr<bool> {
    if (block.size >= bytes) return false;
    device_mem_->Release(block);
    block = Block{};
    absl::StatusOr<Block> b = device_mem_->Acquire(bytes);
    if (!b.ok()) return b.status();
    block = *b;
    return true;
  };
  if (partial_bytes == 0 && counter_bytes == 0) return kernels::decode::DecodeWorkspace{};
  absl::StatusOr<bool> grown = grow(slot.decode_workspace, partial_bytes);
  if (!grown.ok()) return grown.status();
  grown = grow(slot.decode_counters, counter_bytes);
  if (!grown.ok()) return grown.status();
  if (*grown) {
    ATTND_RETURN_IF_ERROR(CudaStatus("zeroing the decode split counters",
                                     cudaMemsetAsync(slot.decode_counters.ptr, 0, slot.decode_counters.size, stream)));
  }
  return kernels::decode::DecodeWorkspace{slot.decode_workspace.ptr,
                                          static_cast<int32_t*>(slot.decode_counters.ptr)};
}

}  // namespace attnd::server::cuda
