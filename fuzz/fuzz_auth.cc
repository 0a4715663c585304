// The bearer-token check (server/frontend/auth.cc) on any metadata a client sends: BearerTokenProcessor::Process
// must let a call through exactly when RFC 6750's rule says so (health always; else the first `authorization`
// value is "Bearer <known token>", scheme in any case; else the first `attnd-peer-secret` value is the peer
// secret), leave the metadata as it is (the owner of a call is read from its own header, IndexOf, which must name
// that token's place), and never echo what was presented. PeerOwnerOf against the same rules. Also
// ConstantTimeEquals against ==, and LoadAuthTokens on any file contents.
// Input: pairs of (key choice, value), the last bytes as the token file.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "auth.h"
#include "fuzz_util.h"

namespace {

const std::vector<std::string> kTokens = {"s3cret-token-0123456789", "tok"};
const std::string kPeerSecret = "peer-secret-42";

// The place in kTokens of the token the first `authorization` value names, -1 when none.
int ExpectedIndex(const grpc::AuthMetadataProcessor::InputMetadata& md) {
  auto h = md.find("authorization");
  if (h == md.end()) return -1;
  const absl::string_view v(h->second.data(), h->second.size());
  if (v.size() <= 7 || !absl::EqualsIgnoreCase(v.substr(0, 7), "bearer ")) return -1;
  const absl::string_view token = absl::StripLeadingAsciiWhitespace(v.substr(7));
  for (size_t i = 0; i < kTokens.size(); ++i) {
    if (token == kTokens[i]) return static_cast<int>(i);
  }
  return -1;
}

bool Expected(const grpc::AuthMetadataProcessor::InputMetadata& md) {
  auto path = md.find(":path");
  if (path != md.end() && absl::StartsWith(absl::string_view(path->second.data(), path->second.size()),
                                           "/grpc.health.v1.Health/")) {
    return true;
  }
  if (ExpectedIndex(md) >= 0) return true;
  auto peer = md.find("attnd-peer-secret");
  return peer != md.end() && absl::string_view(peer->second.data(), peer->second.size()) == kPeerSecret;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  static const char* const kKeys[] = {":path", "authorization", "x-other", ":authority", "attnd-peer-secret",
                                      "attnd-owner"};
  constexpr uint8_t kKnownKeys = 6;
  static const char* const kPrefixes[] = {"", "Bearer ", "bearer ", "BEARER  ", "/grpc.health.v1.Health/",
                                          "/attnd.v1.Attention/Forward"};
  // The values live here: the metadata map holds string_refs into them.
  std::vector<std::string> keys, values;
  const int n = in.ConsumeIntegralInRange<int>(0, 4);
  for (int i = 0; i < n; ++i) {
    const uint8_t k = in.ConsumeIntegral<uint8_t>();
    keys.push_back(k < kKnownKeys ? kKeys[k] : in.ConsumeRandomLengthString(16));
    std::string v = kPrefixes[in.ConsumeIntegralInRange<int>(0, 5)];
    if (in.ConsumeBool()) v += kTokens[in.ConsumeIntegralInRange<size_t>(0, kTokens.size() - 1)];
    if (k == 4 && in.ConsumeBool()) v = kPeerSecret;
    v += in.ConsumeRandomLengthString(32);
    values.push_back(std::move(v));
  }
  grpc::AuthMetadataProcessor::InputMetadata md;
  for (size_t i = 0; i < keys.size(); ++i) md.emplace(grpc::string_ref(keys[i]), grpc::string_ref(values[i]));

  int rejected = 0;
  attnd::server::BearerTokenProcessor processor(kTokens, [&] { ++rejected; }, kPeerSecret);
  grpc::AuthMetadataProcessor::OutputMetadata consumed, response;
  const grpc::Status s = processor.Process(md, nullptr, &consumed, &response);
  const bool expected = Expected(md);
  ATTND_FUZZ_CHECK(s.ok() == expected);
  ATTND_FUZZ_CHECK(rejected == (s.ok() ? 0 : 1));
  ATTND_FUZZ_CHECK(consumed.empty() && response.empty());
  ATTND_FUZZ_CHECK(processor.IndexOf(md) == ExpectedIndex(md));
  if (!s.ok()) {
    ATTND_FUZZ_CHECK(s.error_code() == grpc::StatusCode::UNAUTHENTICATED);
    // One of three fixed messages: nothing the client presented is echoed.
    const bool missing = md.find("authorization") == md.end();
    const bool peer = md.find("attnd-peer-secret") != md.end();
    ATTND_FUZZ_CHECK(s.error_message() ==
                     (peer      ? "attnd-peer-secret: not this fleet's peer secret (--peer_secret_file)"
                      : missing ? "authorization: missing; this server needs 'authorization: Bearer <token>' metadata"
                                : "authorization: not a valid bearer token for this server"));
  }
  // The owner a call acts as: none without either key; the owner only with the secret and an owner of 1..256 bytes;
  // else PERMISSION_DENIED naming one of the keys, without a secret configured too.
  for (const std::string& secret : {kPeerSecret, std::string()}) {
    const absl::StatusOr<std::optional<std::string>> owner = attnd::server::PeerOwnerOf(md, secret);
    auto presented = md.find("attnd-peer-secret");
    auto named = md.find("attnd-owner");
    if (presented == md.end() && named == md.end()) {
      ATTND_FUZZ_CHECK(owner.ok() && !owner->has_value());
      continue;
    }
    const bool right = !secret.empty() && presented != md.end() &&
                       absl::string_view(presented->second.data(), presented->second.size()) == secret;
    const bool owner_ok = named != md.end() && named->second.size() >= 1 && named->second.size() <= 256;
    if (right && owner_ok) {
      ATTND_FUZZ_CHECK(owner.ok() && owner->has_value() &&
                       **owner == std::string(named->second.data(), named->second.size()));
    } else {
      ATTND_FUZZ_CHECK(absl::IsPermissionDenied(owner.status()));
      ATTND_FUZZ_CHECK(absl::StartsWith(owner.status().message(), "attnd-"));
      ATTND_FUZZ_CHECK(!absl::StrContains(owner.status().message(), kPeerSecret));
    }
  }

  const std::string a = in.ConsumeRandomLengthString(40), b = in.ConsumeRandomLengthString(40);
  ATTND_FUZZ_CHECK(attnd::server::ConstantTimeEquals(a, b) == (a == b));
  ATTND_FUZZ_CHECK(attnd::server::ConstantTimeEquals(a, a));

  // The token file: any contents; what it yields are trimmed, non-empty, non-comment lines.
  static const std::string path = [] {
    char name[] = "/tmp/attnd-fuzz-tokens-XXXXXX";
    const int fd = ::mkstemp(name);
    ATTND_FUZZ_CHECK(fd >= 0);
    ::close(fd);
    return std::string(name);
  }();
  const std::string file = in.ConsumeRemainingBytesAsString();
  std::FILE* f = std::fopen(path.c_str(), "wb");
  ATTND_FUZZ_CHECK(f != nullptr);
  std::fwrite(file.data(), 1, file.size(), f);
  std::fclose(f);
  absl::StatusOr<std::vector<std::string>> tokens = attnd::server::LoadAuthTokens(path);
  if (tokens.ok()) {
    ATTND_FUZZ_CHECK(!tokens->empty());
    for (const std::string& t : *tokens) {
      ATTND_FUZZ_CHECK(!t.empty() && t[0] != '#' && t.find('\n') == std::string::npos);
      ATTND_FUZZ_CHECK(absl::StripAsciiWhitespace(t) == t);
    }
  } else {
    ATTND_FUZZ_CHECK(absl::IsInvalidArgument(tokens.status()));
  }
  return 0;
}
