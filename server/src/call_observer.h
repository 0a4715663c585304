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
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
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

// Forward/ForwardStream calls that began before shutdown and whose gRPC call still exists, so whose reply,
// status included, has not yet been handed over to the transport. Shutdown waits for these before letting
// gRPC send GOAWAY: gRPC closes a connection the moment its last stream ends after a GOAWAY, and a client
// frame still unread then (the WINDOW_UPDATE for the reply) turns the close into a TCP reset that can cost
// the client the tail of a reply it was owed.
class DrainTracker {
 public:
  // False once draining: later calls are refused UNAVAILABLE by the service and are not waited for, so
  // clients that keep calling cannot hold shutdown open.
  bool Add();
  void Remove();
  void BeginDrain();
  // True when every counted call has ended; false when `deadline` came first.
  bool AwaitDrained(absl::Time deadline);
  uint32_t live() const;

 private:
  mutable absl::Mutex mu_;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  uint32_t live_ ABSL_GUARDED_BY(mu_) = 0;
};

class CallObserverFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  // `metrics`, `peers` and `drain` may be null (not kept); all must outlive the gRPC server.
  CallObserverFactory(ServerMetrics* metrics, PeerCalls* peers, DrainTracker* drain, bool access_log)
      : metrics_(metrics), peers_(peers), drain_(drain), access_log_(access_log) {}

  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo* info) override;

 private:
  ServerMetrics* const metrics_;
  PeerCalls* const peers_;
  DrainTracker* const drain_;
  const bool access_log_;
};

// "attnd-<process prefix>-<counter>": unique within a process and across restarts with high probability.
std::string GenerateRequestId();

// Trailing metadata of a Forward/ForwardStream reply to a request that came without an id: the id the
// service gave it, so that the client and the access log have it also when the call fails.
inline constexpr absl::string_view kRequestIdMetadata = "attnd-request-id";

}  // namespace attnd::server
