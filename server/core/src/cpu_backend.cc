#include "attnd/server/cpu_backend.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "attnd/fp8.h"
#include "attnd/half.h"
#include "attnd/reference.h"
#include "attnd/server/queue_expiry.h"
#include "attnd/server/status_util.h"

namespace attnd::server {
namespace {

// The reference reads each tensor contiguously: q, k and v still in a message's pieces are gathered into
// `gathered`; in[i] is where tensor i's bytes are (null for a tensor with none).
absl::Status GatherInputs(const TensorSource* const (&sources)[3], std::string (&gathered)[3],
                          const uint8_t* (&in)[3]) {
  try {
    for (int i = 0; i < 3; ++i) {
      in[i] = sources[i]->host;
      if (in[i] != nullptr || sources[i]->host_bytes == 0) continue;
      gathered[i].resize(sources[i]->host_bytes);
      CopyInline(*sources[i], reinterpret_cast<uint8_t*>(gathered[i].data()));
      in[i] = reinterpret_cast<const uint8_t*>(gathered[i].data());
    }
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("out of host memory for the inputs");
  }
  return absl::OkStatus();
}

double Micros(absl::Duration d) { return absl::ToDoubleMicroseconds(d); }

// Working memory the reference may use at once: a quarter of physical memory (the rest holds requests,
// replies and everything else on the host), or the configured budget.
uint64_t ResolveMemoryBudget(uint64_t configured) {
  if (configured > 0) return configured;
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return 1ull << 30;
  return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page) / 4;
}

int ResolveThreads(int requested) {
  if (requested > 0) return requested;
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(hw);
}

}  // namespace

