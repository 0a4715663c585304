// The gRPC server: listeners, the Attention service (thin over a Backend), health and reflection.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "attnd/server/backend.h"
#include "attnd/server/sequences.h"

namespace attnd::server {

struct ServerOptions {
  // Where the gRPC listeners are and how their connections are held.
  struct Network {
    std::string listen = "127.0.0.1:50051";  // host:port; ":0" port picks a free one; empty: no TCP listener
    std::string unix_socket;                 // path of a unix-domain listener; empty: none
    uint32_t unix_socket_mode = 0660;        // permission bits the unix socket gets once bound
    // Connections the gRPC listeners (TCP and unix) hold at once; one more is closed at accept and counted
    // (attnd_connections_refused_total). 0: seven eighths of the process's descriptor limit (listener_guard.h).
    uint32_t max_connections = 0;
    // Streams (calls in progress of any method, health watches included) one connection may hold open at once
    // (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS): a client's further calls wait in its own transport until one
    // ends. Bounds what one connection costs the server beyond the transport quota (each call's state). 0: gRPC's
    // default (no cap).
    uint32_t max_streams_per_connection = 1024;
    // gRPC channel arguments "name=value" applied last (channel_args.h); a malformed one fails Create.
    std::vector<std::string> grpc_args;
  };
  // Sizes and counts beyond which a request, an upload or a client is refused.
  struct Limits {
    uint64_t max_request_bytes = 1ull << 32;    // Q+K+V+O(+LSE) bytes of one request
    uint64_t max_message_bytes = 256ull << 20;  // one gRPC message
    // Memory gRPC's transport may hold in all (gRPC's resource quota): messages being received, read buffers,
    // unary requests the backend still holds. 0: max_message_bytes + 16 MiB, at least 64 MiB, which is also what
    // one hostile upload can cost (gRPC 1.51 buffers a message to its announced length before checking it).
    uint64_t max_transport_memory_bytes = 0;
    // Per-request shape limits (RESOURCE_EXHAUSTED beyond); 0: none beyond what the byte limits imply.
    int64_t max_batch = 0;
    int64_t max_q_len = 0;
    int64_t max_kv_len = 0;
    int64_t max_heads = 0;              // shape.q_heads
    uint32_t max_calls_per_client = 0;  // Forward/ForwardStream calls in progress per connection; 0: no limit
    // ForwardStream uploads (header in, inputs arriving) one client holds at once (service.h, ReceivingSlots);
    // 0: a quarter of the backend's max_queue.
    uint32_t max_uploads_per_client = 0;
  };
  // How long a shutdown waits, and how long slow or idle clients may hold a call or a connection
  // (docs/security-and-metrics.md, limits); zero turns each client bound off.
  struct Timeouts {
    // Shutdown waits this long for accepted calls (a stream still uploading included) before gRPC cancels what
    // is left; an infinite grace would let one stalled client hold a SIGTERM forever.
    absl::Duration shutdown_grace = absl::Seconds(60);
    // Shutdown first drains the KV sequences for up to this long, within shutdown_grace: health turns
    // NOT_SERVING, new sequences (OpenSequence, ForkSequence) are refused UNAVAILABLE so that a fleet client opens
    // them on another server, and the open ones are served until their callers close them; those still open after
    // it are lost with the process. Zero: no drain.
    absl::Duration sequence_drain = absl::ZeroDuration();
    // A ForwardStream that receives no message for this long, before its header or between chunks, is ended
    // DEADLINE_EXCEEDED and its inputs are freed.
    absl::Duration stream_idle_timeout = absl::Seconds(30);
    // A call's request must be in this long after the call starts: a unary call's message, or a ForwardStream's
    // header and every input chunk. Ended DEADLINE_EXCEEDED "upload_timeout_s: ..." otherwise.
    absl::Duration upload_timeout = absl::Seconds(60);
    // A connection without a call for this long is closed (GOAWAY; clients reconnect when they next call).
    absl::Duration max_connection_idle = absl::Minutes(5);
    // A connection with calls and no traffic for keepalive_time is pinged; no answer within keepalive_timeout
    // closes it and cancels its calls.
    absl::Duration keepalive_time = absl::Minutes(1);
    absl::Duration keepalive_timeout = absl::Seconds(20);
    // Client pings closer together than this without data are strikes; the third closes the connection
    // (ENHANCE_YOUR_CALM). A client's keepalive time must not be shorter.
    absl::Duration min_client_ping_interval = absl::Seconds(10);
  };
  // Same-host shared-memory channels (attnd/transport/shm_channel.h, docs/transport.md): a unix socket where
  // callers hand over a memfd. Its file gets network.unix_socket_mode; peers must be the server's user or root.
  struct Shm {
    std::string socket;                // empty: off
    uint64_t max_bytes = 64ull << 20;  // per channel, request and reply area each
    uint32_t max_channels = 64;
    absl::Duration spin = absl::Microseconds(50);         // a channel's thread polls this long for a request
    absl::Duration reply_spin = absl::Microseconds(300);  // ... and for its reply (shm_listener.h)
    // Offer steps ordered on the caller's stream by the device (StreamOrder.device) where the backend can.
    bool device_order = true;
  };
  // Who may connect and call, and which calls may hand the server device memory (docs/security-and-metrics.md).
  struct Security {
    std::string tls_cert, tls_key;  // PEM files: TLS on the TCP listener (the unix socket stays plaintext)
    std::string tls_client_ca;      // PEM CA bundle: require and verify client certificates (mutual TLS)
    std::string auth_token_file;    // tokens, one a line: every RPC but grpc.health.v1 needs "Bearer <token>"
    // The secret a fleet's servers share: a call carrying it (attnd-peer-secret) and attnd-owner acts as that
    // owner, admitted without a bearer token (auth.h, PeerOwnerOf). Empty: such metadata is refused.
    std::string peer_secret_file;
    // With tls_cert, a drain's moves (drain.to) speak TLS to the fleet's servers: their certificates must chain to
    // peer_tls_ca and carry peer_tls_server_name (empty: the host each is dialled at), and the moves present
    // tls_cert / tls_key as their client certificate (for servers that require mutual TLS).
    std::string peer_tls_ca;
    std::string peer_tls_server_name;
    // cuda-ipc buffers: accept RegisterCudaBuffer and tensor references (cuda backend only).
    bool enable_cuda_ipc = false;
    bool ipc_over_tcp = false;  // accept CUDA IPC registration over TCP too (off: unix socket only)
    // Serve gRPC server reflection (grpc.reflection.v1alpha, for grpcurl without the .proto). Off by default:
    // gRPC serves it as a stream of its own, outside the upload and idle bounds attnd's methods have.
    bool reflection = false;
  };
  // What the server reports about its calls (docs/security-and-metrics.md).
  struct Observability {
    std::string metrics_listen;  // host:port of the Prometheus endpoint (HTTP GET /metrics); empty: none
    bool access_log = true;      // one info-level line per RPC (health checks excepted)
  };

