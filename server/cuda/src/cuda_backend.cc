// The CUDA backend: per served device a warm primary context, a pool of slots (one stream, four timing
// events and one worker thread each), optionally one compute stream that all slots' kernels share
// (BackendOptions::shared_compute_stream), caching allocators for device buffers and pinned staging bounded
// by the memory budget, and a shared tensor-map cache. A slot's worker waits for its own stream's events,
// so no gRPC thread ever waits for the GPU; `done` runs on the worker once the kernel (and the copy back)
// has finished.
#include "attnd/server/cuda_backend.h"

#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "attnd/kernels/attention.h"
#include "attnd/server/copy_pool.h"
#include "attnd/server/cuda/block_cache.h"
#include "attnd/server/cuda/ipc_registry.h"
#include "attnd/server/cuda/tensor_map_cache.h"
#include "attnd/server/status_util.h"
#include "spdlog/spdlog.h"

namespace attnd::server {
namespace {

using cuda::Block;
using cuda::BlockCache;
using cuda::Lease;
using cuda::TensorMapCache;

absl::Status CudaStatus(const char* what, cudaError_t err) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(err)));
}

double Micros(absl::Duration d) { return absl::ToDoubleMicroseconds(d); }

// A worker spins on its completion (BackendOptions::completion_spin) only while the device runs at most
// this many requests, its own included.
constexpr uint32_t kSpinWhileRunning = 2;

// Buffer placement inside a slot's device block (and, at the same offsets, its pinned staging block): the
// inline inputs first, so one H2D copy moves them all, then the outputs, so one D2H copy returns them.
struct Placement {
  static constexpr uint64_t kAbsent = ~uint64_t{0};
  uint64_t q = kAbsent, k = kAbsent, v = kAbsent, o = kAbsent, lse = kAbsent;
  uint64_t in_bytes = 0;     // [0, in_bytes): inline Q/K/V
  uint64_t out_offset = 0;   // [out_offset, total): O (when inline) and LSE
  uint64_t total = 0;
};

// TMA wants 16-byte aligned bases; 1 KiB keeps each tensor on its own cache lines and swizzle atoms.
uint64_t Align(uint64_t x) { return (x + 1023) & ~uint64_t{1023}; }

Placement Place(const Shape& s, bool q_inline, bool k_inline, bool v_inline, bool o_inline, bool lse) {
  const uint64_t qb = static_cast<uint64_t>(QElems(s)) * 2, kvb = static_cast<uint64_t>(KVElems(s)) * 2;
  Placement p;
  uint64_t at = 0;
  if (q_inline) p.q = at, at = Align(at + qb);
  if (k_inline) p.k = at, at = Align(at + kvb);
  if (v_inline) p.v = at, at = Align(at + kvb);
  p.in_bytes = at;
  p.out_offset = at;
  if (o_inline) p.o = at, at = Align(at + qb);
  if (lse) p.lse = at, at = Align(at + static_cast<uint64_t>(LseElems(s)) * sizeof(float));
  p.total = at;
  return p;
}

absl::StatusOr<std::vector<Shape>> ParseWarmShapes(const std::string& spec) {
  std::vector<Shape> out;
  for (absl::string_view item : absl::StrSplit(spec, ',', absl::SkipWhitespace())) {
    std::vector<absl::string_view> parts = absl::StrSplit(item, 'x');
    int64_t v[6];
    bool ok = parts.size() == 6;
    for (size_t i = 0; ok && i < 6; ++i) ok = absl::SimpleAtoi(parts[i], &v[i]) && v[i] >= 1;
    if (!ok || v[3] % v[4] != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "warm_shapes: '", item, "' is not batch x q_len x kv_len x q_heads x kv_heads x head_dim, e.g. 1x4096x4096x32x8x128"));
    }
    out.push_back(Shape{v[0], v[1], v[2], v[3], v[4], v[5]});
  }
  return out;
}

// Waits for `ev` (created with cudaEventBlockingSync). Polls, yielding, for up to `spin`, where a short
// kernel completes and the cost of a sleep/wake-up (tens of us) would show in the latency; then sleeps in
// the driver. The caller passes no spin when the device is busy: waiters polling a queue of GPU work only
// take cores from gRPC and the clients (seen on the H200 host: IPC at concurrency 16 kept the GPU half busy).
absl::Status WaitEvent(cudaEvent_t ev, absl::Duration spin) {
  const absl::Time until = absl::Now() + spin;
  for (;;) {
    const cudaError_t e = cudaEventQuery(ev);
    if (e == cudaSuccess) return absl::OkStatus();
    if (e != cudaErrorNotReady) return CudaStatus("the GPU work of this request failed", e);
    if (absl::Now() >= until) return CudaStatus("the GPU work of this request failed", cudaEventSynchronize(ev));
    std::this_thread::yield();
  }
}

// What Submit resolved for one job: the job, the leases on the registered buffers it names (held until the
// job is done, so they cannot be unmapped under it) and their device pointers.
struct Pending {
  std::unique_ptr<ForwardJob> job;
  std::vector<Lease> leases;  // one per distinct region, so requests_in_flight counts requests
  const uint8_t *q_ptr = nullptr, *k_ptr = nullptr, *v_ptr = nullptr;
  uint8_t* o_ptr = nullptr;
};

