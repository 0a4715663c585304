// The C ABI of attnd_client_c.h over attnd::client::Client and ShmChannel.
#include "attnd_client_c.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <future>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "attnd/client/bench.h"
#include "attnd/client/client.h"
#include "attnd/client/cuda_steps.h"
#include "attnd/client/shm_channel.h"
#include "google/protobuf/util/json_util.h"

#define ATTND_C_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

using attnd::DType;
using attnd::Mask;
using attnd::client::ForwardResult;
using attnd::client::Transport;
namespace v1 = attnd::v1;

constexpr int64_t kElemBytes = 2;  // bf16 and fp16
// A shared-memory channel's areas are at least this large, so that one channel serves calls of many sizes.
constexpr uint64_t kShmMinAreaBytes = 1ull << 20;

void Copy(char* dst, size_t cap, const std::string& s) {
  if (cap == 0) return;
  const size_t n = std::min(cap - 1, s.size());
  std::memcpy(dst, s.data(), n);
  dst[n] = '\0';
}

int32_t Fail(attnd_error* err, const absl::Status& s, const std::string& request_id = "") {
  if (err != nullptr) {
    err->code = static_cast<int32_t>(s.code());
    Copy(err->message, sizeof(err->message), std::string(s.message()));
    Copy(err->request_id, sizeof(err->request_id), request_id);
  }
  return static_cast<int32_t>(s.code());
}

void Ok(attnd_error* err) {
  if (err != nullptr) {
    err->code = 0;
    err->message[0] = '\0';
    err->request_id[0] = '\0';
  }
}

std::string Str(const char* s) { return s == nullptr ? std::string() : std::string(s); }

char* Dup(const std::string& s) {
  char* out = static_cast<char*>(std::malloc(s.size() + 1));
  if (out == nullptr) return nullptr;
  std::memcpy(out, s.data(), s.size());
  out[s.size()] = '\0';
  return out;
}

absl::StatusOr<std::string> ToJson(const google::protobuf::Message& m) {
  google::protobuf::util::JsonPrintOptions o;
  o.always_print_primitive_fields = true;
  o.preserve_proto_field_names = true;
  std::string out;
  auto s = google::protobuf::util::MessageToJsonString(m, &out, o);
  if (!s.ok()) return absl::InternalError(absl::StrCat("JSON of ", m.GetTypeName(), ": ", s.ToString()));
  return out;
}

// One shared-memory channel and the request/reply sizes it was opened for.
struct ShmSlot {
  std::unique_ptr<attnd::client::ShmChannel> channel;
  uint64_t request_capacity = 0, reply_capacity = 0;
};

}  // namespace

struct attnd_client {
  std::unique_ptr<attnd::client::Client> client;
  Transport transport = Transport::kAuto;
  std::string shm_socket, auth_token;
  uint64_t shm_max_bytes = 64ull << 20;
  absl::Duration default_timeout = absl::Seconds(120);
  std::string id_prefix;
  std::atomic<uint64_t> next_id{0};

  // Made on the first CUDA step, on that thread's context; destroyed before `client`.
  absl::Mutex cuda_mu;
  std::unique_ptr<attnd::client::CudaSteps> cuda ABSL_GUARDED_BY(cuda_mu);

  absl::Mutex mu;
  int64_t in_flight ABSL_GUARDED_BY(mu) = 0;
  // Idle channels: a channel carries one request at a time, so each call in flight over shm holds one.
  std::vector<ShmSlot> shm_idle ABSL_GUARDED_BY(mu);

  // The caller's request id, or one this library makes (so that errors can name it).
  std::string RequestId(const char* given) {
    if (given != nullptr && given[0] != '\0') return given;
    return absl::StrCat(id_prefix, next_id.fetch_add(1, std::memory_order_relaxed));
  }

  void Begin() {
    absl::MutexLock l(&mu);
    ++in_flight;
  }
  void End() {
    absl::MutexLock l(&mu);
    --in_flight;
  }

  absl::StatusOr<ShmSlot> TakeShm(const v1::ForwardRequest& request) {
    auto need = attnd::client::ShmChannelOptionsFor(request, shm_socket, shm_max_bytes);
    if (!need.ok()) return need.status();
    {
      absl::MutexLock l(&mu);
      for (size_t i = 0; i < shm_idle.size(); ++i) {
        if (shm_idle[i].request_capacity >= need->request_capacity &&
            shm_idle[i].reply_capacity >= need->reply_capacity) {
          ShmSlot slot = std::move(shm_idle[i]);
          shm_idle.erase(shm_idle.begin() + static_cast<std::ptrdiff_t>(i));
          return slot;
        }
      }
    }
    attnd::client::ShmChannelOptions o = *need;
    o.request_capacity = std::min(shm_max_bytes, std::max(o.request_capacity, kShmMinAreaBytes));
    o.reply_capacity = std::min(shm_max_bytes, std::max(o.reply_capacity, kShmMinAreaBytes));
    o.auth_token = auth_token;
    auto channel = attnd::client::ShmChannel::Connect(o);
    if (!channel.ok()) return channel.status();
    return ShmSlot{*std::move(channel), o.request_capacity, o.reply_capacity};
  }
  void ReturnShm(ShmSlot slot) {
    absl::MutexLock l(&mu);
    shm_idle.push_back(std::move(slot));
  }
};

