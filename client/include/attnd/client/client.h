// The attnd client library: one channel to a server, sync and async Forward that pick the unary or the
// streaming RPC by payload size, and passthroughs for the other RPCs. Every result is absl::Status(Or);
// grpc::Status is translated in exactly one place (FromGrpcStatus).
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "attnd/problem.h"
#include "attnd/v1/attention.grpc.pb.h"
#include "attnd/v1/attention.pb.h"
#include "grpcpp/channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/status.h"

namespace attnd::client {

class ShmChannel;  // attnd/client/shm_channel.h

// Which RPC carries a Forward call.
enum class Transport {
  // Streaming when the request's inline tensors reach the server's ServerInfo.stream_preferred_from_bytes
  // (non-zero on a CUDA server that copies a stream's chunks to the device while the rest arrives) and it
  // names no registered buffer; otherwise unary when request and reply fit the server's message limit,
  // streaming when not.
  kAuto,
  kUnary,   // always Attention.Forward (RESOURCE_EXHAUSTED before sending when a message limit would stop it)
  kStream,  // always Attention.ForwardStream
  // The same-host shared-memory channel (the server's --shm_socket), no RPC at all: carried by a ShmChannel
  // (attnd/client/shm_channel.h, ForwardOverShm), never by Client, whose Forward calls fail INVALID_ARGUMENT.
  kShm,
};
const char* TransportName(Transport t);
// "auto" | "unary" | "stream" | "shm".
absl::StatusOr<Transport> ParseTransport(const std::string& name);

struct ClientOptions {
  // host:port, unix:/path (or unix:///abs/path), or a fleet of servers: dns:///name:port (every address the
  // name resolves to, e.g. a Kubernetes headless Service) or ipv4:host:port,host:port,... (ipv6: likewise);
  // or any other gRPC target URI. Over a fleet, calls are spread by `load_balancing` and a sequence's calls go
  // to the server that holds it ("Pinning" below).
  std::string target = "127.0.0.1:50051";
  // Deadline of a call that does not give its own (CallOptions::deadline).
  absl::Duration default_deadline = absl::Seconds(120);
  Transport transport = Transport::kAuto;
  // Bytes of tensor data per ForwardStream chunk; 0: 1 MiB, always clamped below the server's message limit.
  uint64_t stream_chunk_bytes = 0;
  // Largest message this client sends/accepts; -1: no client-side limit (the server enforces its own).
  int max_send_message_bytes = -1;
  int max_receive_message_bytes = -1;
  // gRPC load-balancing policy of a fleet target (dns:, ipv4: or ipv6: with several addresses), over the servers
  // whose grpc.health.v1 status is SERVING (watched); empty: gRPC's default (pick_first: every call to one
  // server, health not watched).
  std::string load_balancing = "round_robin";
  // Give this client its own connection instead of sharing one with other clients of the same target
  // (in-process load tests and "N clients" tests want N real connections).
  bool own_connection = false;

  // Security (docs/security-and-metrics.md). Any tls_* set: the channel speaks TLS.
  std::string tls_ca_file;    // PEM CA bundle the server's certificate must chain to (empty: the system roots)
  std::string tls_cert_file;  // PEM client certificate, for servers that require mutual TLS (with tls_key_file)
  std::string tls_key_file;
  std::string tls_server_name;  // name checked against the server's certificate instead of the target's host
  std::string auth_token;       // sent as "authorization: Bearer <token>" with every call

  // gRPC channel arguments "name=value" applied last (attnd/transport/channel_args.h); a malformed one fails Create.
  std::vector<std::string> grpc_args;

