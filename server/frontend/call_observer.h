// Watches every RPC from outside the handlers, as a gRPC server interceptor: records each call once in the
// server's stats sink (CallStats: GetStats, metrics and the access log read it) with the request id, shape,
// message bytes and timing it sees go by, and counts each peer's data-plane calls in progress for the
// per-client concurrency limit (PeerCalls::Admit, checked by the service).
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/server_interceptor.h"
#include "call_stats.h"

namespace attnd::server {

// The key --max_calls_per_client counts under: one gRPC connection. The peer address alone does not tell
// connections apart on the unix socket (every caller there is "unix:"), so the key is the peer address and the
// connection's own identity within the server.
std::string ConnectionKey(grpc::ServerContextBase* ctx);

// Forward/ForwardStream calls in progress per connection (ConnectionKey), so that one client cannot take every
// worker and the whole queue.
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
  // `peers` and `drain` may be null (not kept); all must outlive the gRPC server.
  CallObserverFactory(CallStats* stats, PeerCalls* peers, DrainTracker* drain)
      : stats_(stats), peers_(peers), drain_(drain) {}

  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo* info) override;

 private:
  CallStats* const stats_;
  PeerCalls* const peers_;
  DrainTracker* const drain_;
};

// The status of a call that ended before the server's answer reached the client (the client cancelled it, its
// deadline passed, or the server cancelled it at shutdown), as the client sees it: DEADLINE_EXCEEDED when it ended
// at its deadline, CANCELLED otherwise. gRPC sends the timeout rounded up (to 1 ms below 1 s, 10 ms below 10 s,
// 1% beyond) and the request takes time to arrive, so the server's deadline trails the client's: a call that ends
// within 1% + 5 ms of the server's deadline (measured from `start`) ended at it. `when` completes the message
// ("before the reply was sent").
absl::Status EndedEarly(absl::Time start, absl::Time deadline, absl::string_view when);

// The debug-level line of one Forward outcome (request_id is client text: escaped so that it cannot forge
// log lines).
void LogOutcome(const char* method, const std::string& request_id, const absl::Status& status, absl::Time start);

// "attnd-<process prefix>-<counter>": unique within a process and across restarts with high probability.
std::string GenerateRequestId();

// Trailing metadata of a Forward/ForwardStream reply to a request that came without an id: the id the
// service gave it, so that the client and the access log have it also when the call fails.
inline constexpr absl::string_view kRequestIdMetadata = "attnd-request-id";

}  // namespace attnd::server
