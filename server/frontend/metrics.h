// Prometheus metrics of one server and their HTTP endpoint (GET /metrics, text format 0.0.4).
//
// Per-call series come from the server's one stats sink (CallStats, call_stats.h) as each call ends; the backend's gauges
// (queue depth, in flight, tensor-map cache, device memory) are read from the Backend at scrape time, so a
// scrape always sees the current value and nothing polls in between.
//
// Built on prometheus-cpp where it is available (ATTND_HAVE_METRICS: the shared build). The static build has
// no prometheus-cpp archive: there RecordCall is a no-op and Serve answers UNIMPLEMENTED.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "attnd/server/backend.h"
#include "attnd/server/requests.h"
#include "attnd/v1/attention.pb.h"
#include "call_stats.h"

namespace attnd::server {

class ServerMetrics {
 public:
  // `backend`, `streams_receiving` and `sequences` (may be empty) are sampled at scrape time and must outlive
  // this object.
  explicit ServerMetrics(const Backend* backend, std::function<uint32_t()> streams_receiving = nullptr,
                         std::function<SequenceCounts()> sequences = nullptr);
  ~ServerMetrics();
  ServerMetrics(const ServerMetrics&) = delete;
  ServerMetrics& operator=(const ServerMetrics&) = delete;

  // False in builds without prometheus-cpp.
  static bool Available();

  void RecordCall(const CallRecord& call);
  // A Step that ran, in a launch of `batch_sequences` sequences.
  void RecordStep(uint32_t batch_sequences);
  // A call refused by the bearer-token check (it never reaches a handler, so RecordCall does not see it).
  void RecordAuthFailure();
  // A connection closed at accept (listener_guard.h: over the cap, or shed at the descriptor limit).
  void RecordConnectionRefused();
  // A gRPC listener stopped accepting for good (attnd_listener_up drops to 0).
  void RecordListenerLost();

  // Everything GET /metrics answers, in the text exposition format.
  std::string Scrape() const;

  // Starts the HTTP endpoint on host:port (port 0 picks one). Call at most once.
  absl::Status Serve(const std::string& listen);
  int port() const;  // the bound port after Serve, else 0

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace attnd::server
