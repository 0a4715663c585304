// The CUDA backend: per served device a warm primary context, a pool of slots (one stream, four timing
// events and one worker thread each), optionally one compute stream that all slots' kernels share
// (BackendOptions::shared_compute_stream), caching allocators for device buffers and pinned staging bounded
// by the memory budget, and a shared tensor-map cache. A slot's worker waits for its own stream's events,
// so no gRPC thread ever waits for the GPU; `done` runs on the worker once the kernel (and the copy back)
// has finished.
#include "attnd/server/cuda_backend.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>
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
#include "attnd/server/cuda/tensor_map_cache.h"
#include "attnd/server/status_util.h"
#include "cuda_device.h"
#include "spdlog/spdlog.h"

namespace attnd::server {
namespace cuda {
namespace {

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

}  // namespace

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

absl::Status CudaDevice::AwaitCompletion(Slot& slot, cudaEvent_t last) {
  // Spin only while this request has the GPU (nearly) to itself; behind others it would poll a queue.
  const bool alone = running_.load(std::memory_order_relaxed) <= kSpinWhileRunning;
  const absl::Time start = absl::Now();
  const absl::Status status =
      WaitEvent(last, alone ? CompletionSpin(options_.completion_spin, slot.last_wait) : absl::ZeroDuration());
  slot.last_wait = absl::Now() - start;
  return status;
}

CudaDevice::~CudaDevice() {
  Stop();
  cudaSetDevice(index_);
  for (auto& s : slots_) {
    if (s->workspace.ptr != nullptr && device_mem_) device_mem_->Release(s->workspace);
    if (s->decode_workspace.ptr != nullptr && device_mem_) device_mem_->Release(s->decode_workspace);
    if (s->decode_counters.ptr != nullptr && device_mem_) device_mem_->Release(s->decode_counters);
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
  device_mem_ = std::make_shared<BlockCache>(
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

// One launch of every configuration auto can choose on this device, in both dtypes: loads the module, sets the
// shared-memory attributes and pays every first-launch cost before the first request.
absl::Status CudaDevice::WarmUpKernels() {
  absl::StatusOr<std::vector<kernels::ConfigInfo>> configs = kernels::AutoConfigsForDevice(index_);
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
  if (p.job != nullptr) expiry_.Queued(p.job->deadline);
  queue_.push_back(std::move(p));
  queued_.fetch_add(1);
}

absl::Time CudaDevice::DropExpired(absl::Time now) {
  std::vector<Pending> expired;
  absl::Time earliest = absl::InfiniteFuture();
  {
    absl::MutexLock lock(&mu_);
    for (auto it = queue_.begin(); it != queue_.end();) {
      if (it->job != nullptr && it->job->deadline <= now) {
        expired.push_back(std::move(*it));
        it = queue_.erase(it);
        queued_.fetch_sub(1);
        queued_total_->fetch_sub(1);
      } else {
        if (it->job != nullptr) earliest = std::min(earliest, it->job->deadline);
        ++it;
      }
    }
  }
  // A stream's inputs go back to the device's blocks with the job (StreamedInputs' destructor).
  for (Pending& p : expired) {
    p.job->done(ExpiredInQueue(*p.job, now));
    p.job.reset();
  }
  return earliest;
}

void CudaDevice::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& w : workers_) {
    if (w.joinable()) w.join();
  }
  expiry_.Stop();
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
    if (p.steps != nullptr) {
      std::vector<absl::Status> statuses;
      RunSteps(*slot, *p.steps, statuses);
      running_.fetch_sub(1);
      for (size_t i = 0; i < p.steps->jobs.size(); ++i) p.steps->jobs[i]->done(statuses[i]);
      // The jobs hold their pool: dropped here, after the batch's GPU work (RunSteps waits for it).
      p.steps.reset();
      continue;
    }
    const absl::Status status = Run(*slot, p);
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
  // The deadline first, as in the CPU backend: gRPC cancels a call whose deadline passed.
  if (start >= job.deadline) return ExpiredInQueue(job, start);
  if (job.cancelled && job.cancelled()) {
    return absl::CancelledError("the call was cancelled before its computation started");
  }
  job.kernel = p.selection.info().name;
  Work w(job, slot);
  ATTND_RETURN_IF_ERROR(TakeBlocks(w));
  // In this order so that the host's planning overlaps the copy of the inputs already enqueued.
  absl::Status status = StageInputs(w);
  absl::StatusOr<kernels::Plan> plan;
  if (status.ok()) {
    plan = PlanLaunch(p.selection, w.tensors);
    status = plan.status();
  }
  if (status.ok()) status = EnqueueKernel(*plan, w);
  if (status.ok()) status = CollectOutputs(w);
  if (!status.ok()) {
    Release(w);
    if (absl::IsInternal(status)) spdlog::error("device {}: request '{}': {}", index_, job.request_id, std::string(status.message()));
    return status;
  }
  job.timing.total_us = Micros(absl::Now() - job.accepted);
  return absl::OkStatus();
}

absl::Status CudaDevice::TakeBlocks(Work& w) {
  const ForwardJob& job = w.job;
  const bool qi = !job.q.is_reference(), ki = !job.k.is_reference(), vi = !job.v.is_reference();
  const bool oi = !job.o_to_buffer;
  w.pl = Place(job.problem.shape, qi, ki, vi, oi, job.problem.want_lse);
  // A stream whose inputs were copied here while they arrived: its blocks already hold them on both sides.
  w.streamed = dynamic_cast<StreamedInputs*>(job.inputs.get());
  if (w.streamed != nullptr && (w.streamed->device() != this || !w.streamed->complete() ||
                                w.streamed->placement().total != w.pl.total)) {
    w.streamed = nullptr;  // cannot happen (Submit routes it here, complete); staged from its host bytes
  }
  if (w.streamed != nullptr) {
    std::tie(w.dblock, w.hblock) = w.streamed->Take();
  } else if (w.pl.total > 0) {
    absl::StatusOr<std::pair<Block, Block>> blocks = AcquireBlocks(w.pl.total);
    if (!blocks.ok()) return blocks.status();
    std::tie(w.dblock, w.hblock) = *blocks;
  }
  uint8_t* dev = w.dev();
  w.tensors.q = qi ? dev + w.pl.q : job.q.device_data;
  w.tensors.k = ki ? dev + w.pl.k : job.k.device_data;
  w.tensors.v = vi ? dev + w.pl.v : job.v.device_data;
  w.tensors.o = oi ? dev + w.pl.o : job.o_ref.device_data;
  w.tensors.lse = job.problem.want_lse ? reinterpret_cast<float*>(dev + w.pl.lse) : nullptr;
  return absl::OkStatus();
}

absl::Status CudaDevice::StageInputs(Work& w) {
  const ForwardJob& job = w.job;
  const Placement& pl = w.pl;
  uint8_t* dev = w.dev();
  uint8_t* host = w.host();
  // The request's bytes into pinned memory, so that the H2D copy runs at full DMA speed and async.
  if (w.streamed == nullptr) {
    std::vector<CopyPool::Part> parts;
    const auto stage = [&parts](const TensorSource& src, uint8_t* dst) {
      ForEachInlineRun(src, [&](const uint8_t* data, uint64_t size) {
        parts.push_back({dst, data, size});
        dst += size;
      });
    };
    if (pl.q != Placement::kAbsent) stage(job.q, host + pl.q);
    if (pl.k != Placement::kAbsent) stage(job.k, host + pl.k);
    if (pl.v != Placement::kAbsent) stage(job.v, host + pl.v);
    copies_->Copy(parts);
  }
  const bool shared = compute_ != nullptr;
  cudaStream_t st = w.slot.stream;
  // The copy events are recorded only around copies (and ev[1] always on the shared compute stream's path, which
  // waits on it): a request on registered buffers alone (cuda-ipc) then makes 2 event records besides its launch
  // instead of 5, host time spent between its arrival and its kernel.
  w.copies_in = w.streamed != nullptr || pl.in_bytes > 0;
  w.out_bytes = pl.total - pl.out_offset;
  if (w.copies_in) ATTND_RETURN_IF_ERROR(CudaStatus("cudaEventRecord", cudaEventRecord(w.slot.ev[0], st)));
  if (w.streamed != nullptr) {
    w.enqueued = true;
    ATTND_RETURN_IF_ERROR(CudaStatus("cudaStreamWaitEvent (streamed inputs)",
                                     cudaStreamWaitEvent(st, w.streamed->uploaded(), 0)));
  } else if (pl.in_bytes > 0) {
    w.enqueued = true;
    ATTND_RETURN_IF_ERROR(CudaStatus("H2D copy", cudaMemcpyAsync(dev, host, pl.in_bytes, cudaMemcpyHostToDevice, st)));
  }
  if (w.copies_in || shared) ATTND_RETURN_IF_ERROR(CudaStatus("cudaEventRecord", cudaEventRecord(w.slot.ev[1], st)));
  if (!shared && options_.poison_outputs && pl.total > pl.out_offset) {
    // Test mode: NaN-fill the outputs so that a launch that writes nothing cannot pass on stale results.
    ATTND_RETURN_IF_ERROR(
        CudaStatus("poison", cudaMemsetAsync(dev + pl.out_offset, 0xFF, pl.total - pl.out_offset, st)));
  }
  return absl::OkStatus();
}

absl::StatusOr<kernels::Plan> CudaDevice::PlanLaunch(const kernels::Selection& selection,
                                                     const kernels::DeviceTensors& tensors) {
  absl::StatusOr<kernels::TensorMapKeys> keys = kernels::MapKeys(selection, tensors);
  if (!keys.ok()) return keys.status();
  absl::StatusOr<CUtensorMap> qm = maps_->Get(keys->q);
  absl::StatusOr<CUtensorMap> km = maps_->Get(keys->k);
  absl::StatusOr<CUtensorMap> vm = maps_->Get(keys->v);
  absl::StatusOr<CUtensorMap> om;
  if (keys->has_o) om = maps_->Get(keys->o);  // configurations that store O through a tensor map
  for (const auto* m : {&qm, &km, &vm}) {
    if (!m->ok()) return m->status();
  }
  if (keys->has_o && !om.ok()) return om.status();
  return kernels::MakePlanFromMaps(selection, tensors, *qm, *km, *vm, keys->has_o ? &*om : nullptr);
}

absl::Status CudaDevice::EnqueueKernel(const kernels::Plan& plan, Work& w) {
  Slot& slot = w.slot;
  cudaStream_t st = slot.stream;
  if (compute_ == nullptr) {
    w.enqueued = true;
    absl::StatusOr<void*> workspace = SlotWorkspace(slot, plan, st);
    if (!workspace.ok()) return workspace.status();
    ATTND_RETURN_IF_ERROR(CudaStatus("cudaEventRecord", cudaEventRecord(slot.kernel_start, st)));
    ATTND_RETURN_IF_ERROR(kernels::Launch(plan, *workspace, st));
    return CudaStatus("cudaEventRecord", cudaEventRecord(slot.ev[2], st));
  }
  w.on_compute = true;
  {
    // Enqueued together, after the host-side planning, so that the lock is held for a few API calls only.
    absl::MutexLock lock(&compute_mu_);
    ATTND_RETURN_IF_ERROR(
        CudaStatus("cudaStreamWaitEvent (inputs)", cudaStreamWaitEvent(compute_, slot.ev[1], 0)));
    const Placement& pl = w.pl;
    if (options_.poison_outputs && pl.total > pl.out_offset) {
      // Test mode, as in StageInputs; on the compute stream, so that it lands before this launch without another
      // cross-stream dependency.
      ATTND_RETURN_IF_ERROR(CudaStatus(
          "poison", cudaMemsetAsync(w.dev() + pl.out_offset, 0xFF, pl.total - pl.out_offset, compute_)));
    }
    absl::StatusOr<void*> workspace = SlotWorkspace(slot, plan, compute_);
    if (!workspace.ok()) return workspace.status();
    ATTND_RETURN_IF_ERROR(CudaStatus("cudaEventRecord", cudaEventRecord(slot.kernel_start, compute_)));
    ATTND_RETURN_IF_ERROR(kernels::Launch(plan, *workspace, compute_));
    ATTND_RETURN_IF_ERROR(CudaStatus("cudaEventRecord", cudaEventRecord(slot.ev[2], compute_)));
  }
  // From here the slot stream holds this request's last work (the copy back, behind the kernel), also when
  // nothing was copied in.
  w.enqueued = true;
  return CudaStatus("cudaStreamWaitEvent (kernel)", cudaStreamWaitEvent(st, slot.ev[2], 0));
}

absl::Status CudaDevice::CollectOutputs(Work& w) {
  ForwardJob& job = w.job;
  Slot& slot = w.slot;
  const Placement& pl = w.pl;
  const Shape& s = job.problem.shape;
  cudaStream_t st = slot.stream;
  uint8_t* host = w.host();
  if (w.out_bytes > 0) {
    ATTND_RETURN_IF_ERROR(CudaStatus("D2H copy", cudaMemcpyAsync(host + pl.out_offset, w.dev() + pl.out_offset,
                                                                 w.out_bytes, cudaMemcpyDeviceToHost, st)));
  }
  // The request's last work: the copy back, or with nothing to copy (and the kernel on this stream) the kernel.
  const bool after_kernel = w.out_bytes == 0 && compute_ == nullptr;
  cudaEvent_t last = after_kernel ? slot.ev[2] : slot.ev[3];
  if (!after_kernel) ATTND_RETURN_IF_ERROR(CudaStatus("cudaEventRecord", cudaEventRecord(slot.ev[3], st)));
  ATTND_RETURN_IF_ERROR(AwaitCompletion(slot, last));
  float h2d = 0, kernel = 0, d2h = 0;
  if (w.copies_in) cudaEventElapsedTime(&h2d, slot.ev[0], slot.ev[1]);
  cudaEventElapsedTime(&kernel, slot.kernel_start, slot.ev[2]);
  if (w.out_bytes > 0) cudaEventElapsedTime(&d2h, slot.ev[2], slot.ev[3]);
  // Back-to-back events still read a few nanoseconds apart: report exactly 0 when nothing was copied.
  // Streamed inputs: only their last piece's copy, the rest ran while the upload went on.
  if (w.streamed != nullptr) h2d = w.streamed->last_piece_ms();
  job.timing.h2d_us = pl.in_bytes > 0 ? h2d * 1e3 : 0;
  job.timing.kernel_us = kernel * 1e3;
  job.timing.d2h_us = w.out_bytes > 0 ? d2h * 1e3 : 0;
  const bool oi = !job.o_to_buffer;
  if (oi && job.accepts_lent_o) {
    // O stays in the pinned block, lent to the caller, which copies it on (ForwardStream: into its chunks); the
    // block goes back to the cache when the loan is dropped. Saves a copy into `o` and the zero-fill of a fresh
    // string, most of a large stream's time after its last byte.
    job.o_lent = std::string_view(reinterpret_cast<const char*>(host + pl.o), static_cast<uint64_t>(QElems(s)) * 2);
    job.o_loan = std::shared_ptr<const void>(host, [cache = pinned_mem_, lent = w.hblock](const void*) { cache->Release(lent); });
    w.hblock = Block{};  // Release below keeps its hands off it
  } else if (oi) {
    job.o.resize(static_cast<uint64_t>(QElems(s)) * 2);
    const CopyPool::Part out{reinterpret_cast<uint8_t*>(job.o.data()), host + pl.o, job.o.size()};
    copies_->Copy({&out, 1});
  }
  if (job.problem.want_lse) {
    job.lse.assign(reinterpret_cast<const char*>(host + pl.lse), static_cast<uint64_t>(LseElems(s)) * sizeof(float));
  }
  w.enqueued = false;  // the stream is idle: `last` was the last work on it
  // This request's compute-stream work is done too (the slot stream waited for ev[2] before ev[3]); a
  // synchronisation here would wait for other requests' kernels.
  w.on_compute = false;
  Release(w);
  return absl::OkStatus();
}

void CudaDevice::Release(Work& w) {
  // An error may leave this request's memset or kernel queued on the compute stream, still writing the
  // blocks. Synchronising the whole stream waits for other requests' kernels as well, but it needs no
  // further call to succeed (recording ev[2] after a failed launch for the slot stream to wait on may
  // fail too, and a wait on a stale record would free the blocks early), and errors are rare.
  if (w.on_compute) cudaStreamSynchronize(compute_);
  if (w.enqueued) cudaStreamSynchronize(w.slot.stream);
  ReleaseBlocks(w.dblock, w.hblock);
  w.dblock = w.hblock = Block{};
}

}  // namespace cuda

namespace {

using cuda::CudaDevice;
using cuda::Pending;
using cuda::StreamedInputs;
using cuda::TensorMapCache;

class CudaBackendImpl final : public Backend {
 public:
  explicit CudaBackendImpl(const BackendOptions& options)
      : options_(options),
        copies_(options.copy_threads >= 0 ? options.copy_threads : DefaultCopyThreads()),
        maps_(options.tensor_map_cache_entries) {}
  ~CudaBackendImpl() override {
    Shutdown();
    devices_.clear();
  }