  Network network;
  Limits limits;
  Timeouts timeouts;
  Shm shm;
  Security security;
  Observability observability;
  // A drain that moves the open sequences itself (docs/sequences.md, "Drain"), to `to`: a gRPC target (an
  // address, or the fleet's shared target, whose balancer skips this server once it is NOT_SERVING). Needs
  // timeouts.sequence_drain > 0 and security.peer_secret_file (its calls act as each sequence's owner). Empty: the
  // drain waits for the callers to close or move their sequences.
  struct Drain {
    std::string to;
    uint32_t moves_in_flight = 16;  // sequences moving at once: the calls of one overlap the copies of others
    // A move that failed is tried again this long after (its reason logged), until the drain's time runs out; one
    // refused because a step was in flight, after a tenth of it.
    absl::Duration retry = absl::Milliseconds(100);
  };
  Drain drain;
  // KV sequences (docs/sequences.md). pool_bytes 0: half the backend's memory budget on CUDA, 1 GiB on CPU.
  SequenceOptions sequences;
};

class Server {
 public:
  // Starts listening; the backend is owned by the server from here on.
  static absl::StatusOr<std::unique_ptr<Server>> Create(const ServerOptions& options,
                                                        std::unique_ptr<Backend> backend);
  virtual ~Server() = default;

  virtual int tcp_port() const = 0;  // the bound TCP port (after ":0"), 0 without a TCP listener
  virtual int metrics_port() const { return 0; }  // the bound metrics HTTP port, 0 without metrics_listen
  // Stop accepting, finish every accepted request (its reply is sent), then stop. Idempotent.
  virtual void Shutdown() = 0;
  // Blocks until Shutdown has completed.
  virtual void Wait() = 0;
};

// Raises the process's soft descriptor limit (RLIMIT_NOFILE) to its hard limit, as attnd does at start.
// Returns the soft limit in force afterwards.
uint64_t RaiseDescriptorLimit();

}  // namespace attnd::server