class CudaBackendImpl;
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
  CudaDevice(int index, const BackendOptions& options, TensorMapCache* maps, std::atomic<uint32_t>* queued_total,
             CopyPool* copies)
      : index_(index), options_(options), maps_(maps), queued_total_(queued_total), copies_(copies) {}
  ~CudaDevice();

  // Context, warm-up launches, slots, pools, warm shapes, then the workers.
  absl::Status Start(const std::vector<Shape>& warm_shapes);
  void Enqueue(Pending p);
  // Drains the queue (every job gets its `done`) and joins the workers.
  void Stop();

  int index() const { return index_; }
  const DeviceDescription& description() const { return desc_; }
  const std::vector<std::string>& kernel_names() const { return kernel_names_; }
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
    // The kernels' scratch memory (kernels::Plan::workspace_bytes), from the device budget: see SlotWorkspace.
    Block workspace;
  };

  // A device block and a pinned block of `bytes` each, or neither.
  absl::StatusOr<std::pair<Block, Block>> AcquireBlocks(uint64_t bytes);
  void ReleaseBlocks(Block dblock, Block hblock);
  // The workspace for `plan`'s launch on `stream` by this slot: null when the plan needs none; else the slot's own,
  // grown (a fresh block, zeroed on `stream`) when the plan needs more than the slot has. Each launch leaves it
  // zero, and a slot runs one request at a time, so launches in flight never share one. The slot's earlier
  // launches must be complete when it grows (true between requests: Run returns after its work).
  absl::StatusOr<void*> SlotWorkspace(Slot& slot, const kernels::Plan& plan, cudaStream_t stream);
  absl::Status WarmUpKernels();
  absl::Status WarmShape(const Shape& s);
  void SlotLoop(Slot* slot);
  absl::Status Run(Slot& slot, Pending& p);

  const int index_;
  const BackendOptions options_;
  TensorMapCache* const maps_;
  std::atomic<uint32_t>* const queued_total_;
  CopyPool* const copies_;  // the backend's, shared by its devices
  DeviceDescription desc_;
  std::vector<std::string> kernel_names_;
  std::unique_ptr<BlockCache> device_mem_;
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
};

CudaDevice::~CudaDevice() {
  Stop();
  cudaSetDevice(index_);
  for (auto& s : slots_) {
    if (s->workspace.ptr != nullptr && device_mem_) device_mem_->Release(s->workspace);
    for (cudaEvent_t e : s->ev) {
      if (e) cudaEventDestroy(e);
    }
    if (s->kernel_start) cudaEventDestroy(s->kernel_start);
    if (s->stream) cudaStreamDestroy(s->stream);
  }
  if (compute_) cudaStreamDestroy(compute_);
  if (upload_) cudaStreamDestroy(upload_);
}

absl::Status CudaDevice::Start(const std::vector<Shape>& warm_shapes) {
  const absl::Time t0 = absl::Now();
  ATTND_RETURN_IF_ERROR(CudaStatus("cudaSetDevice", cudaSetDevice(index_)));
  // The primary context is created here, not by the first request.
  ATTND_RETURN_IF_ERROR(CudaStatus("creating the CUDA context", cudaFree(nullptr)));
  cudaDeviceProp prop{};
  ATTND_RETURN_IF_ERROR(CudaStatus("cudaGetDeviceProperties", cudaGetDeviceProperties(&prop, index_)));
  desc_ = DeviceDescription{index_, prop.name, prop.major, prop.minor, static_cast<uint64_t>(prop.totalGlobalMem),
                            prop.multiProcessorCount};

  size_t free_bytes = 0, total_bytes = 0;
  ATTND_RETURN_IF_ERROR(CudaStatus("cudaMemGetInfo", cudaMemGetInfo(&free_bytes, &total_bytes)));
  const uint64_t budget = options_.memory_budget_bytes ? options_.memory_budget_bytes : free_bytes / 10 * 8;
  // Pinned staging is host RAM locked for DMA: never more than a quarter of the machine's memory.
  const uint64_t host_ram = static_cast<uint64_t>(sysconf(_SC_PHYS_PAGES)) * static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t pinned_budget = std::min<uint64_t>(budget, host_ram / 4);
  const int dev = index_;
  device_mem_ = std::make_unique<BlockCache>(
      cuda::RawAllocator{"device memory",
                         [dev](uint64_t n) -> absl::StatusOr<void*> {
                           void* p = nullptr;
                           cudaSetDevice(dev);
                           const cudaError_t e = cudaMalloc(&p, n);
                           if (e != cudaSuccess) {
                             cudaGetLastError();
                             return CudaStatus("cudaMalloc", e);
                           }
                           return p;
                         },
                         [dev](void* p) {
                           cudaSetDevice(dev);
                           cudaFree(p);
                         }},
      budget);
  pinned_mem_ = std::make_shared<BlockCache>(
      cuda::RawAllocator{"pinned host memory",
                         [](uint64_t n) -> absl::StatusOr<void*> {
                           void* p = nullptr;
                           const cudaError_t e = cudaMallocHost(&p, n);
                           if (e != cudaSuccess) {
                             cudaGetLastError();
                             return CudaStatus("cudaMallocHost", e);
                           }
                           return p;
                         },
                         [](void* p) { cudaFreeHost(p); }},
      pinned_budget);

  if (options_.shared_compute_stream) {
    // Non-blocking like the slot streams: the legacy default stream must not serialise it with them.
    ATTND_RETURN_IF_ERROR(
        CudaStatus("cudaStreamCreate (compute)", cudaStreamCreateWithFlags(&compute_, cudaStreamNonBlocking)));
  }
  ATTND_RETURN_IF_ERROR(
      CudaStatus("cudaStreamCreate (upload)", cudaStreamCreateWithFlags(&upload_, cudaStreamNonBlocking)));
  for (int i = 0; i < options_.streams_per_device; ++i) {
    auto slot = std::make_unique<Slot>();
    ATTND_RETURN_IF_ERROR(
        CudaStatus("cudaStreamCreate", cudaStreamCreateWithFlags(&slot->stream, cudaStreamNonBlocking)));
    for (cudaEvent_t& e : slot->ev) {
      ATTND_RETURN_IF_ERROR(CudaStatus("cudaEventCreate", cudaEventCreateWithFlags(&e, cudaEventBlockingSync)));
    }
    // Only read for the timing, never waited on by the host: no blocking-sync flag needed.
    ATTND_RETURN_IF_ERROR(CudaStatus("cudaEventCreate", cudaEventCreate(&slot->kernel_start)));
    slots_.push_back(std::move(slot));
  }
  ATTND_RETURN_IF_ERROR(WarmUpKernels());
  for (const Shape& s : warm_shapes) ATTND_RETURN_IF_ERROR(WarmShape(s));

  for (auto& s : slots_) workers_.emplace_back([this, slot = s.get()] { SlotLoop(slot); });
  spdlog::info("cuda device {} ({}, sm_{}{}, {} SMs): ready in {:.0f} ms; {} streams, {}, budget {} MiB device / "
               "{} MiB pinned, {} warm shapes, {} staging copy helpers (shared by the devices)",
               index_, desc_.name, desc_.cc_major, desc_.cc_minor, desc_.multiprocessor_count,
               absl::ToDoubleMilliseconds(absl::Now() - t0), slots_.size(),
               compute_ ? "kernels on one shared compute stream" : "kernels on each stream", budget >> 20,
               pinned_budget >> 20, warm_shapes.size(), copies_->threads());
  return absl::OkStatus();
}