  // The server's --shm_socket: with transport kShm, Step calls travel over shared-memory channels opened there
  // (one per call in flight, kept for reuse). Every other call still goes over gRPC to `target`.
  std::string shm_socket;
  // Largest request or reply area such a channel asks for (the server's --shm_max_bytes must allow it too).
  uint64_t shm_max_area_bytes = 64ull << 20;
  // Steps on a StepStream: how long the calling thread polls for a step's answer before it sleeps until the
  // answer wakes it (zero: it sleeps at once), while at most two steps of this process wait (more pollers
  // would take the cores from the server and each other). An answer that comes within the poll spares the
  // caller a wake-up from sleep, as for the shm channel's caller (docs/tuning.md, "Service").
  absl::Duration step_poll = absl::Microseconds(300);
  // A sequence its server moved away (NOT_FOUND "moved to <new id>", the new id also in trailing metadata
  // attnd-moved-to; docs/sequences.md "Drain"): a call about it goes once more, to the new id, and old -> new is
  // remembered for this client's later calls, the latest this many of them.
  size_t moved_ids_remembered = 4096;
  // A step refused ABORTED because a sequence of it is being moved goes again after 1 ms, doubling to 50 ms, for
  // up to this long (the move ends, then the step follows the new id); so does a MoveSequence whose export was
  // refused because a step of the sequence is in flight. Zero: that ABORTED is the answer.
  absl::Duration moving_step_retry = absl::Seconds(10);
  // MoveSequence's bytes (MovePath::kBytes) travel over connections of their own to each server, up to this many
  // per server, a move taking an idle one: one connection carries a stream's bytes on one thread at each end and
  // shares HTTP/2 flow control, so moves at once on one connection go no faster than one, and the calls that share
  // it (steps) would share that window with their frames. Zero: moves share the connections of the other calls.
  int move_connections = 8;
};

// Memory of the caller's that a call writes O (and LSE) into, instead of fresh strings in its ForwardResult.
// Each span must be exactly the bytes the request implies (RequestSpec::o_bytes / lse_bytes; o empty when the
// request names an O buffer, lse empty unless it asks for LSE), and nobody else may touch it until the call's
// `done` has run. Reused call after call, it spares each call allocating and page-faulting its result: a
// 32 MiB O (4k tokens x 32 heads x 128) is past what glibc keeps in its heap, so a fresh one is mmapped and
// faulted in page by page on every call.
struct ForwardOutputs {
  absl::Span<char> o;
  absl::Span<char> lse;
};

struct CallOptions {
  std::optional<absl::Duration> deadline;  // unset: ClientOptions::default_deadline
  std::optional<Transport> transport;      // unset: ClientOptions::transport
  bool wait_for_ready = false;             // queue the call while the channel connects instead of failing fast
  std::optional<ForwardOutputs> outputs;   // unset: O and LSE arrive in ForwardResult::o / lse
  // Sent with each unary or move call this call makes, as (key, value) pairs: a fleet's server acting for a caller
  // (attnd-peer-secret, attnd-owner; docs/security-and-metrics.md). Not with steps over a StepStream (a stream
  // serves many calls) or the shared-memory channel: a step that must carry them goes with Transport::kUnary.
  std::vector<std::pair<std::string, std::string>> metadata;
};

// The shape and semantics of a request, in host form (Problem plus the optional scale).
struct RequestSpec {
  Shape shape;
  DType dtype = DType::kBF16;  // kFP8E4M3: Q, K and V are e4m3 codes read through the descales below; O is bf16
  Mask mask = Mask::kNone;
  std::optional<float> scale;  // unset: the server's default 1/sqrt(head_dim)
  bool want_lse = false;
  std::string request_id;
  // Float8 requests (ForwardRequest.q_descale): 1 value or one per head (q_heads; kv_heads for K and V), each finite
  // and > 0. Sent as given, also with a 16-bit dtype: the server is the one that refuses them there.
  std::vector<float> q_descale, k_descale, v_descale;

