// absl::Status is the one error type inside attnd; it becomes a grpc::Status only at the RPC boundary.
#pragma once

#include "absl/status/status.h"

namespace grpc {
class Status;
}

namespace attnd::server {

// The single absl -> gRPC status translation. The codes share their numbering; kept as a function so that a
// future change (details, trailers) happens in one place.
grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace attnd::server

// Returns early with the status of `expr` when it is not OK (Abseil does not export its own macro).
#define ATTND_RETURN_IF_ERROR(expr)                  \
  do {                                               \
    const ::absl::Status _attnd_status = (expr);     \
    if (!_attnd_status.ok()) return _attnd_status;   \
  } while (0)