// One launch of every configuration this device runs, in both dtypes: loads the module, sets the shared-
// memory attributes and pays every first-launch cost before the first request.
absl::Status CudaDevice::WarmUpKernels() {
  absl::StatusOr<std::vector<kernels::ConfigInfo>> configs = kernels::ConfigsForDevice(index_);
  if (!configs.ok()) return configs.status();
  const Shape s{1, 128, 128, 1, 1, 256};
  const uint64_t bytes = static_cast<uint64_t>(QElems(s)) * 2;
  void* buf = nullptr;
  ATTND_RETURN_IF_ERROR(CudaStatus("cudaMalloc (warm-up)", cudaMalloc(&buf, 4 * bytes + 4096)));
  ATTND_RETURN_IF_ERROR(CudaStatus("cudaMemset (warm-up)", cudaMemset(buf, 0, 4 * bytes + 4096)));
  uint8_t* base = static_cast<uint8_t*>(buf);
  absl::Status status;
  for (const kernels::ConfigInfo& c : *configs) {
    bool usable = true;
    for (DType dt : {DType::kBF16, DType::kFP16}) {
      Problem p;
      p.shape = s;
      p.shape.head_dim = c.head_dim;
      p.dtype = dt;
      p.scale = DefaultScale(c.head_dim);
      p.want_lse = true;
      kernels::DeviceTensors t{base, base + bytes, base + 2 * bytes, base + 3 * bytes,
                               reinterpret_cast<float*>(base + 4 * bytes)};
      kernels::PlanOptions po;
      po.config = c.name;
      po.device = index_;
      absl::StatusOr<kernels::Plan> plan = kernels::MakePlan(p, ContiguousLayout(p.shape), t, po);
      if (!plan.ok()) {
        // A configuration the library lists but cannot plan (a family not built yet) is left out, not fatal.
        spdlog::warn("device {}: warm-up skips {} ({}): {}", index_, c.name, DTypeName(dt),
                     std::string(plan.status().message()));
        usable = false;
        break;
      }
      absl::StatusOr<void*> workspace = SlotWorkspace(*slots_[0], *plan, slots_[0]->stream);
      status = workspace.ok() ? kernels::Launch(*plan, *workspace, slots_[0]->stream) : workspace.status();
      if (!status.ok()) break;
    }
    if (!status.ok()) break;
    if (usable) kernel_names_.push_back(c.name);
  }
  if (status.ok()) status = CudaStatus("warm-up launches", cudaStreamSynchronize(slots_[0]->stream));
  cudaFree(buf);
  if (!status.ok()) return absl::InternalError(absl::StrCat("device ", index_, " warm-up: ", status.message()));
  return absl::OkStatus();
}