  // The Problem this request computes (scale resolved to its default).
  Problem ToProblem() const;
  // Bytes of Q, K (= V), O (OutputDType: bf16 for float8 inputs) and LSE.
  uint64_t q_bytes() const;
  uint64_t kv_bytes() const;
  uint64_t o_bytes() const;
  uint64_t lse_bytes() const;
};

// A ForwardRequest with inline tensors (the bytes are moved in, not copied).
v1::ForwardRequest MakeForwardRequest(const RequestSpec& spec, std::string q, std::string k, std::string v);
// The proto enums of the host ones and back.
v1::Dtype ToProto(DType t);
v1::MaskType ToProto(Mask m);
absl::StatusOr<DType> FromProto(v1::Dtype t);
absl::StatusOr<Mask> FromProto(v1::MaskType m);

struct ForwardResult {
  std::string request_id;
  // [batch, q_len, q_heads, head_dim] in the request's dtype (bf16 for float8 inputs); empty when written to
  // CallOptions::outputs
  std::string o;
  std::string lse;  // fp32 [batch, q_heads, q_len] when asked for; empty when written to CallOptions::outputs
  // Set when the call wrote O and LSE into the caller's CallOptions::outputs: the bytes of each it wrote.
  std::optional<ForwardOutputs> outputs;
  // O and LSE wherever this call put them.
  std::string_view o_bytes() const { return outputs ? std::string_view(outputs->o.data(), outputs->o.size()) : o; }
  std::string_view lse_bytes() const {
    return outputs ? std::string_view(outputs->lse.data(), outputs->lse.size()) : lse;
  }
  v1::Timing timing;
  std::string backend, kernel;
  int device = -1;
  Transport transport = Transport::kUnary;  // the RPC that carried it
  absl::Duration latency;                   // client-side, call start to completion
  uint64_t bytes_sent = 0, bytes_received = 0;  // tensor payload bytes (Q+K+V out, O+LSE in)
};

using ForwardCallback = std::function<void(absl::StatusOr<ForwardResult>)>;

// Inline tensors in the caller's own memory ([batch, len, heads, head_dim] bytes as the RequestSpec says),
// sent without being copied into a request.
struct ForwardInputs {
  std::string_view q, k, v;
  // Keeps q, k and v valid and unchanged. gRPC holds shares of it until it no longer reads them, which may
  // be after the call's `done` has run. Required.
  std::shared_ptr<const void> keep_alive;
};

// The one translation of a gRPC status into an absl::Status (codes are numerically identical).
absl::Status FromGrpcStatus(const grpc::Status& s);

// The bytes of O and LSE that a reply to `request` carries inline: O unless the request names an O buffer,
// LSE when it asks for it (0 where the shape's product overflows: the server refuses such a request).
struct ReplyBytes {
  uint64_t o = 0, lse = 0;
};
ReplyBytes ExpectedReplyBytes(const v1::ForwardRequest& request);

// INTERNAL unless the reply's O (when inline) and LSE (when asked for) have the sizes `request` implies: a
// short or truncated answer is an error rather than a silent wrong result. Every Forward result passes it.
absl::Status CheckReplySizes(const v1::ForwardRequest& request, const ForwardResult& result);


// ---- KV sequences (docs/sequences.md, "Client and CLI") ----------------------------------------------------
//
// Pinning: a sequence id may end in '@host:port', the address of the server that holds it (its
// --advertise_address). Every call about such a sequence goes to that address when it differs from
// ClientOptions::target, over a channel of its own (one per address, cached for the client's life, with the
// target's credentials, TLS settings, token and channel arguments); a Step whose sequences name different
// servers is INVALID_ARGUMENT before anything is sent. Ids without '@' go to the target. With transport kShm a
// Step goes over the target's shared-memory channel unless its sequences are pinned elsewhere (then gRPC to
// that server: a shared-memory channel only reaches this host's server). OpenSequence, ForkSequence,
// TruncateSequence, CloseSequence and GetSequence always use gRPC.

// What a sequence caches (OpenSequence); fixed for its life.
struct SequenceShape {
  int64_t layers = 1;
  int64_t kv_heads = 1;
  int64_t head_dim = 128;
  DType dtype = DType::kBF16;  // of Q, O and the K/V rows a step sends
  KvFormat kv_format = KvFormat::kAsDtype;
  // kFp8E4M3 only (the server refuses them otherwise, and requires them with it): the fp32 descales of K and of V,
  // each finite and > 0: one for all, one per layer (`layers` values), or one per layer and kv head (layers x
  // kv_heads, layer-major). docs/sequences.md, "Float8 caches". ({}: brace-initialized shapes may leave them out.)
  std::vector<float> k_descale{}, v_descale{};

