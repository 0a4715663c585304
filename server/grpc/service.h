// The attnd.v1.Attention service on the gRPC callback API (the grpc-tcp and grpc-unix transports). Forward
// and ForwardStream decode their messages and hand the request to the Dispatcher; its reply (on a backend
// thread) finishes the reactor, so no gRPC thread ever waits for a computation. The unary methods are served as
// streams of one message each way (bounded_unary.h) so that their uploads are bounded. The buffer RPCs go to
// the BufferRegistry the server owns.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "attnd/server/backend.h"
#include "attnd/server/buffer_registry.h"
#include "attnd/server/dispatcher.h"
#include "attnd/server/sequences.h"
#include "attnd/server/server.h"
#include "attnd/server/validation.h"
#include "attnd/server/work_queue.h"
#include "attnd/v1/attention.grpc.pb.h"
#include "auth.h"
#include "bounded_unary.h"
#include "call_stats.h"
#include "grpc_status.h"

namespace attnd::server {

class PeerCalls;

// ForwardStream uploads in progress (a header accepted, inputs still arriving), in all and per client. Each holds
// its inputs' memory and a place in --max_queue until it ends or times out, so one client that opens many and
// stalls them would have every other client's calls refused for a full queue: a client holds at most
// `per_client` of them at once.
class ReceivingSlots {
 public:
  explicit ReceivingSlots(uint32_t per_client) : per_client_(per_client) {}
  // RESOURCE_EXHAUSTED naming --max_uploads_per_client when `client` already holds per_client slots.
  absl::Status Acquire(const std::string& client);
  void Release(const std::string& client);
  uint32_t total() const { return total_.load(std::memory_order_relaxed); }
  uint32_t per_client() const { return per_client_; }

 private:
  const uint32_t per_client_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, uint32_t> held_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint32_t> total_{0};
};

// The proto's streams on the callback API; ForwardStream, ExportSequence and ImportSequence raw (ByteBuffer
// messages) so that their chunks are read and written with one copy of their bytes (attnd/transport/zero_copy.h).
// Every other method is unary in the proto and served as a stream of one message each way (bounded_unary.h), marked
// so in the constructor: the server then sees a call from its headers on and bounds its upload
// (--upload_timeout_s). The wire format is unchanged.
using AttentionServiceBase = v1::Attention::WithRawCallbackMethod_ForwardStream<
    v1::Attention::WithCallbackMethod_StepStream<v1::Attention::WithRawCallbackMethod_ExportSequence<
        v1::Attention::WithRawCallbackMethod_ImportSequence<v1::Attention::Service>>>>;

// A streaming call refused as it starts (OwnerOf refused its peer metadata): finished with `why`.
template <typename Reactor>
class RefusedCall final : public Reactor {
 public:
  explicit RefusedCall(const absl::Status& why) { this->Finish(ToGrpcStatus(why)); }
  void OnDone() override { delete this; }
};

class AttentionService final : public AttentionServiceBase {
 public:
  // `dispatcher`, `sequences`, `buffers` (null: no cuda-ipc) and `stats` must outlive the service.
  AttentionService(const ServerOptions& options, Dispatcher* dispatcher, Sequences* sequences, BufferRegistry* buffers,
                   CallStats* stats);

  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* ForwardStream(grpc::CallbackServerContext* ctx) override;
  // KV sequences' steps over a stream (sequence_service.cc).
  grpc::ServerBidiReactor<v1::StepStreamRequest, v1::StepStreamResponse>* StepStream(
      grpc::CallbackServerContext* ctx) override;
  // sequence_moves.cc: a sequence's rows out of this server and into it, raw (their rows are copied once each way).
  grpc::ServerWriteReactor<grpc::ByteBuffer>* ExportSequence(grpc::CallbackServerContext* ctx,
                                                             const grpc::ByteBuffer* request) override;
  grpc::ServerReadReactor<grpc::ByteBuffer>* ImportSequence(grpc::CallbackServerContext* ctx,
                                                            grpc::ByteBuffer* response) override;