// Pre-allocates one block set per slot for shape `s` (LSE included, so requests with or without LSE reuse
// it) and pre-encodes the tensor maps the kernel will use on those blocks, in both dtypes.
absl::Status CudaDevice::WarmShape(const Shape& s) {
  const Placement pl = Place(s, true, true, true, true, true);
  std::vector<std::pair<Block, Block>> held;
  absl::Status status;
  for (size_t i = 0; i < slots_.size() && status.ok(); ++i) {
    absl::StatusOr<std::pair<Block, Block>> blocks = AcquireBlocks(pl.total);
    if (!blocks.ok()) {
      status = blocks.status();
      break;
    }
    held.push_back(*blocks);
    uint8_t* base = static_cast<uint8_t*>(blocks->first.ptr);
    for (DType dt : {DType::kBF16, DType::kFP16}) {
      Problem p;
      p.shape = s;
      p.dtype = dt;
      p.scale = DefaultScale(s.head_dim);
      kernels::PlanOptions po;
      po.device = index_;
      absl::StatusOr<kernels::Selection> sel = kernels::Select(p, ContiguousLayout(s), po);
      if (!sel.ok()) {
        status = sel.status();
        break;
      }
      kernels::DeviceTensors t{base + pl.q, base + pl.k, base + pl.v, base + pl.o, nullptr};
      absl::StatusOr<kernels::TensorMapKeys> keys = kernels::MapKeys(*sel, t);
      if (!keys.ok()) {
        status = keys.status();
        break;
      }
      for (const kernels::TensorMapKey* k : {&keys->q, &keys->k, &keys->v}) {
        if (absl::StatusOr<CUtensorMap> m = maps_->Get(*k); !m.ok()) status = m.status();
      }
      if (keys->has_o) {
        if (absl::StatusOr<CUtensorMap> m = maps_->Get(keys->o); !m.ok()) status = m.status();
      }
    }
  }
  for (auto& [d, h] : held) ReleaseBlocks(d, h);
  if (!status.ok()) {
    return absl::Status(status.code(), absl::StrCat("warm_shapes: ", s.batch, "x", s.q_len, "x", s.kv_len, "x",
                                                    s.q_heads, "x", s.kv_heads, "x", s.head_dim, " on device ",
                                                    index_, ": ", status.message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<void*> CudaDevice::SlotWorkspace(Slot& slot, const kernels::Plan& plan, cudaStream_t stream) {
  if (plan.workspace_bytes == 0) return nullptr;
  if (slot.workspace.size < plan.workspace_bytes) {
    device_mem_->Release(slot.workspace);
    slot.workspace = Block{};
    absl::StatusOr<Block> b = device_mem_->Acquire(plan.workspace_bytes);
    if (!b.ok()) return b.status();
    slot.workspace = *b;
    // The whole block, so that a later plan needing more of it (up to its size) finds it zero too.
    ATTND_RETURN_IF_ERROR(CudaStatus("zeroing the kernel workspace",
                                     cudaMemsetAsync(slot.workspace.ptr, 0, slot.workspace.size, stream)));
  }
  return slot.workspace.ptr;
}

absl::StatusOr<std::pair<Block, Block>> CudaDevice::AcquireBlocks(uint64_t bytes) {
  absl::StatusOr<Block> d = device_mem_->Acquire(bytes);
  if (!d.ok()) return d.status();
  absl::StatusOr<Block> h = pinned_mem_->Acquire(bytes);
  if (!h.ok()) {
    device_mem_->Release(*d);
    return h.status();
  }
  return std::make_pair(*d, *h);
}

void CudaDevice::ReleaseBlocks(Block dblock, Block hblock) {
  if (dblock.ptr != nullptr) device_mem_->Release(dblock);
  if (hblock.ptr != nullptr) pinned_mem_->Release(hblock);
}

absl::StatusOr<std::unique_ptr<InputSink>> CudaDevice::OpenInputs(const Problem& problem,
                                                                  const uint64_t (&sizes)[InputSink::kTensors]) {
  // Laid out as Run places an all-inline request, so the worker uses the blocks as they are.
  const Placement pl = Place(problem.shape, true, true, true, true, problem.want_lse);
  const uint64_t qb = static_cast<uint64_t>(QElems(problem.shape)) * 2;
  const uint64_t kvb = static_cast<uint64_t>(KVElems(problem.shape)) * 2;
  if (sizes[0] != qb || sizes[1] != kvb || sizes[2] != kvb) {
    return absl::InternalError("stream inputs: sizes do not match the validated shape");
  }
  absl::StatusOr<std::pair<Block, Block>> blocks = AcquireBlocks(pl.total);
  if (!blocks.ok()) return blocks.status();
  uploading_.fetch_add(1);
  auto sink = std::make_unique<StreamedInputs>(this, pl, blocks->first, blocks->second, sizes);
  ATTND_RETURN_IF_ERROR(sink->Init());
  return std::unique_ptr<InputSink>(std::move(sink));
}

StreamedInputs::StreamedInputs(CudaDevice* device, const Placement& pl, Block dblock, Block hblock,
                               const uint64_t (&sizes)[kTensors])
    : device_(device), pl_(pl), dblock_(dblock), hblock_(hblock), offset_{pl.q, pl.k, pl.v} {
  for (int i = 0; i < kTensors; ++i) {
    size_[i] = sizes[i];
    waiting_ += sizes[i];
  }
}

absl::Status StreamedInputs::Init() {
  ATTND_RETURN_IF_ERROR(CudaStatus("cudaSetDevice", cudaSetDevice(device_->index())));
  ATTND_RETURN_IF_ERROR(CudaStatus("cudaEventCreate", cudaEventCreate(&before_last_)));
  return CudaStatus("cudaEventCreate", cudaEventCreate(&done_));
}

StreamedInputs::~StreamedInputs() {
  if (counted_) device_->uploading_.fetch_sub(1);
  cudaSetDevice(device_->index());
  if (own_blocks_) {
    // The stream ended early or the job never ran: pieces may still be in flight into these blocks. Rare,
    // so the whole upload stream is waited for (it needs no event that may not have been recorded).
    if (copied_) cudaStreamSynchronize(device_->upload_);
    device_->ReleaseBlocks(dblock_, hblock_);
  }
  if (before_last_) cudaEventDestroy(before_last_);
  if (done_) cudaEventDestroy(done_);
}

absl::Status StreamedInputs::Arrived(int tensor, uint64_t bytes_in_place) {
  if (offset_[tensor] == Placement::kAbsent || bytes_in_place > size_[tensor]) {
    return absl::InternalError("stream inputs: bytes reported past the tensor");
  }
  const uint64_t pending = bytes_in_place - flushed_[tensor];
  if (pending == 0 || (pending < kPieceBytes && bytes_in_place < size_[tensor])) return absl::OkStatus();
  const bool last = pending == waiting_;
  ATTND_RETURN_IF_ERROR(CudaStatus("cudaSetDevice", cudaSetDevice(device_->index())));
  cudaStream_t up = device_->upload_;
  if (last) ATTND_RETURN_IF_ERROR(CudaStatus("cudaEventRecord", cudaEventRecord(before_last_, up)));
  const uint64_t at = offset_[tensor] + flushed_[tensor];
  copied_ = true;
  ATTND_RETURN_IF_ERROR(CudaStatus("H2D copy (stream piece)",
                                   cudaMemcpyAsync(static_cast<uint8_t*>(dblock_.ptr) + at,
                                                   static_cast<uint8_t*>(hblock_.ptr) + at, pending,
                                                   cudaMemcpyHostToDevice, up)));
  ATTND_RETURN_IF_ERROR(CudaStatus("cudaEventRecord", cudaEventRecord(done_, up)));
  flushed_[tensor] = bytes_in_place;
  waiting_ -= pending;
  return absl::OkStatus();
}

float StreamedInputs::last_piece_ms() const {
  float ms = 0;
  cudaEventElapsedTime(&ms, before_last_, done_);
  return ms;
}

void StreamedInputs::Submitted() {
  if (counted_) device_->uploading_.fetch_sub(1);
  counted_ = false;
}

std::pair<Block, Block> StreamedInputs::Take() {
  own_blocks_ = false;
  return {dblock_, hblock_};
}

void CudaDevice::Enqueue(Pending p) {
  absl::MutexLock lock(&mu_);
  queue_.push_back(std::move(p));
  queued_.fetch_add(1);
}

void CudaDevice::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& w : workers_) {
    if (w.joinable()) w.join();
  }
}

void CudaDevice::SlotLoop(Slot* slot) {
  cudaSetDevice(index_);
  for (;;) {
    Pending p;
    // One idle worker at a time polls the queue for a moment before sleeping on the mutex: a request that
    // arrives right after the previous one finished (a closed-loop caller) starts without a wake-up.
    bool expected = false;
    if (queued_.load(std::memory_order_relaxed) == 0 && spinner_.compare_exchange_strong(expected, true)) {
      const absl::Time until = absl::Now() + absl::Milliseconds(1);
      while (queued_.load(std::memory_order_relaxed) == 0 && absl::Now() < until) std::this_thread::yield();
      spinner_.store(false);
    }
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](CudaDevice* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) {
            return !self->queue_.empty() || self->stopping_;
          },
          this));
      if (queue_.empty()) return;  // stopping, and every accepted job has been taken
      p = std::move(queue_.front());
      queue_.pop_front();
      running_.fetch_add(1);
      queued_.fetch_sub(1);
      queued_total_->fetch_sub(1);
    }
    const absl::Status status = Run(*slot, p);
    // The leases go before the reply, so a client that unregisters right after its reply finds the buffer
    // idle.
    p.leases.clear();
    // Finished before the reply goes out, as in the CPU backend: a client that reads the stats right after its
    // reply must not find its own request still in flight.
    running_.fetch_sub(1);
    p.job->done(status);
    p.job.reset();
  }
}

