#include "attnd/client/cuda_steps.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <optional>
#include <thread>
#include <type_traits>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "attnd/client/shm_channel.h"

namespace attnd::client {
namespace {

// The few driver types and constants used, declared here so that the library builds without CUDA's headers.
using CUresult = int;
using CUdeviceptr = unsigned long long;  // NOLINT(runtime/int): the driver's own type
using CUstream = void*;
using CUcontext = void*;
constexpr CUresult kSuccess = 0;
constexpr int kAttrBufferId = 7, kAttrDeviceOrdinal = 9, kAttrRangeStart = 11, kAttrRangeSize = 12;
constexpr int kDeviceAttr64BitMemOps = 122;  // CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS
constexpr int kDeviceAttrHostPointerForRegisteredMem = 91;  // CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_...
constexpr unsigned kWriteDefault = 0, kWaitGeq = 0, kHostRegisterDeviceMap = 2;
constexpr unsigned kHostAllocPortableMapped = 1 | 2;  // CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP
constexpr unsigned kStreamNonBlocking = 1;
constexpr size_t kIpcHandleBytes = 64;
constexpr size_t kMaxStreams = 256;  // streams one client may order steps on (a channel and a server thread each)

struct Driver {
  CUresult (*pointer_get_attributes)(unsigned, int*, void**, CUdeviceptr) = nullptr;
  CUresult (*ipc_get_mem_handle)(void*, CUdeviceptr) = nullptr;
  CUresult (*write_value64)(CUstream, CUdeviceptr, uint64_t, unsigned) = nullptr;
  CUresult (*wait_value64)(CUstream, CUdeviceptr, uint64_t, unsigned) = nullptr;
  CUresult (*mem_host_alloc)(void**, size_t, unsigned) = nullptr;
  CUresult (*mem_free_host)(void*) = nullptr;
  CUresult (*memset_d16_async)(CUdeviceptr, unsigned short, size_t, CUstream) = nullptr;  // NOLINT(runtime/int)
  CUresult (*stream_create)(CUstream*, unsigned) = nullptr;
  CUresult (*stream_destroy)(CUstream) = nullptr;
  CUresult (*stream_synchronize)(CUstream) = nullptr;
  CUresult (*ctx_get_current)(CUcontext*) = nullptr;
  CUresult (*ctx_set_current)(CUcontext) = nullptr;
  CUresult (*ctx_get_device)(int*) = nullptr;
  CUresult (*device_get_attribute)(int*, int, int) = nullptr;
  CUresult (*get_error_string)(CUresult, const char**) = nullptr;
  CUresult (*mem_host_register)(void*, size_t, unsigned) = nullptr;
  CUresult (*mem_host_unregister)(void*) = nullptr;
  CUresult (*mem_host_get_device_pointer)(CUdeviceptr*, void*, unsigned) = nullptr;
  CUresult (*ctx_synchronize)() = nullptr;
  CUresult (*init)(unsigned) = nullptr;
  CUresult (*primary_ctx_retain)(CUcontext*, int) = nullptr;
};

// libcuda.so.1, loaded once for the process; null when the machine has no driver.
const Driver* LoadDriver() {
  static const Driver* driver = [] () -> const Driver* {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) return nullptr;
    auto* d = new Driver();
    bool ok = true;
    const auto bind = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      ok = ok && fn != nullptr;
    };
    bind(d->pointer_get_attributes, "cuPointerGetAttributes");
    bind(d->ipc_get_mem_handle, "cuIpcGetMemHandle");
    bind(d->write_value64, "cuStreamWriteValue64_v2");
    bind(d->wait_value64, "cuStreamWaitValue64_v2");
    bind(d->mem_host_alloc, "cuMemHostAlloc");
    bind(d->mem_free_host, "cuMemFreeHost");
    bind(d->memset_d16_async, "cuMemsetD16Async");
    bind(d->stream_create, "cuStreamCreate");
    bind(d->stream_destroy, "cuStreamDestroy_v2");
    bind(d->stream_synchronize, "cuStreamSynchronize");
    bind(d->ctx_get_current, "cuCtxGetCurrent");
    bind(d->ctx_set_current, "cuCtxSetCurrent");
    bind(d->ctx_get_device, "cuCtxGetDevice");
    bind(d->device_get_attribute, "cuDeviceGetAttribute");
    bind(d->get_error_string, "cuGetErrorString");
    bind(d->mem_host_register, "cuMemHostRegister_v2");
    bind(d->mem_host_unregister, "cuMemHostUnregister");
    bind(d->mem_host_get_device_pointer, "cuMemHostGetDevicePointer_v2");
    bind(d->ctx_synchronize, "cuCtxSynchronize");
    bind(d->init, "cuInit");
    bind(d->primary_ctx_retain, "cuDevicePrimaryCtxRetain");
    if (!ok) {
      delete d;
      return nullptr;
    }
    return d;
  }();
  return driver;
}

