// Bearer-token authentication (--auth_token_file): every RPC except grpc.health.v1 must carry
// `authorization: Bearer <token>` with one of the file's tokens, else it is answered UNAUTHENTICATED before any
// handler runs. Implemented as gRPC's AuthMetadataProcessor, so it covers every service on the server
// (reflection included). The header stays in the call's metadata: gRPC hands a processor the connection's auth
// context, shared by every call on that connection, so a call's identity can only come from its own header
// (IndexOf); nothing logs client metadata.
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

class BearerTokenProcessor final : public grpc::AuthMetadataProcessor {
 public:
  // `on_reject` (may be empty) is called for every refused call, for the metrics.
  BearerTokenProcessor(std::vector<std::string> tokens, std::function<void()> on_reject)
      : tokens_(std::move(tokens)), on_reject_(std::move(on_reject)) {}

  // Cheap and non-blocking: runs inline on the transport thread.
  bool IsBlocking() const override { return false; }
  grpc::Status Process(const InputMetadata& auth_metadata, grpc::AuthContext* context,
                       OutputMetadata* consumed_auth_metadata, OutputMetadata* response_metadata) override;

  // The index in the file of the token that `authorization` metadata (any multimap of string_ref, a call's
  // client_metadata or a processor's input) names; -1 when absent, malformed or unknown.
  template <typename Metadata>
  int IndexOf(const Metadata& metadata) const {
    auto header = metadata.find("authorization");
    if (header == metadata.end()) return -1;
    return IndexOfHeader(absl::string_view(header->second.data(), header->second.size()));
  }

 private:
  // "Bearer <token>" (RFC 6750: the scheme is case-insensitive) -> the token's index, else -1.
  int IndexOfHeader(absl::string_view value) const;
  // Index of `token` in tokens_, -1 when unknown; constant time in which one matches.
  int Find(absl::string_view token) const;

  const std::vector<std::string> tokens_;
  const std::function<void()> on_reject_;
};

}  // namespace attnd::server