absl::Status CudaDevice::Run(Slot& slot, Pending& p) {
  ForwardJob& job = *p.job;
  const absl::Time start = absl::Now();
  job.timing.queue_us = Micros(start - job.accepted);
  job.device = index_;
  if (job.cancelled && job.cancelled()) {
    return absl::CancelledError("the call was cancelled before its computation started");
  }
  if (start >= job.deadline) {
    return absl::DeadlineExceededError(absl::StrCat("the deadline expired after ", Micros(start - job.accepted),
                                                    " us in the queue; the computation was not started"));
  }
  const Problem& pr = job.problem;
  const Shape& s = pr.shape;
  const Layout layout{job.q.strides, job.k.strides, job.v.strides,
                      job.o_to_buffer ? job.o_ref.strides : ContiguousStrides(s.q_len, s.q_heads, s.head_dim)};
  kernels::PlanOptions po;
  po.device = index_;
  absl::StatusOr<kernels::Selection> sel = kernels::Select(pr, layout, po);
  if (!sel.ok()) return sel.status();
  job.kernel = sel->info().name;

  const bool qi = p.q_ptr == nullptr, ki = p.k_ptr == nullptr, vi = p.v_ptr == nullptr, oi = !job.o_to_buffer;
  const Placement pl = Place(s, qi, ki, vi, oi, pr.want_lse);
  // A stream whose inputs were copied here while they arrived: its blocks already hold them on both sides.
  StreamedInputs* streamed = dynamic_cast<StreamedInputs*>(job.inputs.get());
  if (streamed != nullptr && (streamed->device() != this || !streamed->complete() ||
                              streamed->placement().total != pl.total)) {
    streamed = nullptr;  // cannot happen (Submit routes it here, complete); staged from its host bytes
  }
  Block dblock, hblock;
  if (streamed != nullptr) {
    std::tie(dblock, hblock) = streamed->Take();
  } else if (pl.total > 0) {
    absl::StatusOr<std::pair<Block, Block>> blocks = AcquireBlocks(pl.total);
    if (!blocks.ok()) return blocks.status();
    std::tie(dblock, hblock) = *blocks;
  }
  uint8_t* dev = static_cast<uint8_t*>(dblock.ptr);
  uint8_t* host = static_cast<uint8_t*>(hblock.ptr);
  const bool shared = compute_ != nullptr;
  bool enqueued = false;  // GPU work may be in flight on this slot's stream: wait before freeing the blocks
  bool on_compute = false;  // the same on the shared compute stream
  auto release = [&] {
    // An error may leave this request's memset or kernel queued on the compute stream, still writing the
    // blocks. Synchronising the whole stream waits for other requests' kernels as well, but it needs no
    // further call to succeed (recording ev[2] after a failed launch for the slot stream to wait on may
    // fail too, and a wait on a stale record would free the blocks early), and errors are rare.
    if (on_compute) cudaStreamSynchronize(compute_);
    if (enqueued) cudaStreamSynchronize(slot.stream);
    ReleaseBlocks(dblock, hblock);
  };

  kernels::DeviceTensors t;
  t.q = qi ? dev + pl.q : p.q_ptr;
  t.k = ki ? dev + pl.k : p.k_ptr;
  t.v = vi ? dev + pl.v : p.v_ptr;
  t.o = oi ? dev + pl.o : p.o_ptr;
  t.lse = pr.want_lse ? reinterpret_cast<float*>(dev + pl.lse) : nullptr;
  // Staging: the request's bytes into pinned memory, so the H2D copy runs at full DMA speed and async.
  if (streamed == nullptr) {
    std::vector<CopyPool::Part> parts;
    const auto stage = [&parts](const TensorSource& src, uint8_t* dst) {
      ForEachInlineRun(src, [&](const uint8_t* data, uint64_t size) {
        parts.push_back({dst, data, size});
        dst += size;
      });
    };
    if (qi) stage(job.q, host + pl.q);
    if (ki) stage(job.k, host + pl.k);
    if (vi) stage(job.v, host + pl.v);
    copies_->Copy(parts);
  }

  absl::Status status;
  cudaStream_t st = slot.stream;
  // The copy events are recorded only around copies (and ev[1] always on the shared compute stream's path, which
  // waits on it): a request on registered buffers alone (CUDA IPC) then makes 2 event records besides its launch
  // instead of 5, host time spent between its arrival and its kernel.
  const bool copies_in = streamed != nullptr || pl.in_bytes > 0;
  const uint64_t out_bytes = pl.total - pl.out_offset;
  if (copies_in) status = CudaStatus("cudaEventRecord", cudaEventRecord(slot.ev[0], st));
  if (status.ok() && streamed != nullptr) {
    enqueued = true;
    status = CudaStatus("cudaStreamWaitEvent (streamed inputs)", cudaStreamWaitEvent(st, streamed->uploaded(), 0));
  } else if (status.ok() && pl.in_bytes > 0) {
    enqueued = true;
    status = CudaStatus("H2D copy", cudaMemcpyAsync(dev, host, pl.in_bytes, cudaMemcpyHostToDevice, st));
  }
  if (status.ok() && (copies_in || shared)) status = CudaStatus("cudaEventRecord", cudaEventRecord(slot.ev[1], st));
  if (status.ok() && !shared && options_.poison_outputs && pl.total > pl.out_offset) {
    // Test mode: NaN-fill the outputs so that a launch that writes nothing cannot pass on stale results.
    status = CudaStatus("poison", cudaMemsetAsync(dev + pl.out_offset, 0xFF, pl.total - pl.out_offset, st));
  }
  absl::StatusOr<kernels::TensorMapKeys> keys;
  if (status.ok()) {
    keys = kernels::MapKeys(*sel, t);
    if (!keys.ok()) status = keys.status();
  }
  absl::StatusOr<CUtensorMap> qm, km, vm, om;
  if (status.ok()) {
    qm = maps_->Get(keys->q);
    km = maps_->Get(keys->k);
    vm = maps_->Get(keys->v);
    if (keys->has_o) om = maps_->Get(keys->o);  // configurations that store O through a tensor map
    for (const auto* m : {&qm, &km, &vm}) {
      if (status.ok() && !m->ok()) status = m->status();
    }
    if (status.ok() && keys->has_o && !om.ok()) status = om.status();
  }
  absl::StatusOr<kernels::Plan> plan;
  if (status.ok()) {
    plan = kernels::MakePlanFromMaps(*sel, t, *qm, *km, *vm, keys->has_o ? &*om : nullptr);
    if (!plan.ok()) status = plan.status();
  }
  absl::StatusOr<void*> workspace;
  if (!shared) {
    if (status.ok()) {
      enqueued = true;
      workspace = SlotWorkspace(slot, *plan, st);
      if (!workspace.ok()) status = workspace.status();
    }
    if (status.ok()) status = CudaStatus("cudaEventRecord", cudaEventRecord(slot.kernel_start, st));
    if (status.ok()) status = kernels::Launch(*plan, *workspace, st);
    if (status.ok()) status = CudaStatus("cudaEventRecord", cudaEventRecord(slot.ev[2], st));
  } else {
    if (status.ok()) {
      on_compute = true;
      // Enqueued together, after the host-side planning, so that the lock is held for a few API calls only.
      absl::MutexLock lock(&compute_mu_);
      status = CudaStatus("cudaStreamWaitEvent (inputs)", cudaStreamWaitEvent(compute_, slot.ev[1], 0));
      if (status.ok() && options_.poison_outputs && pl.total > pl.out_offset) {
        // Test mode, as above; on the compute stream, so that it lands before this launch without another
        // cross-stream dependency.
        status = CudaStatus("poison", cudaMemsetAsync(dev + pl.out_offset, 0xFF, pl.total - pl.out_offset, compute_));
      }
      if (status.ok()) {
        workspace = SlotWorkspace(slot, *plan, compute_);
        if (!workspace.ok()) status = workspace.status();
      }
      if (status.ok()) status = CudaStatus("cudaEventRecord", cudaEventRecord(slot.kernel_start, compute_));
      if (status.ok()) status = kernels::Launch(*plan, *workspace, compute_);
      if (status.ok()) status = CudaStatus("cudaEventRecord", cudaEventRecord(slot.ev[2], compute_));
    }
    if (status.ok()) {
      // From here the slot stream holds this request's last work (the copy back, behind the kernel), also
      // when nothing was copied in.
      enqueued = true;
      status = CudaStatus("cudaStreamWaitEvent (kernel)", cudaStreamWaitEvent(st, slot.ev[2], 0));
    }
  }
  if (status.ok() && out_bytes > 0) {
    status = CudaStatus("D2H copy", cudaMemcpyAsync(host + pl.out_offset, dev + pl.out_offset, out_bytes,
                                                    cudaMemcpyDeviceToHost, st));
  }
  // The request's last work: the copy back, or with nothing to copy (and the kernel on this stream) the kernel.
  const bool after_kernel = out_bytes == 0 && !shared;
  cudaEvent_t last = after_kernel ? slot.ev[2] : slot.ev[3];
  if (status.ok() && !after_kernel) status = CudaStatus("cudaEventRecord", cudaEventRecord(slot.ev[3], st));
  // Spin only while this request has the GPU (nearly) to itself; behind others it would poll a queue.
  if (status.ok()) {
    status = WaitEvent(last, running_.load(std::memory_order_relaxed) <= kSpinWhileRunning
                                       ? options_.completion_spin
                                       : absl::ZeroDuration());
  }
  if (!status.ok()) {
    release();
    if (absl::IsInternal(status)) spdlog::error("device {}: request '{}': {}", index_, job.request_id, std::string(status.message()));
    return status;
  }
  float h2d = 0, kernel = 0, d2h = 0;
  if (copies_in) cudaEventElapsedTime(&h2d, slot.ev[0], slot.ev[1]);
  cudaEventElapsedTime(&kernel, slot.kernel_start, slot.ev[2]);
  if (out_bytes > 0) cudaEventElapsedTime(&d2h, slot.ev[2], slot.ev[3]);
  // Back-to-back events still read a few nanoseconds apart: report exactly 0 when nothing was copied.
  // Streamed inputs: only their last piece's copy, the rest ran while the upload went on.
  if (streamed != nullptr) h2d = streamed->last_piece_ms();
  job.timing.h2d_us = pl.in_bytes > 0 ? h2d * 1e3 : 0;
  job.timing.kernel_us = kernel * 1e3;
  job.timing.d2h_us = out_bytes > 0 ? d2h * 1e3 : 0;
  if (oi && job.accepts_lent_o) {
    // O stays in the pinned block, lent to the caller, which copies it on (ForwardStream: into its chunks); the
    // block goes back to the cache when the loan is dropped. No copy into `o` and no zero-fill of a fresh string
    // first (~4.9 ms of a 4k stream's 5.9 ms after its last byte, H200, session 9).
    job.o_lent = std::string_view(reinterpret_cast<const char*>(host + pl.o), static_cast<uint64_t>(QElems(s)) * 2);
    job.o_loan = std::shared_ptr<const void>(host, [cache = pinned_mem_, lent = hblock](const void*) { cache->Release(lent); });
    hblock = Block{};  // release() below keeps its hands off it
  } else if (oi) {
    job.o.resize(static_cast<uint64_t>(QElems(s)) * 2);
    const CopyPool::Part out{reinterpret_cast<uint8_t*>(job.o.data()), host + pl.o, job.o.size()};
    copies_->Copy({&out, 1});
  }
  if (pr.want_lse) {
    job.lse.assign(reinterpret_cast<const char*>(host + pl.lse), static_cast<uint64_t>(LseElems(s)) * sizeof(float));
  }
  enqueued = false;  // the stream is idle: `last` was the last work on it
  // This request's compute-stream work is done too (the slot stream waited for ev[2] before ev[3]); a
  // synchronisation here would wait for other requests' kernels.
  on_compute = false;
  release();
  job.timing.total_us = Micros(absl::Now() - job.accepted);
  return absl::OkStatus();
}

