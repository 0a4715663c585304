// The CUDA backend's per-device machinery, shared by its translation units: cuda_backend.cc (the devices, their
// slots and the Forward path, and the Backend itself) and sequence_runner.cc (the KV sequences' pools and
// steps). Internal to attnd_server_cuda.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "attnd/kernels/attention.h"
#include "attnd/kernels/decode.h"
#include "attnd/server/backend.h"
#include "attnd/server/copy_pool.h"
#include "attnd/server/cuda_backend.h"
#include "attnd/server/cuda/block_cache.h"
#include "attnd/server/cuda/ipc_registry.h"
#include "attnd/server/cuda/tensor_map_cache.h"
#include "attnd/server/queue_expiry.h"

namespace attnd::server::cuda {

inline absl::Status CudaStatus(const char* what, cudaError_t err) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(err)));
}

inline double Micros(absl::Duration d) { return absl::ToDoubleMicroseconds(d); }

// A worker spins on its completion (BackendOptions::completion_spin) only while the device runs at most
// this many requests, its own included.
constexpr uint32_t kSpinWhileRunning = 2;

// Buffer placement inside a slot's device block (and, at the same offsets, its pinned staging block): the
// inline inputs first, so one H2D copy moves them all, then the outputs, so one D2H copy returns them.
// A float8 request's descales travel with the inputs: fp32, q_heads of Q, then kv_heads of K and of V, each array
// 16-byte aligned (a kernel may read them as vectors).
struct Placement {
  static constexpr uint64_t kAbsent = ~uint64_t{0};
  uint64_t q = kAbsent, k = kAbsent, v = kAbsent, o = kAbsent, lse = kAbsent;
  uint64_t descales = kAbsent, descale_bytes = 0;  // float8 only
  uint64_t k_descale_at = 0, v_descale_at = 0;     // within the descales
  uint64_t in_bytes = 0;     // [0, in_bytes): inline Q/K/V (and descales)
  uint64_t out_offset = 0;   // [out_offset, total): O (when inline) and LSE
  uint64_t total = 0;
};

// TMA wants 16-byte aligned bases; 1 KiB keeps each tensor on its own cache lines and swizzle atoms.
inline uint64_t Align(uint64_t x) { return (x + 1023) & ~uint64_t{1023}; }

// Inputs of `dtype`, O of OutputDType(dtype).
inline Placement Place(const Shape& s, DType dtype, bool q_inline, bool k_inline, bool v_inline, bool o_inline,
                       bool lse) {
  const uint64_t eb = static_cast<uint64_t>(DTypeBytes(dtype));
  const uint64_t qb = static_cast<uint64_t>(QElems(s)) * eb, kvb = static_cast<uint64_t>(KVElems(s)) * eb;
  const uint64_t ob = static_cast<uint64_t>(QElems(s)) * DTypeBytes(OutputDType(dtype));
  Placement p;
  uint64_t at = 0;
  if (q_inline) p.q = at, at = Align(at + qb);
  if (k_inline) p.k = at, at = Align(at + kvb);
  if (v_inline) p.v = at, at = Align(at + kvb);
  if (dtype == DType::kFP8E4M3) {
    const auto bytes16 = [](int64_t heads) { return (static_cast<uint64_t>(heads) * sizeof(float) + 15) & ~15ull; };
    p.descales = at;
    p.k_descale_at = bytes16(s.q_heads);
    p.v_descale_at = p.k_descale_at + bytes16(s.kv_heads);
    p.descale_bytes = p.v_descale_at + bytes16(s.kv_heads);
    at = Align(at + p.descale_bytes);
  }
  p.in_bytes = at;
  p.out_offset = at;
  if (o_inline) p.o = at, at = Align(at + ob);
  if (lse) p.lse = at, at = Align(at + static_cast<uint64_t>(LseElems(s)) * sizeof(float));
  p.total = at;
  return p;
}

// Waits for `ev` (created with cudaEventBlockingSync). Polls, yielding, for up to `spin`, where a short
// kernel completes and the cost of a sleep/wake-up (tens of us) would show in the latency; then sleeps in
// the driver. The caller passes no spin when the device is busy: waiters polling a queue of GPU work only
// take cores from gRPC and the clients (seen on the H200 host: IPC at concurrency 16 kept the GPU half busy).
absl::Status WaitEvent(cudaEvent_t ev, absl::Duration spin);