  // Bytes of one cached element of K or V: 1 for float8, else the dtype's.
  uint64_t kv_bytes() const { return kv_format == KvFormat::kFp8E4M3 ? 1 : static_cast<uint64_t>(DTypeBytes(dtype)); }
  // The value of `descale` (k_descale or v_descale, in any of its three forms) for kv head `head` at `layer`; 1 when
  // it is empty.
  float DescaleAt(const std::vector<float>& descale, int64_t layer, int64_t head) const;
};
// "bf16" | "fp16" (kAsDtype: the dtype's name) | "fp8_e4m3".
std::string KvDtypeName(const SequenceShape& s);
// The OpenSequence shape of a SequenceShape and back: the one place the client maps the two. FromProto is
// INVALID_ARGUMENT for a dtype or kv_dtype it does not know.
v1::SequenceShape ToProto(const SequenceShape& s);
absl::StatusOr<SequenceShape> FromProto(const v1::SequenceShape& s);

struct OpenedSequences {
  std::vector<std::string> ids;  // `count` of them, in the server's order
  int64_t max_tokens = 0;        // the per-sequence limit that applies
  int page_tokens = 0;           // tokens per page of the server's pool
};

// One of a Step's Q, K, V: inline bytes of the caller's (copied into the request), a registered CUDA buffer,
// or neither (absent: no q means append only; no k and v means attend only).
// How MoveSequence carries a sequence's rows (docs/sequences.md, "Moving a sequence").
enum class MovePath {
  kAuto,    // on the device when both servers report the same GPU (ServerInfo.devices[0].uuid), else kBytes
  kBytes,   // K and V stream through this client over gRPC
  kDevice,  // one GPU buffer the importer copies from (CUDA IPC); FAILED_PRECONDITION where it cannot be
};
const char* MovePathName(MovePath path);  // "auto", "bytes", "device"

struct MoveOptions {
  MovePath path = MovePath::kAuto;
};

struct MovedSequence {
  std::string sequence_id;             // the new id, on `to`
  MovePath path = MovePath::kBytes;    // the path that carried the rows: kBytes or kDevice
};

struct StepTensor {
  std::string_view data;
  std::optional<v1::TensorRef> ref;
  bool present() const { return ref.has_value() || !data.empty(); }
};

// One Step (StepRequest in attention.proto): the batch of sequences and their rows, back to back in q/k/v.
struct StepSpec {
  struct Entry {
    std::string sequence_id;
    int64_t tokens = 1;
  };
  std::vector<Entry> sequences;
  int64_t layer = 0;
  int64_t q_heads = 0;            // with q: a multiple of the sequences' kv_heads
  std::optional<float> scale;     // unset: the server's 1/sqrt(head_dim)
  bool want_lse = false;
  std::string request_id;
  StepTensor q, k, v;             // q [T, q_heads, head_dim]; k, v [T, kv_heads, head_dim]; T = sum of tokens
  std::optional<v1::TensorRef> o_ref;  // O into this registered buffer instead of StepResult::o
};
// The StepRequest of a spec (INVALID_ARGUMENT for an empty batch or a k without v or the reverse).
absl::StatusOr<v1::StepRequest> MakeStepRequest(const StepSpec& spec);

struct StepResult {
  std::string request_id;
  std::string o;    // [T, q_heads, head_dim]; empty without q or with o_ref
  std::string lse;  // fp32, per sequence [q_heads, tokens], back to back; when asked for
  v1::StepTiming timing;
  std::vector<int64_t> lengths;  // each sequence's cached tokens at the layer after the step, request order
  std::string backend, kernel;
  int device = -1;
  Transport transport = Transport::kUnary;  // kUnary (gRPC) or kShm
  absl::Duration latency;                   // client-side
  uint64_t bytes_sent = 0, bytes_received = 0;  // inline Q+K+V out, O+LSE in
};

// A StepResponse as a StepResult, after checking that O (inline), LSE (when asked for) and the lengths have
// the sizes `request` implies (INTERNAL otherwise: a short answer is an error, not a silent wrong result).
absl::StatusOr<StepResult> StepResultOf(const v1::StepRequest& request, v1::StepResponse response, Transport t,
                                        absl::Time start);

// The address part of a sequence id ('@host:port'), or "" when it has none.
std::string SequenceAddress(std::string_view sequence_id);

class Client {
 public:
  // Creates the channel; does not wait for the server (the first call connects).
  static absl::StatusOr<std::unique_ptr<Client>> Create(const ClientOptions& options);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  const ClientOptions& options() const { return options_; }

