// absl::Status is the one error type inside attnd; it becomes a grpc::Status only at the RPC boundary, here.
#pragma once

#include "absl/status/status.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/status.h"

namespace attnd::server {

// The single absl -> gRPC status translation. The codes share their numbering; kept as a function so that a
// future change (details, trailers) happens in one place.
grpc::Status ToGrpcStatus(const absl::Status& status);

// Trailing metadata that says what the message says, for programs: a NOT_FOUND for a sequence closed with
// moved_to (kMovedToPayload) carries `attnd-moved-to: <new id>`, which the client library follows.
inline constexpr char kMovedToMetadata[] = "attnd-moved-to";
void AddStatusTrailers(grpc::ServerContextBase* ctx, const absl::Status& status);

}  // namespace attnd::server
