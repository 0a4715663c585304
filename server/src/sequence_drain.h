// A drain that moves the server's open KV sequences to another server of its fleet (--sequence_drain_to,
// docs/sequences.md "Drain"), through the client library's MoveSequence, each call acting as the sequence's owner
// (the peer secret, auth.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "attnd/server/sequences.h"

namespace attnd::server {

struct DrainMovesOptions {
  std::string self;         // a gRPC target reaching this server, for ids without '@'
  std::string to;           // where the sequences go (--sequence_drain_to)
  std::string peer_secret;  // --peer_secret_file's secret
  // The server's --grpc_arg, applied to the mover's channels too: what tunes the server's transport (BDP probing
  // off on one host, say) tunes its moves' streams the same way.
  std::vector<std::string> grpc_args;
  // TLS to the fleet's servers (all empty: plaintext): the CA their certificates chain to, this server's own
  // certificate and key presented as the client's, the name checked instead of the host dialled.
  std::string tls_ca_file, tls_cert_file, tls_key_file, tls_server_name;
  uint32_t in_flight = 16;
  absl::Duration retry = absl::Milliseconds(100);
};

// Moves every sequence open now, `in_flight` at a time, until each has moved or `until`; a move that fails leaves
// its sequence where it was, is logged with its reason and tried again (ABORTED, a step in flight: after a tenth
// of `retry`). Every moved id is expected to be followed (Sequences::ExpectFollow). Returns the number not moved.
size_t MoveSequencesAway(Sequences& sequences, const DrainMovesOptions& options, absl::Time until);

}  // namespace attnd::server