class CudaBackendImpl final : public Backend {
 public:
  CudaBackendImpl(const BackendOptions& options, std::vector<int> devices)
      : options_(options),
        copies_(options.copy_threads >= 0 ? options.copy_threads : DefaultCopyThreads()),
        maps_(options.tensor_map_cache_entries),
        registry_(devices) {}
  ~CudaBackendImpl() override {
    Shutdown();
    devices_.clear();  // before the registry: workers are gone, leases released
  }

  absl::Status Start(const std::vector<int>& devices) {
    absl::StatusOr<std::vector<Shape>> warm = ParseWarmShapes(options_.warm_shapes);
    if (!warm.ok()) return warm.status();
    for (int d : devices) {
      auto dev = std::make_unique<CudaDevice>(d, options_, &maps_, &queued_total_, &copies_);
      ATTND_RETURN_IF_ERROR(dev->Start(*warm));
      devices_.push_back(std::move(dev));
    }
    return absl::OkStatus();
  }

  std::string name() const override { return "cuda"; }
  std::vector<DeviceDescription> devices() const override {
    std::vector<DeviceDescription> out;
    for (const auto& d : devices_) out.push_back(d->description());
    return out;
  }
  std::vector<int64_t> supported_head_dims() const override { return {64, 128, 256}; }
  std::vector<DType> supported_dtypes() const override { return {DType::kBF16, DType::kFP16}; }
  std::vector<std::string> kernels() const override {
    std::vector<std::string> out;
    for (const auto& d : devices_) {
      for (const std::string& k : d->kernel_names()) {
        if (std::find(out.begin(), out.end(), k) == out.end()) out.push_back(k);
      }
    }
    return out;
  }