// A slot's poll for its request's completion: BackendOptions::completion_spin, or 1.5x as long as the slot's
// previous request took from this wait to its end, up to kMaxSpinFactor x the option. Work about as long as
// the option (a 64-sequence decode step at 4k, ~300 us) would otherwise straddle a fixed poll and pay the
// driver's wake-up on most calls.
constexpr int kMaxSpinFactor = 4;
inline absl::Duration CompletionSpin(absl::Duration option, absl::Duration last_wait) {
  return std::min(std::max(option, last_wait * 3 / 2), option * kMaxSpinFactor);
}

// What a device's queue holds: a Forward job with the kernel selected for it, or a batch of KV sequence steps.
struct Pending {
  std::unique_ptr<ForwardJob> job;
  kernels::Selection selection;
  std::unique_ptr<StepBatch> steps;  // set instead of `job`
};

class CudaDevice;

// A stream's inline inputs, received into a pinned block laid out like the request's device block (the
// same Placement) and copied to the device in pieces while the rest is still arriving, on the device's
// upload stream. The request's worker then waits for the last piece instead of staging and copying the
// inputs itself, and takes over the blocks. Arrived runs on the stream's gRPC thread; the destructor on
// whichever thread drops the job.
class StreamedInputs final : public InputSink {
 public:
  // A piece is copied once this many of a tensor's bytes are waiting, and when the tensor is complete:
  // large enough that the API calls stay few (a 4k request's 100 MB take ~50), small enough that the copy
  // left after the last chunk (~40 us at PCIe speed) is short.
  static constexpr uint64_t kPieceBytes = 2ull << 20;

  StreamedInputs(CudaDevice* device, const Placement& pl, Block dblock, Block hblock,
                 const uint64_t (&sizes)[kTensors]);
  ~StreamedInputs() override;
  absl::Status Init();  // the events

  uint8_t* data(int tensor) override {
    return offset_[tensor] == Placement::kAbsent ? nullptr : static_cast<uint8_t*>(hblock_.ptr) + offset_[tensor];
  }
  absl::Status Arrived(int tensor, uint64_t bytes_in_place) override;

  CudaDevice* device() const { return device_; }
  const Placement& placement() const { return pl_; }
  bool complete() const { return waiting_ == 0; }
  // Recorded on the upload stream after the last piece (complete() only).
  cudaEvent_t uploaded() const { return done_; }
  // Milliseconds the last piece took: the part of the host-to-device copy not hidden behind the upload.
  float last_piece_ms() const;
  // The request has been queued: it counts in its device's load as a job from here.
  void Submitted();
  // Hands both blocks to the request's worker, which releases them after its own work on the device.
  std::pair<Block, Block> Take();

 private:
  CudaDevice* const device_;
  const Placement pl_;
  Block dblock_, hblock_;
  bool own_blocks_ = true;
  uint64_t offset_[kTensors], size_[kTensors], flushed_[kTensors] = {};
  uint64_t waiting_ = 0;  // inline bytes not yet copied
  bool copied_ = false;   // a copy was enqueued: it must finish before the blocks are reused
  bool counted_ = true;   // in the device's uploading count
  cudaEvent_t before_last_ = nullptr, done_ = nullptr;
};

// One served GPU.
class CudaDevice {
 public:
  // `queued_total`: the backend-wide count of waiting jobs, decremented when a worker takes one.
  CudaDevice(int index, const BackendOptions& options, CudaBackendHooks hooks, TensorMapCache* maps,
             std::atomic<uint32_t>* queued_total, CopyPool* copies)
      : index_(index),
        options_(options),
        hooks_(hooks),
        maps_(maps),
        queued_total_(queued_total),
        copies_(copies),
        expiry_([this](absl::Time now) { return DropExpired(now); }) {}
  ~CudaDevice();

  // Context, warm-up launches, slots, pools, warm shapes, then the workers.
  absl::Status Start(const std::vector<Shape>& warm_shapes);
  void Enqueue(Pending p);
  // Drains the queue (every job gets its `done`) and joins the workers.
  void Stop();

  int index() const { return index_; }
  const DeviceDescription& description() const { return desc_; }
  const std::vector<std::string>& kernel_names() const { return kernel_names_; }
  // A float8 configuration warmed up here: the device runs float8 e4m3 Forward requests.
  bool serves_fp8() const { return serves_fp8_; }
  uint32_t queued() const { return queued_.load(); }
  uint32_t load() const { return queued_.load() + running_.load(); }
  // What an inline request placed here now would wait behind: jobs, and streams still uploading.
  uint32_t placement_load() const { return load() + uploading_.load(); }
  // A sink for a stream's inline inputs on this device (StreamedInputs); RESOURCE_EXHAUSTED over the budget.
  absl::StatusOr<std::unique_ptr<InputSink>> OpenInputs(const Problem& problem,
                                                        const uint64_t (&sizes)[InputSink::kTensors]);
  uint32_t running() const { return running_.load(); }
  // Device memory the pool holds (in use + cached for reuse); IPC buffers belong to their callers.
  uint64_t device_bytes_held() const { return device_mem_ ? device_mem_->stats().held_bytes : 0; }
  uint64_t device_budget_bytes() const { return device_mem_ ? device_mem_->stats().budget_bytes : 0; }

