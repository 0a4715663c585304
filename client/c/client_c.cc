// The C ABI of attnd_client_c.h over attnd::client::Client and ShmChannel: the client, Forward and CUDA buffers
// (KV sequences and steps: client_c_sequences.cc).
#include "attnd_client_c.h"

#include <algorithm>
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
#include "attnd/client/shm_channel.h"
#include "attnd/transport/channel_args.h"
#include "client_c_internal.h"

using namespace attnd::c_abi;  // NOLINT(build/namespaces): this library's own helpers

namespace {

static_assert(static_cast<int>(DType::kBF16) == ATTND_DTYPE_BF16 &&
                  static_cast<int>(DType::kFP16) == ATTND_DTYPE_FP16 &&
                  static_cast<int>(DType::kFP8E4M3) == ATTND_DTYPE_FP8_E4M3,
              "enum attnd_dtype's numbers are attnd::DType's");

bool Contiguous(const attnd_tensor& t, int64_t seq, int64_t heads, int64_t dim) {
  const int64_t* s = t.strides;
  return (s[0] == 0 && s[1] == 0 && s[2] == 0) || (s[0] == seq * heads * dim && s[1] == heads * dim && s[2] == dim);
}

// An inline tensor's bytes, contiguous: a view of the caller's memory, or a gathered copy of a strided one.
struct Inline {
  std::string copy;
  std::string_view bytes;
};

// `elem_bytes`: 2 (bf16, fp16) or 1 (float8).
absl::Status Gather(const char* name, const attnd_tensor& t, int64_t batch, int64_t seq, int64_t heads, int64_t dim,
                    int64_t elem_bytes, Inline* out) {
  if (t.data == nullptr) return absl::InvalidArgumentError(absl::StrCat(name, ": no data and no buffer_id"));
  const auto* base = static_cast<const char*>(t.data);
  const size_t row = static_cast<size_t>(dim * elem_bytes);
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
        std::memcpy(dst, base + e * elem_bytes, row);
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
  if (a->dtype != ATTND_DTYPE_BF16 && a->dtype != ATTND_DTYPE_FP16 && a->dtype != ATTND_DTYPE_FP8_E4M3) {
    return absl::InvalidArgumentError(absl::StrCat("dtype: unknown value ", a->dtype));
  }
  const struct {
    const char* name;
    const float* values;
    int64_t count;
    std::vector<float>* out;
  } descales[] = {{"q_descale", a->q_descale, a->q_descale_count, &call->spec.q_descale},
                  {"k_descale", a->k_descale, a->k_descale_count, &call->spec.k_descale},
                  {"v_descale", a->v_descale, a->v_descale_count, &call->spec.v_descale}};
  // Copied, sent as given: the server checks their counts and values (and that only a float8 call has them).
  for (const auto& d : descales) {
    if (d.count < 0 || (d.count > 0 && d.values == nullptr)) {
      return absl::InvalidArgumentError(absl::StrCat(d.name, ": ", d.count, " values at NULL"));
    }
    d.out->assign(d.values, d.values + d.count);
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
  spec.dtype = static_cast<DType>(a->dtype);  // the ABI's numbers are DType's
  const int64_t elem_bytes = DTypeBytes(spec.dtype);
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
      auto* keep = t.keep->get();
      if (auto s = Gather(t.name, t.t, a->batch, t.seq, t.heads, a->head_dim, elem_bytes, keep); !s.ok()) return s;
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
      if (auto s = Gather(t.name, t.t, a->batch, t.seq, t.heads, a->head_dim, elem_bytes, &in); !s.ok()) return s;
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

// The options' gRPC channel arguments as the C++ client takes them, checked here so that errors name the C fields.
absl::StatusOr<std::vector<std::string>> GrpcArgs(const attnd_client_options& options) {
  if (options.num_grpc_args < 0) {
    return absl::InvalidArgumentError(absl::StrCat("num_grpc_args: ", options.num_grpc_args, " is negative"));
  }
  if (options.num_grpc_args > 0 && options.grpc_args == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("grpc_args: NULL with num_grpc_args ", options.num_grpc_args));
  }
  std::vector<std::string> specs;
  for (int32_t i = 0; i < options.num_grpc_args; ++i) {
    if (options.grpc_args[i] == nullptr) return absl::InvalidArgumentError(absl::StrCat("grpc_args[", i, "]: NULL"));
    specs.emplace_back(options.grpc_args[i]);
  }
  absl::StatusOr<std::vector<attnd::ChannelArg>> parsed = attnd::ParseChannelArgs(specs, "grpc_args");
  if (!parsed.ok()) return parsed.status();
  return specs;
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
  absl::StatusOr<std::vector<std::string>> grpc_args = GrpcArgs(*options);
  if (!grpc_args.ok()) {
    Fail(err, grpc_args.status());
    return nullptr;
  }
  o.grpc_args = *std::move(grpc_args);
  if (options->move_connections != 0) o.move_connections = std::max(options->move_connections, 0);  // Create: <= 64
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
