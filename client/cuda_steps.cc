#include "attnd/client/cuda_steps.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstring>
#include <optional>
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
constexpr unsigned kWriteDefault = 0, kHostRegisterDeviceMap = 2;
constexpr size_t kIpcHandleBytes = 64;
constexpr size_t kMaxStreams = 256;  // streams one client may order steps on (a channel and a server thread each)

struct Driver {
  CUresult (*pointer_get_attributes)(unsigned, int*, void**, CUdeviceptr) = nullptr;
  CUresult (*ipc_get_mem_handle)(void*, CUdeviceptr) = nullptr;
  CUresult (*write_value64)(CUstream, CUdeviceptr, uint64_t, unsigned) = nullptr;
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
    // Writes of wait words may still be queued on the callers' streams: they land before the pages go.
    if (!slots_.empty()) d_.ctx_synchronize();
    for (auto& [stream, slot] : slots_) {
      if (slot->registered) d_.mem_host_unregister(slot->channel->header_page());
    }
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
    }
    return *ordered_;
  }

  absl::StatusOr<StepResult> Step(StepBatch& batch, const DeviceStepTensors& t, void* stream, const CallOptions& call) {
    d_.ctx_set_current(ctx_);  // any calling thread: the driver calls below name the context's memory
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
    *ordered = *ordered && call.transport.value_or(client_->options().transport) == Transport::kShm;
    auto s = static_cast<CUstream>(stream);
    absl::StatusOr<Slot*> slot = *ordered ? SlotFor(s) : absl::StatusOr<Slot*>(nullptr);
    if (!slot.ok() && absl::IsInternal(slot.status())) {
      // The device cannot write the channel's page from a stream after all: host order from now on.
      absl::MutexLock lock(&mu_);
      ordered_ = false;
      slot = nullptr;
    }
    if (!slot.ok()) return slot.status();
    if (*slot == nullptr) {
      const CUresult r = d_.stream_synchronize(s);
      if (r != kSuccess) return DriverError(d_, "cuStreamSynchronize (the step's producers)", r);
      return client_->Step(request, call);
    }
    // One step at a time per stream and channel: values increase in the order the stream runs their writes.
    absl::MutexLock stream_lock(&(*slot)->mu);
    const uint64_t value = (*slot)->next + 1;
    const CUresult r = d_.write_value64(s, (*slot)->word, value, kWriteDefault);
    if (r != kSuccess) return DriverError(d_, "cuStreamWriteValue64 (the step's wait word)", r);
    (*slot)->next = value;
    request.mutable_order()->set_wait_value(value);
    const absl::Duration timeout = call.deadline.value_or(client_->options().default_deadline);
    absl::StatusOr<StepResult> result = StepOverShm(*(*slot)->channel, request, timeout);
    request.clear_order();
    if (!result.ok() && (absl::IsDeadlineExceeded(result.status()) || absl::IsUnavailable(result.status()))) {
      // The channel is unusable now (shm_channel.h): the next step on this stream opens another.
      Drop(s);
    }
    return result;
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
  // A calling stream's channel and its wait word as the stream's device sees it.
  struct Slot {
    absl::Mutex mu;  // held while a step on this stream is written and sent
    std::unique_ptr<ShmChannel> channel;
    bool registered = false;
    CUdeviceptr word = 0;
    uint64_t next = 0;  // the last value written to the word (under mu)
  };

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

  absl::StatusOr<Slot*> SlotFor(CUstream stream) {
    absl::MutexLock lock(&mu_);
    auto it = slots_.find(stream);
    if (it != slots_.end()) return it->second.get();
    if (slots_.size() >= kMaxStreams) {
      return absl::ResourceExhaustedError(
          absl::StrCat("stream: a client orders steps on at most ", kMaxStreams, " streams"));
    }
    ShmChannelOptions co;
    co.socket_path = client_->options().shm_socket;
    co.auth_token = client_->options().auth_token;
    absl::StatusOr<std::unique_ptr<ShmChannel>> channel = ShmChannel::Connect(co);
    if (!channel.ok()) return channel.status();
    auto slot = std::make_unique<Slot>();
    slot->channel = *std::move(channel);
    void* page = slot->channel->header_page();
    CUresult r = d_.mem_host_register(page, shm::kHeaderBytes, kHostRegisterDeviceMap);
    if (r != kSuccess) return DriverError(d_, "cuMemHostRegister (the channel's wait word)", r);
    slot->registered = true;
    CUdeviceptr base = 0;
    r = d_.mem_host_get_device_pointer(&base, page, 0);
    if (r != kSuccess) {
      d_.mem_host_unregister(page);
      return DriverError(d_, "cuMemHostGetDevicePointer (the channel's wait word)", r);
    }
    slot->word = base + shm::kWaitWordOffset;
    Slot* s = slot.get();
    slots_.emplace(stream, std::move(slot));
    return s;
  }

  // Forgets a stream's channel after it broke; its word's writes already queued land first.
  void Drop(CUstream stream) {
    std::unique_ptr<Slot> slot;
    {
      absl::MutexLock lock(&mu_);
      auto it = slots_.find(stream);
      if (it == slots_.end()) return;
      slot = std::move(it->second);
      slots_.erase(it);
    }
    d_.stream_synchronize(stream);
    if (slot->registered) d_.mem_host_unregister(slot->channel->header_page());
    slot->registered = false;
    slot->channel.reset();  // the server's end of it goes too
    // The caller holds slot->mu (Step), which its MutexLock releases later: the slot lives until the client goes.
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
absl::StatusOr<bool> CudaSteps::StreamOrdered() { return impl_->StreamOrdered(); }
size_t CudaSteps::registered() const { return impl_->registered(); }

}  // namespace attnd::client
