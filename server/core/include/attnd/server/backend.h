// The core vocabulary every transport and backend shares: where a request's tensors are (TensorSource,
// InputSink), one validated request (ForwardJob) and the Backend that runs it. A backend owns its worker
// threads (CPU) or streams (CUDA); Submit never blocks the caller, and `done` runs exactly once on a backend
// thread. Transports do not call a Backend for requests directly: the Dispatcher (dispatcher.h) does.
#pragma once

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "attnd/problem.h"
#include "attnd/server/step.h"

namespace attnd::server {

// Where a tensor's bytes are. Inline tensors are host memory owned by the request: contiguous (`host`: the
// streaming assembly buffer, a shared-memory channel's area, a parsed message) or in `pieces` (a unary
// message's bytes where gRPC received them, read without a copy); references name a registered buffer
// (buffer_registry.h), which the Dispatcher resolves to device memory before the backend sees the job.
struct TensorSource {
  const uint8_t* host = nullptr;  // inline bytes, contiguous, or nullptr
  uint64_t host_bytes = 0;        // inline bytes in all (contiguous or in pieces)
  std::string buffer_id;          // registered buffer, when the tensor is not inline
  uint64_t offset = 0;            // byte offset into the registered region
  Strides strides;                // element strides (contiguous unless the reference said otherwise)
  std::vector<absl::Span<const uint8_t>> pieces;  // inline bytes in order, when host == nullptr
  // A resolved reference: the tensor's first byte in device memory and that device.
  uint8_t* device_data = nullptr;
  int device = -1;
  bool is_reference() const { return !buffer_id.empty(); }
};

// Calls run(data, size) for each contiguous run of an inline tensor's host_bytes, in order.
template <typename Run>
void ForEachInlineRun(const TensorSource& s, Run&& run) {
  if (s.host != nullptr) {
    run(s.host, s.host_bytes);
    return;
  }
  for (const absl::Span<const uint8_t>& piece : s.pieces) run(piece.data(), piece.size());
}

// Copies an inline tensor's host_bytes to `dst`, from wherever they are.
inline void CopyInline(const TensorSource& s, uint8_t* dst) {
  ForEachInlineRun(s, [&dst](const uint8_t* data, uint64_t size) {
    std::memcpy(dst, data, size);
    dst += size;
  });
}

// Where a ForwardStream's inline inputs land while they arrive. The stream writes each tensor's bytes in
// order into data(i) and, after every chunk, reports how many of that tensor's bytes are now in place, so
// a backend can start moving them before the upload has ended (the CUDA backend copies them to the device
// piece by piece). Owned by the job; destroyed with it, or with the stream when it ends before Submit.
class InputSink {
 public:
  static constexpr int kTensors = 3;  // q, k, v in that order
  virtual ~InputSink() = default;
  // Tensor i's bytes (host memory, written by the stream); null when the tensor is not inline.
  virtual uint8_t* data(int tensor) = 0;
  // Bytes [0, bytes_in_place) of tensor i have been written. A failure ends the stream with that status.
  virtual absl::Status Arrived(int tensor, uint64_t bytes_in_place) = 0;
};

// The default sink: plain host buffers, read by the backend once the job runs.
class HostInputSink final : public InputSink {
 public:
  // RESOURCE_EXHAUSTED when the host cannot give the memory. sizes[i] == 0: tensor i is not inline.
  static absl::StatusOr<std::unique_ptr<InputSink>> Make(const uint64_t (&sizes)[kTensors]) {
    auto sink = std::unique_ptr<HostInputSink>(new HostInputSink());
    for (int i = 0; i < kTensors; ++i) {
      if (sizes[i] == 0) continue;
      // Left uninitialised: every byte is written by the stream before the job reads it (the stream checks
      // that each tensor arrived whole).
      sink->bytes_[i].reset(new (std::nothrow) uint8_t[sizes[i]]);
      if (sink->bytes_[i] == nullptr) {
        return absl::ResourceExhaustedError(
            absl::StrCat("stream inputs: out of host memory for ", sizes[i], " bytes of tensor ",
                         absl::string_view("qkv").substr(i, 1)));
      }
    }
    return std::unique_ptr<InputSink>(std::move(sink));
  }
  uint8_t* data(int tensor) override { return bytes_[tensor].get(); }
  absl::Status Arrived(int, uint64_t) override { return absl::OkStatus(); }