absl::Status DriverError(const Driver& d, const char* what, CUresult r) {
  const char* text = nullptr;
  d.get_error_string(r, &text);
  return absl::InternalError(absl::StrCat(what, ": CUDA driver error ", r, text != nullptr ? " (" : "",
                                          text != nullptr ? text : "", text != nullptr ? ")" : ""));
}

}  // namespace

StepBatch::StepBatch(const std::vector<std::string>& sequence_ids, int64_t tokens) {
  for (const std::string& id : sequence_ids) request_.add_sequences()->set_sequence_id(id);
  tokens_ = -1;
  set_tokens(tokens);
}

void StepBatch::set_tokens(int64_t tokens) {
  if (tokens == tokens_) return;
  tokens_ = tokens;
  for (v1::SequenceTokens& s : *request_.mutable_sequences()) s.set_tokens(tokens);
}

class CudaSteps::Impl {
 public:
  Impl(Client* client, const Driver* driver, CUcontext ctx, int device, const CudaStepsOptions& options)
      : client_(client), d_(*driver), ctx_(ctx), device_(device), options_(options) {}

  ~Impl() {
    d_.ctx_set_current(ctx_);
    for (auto& [stream, slot] : slots_) StopSender(*slot);
    // Writes of wait words may still be queued on the callers' streams: they land before the pages go.
    if (!slots_.empty()) d_.ctx_synchronize();
    for (auto& [stream, slot] : slots_) Release(*slot);
    for (const auto& [base, reg] : regs_) client_->UnregisterCudaBuffer(reg.buffer_id).IgnoreError();
  }

  absl::StatusOr<v1::TensorRef> Ref(const void* ptr, uint64_t bytes) {
    const auto addr = reinterpret_cast<CUdeviceptr>(ptr);
    CUdeviceptr start = 0;
    size_t size = 0;
    unsigned long long buffer_id = 0;  // NOLINT(runtime/int)
    int ordinal = -1;
    int attrs[] = {kAttrRangeStart, kAttrRangeSize, kAttrBufferId, kAttrDeviceOrdinal};
    void* out[] = {&start, &size, &buffer_id, &ordinal};
    if (d_.pointer_get_attributes(4, attrs, out, addr) != kSuccess || start == 0) {
      return absl::InvalidArgumentError("not device memory of this process's CUDA allocations");
    }
    if (addr - start + bytes > size) {
      return absl::InvalidArgumentError(absl::StrCat(bytes, " bytes from its address run past its allocation"));
    }
    v1::TensorRef ref;
    ref.set_offset(addr - start);
    {
      absl::MutexLock lock(&mu_);
      auto it = regs_.find(start);
      if (it != regs_.end() && it->second.allocation == buffer_id) {
        ref.set_buffer_id(it->second.buffer_id);
        return ref;
      }
    }
    absl::StatusOr<std::string> id = Register(start, size, buffer_id, ordinal);
    if (!id.ok()) return id.status();
    ref.set_buffer_id(*id);
    return ref;
  }

