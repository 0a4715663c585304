#include "attnd/client/client.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <sstream>
#include <type_traits>
#include <utility>
#include <variant>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "attnd/client/shm_channel.h"
#include "attnd/transport/channel_args.h"
#include "attnd/transport/zero_copy.h"
#include "client_internal.h"
#include "grpcpp/completion_queue.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/async_stream.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/channel_arguments.h"
#include "grpcpp/support/client_callback.h"

namespace attnd::client {
namespace {

// The channel's credentials: TLS when any tls_* file is given (client.h), plaintext otherwise.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials(const ClientOptions& o) {
  if (o.tls_ca_file.empty() && o.tls_cert_file.empty() && o.tls_key_file.empty()) {
    return grpc::InsecureChannelCredentials();
  }
  if (o.tls_cert_file.empty() != o.tls_key_file.empty()) {
    return absl::InvalidArgumentError("tls_cert/tls_key: a client certificate needs both files");
  }
  grpc::SslCredentialsOptions ssl;
  const std::pair<const std::string*, std::string*> files[] = {
      {&o.tls_ca_file, &ssl.pem_root_certs}, {&o.tls_cert_file, &ssl.pem_cert_chain}, {&o.tls_key_file, &ssl.pem_private_key}};
  for (const auto& [path, pem] : files) {
    if (path->empty()) continue;
    std::ifstream in(*path, std::ios::binary);
    if (!in) return absl::InvalidArgumentError(absl::StrCat("tls: cannot read '", *path, "'"));
    std::stringstream text;
    text << in.rdbuf();
    *pem = text.str();
  }
  return grpc::SslCredentials(ssl);
}

const std::string kForwardMethod = absl::StrCat("/", v1::Attention::service_full_name(), "/Forward");
const std::string kForwardStreamMethod = absl::StrCat("/", v1::Attention::service_full_name(), "/ForwardStream");

// Room for the request's non-tensor fields and the framing of one message on top of its tensor bytes.
constexpr uint64_t kMessageOverhead = 64 << 10;
constexpr uint64_t kDefaultChunkBytes = 1 << 20;

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

void FillResultHeader(v1::ForwardResponse& header, ForwardResult& res) {
  res.request_id = std::move(*header.mutable_request_id());
  res.timing = header.timing();
  res.backend = std::move(*header.mutable_backend());
  res.kernel = std::move(*header.mutable_kernel());
  res.device = header.device();
}

}  // namespace

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

// What one Forward call sends: every request field but the inline tensor bytes, and those bytes, which
// go out by reference while `owner` keeps them alive (zero_copy.h) or are copied when it is null.
struct Client::Outgoing {
  v1::ForwardRequest header;                   // q, k, v unset or references
  std::optional<std::string_view> tensors[3];  // Q, K, V inline bytes; nullopt: not inline
  std::shared_ptr<const void> owner;

  uint64_t inline_bytes() const {
    uint64_t n = 0;
    for (const auto& t : tensors) n += t ? t->size() : 0;
    return n;
  }
};

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

const char* TransportName(Transport t) {
  switch (t) {
    case Transport::kAuto:
      return "auto";
    case Transport::kUnary:
      return "unary";
    case Transport::kStream:
      return "stream";
    case Transport::kShm:
      return "shm";
  }
  return "?";
}

absl::StatusOr<Transport> ParseTransport(const std::string& name) {
  if (name == "auto") return Transport::kAuto;
  if (name == "unary") return Transport::kUnary;
  if (name == "stream") return Transport::kStream;
  if (name == "shm") return Transport::kShm;
  return absl::InvalidArgumentError(absl::StrCat("transport: '", name, "' is not one of auto, unary, stream, shm"));
}

Problem RequestSpec::ToProblem() const {
  Problem p;
  p.shape = shape;
  p.dtype = dtype;
  p.mask = mask;
  p.scale = scale ? *scale : DefaultScale(shape.head_dim);
  p.want_lse = want_lse;
  return p;
}

uint64_t RequestSpec::q_bytes() const { return static_cast<uint64_t>(QElems(shape)) * DTypeBytes(dtype); }
uint64_t RequestSpec::kv_bytes() const { return static_cast<uint64_t>(KVElems(shape)) * DTypeBytes(dtype); }
uint64_t RequestSpec::lse_bytes() const { return want_lse ? static_cast<uint64_t>(LseElems(shape)) * 4 : 0; }

