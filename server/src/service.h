// The attnd.v1.Attention service on the gRPC callback API. Handlers validate, translate to a ForwardJob and
// hand it to the Backend; the backend's `done` (on a backend thread) finishes the reactor, so no gRPC thread
// ever waits for a computation.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "attnd/server/backend.h"
#include "attnd/server/server.h"
#include "attnd/server/validation.h"
#include "attnd/v1/attention.grpc.pb.h"
#include "rpc_stats.h"

namespace attnd::server {

class PeerCalls;

// Every method on the callback API; Forward and ForwardStream raw (ByteBuffer messages) so that their
// tensors are written by reference and stream chunks read with one copy (attnd/transport/zero_copy.h). The wire
// format is unchanged.
using AttentionServiceBase = v1::Attention::WithRawCallbackMethod_Forward<
    v1::Attention::WithRawCallbackMethod_ForwardStream<v1::Attention::WithCallbackMethod_RegisterCudaBuffer<
        v1::Attention::WithCallbackMethod_UnregisterCudaBuffer<v1::Attention::WithCallbackMethod_ListCudaBuffers<
            v1::Attention::WithCallbackMethod_GetServerInfo<v1::Attention::WithCallbackMethod_GetStats<
                v1::Attention::Service>>>>>>>;

class AttentionService final : public AttentionServiceBase {
 public:
  AttentionService(const ServerOptions& options, Backend* backend);

  grpc::ServerUnaryReactor* Forward(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request,
                                    grpc::ByteBuffer* response) override;
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

  // From here on new Forward calls are answered UNAVAILABLE (those already accepted still complete).
  void BeginShutdown() { shutting_down_.store(true); }
  // Per-connection limit on Forward/ForwardStream calls (call_observer.h); null: none. Set before serving.
  void set_peer_calls(const PeerCalls* peers) { peer_calls_ = peers; }

  // Validation + backend acceptance + deadline/cancel check of a request about to be submitted. `in_message`:
  // q/k/v left in the gRPC message's slices (ReadForwardRequest), or null.
  absl::Status Prepare(const v1::ForwardRequest& request, Transport transport, grpc::CallbackServerContext* ctx,
                       ForwardJob* job, RequestBytes* bytes, const InlineBytes* in_message = nullptr) const;
  // Gives a request without an id one, and sends that id back in trailing metadata (kRequestIdMetadata).
  void NameRequest(grpc::CallbackServerContext* ctx, v1::ForwardRequest& request);
  // Forward from the same-host shared-memory channel (shm_listener.h): the same validation, backend and response
  // as Forward, without a gRPC call. `reply` runs exactly once: on a backend thread, or inline when the request is
  // refused before it reaches the backend.
  using LocalReply = std::function<void(absl::Status, std::shared_ptr<v1::ForwardResponse>)>;
  void ForwardLocal(std::shared_ptr<v1::ForwardRequest> request, LocalReply reply);
  // Fills the response header fields (request_id, timing, backend, kernel, device) from a finished job.
  void FillResponseHeader(const ForwardJob& job, v1::ForwardResponse* response) const;

  Backend* backend() const { return backend_; }
  // ForwardStream calls whose header was accepted and whose inputs are still arriving (GetStats, metrics).
  uint32_t streams_receiving() const { return streams_receiving_.load(std::memory_order_relaxed); }
  // Called by a stream as it starts (true) and stops (false) receiving its inputs.
  void CountReceiving(bool receiving) {
    if (receiving) {
      streams_receiving_.fetch_add(1, std::memory_order_relaxed);
    } else {
      streams_receiving_.fetch_sub(1, std::memory_order_relaxed);
    }
  }
  RpcStatsTable& stats() { return stats_; }
  uint64_t stream_chunk_bytes() const { return stream_chunk_bytes_; }

 private:
  // Finishes a call answered without the backend (errors, metadata RPCs) and records it.
  grpc::ServerUnaryReactor* FinishNow(grpc::CallbackServerContext* ctx, const char* method, absl::Time start,
                                      const absl::Status& status, const std::string& request_id = "");
  absl::Status CheckIpcTransport(grpc::CallbackServerContext* ctx, const char* method) const;

  const ServerOptions options_;
  Backend* const backend_;
  const ValidationLimits limits_;
  const uint64_t stream_chunk_bytes_;
  RpcStatsTable stats_;
  std::atomic<bool> shutting_down_{false};
  std::atomic<uint32_t> streams_receiving_{0};
  const PeerCalls* peer_calls_ = nullptr;
};

}  // namespace attnd::server