  // The unary methods, each answering through `done` (Forward and Step, whose answer comes from the backend) or
  // by its return value (the rest), with the response filled when OK.
  using Done = std::function<void(const absl::Status&)>;
  void ServeForward(grpc::CallbackServerContext* ctx, absl::Time start, const grpc::ByteBuffer* request,
                    grpc::ByteBuffer* response, Done done);
  void ServeStep(grpc::CallbackServerContext* ctx, absl::Time start, const v1::StepRequest* request,
                 v1::StepResponse* response, Done done);
  absl::Status ServeRegisterCudaBuffer(grpc::CallbackServerContext* ctx, const v1::RegisterCudaBufferRequest& request,
                                       v1::RegisterCudaBufferResponse* response);
  absl::Status ServeUnregisterCudaBuffer(grpc::CallbackServerContext* ctx,
                                         const v1::UnregisterCudaBufferRequest& request,
                                         v1::UnregisterCudaBufferResponse* response);
  absl::Status ServeListCudaBuffers(grpc::CallbackServerContext* ctx, const v1::ListCudaBuffersRequest& request,
                                    v1::ListCudaBuffersResponse* response);
  absl::Status ServeGetServerInfo(grpc::CallbackServerContext* ctx, const v1::GetServerInfoRequest& request,
                                  v1::ServerInfo* response);
  absl::Status ServeGetStats(grpc::CallbackServerContext* ctx, const v1::GetStatsRequest& request,
                             v1::ServerStats* response);
  // KV sequences (sequence_service.cc): thin over the Sequences core.
  absl::Status ServeOpenSequence(grpc::CallbackServerContext* ctx, const v1::OpenSequenceRequest& request,
                                 v1::OpenSequenceResponse* response);
  absl::Status ServeForkSequence(grpc::CallbackServerContext* ctx, const v1::ForkSequenceRequest& request,
                                 v1::ForkSequenceResponse* response);
  absl::Status ServeTruncateSequence(grpc::CallbackServerContext* ctx, const v1::TruncateSequenceRequest& request,
                                     v1::TruncateSequenceResponse* response);
  absl::Status ServeCloseSequence(grpc::CallbackServerContext* ctx, const v1::CloseSequenceRequest& request,
                                  v1::CloseSequenceResponse* response);
  absl::Status ServeGetSequence(grpc::CallbackServerContext* ctx, const v1::GetSequenceRequest& request,
                                v1::SequenceInfo* response);
  // Who owns what a call creates: the attnd-owner a fleet's server names with the peer secret (auth.h,
  // PeerOwnerOf), else the index of the bearer token in the call's own metadata when tokens are on, else the
  // peer's address without its port ("local" for the unix socket). docs/sequences.md, "ownership".
  // PERMISSION_DENIED naming the key for peer metadata this server does not accept.
  absl::StatusOr<std::string> OwnerOf(grpc::CallbackServerContext* ctx) const;

  // Per-connection limit on Forward/ForwardStream calls (call_observer.h); null: none. Set before serving.
  void set_peer_calls(const PeerCalls* peers) { peer_calls_ = peers; }
  // The bearer-token check (--auth_token_file), which names a call's owner; null: tokens off. Set before serving.
  void set_auth(const BearerTokenProcessor* auth) { auth_ = auth; }
  // The fleet's shared secret (--peer_secret_file); empty: no call may act as another owner. Set before serving.
  void set_peer_secret(std::string secret) { peer_secret_ = std::move(secret); }

  // What the Dispatcher needs to know about a call: its deadline, cancellation and the per-connection limit.
  CallInfo CallFor(grpc::CallbackServerContext* ctx, absl::Time start) const;
  // Gives a request without an id one, and sends that id back in trailing metadata (kRequestIdMetadata).
  void NameRequest(grpc::CallbackServerContext* ctx, v1::ForwardRequest& request);