namespace {

bool Contiguous(const attnd_tensor& t, int64_t seq, int64_t heads, int64_t dim) {
  const int64_t* s = t.strides;
  return (s[0] == 0 && s[1] == 0 && s[2] == 0) || (s[0] == seq * heads * dim && s[1] == heads * dim && s[2] == dim);
}

// An inline tensor's bytes, contiguous: a view of the caller's memory, or a gathered copy of a strided one.
struct Inline {
  std::string copy;
  std::string_view bytes;
};

absl::Status Gather(const char* name, const attnd_tensor& t, int64_t batch, int64_t seq, int64_t heads, int64_t dim,
                    Inline* out) {
  if (t.data == nullptr) return absl::InvalidArgumentError(absl::StrCat(name, ": no data and no buffer_id"));
  const auto* base = static_cast<const char*>(t.data);
  const size_t row = static_cast<size_t>(dim * kElemBytes);
  const uint64_t bytes = static_cast<uint64_t>(batch * seq * heads) * row;
  if (Contiguous(t, seq, heads, dim)) {
    out->bytes = std::string_view(base, bytes);
    return absl::OkStatus();
  }
  out->copy.resize(bytes);
  char* dst = out->copy.data();
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t s = 0; s < seq; ++s) {
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t e = b * t.strides[0] + s * t.strides[1] + h * t.strides[2];
        std::memcpy(dst, base + e * kElemBytes, row);
        dst += row;
      }
    }
  }
  out->bytes = out->copy;
  return absl::OkStatus();
}

void SetRef(const attnd_tensor& t, int64_t seq, int64_t heads, int64_t dim, v1::TensorRef* ref) {
  ref->set_buffer_id(t.buffer_id);
  ref->set_offset(t.offset);
  if (!Contiguous(t, seq, heads, dim)) {
    for (int i = 0; i < 3; ++i) ref->add_strides(t.strides[i]);
  }
}

bool IsRef(const attnd_tensor& t) { return t.buffer_id != nullptr && t.buffer_id[0] != '\0'; }

// Everything one call owns until it completes: the request or the spec and inputs, gathered copies.
struct Call {
  attnd_client* c = nullptr;
  std::string request_id;
  Transport transport = Transport::kAuto;
  attnd::client::CallOptions options;
  char* o = nullptr;  // the caller's O when inline, for the shm path's copy-out
  float* lse = nullptr;
  uint64_t o_bytes = 0, lse_bytes = 0;
  // The request path (a buffer reference, or the shm channel).
  std::shared_ptr<v1::ForwardRequest> request;
  // The inline path.
  attnd::client::RequestSpec spec;
  std::shared_ptr<Inline> q, k, v;
};

