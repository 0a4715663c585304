// grpc.health.v1.Health, served by attnd instead of gRPC's default health service so that its requests are bounded
// like attnd's own (--upload_timeout_s, bounded_unary.h): gRPC 1.51 hands a unary call to its handler only once the
// whole request is in, so a probe that trickled its request would hold its call for as long as it liked.
//
// Check and Watch are served as raw callback streams (one message in; one, or one per status change, out: the
// wire format is unchanged) of a service registered by hand, so that reflection still lists grpc.health.v1.Health
// and an unknown method is still answered UNIMPLEMENTED by gRPC, at once. Debian ships no health.proto: the two
// messages, one field each, are coded here.
#pragma once

#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/impl/service_type.h"
#include "grpcpp/support/byte_buffer.h"

namespace attnd::server {

class HealthService final : public grpc::Service {
 public:
  // grpc.health.v1.HealthCheckResponse.ServingStatus.
  enum class ServingStatus { kUnknown = 0, kServing = 1, kNotServing = 2, kServiceUnknown = 3 };

  // `upload_timeout`: how long after a call's start its request must be in (zero or less: no bound).
  explicit HealthService(absl::Duration upload_timeout);

  // `service` ("" for the whole server) is SERVING or NOT_SERVING from now on, and its watches are told. A service
  // never set is unknown: Check answers NOT_FOUND, Watch SERVICE_UNKNOWN. Ignored after Shutdown.
  void SetServingStatus(const std::string& service, bool serving);
  // The server stops: every status turns NOT_SERVING for good, and every Watch ends (CANCELLED) once it has sent
  // that, as a later one does after its first message. Left to gRPC, a watch would stay open until the server's
  // shutdown cancels what is left.
  void Shutdown();

 private:
  class WatchReactor;

  absl::Status Check(const grpc::ByteBuffer& request, grpc::ByteBuffer* response);
  // Registers `watch` (whose request is in) and hands it its service's status.
  void AddWatch(WatchReactor* watch);
  // Called from the watch's OnDone: no status is handed to it after this returns.
  void RemoveWatch(WatchReactor* watch);
  ServingStatus StatusOf(const std::string& service) const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  const absl::Duration upload_timeout_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, ServingStatus> statuses_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<WatchReactor*> watches_ ABSL_GUARDED_BY(mu_);
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace attnd::server
