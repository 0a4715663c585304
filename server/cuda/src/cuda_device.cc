// A served device: its warm context, its slots (one stream, four timing events and one worker thread each) and
// their queue, the caching allocators for device buffers and pinned staging bounded by the memory budget, and the
// warm-up of kernels and shapes at start. A slot's worker waits for its own stream's events, so no gRPC thread ever
// waits for the GPU. What a worker runs is in forward_runner.cc (a Forward request) and sequence_runner.cc (a batch
// of KV-sequence steps).
#include <cuda_runtime_api.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "attnd/kernels/attention.h"
#include "attnd/server/copy_pool.h"
#include "attnd/server/cuda/block_cache.h"
#include "attnd/server/status_util.h"
#include "cuda_device.h"
#include "spdlog/spdlog.h"

namespace attnd::server::cuda {

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
                            prop.multiProcessorCount, UuidText(prop.uuid)};

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

// One launch of every configuration auto can choose on this device, in each dtype it runs (bf16 and fp16, or float8
// e4m3): loads the module, sets the shared-memory attributes and pays every first-launch cost before the first
// request.
absl::Status CudaDevice::WarmUpKernels() {
  absl::StatusOr<std::vector<kernels::ConfigInfo>> configs = kernels::AutoConfigsForDevice(index_);
  if (!configs.ok()) return configs.status();
  const Shape s{1, 128, 128, 1, 1, 256};
  // Q, K, V, O and float8's V-transposed scratch, a 16-bit Q's bytes each, then LSE and the float8 descales.
  const uint64_t bytes = static_cast<uint64_t>(QElems(s)) * 2;
  const uint64_t total = 5 * bytes + 4096;
  void* buf = nullptr;
  ATTND_RETURN_IF_ERROR(CudaStatus("cudaMalloc (warm-up)", cudaMalloc(&buf, total)));
  ATTND_RETURN_IF_ERROR(CudaStatus("cudaMemset (warm-up)", cudaMemset(buf, 0, total)));
  uint8_t* base = static_cast<uint8_t*>(buf);
  float* descales = reinterpret_cast<float*>(base + 5 * bytes + 2048);
  // Q's, K's and V's of one head each, 16 bytes apart as a request's are placed.
  const float ones[12] = {1.f, 0.f, 0.f, 0.f, 1.f, 0.f, 0.f, 0.f, 1.f, 0.f, 0.f, 0.f};
  ATTND_RETURN_IF_ERROR(
      CudaStatus("cudaMemcpy (warm-up)", cudaMemcpy(descales, ones, sizeof ones, cudaMemcpyHostToDevice)));
  absl::Status status;
  for (const kernels::ConfigInfo& c : *configs) {
    bool usable = true;
    const std::vector<DType> dtypes =
        c.fp8 ? std::vector<DType>{DType::kFP8E4M3} : std::vector<DType>{DType::kBF16, DType::kFP16};
    for (DType dt : dtypes) {
      Problem p;
      p.shape = s;
      p.shape.head_dim = c.head_dim;
      p.dtype = dt;
      p.scale = DefaultScale(c.head_dim);
      p.want_lse = true;
      kernels::DeviceTensors t{base, base + bytes, base + 2 * bytes, base + 3 * bytes,
                               reinterpret_cast<float*>(base + 5 * bytes)};
      if (dt == DType::kFP8E4M3) {
        t.q_descale = descales;
        t.k_descale = descales + 4;
        t.v_descale = descales + 8;
        t.v_t = base + 4 * bytes;  // VTransposedBytes: 256 x 128 bytes
      }
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
    serves_fp8_ = serves_fp8_ || (usable && c.fp8);
  }
  if (status.ok()) status = CudaStatus("warm-up launches", cudaStreamSynchronize(slots_[0]->stream));
  cudaFree(buf);
  if (!status.ok()) return absl::InternalError(absl::StrCat("device ", index_, " warm-up: ", status.message()));
  return absl::OkStatus();
}

// Pre-allocates one block set per slot for shape `s` (LSE included, so requests with or without LSE reuse
// it) and pre-encodes the tensor maps the kernel will use on those blocks, in both dtypes.
absl::Status CudaDevice::WarmShape(const Shape& s) {
  // Sized for 16-bit inputs, the largest (a float8 request's blocks are smaller). Float8 plans are not warmed here:
  // their V map follows each request's own V-transposed scratch block.
  const Placement pl = Place(s, DType::kBF16, true, true, true, true, true);
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

}  // namespace attnd::server::cuda