absl::Status Prepare(attnd_client* c, const attnd_forward_args* a, Call* call) {
  if (a == nullptr) return absl::InvalidArgumentError("args: NULL");
  const struct {
    const char* name;
    int64_t v;
  } dims[] = {{"shape.batch", a->batch},       {"shape.q_len", a->q_len},       {"shape.kv_len", a->kv_len},
              {"shape.q_heads", a->q_heads},   {"shape.kv_heads", a->kv_heads}, {"shape.head_dim", a->head_dim}};
  for (const auto& d : dims) {
    if (d.v < 1) return absl::InvalidArgumentError(absl::StrCat(d.name, ": must be >= 1, got ", d.v));
  }
  if (a->dtype != ATTND_DTYPE_BF16 && a->dtype != ATTND_DTYPE_FP16) {
    return absl::InvalidArgumentError(absl::StrCat("dtype: unknown value ", a->dtype));
  }
  if (a->mask < ATTND_MASK_NONE || a->mask > ATTND_MASK_CAUSAL_BOTTOM_RIGHT) {
    return absl::InvalidArgumentError(absl::StrCat("mask: unknown value ", a->mask));
  }
  if (a->transport < ATTND_TRANSPORT_DEFAULT || a->transport > ATTND_TRANSPORT_SHM) {
    return absl::InvalidArgumentError(absl::StrCat("transport: unknown value ", a->transport));
  }
  call->c = c;
  call->transport = a->transport == ATTND_TRANSPORT_DEFAULT ? c->transport : static_cast<Transport>(a->transport);
  call->request_id = c->RequestId(a->request_id);
  auto& spec = call->spec;
  spec.shape = attnd::Shape{a->batch, a->q_len, a->kv_len, a->q_heads, a->kv_heads, a->head_dim};
  spec.dtype = static_cast<DType>(a->dtype);
  spec.mask = static_cast<Mask>(a->mask);
  if (a->has_scale) spec.scale = a->scale;
  spec.want_lse = a->want_lse != 0;
  spec.request_id = call->request_id;
  // The server writes O contiguous, into a registered buffer or the reply.
  if (!Contiguous(a->o, a->q_len, a->q_heads, a->head_dim)) return absl::InvalidArgumentError("o: must be contiguous");
  if (!IsRef(a->o)) {
    if (a->o.data == nullptr) return absl::InvalidArgumentError("o: no data and no buffer_id");
    call->o = static_cast<char*>(const_cast<void*>(a->o.data));
    call->o_bytes = spec.o_bytes();
  }
  if (spec.want_lse) {
    if (a->lse == nullptr) return absl::InvalidArgumentError("lse: NULL while want_lse is set");
    call->lse = a->lse;
    call->lse_bytes = spec.lse_bytes();
  }
  if (a->timeout_s > 0) call->options.deadline = absl::Seconds(a->timeout_s);
  call->options.outputs = attnd::client::ForwardOutputs{
      absl::Span<char>(call->o, call->o_bytes), absl::Span<char>(reinterpret_cast<char*>(call->lse), call->lse_bytes)};
  if (call->transport != Transport::kShm) call->options.transport = call->transport;

  const bool any_ref = IsRef(a->q) || IsRef(a->k) || IsRef(a->v) || IsRef(a->o);
  struct {
    const char* name;
    const attnd_tensor& t;
    int64_t seq, heads;
    std::shared_ptr<Inline>* keep;
  } tensors[] = {{"q", a->q, a->q_len, a->q_heads, &call->q},
                 {"k", a->k, a->kv_len, a->kv_heads, &call->k},
                 {"v", a->v, a->kv_len, a->kv_heads, &call->v}};
  if (!any_ref && call->transport != Transport::kShm) {
    for (auto& t : tensors) {
      *t.keep = std::make_shared<Inline>();
      if (auto s = Gather(t.name, t.t, a->batch, t.seq, t.heads, a->head_dim, t.keep->get()); !s.ok()) return s;
    }
    return absl::OkStatus();
  }
  // A request message: references go as TensorRefs, inline tensors are copied into it.
  auto req = std::make_shared<v1::ForwardRequest>(
      attnd::client::MakeForwardRequest(spec, std::string(), std::string(), std::string()));
  v1::TensorInput* inputs[] = {req->mutable_q(), req->mutable_k(), req->mutable_v()};
  for (int i = 0; i < 3; ++i) {
    const auto& t = tensors[i];
    if (IsRef(t.t)) {
      SetRef(t.t, t.seq, t.heads, a->head_dim, inputs[i]->mutable_ref());
    } else {
      Inline in;
      if (auto s = Gather(t.name, t.t, a->batch, t.seq, t.heads, a->head_dim, &in); !s.ok()) return s;
      if (in.copy.empty()) {
        inputs[i]->set_data(in.bytes.data(), in.bytes.size());
      } else {
        inputs[i]->set_data(std::move(in.copy));
      }
    }
  }
  if (IsRef(a->o)) SetRef(a->o, a->q_len, a->q_heads, a->head_dim, req->mutable_o_ref());
  call->request = std::move(req);
  return absl::OkStatus();
}

void FillInfo(const ForwardResult& r, attnd_forward_info* info) {
  if (info == nullptr) return;
  Copy(info->request_id, sizeof(info->request_id), r.request_id);
  Copy(info->backend, sizeof(info->backend), r.backend);
  Copy(info->kernel, sizeof(info->kernel), r.kernel);
  info->device = r.device;
  info->transport = static_cast<int32_t>(r.transport);
  info->queue_us = r.timing.queue_us();
  info->h2d_us = r.timing.h2d_us();
  info->kernel_us = r.timing.kernel_us();
  info->d2h_us = r.timing.d2h_us();
  info->total_us = r.timing.total_us();
  info->latency_us = absl::ToDoubleMicroseconds(r.latency);
}

// The shm path, synchronously: one idle channel (or a new one), the reply copied into the caller's memory.
absl::StatusOr<ForwardResult> RunShm(Call& call) {
  attnd_client* c = call.c;
  if (c->shm_socket.empty()) {
    return absl::InvalidArgumentError("transport: shm needs the client's shm_socket (the server's --shm_socket)");
  }
  auto slot = c->TakeShm(*call.request);
  if (!slot.ok()) return slot.status();
  const absl::Duration timeout = call.options.deadline.value_or(c->default_timeout);
  auto res = attnd::client::ForwardOverShm(*slot->channel, *call.request, timeout);
  if (!res.ok()) {
    // After these the channel may still receive a late reply: it is closed, not reused.
    if (!absl::IsDeadlineExceeded(res.status()) && !absl::IsUnavailable(res.status())) c->ReturnShm(*std::move(slot));
    return res.status();
  }
  c->ReturnShm(*std::move(slot));
  if (call.o != nullptr) std::memcpy(call.o, res->o.data(), std::min<size_t>(call.o_bytes, res->o.size()));
  if (call.lse != nullptr) std::memcpy(call.lse, res->lse.data(), std::min<size_t>(call.lse_bytes, res->lse.size()));
  return res;
}