  // KV sequences (sequence_runner.cc). A page pool in one block of this device's memory budget, given back when
  // the last holder drops it; RESOURCE_EXHAUSTED naming the pool when the budget cannot hold it.
  absl::StatusOr<std::shared_ptr<KvPool>> MakeKvPool(const SequenceShape& shape, int page_tokens, int32_t num_pages);

 private:
  friend class StreamedInputs;

  struct Slot {
    cudaStream_t stream = nullptr;
    cudaEvent_t ev[4] = {};  // before H2D, before kernel, after kernel, after D2H
    // ev[1] only says when the inputs arrived: with the shared compute stream the kernel may then wait
    // behind other requests' kernels, and when the inputs were on the device already (IPC, a stream's
    // pieces) the GPU reaches ev[1] at once while the host still plans the launch. This event, recorded right
    // before the launch on the stream that runs it, makes the reported kernel time the kernel's own.
    cudaEvent_t kernel_start = nullptr;
    absl::Duration last_wait;  // the previous request's wait for its completion (CompletionSpin)
    // The kernels' scratch memory (kernels::Plan::workspace_bytes), from the device budget: see SlotWorkspace.
    Block workspace;
    // The decode kernels' split partials (kernels::decode::DecodePlan::workspace_bytes): apart from `workspace`,
    // which the prefill kernels need zero, while a decode launch leaves its partials written.
    Block decode_workspace;
    // The decode kernels' split counters (DecodePlan::counter_bytes): zeroed when allocated; every launch
    // leaves them zero.
    Block decode_counters;
  };

  // A device block and a pinned block of `bytes` each, or neither.
  absl::StatusOr<std::pair<Block, Block>> AcquireBlocks(uint64_t bytes);
  void ReleaseBlocks(Block dblock, Block hblock);
  // The workspace for `plan`'s launch on `stream` by this slot: null when the plan needs none; else the slot's own,
  // grown (a fresh block, zeroed on `stream`) when the plan needs more than the slot has. Each launch leaves it
  // zero, and a slot runs one request at a time, so launches in flight never share one. The slot's earlier
  // launches must be complete when it grows (true between requests: Run returns after its work).
  absl::StatusOr<void*> SlotWorkspace(Slot& slot, const kernels::Plan& plan, cudaStream_t stream);
  // Waits for the slot's request to complete at `last` (WaitEvent), polling while the device is not busy.
  absl::Status AwaitCompletion(Slot& slot, cudaEvent_t last);
  absl::Status WarmUpKernels();
  absl::Status WarmShape(const Shape& s);
  void SlotLoop(Slot* slot);
  // QueueExpiry's sweep: answers and drops the queued Forward jobs whose deadline is at or before `now` (step
  // batches check their jobs' deadlines when they start).
  absl::Time DropExpired(absl::Time now);

  // One request while it runs on a slot: its blocks, where its tensors are, and what GPU work it has in flight.
  struct Work {
    Work(ForwardJob& j, Slot& s) : job(j), slot(s) {}
    ForwardJob& job;
    Slot& slot;
    Placement pl;
    StreamedInputs* streamed = nullptr;  // its inputs were copied to the device while they arrived
    Block dblock, hblock;
    Block v_t;  // float8: the kernels' V-transposed scratch (DeviceTensors::v_t), from the device budget
    kernels::DeviceTensors tensors;
    bool copies_in = false;   // ev[0] and ev[1] bracket a copy in (or the wait for streamed pieces)
    uint64_t out_bytes = 0;   // copied back after the kernel
    bool enqueued = false;    // GPU work may be in flight on the slot's stream: wait before freeing the blocks
    bool on_compute = false;  // the same on the shared compute stream
    uint8_t* dev() const { return static_cast<uint8_t*>(dblock.ptr); }
    uint8_t* host() const { return static_cast<uint8_t*>(hblock.ptr); }
  };
  // The request's steps, in order: its blocks and tensor addresses; its inline inputs staged in pinned memory
  // and their copy to the device enqueued; the kernel planned (tensor maps from the cache); the kernel
  // enqueued; the copy back, the wait for it, the timings and the outputs.
  absl::Status Run(Slot& slot, Pending& p);
  absl::Status TakeBlocks(Work& w);
  absl::Status StageInputs(Work& w);
  static void StageDescales(const ForwardJob& job, const Placement& pl, uint8_t* host);
  // The plan of `selection` on `tensors`, its tensor maps from the cache.
  absl::StatusOr<kernels::Plan> PlanLaunch(const kernels::Selection& selection, const kernels::DeviceTensors& tensors);
  absl::Status EnqueueKernel(const kernels::Plan& plan, Work& w);
  absl::Status CollectOutputs(Work& w);
  // Waits for the request's GPU work still in flight, then gives its blocks back.
  void Release(Work& w);