 private:
  HostInputSink() = default;
  std::unique_ptr<uint8_t[]> bytes_[kTensors];
};

// Timings reported back in ForwardResponse.timing (microseconds).
struct Timing {
  double queue_us = 0, h2d_us = 0, kernel_us = 0, d2h_us = 0, total_us = 0;
};

// One validated forward request. The gRPC layer fills everything but the outputs; the backend fills
// `o`/`lse` (inline) or writes O into `o_ref`, then calls `done`.
struct ForwardJob {
  std::string request_id;
  Problem problem;
  TensorSource q, k, v;
  // Float8 problems: the descale of each head of Q (q_heads values), K and V (kv_heads each); empty otherwise.
  std::vector<float> q_descale, k_descale, v_descale;
  bool o_to_buffer = false;   // O goes to o_ref instead of `o`
  TensorSource o_ref;
  // ForwardStream only: the sink that received the inline inputs (q/k/v's `host` point into it).
  std::unique_ptr<InputSink> inputs;
  absl::Time accepted;        // when the gRPC layer accepted it (queue time starts here)
  absl::Time deadline = absl::InfiniteFuture();  // work not started by then is answered DEADLINE_EXCEEDED
  std::function<bool()> cancelled;               // true once the client went away; may be empty
  // What the backend decided when it accepted the job (Backend::Accept; the CUDA backend: the kernel), for
  // its own use when the job runs. Opaque to everything else.
  std::shared_ptr<const void> backend_plan;
  // The registered buffers the references point into, kept mapped until the Dispatcher drops these (before
  // the reply, so a client that unregisters right after its reply finds the buffer idle).
  std::vector<std::shared_ptr<const void>> buffer_holds;

  // Outputs.
  std::string o;    // O bytes (OutputDType(problem.dtype)) when !o_to_buffer (and not lent, below)
  // Set by a caller that sends O from memory the backend lends it (ForwardStream's reply chunks point into it):
  // the backend may then leave `o` empty and lend O's bytes as `o_lent`, valid until the last holder of
  // `o_loan` drops it, which gives the memory back. Saves the copy into `o` (and its zero-fill): the CUDA backend
  // lends its pinned staging block.
  bool accepts_lent_o = false;
  std::string_view o_lent;
  std::shared_ptr<const void> o_loan;
  std::string lse;  // fp32 LSE bytes when problem.want_lse
  Timing timing;
  std::string kernel;  // configuration that ran
  int device = -1;

  // Called once with the outcome; the job is still alive during the call.
  std::function<void(absl::Status)> done;
};

// One Step request of KV sequences (docs/sequences.md), validated and resolved by the core against the
// sequences' page tables: the backend copies `copies` (copy-on-write), appends k/v at each sequence's `cached`
// position of `layer` when `append`, runs causal attention of q over the sequence's keys when `attend`, and
// fills o/lse. The core commits the new lengths after `done` reports OK; on failure nothing is committed (rows
// the backend may have written past a sequence's length are never read).
struct StepJob {
  std::string request_id;
  std::shared_ptr<KvPool> pool;
  int layer = 0;
  int q_heads = 0;   // with attend
  float scale = 0.f;
  bool want_lse = false;
  bool append = false;  // k and v given
  bool attend = false;  // q given
  std::vector<StepSequence> sequences;
  // The page tables `sequences` view when the core's own may change under the step: a step admitted behind this
  // one (CallInfo::chain) grows them. Empty otherwise.
  std::vector<int32_t> tables;
  int64_t rows = 0;  // sum of sequences[i].tokens: rows of q, k, v, o
  std::vector<PageCopy> copies;
  // q: [rows, q_heads, head_dim]; k, v: [rows, kv_heads, head_dim] (inline, or resolved references).
  TensorSource q, k, v;
  bool o_to_buffer = false;
  TensorSource o_ref;
  absl::Time accepted;
  absl::Time deadline = absl::InfiniteFuture();
  std::function<bool()> cancelled;
  std::vector<std::shared_ptr<const void>> buffer_holds;
  // Ordered on the caller's stream by the device (CallInfo::device_order; such a step runs alone): the step's
  // stream waits until the word at `wait_word` holds at least `value` before it reads the caller's tensors, and
  // writes `value` to `done_word` once its kernels have run. Device addresses of host memory (MapHostMemory).
  struct DeviceOrder {
    uint64_t wait_word = 0, done_word = 0, value = 0;
  };
  std::optional<DeviceOrder> device_order;
  // Called once the step's GPU work is queued on its stream, before it completes (backends that queue it).
  std::function<void()> enqueued;