  absl::Status CheckSupported(const ForwardJob& job) const override {
    const bool refs = !job.q.buffer_id.empty() || !job.k.buffer_id.empty() || !job.v.buffer_id.empty() ||
                      job.o_to_buffer;
    if (refs && !options_.enable_cuda_ipc) {
      return absl::FailedPreconditionError(
          "ref: tensor references need CUDA IPC, which this server does not enable (start attnd with "
          "--enable_cuda_ipc)");
    }
    // The kernel's own layout rules (strides in 16-byte units, limits), checked before the job is queued.
    const Shape& s = job.problem.shape;
    const Layout layout{job.q.strides, job.k.strides, job.v.strides,
                        job.o_to_buffer ? job.o_ref.strides : ContiguousStrides(s.q_len, s.q_heads, s.head_dim)};
    kernels::PlanOptions po;
    po.device = devices_.front()->index();
    absl::StatusOr<kernels::Selection> sel = kernels::Select(job.problem, layout, po);
    return sel.status();
  }

  absl::Status Submit(std::unique_ptr<ForwardJob> job) override {
    // Held shared until the job is enqueued: Shutdown cannot stop the workers between the check and the
    // enqueue, so an accepted job is always drained.
    absl::ReaderMutexLock lock(&submit_mu_);
    if (stopping_) return absl::UnavailableError("the server is shutting down");
    Pending p;
    int ref_device = -1;
    const Shape& s = job->problem.shape;
    struct RefUse {
      const char* field;
      const TensorSource* src;
      int64_t seq, heads;
      uint8_t* ptr = nullptr;
    } uses[4] = {{"q.ref", &job->q, s.q_len, s.q_heads},
                 {"k.ref", &job->k, s.kv_len, s.kv_heads},
                 {"v.ref", &job->v, s.kv_len, s.kv_heads},
                 {"o_ref", &job->o_ref, s.q_len, s.q_heads}};
    for (int i = 0; i < 4; ++i) {
      RefUse& u = uses[i];
      if (i < 3 ? u.src->buffer_id.empty() : !job->o_to_buffer) continue;
      if (!options_.enable_cuda_ipc) {
        return absl::FailedPreconditionError(absl::StrCat(u.field, ": CUDA IPC is not enabled (--enable_cuda_ipc)"));
      }
      const cuda::IpcRegion* r = nullptr;
      for (const Lease& held : p.leases) {
        if (held->id == u.src->buffer_id) r = held.operator->();
      }
      if (r == nullptr) {
        absl::StatusOr<Lease> lease = registry_.Acquire(u.field, u.src->buffer_id);
        if (!lease.ok()) return lease.status();
        p.leases.push_back(std::move(*lease));
        r = p.leases.back().operator->();
      }
      if (ref_device >= 0 && r->device != ref_device) {
        return absl::InvalidArgumentError(absl::StrCat(u.field, ".buffer_id: on device ", r->device,
                                                       ", but the request's other buffers are on device ",
                                                       ref_device, " (one request runs on one GPU)"));
      }
      ref_device = r->device;
      absl::StatusOr<uint64_t> span =
          cuda::TensorSpanBytes(u.field, s.batch, u.seq, u.heads, s.head_dim, u.src->strides, DTypeBytes(job->problem.dtype));
      if (!span.ok()) return span.status();
      ATTND_RETURN_IF_ERROR(cuda::CheckInRegion(absl::StrCat(u.field, ".offset"), u.src->offset, *span, r->byte_size));
      u.ptr = r->data() + u.src->offset;
      if (reinterpret_cast<uintptr_t>(u.ptr) % 16 != 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            u.field, ".offset: the tensor starts at a device address that is not 16-byte aligned (the "
                     "registration's offset plus this offset must be a multiple of 16)"));
      }
    }
    p.q_ptr = uses[0].ptr;
    p.k_ptr = uses[1].ptr;
    p.v_ptr = uses[2].ptr;
    p.o_ptr = uses[3].ptr;

    CudaDevice* target = nullptr;
    StreamedInputs* streamed = dynamic_cast<StreamedInputs*>(job->inputs.get());
    if (streamed != nullptr) {
      target = streamed->device();  // its inputs are there already (it has no references)
    } else if (ref_device >= 0) {
      for (const auto& d : devices_) {
        if (d->index() == ref_device) target = d.get();
      }
    } else {
      target = PickInlineDevice();
    }
    if (target == nullptr) return absl::InternalError("no device to run on");
    // Bound the waiting jobs across devices; the check and the increment are one step so that concurrent
    // submitters cannot overshoot.
    uint32_t q = queued_total_.load();
    do {
      if (q >= options_.max_queue) {
        return absl::ResourceExhaustedError(absl::StrCat("queue full: ", q, " requests waiting (--max_queue=",
                                                         options_.max_queue, ")"));
      }
    } while (!queued_total_.compare_exchange_weak(q, q + 1));
    if (streamed != nullptr) streamed->Submitted();
    p.job = std::move(job);
    target->Enqueue(std::move(p));
    return absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<InputSink>> OpenInputs(const ForwardJob& job,
                                                        const uint64_t (&sizes)[InputSink::kTensors]) override {
    // A request that also names registered buffers runs where they are, and its inline inputs are staged
    // when it runs, like a unary request's.
    const bool all_inline = sizes[0] > 0 && sizes[1] > 0 && sizes[2] > 0 && !job.o_to_buffer;
    if (!options_.stream_to_device || !all_inline) return Backend::OpenInputs(job, sizes);
    absl::ReaderMutexLock lock(&submit_mu_);
    if (stopping_) return absl::UnavailableError("the server is shutting down");
    return PickInlineDevice()->OpenInputs(job.problem, sizes);
  }

  uint32_t queue_depth() const override {
    uint32_t n = 0;
    for (const auto& d : devices_) n += d->queued();
    return n;
  }
  uint32_t in_flight() const override {
    uint32_t n = 0;
    for (const auto& d : devices_) n += d->load();
    return n;
  }

  void Shutdown() override {
    {
      absl::WriterMutexLock lock(&submit_mu_);
      stopping_ = true;
    }
    absl::MutexLock lock(&shutdown_mu_);
    for (auto& d : devices_) d->Stop();
  }

  absl::StatusOr<std::string> RegisterCudaBuffer(const CudaBufferRegistration& reg) override {
    if (!options_.enable_cuda_ipc) {
      return absl::FailedPreconditionError(
          "RegisterCudaBuffer: CUDA IPC is disabled on this server (start attnd with --enable_cuda_ipc)");
    }
    return registry_.Register(reg);
  }
  absl::Status UnregisterCudaBuffer(const std::string& buffer_id) override {
    if (!options_.enable_cuda_ipc) {
      return absl::FailedPreconditionError("UnregisterCudaBuffer: CUDA IPC is disabled on this server");
    }
    return registry_.Unregister(buffer_id);
  }
  std::vector<CudaBufferDescription> ListCudaBuffers() const override { return registry_.List(); }

  BackendStats stats() const override {
    BackendStats st;
    st.tensor_map_cache_hits = maps_.hits();
    st.tensor_map_cache_misses = maps_.misses();
    return st;
  }
  std::vector<DeviceMemoryUse> device_memory() const override {
    std::vector<DeviceMemoryUse> out;
    for (const auto& d : devices_) out.push_back(DeviceMemoryUse{d->index(), d->device_bytes_held()});
    return out;
  }
  uint32_t max_queue() const override { return options_.max_queue; }
  bool cuda_ipc_enabled() const override { return options_.enable_cuda_ipc; }
  // Without the device sink a stream is received into host memory and staged when it runs, as a unary
  // request is: nothing overlaps, so there is nothing to prefer.
  uint64_t stream_preferred_from_bytes() const override {
    return options_.stream_to_device ? options_.stream_preferred_from_bytes : 0;
  }

 private:
  // Inline work goes to the device with the fewest requests queued, running or uploading. Ties are common
  // (a request spends most of its time in transfer, so devices are often idle when one is chosen): the scan
  // starts one device further each time, or device 0 would take them all (2 x H200: 82 of 96 requests from
  // 16 callers before this rotation).
  CudaDevice* PickInlineDevice() {
    CudaDevice* target = nullptr;
    const size_t n = devices_.size();
    const size_t first = next_inline_.fetch_add(1, std::memory_order_relaxed) % n;
    for (size_t i = 0; i < n; ++i) {
      CudaDevice* d = devices_[(first + i) % n].get();
      if (target == nullptr || d->placement_load() < target->placement_load()) target = d;
    }
    return target;
  }

  const BackendOptions options_;
  CopyPool copies_;  // outlives the devices, whose workers use it
  mutable TensorMapCache maps_;
  cuda::IpcRegistry registry_;
  std::vector<std::unique_ptr<CudaDevice>> devices_;
  absl::Mutex submit_mu_;
  bool stopping_ ABSL_GUARDED_BY(submit_mu_) = false;
  std::atomic<uint32_t> queued_total_{0};  // jobs waiting on any device, bounded by max_queue
  std::atomic<size_t> next_inline_{0};     // where the next inline request's least-loaded scan starts
  absl::Mutex shutdown_mu_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(const BackendOptions& options) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    cudaGetLastError();
    return absl::UnavailableError(
        absl::StrCat("no CUDA device (", err == cudaSuccess ? "none found" : cudaGetErrorString(err), ")"));
  }
  std::vector<int> devices = options.devices;
  if (devices.empty()) {
    for (int d = 0; d < count; ++d) {
      if (kernels::CheckDevice(d).ok()) devices.push_back(d);
    }
    if (devices.empty()) {
      return absl::UnavailableError(absl::StrCat("none of the ", count,
                                                 " CUDA devices is supported by attnd's kernels (sm_90 / sm_120)"));
    }
  }
  for (int d : devices) {
    if (d >= count) {
      return absl::InvalidArgumentError(absl::StrCat("devices: ", d, " does not exist (", count, " CUDA devices)"));
    }
    if (absl::Status st = kernels::CheckDevice(d); !st.ok()) {
      return absl::FailedPreconditionError(absl::StrCat("devices: ", st.message()));
    }
  }
  if (options.streams_per_device < 1) return absl::InvalidArgumentError("streams: must be >= 1");
  auto backend = std::make_unique<CudaBackendImpl>(options, devices);
  ATTND_RETURN_IF_ERROR(backend->Start(devices));
  return std::unique_ptr<Backend>(std::move(backend));
}

}  // namespace attnd::server