CpuBackend::CpuBackend(const BackendOptions& options, CpuBackendHooks hooks)
    : max_queue_(options.max_queue),
      threads_(ResolveThreads(options.threads)),
      memory_budget_(ResolveMemoryBudget(options.memory_budget_bytes)),
      hooks_(std::move(hooks)),
      expiry_([this](absl::Time now) { return DropExpired(now); }) {
  // One worker per thread: under load every core runs its own request; a lone request fans out over all
  // cores inside ReferenceAttention (see Run), so latency stays low when the server is idle.
  workers_.reserve(threads_);
  for (int i = 0; i < threads_; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

CpuBackend::~CpuBackend() { Shutdown(); }

std::vector<int64_t> CpuBackend::supported_head_dims() const {
  // The reference handles any head_dim; it serves the kernels' set (problem.h says why).
  return {kHeadDims.begin(), kHeadDims.end()};
}

absl::Status CpuBackend::Accept(ForwardJob* job_ptr) const {
  const ForwardJob& job = *job_ptr;
  const auto ref_error = [](absl::string_view field) {
    return absl::FailedPreconditionError(absl::StrCat(
        field, ": tensor references (registered CUDA buffers) need the cuda backend; this server runs the cpu "
               "backend, send the bytes inline"));
  };
  if (job.q.host == nullptr && !job.q.buffer_id.empty()) return ref_error("q.ref");
  if (job.k.host == nullptr && !job.k.buffer_id.empty()) return ref_error("k.ref");
  if (job.v.host == nullptr && !job.v.buffer_id.empty()) return ref_error("v.ref");
  if (job.o_to_buffer) return ref_error("o_ref");
  return absl::OkStatus();
}

absl::Status CpuBackend::Submit(std::unique_ptr<ForwardJob> job) {
  absl::MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("the server is shutting down");
  if (queue_.size() >= max_queue_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("queue full: ", queue_.size(), " requests waiting (--max_queue=", max_queue_, ")"));
  }
  expiry_.Queued(job->deadline);
  queue_.push_back(std::move(job));
  return absl::OkStatus();
}

namespace {

// Pages in host memory, left uninitialised: a page's rows are written by an append before any step reads them.
class CpuKvPool final : public KvPool {
 public:
  CpuKvPool(const SequenceShape& shape, int page_tokens, int32_t num_pages, std::unique_ptr<uint8_t[]> data)
      : KvPool(shape, page_tokens, num_pages), data_(std::move(data)) {}
  // Layer `layer`'s K (kv 0) or V (kv 1) pages.
  uint8_t* pool(int layer, int kv) { return data_.get() + pool_offset(layer, kv) * shape().kv_bytes(); }
  uint8_t* bytes() const { return data_.get(); }

 private:
  std::unique_ptr<uint8_t[]> data_;
};

// Token t of a sequence at one layer's K or V pages: row t % page_tokens of page pages[t / page_tokens].
uint8_t* PoolRow(CpuKvPool& pool, int layer, int kv, const StepSequence& s, int64_t t) {
  const SequenceShape& shape = pool.shape();
  const int page = pool.page_tokens();
  return pool.pool(layer, kv) +
         (int64_t{s.pages[t / page]} * shape.page_elems(page) + (t % page) * shape.kv_heads * shape.head_dim) *
             static_cast<int64_t>(shape.kv_bytes());
}

// A float8 cache's rows (kv_heads x head_dim elements): an appended row stored as the codes of x / descale of each
// element's kv head (what the CUDA backend's append writes, bit for bit), and read back as code x descale rounded
// once to the dtype (as the CUDA backend's gather for its prefill kernels).
void QuantizeRow(const SequenceShape& shape, const float* descale, const uint16_t* in, uint8_t* out) {
  for (int64_t i = 0; i < int64_t{shape.kv_heads} * shape.head_dim; ++i) {
    out[i] = FloatToFp8E4M3(HalfToFloat(shape.dtype, in[i]) / descale[i / shape.head_dim]);
  }
}
void DequantizeRow(const SequenceShape& shape, const float* descale, const uint8_t* in, uint16_t* out) {
  for (int64_t i = 0; i < int64_t{shape.kv_heads} * shape.head_dim; ++i) {
    out[i] = FloatToHalf(shape.dtype, Fp8E4M3ToFloat(in[i]) * descale[i / shape.head_dim]);
  }
}

// The descales of `layer`'s K (kv 0) or V (kv 1), one per kv head; null for a 16-bit cache.
const float* LayerDescales(const SequenceShape& shape, int layer, int kv) {
  if (shape.kv_format == KvFormat::kAsDtype) return nullptr;
  return (kv == 0 ? shape.k_descale : shape.v_descale).data() + int64_t{layer} * shape.kv_heads;
}

void CopyPages(CpuKvPool& pool, absl::Span<const PageCopy> copies) {
  const SequenceShape& shape = pool.shape();
  const uint64_t page_bytes = static_cast<uint64_t>(shape.page_elems(pool.page_tokens())) * shape.kv_bytes();
  for (const PageCopy& c : copies) {
    for (int layer = 0; layer < shape.layers; ++layer) {
      for (int kv = 0; kv < 2; ++kv) {
        uint8_t* base = pool.pool(layer, kv);
        std::memcpy(base + c.to * page_bytes, base + c.from * page_bytes, page_bytes);
      }
    }
  }
}

void AppendRows(CpuKvPool& pool, const StepJob& job, const uint16_t* k, const uint16_t* v) {
  const SequenceShape& shape = pool.shape();
  const int64_t row_elems = int64_t{shape.kv_heads} * shape.head_dim;
  const float* descale[2] = {LayerDescales(shape, job.layer, 0), LayerDescales(shape, job.layer, 1)};
  const auto store = [&](int kv, const uint16_t* in, uint8_t* out) {
    if (descale[kv] == nullptr) {
      std::memcpy(out, in, shape.row_bytes());
    } else {
      QuantizeRow(shape, descale[kv], in, out);
    }
  };
  int64_t r = 0;
  for (const StepSequence& s : job.sequences) {
    for (int64_t t = 0; t < s.tokens; ++t, ++r) {
      store(0, k + r * row_elems, PoolRow(pool, job.layer, 0, s, s.cached + t));
      store(1, v + r * row_elems, PoolRow(pool, job.layer, 1, s, s.cached + t));
    }
  }
}

// Each sequence's query rows over its cached keys, bottom-right causal, into job.o (and job.lse).
absl::Status Attend(CpuKvPool& pool, StepJob& job, const uint16_t* q, int compute_threads) {
  const SequenceShape& shape = pool.shape();
  const int64_t row_elems = int64_t{shape.kv_heads} * shape.head_dim;
  const int64_t q_row = int64_t{job.q_heads} * shape.head_dim;
  try {
    job.o.resize(static_cast<uint64_t>(job.rows * q_row) * sizeof(uint16_t));
    if (job.want_lse) job.lse.resize(static_cast<uint64_t>(job.rows) * job.q_heads * sizeof(float));
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("out of host memory for the step's O");
  }
  auto* o = reinterpret_cast<uint16_t*>(job.o.data());
  auto* lse = reinterpret_cast<float*>(job.lse.data());
  const float* descale[2] = {LayerDescales(shape, job.layer, 0), LayerDescales(shape, job.layer, 1)};
  std::vector<uint16_t> keys, values;
  int64_t r = 0;
  for (const StepSequence& s : job.sequences) {
    const int64_t n = s.keys(job.append);
    try {
      keys.resize(static_cast<size_t>(n * row_elems));
      values.resize(static_cast<size_t>(n * row_elems));
    } catch (const std::bad_alloc&) {
      return absl::ResourceExhaustedError("out of host memory for a sequence's keys");
    }
    for (int64_t t = 0; t < n; ++t) {
      for (int kv = 0; kv < 2; ++kv) {
        const uint8_t* in = PoolRow(pool, job.layer, kv, s, t);
        uint16_t* out = (kv == 0 ? keys : values).data() + t * row_elems;
        if (descale[kv] == nullptr) {
          std::memcpy(out, in, shape.row_bytes());
        } else {
          DequantizeRow(shape, descale[kv], in, out);
        }
      }
    }
    Problem p;
    p.shape = Shape{1, s.tokens, n, job.q_heads, shape.kv_heads, shape.head_dim};
    p.dtype = shape.dtype;
    p.mask = Mask::kCausalBottomRight;
    p.scale = job.scale;
    p.want_lse = job.want_lse;
    ReferenceOptions opts;
    opts.num_threads = compute_threads;
    try {
      ReferenceAttention(p, ContiguousLayout(p.shape), q + r * q_row, keys.data(), values.data(), o + r * q_row,
                         job.want_lse ? lse + r * job.q_heads : nullptr, opts);
    } catch (const std::exception& e) {
      return absl::ResourceExhaustedError(absl::StrCat("cpu backend: ", e.what()));
    }
    r += s.tokens;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::shared_ptr<KvPool>> CpuBackend::MakeKvPool(const SequenceShape& shape, int page_tokens,
                                                               int32_t num_pages) {
  const uint64_t bytes = shape.page_bytes(page_tokens) * static_cast<uint64_t>(num_pages);
  std::unique_ptr<uint8_t[]> data(new (std::nothrow) uint8_t[bytes]);
  if (data == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("kv pool: out of host memory for ", bytes, " bytes (--kv_pool_mb)"));
  }
  return std::make_shared<CpuKvPool>(shape, page_tokens, num_pages, std::move(data));
}

absl::Status CpuBackend::CopyKvRows(const KvPool& pool, absl::Span<const int32_t> pages, int layer, int kv,
                                    int64_t first, int64_t rows, bool to_host, uint8_t* host) {
  uint8_t* const data = static_cast<const CpuKvPool&>(pool).bytes();
  ForEachKvRowRun(pool, pages, layer, kv, first, rows, [&](uint64_t at, uint64_t bytes, uint64_t host_at) {
    if (to_host) {
      std::memcpy(host + host_at, data + at, bytes);
    } else {
      std::memcpy(data + at, host + host_at, bytes);
    }
  });
  return absl::OkStatus();
}

absl::Status CpuBackend::WriteKvRows(const KvPool& pool, absl::Span<const int32_t> pages, int layer, int kv,
                                     int64_t first, int64_t rows, HostPieces src) {
  uint8_t* const data = static_cast<const CpuKvPool&>(pool).bytes();
  PieceReader in(src);
  bool whole = true;
  // The runs come in the rows' order, so each continues the pieces where the last one ended.
  ForEachKvRowRun(pool, pages, layer, kv, first, rows,
                  [&](uint64_t at, uint64_t bytes, uint64_t) { whole = whole && in.Read(data + at, bytes); });
  return whole ? absl::OkStatus() : absl::InternalError("kv rows: fewer bytes than rows");
}

absl::Status CpuBackend::SubmitSteps(std::unique_ptr<StepBatch> batch) {
  absl::MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("the server is shutting down");
  if (queue_.size() + steps_.size() >= max_queue_) {
    return absl::ResourceExhaustedError(absl::StrCat("queue full: ", queue_.size() + steps_.size(),
                                                     " requests waiting (--max_queue=", max_queue_, ")"));
  }
  steps_.push_back(std::move(batch));
  return absl::OkStatus();
}

absl::Status CpuBackend::RunStep(StepJob& job, int compute_threads) {
  const absl::Time start = absl::Now();
  job.timing.queue_us = Micros(start - job.accepted);
  job.kernel = kKernelName;
  job.device = -1;
  if (job.cancelled && job.cancelled()) return absl::CancelledError("the call was cancelled before the step started");
  if (start >= job.deadline) {
    return absl::DeadlineExceededError(absl::StrCat("the deadline expired after ", Micros(start - job.accepted),
                                                    " us in the queue; the step was not started"));
  }
  auto& pool = static_cast<CpuKvPool&>(*job.pool);
  CopyPages(pool, job.copies);
  std::string gathered[3];
  const uint8_t* in[3];
  ATTND_RETURN_IF_ERROR(GatherInputs({&job.q, &job.k, &job.v}, gathered, in));
  const absl::Time compute_start = absl::Now();
  if (job.append) {
    AppendRows(pool, job, reinterpret_cast<const uint16_t*>(in[1]), reinterpret_cast<const uint16_t*>(in[2]));
  }
  if (job.attend) {
    ATTND_RETURN_IF_ERROR(Attend(pool, job, reinterpret_cast<const uint16_t*>(in[0]), compute_threads));
  }
  const absl::Time end = absl::Now();
  job.timing.kernel_us = Micros(end - compute_start);
  job.timing.total_us = Micros(end - job.accepted);
  return absl::OkStatus();
}

absl::Time CpuBackend::DropExpired(absl::Time now) {
  std::vector<std::unique_ptr<ForwardJob>> expired;
  absl::Time earliest = absl::InfiniteFuture();
  {
    absl::MutexLock lock(&mu_);
    for (auto it = queue_.begin(); it != queue_.end();) {
      if ((*it)->deadline <= now) {
        expired.push_back(std::move(*it));
        it = queue_.erase(it);
      } else {
        earliest = std::min(earliest, (*it)->deadline);
        ++it;
      }
    }
  }
  for (std::unique_ptr<ForwardJob>& job : expired) job->done(ExpiredInQueue(*job, now));
  return earliest;
}

uint32_t CpuBackend::queue_depth() const {
  absl::MutexLock lock(&mu_);
  return static_cast<uint32_t>(queue_.size() + steps_.size());
}

uint32_t CpuBackend::in_flight() const {
  absl::MutexLock lock(&mu_);
  return static_cast<uint32_t>(queue_.size() + steps_.size()) + running_;
}

uint64_t CpuBackend::jobs_computed() const {
  absl::MutexLock lock(&mu_);
  return computed_;
}

void CpuBackend::Shutdown() {
  absl::MutexLock shutdown_lock(&shutdown_mu_);
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  // Workers drain the queue before they exit, so every accepted job gets its `done`.
  for (auto& w : workers_) {
    if (w.joinable()) w.join();
  }
  expiry_.Stop();
}

void CpuBackend::WorkerLoop() {
  for (;;) {
    std::unique_ptr<ForwardJob> job;
    std::unique_ptr<StepBatch> steps;
    int compute_threads = 1;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](CpuBackend* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) {
            return !self->queue_.empty() || !self->steps_.empty() || self->stopping_;
          },
          this));
      if (queue_.empty() && steps_.empty()) return;  // stopping and drained
      if (!steps_.empty()) {
        steps = std::move(steps_.front());
        steps_.pop_front();
      } else {
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      ++running_;
      // Share the cores among the jobs running now; a lone job gets all of them.
      compute_threads = std::max(1, threads_ / static_cast<int>(running_));
    }
    if (steps != nullptr) {
      uint32_t sequences = 0;
      for (const auto& j : steps->jobs) sequences += static_cast<uint32_t>(j->sequences.size());
      std::vector<absl::Status> statuses;
      for (const auto& j : steps->jobs) {
        j->batch_sequences = sequences;
        j->batch_requests = static_cast<uint32_t>(steps->jobs.size());
        statuses.push_back(RunStep(*j, compute_threads));
      }
      {
        absl::MutexLock lock(&mu_);
        --running_;
      }
      for (size_t i = 0; i < steps->jobs.size(); ++i) steps->jobs[i]->done(statuses[i]);
      continue;
    }
    const absl::Status status = Run(*job, compute_threads);
    // Finished before the reply goes out: a client that reads the stats right after its reply must not find its
    // own request still in flight.
    {
      absl::MutexLock lock(&mu_);
      --running_;
    }
    job->done(status);
    job.reset();
  }
}