  // Outputs.
  std::string o;    // [rows, q_heads, head_dim] when attend && !o_to_buffer
  std::string lse;  // fp32, per sequence [q_heads, tokens], back to back, when want_lse
  Timing timing;
  std::string kernel;
  int device = -1;
  uint32_t batch_sequences = 0;  // sequences in the launch this job ran in (set by the backend)
  uint32_t batch_requests = 0;   // jobs in that launch

  // Called once with the outcome, on a backend thread; the job is alive during the call.
  std::function<void(absl::Status)> done;
};

// Steps the core gathered to run as one launch: one pool, one layer, and the same q_heads, scale, LSE and
// append/attend modes. A backend may still split it (the CUDA decode kernel takes one query length per
// launch); each job's done is called once.
struct StepBatch {
  std::vector<std::unique_ptr<StepJob>> jobs;
};

struct DeviceDescription {
  int index = 0;
  std::string name;
  int cc_major = 0, cc_minor = 0;
  uint64_t total_memory_bytes = 0;
  int multiprocessor_count = 0;
  std::string uuid;  // the GPU's UUID as 32 hex digits, the same in every process on the host
};

// A sequence's rows in a device buffer of their own, for a move between two servers on one GPU
// (docs/sequences.md, "Moving a sequence"): every layer's K then V rows from token 0, as the byte chunks carry them.
// With `from_pool`, the handle names the exporter's page pool instead, read in place (one copy): its pages are laid
// out as KvPool says from the allocation's first byte, token t of every layer in page pool_pages[t / page_tokens].
struct DeviceRows {
  std::string ipc_handle;  // the buffer's (or the pool allocation's) cudaIpcMemHandle_t
  uint64_t bytes = 0;
  std::string device_uuid;
  bool from_pool = false;
  int32_t pool_num_pages = 0;
  int pool_page_tokens = 0;
  std::vector<int32_t> pool_pages;
};

// Device memory one served device holds for this server (exported as attnd_device_memory_used_bytes{device}).
struct DeviceMemoryUse {
  int device = 0;
  uint64_t used_bytes = 0;
};

struct BackendStats {
  uint64_t tensor_map_cache_hits = 0, tensor_map_cache_misses = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual std::string name() const = 0;  // "cpu" or "cuda"
  // Whether the backend's kernels can read and write device memory other processes on this host share by CUDA IPC
  // (RegisterCudaBuffer, tensor references).
  virtual bool cuda_ipc() const { return false; }
  virtual std::vector<DeviceDescription> devices() const = 0;
  virtual std::vector<int64_t> supported_head_dims() const = 0;
  virtual std::vector<DType> supported_dtypes() const = 0;
  virtual std::vector<std::string> kernels() const = 0;

  // Backend-specific acceptance (head_dim, dtype, references, layout) beyond the generic validation, called
  // once per request before Submit (and before a stream's OpenInputs); may record its decisions in
  // job->backend_plan. INVALID_ARGUMENT / FAILED_PRECONDITION naming the field.
  virtual absl::Status Accept(ForwardJob* job) const = 0;

  // Queues the job. Returns RESOURCE_EXHAUSTED (and does not call done) when the queue is full; otherwise
  // OK and `done` is called exactly once later, also across Shutdown.
  virtual absl::Status Submit(std::unique_ptr<ForwardJob> job) = 0;

  // Where a ForwardStream's inline inputs go as they arrive: called once its header has been validated
  // (Accept included), before any chunk; sizes[i] are the inline bytes of q/k/v (0: a reference).
  // The sink comes back to Submit in job->inputs. RESOURCE_EXHAUSTED when the memory cannot be had.
  virtual absl::StatusOr<std::unique_ptr<InputSink>> OpenInputs(const ForwardJob& job,
                                                                const uint64_t (&sizes)[InputSink::kTensors]) {
    (void)job;
    return HostInputSink::Make(sizes);
  }