  absl::StatusOr<bool> StreamOrdered() {
    if (options_.host_order || client_->options().shm_socket.empty()) return false;
    absl::MutexLock lock(&mu_);
    if (!ordered_.has_value()) {
      absl::StatusOr<v1::ServerInfo> info = client_->ServerInfo();
      if (!info.ok()) return info.status();
      int memops = 0, host_ptr = 0;
      d_.device_get_attribute(&memops, kDeviceAttr64BitMemOps, device_);
      d_.device_get_attribute(&host_ptr, kDeviceAttrHostPointerForRegisteredMem, device_);
      ordered_ = info->stream_ordered_steps() && memops != 0 && host_ptr != 0;
      device_ordered_ = *ordered_ && options_.device_order && info->device_ordered_steps();
    }
    return *ordered_;
  }

  absl::StatusOr<StepResult> Step(StepBatch& batch, const DeviceStepTensors& t, void* stream, const CallOptions& call) {
    d_.ctx_set_current(ctx_);  // any calling thread: the driver calls below name the context's memory
    auto s = static_cast<CUstream>(stream);
    absl::StatusOr<Slot*> slot = Prepare(batch, t, s, call);
    if (!slot.ok()) return slot.status();
    v1::StepRequest& request = batch.request();
    if (*slot == nullptr) return StepInHostOrder(request, s, call);
    Slot& sl = **slot;
    absl::StatusOr<StepResult> result;
    bool broken = false;
    {
      absl::MutexLock lock(&sl.mu);
      // Steps submitted earlier on this stream are sent first; a failure among them is this call's.
      sl.mu.Await(absl::Condition(+[](Slot* x) { return x->queued() == 0; }, &sl));
      if (sl.lanes[0].channel == nullptr) return Gone();
      absl::Status earlier = TakeFailure(sl, &broken);
      if (!earlier.ok()) {
        result = earlier;
      } else {
        // A step that waits goes over the first channel: its own thread polls for it at the stream's pace.
        absl::StatusOr<uint64_t> value = WriteWaitWord(sl, sl.lanes[0], s);
        if (!value.ok()) return value.status();
        sl.previous = nullptr;  // answered before the next step is sent
        request.mutable_order()->set_wait_value(*value);
        result = StepOverShm(*sl.lanes[0].channel, request, Timeout(call));
        // The channel is unusable after these (shm_channel.h): the next step on this stream opens another.
        broken = !result.ok() && Breaks(result.status());
      }
    }
    request.clear_order();
    if (broken) Drop(s);
    return result;
  }

  absl::Status Submit(StepBatch& batch, const DeviceStepTensors& t, void* stream, const CallOptions& call) {
    d_.ctx_set_current(ctx_);
    auto s = static_cast<CUstream>(stream);
    absl::StatusOr<Slot*> slot = Prepare(batch, t, s, call);
    if (!slot.ok()) return slot.status();
    v1::StepRequest& request = batch.request();
    if (*slot == nullptr) return StepInHostOrder(request, s, call).status();  // the step runs now, as Step's
    Slot& sl = **slot;
    bool broken = false;
    absl::Status status;
    {
      absl::MutexLock lock(&sl.mu);
      const auto room = [](Slot* x) { return !x->failure.ok() || x->queued() < x->ahead; };
      sl.mu.Await(absl::Condition(+room, &sl));
      if (sl.lanes[0].channel == nullptr) return Gone();
      status = TakeFailure(sl, &broken);
      if (status.ok()) {
        // Device order: submitted steps alternate between the channels.
        Lane& lane = sl.lanes[sl.device ? sl.next_lane : 0];
        absl::StatusOr<uint64_t> value = WriteWaitWord(sl, lane, s);
        if (!value.ok()) return value.status();
        // Work queued after this call waits until the step's value is in the done word: written by the server's
        // stream after the step's kernels (device order), or by the sender after the step's reply; by the sender
        // after O was filled with NaN when the step failed.
        const CUresult r = d_.wait_value64(s, sl.device ? lane.done_word : sl.done_device, *value, kWaitGeq);
        if (r != kSuccess) {
          // The stream cannot wait on the done word: the step is not sent, and the stream's channel goes.
          status = DriverError(d_, "cuStreamWaitValue64 (the step's done word)", r);
          broken = true;
        } else {
          request.mutable_order()->set_wait_value(*value);
          if (sl.device) request.mutable_order()->set_device(true);
          lane.queue.push_back(Queued{request, *value, const_cast<void*>(t.o), t.o != nullptr ? t.q_bytes : 0,
                                      Timeout(call), sl.previous, sl.previous_value});
          if (sl.device) {
            sl.previous = &lane;
            sl.previous_value = *value;
            sl.next_lane ^= 1;
          }
          if (!lane.sender.joinable()) lane.sender = std::thread([this, x = &sl, l = &lane] { Send(*x, *l); });
        }
      }
    }
    request.clear_order();
    if (broken) Drop(s);
    return status;
  }

