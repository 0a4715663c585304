// The attnd.v1.Attention service on the gRPC callback API (the grpc-tcp and grpc-unix transports). Forward
// and ForwardStream decode their messages and hand the request to the Dispatcher; its reply (on a backend
// thread) finishes the reactor, so no gRPC thread ever waits for a computation. Forward and Step are served as
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
#include "attnd/v1/attention.grpc.pb.h"
#include "auth.h"
#include "bounded_unary.h"
#include "call_stats.h"

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

// Every method on the callback API; Forward and ForwardStream raw (ByteBuffer messages) so that their
// tensors are written by reference and stream chunks read with one copy (attnd/transport/zero_copy.h). The wire
// format is unchanged.
using SequenceMethods = v1::Attention::WithCallbackMethod_OpenSequence<v1::Attention::WithCallbackMethod_Step<
    v1::Attention::WithCallbackMethod_StepStream<v1::Attention::WithCallbackMethod_ForkSequence<
        v1::Attention::WithCallbackMethod_TruncateSequence<v1::Attention::WithCallbackMethod_CloseSequence<
            v1::Attention::WithCallbackMethod_GetSequence<v1::Attention::Service>>>>>>>;
using AttentionServiceBase = v1::Attention::WithRawCallbackMethod_Forward<
    v1::Attention::WithRawCallbackMethod_ForwardStream<v1::Attention::WithCallbackMethod_RegisterCudaBuffer<
        v1::Attention::WithCallbackMethod_UnregisterCudaBuffer<v1::Attention::WithCallbackMethod_ListCudaBuffers<
            v1::Attention::WithCallbackMethod_GetServerInfo<v1::Attention::WithCallbackMethod_GetStats<
                SequenceMethods>>>>>>>;

class AttentionService final : public AttentionServiceBase {
 public:
  // `dispatcher`, `sequences`, `buffers` (null: no cuda-ipc) and `stats` must outlive the service.
  AttentionService(const ServerOptions& options, Dispatcher* dispatcher, Sequences* sequences, BufferRegistry* buffers,
                   CallStats* stats);

