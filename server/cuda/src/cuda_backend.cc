// The CUDA backend (MakeCudaBackend): the served devices (cuda_device.cc), the kernel selection a Forward request
// is accepted with, the device each request runs on (where its registered buffers are, else the least loaded), the
// bound on waiting requests across devices, and the KV sequences' pools and steps on the first device. The tensor-map
// cache and the copy helpers are shared by all devices.
#include "attnd/server/cuda_backend.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>

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
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "attnd/kernels/attention.h"
#include "attnd/server/copy_pool.h"
#include "attnd/server/cuda/tensor_map_cache.h"
#include "attnd/server/status_util.h"
#include "cuda_device.h"
#include "stream_words.h"

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
}  // namespace cuda

namespace {

using cuda::CudaDevice;
using cuda::Pending;
using cuda::StreamedInputs;
using cuda::TensorMapCache;

class CudaBackendImpl final : public Backend {
 public:
  CudaBackendImpl(const BackendOptions& options, CudaBackendHooks hooks)
      : options_(options),
        hooks_(hooks),
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
      auto dev = std::make_unique<CudaDevice>(d, options_, hooks_, &maps_, &queued_total_, &copies_);
      ATTND_RETURN_IF_ERROR(dev->Start(*warm));
      devices_.push_back(std::move(dev));
    }
    device_order_ = cuda::StreamWordsAvailable(devices);
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
  bool cuda_ipc() const override { return true; }
  std::vector<DeviceDescription> devices() const override {
    std::vector<DeviceDescription> out;
    for (const auto& d : devices_) out.push_back(d->description());
    return out;
  }
  std::vector<int64_t> supported_head_dims() const override { return {kHeadDims.begin(), kHeadDims.end()}; }
  // Float8 where every served device has a float8 kernel (Hopper, head_dim 128 and 256; kernels::Select refuses
  // the rest, naming the field): a request may run on any of them.
  std::vector<DType> supported_dtypes() const override {
    bool fp8 = !devices_.empty();
    for (const auto& d : devices_) fp8 = fp8 && d->serves_fp8();
    if (fp8) return {DType::kBF16, DType::kFP16, DType::kFP8E4M3};
    return {DType::kBF16, DType::kFP16};
  }
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
    ATTND_RETURN_IF_ERROR(TakeQueuePlace());
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
  absl::Status CopyKvRows(const KvPool& pool, absl::Span<const int32_t> pages, int layer, int kv, int64_t first,
                          int64_t rows, bool to_host, uint8_t* host) override {
    return cuda::CopyKvRows(pool, pages, layer, kv, first, rows, to_host, host);
  }
  absl::Status WriteKvRows(const KvPool& pool, absl::Span<const int32_t> pages, int layer, int kv, int64_t first,
                           int64_t rows, HostPieces src) override {
    return cuda::WriteKvRows(pool, pages, layer, kv, first, rows, src);
  }
  absl::StatusOr<DeviceRows> ExportKvRowsOnDevice(const KvPool& pool, absl::Span<const int32_t> pages,
                                                  absl::Span<const int64_t> lengths, bool share_pool,
                                                  std::shared_ptr<void>* hold) override {
    return cuda::ExportKvRowsOnDevice(pool, pages, lengths, share_pool, PoolUuid(pool), hold);
  }
  absl::Status ImportKvRowsOnDevice(const KvPool& pool, absl::Span<const int32_t> pages,
                                    absl::Span<const int64_t> lengths, const DeviceRows& rows) override {
    return cuda::ImportKvRowsOnDevice(pool, pages, lengths, PoolUuid(pool), rows, pool_mappings_);
  }

  bool device_order() const override { return device_order_; }
  absl::StatusOr<MappedHostMemory> MapHostMemory(void* page, size_t bytes) override {
    if (!device_order_) return Backend::MapHostMemory(page, bytes);
    return cuda::MapHostPage(page, bytes);
  }

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
    ATTND_RETURN_IF_ERROR(TakeQueuePlace());
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
  // The UUID of the device a pool lives on (the first served; empty for a pool of no device of this backend).
  std::string PoolUuid(const KvPool& pool) const {
    const int device = cuda::KvPoolDevice(pool);
    for (const auto& d : devices_) {
      if (d->description().index == device) return d->description().uuid;
    }
    return {};
  }

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
  // One place among the jobs waiting on all devices (--max_queue); the check and the increment are one step so that
  // concurrent submitters cannot overshoot.
  absl::Status TakeQueuePlace() {
    uint32_t q = queued_total_.load();
    do {
      if (q >= options_.max_queue) {
        return absl::ResourceExhaustedError(absl::StrCat("queue full: ", q, " requests waiting (--max_queue=",
                                                         options_.max_queue, ")"));
      }
    } while (!queued_total_.compare_exchange_weak(q, q + 1));
    return absl::OkStatus();
  }

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
  const CudaBackendHooks hooks_;
  CopyPool copies_;  // outlives the devices, whose workers use it
  mutable TensorMapCache maps_;
  std::vector<std::unique_ptr<CudaDevice>> devices_;
  bool device_order_ = false;  // steps ordered on callers' streams by the device (StepJob::device_order)
  bool one_model_ = true;  // every served device is the same GPU model (Start)
  absl::Mutex submit_mu_;
  bool stopping_ ABSL_GUARDED_BY(submit_mu_) = false;
  std::atomic<uint32_t> queued_total_{0};  // jobs waiting on any device, bounded by max_queue
  std::atomic<size_t> next_inline_{0};     // where the next inline request's least-loaded scan starts
  absl::Mutex shutdown_mu_;
  cuda::PoolMappings pool_mappings_;  // exporters' pools this server imports from (DeviceRows::from_pool)
};

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(const BackendOptions& options, CudaBackendHooks hooks) {
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
  auto backend = std::make_unique<CudaBackendImpl>(options, hooks);
  ATTND_RETURN_IF_ERROR(backend->Start(devices));
  return std::unique_ptr<Backend>(std::move(backend));
}

}  // namespace attnd::server