  // Blocks until the call completes. `request` must carry inline tensors (or references) and stays owned by
  // the caller.
  absl::StatusOr<ForwardResult> Forward(const v1::ForwardRequest& request, const CallOptions& call = {});
  // Starts the call and returns; `done` runs exactly once on a gRPC thread (it must not block long). The
  // request is shared so that a load test can send one request many times without copying it. With
  // Transport::kAuto the first call may block once to fetch GetServerInfo (cached afterwards); call
  // ServerInfo() beforehand to avoid even that.
  void ForwardAsync(std::shared_ptr<const v1::ForwardRequest> request, ForwardCallback done,
                    const CallOptions& call = {});
  std::future<absl::StatusOr<ForwardResult>> ForwardFuture(std::shared_ptr<const v1::ForwardRequest> request,
                                                           const CallOptions& call = {});
  // The same from a spec and tensors the caller keeps (ForwardInputs): no copy of them is made.
  void ForwardAsync(const RequestSpec& spec, ForwardInputs inputs, ForwardCallback done, const CallOptions& call = {});
  std::future<absl::StatusOr<ForwardResult>> ForwardFuture(const RequestSpec& spec, ForwardInputs inputs,
                                                           const CallOptions& call = {});

  // The transport kAuto picks for this request (fetches and caches the server info when needed).
  absl::StatusOr<Transport> ChooseTransport(const v1::ForwardRequest& request);


  // KV sequences (pinning: see above). `count` sequences of `shape` (0 means 1) on one server; max_tokens 0: the
  // server's limit. Over a fleet, a server that refuses them RESOURCE_EXHAUSTED (its pool full, its per-client
  // limits) or UNAVAILABLE (draining before a shutdown) passes the open on to the next one the load balancer
  // picks, until one takes them or every server has refused (RESOURCE_EXHAUSTED if any was out of room, else
  // UNAVAILABLE, naming each server's reason).
  absl::StatusOr<OpenedSequences> OpenSequence(const SequenceShape& shape, int64_t max_tokens = 0, uint32_t count = 1,
                                               const CallOptions& call = {});
  // Blocks until the step's reply. Transport: call.transport, else ClientOptions::transport; kShm goes over a
  // shared-memory channel at ClientOptions::shm_socket, kUnary over the unary Step RPC, kAuto and kStream over
  // a StepStream (one stream per step in flight, opened on first use and kept for reuse; a server without
  // StepStream gets unary Steps instead). The reply's O, LSE and lengths are checked against the sizes the
  // request implies (INTERNAL otherwise).
  absl::StatusOr<StepResult> Step(const v1::StepRequest& request, const CallOptions& call = {});
  absl::StatusOr<StepResult> Step(const StepSpec& spec, const CallOptions& call = {});
  absl::StatusOr<std::vector<std::string>> ForkSequence(const std::string& sequence_id, uint32_t count = 1,
                                                        const CallOptions& call = {});
  // Per-layer lengths after the truncation.
  absl::StatusOr<std::vector<int64_t>> TruncateSequence(const std::string& sequence_id, int64_t tokens,
                                                        const CallOptions& call = {});
  // All of `sequence_ids` must live on one server (else INVALID_ARGUMENT).
  absl::Status CloseSequence(const std::vector<std::string>& sequence_ids, const CallOptions& call = {});
  absl::StatusOr<v1::SequenceInfo> GetSequence(const std::string& sequence_id, const CallOptions& call = {});
  // Moves a sequence to the server at `to` (an address as after a sequence id's '@', which that server must
  // advertise): its cached K and V, every layer, stream from its server through this client into a new sequence
  // there, and the old one closes, answering later calls NOT_FOUND "moved to <new id>". Returns the new id. On any
  // failure the sequence stays where it was, unchanged, and nothing is left on `to` (docs/sequences.md, "Moving a
  // sequence"). A sequence with a step in flight is ABORTED (retry); shared pages arrive as the sequence's own.
  absl::StatusOr<std::string> MoveSequence(const std::string& sequence_id, const std::string& to,
                                           const CallOptions& call = {});
  // The same with the path chosen (MoveOptions: automatic by default, falling back to bytes when the exporter
  // refuses the device path FAILED_PRECONDITION); says which path carried the rows.
  absl::StatusOr<MovedSequence> MoveSequence(const std::string& sequence_id, const std::string& to,
                                             const MoveOptions& options, const CallOptions& call = {});