  absl::Status Sync(void* stream) {
    auto s = static_cast<CUstream>(stream);
    Slot* slot = nullptr;
    {
      absl::MutexLock lock(&mu_);
      auto it = slots_.find(s);
      if (it == slots_.end()) return absl::OkStatus();
      slot = it->second.get();
    }
    bool broken = false;
    absl::Status status;
    {
      absl::MutexLock lock(&slot->mu);
      slot->mu.Await(absl::Condition(+[](Slot* x) { return x->queued() == 0; }, slot));
      status = TakeFailure(*slot, &broken);
    }
    if (broken) Drop(s);
    return status;
  }

  size_t registered() const {
    absl::MutexLock lock(&mu_);
    return regs_.size();
  }

 private:
  struct Registration {
    std::string buffer_id;
    unsigned long long allocation = 0;  // NOLINT(runtime/int): CU_POINTER_ATTRIBUTE_BUFFER_ID
  };
  struct Lane;
  // A submitted step waiting for its stream's sender.
  struct Queued {
    v1::StepRequest request;
    uint64_t value = 0;  // its wait word value, and the done word value that releases the stream
    void* o = nullptr;   // filled with NaN when the step fails
    uint64_t o_bytes = 0;
    absl::Duration timeout;
    Lane* previous = nullptr;  // device order: the channel of the stream's step before it, sent first
    uint64_t previous_value = 0;
  };
  // One of a calling stream's channels, its words as the stream's device sees them, and its sender.
  struct Lane {
    std::unique_ptr<ShmChannel> channel;
    bool registered = false;
    CUdeviceptr word = 0;       // the channel's wait word
    CUdeviceptr done_word = 0;  // the channel's done word (device order)
    std::deque<Queued> queue;   // submitted, not yet answered (the front is being sent)
    const bool* stop = nullptr; // the slot's
    std::thread sender;
  };
  // A calling stream: its channels (two with device order, whose steps alternate between them so that one is
  // admitted while the one before it runs; else one), the last value written to a wait word, and, in host order,
  // the done word its stream waits on after submitted steps (host memory that this process's sender writes).
  struct Slot {
    absl::Mutex mu;  // held while a step on this stream is written and sent, and over the fields below
    bool device = false;
    Lane lanes[2];
    uint64_t next = 0;
    std::atomic<uint64_t>* done = nullptr;  // pinned, mapped host memory (host order)
    CUdeviceptr done_device = 0;
    CUstream fill_stream = nullptr;  // a failed step's NaN fill: not the caller's stream, which waits
    size_t ahead = 4;
    absl::Status failure;      // the first failure of a submitted step not yet reported
    bool broken = false;       // a channel is unusable: later steps fail unsent
    bool stop = false;

    int next_lane = 0;             // device order: the channel of the next submitted step
    Lane* previous = nullptr;      // ... and where the one before it went, if it may be unanswered
    uint64_t previous_value = 0;

    int lane_count() const { return device ? 2 : 1; }
    size_t queued() const { return lanes[0].queue.size() + lanes[1].queue.size(); }
  };