absl::Status FromGrpcStatus(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  // grpc::StatusCode and absl::StatusCode share their numeric values (both follow google.rpc.Code).
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

// ---------------------------------------------------------------------------------------------------------
// Streaming call: header, then Q, K, V chunks in order; the reply is a header then O and LSE chunks.
class Client::StreamCall final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  StreamCall(std::shared_ptr<const Outgoing> sent, ForwardCallback done, uint64_t chunk_bytes,
             std::optional<ForwardOutputs> outputs)
      : sent_(std::move(sent)),
        done_(std::move(done)),
        chunk_bytes_(chunk_bytes),
        start_(absl::Now()),
        outputs_(outputs) {}

  // Takes ownership of itself: deleted in OnDone, or here when nothing could be started.
  void Start(grpc::GenericStub* stub, const Client& client, const CallOptions& call) {
    client.Prepare(&ctx_, call);
    const ReplyBytes want = ExpectedReplyBytes(sent_->header);
    dest_[0].limit = want.o;
    dest_[1].limit = want.lse;
    v1::ForwardStreamRequest header;
    *header.mutable_header() = sent_->header;
    bool own_buffer = false;
    const grpc::Status serialized =
        grpc::SerializationTraits<v1::ForwardStreamRequest>::Serialize(header, &out_, &own_buffer);
    if (!serialized.ok()) {
      ForwardCallback done = std::move(done_);
      delete this;
      done(FromGrpcStatus(serialized));
      return;
    }
    stub->PrepareBidiStreamingCall(&ctx_, kForwardStreamMethod, grpc::StubOptions(), this);
    StartWrite(&out_);
    StartRead(&in_buf_);
    StartCall();
  }

  void OnWriteDone(bool ok) override {
    // !ok: the stream is broken (the server answered early, e.g. with a validation error); OnDone reports.
    if (!ok) return;
    if (NextChunk()) {
      StartWrite(&out_);
    } else {
      StartWritesDone();
    }
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;
    absl::Status st = Receive();
    if (!st.ok()) {
      if (protocol_error_.ok()) protocol_error_ = st;
      ctx_.TryCancel();
      return;
    }
    StartRead(&in_buf_);
  }

  void OnDone(const grpc::Status& s) override {
    absl::StatusOr<ForwardResult> out;
    if (!protocol_error_.ok()) {
      out = protocol_error_;
    } else if (!s.ok()) {
      out = FromGrpcStatus(s);
    } else if (!have_header_) {
      out = absl::InternalError("ForwardStream: the server closed the stream without a header");
    } else {
      if (outputs_) {
        result_.outputs = ForwardOutputs{outputs_->o.first(dest_[0].filled), outputs_->lse.first(dest_[1].filled)};
      }
      out = Completed(*sent_, std::move(result_), Transport::kStream, start_);
    }
    ForwardCallback done = std::move(done_);
    delete this;
    done(std::move(out));
  }

 private:
  // Fills out_ with the next chunk; false when every inline byte has been sent.
  bool NextChunk() {
    static constexpr v1::TensorName kNames[3] = {v1::TENSOR_NAME_Q, v1::TENSOR_NAME_K, v1::TENSOR_NAME_V};
    while (tensor_ < 3) {
      const std::string_view data = sent_->tensors[tensor_].value_or(std::string_view());
      if (offset_ < data.size()) {
        // By reference while the owner lives on in the slices; copied into them when there is none.
        const uint64_t n = std::min<uint64_t>(chunk_bytes_, data.size() - offset_);
        out_ = SerializeStreamChunk(kNames[tensor_], offset_, data.data() + offset_, n, sent_->owner);
        offset_ += n;
        return true;
      }
      ++tensor_;
      offset_ = 0;
    }
    return false;
  }

  // Where one reply tensor goes: the caller's memory (`mem`, CallOptions::outputs) or the result's string.
  struct Dest {
    std::string* str = nullptr;
    char* mem = nullptr;
    uint64_t filled = 0, limit = 0;

    // The next n bytes, to be written by the caller.
    char* Extend(uint64_t n) {
      const uint64_t at = filled;
      filled += n;
      if (mem != nullptr) return mem + at;
      str->resize(filled);  // within the capacity reserved at the header
      return str->data() + at;
    }
    void Truncate(uint64_t n) {
      filled = n;
      if (str != nullptr) str->resize(n);
    }
  };

  // O and LSE chunks are copied from gRPC's slices straight to their destination (ReadStreamChunk); the
  // header and anything unusual go through protobuf.
  absl::Status Receive() {
    if (have_header_) {
      absl::Status refused;
      Dest* grown = nullptr;
      uint64_t before = 0;
      const ChunkRead r = ReadStreamChunk(in_buf_, [&](const ChunkHead& h) -> char* {
        absl::StatusOr<Dest*> dst = Place(h);
        if (!dst.ok()) {
          refused = dst.status();
          return nullptr;
        }
        grown = *dst;
        before = grown->filled;
        return grown->Extend(h.size);
      });
      if (r == ChunkRead::kDone) return absl::OkStatus();
      if (r == ChunkRead::kRefused) return refused;
      if (grown != nullptr) grown->Truncate(before);
    }
    const grpc::Status parsed = grpc::SerializationTraits<v1::ForwardStreamResponse>::Deserialize(&in_buf_, &in_);
    if (!parsed.ok()) {
      return absl::InternalError(absl::StrCat("ForwardStream: an unreadable response message: ", parsed.error_message()));
    }
    if (in_.has_header()) {
      if (have_header_) return absl::InternalError("ForwardStream: a second response header");
      have_header_ = true;
      FillResultHeader(*in_.mutable_header(), result_);
      if (outputs_) {
        dest_[0].mem = outputs_->o.data();
        dest_[1].mem = outputs_->lse.data();
      } else {
        dest_[0].str = &result_.o;
        dest_[1].str = &result_.lse;
        result_.o.reserve(dest_[0].limit);
        result_.lse.reserve(dest_[1].limit);
      }
      return absl::OkStatus();
    }
    if (!in_.has_chunk()) return absl::InternalError("ForwardStream: an empty response message");
    const v1::TensorChunk& c = in_.chunk();
    absl::StatusOr<Dest*> dst = Place({c.tensor(), c.offset(), c.data().size()});
    if (!dst.ok()) return dst.status();
    if (!c.data().empty()) std::memcpy((*dst)->Extend(c.data().size()), c.data().data(), c.data().size());
    return absl::OkStatus();
  }

  // The result tensor a reply chunk extends, after checking it follows on and fits the shape.
  absl::StatusOr<Dest*> Place(const ChunkHead& c) {
    if (!have_header_) return absl::InternalError("ForwardStream: a chunk before the response header");
    Dest* dst;
    if (c.tensor == v1::TENSOR_NAME_O) {
      dst = &dest_[0];
    } else if (c.tensor == v1::TENSOR_NAME_LSE) {
      dst = &dest_[1];
    } else {
      return absl::InternalError(absl::StrCat("ForwardStream: a response chunk of tensor ", c.tensor));
    }
    if (c.offset != dst->filled) {
      return absl::InternalError(absl::StrCat("ForwardStream: ", v1::TensorName_Name(c.tensor), " chunk at offset ",
                                              c.offset, ", expected ", dst->filled));
    }
    if (c.size > dst->limit - dst->filled) {
      return absl::InternalError(absl::StrCat("ForwardStream: ", v1::TensorName_Name(c.tensor),
                                              " longer than the ", dst->limit, " bytes its shape implies"));
    }
    return dst;
  }

  grpc::ClientContext ctx_;
  std::shared_ptr<const Outgoing> sent_;
  ForwardCallback done_;
  const uint64_t chunk_bytes_;
  const absl::Time start_;
  grpc::ByteBuffer out_, in_buf_;
  v1::ForwardStreamResponse in_;
  int tensor_ = 0;       // 0..2: Q, K, V being sent
  uint64_t offset_ = 0;  // bytes of that tensor sent
  bool have_header_ = false;
  ForwardResult result_;
  const std::optional<ForwardOutputs> outputs_;
  Dest dest_[2];  // O, LSE; their limits are the sizes the request implies
  absl::Status protocol_error_;  // written only from OnReadDone, read in OnDone (which follows every reaction)
};

