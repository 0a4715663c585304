// The one stats sink of a server: every finished call is recorded here once, as a CallRecord, and the three
// views read it: GetStats (per-method counts, errors by code, durations, tensor bytes), the Prometheus metrics
// (ServerMetrics, with --metrics_listen) and the access log (one info-level line per gRPC call).
//
// gRPC calls are recorded by the call observer (call_observer.h) as their status leaves, with what the handler
// added through Annotate (the tensor bytes only the handler knows); shm calls by the shm listener.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <unordered_map>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "attnd/v1/attention.pb.h"
#include "grpcpp/server_context.h"

namespace attnd::server {

class ServerMetrics;

// One finished call.
struct CallRecord {
  std::string method;  // "Forward", ..., "ForwardShm", or the full path for services other than attnd.v1.Attention
  absl::StatusCode code = absl::StatusCode::kOk;
  std::string error;                            // the status message when not OK
  absl::Duration total;                         // call start to status sent, as the server saw it
  std::optional<absl::Duration> queue, kernel;  // from the reply's timing (a Forward that computed)
  uint64_t bytes_in = 0, bytes_out = 0;         // message bytes as they crossed the transport (metrics, log)
  uint64_t tensor_bytes_in = 0, tensor_bytes_out = 0;  // Q+K+V in, O+LSE out (GetStats)
  bool in_stats = false;    // an attnd.v1.Attention method or ForwardShm: counted by GetStats
  bool access_log = false;  // written to the access log
  bool data_plane = false;  // a Forward of any kind: the log line carries its bytes
  std::string peer, request_id, shape;  // for the access log
};

class CallStats {
 public:
  // `access_log`: --access_log.
  explicit CallStats(bool access_log);

  void Record(const CallRecord& call);

  // Attached later (the metrics endpoint starts after the server's parts exist); before serving.
  void set_metrics(ServerMetrics* metrics) { metrics_ = metrics; }
  ServerMetrics* metrics() const { return metrics_; }

  // What a gRPC handler knows of its call and the observer does not: the tensor bytes. Keyed by the call's
  // server context; taken back by the observer when it records the call.
  void Annotate(const grpc::ServerContextBase* call, uint64_t tensor_bytes_in, uint64_t tensor_bytes_out);
  void TakeAnnotation(const grpc::ServerContextBase* call, CallRecord* record);

  // GetStats: fills rpcs, bytes_in, bytes_out and uptime_s.
  void Fill(v1::ServerStats* out) const;
  // Calls of the service recorded so far (health probes and other services left out): moves while clients call.
  uint64_t service_calls() const { return service_calls_.load(std::memory_order_relaxed); }

 private:
  struct Entry {
    uint64_t count = 0, errors = 0;
    double total_us = 0;
    std::map<std::string, uint64_t> errors_by_code;
  };
  ServerMetrics* metrics_ = nullptr;  // null: no --metrics_listen
  const bool access_log_;
  const absl::Time start_;
  std::atomic<uint64_t> service_calls_{0};
  mutable absl::Mutex mu_;
  std::map<std::string, Entry> entries_ ABSL_GUARDED_BY(mu_);
  uint64_t bytes_in_ ABSL_GUARDED_BY(mu_) = 0, bytes_out_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Mutex annotations_mu_;
  std::unordered_map<const grpc::ServerContextBase*, std::pair<uint64_t, uint64_t>> annotations_
      ABSL_GUARDED_BY(annotations_mu_);
};

}  // namespace attnd::server