// Starts the call; `done` runs exactly once. The client's in-flight count covers it until `done` returns.
void Start(std::shared_ptr<Call> call, std::function<void(absl::StatusOr<ForwardResult>)> done) {
  attnd_client* c = call->c;
  c->Begin();
  auto finish = [c, done = std::move(done)](absl::StatusOr<ForwardResult> r) {
    done(std::move(r));
    c->End();
  };
  if (call->transport == Transport::kShm) {
    std::thread([call, finish = std::move(finish)]() mutable { finish(RunShm(*call)); }).detach();
    return;
  }
  auto cb = [call, finish = std::move(finish)](absl::StatusOr<ForwardResult> r) { finish(std::move(r)); };
  if (call->request != nullptr) {
    c->client->ForwardAsync(call->request, std::move(cb), call->options);
    return;
  }
  attnd::client::ForwardInputs in;
  in.q = call->q->bytes;
  in.k = call->k->bytes;
  in.v = call->v->bytes;
  in.keep_alive = call;
  c->client->ForwardAsync(call->spec, std::move(in), std::move(cb), call->options);
}

}  // namespace

ATTND_C_EXPORT int32_t attnd_abi_version(void) { return ATTND_C_ABI_VERSION; }

ATTND_C_EXPORT void attnd_free_string(char* s) { std::free(s); }

ATTND_C_EXPORT attnd_client* attnd_client_create(const attnd_client_options* options, attnd_error* err) {
  if (options == nullptr || options->target == nullptr || options->target[0] == '\0') {
    Fail(err, absl::InvalidArgumentError("target: required"));
    return nullptr;
  }
  if (options->transport < ATTND_TRANSPORT_AUTO || options->transport > ATTND_TRANSPORT_SHM) {
    Fail(err, absl::InvalidArgumentError(absl::StrCat("transport: unknown value ", options->transport)));
    return nullptr;
  }
  const auto transport = static_cast<Transport>(options->transport);
  if (transport == Transport::kShm && Str(options->shm_socket).empty()) {
    Fail(err, absl::InvalidArgumentError("shm_socket: required with transport shm"));
    return nullptr;
  }
  attnd::client::ClientOptions o;
  o.target = options->target;
  // The gRPC client carries everything but shm calls (which go over ShmChannels, not through it).
  o.transport = transport == Transport::kShm ? Transport::kAuto : transport;
  o.tls_ca_file = Str(options->tls_ca_file);
  o.tls_server_name = Str(options->tls_server_name);
  o.auth_token = Str(options->auth_token);
  // Step calls with transport shm go over the C++ client's own shared-memory channels.
  o.shm_socket = Str(options->shm_socket);
  if (options->shm_max_bytes > 0) o.shm_max_area_bytes = options->shm_max_bytes;
  if (options->default_timeout_s > 0) o.default_deadline = absl::Seconds(options->default_timeout_s);
  auto client = attnd::client::Client::Create(o);
  if (!client.ok()) {
    Fail(err, client.status());
    return nullptr;
  }
  auto* c = new attnd_client;
  c->client = *std::move(client);
  c->transport = transport;
  c->shm_socket = Str(options->shm_socket);
  c->auth_token = o.auth_token;
  c->default_timeout = o.default_deadline;
  if (options->shm_max_bytes > 0) c->shm_max_bytes = options->shm_max_bytes;
  std::random_device rd;
  c->id_prefix = absl::StrFormat("c%08x%08x-", rd(), rd());
  Ok(err);
  return c;
}

ATTND_C_EXPORT void attnd_client_destroy(attnd_client* client) {
  if (client == nullptr) return;
  {
    absl::MutexLock l(&client->mu);
    client->mu.Await(absl::Condition(
        +[](int64_t* n) { return *n == 0; }, &client->in_flight));
  }
  delete client;
}

ATTND_C_EXPORT char* attnd_client_info_json(attnd_client* client, int32_t refresh, attnd_error* err) {
  auto info = client->client->ServerInfo(refresh != 0);
  if (!info.ok()) return Fail(err, info.status()), nullptr;
  auto json = ToJson(*info);
  if (!json.ok()) return Fail(err, json.status()), nullptr;
  Ok(err);
  return Dup(*json);
}

ATTND_C_EXPORT char* attnd_client_stats_json(attnd_client* client, attnd_error* err) {
  auto stats = client->client->Stats();
  if (!stats.ok()) return Fail(err, stats.status()), nullptr;
  auto json = ToJson(*stats);
  if (!json.ok()) return Fail(err, json.status()), nullptr;
  Ok(err);
  return Dup(*json);
}