  // The id `sequence_id` goes by for this client now: itself, or the id its server moved it to once a call of
  // this client has followed the move (ClientOptions::moved_ids_remembered).
  std::string CurrentSequenceId(const std::string& sequence_id) const;
  // Moves this client has followed since it was made (each old -> new remembered): a caller holding ids learns
  // from a change here that CurrentSequenceId may answer differently.
  uint64_t moves_followed() const;

  // GetServerInfo, cached after the first success unless `refresh`.
  absl::StatusOr<v1::ServerInfo> ServerInfo(bool refresh = false, const CallOptions& call = {});
  absl::StatusOr<v1::ServerStats> Stats(const CallOptions& call = {});
  absl::StatusOr<std::string> RegisterCudaBuffer(const v1::RegisterCudaBufferRequest& request,
                                                 const CallOptions& call = {});
  absl::Status UnregisterCudaBuffer(const std::string& buffer_id, const CallOptions& call = {});
  absl::StatusOr<std::vector<v1::CudaBufferInfo>> ListCudaBuffers(const CallOptions& call = {});

  // Standard grpc.health.v1 check of `service` ("" = the whole server): OK when SERVING.
  absl::Status CheckHealth(const std::string& service = "", const CallOptions& call = {});

  std::shared_ptr<grpc::Channel> channel() const { return channel_; }

 private:
  class StreamCall;
  struct Outgoing;  // what one call sends: a header and the inline tensors (client_internal.h)

  // A request as an Outgoing; the result of a call whose reply arrived in full, accounted and size-checked.
  static std::shared_ptr<Outgoing> Split(std::shared_ptr<const v1::ForwardRequest> request);
  static absl::StatusOr<ForwardResult> Completed(const Outgoing& sent, ForwardResult res, Transport t,
                                                 absl::Time start);
  Client(ClientOptions options, std::shared_ptr<grpc::Channel> channel);
  // The stub for calls about sequences pinned to `address` ("" or the target: the main one), and its channel.
  absl::StatusOr<v1::Attention::Stub*> StubFor(const std::string& address);
  absl::StatusOr<std::shared_ptr<grpc::Channel>> ChannelFor(const std::string& address);
  // A connection of MoveSequence's own to the server at `address` (ClientOptions::move_connections), the one with
  // the fewest moves on it, held until ReturnMoveChannel; ChannelFor's when moves have none.
  struct MoveChannel {
    std::shared_ptr<grpc::Channel> channel;
    int lane = -1;  // -1: ChannelFor's, nothing to return
  };
  absl::StatusOr<MoveChannel> TakeMoveChannel(const std::string& address);
  void ReturnMoveChannel(const std::string& address, const MoveChannel& taken);
  // OpenSequence on the first server that has room (over a fleet, each RESOURCE_EXHAUSTED tries the next).
  absl::StatusOr<v1::OpenSequenceResponse> PlaceSequences(const v1::OpenSequenceRequest& request,
                                                          const CallOptions& call);
  // A unary call about sequences on the server of `address`, its failure naming that server.
  template <typename Request, typename Response>
  absl::StatusOr<Response> CallOn(const std::string& address,
                                  grpc::Status (v1::Attention::Stub::*rpc)(grpc::ClientContext*, const Request&,
                                                                           Response*),
                                  const Request& request, const CallOptions& call);
  // CallOn the server of one sequence, with the request naming it.
  template <typename Request, typename Response>
  absl::StatusOr<Response> CallAbout(const std::string& sequence_id,
                                     grpc::Status (v1::Attention::Stub::*rpc)(grpc::ClientContext*, const Request&,
                                                                              Response*),
                                     Request request, const CallOptions& call);
  // The one address of `ids` (INVALID_ARGUMENT naming `field` when they name different servers).
  static absl::StatusOr<std::string> AddressOf(const std::vector<std::string>& ids, const char* field);
  absl::StatusOr<StepResult> StepOverShm(const v1::StepRequest& request, const CallOptions& call);
  // One step on the server its sequences name, as sent (Step adds following moves and retries).
  absl::StatusOr<StepResult> StepOnce(const v1::StepRequest& request, const CallOptions& call);
  // When `st` says that one of `ids` moved (NOT_FOUND naming its new id): remembers old -> new and returns the new.
  std::optional<std::string> LearnMove(const absl::Status& st, const std::vector<std::string>& ids);
  // Where `ids` name two servers: the moves of each, learnt by asking about it (see the definition).
  void LearnMovesOf(const std::vector<std::string>& ids, const CallOptions& call);
  // The GPU the server at `address` keeps its sequences on (its first device's UUID; empty on the CPU backend or
  // when it cannot be asked), asked once and remembered; Forget drops it.
  std::string GpuOf(const std::string& address, const CallOptions& call);
  void ForgetGpuOf(const std::string& address);
  class StepStreamCall;
  // A step over an idle StepStream to `address` (a new one when none is idle); nullopt when that server has no
  // StepStream (the step was not sent).
  std::optional<absl::StatusOr<StepResult>> StepOverStream(v1::Attention::Stub* stub, const std::string& address,
                                                           const v1::StepRequest& request, const CallOptions& call);
  void Prepare(grpc::ClientContext* ctx, const CallOptions& call) const;
  uint64_t ChunkBytes(uint64_t max_message_bytes) const;
  // `request_bytes`: the whole message; `inline_bytes`: its tensors' share; `request`: at least its header.
  absl::StatusOr<Transport> ChooseTransportFor(uint64_t request_bytes, uint64_t inline_bytes,
                                               const v1::ForwardRequest& request);
  void Dispatch(std::shared_ptr<const Outgoing> sent, ForwardCallback done, const CallOptions& call);
  void StartUnary(std::shared_ptr<const Outgoing> sent, ForwardCallback done, const CallOptions& call);
  // The server's message limit from the cached ServerInfo (no RPC); nullopt before the first fetch.
  std::optional<uint64_t> CachedMaxMessageBytes() const;
  // RESOURCE_EXHAUSTED, before anything is sent, for a unary call that a message limit would stop.
  absl::Status CheckUnaryFits(uint64_t request_bytes, const v1::ForwardRequest& header, const CallOptions& call);
  void StartStream(std::shared_ptr<const Outgoing> sent, ForwardCallback done, const CallOptions& call,
                   uint64_t max_message_bytes);

