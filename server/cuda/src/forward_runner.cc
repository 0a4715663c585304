// A Forward request on a slot: its blocks (or its streamed inputs' blocks) taken, the inline inputs staged and
// copied in, the kernel planned and launched, the outputs collected once the slot's events say the work ended.
#include <cuda_runtime_api.h>

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

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "attnd/kernels/attention.h"
#include "attnd/server/copy_pool.h"
#include "attnd/server/status_util.h"
#include "cuda_device.h"
#include "spdlog/spdlog.h"

namespace attnd::server::cuda {

absl::StatusOr<std::unique_ptr<InputSink>> CudaDevice::OpenInputs(const Problem& problem,
                                                                  const uint64_t (&sizes)[InputSink::kTensors]) {
  // Laid out as Run places an all-inline request, so the worker uses the blocks as they are.
  const Placement pl = Place(problem.shape, problem.dtype, true, true, true, true, problem.want_lse);
  const uint64_t qb = static_cast<uint64_t>(QElems(problem.shape)) * DTypeBytes(problem.dtype);
  const uint64_t kvb = static_cast<uint64_t>(KVElems(problem.shape)) * DTypeBytes(problem.dtype);
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
  if (absl::Status taken = TakeBlocks(w); !taken.ok()) {
    Release(w);  // what it took before the part it could not have
    return taken;
  }
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
  w.pl = Place(job.problem.shape, job.problem.dtype, qi, ki, vi, oi, job.problem.want_lse);
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
  if (w.pl.descales != Placement::kAbsent) {
    uint8_t* d = dev + w.pl.descales;
    w.tensors.q_descale = reinterpret_cast<const float*>(d);
    w.tensors.k_descale = reinterpret_cast<const float*>(d + w.pl.k_descale_at);
    w.tensors.v_descale = reinterpret_cast<const float*>(d + w.pl.v_descale_at);
    // The kernel's transposed copy of V (V's bytes, keys padded to 32), per request, from the staging budget.
    const int64_t v_t_bytes = kernels::VTransposedBytes(job.problem.shape, job.problem.dtype);
    if (v_t_bytes > 0) {
      absl::StatusOr<Block> v_t = device_mem_->Acquire(static_cast<uint64_t>(v_t_bytes));
      if (!v_t.ok()) return v_t.status();
      w.v_t = *v_t;
      w.tensors.v_t = w.v_t.ptr;
    }
  }
  return absl::OkStatus();
}

// A float8 request's descales, one per head, into its staging block where the placement puts them.
void CudaDevice::StageDescales(const ForwardJob& job, const Placement& pl, uint8_t* host) {
  std::memcpy(host, job.q_descale.data(), job.q_descale.size() * sizeof(float));
  std::memcpy(host + pl.k_descale_at, job.k_descale.data(), job.k_descale.size() * sizeof(float));
  std::memcpy(host + pl.v_descale_at, job.v_descale.data(), job.v_descale.size() * sizeof(float));
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
  if (pl.descales != Placement::kAbsent) StageDescales(job, pl, host + pl.descales);
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
    // The stream's pieces are Q, K and V: the descales, staged here, follow on their own.
    if (pl.descales != Placement::kAbsent) {
      ATTND_RETURN_IF_ERROR(CudaStatus("H2D copy (descales)",
                                       cudaMemcpyAsync(dev + pl.descales, host + pl.descales, pl.descale_bytes,
                                                       cudaMemcpyHostToDevice, st)));
    }
  } else if (pl.in_bytes > 0) {
    w.enqueued = true;
    ATTND_RETURN_IF_ERROR(CudaStatus("H2D copy", cudaMemcpyAsync(dev, host, pl.in_bytes, cudaMemcpyHostToDevice, st)));
  }
  if (w.copies_in || shared) ATTND_RETURN_IF_ERROR(CudaStatus("cudaEventRecord", cudaEventRecord(w.slot.ev[1], st)));
  if (!shared && hooks_.poison_outputs && pl.total > pl.out_offset) {
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
    if (hooks_.poison_outputs && pl.total > pl.out_offset) {
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
  const uint64_t o_bytes = static_cast<uint64_t>(QElems(s)) * DTypeBytes(OutputDType(job.problem.dtype));
  if (oi && job.accepts_lent_o) {
    // O stays in the pinned block, lent to the caller, which copies it on (ForwardStream: into its chunks); the
    // block goes back to the cache when the loan is dropped. Saves a copy into `o` and the zero-fill of a fresh
    // string, most of a large stream's time after its last byte.
    job.o_lent = std::string_view(reinterpret_cast<const char*>(host + pl.o), o_bytes);
    job.o_loan = std::shared_ptr<const void>(host, [cache = pinned_mem_, lent = w.hblock](const void*) { cache->Release(lent); });
    w.hblock = Block{};  // Release below keeps its hands off it
  } else if (oi) {
    job.o.resize(o_bytes);
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
  device_mem_->Release(w.v_t);
  w.v_t = Block{};
}

}  // namespace attnd::server::cuda