ATTND_C_EXPORT int32_t attnd_client_health(attnd_client* client, const char* service, attnd_error* err) {
  absl::Status s = client->client->CheckHealth(Str(service));
  if (!s.ok()) return Fail(err, s);
  Ok(err);
  return 0;
}

ATTND_C_EXPORT int32_t attnd_forward(attnd_client* client, const attnd_forward_args* args, attnd_forward_info* info,
                                     attnd_error* err) {
  auto call = std::make_shared<Call>();
  if (absl::Status s = Prepare(client, args, call.get()); !s.ok()) return Fail(err, s, call->request_id);
  if (call->transport == Transport::kShm) {  // synchronous already: no thread
    client->Begin();
    auto r = RunShm(*call);
    client->End();
    if (!r.ok()) return Fail(err, r.status(), call->request_id);
    FillInfo(*r, info);
    Ok(err);
    return 0;
  }
  std::promise<absl::StatusOr<ForwardResult>> p;
  auto f = p.get_future();
  Start(call, [&p](absl::StatusOr<ForwardResult> r) { p.set_value(std::move(r)); });
  auto r = f.get();
  if (!r.ok()) return Fail(err, r.status(), call->request_id);
  FillInfo(*r, info);
  Ok(err);
  return 0;
}

ATTND_C_EXPORT int32_t attnd_forward_async(attnd_client* client, const attnd_forward_args* args, attnd_done_fn done,
                                           void* user, attnd_error* err) {
  auto call = std::make_shared<Call>();
  if (absl::Status s = Prepare(client, args, call.get()); !s.ok()) return Fail(err, s, call->request_id);
  if (done == nullptr) return Fail(err, absl::InvalidArgumentError("done: NULL"), call->request_id);
  const std::string id = call->request_id;
  Start(call, [done, user, id](absl::StatusOr<ForwardResult> r) {
    attnd_error e;
    attnd_forward_info info{};
    if (r.ok()) {
      Ok(&e);
      FillInfo(*r, &info);
    } else {
      Fail(&e, r.status(), id);
    }
    done(user, &e, r.ok() ? &info : nullptr);
  });
  Ok(err);
  return 0;
}

ATTND_C_EXPORT int32_t attnd_register_cuda_buffer(attnd_client* client, const uint8_t* ipc_handle, int32_t device,
                                                  uint64_t offset, uint64_t byte_size, const char* name,
                                                  char* buffer_id, size_t cap, attnd_error* err) {
  if (ipc_handle == nullptr) return Fail(err, absl::InvalidArgumentError("ipc_handle: NULL"));
  v1::RegisterCudaBufferRequest req;
  req.set_ipc_handle(reinterpret_cast<const char*>(ipc_handle), 64);
  req.set_device(device);
  req.set_offset(offset);
  req.set_byte_size(byte_size);
  req.set_name(Str(name));
  auto id = client->client->RegisterCudaBuffer(req);
  if (!id.ok()) return Fail(err, id.status());
  if (buffer_id == nullptr || cap <= id->size()) {
    // Too small to return the id: drop the registration rather than leak it.
    (void)client->client->UnregisterCudaBuffer(*id);
    return Fail(err, absl::InvalidArgumentError(absl::StrCat("buffer_id: needs ", id->size() + 1, " bytes")));
  }
  Copy(buffer_id, cap, *id);
  Ok(err);
  return 0;
}

ATTND_C_EXPORT int32_t attnd_unregister_cuda_buffer(attnd_client* client, const char* buffer_id, attnd_error* err) {
  absl::Status s = client->client->UnregisterCudaBuffer(Str(buffer_id));
  if (!s.ok()) return Fail(err, s);
  Ok(err);
  return 0;
}

// ---- KV sequences ----------------------------------------------------------------------------------------------