  absl::Status Start(const std::vector<int>& devices) {
    absl::StatusOr<std::vector<Shape>> warm = cuda::ParseWarmShapes(options_.warm_shapes);
    if (!warm.ok()) return warm.status();
    for (int d : devices) {
      auto dev = std::make_unique<CudaDevice>(d, options_, &maps_, &queued_total_, &copies_);
      ATTND_RETURN_IF_ERROR(dev->Start(*warm));
      devices_.push_back(std::move(dev));
    }
    // A kernel selection depends on the device's model only (compute capability, SMs, shared memory, L2).
    one_model_ = true;
    for (const auto& d : devices_) {
      const DeviceDescription& a = d->description();
      const DeviceDescription& b = devices_.front()->description();
      one_model_ = one_model_ && a.name == b.name && a.cc_major == b.cc_major && a.cc_minor == b.cc_minor &&
                   a.multiprocessor_count == b.multiprocessor_count;
    }
    return absl::OkStatus();
  }

  std::string name() const override { return "cuda"; }
  std::vector<DeviceDescription> devices() const override {
    std::vector<DeviceDescription> out;
    for (const auto& d : devices_) out.push_back(d->description());
    return out;
  }
  std::vector<int64_t> supported_head_dims() const override { return {kHeadDims.begin(), kHeadDims.end()}; }
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