  // The checks and references Step and Submit share; the stream's slot, or null for host order.
  absl::StatusOr<Slot*> Prepare(StepBatch& batch, const DeviceStepTensors& t, CUstream s, const CallOptions& call) {
    v1::StepRequest& request = batch.request();
    request.clear_q(), request.clear_k(), request.clear_v(), request.clear_o_ref(), request.clear_order();
    if ((t.q == nullptr) != (t.o == nullptr)) return absl::InvalidArgumentError("q, o: give both or neither");
    if ((t.k == nullptr) != (t.v == nullptr)) return absl::InvalidArgumentError("k, v: give both or neither");
    const auto ref = [this](const void* p, uint64_t bytes, const char* field) -> absl::StatusOr<v1::TensorRef> {
      absl::StatusOr<v1::TensorRef> r = Ref(p, bytes);
      if (!r.ok()) return absl::Status(r.status().code(), absl::StrCat(field, ": ", r.status().message()));
      return r;
    };
    if (t.q != nullptr) {
      absl::StatusOr<v1::TensorRef> q = ref(t.q, t.q_bytes, "q"), o = ref(t.o, t.q_bytes, "o");
      if (!q.ok()) return q.status();
      if (!o.ok()) return o.status();
      *request.mutable_q()->mutable_ref() = *std::move(q);
      *request.mutable_o_ref() = *std::move(o);
    }
    if (t.k != nullptr) {
      absl::StatusOr<v1::TensorRef> k = ref(t.k, t.kv_bytes, "k"), v = ref(t.v, t.kv_bytes, "v");
      if (!k.ok()) return k.status();
      if (!v.ok()) return v.status();
      *request.mutable_k()->mutable_ref() = *std::move(k);
      *request.mutable_v()->mutable_ref() = *std::move(v);
    }
    absl::StatusOr<bool> ordered = StreamOrdered();
    if (!ordered.ok()) return ordered.status();
    if (!*ordered || call.transport.value_or(client_->options().transport) != Transport::kShm) {
      return static_cast<Slot*>(nullptr);
    }
    absl::StatusOr<Slot*> slot = SlotFor(s);
    if (!slot.ok() && absl::IsInternal(slot.status())) {
      // The device cannot write the channel's page from a stream after all: host order from now on.
      absl::MutexLock lock(&mu_);
      ordered_ = false;
      return static_cast<Slot*>(nullptr);
    }
    return slot;
  }

  // Host order: the stream is synchronised, then the step sent as any other.
  absl::StatusOr<StepResult> StepInHostOrder(const v1::StepRequest& request, CUstream s, const CallOptions& call) {
    const CUresult r = d_.stream_synchronize(s);
    if (r != kSuccess) return DriverError(d_, "cuStreamSynchronize (the step's producers)", r);
    return client_->Step(request, call);
  }