namespace {

std::string JoinIds(const std::vector<std::string>& ids) {
  std::string out;
  for (const auto& id : ids) {
    if (!out.empty()) out += '\n';
    out += id;
  }
  return out;
}

attnd::client::CallOptions CallFor(attnd_client* c, int32_t transport, double timeout_s) {
  attnd::client::CallOptions o;
  if (timeout_s > 0) o.deadline = absl::Seconds(timeout_s);
  const Transport t = transport == ATTND_TRANSPORT_DEFAULT ? c->transport : static_cast<Transport>(transport);
  // A Step is one message on a StepStream (auto, stream), one unary RPC (unary) or one shared-memory frame.
  o.transport = t == Transport::kShm || t == Transport::kUnary ? t : Transport::kStream;
  return o;
}

// The inline bytes of one of a step's tensors: absent when data is NULL.
absl::Status StepInput(const char* name, const void* data, uint64_t bytes, attnd::client::StepTensor* out) {
  if (data == nullptr) {
    if (bytes != 0) return absl::InvalidArgumentError(absl::StrCat(name, ": NULL with ", bytes, " bytes"));
    return absl::OkStatus();
  }
  if (bytes == 0) return absl::InvalidArgumentError(absl::StrCat(name, ": 0 bytes"));
  out->data = std::string_view(static_cast<const char*>(data), bytes);
  return absl::OkStatus();
}

// A step's reply as the caller's attnd_forward_info.
void FillStepInfo(const attnd::client::StepResult& r, attnd_forward_info* info) {
  Copy(info->request_id, sizeof(info->request_id), r.request_id);
  Copy(info->backend, sizeof(info->backend), r.backend);
  Copy(info->kernel, sizeof(info->kernel), r.kernel);
  info->device = r.device;
  info->transport = static_cast<int32_t>(r.transport);
  const auto& t = r.timing.timing();
  info->queue_us = t.queue_us();
  info->h2d_us = t.h2d_us();
  info->kernel_us = t.kernel_us();
  info->d2h_us = t.d2h_us();
  info->total_us = t.total_us();
  info->latency_us = absl::ToDoubleMicroseconds(r.latency);
}

absl::Status PrepareStep(attnd_client* c, const attnd_step_args* a, attnd::client::StepSpec* spec) {
  if (a == nullptr) return absl::InvalidArgumentError("args: NULL");
  if (a->count < 1) return absl::InvalidArgumentError(absl::StrCat("sequences: need at least one, got ", a->count));
  if (a->sequence_ids == nullptr) return absl::InvalidArgumentError("sequence_ids: NULL");
  if (a->tokens == nullptr) return absl::InvalidArgumentError("tokens: NULL");
  if (a->transport < ATTND_TRANSPORT_DEFAULT || a->transport > ATTND_TRANSPORT_SHM) {
    return absl::InvalidArgumentError(absl::StrCat("transport: unknown value ", a->transport));
  }
  spec->sequences.reserve(static_cast<size_t>(a->count));
  for (int64_t i = 0; i < a->count; ++i) {
    if (a->sequence_ids[i] == nullptr || a->sequence_ids[i][0] == '\0') {
      return absl::InvalidArgumentError(absl::StrCat("sequence_ids[", i, "]: empty"));
    }
    // The server bounds tokens by the sequence's max_tokens; this bound only keeps the sums below from overflowing.
    if (a->tokens[i] < 1 || a->tokens[i] > (int64_t{1} << 40)) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokens[", i, "]: must be 1..", int64_t{1} << 40, ", got ", a->tokens[i]));
    }
    spec->sequences.push_back({a->sequence_ids[i], a->tokens[i]});
  }
  spec->layer = a->layer;
  spec->q_heads = a->q_heads;
  if (a->has_scale) spec->scale = a->scale;
  spec->want_lse = a->want_lse != 0;
  spec->request_id = c->RequestId(a->request_id);
  if (auto s = StepInput("q", a->q, a->q_bytes, &spec->q); !s.ok()) return s;
  if (auto s = StepInput("k", a->k, a->k_bytes, &spec->k); !s.ok()) return s;
  if (auto s = StepInput("v", a->v, a->v_bytes, &spec->v); !s.ok()) return s;
  // O is q's shape, LSE one float per q row and head: the caller's buffers are checked before anything is sent,
  // so a step that could not deliver its result is never committed.
  if (spec->q.present()) {
    if (a->o == nullptr) return absl::InvalidArgumentError("o: NULL while q is given");
    if (a->o_bytes != a->q_bytes) {
      return absl::InvalidArgumentError(absl::StrCat("o_bytes: ", a->o_bytes, ", q has ", a->q_bytes));
    }
  }
  if (spec->want_lse) {
    if (a->lse == nullptr) return absl::InvalidArgumentError("lse: NULL while want_lse is set");
    int64_t rows = 0;
    for (int64_t i = 0; i < a->count; ++i) rows += a->tokens[i];
    const uint64_t want = static_cast<uint64_t>(rows) * static_cast<uint64_t>(std::max<int64_t>(a->q_heads, 0)) * 4;
    if (a->lse_bytes != want) {
      return absl::InvalidArgumentError(absl::StrCat("lse_bytes: ", a->lse_bytes, ", the step's LSE has ", want));
    }
  }
  return absl::OkStatus();
}

}  // namespace

ATTND_C_EXPORT char* attnd_sequence_open(attnd_client* client, const attnd_sequence_shape* shape, int64_t max_tokens,
                                         uint32_t count, int64_t* max_tokens_out, int32_t* page_tokens_out,
                                         attnd_error* err) {
  if (shape == nullptr) return Fail(err, absl::InvalidArgumentError("shape: NULL")), nullptr;
  if (shape->dtype != ATTND_DTYPE_BF16 && shape->dtype != ATTND_DTYPE_FP16) {
    return Fail(err, absl::InvalidArgumentError(absl::StrCat("shape.dtype: unknown value ", shape->dtype))), nullptr;
  }
  attnd::client::SequenceShape s;
  s.layers = shape->layers;
  s.kv_heads = shape->kv_heads;
  s.head_dim = shape->head_dim;
  s.dtype = static_cast<DType>(shape->dtype);
  auto opened = client->client->OpenSequence(s, max_tokens, count);
  if (!opened.ok()) return Fail(err, opened.status()), nullptr;
  if (max_tokens_out != nullptr) *max_tokens_out = opened->max_tokens;
  if (page_tokens_out != nullptr) *page_tokens_out = opened->page_tokens;
  Ok(err);
  return Dup(JoinIds(opened->ids));
}