// ---------------------------------------------------------------------------------------------------------

absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeChannel(const ClientOptions& options, const std::string& target) {
  absl::StatusOr<std::vector<ChannelArg>> extra = ParseChannelArgs(options.grpc_args, "grpc_arg");
  if (!extra.ok()) return extra.status();
  auto ours = [&extra](absl::string_view name) { return !SetsChannelArg(*extra, name); };
  grpc::ChannelArguments args;
  if (ours(GRPC_ARG_MAX_SEND_MESSAGE_LENGTH)) args.SetMaxSendMessageSize(options.max_send_message_bytes);
  if (ours(GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH)) args.SetMaxReceiveMessageSize(options.max_receive_message_bytes);
  if (absl::StartsWith(target, "dns:") && !options.dns_load_balancing.empty() && ours(GRPC_ARG_LB_POLICY_NAME)) {
    args.SetLoadBalancingPolicyName(options.dns_load_balancing);
  }
  if (options.own_connection && ours(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL)) {
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  }
  if (!options.tls_server_name.empty() && ours(GRPC_SSL_TARGET_NAME_OVERRIDE_ARG)) {
    args.SetSslTargetNameOverride(options.tls_server_name);
  }
  for (const ChannelArg& arg : *extra) {
    std::visit(
        [&](const auto& v) {
          if constexpr (std::is_same_v<std::decay_t<decltype(v)>, int>) {
            args.SetInt(arg.name, v);
          } else {
            args.SetString(arg.name, v);
          }
        },
        arg.value);
  }
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> creds = ChannelCredentials(options);
  if (!creds.ok()) return creds.status();
  auto channel = grpc::CreateCustomChannel(target, *creds, args);
  if (!channel) return absl::InvalidArgumentError(absl::StrCat("target: cannot create a channel to '", target, "'"));
  return channel;
}

