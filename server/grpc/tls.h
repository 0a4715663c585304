// Transport credentials of the listeners. The TCP listener speaks TLS when given a certificate and key, and
// mutual TLS (client certificates required and verified) when also given a client CA. The unix socket stays
// plaintext: it is protected by its file permissions (--unix_socket_mode).
//
// A bearer-token check (auth.h) can only be attached to credentials gRPC treats as secure: TLS, or gRPC's
// "local" credentials, which accept loopback TCP or unix-socket peers and need nothing from the client.
// Tokens on a plaintext non-loopback listener are refused at start: they could be read off the wire.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/security/auth_metadata_processor.h"
#include "grpcpp/security/server_credentials.h"

namespace attnd::server {

struct TlsFiles {
  std::string cert;       // PEM certificate chain of the server (--tls_cert)
  std::string key;        // PEM private key (--tls_key)
  std::string client_ca;  // PEM CA bundle; set: clients must present a certificate it signed (--tls_client_ca)
  bool enabled() const { return !cert.empty() || !key.empty() || !client_ca.empty(); }
};

// Credentials for the TCP listener on `listen` (host:port). `auth` may be null (no token check).
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> TcpListenerCredentials(
    const std::string& listen, const TlsFiles& tls, std::shared_ptr<grpc::AuthMetadataProcessor> auth);

// Credentials for the unix-socket listener. `auth` may be null.
std::shared_ptr<grpc::ServerCredentials> UnixListenerCredentials(std::shared_ptr<grpc::AuthMetadataProcessor> auth);

// True for 127.0.0.0/8, ::1 and localhost.
bool IsLoopbackListen(const std::string& listen);

// The whole file, or INVALID_ARGUMENT naming `flag`.
absl::StatusOr<std::string> ReadPemFile(const std::string& path, const char* flag);

}  // namespace attnd::server