ATTND_C_EXPORT int32_t attnd_step(attnd_client* client, const attnd_step_args* args, attnd_forward_info* info,
                                  attnd_error* err) {
  attnd::client::StepSpec spec;
  if (absl::Status s = PrepareStep(client, args, &spec); !s.ok()) return Fail(err, s, spec.request_id);
  client->Begin();
  auto r = client->client->Step(spec, CallFor(client, args->transport, args->timeout_s));
  client->End();
  if (!r.ok()) return Fail(err, r.status(), spec.request_id);
  // The library has checked the reply's sizes against the request, and PrepareStep the caller's buffers.
  if (spec.q.present()) std::memcpy(args->o, r->o.data(), std::min<size_t>(args->o_bytes, r->o.size()));
  if (spec.want_lse) std::memcpy(args->lse, r->lse.data(), std::min<size_t>(args->lse_bytes, r->lse.size()));
  if (args->lengths != nullptr) std::copy(r->lengths.begin(), r->lengths.end(), args->lengths);
  if (info != nullptr) FillStepInfo(*r, info);
  Ok(err);
  return 0;
}

struct attnd_batch {
  attnd_client* client;
  attnd::client::StepBatch batch;
};

namespace {

absl::StatusOr<attnd::client::CudaSteps*> CudaStepsOf(attnd_client* c) {
  absl::MutexLock l(&c->cuda_mu);
  if (c->cuda == nullptr) {
    auto made = attnd::client::CudaSteps::Create(c->client.get());
    if (!made.ok()) return made.status();
    c->cuda = *std::move(made);
  }
  return c->cuda.get();
}

}  // namespace

ATTND_C_EXPORT attnd_batch* attnd_batch_create(attnd_client* client, const char* const* sequence_ids, int64_t count,
                                               int64_t tokens, attnd_error* err) {
  if (count < 1) return Fail(err, absl::InvalidArgumentError("count: need at least one sequence")), nullptr;
  if (sequence_ids == nullptr) return Fail(err, absl::InvalidArgumentError("sequence_ids: NULL")), nullptr;
  if (tokens < 1 || tokens > (int64_t{1} << 31)) {
    return Fail(err, absl::InvalidArgumentError(absl::StrCat("tokens: must be 1..2^31, got ", tokens))), nullptr;
  }
  std::vector<std::string> ids;
  ids.reserve(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    if (sequence_ids[i] == nullptr || sequence_ids[i][0] == '\0') {
      return Fail(err, absl::InvalidArgumentError(absl::StrCat("sequence_ids[", i, "]: empty"))), nullptr;
    }
    ids.emplace_back(sequence_ids[i]);
  }
  Ok(err);
  return new attnd_batch{client, attnd::client::StepBatch(ids, tokens)};
}

ATTND_C_EXPORT void attnd_batch_destroy(attnd_batch* batch) { delete batch; }

ATTND_C_EXPORT int32_t attnd_cuda_stream_ordered(attnd_client* client, attnd_error* err) {
  auto steps = CudaStepsOf(client);
  if (!steps.ok()) return -Fail(err, steps.status());
  auto ordered = (*steps)->StreamOrdered();
  if (!ordered.ok()) return -Fail(err, ordered.status());
  Ok(err);
  return *ordered ? 1 : 0;
}

namespace {

// The checks of a CUDA step's arguments and the batch's request set from them; the tensors in *t.
absl::StatusOr<attnd::client::CudaSteps*> PrepareCudaStep(attnd_batch* batch, const attnd_cuda_step_args* args,
                                                          attnd::client::DeviceStepTensors* t) {
  if (batch == nullptr) return absl::InvalidArgumentError("batch: NULL");
  if (args == nullptr) return absl::InvalidArgumentError("args: NULL");
  attnd_client* c = batch->client;
  if (args->transport < ATTND_TRANSPORT_DEFAULT || args->transport > ATTND_TRANSPORT_SHM) {
    return absl::InvalidArgumentError(absl::StrCat("transport: unknown value ", args->transport));
  }
  if (args->tokens < 0 || args->tokens > (int64_t{1} << 31)) {
    return absl::InvalidArgumentError(absl::StrCat("tokens: must be 0..2^31, got ", args->tokens));
  }
  auto steps = CudaStepsOf(c);
  if (!steps.ok()) return steps.status();
  if (args->tokens > 0) batch->batch.set_tokens(args->tokens);
  v1::StepRequest& r = batch->batch.request();
  r.set_layer(args->layer);
  r.set_q_heads(args->q_heads);
  if (args->has_scale) {
    r.set_softmax_scale(args->scale);
  } else {
    r.clear_softmax_scale();
  }
  r.set_request_id(c->RequestId(args->request_id));
  t->q = reinterpret_cast<const void*>(args->q);
  t->k = reinterpret_cast<const void*>(args->k);
  t->v = reinterpret_cast<const void*>(args->v);
  t->o = reinterpret_cast<void*>(args->o);
  t->q_bytes = args->q_bytes;
  t->kv_bytes = args->kv_bytes;
  return steps;
}

}  // namespace

