// Watches every RPC from outside the handlers, as a gRPC server interceptor: gives a Forward request without
// a request_id a generated one (so that every log line of the request and its reply carry an id), writes one
// access-log line per RPC, records the call in ServerMetrics, and counts each peer's data-plane calls in
// progress for the per-client concurrency limit (PeerCalls::Admit, checked by the service).
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/support/server_interceptor.h"
#include "metrics.h"

namespace attnd::server {

// Forward/ForwardStream calls in progress per peer (a peer is one connection: "ipv4:10.0.0.7:51234",
// "unix:..."), so that one client cannot take every worker and the whole queue.
class PeerCalls {
 public:
  explicit PeerCalls(uint32_t max_per_peer) : max_per_peer_(max_per_peer) {}
  void Add(const std::string& peer);
  void Remove(const std::string& peer);
  uint32_t Count(const std::string& peer) const;
  // RESOURCE_EXHAUSTED naming the limit when `peer` has more calls in progress than allowed (the call
  // asking is already counted). OK when the limit is 0 (off).
  absl::Status Admit(const std::string& peer) const;

 private:
  const uint32_t max_per_peer_;
  mutable absl::Mutex mu_;
  std::unordered_map<std::string, uint32_t> calls_ ABSL_GUARDED_BY(mu_);
};

class CallObserverFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  // `metrics` and `peers` may be null (not kept); both must outlive the gRPC server.
  CallObserverFactory(ServerMetrics* metrics, PeerCalls* peers, bool access_log)
      : metrics_(metrics), peers_(peers), access_log_(access_log) {}

  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo* info) override;

 private:
  ServerMetrics* const metrics_;
  PeerCalls* const peers_;
  const bool access_log_;
};

// "attnd-<process prefix>-<counter>": unique within a process and across restarts with high probability.
std::string GenerateRequestId();

}  // namespace attnd::server
