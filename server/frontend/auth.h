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
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "grpcpp/security/auth_metadata_processor.h"

namespace attnd::server {

// One token per line; blank lines and lines starting with '#' are skipped, surrounding whitespace trimmed.
// INVALID_ARGUMENT naming the flag when unreadable or when it holds no token.
absl::StatusOr<std::vector<std::string>> LoadAuthTokens(const std::string& path);

// Equality whose running time depends only on the length of `presented`, never on where it differs from
// `secret` (a timing side channel would let a client guess a token byte by byte).
bool ConstantTimeEquals(absl::string_view presented, absl::string_view secret);

// A fleet's servers act for their callers with each other (a drain moves its callers' sequences): such a call
// carries the secret the servers share (--peer_secret_file) and the owner it acts as (OwnerOf's string).
inline constexpr char kPeerSecretMetadata[] = "attnd-peer-secret";
inline constexpr char kPeerOwnerMetadata[] = "attnd-owner";
// Longest attnd-owner accepted: OwnerOf's strings are a token's index or an address.
inline constexpr size_t kMaxPeerOwnerBytes = 256;

// The whole file, surrounding whitespace trimmed. INVALID_ARGUMENT naming the flag when unreadable or empty.
absl::StatusOr<std::string> LoadPeerSecret(const std::string& path);

// The owner a call acts as through the peer metadata: nullopt when it carries neither key (it acts as itself),
// the attnd-owner value when its attnd-peer-secret equals `secret`. PERMISSION_DENIED naming the key otherwise
// (no secret configured: `secret` empty; a wrong or missing secret; a missing, empty or overlong owner): metadata
// meant to change who a call is never passes unnoticed.
template <typename Metadata>
absl::StatusOr<std::optional<std::string>> PeerOwnerOf(const Metadata& metadata, absl::string_view secret) {
  auto presented = metadata.find(kPeerSecretMetadata);
  auto owner = metadata.find(kPeerOwnerMetadata);
  if (presented == metadata.end() && owner == metadata.end()) return std::nullopt;
  if (secret.empty()) {
    return absl::PermissionDeniedError(absl::StrCat(kPeerSecretMetadata, " / ", kPeerOwnerMetadata,
                                                    ": this server has no --peer_secret_file, so no call may act "
                                                    "as another owner"));
  }
  if (presented == metadata.end() ||
      !ConstantTimeEquals(absl::string_view(presented->second.data(), presented->second.size()), secret)) {
    return absl::PermissionDeniedError(absl::StrCat(kPeerSecretMetadata, ": ",
                                                    presented == metadata.end() ? "missing" : "not this fleet's",
                                                    " peer secret (--peer_secret_file)"));
  }
  if (owner == metadata.end()) {
    return absl::PermissionDeniedError(absl::StrCat(kPeerOwnerMetadata, ": missing (a call with ", kPeerSecretMetadata,
                                                    " names the owner it acts as)"));
  }
  if (owner->second.size() == 0 || owner->second.size() > kMaxPeerOwnerBytes) {
    return absl::PermissionDeniedError(
        absl::StrCat(kPeerOwnerMetadata, ": empty or longer than ", kMaxPeerOwnerBytes, " bytes"));
  }
  return std::optional<std::string>(std::string(owner->second.data(), owner->second.size()));
}

class BearerTokenProcessor final : public grpc::AuthMetadataProcessor {
 public:
  // `on_reject` (may be empty) is called for every refused call, for the metrics. A call carrying
  // `peer_secret` (non-empty) as attnd-peer-secret is admitted without a token: it acts for a fleet's server.
  BearerTokenProcessor(std::vector<std::string> tokens, std::function<void()> on_reject, std::string peer_secret = {})
      : tokens_(std::move(tokens)), on_reject_(std::move(on_reject)), peer_secret_(std::move(peer_secret)) {}

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
  const std::string peer_secret_;
};

}  // namespace attnd::server
