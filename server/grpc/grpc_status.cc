#include "grpc_status.h"

#include <optional>
#include <string>

#include "attnd/server/sequences.h"
#include "grpcpp/support/status.h"

namespace attnd::server {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  // absl::StatusCode and grpc::StatusCode both follow google.rpc.Code, so the cast is exact for the 17
  // canonical codes; anything else would be a bug upstream and is reported as UNKNOWN.
  const int code = static_cast<int>(status.code());
  const grpc::StatusCode grpc_code =
      (code >= 0 && code <= static_cast<int>(grpc::StatusCode::UNAUTHENTICATED)) ? static_cast<grpc::StatusCode>(code)
                                                                                  : grpc::StatusCode::UNKNOWN;
  return grpc::Status(grpc_code, std::string(status.message()));
}

void AddStatusTrailers(grpc::ServerContextBase* ctx, const absl::Status& status) {
  if (auto moved = status.GetPayload(kMovedToPayload); moved.has_value()) {
    ctx->AddTrailingMetadata(kMovedToMetadata, std::string(*moved));
  }
}

}  // namespace attnd::server
