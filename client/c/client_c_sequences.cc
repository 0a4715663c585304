// The C ABI of attnd_client_c.h over attnd::client::Client: KV sequences, steps and step batches, CUDA-memory
// steps included.
#include "attnd_client_c.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "attnd/client/client.h"
#include "attnd/client/cuda_steps.h"
#include "client_c_internal.h"

using namespace attnd::c_abi;  // NOLINT(build/namespaces): this library's own helpers

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

// `count` descales at `values` (NULL with 0), `field` named when they cannot be read.
absl::StatusOr<std::vector<float>> Descales(const char* field, const float* values, int64_t count) {
  if (count < 0 || (count > 0 && values == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", count, " values at ", values ? "an address" : "NULL"));
  }
  return std::vector<float>(values, values + count);
}

// The C++ shape of a C one (INVALID_ARGUMENT naming a field the library cannot map; the server checks the rest).
absl::StatusOr<attnd::client::SequenceShape> ShapeOf(const attnd_sequence_shape& c) {
  if (c.dtype == ATTND_DTYPE_FP8_E4M3) {
    return absl::InvalidArgumentError(
        "shape.dtype: a sequence's q and O are bf16 or fp16 (kv_format ATTND_KV_FP8_E4M3 caches K and V as float8)");
  }
  if (c.dtype != ATTND_DTYPE_BF16 && c.dtype != ATTND_DTYPE_FP16) {
    return absl::InvalidArgumentError(absl::StrCat("shape.dtype: unknown value ", c.dtype));
  }
  if (c.kv_format != ATTND_KV_AS_DTYPE && c.kv_format != ATTND_KV_FP8_E4M3) {
    return absl::InvalidArgumentError(absl::StrCat("shape.kv_format: unknown value ", c.kv_format));
  }
  attnd::client::SequenceShape s;
  s.layers = c.layers;
  s.kv_heads = c.kv_heads;
  s.head_dim = c.head_dim;
  s.dtype = static_cast<DType>(c.dtype);
  if (c.kv_format == ATTND_KV_FP8_E4M3) s.kv_format = attnd::KvFormat::kFp8E4M3;
  absl::StatusOr<std::vector<float>> k = Descales("shape.k_descale", c.k_descale, c.k_descale_count);
  if (!k.ok()) return k.status();
  absl::StatusOr<std::vector<float>> v = Descales("shape.v_descale", c.v_descale, c.v_descale_count);
  if (!v.ok()) return v.status();
  s.k_descale = *std::move(k);
  s.v_descale = *std::move(v);
  return s;
}

}  // namespace

ATTND_C_EXPORT char* attnd_sequence_open(attnd_client* client, const attnd_sequence_shape* shape, int64_t max_tokens,
                                         uint32_t count, int64_t* max_tokens_out, int32_t* page_tokens_out,
                                         attnd_error* err) {
  if (shape == nullptr) return Fail(err, absl::InvalidArgumentError("shape: NULL")), nullptr;
  absl::StatusOr<attnd::client::SequenceShape> s = ShapeOf(*shape);
  if (!s.ok()) return Fail(err, s.status()), nullptr;
  auto opened = client->client->OpenSequence(*s, max_tokens, count);
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

ATTND_C_EXPORT char* attnd_sequence_move(attnd_client* client, const char* sequence_id, const char* to,
                                         attnd_error* err) {
  absl::StatusOr<std::string> moved = client->client->MoveSequence(Str(sequence_id), Str(to));
  if (!moved.ok()) return Fail(err, moved.status()), nullptr;
  Ok(err);
  return Dup(*moved);
}

static_assert(static_cast<int>(attnd::client::MovePath::kAuto) == 0 &&
              static_cast<int>(attnd::client::MovePath::kBytes) == 1 &&
              static_cast<int>(attnd::client::MovePath::kDevice) == 2);

ATTND_C_EXPORT char* attnd_sequence_move_path(attnd_client* client, const char* sequence_id, const char* to,
                                              int32_t path, int32_t* path_used, attnd_error* err) {
  if (path < 0 || path > 2) {
    return Fail(err, absl::InvalidArgumentError(absl::StrCat("path: ", path, " is not 0 (auto), 1 (bytes) or 2 "
                                                             "(device)"))),
           nullptr;
  }
  attnd::client::MoveOptions options;
  options.path = static_cast<attnd::client::MovePath>(path);
  absl::StatusOr<attnd::client::MovedSequence> moved = client->client->MoveSequence(Str(sequence_id), Str(to), options);
  if (!moved.ok()) return Fail(err, moved.status()), nullptr;
  if (path_used != nullptr) *path_used = static_cast<int32_t>(moved->path);
  Ok(err);
  return Dup(moved->sequence_id);
}

ATTND_C_EXPORT char* attnd_sequence_current_id(attnd_client* client, const char* sequence_id) {
  return Dup(client->client->CurrentSequenceId(Str(sequence_id)));
}

ATTND_C_EXPORT uint64_t attnd_client_moves_followed(attnd_client* client) { return client->client->moves_followed(); }

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