  // Enqueues on `s` the write of the stream's next wait word value (values increase in the order the stream runs
  // them: the caller holds sl.mu) and returns it.
  absl::StatusOr<uint64_t> WriteWaitWord(Slot& sl, Lane& lane, CUstream s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(sl.mu) {
    const uint64_t value = sl.next + 1;
    const CUresult r = d_.write_value64(s, lane.word, value, kWriteDefault);
    if (r != kSuccess) return DriverError(d_, "cuStreamWriteValue64 (the step's wait word)", r);
    sl.next = value;
    return value;
  }

  absl::Duration Timeout(const CallOptions& call) const {
    return call.deadline.value_or(client_->options().default_deadline);
  }
  static absl::Status Gone() {
    return absl::UnavailableError("stream: its channel broke under another thread's step; step again");
  }
  static bool Breaks(const absl::Status& s) { return absl::IsDeadlineExceeded(s) || absl::IsUnavailable(s); }

  // The stream's unreported failure, now reported (cleared); *broken when the channel must go.
  static absl::Status TakeFailure(Slot& sl, bool* broken) ABSL_EXCLUSIVE_LOCKS_REQUIRED(sl.mu) {
    absl::Status f = std::move(sl.failure);
    sl.failure = absl::OkStatus();
    *broken = sl.broken;
    return f;
  }

  // A lane's sender: sends its submitted steps one after another over its channel, each once the stream's step
  // before it is in the server (device order: that one went over the other channel), and releases the stream past
  // each (the done word) once it is answered, unless the server's stream did. A failed step's O is filled with NaN
  // first, and steps queued behind a failure are not sent: they fail with it, so the engine's next layer never
  // reads a stale O as valid.
  void Send(Slot& sl, Lane& lane) {
    d_.ctx_set_current(ctx_);
    for (;;) {
      Queued* q = nullptr;
      absl::Status before;
      {
        absl::MutexLock lock(&sl.mu);
        sl.mu.Await(absl::Condition(+[](Lane* l) { return !l->queue.empty() || *l->stop; }, &lane));
        if (lane.queue.empty()) return;
        q = &lane.queue.front();  // a deque's elements stay put while others are pushed behind them
      }
      if (q->previous != nullptr) AwaitAdmitted(sl, *q->previous, q->previous_value);
      {
        // After the step before it is admitted or answered: a refusal of that one is seen here.
        absl::MutexLock lock(&sl.mu);
        if (!sl.failure.ok()) {
          before = absl::Status(sl.failure.code(), absl::StrCat("not sent: an earlier step on this stream failed: ",
                                                                sl.failure.message()));
        }
      }
      absl::Status status = before;
      if (status.ok()) {
        absl::StatusOr<StepResult> r = StepOverShm(*lane.channel, q->request, q->timeout);
        if (!r.ok()) {
          status = absl::Status(r.status().code(),
                                absl::StrCat("step ", q->request.request_id(), " (layer ", q->request.layer(),
                                             ", submitted): ", r.status().message()));
        }
      }
      if (!status.ok() && q->o != nullptr) FillNaN(sl, lane, *q);
      // Device order: the server's stream wrote the done word after the step's kernels; a step that failed may
      // not have got there.
      if (!sl.device) {
        sl.done->store(q->value, std::memory_order_release);
      } else if (!status.ok()) {
        shm::RaiseWord(lane.channel->done_word(), q->value);
      }
      absl::MutexLock lock(&sl.mu);
      if (!status.ok() && sl.failure.ok()) sl.failure = status;
      if (!status.ok() && Breaks(status)) sl.broken = true;
      lane.queue.pop_front();
    }
  }

  // Until the server has admitted the stream's step `value` (its channel's admitted word), or that step is answered
  // (a refusal comes at once) or will not be sent (an earlier failure), or the stream stops.
  void AwaitAdmitted(Slot& sl, Lane& other, uint64_t value) {
    for (int polls = 0;; ++polls) {
      if (static_cast<int64_t>(other.channel->admitted_word()->load(std::memory_order_acquire) - value) >= 0) return;
      if (polls % 64 == 63) {
        absl::MutexLock lock(&sl.mu);
        if (!sl.failure.ok() || sl.stop || other.queue.empty() || other.queue.front().value > value) return;
      }
      if (polls < 4096) {
        shm::CpuRelax();
      } else {
        absl::SleepFor(absl::Microseconds(20));
      }
    }
  }

  // A failed step's O, filled with NaN on another stream: after what the caller queued before the step (which may
  // write O too), so once the caller's stream has written the step's wait word, or after the step's timeout.
  void FillNaN(Slot& sl, Lane& lane, const Queued& q) {
    const absl::Time give_up = absl::Now() + q.timeout;
    while (static_cast<int64_t>(lane.channel->wait_word()->load(std::memory_order_acquire) - q.value) < 0 &&
           absl::Now() < give_up) {
      absl::SleepFor(absl::Microseconds(50));
    }
    // 0xFFFF is a NaN in bf16 and in fp16.
    if (d_.memset_d16_async(reinterpret_cast<CUdeviceptr>(q.o), 0xFFFF, q.o_bytes / 2, sl.fill_stream) == kSuccess) {
      d_.stream_synchronize(sl.fill_stream);
    }
  }

  // Ends a slot's senders after the steps they hold are answered (or failed).
  void StopSender(Slot& sl) {
    {
      absl::MutexLock lock(&sl.mu);
      sl.stop = true;
    }
    for (Lane& lane : sl.lanes) {
      if (lane.sender.joinable()) lane.sender.join();
    }
  }

  // Gives a slot's CUDA resources back, once no stream can still use them.
  void Release(Slot& sl) {
    for (Lane& lane : sl.lanes) {
      if (lane.registered) d_.mem_host_unregister(lane.channel->header_page());
      lane.registered = false;
    }
    if (sl.done != nullptr) d_.mem_free_host(sl.done);
    sl.done = nullptr;
    if (sl.fill_stream != nullptr) d_.stream_destroy(sl.fill_stream);
    sl.fill_stream = nullptr;
  }

  absl::StatusOr<std::string> Register(CUdeviceptr start, size_t size, unsigned long long allocation,  // NOLINT
                                       int ordinal) {
    unsigned char handle[kIpcHandleBytes];
    const CUresult r = d_.ipc_get_mem_handle(handle, start);
    if (r != kSuccess) {
      return absl::FailedPreconditionError(absl::StrCat(
          "its allocation cannot be exported by CUDA IPC (driver error ", r,
          "); memory from cuMemCreate, such as torch's expandable segments, cannot be shared this way"));
    }
    v1::RegisterCudaBufferRequest req;
    req.set_ipc_handle(reinterpret_cast<const char*>(handle), kIpcHandleBytes);
    req.set_device(ordinal);
    req.set_offset(0);
    req.set_byte_size(size);
    req.set_name("attnd-cuda-steps");
    absl::StatusOr<std::string> id = client_->RegisterCudaBuffer(req);
    if (!id.ok()) return id.status();
    std::string stale;
    {
      absl::MutexLock lock(&mu_);
      Registration& reg = regs_[start];
      stale = std::move(reg.buffer_id);  // an allocation freed since: its range holds another one now
      reg.buffer_id = *id;
      reg.allocation = allocation;
    }
    if (!stale.empty()) client_->UnregisterCudaBuffer(stale).IgnoreError();
    return id;
  }

  // A channel of a stream's, its header page registered with CUDA: the words the stream writes and waits on.
  absl::Status OpenLane(Lane& lane) {
    ShmChannelOptions co;
    co.socket_path = client_->options().shm_socket;
    co.auth_token = client_->options().auth_token;
    absl::StatusOr<std::unique_ptr<ShmChannel>> channel = ShmChannel::Connect(co);
    if (!channel.ok()) return channel.status();
    lane.channel = *std::move(channel);
    void* page = lane.channel->header_page();
    CUresult r = d_.mem_host_register(page, shm::kHeaderBytes, kHostRegisterDeviceMap);
    if (r != kSuccess) return DriverError(d_, "cuMemHostRegister (the channel's wait word)", r);
    lane.registered = true;
    CUdeviceptr base = 0;
    r = d_.mem_host_get_device_pointer(&base, page, 0);
    if (r != kSuccess) return DriverError(d_, "cuMemHostGetDevicePointer (the channel's wait word)", r);
    lane.word = base + shm::kWaitWordOffset;
    lane.done_word = base + shm::kDoneWordOffset;
    return absl::OkStatus();
  }

  absl::StatusOr<Slot*> SlotFor(CUstream stream) {
    absl::MutexLock lock(&mu_);
    auto it = slots_.find(stream);
    if (it != slots_.end()) return it->second.get();
    if (slots_.size() >= kMaxStreams) {
      return absl::ResourceExhaustedError(
          absl::StrCat("stream: a client orders steps on at most ", kMaxStreams, " streams"));
    }
    auto slot = std::make_unique<Slot>();
    slot->device = device_ordered_.value_or(false);
    for (int i = 0; i < slot->lane_count(); ++i) {
      absl::Status opened = OpenLane(slot->lanes[i]);
      if (!opened.ok()) {
        Release(*slot);
        return opened;
      }
      slot->lanes[i].stop = &slot->stop;
    }
    CUresult r = kSuccess;
    void* done = nullptr;
    r = d_.mem_host_alloc(&done, 64, kHostAllocPortableMapped);
    if (r != kSuccess) {
      Release(*slot);
      return DriverError(d_, "cuMemHostAlloc (the stream's done word)", r);
    }
    slot->done = new (done) std::atomic<uint64_t>(0);
    r = d_.mem_host_get_device_pointer(&slot->done_device, done, 0);
    if (r == kSuccess) r = d_.stream_create(&slot->fill_stream, kStreamNonBlocking);
    if (r != kSuccess) {
      Release(*slot);
      return DriverError(d_, "the stream's done word", r);
    }
    slot->ahead = std::max<size_t>(1, options_.max_steps_ahead);
    Slot* s = slot.get();
    slots_.emplace(stream, std::move(slot));
    return s;
  }

  // Forgets a stream's channel after it broke (the caller holds none of its locks); the steps it holds are answered
  // first, and its word's writes already queued land.
  void Drop(CUstream stream) {
    std::unique_ptr<Slot> slot;
    {
      absl::MutexLock lock(&mu_);
      auto it = slots_.find(stream);
      if (it == slots_.end()) return;
      slot = std::move(it->second);
      slots_.erase(it);
    }
    StopSender(*slot);
    d_.stream_synchronize(stream);
    Release(*slot);
    {
      absl::MutexLock lock(&slot->mu);
      for (Lane& lane : slot->lanes) lane.channel.reset();  // the server's ends go too
    }
    // Another thread stepping on this stream may still hold the slot: it lives until the client goes.
    absl::MutexLock lock(&mu_);
    retired_.push_back(std::move(slot));
  }

  Client* const client_;
  const Driver& d_;
  const CUcontext ctx_;
  const int device_;
  const CudaStepsOptions options_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<CUdeviceptr, Registration> regs_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<CUstream, std::unique_ptr<Slot>> slots_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<Slot>> retired_ ABSL_GUARDED_BY(mu_);  // broken channels' slots (Drop)
  std::optional<bool> ordered_ ABSL_GUARDED_BY(mu_);
  std::optional<bool> device_ordered_ ABSL_GUARDED_BY(mu_);
};

absl::StatusOr<std::unique_ptr<CudaSteps>> CudaSteps::Create(Client* client, const CudaStepsOptions& options) {
  const Driver* d = LoadDriver();
  if (d == nullptr) return absl::FailedPreconditionError("CUDA steps: libcuda.so.1 cannot be loaded");
  CUcontext ctx = nullptr;
  int device = -1;
  if (d->init(0) != kSuccess) return absl::FailedPreconditionError("CUDA steps: cuInit failed (no usable GPU)");
  if (d->ctx_get_current(&ctx) != kSuccess || ctx == nullptr) {
    // No context on this thread yet: device 0's primary context, the one the runtime (and torch) use.
    if (d->primary_ctx_retain(&ctx, 0) != kSuccess || d->ctx_set_current(ctx) != kSuccess) {
      return absl::FailedPreconditionError("CUDA steps: no CUDA context on the calling thread, nor device 0's");
    }
  }
  if (d->ctx_get_device(&device) != kSuccess) return absl::FailedPreconditionError("CUDA steps: cuCtxGetDevice failed");
  return std::unique_ptr<CudaSteps>(new CudaSteps(std::make_unique<Impl>(client, d, ctx, device, options)));
}

CudaSteps::CudaSteps(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaSteps::~CudaSteps() = default;

absl::StatusOr<v1::TensorRef> CudaSteps::Ref(const void* ptr, uint64_t bytes) { return impl_->Ref(ptr, bytes); }
absl::StatusOr<StepResult> CudaSteps::Step(StepBatch& batch, const DeviceStepTensors& tensors, void* stream,
                                           const CallOptions& call) {
  return impl_->Step(batch, tensors, stream, call);
}
absl::Status CudaSteps::Submit(StepBatch& batch, const DeviceStepTensors& tensors, void* stream,
                               const CallOptions& call) {
  return impl_->Submit(batch, tensors, stream, call);
}
absl::Status CudaSteps::Sync(void* stream) { return impl_->Sync(stream); }
absl::StatusOr<bool> CudaSteps::StreamOrdered() { return impl_->StreamOrdered(); }
size_t CudaSteps::registered() const { return impl_->registered(); }

}  // namespace attnd::client
