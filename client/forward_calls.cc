#include "attnd/client/client.h"

#include <algorithm>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "attnd/transport/zero_copy.h"
#include "client_internal.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/byte_buffer.h"

namespace attnd::client {
namespace {

const std::string kForwardMethod = absl::StrCat("/", v1::Attention::service_full_name(), "/Forward");

// a*b*... in uint64, or nullopt on a non-positive factor or overflow; shapes come from users and are only
// validated by the server, so the client must not trust them for sizes.
std::optional<uint64_t> CheckedProduct(std::initializer_list<int64_t> factors) {
  uint64_t p = 1;
  for (int64_t f : factors) {
    if (f <= 0 || __builtin_mul_overflow(p, static_cast<uint64_t>(f), &p)) return std::nullopt;
  }
  return p;
}

std::optional<uint64_t> ExpectedOBytes(const v1::ForwardRequest& r) {
  const auto& s = r.shape();
  return CheckedProduct({s.batch(), s.q_len(), s.q_heads(), s.head_dim(), 2});
}
std::optional<uint64_t> ExpectedLseBytes(const v1::ForwardRequest& r) {
  const auto& s = r.shape();
  return CheckedProduct({s.batch(), s.q_heads(), s.q_len(), 4});
}

// A request that names a registered CUDA buffer (an input or O's destination) is staged by the server when it
// runs, whichever RPC carries it: streaming it overlaps nothing.
bool NamesBuffers(const v1::ForwardRequest& r) {
  return r.has_o_ref() || r.q().has_ref() || r.k().has_ref() || r.v().has_ref();
}

}  // namespace

void FillResultHeader(v1::ForwardResponse& header, ForwardResult& res) {
  res.request_id = std::move(*header.mutable_request_id());
  res.timing = header.timing();
  res.backend = std::move(*header.mutable_backend());
  res.kernel = std::move(*header.mutable_kernel());
  res.device = header.device();
}

absl::Status CheckReplySizes(const v1::ForwardRequest& r, const ForwardResult& res) {
  const uint64_t o = res.o_bytes().size(), lse = res.lse_bytes().size();
  if (!r.has_o_ref()) {
    const auto want = ExpectedOBytes(r);
    if (want && o != *want) {
      return absl::InternalError(absl::StrCat("server returned ", o, " bytes of O, expected ", *want));
    }
  }
  if (r.return_lse()) {
    const auto want = ExpectedLseBytes(r);
    if (want && lse != *want) {
      return absl::InternalError(absl::StrCat("server returned ", lse, " bytes of LSE, expected ", *want));
    }
  }
  return absl::OkStatus();
}

ReplyBytes ExpectedReplyBytes(const v1::ForwardRequest& r) {
  ReplyBytes b;
  if (!r.has_o_ref()) b.o = ExpectedOBytes(r).value_or(0);
  if (r.return_lse()) b.lse = ExpectedLseBytes(r).value_or(0);
  return b;
}

static absl::Status CheckOutputs(const v1::ForwardRequest& r, const ForwardOutputs& out) {
  const ReplyBytes want = ExpectedReplyBytes(r);
  const uint64_t want_o = want.o, want_lse = want.lse;
  if (out.o.size() != want_o) {
    return absl::InvalidArgumentError(absl::StrCat("outputs.o: ", out.o.size(), " bytes, but the request's O takes ",
                                                   want_o, r.has_o_ref() ? " (it names an O buffer)" : ""));
  }
  if (out.lse.size() != want_lse) {
    return absl::InvalidArgumentError(absl::StrCat("outputs.lse: ", out.lse.size(),
                                                   " bytes, but the request's LSE takes ", want_lse,
                                                   r.return_lse() ? "" : " (it does not ask for LSE)"));
  }
  return absl::OkStatus();
}

// A request we share ownership of owns its tensors' slices; a borrowed one (the blocking Forward) cannot
// outlive its caller's frame while gRPC may still hold a slice after the call completed, so its bytes are
// copied.
std::shared_ptr<Client::Outgoing> Client::Split(std::shared_ptr<const v1::ForwardRequest> request) {
  auto out = std::make_shared<Outgoing>();
  const v1::ForwardRequest& r = *request;
  v1::ForwardRequest& h = out->header;
  h.set_request_id(r.request_id());
  *h.mutable_shape() = r.shape();
  h.set_dtype(r.dtype());
  h.set_mask(r.mask());
  if (r.has_softmax_scale()) h.set_softmax_scale(r.softmax_scale());
  h.set_return_lse(r.return_lse());
  if (r.has_o_ref()) *h.mutable_o_ref() = r.o_ref();
  *h.mutable_q_descale() = r.q_descale();
  *h.mutable_k_descale() = r.k_descale();
  *h.mutable_v_descale() = r.v_descale();
  const v1::TensorInput* inputs[3] = {&r.q(), &r.k(), &r.v()};
  for (int i = 0; i < 3; ++i) {
    if (inputs[i]->has_ref()) {
      *(i == 0 ? h.mutable_q() : i == 1 ? h.mutable_k() : h.mutable_v())->mutable_ref() = inputs[i]->ref();
    } else if (inputs[i]->source_case() == v1::TensorInput::kData) {
      out->tensors[i] = inputs[i]->data();
    }
  }
  if (request.use_count() > 0) out->owner = std::move(request);
  return out;
}

absl::StatusOr<ForwardResult> Client::Completed(const Outgoing& sent, ForwardResult res, Transport t,
                                                absl::Time start) {
  res.transport = t;
  res.latency = absl::Now() - start;
  res.bytes_sent = sent.inline_bytes();
  res.bytes_received = res.o_bytes().size() + res.lse_bytes().size();
  if (absl::Status sizes = CheckReplySizes(sent.header, res); !sizes.ok()) return sizes;
  return res;
}

absl::StatusOr<Transport> Client::ChooseTransport(const v1::ForwardRequest& request) {
  uint64_t inline_bytes = 0;
  for (const v1::TensorInput* t : {&request.q(), &request.k(), &request.v()}) {
    if (t->source_case() == v1::TensorInput::kData) inline_bytes += t->data().size();
  }
  return ChooseTransportFor(request.ByteSizeLong(), inline_bytes, request);
}

absl::StatusOr<Transport> Client::ChooseTransportFor(uint64_t request_bytes, uint64_t inline_bytes,
                                                     const v1::ForwardRequest& request) {
  auto info = ServerInfo();
  if (!info.ok()) {
    return absl::Status(info.status().code(), absl::StrCat("fetching the server's limits: ", info.status().message()));
  }
  // The server copies a stream's chunks on (to the device) while the rest arrives; from this size that
  // overlap beats a unary message even when the request fits one.
  const uint64_t prefer = info->stream_preferred_from_bytes();
  if (prefer > 0 && inline_bytes >= prefer && !NamesBuffers(request)) return Transport::kStream;
  const uint64_t limit = info->limits().max_message_bytes();
  if (limit == 0) return Transport::kUnary;  // the server states no limit
  const uint64_t reply = ExpectedOBytes(request).value_or(0) + (request.return_lse() ? ExpectedLseBytes(request).value_or(0) : 0);
  const bool fits = request_bytes + kMessageOverhead <= limit && reply + kMessageOverhead <= limit;
  return fits ? Transport::kUnary : Transport::kStream;
}

void Client::ForwardAsync(std::shared_ptr<const v1::ForwardRequest> request, ForwardCallback done,
                          const CallOptions& call) {
  Dispatch(Split(std::move(request)), std::move(done), call);
}

void Client::ForwardAsync(const RequestSpec& spec, ForwardInputs inputs, ForwardCallback done,
                          const CallOptions& call) {
  if (inputs.keep_alive == nullptr) {
    done(absl::InvalidArgumentError("inputs.keep_alive: required (it keeps q, k, v alive while gRPC sends them)"));
    return;
  }
  auto sent = std::make_shared<Outgoing>();
  sent->header = MakeForwardRequest(spec, "", "", "");
  sent->header.clear_q();
  sent->header.clear_k();
  sent->header.clear_v();
  sent->tensors[0] = inputs.q;
  sent->tensors[1] = inputs.k;
  sent->tensors[2] = inputs.v;
  sent->owner = std::move(inputs.keep_alive);
  Dispatch(std::move(sent), std::move(done), call);
}

std::future<absl::StatusOr<ForwardResult>> Client::ForwardFuture(const RequestSpec& spec, ForwardInputs inputs,
                                                                 const CallOptions& call) {
  auto promise = std::make_shared<std::promise<absl::StatusOr<ForwardResult>>>();
  auto future = promise->get_future();
  ForwardAsync(
      spec, std::move(inputs), [promise](absl::StatusOr<ForwardResult> r) { promise->set_value(std::move(r)); },
      call);
  return future;
}

void Client::Dispatch(std::shared_ptr<const Outgoing> sent, ForwardCallback done, const CallOptions& call) {
  if (call.outputs) {
    if (absl::Status s = CheckOutputs(sent->header, *call.outputs); !s.ok()) {
      done(s);
      return;
    }
  }
  Transport t = call.transport ? *call.transport : options_.transport;
  if (t == Transport::kAuto) {
    // The message size: the header, the tensors and their few bytes of tags and lengths each.
    const uint64_t inline_bytes = sent->inline_bytes();
    auto chosen = ChooseTransportFor(sent->header.ByteSizeLong() + inline_bytes + 3 * 24, inline_bytes, sent->header);
    if (!chosen.ok()) {
      done(chosen.status());
      return;
    }
    t = *chosen;
  }
  if (t == Transport::kShm) {
    done(absl::InvalidArgumentError(
        "transport: shm is not carried by the gRPC client; Forward over a ShmChannel (attnd/client/shm_channel.h)"));
    return;
  }
  if (t == Transport::kUnary) {
    StartUnary(std::move(sent), std::move(done), call);
    return;
  }
  // Chunks must fit the server's message limit; without the info (unreachable server) the call itself
  // reports the failure, so the default chunk size is as good as any.
  uint64_t max_message = CachedMaxMessageBytes().value_or(0);
  if (max_message == 0) {
    auto info = ServerInfo(false, call);
    if (info.ok()) max_message = info->limits().max_message_bytes();
  }
  StartStream(std::move(sent), std::move(done), call, max_message);
}

void Client::StartUnary(std::shared_ptr<const Outgoing> sent, ForwardCallback done, const CallOptions& call) {
  struct Call {
    grpc::ClientContext ctx;
    std::shared_ptr<const Outgoing> sent;
    grpc::ByteBuffer request_buf, response_buf;
    ForwardCallback done;
    absl::Time start;
    std::optional<ForwardOutputs> outputs;

    void Finish(grpc::Status s) {
      std::unique_ptr<Call> owned(this);
      absl::StatusOr<ForwardResult> out = Receive(s);
      if (out.ok()) out = Completed(*sent, *std::move(out), Transport::kUnary, start);
      ForwardCallback cb = std::move(done);
      owned.reset();
      cb(std::move(out));
    }

    // The reply as a result: O and LSE moved out of protobuf's strings, or copied from gRPC's slices
    // straight into the caller's outputs.
    absl::StatusOr<ForwardResult> Receive(const grpc::Status& s) {
      if (!s.ok()) return FromGrpcStatus(s);
      ForwardResult res;
      v1::ForwardResponse response;
      if (outputs) {
        uint64_t o_n = 0, lse_n = 0;
        const absl::Status read = ReadForwardResponse(response_buf, &response, outputs->o, outputs->lse, &o_n, &lse_n);
        if (!read.ok()) return read;
        res.outputs = ForwardOutputs{outputs->o.first(o_n), outputs->lse.first(lse_n)};
      } else {
        const grpc::Status parsed =
            grpc::SerializationTraits<v1::ForwardResponse>::Deserialize(&response_buf, &response);
        if (!parsed.ok()) return FromGrpcStatus(parsed);
        res.o = std::move(*response.mutable_o());
        res.lse = std::move(*response.mutable_lse());
      }
      FillResultHeader(response, res);
      return res;
    }
  };
  auto* c = new Call;
  c->sent = std::move(sent);
  c->done = std::move(done);
  c->outputs = call.outputs;
  Prepare(&c->ctx, call);
  c->start = absl::Now();
  c->request_buf = SerializeForwardRequest(c->sent->header, c->sent->tensors, c->sent->owner);
  if (absl::Status fits = CheckUnaryFits(c->request_buf.Length(), c->sent->header, call); !fits.ok()) {
    ForwardCallback cb = std::move(c->done);
    delete c;
    cb(std::move(fits));
    return;
  }
  generic_->UnaryCall(&c->ctx, kForwardMethod, grpc::StubOptions(), &c->request_buf, &c->response_buf,
                      [c](grpc::Status s) { c->Finish(std::move(s)); });
}

// gRPC would send an oversized request whole before the server refused it (and then say only "Received message
// larger than max"), and a server would compute a reply too large to send. The server's limit comes from its
// ServerInfo: fetched once for a call large enough to meet any sensible limit, and fetched again before a
// refusal, in case the server restarted with another one. Without it the call goes ahead.
absl::Status Client::CheckUnaryFits(uint64_t request_bytes, const v1::ForwardRequest& header,
                                    const CallOptions& call) {
  const uint64_t reply_bytes = (header.has_o_ref() ? 0 : ExpectedOBytes(header).value_or(0)) +
                               (header.return_lse() ? ExpectedLseBytes(header).value_or(0) : 0);
  auto over = [](absl::string_view what, uint64_t n, absl::string_view limit_name, uint64_t limit) {
    return absl::ResourceExhaustedError(absl::StrCat(
        what, ": ", n, " bytes in one Forward message, above ", limit_name, " of ", limit,
        " (transport stream, or auto, sends it in chunks)"));
  };
  if (options_.max_send_message_bytes >= 0 && request_bytes > static_cast<uint64_t>(options_.max_send_message_bytes)) {
    return over("request", request_bytes, "this client's max_send_message_bytes", options_.max_send_message_bytes);
  }
  if (options_.max_receive_message_bytes >= 0 &&
      reply_bytes > static_cast<uint64_t>(options_.max_receive_message_bytes)) {
    return over("reply (O and LSE)", reply_bytes, "this client's max_receive_message_bytes",
                options_.max_receive_message_bytes);
  }
  auto fits = [&](uint64_t limit) { return limit == 0 || (request_bytes <= limit && reply_bytes <= limit); };
  const std::optional<uint64_t> limit = CachedMaxMessageBytes();
  if (limit && fits(*limit)) return absl::OkStatus();
  if (!limit && std::max(request_bytes, reply_bytes) <= kMessageOverhead) return absl::OkStatus();
  absl::StatusOr<v1::ServerInfo> info = ServerInfo(/*refresh=*/true, call);
  if (!info.ok() || fits(info->limits().max_message_bytes())) return absl::OkStatus();
  const uint64_t server = info->limits().max_message_bytes();
  return request_bytes > server ? over("request", request_bytes, "the server's max_message_bytes", server)
                                : over("reply (O and LSE)", reply_bytes, "the server's max_message_bytes", server);
}

absl::StatusOr<ForwardResult> Client::Forward(const v1::ForwardRequest& request, const CallOptions& call) {
  // The caller keeps `request` alive for the whole (blocking) call, so a non-owning pointer is enough.
  std::shared_ptr<const v1::ForwardRequest> alias(std::shared_ptr<void>(), &request);
  return ForwardFuture(std::move(alias), call).get();
}

std::future<absl::StatusOr<ForwardResult>> Client::ForwardFuture(std::shared_ptr<const v1::ForwardRequest> request,
                                                                 const CallOptions& call) {
  auto promise = std::make_shared<std::promise<absl::StatusOr<ForwardResult>>>();
  auto future = promise->get_future();
  ForwardAsync(
      std::move(request), [promise](absl::StatusOr<ForwardResult> r) { promise->set_value(std::move(r)); }, call);
  return future;
}

}  // namespace attnd::client