  Dispatcher& dispatcher() const { return *dispatcher_; }
  Backend* backend() const { return dispatcher_->backend(); }
  // ForwardStream calls whose header was accepted and whose inputs are still arriving (GetStats, metrics).
  uint32_t streams_receiving() const { return receiving_.total(); }
  // The receiving streams' slots, per uploading client (--max_uploads_per_client).
  ReceivingSlots& receiving() { return receiving_; }
  // Who an upload slot is counted for: the owner of what a call creates (OwnerOf: its token, or its host), and
  // on the unix socket, where every caller is "local", its connection.
  absl::StatusOr<std::string> UploaderOf(grpc::CallbackServerContext* ctx) const;
  CallStats& stats() { return *stats_; }
  // --stream_idle_timeout_s: a ForwardStream silent this long while it should send is ended (zero: never).
  absl::Duration stream_idle_timeout() const;
  // --upload_timeout_s: a ForwardStream's header and inputs must all arrive this long after it starts (zero: never).
  absl::Duration upload_timeout() const;
  // A Forward, or a ForwardStream's header, is admitted while the requests queued and the streams receiving
  // are fewer than --max_queue together: an upload in progress holds its place in the queue, so a stream that
  // finishes its upload is not refused for a full queue, and uploads cannot hold memory beyond the queue's.
  // RESOURCE_EXHAUSTED naming max_queue otherwise.
  absl::Status AdmitToQueue() const;
  uint64_t stream_chunk_bytes() const { return stream_chunk_bytes_; }

 private:
  // Serves `method` through BoundedUnaryReactor. It is marked twice, for the API (raw or typed callback) and for the
  // method type (a stream), each mark owning the handler it is given. `refused_while_draining`: once the server
  // shuts down, calls are answered UNAVAILABLE as their headers arrive (the data plane; the control methods keep
  // answering, so that a client can still close its sequences and read the stats).
  template <typename Request, typename Response>
  void ServeBounded(const char* method, bool raw, bool refused_while_draining,
                    typename BoundedUnaryReactor<Request, Response>::Handler handler) {
    auto shared = std::make_shared<const typename BoundedUnaryReactor<Request, Response>::Handler>(std::move(handler));
    auto make = [this, shared, refused_while_draining] {
      return new grpc::internal::CallbackBidiHandler<Request, Response>(
          [this, shared, refused_while_draining](grpc::CallbackServerContext* ctx) {
            const bool refuse = refused_while_draining && dispatcher_->shutting_down();
            // Peer metadata is checked on every method, also those that own nothing: never silently ignored.
            absl::Status refusal = OwnerOf(ctx).status();
            if (refusal.ok() && refuse) refusal = absl::UnavailableError("the server is shutting down");
            return new BoundedUnaryReactor<Request, Response>(ctx, options_.timeouts.upload_timeout, refusal, shared);
          });
    };
    const int index = MethodIndex(method);
    if (raw) {
      MarkMethodRawCallback(index, make());
    } else {
      MarkMethodCallback(index, make());
    }
    MarkMethodStreamed(index, make());
  }

  // A method answered at once, on the gRPC thread that read its request.
  template <typename Request, typename Response>
  void ServeBoundedNow(const char* method, absl::Status (AttentionService::*serve)(grpc::CallbackServerContext*,
                                                                                   const Request&, Response*)) {
    ServeBounded<Request, Response>(
        method, /*raw=*/false, /*refused_while_draining=*/false,
        [this, method, serve](grpc::CallbackServerContext* ctx, absl::Time start, const Request* request,
                              Response* response, Done done) {
          const absl::Status status = (this->*serve)(ctx, *request, response);
          if (!status.ok()) LogOutcome(method, "", status, start);
          done(status);
        });
  }

  // The place of `method` in attnd.v1.Attention, which is how the generated service numbers its methods.
  static int MethodIndex(const char* method);
  absl::Status CheckIpcTransport(grpc::CallbackServerContext* ctx, const char* method) const;
  // Why a buffer RPC fails on a server without a BufferRegistry.
  absl::Status NoBuffers(const char* method) const;

  const ServerOptions options_;
  Dispatcher* const dispatcher_;
  Sequences* const sequences_;
  BufferRegistry* const buffers_;
  CallStats* const stats_;
  const uint64_t stream_chunk_bytes_;
  ReceivingSlots receiving_;
  const PeerCalls* peer_calls_ = nullptr;
  const BearerTokenProcessor* auth_ = nullptr;
  std::string peer_secret_;
  // Moves' device copies (sequence_moves.cc: an import's, an export's gather into a buffer), which wait for the
  // GPU. Four keep the copy engine fed: a copy of a 0.5 GB sequence outlasts the host work of the next three moves.
  WorkQueue device_copies_{4};
};

}  // namespace attnd::server