absl::StatusOr<std::unique_ptr<Client>> Client::Create(const ClientOptions& options) {
  if (options.target.empty()) return absl::InvalidArgumentError("target: empty");
  if (options.default_deadline <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("default_deadline: must be positive");
  }
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = MakeChannel(options, options.target);
  if (!channel.ok()) return channel.status();
  return std::unique_ptr<Client>(new Client(options, *std::move(channel)));
}

Client::Client(ClientOptions options, std::shared_ptr<grpc::Channel> channel)
    : options_(std::move(options)),
      channel_(std::move(channel)),
      stub_(v1::Attention::NewStub(channel_)),
      generic_(std::make_unique<grpc::GenericStub>(channel_)) {}

Client::~Client() = default;

void Client::Prepare(grpc::ClientContext* ctx, const CallOptions& call) const {
  const absl::Duration d = call.deadline ? *call.deadline : options_.default_deadline;
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + d));
  ctx->set_wait_for_ready(call.wait_for_ready);
  if (!options_.auth_token.empty()) ctx->AddMetadata("authorization", "Bearer " + options_.auth_token);
}

uint64_t Client::ChunkBytes(uint64_t max_message_bytes) const {
  uint64_t c = options_.stream_chunk_bytes ? options_.stream_chunk_bytes : kDefaultChunkBytes;
  if (max_message_bytes > 0) {
    const uint64_t fit = max_message_bytes > 2 * kMessageOverhead ? max_message_bytes - kMessageOverhead
                                                                  : std::max<uint64_t>(1, max_message_bytes / 2);
    c = std::min(c, fit);
  }
  return c;
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

void Client::StartStream(std::shared_ptr<const Outgoing> sent, ForwardCallback done, const CallOptions& call,
                         uint64_t max_message_bytes) {
  auto* s = new StreamCall(std::move(sent), std::move(done), ChunkBytes(max_message_bytes), call.outputs);
  s->Start(generic_.get(), *this, call);
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

std::optional<uint64_t> Client::CachedMaxMessageBytes() const {
  absl::MutexLock lock(&info_mu_);
  if (!info_) return std::nullopt;
  return info_->limits().max_message_bytes();
}

absl::StatusOr<v1::ServerInfo> Client::ServerInfo(bool refresh, const CallOptions& call) {
  if (!refresh) {
    absl::MutexLock lock(&info_mu_);
    if (info_) return *info_;
  }
  grpc::ClientContext ctx;
  Prepare(&ctx, call);
  v1::ServerInfo info;
  absl::Status st = FromGrpcStatus(stub_->GetServerInfo(&ctx, v1::GetServerInfoRequest(), &info));
  if (!st.ok()) return st;
  absl::MutexLock lock(&info_mu_);
  info_ = info;
  return info;
}

absl::StatusOr<v1::ServerStats> Client::Stats(const CallOptions& call) {
  grpc::ClientContext ctx;
  Prepare(&ctx, call);
  v1::ServerStats stats;
  absl::Status st = FromGrpcStatus(stub_->GetStats(&ctx, v1::GetStatsRequest(), &stats));
  if (!st.ok()) return st;
  return stats;
}

absl::StatusOr<std::string> Client::RegisterCudaBuffer(const v1::RegisterCudaBufferRequest& request,
                                                       const CallOptions& call) {
  grpc::ClientContext ctx;
  Prepare(&ctx, call);
  v1::RegisterCudaBufferResponse resp;
  absl::Status st = FromGrpcStatus(stub_->RegisterCudaBuffer(&ctx, request, &resp));
  if (!st.ok()) return st;
  return resp.buffer_id();
}

absl::Status Client::UnregisterCudaBuffer(const std::string& buffer_id, const CallOptions& call) {
  grpc::ClientContext ctx;
  Prepare(&ctx, call);
  v1::UnregisterCudaBufferRequest req;
  req.set_buffer_id(buffer_id);
  v1::UnregisterCudaBufferResponse resp;
  return FromGrpcStatus(stub_->UnregisterCudaBuffer(&ctx, req, &resp));
}

absl::StatusOr<std::vector<v1::CudaBufferInfo>> Client::ListCudaBuffers(const CallOptions& call) {
  grpc::ClientContext ctx;
  Prepare(&ctx, call);
  v1::ListCudaBuffersResponse resp;
  absl::Status st = FromGrpcStatus(stub_->ListCudaBuffers(&ctx, v1::ListCudaBuffersRequest(), &resp));
  if (!st.ok()) return st;
  return std::vector<v1::CudaBufferInfo>(resp.buffers().begin(), resp.buffers().end());
}

absl::Status Client::CheckHealth(const std::string& service, const CallOptions& call) {
  // grpc.health.v1 is called generically: Debian ships neither health.proto nor its generated stubs, and the
  // two messages are one field each (HealthCheckRequest.service = 1, HealthCheckResponse.status = 1).
  std::string req;
  if (!service.empty()) {
    req.push_back(0x0a);  // field 1, length-delimited
    uint64_t n = service.size();
    while (n >= 0x80) {
      req.push_back(static_cast<char>((n & 0x7f) | 0x80));
      n >>= 7;
    }
    req.push_back(static_cast<char>(n));
    req += service;
  }
  grpc::Slice slice(req);
  grpc::ByteBuffer request_buf(&slice, 1), response_buf;
  grpc::GenericStub generic(channel_);
  grpc::ClientContext ctx;
  Prepare(&ctx, call);
  absl::Notification finished;
  grpc::Status status;
  generic.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request_buf, &response_buf,
                    [&](grpc::Status s) {
                      status = std::move(s);
                      finished.Notify();
                    });
  finished.WaitForNotification();
  if (!status.ok()) return FromGrpcStatus(status);
  std::vector<grpc::Slice> slices;
  if (!response_buf.Dump(&slices).ok()) return absl::InternalError("health: unreadable response");
  std::string resp;
  for (const auto& s : slices) resp.append(reinterpret_cast<const char*>(s.begin()), s.size());
  // The response is empty (status 0 = UNKNOWN) or holds field 1 as a one-byte varint.
  int serving_status = 0;
  if (resp.size() >= 2 && resp[0] == 0x08) serving_status = static_cast<unsigned char>(resp[1]);
  static constexpr const char* kNames[] = {"UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN"};
  if (serving_status == 1) return absl::OkStatus();
  return absl::UnavailableError(
      absl::StrCat("health: '", service, "' is ", serving_status < 4 ? kNames[serving_status] : "an unknown status"));
}

}  // namespace attnd::client