  // A batch of steps while it runs on a slot (sequence_runner.cc); RunSteps sets one status per job.
  struct StepWork;
  void RunSteps(Slot& slot, StepBatch& batch, std::vector<absl::Status>& statuses);
  absl::Status PlaceSteps(StepWork& w);
  absl::Status StageSteps(StepWork& w);
  absl::Status EnqueueSteps(StepWork& w);
  absl::Status EnqueueAttention(StepWork& w);
  struct StepLaunch;
  absl::Status PlanDecodeLaunch(StepWork& w, const kernels::decode::BatchLayout& cache, StepLaunch& l);
  absl::Status PlanPrefillLaunch(StepWork& w, const kernels::decode::BatchLayout& cache, StepLaunch& l);
  absl::Status EnqueueLaunch(StepWork& w, const StepLaunch& l, const kernels::decode::DecodeWorkspace& dws,
                             void* prefill_workspace);
  absl::Status CollectSteps(StepWork& w);
  void ReleaseSteps(StepWork& w);
  // The decode scratch of `slot` for plans of at most `partial_bytes` / `counter_bytes`, each grown when it holds
  // less (between batches, as SlotWorkspace); new counters are zeroed on `stream`.
  absl::StatusOr<kernels::decode::DecodeWorkspace> SlotDecodeWorkspace(Slot& slot, size_t partial_bytes,
                                                                       size_t counter_bytes, cudaStream_t stream);

  const int index_;
  const BackendOptions options_;
  const CudaBackendHooks hooks_;
  TensorMapCache* const maps_;
  std::atomic<uint32_t>* const queued_total_;
  CopyPool* const copies_;  // the backend's, shared by its devices
  DeviceDescription desc_;
  std::vector<std::string> kernel_names_;
  bool serves_fp8_ = false;
  // Shared with the KV pools (MakeKvPool), which the sequences core may drop after this device has stopped.
  std::shared_ptr<BlockCache> device_mem_;
  // Shared with the loans of O (ForwardJob::o_loan), which may outlive this device in a reply still being written.
  std::shared_ptr<BlockCache> pinned_mem_;
  std::vector<std::unique_ptr<Slot>> slots_;
  std::vector<std::thread> workers_;
  cudaStream_t compute_ = nullptr;  // the shared compute stream (BackendOptions::shared_compute_stream)
  cudaStream_t upload_ = nullptr;   // streamed inputs' pieces, copied as they arrive (StreamedInputs)
  // Held while one request enqueues its compute-stream work, so that no other request's work lands between
  // its kernel_start event and its launch (which would count into its kernel time).
  absl::Mutex compute_mu_;

  absl::Mutex mu_;
  std::deque<Pending> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<uint32_t> queued_{0}, running_{0};
  std::atomic<uint32_t> uploading_{0};  // streams with a sink here, not yet submitted
  std::atomic<bool> spinner_{false};  // an idle worker is polling the queue
  QueueExpiry expiry_;                 // after the queue and its counts: its sweeps change them
};

// The pages of one sequence shape in one block of a device's memory budget (layout: step.h, KvPool). The block
// goes back to the device's allocator when the last holder (the core's pool, a StepJob in flight) drops it; a
// job is dropped only after its batch's GPU work has finished.
// A float8 pool's block also holds the shape's descales, after the pages at `descales_at`: K's [layers, kv_heads],
// then V's, in fp32, which the launches read one layer's slice of.
class CudaKvPool final : public KvPool {
 public:
  CudaKvPool(const SequenceShape& shape, int page_tokens, int32_t num_pages, int device, Block block,
             uint64_t descales_at, std::shared_ptr<BlockCache> memory, std::shared_ptr<BlockCache> staging)
      : KvPool(shape, page_tokens, num_pages),
        device_(device),
        block_(block),
        descales_at_(descales_at),
        memory_(std::move(memory)),
        staging_(std::move(staging)) {}
  ~CudaKvPool() override { memory_->Release(block_); }