  const ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Attention::Stub> stub_;
  std::unique_ptr<grpc::GenericStub> generic_;  // Forward and ForwardStream with tensors by reference (zero_copy.h)
  absl::Mutex pinned_mu_;
  struct Pinned {
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<v1::Attention::Stub> stub;
  };
  absl::flat_hash_map<std::string, Pinned> pinned_ ABSL_GUARDED_BY(pinned_mu_);
  absl::Mutex lanes_mu_;
  struct MoveLane {
    std::shared_ptr<grpc::Channel> channel;
    int moving = 0;  // moves on it now
  };
  absl::flat_hash_map<std::string, std::vector<MoveLane>> lanes_ ABSL_GUARDED_BY(lanes_mu_);  // address -> lanes
  absl::Mutex shm_mu_;
  std::vector<std::unique_ptr<ShmChannel>> shm_free_ ABSL_GUARDED_BY(shm_mu_);  // idle channels
  mutable absl::Mutex info_mu_;
  std::optional<v1::ServerInfo> info_ ABSL_GUARDED_BY(info_mu_);
  mutable absl::Mutex moved_mu_;
  absl::flat_hash_map<std::string, std::string> moved_ ABSL_GUARDED_BY(moved_mu_);  // old id -> new id
  std::deque<std::string> moved_order_ ABSL_GUARDED_BY(moved_mu_);                  // the oldest first
  std::atomic<uint64_t> moves_followed_{0};
  absl::Mutex gpus_mu_;
  absl::flat_hash_map<std::string, std::string> gpus_ ABSL_GUARDED_BY(gpus_mu_);  // address -> GpuOf's answer
  // Idle StepStreams by server address ("" for the target), and the addresses whose server has none. Declared
  // last: the streams end before the stubs and channels they were opened on.
  absl::Mutex step_streams_mu_;
  absl::flat_hash_map<std::string, std::vector<std::unique_ptr<StepStreamCall>>> step_streams_
      ABSL_GUARDED_BY(step_streams_mu_);
  absl::flat_hash_set<std::string> no_step_stream_ ABSL_GUARDED_BY(step_streams_mu_);
};

}  // namespace attnd::client