  // KV sequences. A pool of `num_pages` pages of `page_tokens` tokens for `shape`, in the backend's memory;
  // RESOURCE_EXHAUSTED when that memory cannot be had, UNIMPLEMENTED when the backend has no sequences.
  virtual absl::StatusOr<std::shared_ptr<KvPool>> MakeKvPool(const SequenceShape& shape, int page_tokens,
                                                             int32_t num_pages) {
    (void)shape, (void)page_tokens, (void)num_pages;
    return absl::UnimplementedError(absl::StrCat("KV sequences are not available on the ", name(), " backend"));
  }
  // The K/V pool memory a server takes for sequences when no --kv_pool_mb is given.
  virtual uint64_t default_kv_pool_bytes() const { return 1ull << 30; }
  // Backend-specific acceptance of a step (head_dim, dtype, references), before the core commits to it.
  virtual absl::Status AcceptStep(const StepJob& job) const {
    (void)job;
    return absl::OkStatus();
  }
  // Moving a sequence between servers: copies rows [first, first + rows) of `layer`'s K (kv 0) or V (kv 1) of the
  // sequence whose page table is `pages` from the pool into `host` (to_host) or from `host` into the pool. Nothing
  // steps on those pages meanwhile (the core holds the sequence).
  virtual absl::Status CopyKvRows(const KvPool& pool, absl::Span<const int32_t> pages, int layer, int kv,
                                  int64_t first, int64_t rows, bool to_host, uint8_t* host) {
    (void)pool, (void)pages, (void)layer, (void)kv, (void)first, (void)rows, (void)to_host, (void)host;
    return absl::UnimplementedError(absl::StrCat("moving sequences is not available on the ", name(), " backend"));
  }
  // The same copy into the pool from bytes in pieces (`src` holds exactly the rows' bytes, in order). Backends copy
  // from the pieces where they lie; this default gathers them first (one piece: used as is).
  virtual absl::Status WriteKvRows(const KvPool& pool, absl::Span<const int32_t> pages, int layer, int kv,
                                   int64_t first, int64_t rows, HostPieces src) {
    if (src.size() == 1) {
      return CopyKvRows(pool, pages, layer, kv, first, rows, false, const_cast<uint8_t*>(src[0].data()));
    }
    std::string gathered(static_cast<size_t>(rows) * pool.shape().row_bytes(), '\0');
    if (!PieceReader(src).Read(reinterpret_cast<uint8_t*>(gathered.data()), gathered.size())) {
      return absl::InternalError("kv rows: fewer bytes than rows");
    }
    return CopyKvRows(pool, pages, layer, kv, first, rows, false, reinterpret_cast<uint8_t*>(gathered.data()));
  }
  // A same-host move on the device. ExportKvRowsOnDevice gathers every row of the sequence (`lengths` per layer)
  // into one device buffer that holds nothing else and returns its handle; `hold` keeps the buffer until dropped,
  // which must come after every importer has closed the handle. With `share_pool` it copies nothing and returns
  // the handle of the pool's allocation and the sequence's pages (DeviceRows::from_pool). ImportKvRowsOnDevice
  // opens either handle and copies the rows into its pages before returning; it closes a buffer's handle then and
  // keeps a pool's open while moves from that pool keep coming. FAILED_PRECONDITION on a backend without a GPU.
  virtual absl::StatusOr<DeviceRows> ExportKvRowsOnDevice(const KvPool& pool, absl::Span<const int32_t> pages,
                                                          absl::Span<const int64_t> lengths, bool share_pool,
                                                          std::shared_ptr<void>* hold) {
    (void)pool, (void)pages, (void)lengths, (void)share_pool, (void)hold;
    return absl::FailedPreconditionError(
        absl::StrCat("device: the ", name(), " backend holds no rows on a GPU; export without `device`"));
  }
  virtual absl::Status ImportKvRowsOnDevice(const KvPool& pool, absl::Span<const int32_t> pages,
                                            absl::Span<const int64_t> lengths, const DeviceRows& rows) {
    (void)pool, (void)pages, (void)lengths;
    return absl::FailedPreconditionError(absl::StrCat("chunk.device_rows.device_uuid: '", rows.device_uuid,
                                                      "' is not this server's GPU (the ", name(),
                                                      " backend has none); move the sequence by bytes"));
  }
  // Steps ordered on a caller's stream by the device (StepJob::device_order): whether the backend runs them, and
  // the device address of `bytes` of host memory at `page` (page-aligned; a shared-memory channel's header) for
  // their words, mapped until the returned hold is dropped (after the last step that names it has ended).
  virtual bool device_order() const { return false; }
  struct MappedHostMemory {
    uint64_t device_address = 0;
    std::shared_ptr<void> hold;
  };
  virtual absl::StatusOr<MappedHostMemory> MapHostMemory(void* page, size_t bytes) {
    (void)page, (void)bytes;
    return absl::UnimplementedError(absl::StrCat("the ", name(), " backend does not order steps on the device"));
  }
  // Queues a batch of steps. RESOURCE_EXHAUSTED (and no done called) when the queue is full; otherwise every
  // job's done is called exactly once later, also across Shutdown.
  virtual absl::Status SubmitSteps(std::unique_ptr<StepBatch> batch) {
    (void)batch;
    return absl::UnimplementedError(absl::StrCat("KV sequences are not available on the ", name(), " backend"));
  }