  // The kernel is selected here, once per request: the selection checks the layout rules (strides in 16-byte
  // units, limits) before anything is queued or uploaded, and the job carries it to its device.
  absl::Status Accept(ForwardJob* job) const override {
    absl::StatusOr<kernels::Selection> sel = Select(*job, devices_.front()->index());
    if (!sel.ok()) return sel.status();
    job->backend_plan = std::make_shared<const kernels::Selection>(*std::move(sel));
    return absl::OkStatus();
  }

  absl::Status Submit(std::unique_ptr<ForwardJob> job) override {
    // Held shared until the job is enqueued: Shutdown cannot stop the workers between the check and the
    // enqueue, so an accepted job is always drained.
    absl::ReaderMutexLock lock(&submit_mu_);
    if (stopping_) return absl::UnavailableError("the server is shutting down");
    // Resolved references (the Dispatcher checked that they share one device) decide where the job runs.
    int ref_device = -1;
    for (const TensorSource* src : {&job->q, &job->k, &job->v, &job->o_ref}) {
      if (src->device_data != nullptr) ref_device = src->device;
    }
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
    Pending p;
    absl::StatusOr<kernels::Selection> selection = SelectionFor(*job, *target);
    if (!selection.ok()) return selection.status();
    p.selection = *std::move(selection);
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

  // KV sequences live on the first served device: one pool per shape there, and every step on it (a sequence's
  // pages cannot follow a request to another device). Other devices serve Forward requests only.
  absl::StatusOr<std::shared_ptr<KvPool>> MakeKvPool(const SequenceShape& shape, int page_tokens,
                                                     int32_t num_pages) override {
    absl::ReaderMutexLock lock(&submit_mu_);
    if (stopping_) return absl::UnavailableError("the server is shutting down");
    return devices_.front()->MakeKvPool(shape, page_tokens, num_pages);
  }

  // Half the sequence device's budget: the other half stages Forward requests and step batches.
  uint64_t default_kv_pool_bytes() const override { return devices_.front()->device_budget_bytes() / 2; }

  absl::Status AcceptStep(const StepJob& job) const override { return cuda::AcceptStepJob(job); }

  absl::Status SubmitSteps(std::unique_ptr<StepBatch> batch) override {
    absl::ReaderMutexLock lock(&submit_mu_);
    if (stopping_) return absl::UnavailableError("the server is shutting down");
    if (batch == nullptr || batch->jobs.empty()) return absl::InvalidArgumentError("steps: an empty batch");
    const KvPool* pool = batch->jobs.front()->pool.get();
    const int device = pool != nullptr ? cuda::KvPoolDevice(*pool) : -1;
    CudaDevice* target = nullptr;
    for (const auto& d : devices_) {
      if (d->index() == device) target = d.get();
    }
    if (target == nullptr) return absl::InternalError("steps: the pool was not made by this backend");
    // A batch is one launch and takes one place in the queue, as a Forward request does.
    uint32_t q = queued_total_.load();
    do {
      if (q >= options_.max_queue) {
        return absl::ResourceExhaustedError(absl::StrCat("queue full: ", q, " requests waiting (--max_queue=",
                                                         options_.max_queue, ")"));
      }
    } while (!queued_total_.compare_exchange_weak(q, q + 1));
    Pending p;
    p.steps = std::move(batch);
    target->Enqueue(std::move(p));
    return absl::OkStatus();
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
  // Without the device sink a stream is received into host memory and staged when it runs, as a unary
  // request is: nothing overlaps, so there is nothing to prefer.
  uint64_t stream_preferred_from_bytes() const override {
    return options_.stream_to_device ? options_.stream_preferred_from_bytes : 0;
  }

 private:
  static absl::StatusOr<kernels::Selection> Select(const ForwardJob& job, int device) {
    const Shape& s = job.problem.shape;
    const Layout layout{job.q.strides, job.k.strides, job.v.strides,
                        job.o_to_buffer ? job.o_ref.strides : ContiguousStrides(s.q_len, s.q_heads, s.head_dim)};
    kernels::PlanOptions po;
    po.device = device;
    return kernels::Select(job.problem, layout, po);
  }

  // The selection Accept made, for the device the job runs on: the same when the served devices are one model,
  // else selected again for that device (a host with GPUs of different models).
  absl::StatusOr<kernels::Selection> SelectionFor(const ForwardJob& job, const CudaDevice& device) const {
    const auto* accepted = static_cast<const kernels::Selection*>(job.backend_plan.get());
    if (accepted == nullptr || (accepted->device != device.index() && !one_model_)) return Select(job, device.index());
    kernels::Selection sel = *accepted;
    sel.device = device.index();
    return sel;
  }

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
  std::vector<std::unique_ptr<CudaDevice>> devices_;
  bool one_model_ = true;  // every served device is the same GPU model (Start)
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
    // The static runtime reports a missing driver library as an old driver ("driver version is insufficient"),
    // which sends an operator after the wrong fix: say which one it is.
    if (err == cudaErrorInsufficientDriver) {
      if (void* driver = ::dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL); driver != nullptr) {
        ::dlclose(driver);
      } else {
        return absl::UnavailableError(
            "no CUDA device (no NVIDIA driver: libcuda.so.1 cannot be loaded; on a GPU host install the driver, in a "
            "container start it with the NVIDIA runtime, e.g. docker run --gpus all)");
      }
    }
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
  auto backend = std::make_unique<CudaBackendImpl>(options);
  ATTND_RETURN_IF_ERROR(backend->Start(devices));
  return std::unique_ptr<Backend>(std::move(backend));
}

}  // namespace attnd::server