ATTND_C_EXPORT int32_t attnd_batch_step_cuda(attnd_batch* batch, const attnd_cuda_step_args* args,
                                             attnd_forward_info* info, attnd_error* err) {
  attnd::client::DeviceStepTensors t;
  auto steps = PrepareCudaStep(batch, args, &t);
  if (!steps.ok()) return Fail(err, steps.status());
  attnd_client* c = batch->client;
  c->Begin();
  auto res = (*steps)->Step(batch->batch, t, reinterpret_cast<void*>(args->stream),
                            CallFor(c, args->transport, args->timeout_s));
  c->End();
  if (!res.ok()) return Fail(err, res.status(), batch->batch.request().request_id());
  if (args->lengths != nullptr) std::copy(res->lengths.begin(), res->lengths.end(), args->lengths);
  if (info != nullptr) FillStepInfo(*res, info);
  Ok(err);
  return 0;
}

ATTND_C_EXPORT int32_t attnd_batch_submit_cuda(attnd_batch* batch, const attnd_cuda_step_args* args,
                                               attnd_error* err) {
  attnd::client::DeviceStepTensors t;
  auto steps = PrepareCudaStep(batch, args, &t);
  if (!steps.ok()) return Fail(err, steps.status());
  attnd_client* c = batch->client;
  c->Begin();
  absl::Status s = (*steps)->Submit(batch->batch, t, reinterpret_cast<void*>(args->stream),
                                    CallFor(c, args->transport, args->timeout_s));
  c->End();
  if (!s.ok()) return Fail(err, s, batch->batch.request().request_id());
  Ok(err);
  return 0;
}

ATTND_C_EXPORT int32_t attnd_cuda_sync(attnd_client* client, uint64_t stream, attnd_error* err) {
  if (client == nullptr) return Fail(err, absl::InvalidArgumentError("client: NULL"));
  auto steps = CudaStepsOf(client);
  if (!steps.ok()) return Fail(err, steps.status());
  client->Begin();
  absl::Status s = (*steps)->Sync(reinterpret_cast<void*>(stream));
  client->End();
  if (!s.ok()) return Fail(err, s);
  Ok(err);
  return 0;
}

ATTND_C_EXPORT char* attnd_sequence_fork(attnd_client* client, const char* sequence_id, uint32_t count,
                                         attnd_error* err) {
  auto ids = client->client->ForkSequence(Str(sequence_id), count);
  if (!ids.ok()) return Fail(err, ids.status()), nullptr;
  Ok(err);
  return Dup(JoinIds(*ids));
}

ATTND_C_EXPORT int32_t attnd_sequence_truncate(attnd_client* client, const char* sequence_id, int64_t tokens,
                                               int64_t* lengths, size_t cap, size_t* layers_out, attnd_error* err) {
  auto got = client->client->TruncateSequence(Str(sequence_id), tokens);
  if (!got.ok()) return Fail(err, got.status());
  if (lengths != nullptr) std::copy_n(got->begin(), std::min(cap, got->size()), lengths);
  if (layers_out != nullptr) *layers_out = got->size();
  Ok(err);
  return 0;
}

ATTND_C_EXPORT int32_t attnd_sequence_close(attnd_client* client, const char* const* sequence_ids, size_t count,
                                            attnd_error* err) {
  if (sequence_ids == nullptr && count > 0) return Fail(err, absl::InvalidArgumentError("sequence_ids: NULL"));
  std::vector<std::string> ids;
  ids.reserve(count);
  for (size_t i = 0; i < count; ++i) ids.push_back(Str(sequence_ids[i]));
  absl::Status s = client->client->CloseSequence(ids);
  if (!s.ok()) return Fail(err, s);
  Ok(err);
  return 0;
}

ATTND_C_EXPORT char* attnd_sequence_info_json(attnd_client* client, const char* sequence_id, attnd_error* err) {
  auto info = client->client->GetSequence(Str(sequence_id));
  if (!info.ok()) return Fail(err, info.status()), nullptr;
  auto json = ToJson(*info);
  if (!json.ok()) return Fail(err, json.status()), nullptr;
  Ok(err);
  return Dup(*json);
}