  // Forward and Step are served as streams of one message each way (bounded_unary.h): their requests carry
  // tensors, and the upload bound needs to see the call before its message is in.
  void ServeForward(grpc::CallbackServerContext* ctx, absl::Time start, const grpc::ByteBuffer* request,
                    grpc::ByteBuffer* response, std::function<void(const absl::Status&)> done);
  void ServeStep(grpc::CallbackServerContext* ctx, absl::Time start, const v1::StepRequest* request,
                 v1::StepResponse* response, std::function<void(const absl::Status&)> done);
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* ForwardStream(grpc::CallbackServerContext* ctx) override;
  grpc::ServerUnaryReactor* RegisterCudaBuffer(grpc::CallbackServerContext* ctx,
                                               const v1::RegisterCudaBufferRequest* request,
                                               v1::RegisterCudaBufferResponse* response) override;
  grpc::ServerUnaryReactor* UnregisterCudaBuffer(grpc::CallbackServerContext* ctx,
                                                 const v1::UnregisterCudaBufferRequest* request,
                                                 v1::UnregisterCudaBufferResponse* response) override;
  grpc::ServerUnaryReactor* ListCudaBuffers(grpc::CallbackServerContext* ctx,
                                            const v1::ListCudaBuffersRequest* request,
                                            v1::ListCudaBuffersResponse* response) override;
  grpc::ServerUnaryReactor* GetServerInfo(grpc::CallbackServerContext* ctx, const v1::GetServerInfoRequest* request,
                                          v1::ServerInfo* response) override;
  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* ctx, const v1::GetStatsRequest* request,
                                     v1::ServerStats* response) override;

  // KV sequences (sequence_service.cc): thin over the Sequences core.
  grpc::ServerUnaryReactor* OpenSequence(grpc::CallbackServerContext* ctx, const v1::OpenSequenceRequest* request,
                                         v1::OpenSequenceResponse* response) override;
  grpc::ServerBidiReactor<v1::StepStreamRequest, v1::StepStreamResponse>* StepStream(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerUnaryReactor* ForkSequence(grpc::CallbackServerContext* ctx, const v1::ForkSequenceRequest* request,
                                         v1::ForkSequenceResponse* response) override;
  grpc::ServerUnaryReactor* TruncateSequence(grpc::CallbackServerContext* ctx,
                                             const v1::TruncateSequenceRequest* request,
                                             v1::TruncateSequenceResponse* response) override;
  grpc::ServerUnaryReactor* CloseSequence(grpc::CallbackServerContext* ctx, const v1::CloseSequenceRequest* request,
                                          v1::CloseSequenceResponse* response) override;
  grpc::ServerUnaryReactor* GetSequence(grpc::CallbackServerContext* ctx, const v1::GetSequenceRequest* request,
                                        v1::SequenceInfo* response) override;
  // Who owns what a call creates: the index of the bearer token in the call's own metadata when tokens are
  // on, else the peer's address without its port ("local" for the unix socket). docs/sequences.md, "ownership".
  std::string OwnerOf(grpc::CallbackServerContext* ctx) const;

  // Per-connection limit on Forward/ForwardStream calls (call_observer.h); null: none. Set before serving.
  void set_peer_calls(const PeerCalls* peers) { peer_calls_ = peers; }
  // The bearer-token check (--auth_token_file), which names a call's owner; null: tokens off. Set before serving.
  void set_auth(const BearerTokenProcessor* auth) { auth_ = auth; }

  // What the Dispatcher needs to know about a call: its deadline, cancellation and the per-connection limit.
  CallInfo CallFor(grpc::CallbackServerContext* ctx, absl::Time start, const InlineBytes* in_message = nullptr) const;
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
  std::string UploaderOf(grpc::CallbackServerContext* ctx) const;
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
  // Serves method `index` (its place in the proto's service, as the generated code numbers it) through
  // BoundedUnaryReactor: marked twice, for the API (raw or typed callback) and for the method type (a stream),
  // each mark owning the handler it is given.
  template <typename Request, typename Response>
  void ServeBounded(int index, bool raw, const typename BoundedUnaryReactor<Request, Response>::Handler* handler) {
    auto make = [this, handler] {
      return new grpc::internal::CallbackBidiHandler<Request, Response>([this, handler](grpc::CallbackServerContext* ctx) {
        return new BoundedUnaryReactor<Request, Response>(
            ctx, options_.upload_timeout,
            dispatcher_->shutting_down() ? absl::UnavailableError("the server is shutting down") : absl::OkStatus(),
            *handler);
      });
    };
    if (raw) {
      MarkMethodRawCallback(index, make());
    } else {
      MarkMethodCallback(index, make());
    }
    MarkMethodStreamed(index, make());
  }

  // Finishes a call answered without the backend (errors, metadata RPCs).
  grpc::ServerUnaryReactor* FinishNow(grpc::CallbackServerContext* ctx, const char* method, absl::Time start,
                                      const absl::Status& status, const std::string& request_id = "");
  absl::Status CheckIpcTransport(grpc::CallbackServerContext* ctx, const char* method) const;
  // Why a buffer RPC fails on a server without a BufferRegistry.
  absl::Status NoBuffers(const char* method) const;

  const ServerOptions options_;
  const BoundedUnaryReactor<grpc::ByteBuffer, grpc::ByteBuffer>::Handler forward_handler_;
  const BoundedUnaryReactor<v1::StepRequest, v1::StepResponse>::Handler step_handler_;
  Dispatcher* const dispatcher_;
  Sequences* const sequences_;
  BufferRegistry* const buffers_;
  CallStats* const stats_;
  const uint64_t stream_chunk_bytes_;
  ReceivingSlots receiving_;
  const PeerCalls* peer_calls_ = nullptr;
  const BearerTokenProcessor* auth_ = nullptr;
};

}  // namespace attnd::server