  int device() const { return device_; }
  uint64_t bytes() const { return block_.size; }
  // Layer `layer`'s K (kv = 0) or V (kv = 1) page pool.
  uint8_t* pool(int layer, int kv) const {
    return static_cast<uint8_t*>(block_.ptr) + static_cast<uint64_t>(pool_offset(layer, kv)) * shape().kv_bytes();
  }
  bool fp8() const { return shape().kv_format == KvFormat::kFp8E4M3; }
  // Layer `layer`'s K and V descales on the device, [kv_heads] each; null for a 16-bit pool.
  const float* k_descale(int layer) const { return descales(0, layer); }
  const float* v_descale(int layer) const { return descales(1, layer); }
  // The device's pinned staging memory, which a move's rows pass through (CopyKvRows).
  BlockCache& staging() const { return *staging_; }
  // The device's memory budget, which a same-host move's buffer comes from (ExportKvRowsOnDevice).
  const std::shared_ptr<BlockCache>& memory() const { return memory_; }

 private:
  const float* descales(int kv, int layer) const {
    if (!fp8()) return nullptr;
    const auto* all = reinterpret_cast<const float*>(static_cast<const uint8_t*>(block_.ptr) + descales_at_);
    return all + (int64_t{kv} * shape().layers + layer) * shape().kv_heads;
  }

  const int device_;
  const Block block_;
  const uint64_t descales_at_;  // float8 only
  const std::shared_ptr<BlockCache> memory_;
  const std::shared_ptr<BlockCache> staging_;
};

// A sequence shape this backend can hold in pages: layers and kv_heads >= 1, head_dim 64, 128 or 256, bf16 or fp16,
// K/V as the dtype or float8 e4m3 with a descale per layer and kv head.
absl::Status CheckKvShape(const SequenceShape& s);

// KV sequences on this backend (sequence_runner.cc): whether `job` can run on the pool's device.
absl::Status AcceptStepJob(const StepJob& job);
// The device index a pool made by CudaDevice::MakeKvPool (kv_pool.cc) lives on; -1 for any other pool.
int KvPoolDevice(const KvPool& pool);
// Such a pool's device memory (step.h's layout); null for any other pool. For tests, which poison and read it.
uint8_t* KvPoolData(const KvPool& pool);
// Backend::CopyKvRows and WriteKvRows on such a pool.
absl::Status CopyKvRows(const KvPool& pool, absl::Span<const int32_t> pages, int layer, int kv, int64_t first,
                        int64_t rows, bool to_host, uint8_t* host);
absl::Status WriteKvRows(const KvPool& pool, absl::Span<const int32_t> pages, int layer, int kv, int64_t first,
                         int64_t rows, HostPieces src);
// The exporters' pools an importer has opened (DeviceRows::from_pool), kept open between moves: opening one of
// 0.5-32 GiB takes 0.1-0.9 ms and closing it up to 0.4 ms (H100), as long as copying a sequence of 0.1-1 GB. A pool no import has used for `idle` is closed
// by a thread of its own, so the pool of an exporter that has exited is not kept allocated for long.
class PoolMappings {
 public:
  explicit PoolMappings(absl::Duration idle = absl::Seconds(2));
  ~PoolMappings();
  PoolMappings(const PoolMappings&) = delete;
  PoolMappings& operator=(const PoolMappings&) = delete;
  // The open mapping of `handle` on `device`, opened now if it is not (errors name the DeviceRows fields).
  absl::StatusOr<std::shared_ptr<IpcMapping>> Open(const std::string& handle, int device);

 private:
  struct Entry {
    std::shared_ptr<IpcMapping> mapping;
    absl::Time used;
  };
  void CloseIdle();

  const absl::Duration idle_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, Entry> open_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread closer_;  // started with the first mapping
};

// Backend::ExportKvRowsOnDevice and ImportKvRowsOnDevice on such a pool (kv_device_moves.cc); `device_uuid` is the
// pool's device's (UuidText).
absl::StatusOr<DeviceRows> ExportKvRowsOnDevice(const KvPool& pool, absl::Span<const int32_t> pages,
                                                absl::Span<const int64_t> lengths, bool share_pool,
                                                const std::string& device_uuid, std::shared_ptr<void>* hold);
absl::Status ImportKvRowsOnDevice(const KvPool& pool, absl::Span<const int32_t> pages,
                                  absl::Span<const int64_t> lengths, const std::string& device_uuid,
                                  const DeviceRows& rows, PoolMappings& pools);
// A GPU's UUID as 32 hex digits (DeviceDescription::uuid).
std::string UuidText(const cudaUUID_t& uuid);

}  // namespace attnd::server::cuda
