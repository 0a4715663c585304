// Bearer-token authentication (--auth_token_file): every RPC except grpc.health.v1 must carry
// `authorization: Bearer <token>` with one of the file's tokens, else it is answered UNAUTHENTICATED before any
// handler runs. Implemented as gRPC's AuthMetadataProcessor, so it covers every service on the server
// (reflection included) and the token is consumed: handlers, interceptors and logs never see it.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/security/auth_metadata_processor.h"

namespace attnd::server {

// One token per line; blank lines and lines starting with '#' are skipped, surrounding whitespace trimmed.
// INVALID_ARGUMENT naming the flag when unreadable or when it holds no token.
absl::StatusOr<std::vector<std::string>> LoadAuthTokens(const std::string& path);

// Equality whose running time depends only on the length of `presented`, never on where it differs from
// `secret` (a timing side channel would let a client guess a token byte by byte).
bool ConstantTimeEquals(absl::string_view presented, absl::string_view secret);

// The auth-context property a call that presented a known token carries: the token's index in the file.
inline constexpr char kTokenProperty[] = "attnd.token_index";

class BearerTokenProcessor final : public grpc::AuthMetadataProcessor {
 public:
  // `on_reject` (may be empty) is called for every refused call, for the metrics.
  BearerTokenProcessor(std::vector<std::string> tokens, std::function<void()> on_reject)
      : tokens_(std::move(tokens)), on_reject_(std::move(on_reject)) {}

  // Cheap and non-blocking: runs inline on the transport thread.
  bool IsBlocking() const override { return false; }
  grpc::Status Process(const InputMetadata& auth_metadata, grpc::AuthContext* context,
                       OutputMetadata* consumed_auth_metadata, OutputMetadata* response_metadata) override;

 private:
  // Index of `token` in tokens_, -1 when unknown; constant time in which one matches.
  int Find(absl::string_view token) const;

  const std::vector<std::string> tokens_;
  const std::function<void()> on_reject_;
};

}  // namespace attnd::server
