#include "tls.h"

#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <fstream>
#include <memory>
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

namespace {

absl::Status CheckKeyMatchesCertificate(const std::string& cert_pem, const std::string& key_pem,
                                        const TlsFiles& tls) {
  // A key with a passphrase is refused, not asked for on the terminal.
  pem_password_cb* no_passphrase = [](char*, int, int, void*) { return 0; };
  std::unique_ptr<BIO, decltype(&BIO_free)> cert_bio(BIO_new_mem_buf(cert_pem.data(), static_cast<int>(cert_pem.size())),
                                                     BIO_free);
  std::unique_ptr<X509, decltype(&X509_free)> cert(
      cert_bio ? PEM_read_bio_X509(cert_bio.get(), nullptr, no_passphrase, nullptr) : nullptr, X509_free);
  std::unique_ptr<BIO, decltype(&BIO_free)> key_bio(BIO_new_mem_buf(key_pem.data(), static_cast<int>(key_pem.size())),
                                                    BIO_free);
  std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> key(
      key_bio ? PEM_read_bio_PrivateKey(key_bio.get(), nullptr, no_passphrase, nullptr) : nullptr, EVP_PKEY_free);
  const bool matches = cert != nullptr && key != nullptr && X509_check_private_key(cert.get(), key.get()) == 1;
  ERR_clear_error();  // OpenSSL's error queue is per thread: leave nothing for gRPC to find
  if (cert == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("tls_cert: '", tls.cert, "' holds no readable certificate"));
  }
  if (key == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("tls_key: '", tls.key, "' holds no readable private key (or one with a passphrase)"));
  }
  if (!matches) {
    return absl::InvalidArgumentError(absl::StrCat("tls_key: '", tls.key,
                                                   "' is not the private key of the certificate in --tls_cert '",
                                                   tls.cert, "'"));
  }
  return absl::OkStatus();
}

}  // namespace

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
  // gRPC would only fail to listen, without saying why.
  if (absl::Status checked = CheckKeyMatchesCertificate(*cert, *key, tls); !checked.ok()) return checked;
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
