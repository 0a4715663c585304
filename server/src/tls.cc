#include "tls.h"

#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/security/server_credentials.h"

namespace attnd::server {

absl::StatusOr<std::string> ReadPemFile(const std::string& path, const char* flag) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(flag, ": cannot read '", path, "'"));
  std::stringstream text;
  text << in.rdbuf();
  std::string pem = text.str();
  // gRPC would only say "handshake failed" much later, on the first connection.
  if (!absl::StrContains(pem, "-----BEGIN ")) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": '", path, "' is not PEM (no -----BEGIN line)"));
  }
  return pem;
}

bool IsLoopbackListen(const std::string& listen) {
  const size_t colon = listen.rfind(':');
  const std::string host = colon == std::string::npos ? listen : listen.substr(0, colon);
  return host == "localhost" || host == "[::1]" || host == "::1" || absl::StartsWith(host, "127.");
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> TcpListenerCredentials(
    const std::string& listen, const TlsFiles& tls, std::shared_ptr<grpc::AuthMetadataProcessor> auth) {
  if (!tls.enabled()) {
    if (auth == nullptr) return grpc::InsecureServerCredentials();
    if (!IsLoopbackListen(listen)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "auth_token_file: bearer tokens on the plaintext TCP listener '", listen,
          "' could be read off the network; give --tls_cert and --tls_key, or listen on loopback"));
    }
    auto creds = grpc::experimental::LocalServerCredentials(LOCAL_TCP);
    creds->SetAuthMetadataProcessor(std::move(auth));
    return creds;
  }
  if (tls.cert.empty() || tls.key.empty()) {
    return absl::InvalidArgumentError(tls.cert.empty() ? "tls_cert: required with --tls_key / --tls_client_ca"
                                                       : "tls_key: required with --tls_cert");
  }
  grpc::SslServerCredentialsOptions options;
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  absl::StatusOr<std::string> cert = ReadPemFile(tls.cert, "tls_cert");
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadPemFile(tls.key, "tls_key");
  if (!key.ok()) return key.status();
  pair.cert_chain = std::move(*cert);
  pair.private_key = std::move(*key);
  options.pem_key_cert_pairs.push_back(std::move(pair));
  if (!tls.client_ca.empty()) {
    absl::StatusOr<std::string> ca = ReadPemFile(tls.client_ca, "tls_client_ca");
    if (!ca.ok()) return ca.status();
    options.pem_root_certs = std::move(*ca);
    options.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  } else {
    options.client_certificate_request = GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE;
  }
  auto creds = grpc::SslServerCredentials(options);
  if (creds == nullptr) return absl::InvalidArgumentError("tls_cert: gRPC refused the certificate/key pair");
  if (auth != nullptr) creds->SetAuthMetadataProcessor(std::move(auth));
  return creds;
}

std::shared_ptr<grpc::ServerCredentials> UnixListenerCredentials(std::shared_ptr<grpc::AuthMetadataProcessor> auth) {
  if (auth == nullptr) return grpc::InsecureServerCredentials();
  auto creds = grpc::experimental::LocalServerCredentials(UDS);
  creds->SetAuthMetadataProcessor(std::move(auth));
  return creds;
}

}  // namespace attnd::server
