#include "auth.h"

#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace attnd::server {

absl::StatusOr<std::vector<std::string>> LoadAuthTokens(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("auth_token_file: cannot read '", path, "'"));
  std::stringstream text;
  text << in.rdbuf();
  std::vector<std::string> tokens;
  for (absl::string_view line : absl::StrSplit(text.str(), '\n')) {
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    tokens.emplace_back(line);
  }
  if (tokens.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("auth_token_file: '", path, "' holds no token (one per line)"));
  }
  return tokens;
}

absl::StatusOr<std::string> LoadPeerSecret(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("peer_secret_file: cannot read '", path, "'"));
  std::stringstream text;
  text << in.rdbuf();
  const std::string secret(absl::StripAsciiWhitespace(text.str()));
  if (secret.empty()) return absl::InvalidArgumentError(absl::StrCat("peer_secret_file: '", path, "' is empty"));
  return secret;
}

bool ConstantTimeEquals(absl::string_view presented, absl::string_view secret) {
  // Walks all of `presented` whatever the secret's length; a length mismatch is folded into the result
  // instead of returning early.
  volatile unsigned char diff = presented.size() != secret.size();
  for (size_t i = 0; i < presented.size(); ++i) {
    const unsigned char s = i < secret.size() ? static_cast<unsigned char>(secret[i]) : 0;
    diff = diff | (static_cast<unsigned char>(presented[i]) ^ s);
  }
  return diff == 0;
}

int BearerTokenProcessor::Find(absl::string_view token) const {
  int found = -1;
  for (size_t i = 0; i < tokens_.size(); ++i) {  // no early exit either
    if (ConstantTimeEquals(token, tokens_[i])) found = static_cast<int>(i);
  }
  return found;
}

int BearerTokenProcessor::IndexOfHeader(absl::string_view value) const {
  if (value.size() <= 7 || !absl::EqualsIgnoreCase(value.substr(0, 7), "bearer ")) return -1;
  return Find(absl::StripLeadingAsciiWhitespace(value.substr(7)));
}

grpc::Status BearerTokenProcessor::Process(const InputMetadata& auth_metadata, grpc::AuthContext*,
                                           OutputMetadata*, OutputMetadata*) {
  // Health stays open: orchestrators' probes (kubelet, HEALTHCHECK) carry no credentials.
  auto path = auth_metadata.find(":path");
  if (path != auth_metadata.end() &&
      absl::StartsWith(absl::string_view(path->second.data(), path->second.size()), "/grpc.health.v1.Health/")) {
    return grpc::Status::OK;
  }
  if (IndexOf(auth_metadata) >= 0) return grpc::Status::OK;
  auto peer = auth_metadata.find(kPeerSecretMetadata);
  if (peer != auth_metadata.end()) {
    if (!peer_secret_.empty() &&
        ConstantTimeEquals(absl::string_view(peer->second.data(), peer->second.size()), peer_secret_)) {
      return grpc::Status::OK;
    }
    if (on_reject_) on_reject_();
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        peer_secret_.empty()
                            ? absl::StrCat(kPeerSecretMetadata, ": this server has no --peer_secret_file")
                            : absl::StrCat(kPeerSecretMetadata, ": not this fleet's peer secret (--peer_secret_file)"));
  }
  const bool missing = auth_metadata.find("authorization") == auth_metadata.end();
  if (on_reject_) on_reject_();
  // The message never repeats what was presented: tokens must not reach clients' logs either.
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                      missing
                          ? "authorization: missing; this server needs 'authorization: Bearer <token>' metadata"
                          : "authorization: not a valid bearer token for this server");
}

}  // namespace attnd::server