absl::Status CpuBackend::Run(ForwardJob& job, int compute_threads) {
  const absl::Time start = absl::Now();
  job.timing.queue_us = Micros(start - job.accepted);
  job.kernel = kKernelName;
  job.device = -1;
  // The deadline first: gRPC cancels a call whose deadline passed, and the client sees DEADLINE_EXCEEDED.
  if (start >= job.deadline) return ExpiredInQueue(job, start);
  if (job.cancelled && job.cancelled()) {
    return absl::CancelledError("the call was cancelled before its computation started");
  }
  if (hooks_.before_compute) hooks_.before_compute(job);

  const Problem& p = job.problem;
  const Shape& s = p.shape;
  const uint64_t o_bytes = static_cast<uint64_t>(QElems(s)) * DTypeBytes(OutputDType(p.dtype));
  try {
    job.o.resize(o_bytes);
    if (p.want_lse) job.lse.resize(static_cast<uint64_t>(LseElems(s)) * sizeof(float));
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat("out of host memory for O (", o_bytes, " bytes)"));
  }
  // ReferenceAttention widens one head's K and V to fp32 in every compute thread; a bad_alloc there would
  // terminate the process, so the thread count is fitted to a memory budget first.
  const uint64_t per_thread = (2 * static_cast<uint64_t>(s.kv_len) * s.head_dim + s.kv_len + 3 * s.head_dim) * 4;
  const uint64_t fit = memory_budget_ / per_thread;
  if (fit == 0) {
    return absl::ResourceExhaustedError(absl::StrCat("shape.kv_len: ", s.kv_len, " needs ", per_thread,
                                                     " bytes of working memory per head, over the cpu backend's budget of ",
                                                     memory_budget_));
  }
  compute_threads = static_cast<int>(std::min<uint64_t>(compute_threads, fit));
  Layout layout;
  layout.q = job.q.strides;
  layout.k = job.k.strides;
  layout.v = job.v.strides;
  layout.o = ContiguousStrides(s.q_len, s.q_heads, s.head_dim);
  ReferenceOptions opts;
  opts.num_threads = compute_threads;
  std::string gathered[3];
  const uint8_t* in[3];
  ATTND_RETURN_IF_ERROR(GatherInputs({&job.q, &job.k, &job.v}, gathered, in));
  const absl::Time compute_start = absl::Now();
  auto* o = reinterpret_cast<uint16_t*>(job.o.data());
  float* lse = p.want_lse ? reinterpret_cast<float*>(job.lse.data()) : nullptr;
  try {
    if (p.dtype == DType::kFP8E4M3) {
      ReferenceAttentionFp8(p, layout, in[0], in[1], in[2],
                            {job.q_descale.data(), job.k_descale.data(), job.v_descale.data()}, o, lse, opts);
    } else {
      ReferenceAttention(p, layout, reinterpret_cast<const uint16_t*>(in[0]),
                         reinterpret_cast<const uint16_t*>(in[1]), reinterpret_cast<const uint16_t*>(in[2]), o, lse,
                         opts);
    }
  } catch (const std::exception& e) {  // thread creation or allocation on the calling thread
    return absl::ResourceExhaustedError(absl::StrCat("cpu backend: ", e.what()));
  }
  const absl::Time end = absl::Now();
  job.timing.kernel_us = Micros(end - compute_start);
  job.timing.h2d_us = job.timing.d2h_us = 0;
  job.timing.total_us = Micros(end - job.accepted);
  {
    absl::MutexLock lock(&mu_);
    ++computed_;
  }
  return absl::OkStatus();
}

}  // namespace attnd::server