  // Requests queued and not yet started / accepted and not yet done.
  virtual uint32_t queue_depth() const = 0;
  virtual uint32_t in_flight() const = 0;

  // Finishes every accepted job, then stops the workers. Submit after Shutdown is UNAVAILABLE.
  virtual void Shutdown() = 0;

  virtual BackendStats stats() const { return {}; }
  // Device memory held per served device, read at every metrics scrape (cheap, no device sync); empty on the
  // CPU backend.
  virtual std::vector<DeviceMemoryUse> device_memory() const { return {}; }

  // Reported by GetServerInfo: the queue bound behind RESOURCE_EXHAUSTED.
  virtual uint32_t max_queue() const { return 0; }
  // Reported by GetServerInfo (stream_preferred_from_bytes): from how many inline tensor bytes a request that
  // fits one message is still better sent as a ForwardStream, because this backend's OpenInputs sink moves
  // the chunks on while the rest arrives. 0: no such overlap (host memory sink), so streaming only costs.
  virtual uint64_t stream_preferred_from_bytes() const { return 0; }
};

struct BackendOptions {
  int threads = 0;                 // CPU backend worker threads (0: hardware concurrency)
  uint32_t max_queue = 256;        // jobs waiting before RESOURCE_EXHAUSTED
  std::vector<int> devices;        // CUDA devices to serve (empty: all)
  int streams_per_device = 4;      // CUDA stream pool size per device
  uint64_t memory_budget_bytes = 0;  // CUDA staging/device memory budget per device (0: 80% of free)
  // CUDA: shapes "BxLqxLkxHqxHkxD,..." whose buffers are pre-allocated and tensor maps pre-encoded at start.
  std::string warm_shapes;
  size_t tensor_map_cache_entries = 4096;  // CUDA: encoded tensor maps kept (LRU)
  // CUDA: how long a worker polls its request's completion before sleeping in the driver, while at most one
  // other request runs on the device (busier: it sleeps at once); after a request that took longer, 1.5x that
  // request's wait, up to 4x this. Zero: always sleep.
  absl::Duration completion_spin = absl::Microseconds(300);
  // CUDA: run the kernels of all of a device's slots back to back on one compute stream, each slot keeping
  // its own stream for the copies. Every kernel is a persistent grid sized for the whole GPU, so kernels of
  // different requests running side by side only compete for SMs and L2 (at 16 concurrent IPC callers the
  // GPU reached 0.86 of its kernel-only rate). Off until measured on a GPU host: each slot's stream then
  // runs its own kernels too, concurrently with the others'.
  bool shared_compute_stream = false;
  // CUDA: helper threads for the staging copies of inline tensors (-1: DefaultCopyThreads(), 0: none).
  int copy_threads = -1;
  // CUDA: a ForwardStream's inline inputs are received into pinned memory and copied to the device piece by
  // piece as they arrive (OpenInputs), so the copy overlaps the upload; the price is that the request holds
  // its device and pinned blocks from its header on, also while a slow client uploads.
  bool stream_to_device = true;
  // CUDA, with stream_to_device: advertised to clients (ServerInfo.stream_preferred_from_bytes) as the inline
  // bytes from which they should stream a request that would fit one message. On the H200 (one caller, p50
  // unary / stream) 6.3 MB of inputs were level (4.18 / 4.27 ms), 12.6 MB already ahead (7.83 / 7.59), 100 MB
  // far ahead (68.3 / 57.4); 8 MiB lies between. 0: no preference.
  uint64_t stream_preferred_from_bytes = 8ull << 20;
};

// "cpu", "cuda", or "auto" (CUDA when a usable GPU is present, else CPU).
absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(const std::string& kind, const BackendOptions& options);

}  // namespace attnd::server
