// attnd: the attention server binary. Flags pick the listeners, the backend and the limits; SIGINT/SIGTERM
// start a graceful shutdown (stop accepting, answer every accepted request, exit 0).
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "attnd/transport/flags_help.h"
#include "attnd/transport/heap_tuning.h"
#include "attnd/server/backend.h"
#include "attnd/server/server.h"
#include "spdlog/spdlog.h"

ABSL_FLAG(std::string, listen, "0.0.0.0:50051", "TCP listener host:port (port 0 picks one); empty: none");
ABSL_FLAG(std::string, unix_socket, "", "path of a unix-domain socket listener; empty: none");
ABSL_FLAG(std::string, backend, "auto", "auto (cuda when a GPU is usable, else cpu), cpu or cuda");
ABSL_FLAG(uint64_t, max_request_bytes, 1ull << 32, "largest request, Q+K+V+O(+LSE) bytes, any transport");
ABSL_FLAG(uint64_t, max_message_bytes, 256ull << 20,
          "largest gRPC message; bigger tensors must use ForwardStream (capped at 2 GiB - 1 by gRPC)");
ABSL_FLAG(uint64_t, max_transport_memory_bytes, 0,
          "memory gRPC's transport may hold in all: messages being received (whatever size their prefix announces), "
          "read buffers, unary requests still being computed; near it uploads slow down, beyond it streams are reset "
          "RESOURCE_EXHAUSTED (0: --max_message_bytes + 16 MiB, at least 64 MiB)");
ABSL_FLAG(int64_t, max_batch, 0, "largest shape.batch of one request (0: no limit); more: RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, max_q_len, 0, "largest shape.q_len of one request (0: no limit); more: RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, max_kv_len, 0, "largest shape.kv_len of one request (0: no limit); more: RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, max_heads, 0, "largest shape.q_heads of one request (0: no limit); more: RESOURCE_EXHAUSTED");
ABSL_FLAG(uint32_t, max_queue, 256, "requests waiting for the backend before RESOURCE_EXHAUSTED");
ABSL_FLAG(int, threads, 0, "CPU backend compute threads (0: all cores)");
ABSL_FLAG(std::string, log_level, "info", "trace, debug, info, warn, error, critical or off");
ABSL_FLAG(std::string, devices, "", "CUDA devices to serve, comma-separated indices (empty: all)");
ABSL_FLAG(int, streams, 4, "CUDA streams per device");
ABSL_FLAG(bool, shared_compute_stream, false,
          "CUDA: run the kernels of all streams of a device back to back on one compute stream, each stream keeping "
          "its own host<->device copies (false: each stream runs its own kernels, concurrently with the others')");
ABSL_FLAG(int, copy_threads, -1,
          "CUDA: helper threads for copying inline tensors into and out of pinned staging (-1: a quarter of the "
          "cores, at most 4; 0: none)");
ABSL_FLAG(bool, stream_to_device, true,
          "CUDA: a ForwardStream's chunks land in pinned memory and are copied to the device while the rest arrives "
          "(the request's device and pinned memory are then taken at its header, for the whole upload); false: "
          "received into host memory and copied when the request runs");
ABSL_FLAG(uint64_t, stream_preferred_from_bytes, 8ull << 20,
          "CUDA, with --stream_to_device: told to clients (GetServerInfo) as the inline tensor bytes from which "
          "their automatic transport streams a request that would fit one message, so that its copy to the device "
          "overlaps the upload (0: no preference, stream only what does not fit)");
ABSL_FLAG(bool, enable_cuda_ipc, false, "accept RegisterCudaBuffer (CUDA IPC, same host) on the cuda backend");
ABSL_FLAG(uint64_t, memory_budget_mb, 0,
          "CUDA device (and pinned staging) memory the stream pool may hold per device, MiB (0: 80% of free)");
ABSL_FLAG(std::string, warm_shapes, "",
          "CUDA: shapes BxLqxLkxHqxHkxD,... pre-allocated and with tensor maps pre-encoded at start");
ABSL_FLAG(uint64_t, tensor_map_cache, 4096, "CUDA: encoded TMA tensor maps kept in the LRU cache");
ABSL_FLAG(int64_t, completion_spin_us, 300,
          "CUDA: microseconds a worker polls its request's completion before sleeping, while at most one other "
          "request runs on the device; longer (1.5x, up to 4x this) after a request that took longer (0: always "
          "sleep)");
ABSL_FLAG(bool, ipc_over_tcp, false, "serve CUDA IPC registration over TCP too (default: the unix socket only)");
ABSL_FLAG(bool, reflection, false,
          "serve gRPC server reflection (grpcurl without the .proto); off by default: gRPC serves it outside the "
          "upload and idle bounds of attnd's own methods");
ABSL_FLAG(double, shutdown_grace_s, 60,
          "seconds a shutdown waits for accepted calls before cancelling the rest; it bounds the exit (idle "
          "connections and health/reflection streams do not hold it)");
ABSL_FLAG(double, sequence_drain_s, 0,
          "on shutdown, seconds (within --shutdown_grace_s) the open KV sequences keep being served while their "
          "callers close them: health NOT_SERVING, new sequences refused UNAVAILABLE (a fleet client opens them "
          "elsewhere); 0: no drain, open sequences are lost at once");
ABSL_FLAG(std::string, sequence_drain_to, "",
          "gRPC target (an address, or the fleet's shared target such as dns:///attnd-headless.ns.svc:50051) the "
          "drain moves the open KV sequences to, each as its owner, before it waits for the rest; needs "
          "--sequence_drain_s > 0 and --peer_secret_file; empty: callers close or move their sequences");
ABSL_FLAG(uint32_t, sequence_drain_moves, 16, "with --sequence_drain_to: sequences moving at once");
// Security and observability (docs/security-and-metrics.md).
ABSL_FLAG(std::string, tls_cert, "", "PEM certificate chain: serve TLS on the TCP listener (with --tls_key)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_client_ca, "", "PEM CA bundle: require client certificates signed by it (mutual TLS)");
ABSL_FLAG(std::string, auth_token_file, "",
          "file of bearer tokens, one a line: every RPC but grpc.health.v1 needs 'authorization: Bearer <token>'");
ABSL_FLAG(std::string, peer_secret_file, "",
          "file holding the secret the fleet's servers share: a call with metadata attnd-peer-secret (it) and "
          "attnd-owner acts as that owner, without a bearer token; empty: such calls are refused PERMISSION_DENIED");
ABSL_FLAG(std::string, peer_tls_ca, "",
          "PEM CA bundle the fleet's servers' certificates chain to: with --tls_cert, a drain's moves "
          "(--sequence_drain_to) speak TLS to them, presenting --tls_cert as their client certificate");
ABSL_FLAG(std::string, peer_tls_server_name, "",
          "name the fleet's servers' certificates carry, checked instead of the host a drain's move dials (pods "
          "are dialled at their addresses); empty: that host");
ABSL_FLAG(std::string, metrics_listen, "", "host:port of the Prometheus endpoint (HTTP GET /metrics); empty: none");
ABSL_FLAG(bool, access_log, true, "log one info line per RPC (method, peer, request id, shape, status, times, bytes)");
ABSL_FLAG(uint32_t, max_calls_per_client, 0,
          "Forward/ForwardStream calls one connection may have in progress (0: no limit); more: RESOURCE_EXHAUSTED");
ABSL_FLAG(uint32_t, max_uploads_per_client, 0,
          "ForwardStream uploads (header in, inputs arriving) one client may have at once (0: a quarter of "
          "--max_queue); more: RESOURCE_EXHAUSTED");
// Slow and idle clients (docs/security-and-metrics.md, limits); 0 turns each off.
ABSL_FLAG(uint32_t, max_connections, 0,
          "gRPC connections (TCP and unix) held at once; one more is closed at accept (0: 7/8 of the descriptor "
          "limit, which attnd raises to its hard limit at start)");
ABSL_FLAG(uint32_t, max_streams_per_connection, 1024,
          "calls (streams) one gRPC connection holds open at once, health watches included; a client's further calls "
          "wait in its transport until one ends (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS; 0: no cap)");
ABSL_FLAG(double, stream_idle_timeout_s, 30,
          "a ForwardStream that sends no message for this long, before its header or between chunks, is ended "
          "DEADLINE_EXCEEDED and its inputs freed (0: never)");
ABSL_FLAG(double, upload_timeout_s, 60,
          "a call's request must arrive within this long of its start: a unary call's message, or a ForwardStream's "
          "header and every input chunk; else DEADLINE_EXCEEDED (0: never)");
ABSL_FLAG(double, max_connection_idle_s, 300, "a connection without calls for this long is closed (0: never)");
ABSL_FLAG(double, keepalive_time_s, 60,
          "a connection with calls but no traffic for this long is pinged (0: never)");
ABSL_FLAG(double, keepalive_timeout_s, 20, "an unanswered keepalive ping closes its connection after this long");
ABSL_FLAG(double, min_client_ping_interval_s, 10,
          "client pings closer together than this without data are strikes; the third closes the connection "
          "(0: any rate)");
ABSL_FLAG(std::string, unix_socket_mode, "0660", "permission bits of the --unix_socket (and --shm_socket) file, octal");
ABSL_FLAG(std::string, shm_socket, "",
          "unix socket for same-host shared-memory channels (Forward without gRPC; docs/transport.md); empty: off");
ABSL_FLAG(uint64_t, shm_max_bytes, 64ull << 20, "largest request or reply area a shared-memory channel may have");
ABSL_FLAG(uint32_t, shm_max_channels, 64, "shared-memory channels open at once (each has a server thread)");
ABSL_FLAG(int64_t, shm_spin_us, 50,
          "how long a shared-memory channel's thread polls for a request before sleeping; up to 1 ms (1.5x the gap "
          "before its previous request) while at most two threads poll that long");
ABSL_FLAG(int64_t, shm_reply_spin_us, 300,
          "how long a shared-memory channel's thread polls for the reply to its request before sleeping (while at "
          "most two channels wait for theirs); best above the kernel time of the requests served");
ABSL_FLAG(bool, retain_heap, true,
          "keep freed tensor-sized heap memory for the next request (no page faults on it; resident size stays near "
          "its peak while calls come, and goes back 10 s after the last one); false: freed memory goes back at once");
ABSL_FLAG(std::string, heap_arenas, "",
          "gone: refused when given (it capped glibc's arenas; attnd allocates with jemalloc, whose idle purge hands "
          "back what every arena freed)");
ABSL_FLAG(std::vector<std::string>, grpc_arg, {},
          "transport tuning: gRPC channel arguments, comma-separated name=value (e.g. "
          "grpc.http2.lookahead_bytes=8388608,grpc.http2.bdp_probe=0); applied last");
ABSL_FLAG(bool, sequences, true, "serve KV sequences (OpenSequence, Step, ...; docs/sequences.md)");
ABSL_FLAG(uint64_t, kv_pool_mb, 0,
          "K/V page memory of all sequence pools, MiB (0: half the memory budget on cuda, 1024 on cpu); on cuda it "
          "is part of --memory_budget_mb");
ABSL_FLAG(int, kv_max_pools, 1,
          "sequence shapes (layers, kv_heads, head_dim, dtype) with a pool at once; each gets kv_pool_mb / this");
ABSL_FLAG(int, kv_page_tokens, 16, "tokens per KV page: a power of two from 16 to 256");
ABSL_FLAG(int64_t, max_sequence_tokens, 131072, "most tokens one sequence may cache");
ABSL_FLAG(double, sequence_ttl_s, 600, "idle sequences are closed after this many seconds (0: never)");
ABSL_FLAG(uint32_t, max_sequences_per_client, 0, "sequences one client may hold open (0: no limit)");
ABSL_FLAG(uint64_t, max_pages_per_client, 0, "KV pages one client's sequences may hold (0: no limit)");
ABSL_FLAG(bool, sequence_device_moves, true,
          "moves between two attnd on one GPU through CUDA IPC (false: refused FAILED_PRECONDITION; see sequences.md)");
ABSL_FLAG(std::string, sequence_device_moves_share_pool, "peers",
          "whose device exports hand out the page pool's CUDA IPC handle and the sequence's pages, read in place by "
          "the importer (one copy instead of two): never | peers (the fleet's servers, calls with the "
          "--peer_secret_file secret: a drain) | always. Whoever gets the handle can read and write every sequence of "
          "that pool (security-and-metrics.md)");
ABSL_FLAG(uint32_t, max_step_batch, 256, "sequences in one batched step launch (and in one Step call)");
ABSL_FLAG(int64_t, step_batch_wait_us, 0,
          "how long the first step of an idle layer waits for others to join its launch (0: launch at once; "
          "steps arriving during a launch still join the next one)");
ABSL_FLAG(uint32_t, step_launches_in_flight, 2,
          "batched step launches of one layer that may run at once (the host work of one overlaps the GPU work of "
          "another); 1 runs them one after the other");
ABSL_FLAG(bool, shm_device_order, true,
          "offer KV-sequence steps ordered on the caller's CUDA stream by the device (StreamOrder.device: the server's "
          "stream waits for the caller's word and writes the done word the caller's stream waits on) where the "
          "backend can; false: the server's host waits for the word and the caller's process releases its stream");
ABSL_FLAG(double, step_order_timeout_s, 30,
          "how long a stream-ordered step over the shared-memory channel waits for its caller's stream to write the "
          "channel's wait word before it is refused DEADLINE_EXCEEDED, nothing done; 0: no limit");
ABSL_FLAG(std::string, advertise_address, "",
          "host:port clients reach this server at, written into sequence ids after '@' so that a client behind a "
          "load balancer sends a sequence's calls to the server that holds it; empty: none");

namespace {

using attnd::server::BackendOptions;
using attnd::server::SequenceOptions;
using attnd::server::ServerOptions;
using attnd::server::SharePool;

int Fail(const std::string& message) {
  std::fprintf(stderr, "attnd: %s\n", message.c_str());
  return 2;
}
int Fail(const absl::Status& status) { return Fail(std::string(status.message())); }

// Once the grace is spent every unfinished call has been cancelled to its client; what may still run is a
// computation the backend cannot interrupt (a CPU one), and the process does not wait for it beyond this.
constexpr absl::Duration kExitMargin = absl::Seconds(1);

absl::Status SetLogLevel() {
  const spdlog::level::level_enum level = spdlog::level::from_str(absl::GetFlag(FLAGS_log_level));
  if (level == spdlog::level::off && absl::GetFlag(FLAGS_log_level) != "off") {
    return absl::InvalidArgumentError("--log_level: unknown value '" + absl::GetFlag(FLAGS_log_level) + "'");
  }
  spdlog::set_level(level);
  return absl::OkStatus();
}

// --retain_heap on whichever allocator serves the process (jemalloc, unless a sanitizer brings its own), and
// --heap_arenas refused: it capped glibc's arenas, and attnd allocates with jemalloc.
absl::Status HeapFlags() {
  if (!absl::GetFlag(FLAGS_heap_arenas).empty()) {
    return absl::InvalidArgumentError(
        "--heap_arenas is gone: attnd allocates with jemalloc, and a server without calls for 10 s hands back what "
        "every arena freed (docs/tuning.md); drop the flag");
  }
  const bool retain = absl::GetFlag(FLAGS_retain_heap);
  if (!(retain ? attnd::RetainFreedHeapMemory() : attnd::ReturnFreedHeapMemoryAtOnce())) {
    spdlog::warn("--retain_heap: this process's allocator cannot be tuned; running with its defaults");
  }
  spdlog::debug("heap: {}, freed memory {}", attnd::HeapIsJemalloc() ? "jemalloc" : "the C library's",
                retain ? "kept for reuse" : "handed back at once");
  return absl::OkStatus();
}

// Block the shutdown signals before any thread exists so that every thread inherits the mask and only
// sigwait below receives them: no work happens inside a signal handler.
sigset_t BlockShutdownSignals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  return signals;
}

absl::StatusOr<BackendOptions> BackendFlags() {
  BackendOptions backend_options;
  backend_options.threads = absl::GetFlag(FLAGS_threads);
  backend_options.max_queue = absl::GetFlag(FLAGS_max_queue);
  backend_options.streams_per_device = absl::GetFlag(FLAGS_streams);
  backend_options.shared_compute_stream = absl::GetFlag(FLAGS_shared_compute_stream);
  backend_options.copy_threads = absl::GetFlag(FLAGS_copy_threads);
  backend_options.stream_to_device = absl::GetFlag(FLAGS_stream_to_device);
  backend_options.stream_preferred_from_bytes = absl::GetFlag(FLAGS_stream_preferred_from_bytes);
  backend_options.memory_budget_bytes = absl::GetFlag(FLAGS_memory_budget_mb) << 20;
  backend_options.warm_shapes = absl::GetFlag(FLAGS_warm_shapes);
  backend_options.tensor_map_cache_entries = absl::GetFlag(FLAGS_tensor_map_cache);
  if (absl::GetFlag(FLAGS_completion_spin_us) < 0) {
    return absl::InvalidArgumentError("--completion_spin_us: must be >= 0");
  }
  backend_options.completion_spin = absl::Microseconds(absl::GetFlag(FLAGS_completion_spin_us));
  for (absl::string_view d : absl::StrSplit(absl::GetFlag(FLAGS_devices), ',', absl::SkipWhitespace())) {
    int index;
    if (!absl::SimpleAtoi(d, &index) || index < 0) {
      return absl::InvalidArgumentError("--devices: '" + std::string(d) + "' is not a device index");
    }
    backend_options.devices.push_back(index);
  }
  if (backend_options.streams_per_device < 1) return absl::InvalidArgumentError("--streams: must be >= 1");
  if (backend_options.copy_threads < -1 || backend_options.copy_threads > 64) {
    return absl::InvalidArgumentError("--copy_threads: -1 (default), or 0 to 64");
  }
  return backend_options;
}

// The shutdown grace and the limits on slow and idle clients.
absl::Status TimeoutFlags(ServerOptions::Timeouts* timeouts) {
  const double grace = absl::GetFlag(FLAGS_shutdown_grace_s);
  if (!(grace >= 0)) return absl::InvalidArgumentError("--shutdown_grace_s: must be >= 0");
  for (const auto& [name, value] : {std::pair{"stream_idle_timeout_s", absl::GetFlag(FLAGS_stream_idle_timeout_s)},
                                    std::pair{"upload_timeout_s", absl::GetFlag(FLAGS_upload_timeout_s)},
                                    std::pair{"sequence_drain_s", absl::GetFlag(FLAGS_sequence_drain_s)},
                                    std::pair{"max_connection_idle_s", absl::GetFlag(FLAGS_max_connection_idle_s)},
                                    std::pair{"keepalive_time_s", absl::GetFlag(FLAGS_keepalive_time_s)},
                                    std::pair{"keepalive_timeout_s", absl::GetFlag(FLAGS_keepalive_timeout_s)},
                                    std::pair{"min_client_ping_interval_s",
                                              absl::GetFlag(FLAGS_min_client_ping_interval_s)}}) {
    if (!(value >= 0)) return absl::InvalidArgumentError(std::string("--") + name + ": must be >= 0");
  }
  timeouts->shutdown_grace = absl::Seconds(grace);
  timeouts->sequence_drain = absl::Seconds(absl::GetFlag(FLAGS_sequence_drain_s));
  timeouts->stream_idle_timeout = absl::Seconds(absl::GetFlag(FLAGS_stream_idle_timeout_s));
  timeouts->upload_timeout = absl::Seconds(absl::GetFlag(FLAGS_upload_timeout_s));
  timeouts->max_connection_idle = absl::Seconds(absl::GetFlag(FLAGS_max_connection_idle_s));
  timeouts->keepalive_time = absl::Seconds(absl::GetFlag(FLAGS_keepalive_time_s));
  timeouts->keepalive_timeout = absl::Seconds(absl::GetFlag(FLAGS_keepalive_timeout_s));
  timeouts->min_client_ping_interval = absl::Seconds(absl::GetFlag(FLAGS_min_client_ping_interval_s));
  return absl::OkStatus();
}

// What one request, one message, the transport and one client may take.
absl::Status LimitFlags(ServerOptions::Limits* limits) {
  for (const auto& [name, value] : {std::pair{"max_batch", absl::GetFlag(FLAGS_max_batch)},
                                    std::pair{"max_q_len", absl::GetFlag(FLAGS_max_q_len)},
                                    std::pair{"max_kv_len", absl::GetFlag(FLAGS_max_kv_len)},
                                    std::pair{"max_heads", absl::GetFlag(FLAGS_max_heads)}}) {
    if (value < 0) return absl::InvalidArgumentError(std::string("--") + name + ": must be >= 0 (0: no limit)");
  }
  limits->max_request_bytes = absl::GetFlag(FLAGS_max_request_bytes);
  limits->max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  limits->max_transport_memory_bytes = absl::GetFlag(FLAGS_max_transport_memory_bytes);
  limits->max_batch = absl::GetFlag(FLAGS_max_batch);
  limits->max_q_len = absl::GetFlag(FLAGS_max_q_len);
  limits->max_kv_len = absl::GetFlag(FLAGS_max_kv_len);
  limits->max_heads = absl::GetFlag(FLAGS_max_heads);
  limits->max_calls_per_client = absl::GetFlag(FLAGS_max_calls_per_client);
  limits->max_uploads_per_client = absl::GetFlag(FLAGS_max_uploads_per_client);
  return absl::OkStatus();
}

absl::Status ShmFlags(ServerOptions::Shm* shm) {
  shm->socket = absl::GetFlag(FLAGS_shm_socket);
  shm->max_bytes = absl::GetFlag(FLAGS_shm_max_bytes);
  shm->max_channels = absl::GetFlag(FLAGS_shm_max_channels);
  if (absl::GetFlag(FLAGS_shm_spin_us) < 0) return absl::InvalidArgumentError("--shm_spin_us: must be >= 0");
  shm->spin = absl::Microseconds(absl::GetFlag(FLAGS_shm_spin_us));
  if (absl::GetFlag(FLAGS_shm_reply_spin_us) < 0) {
    return absl::InvalidArgumentError("--shm_reply_spin_us: must be >= 0");
  }
  shm->reply_spin = absl::Microseconds(absl::GetFlag(FLAGS_shm_reply_spin_us));
  shm->device_order = absl::GetFlag(FLAGS_shm_device_order);
  return absl::OkStatus();
}

// The gRPC listeners: where, the socket file's mode, how many connections, channel arguments.
absl::Status ListenerFlags(ServerOptions::Network* network) {
  network->listen = absl::GetFlag(FLAGS_listen);
  network->unix_socket = absl::GetFlag(FLAGS_unix_socket);
  network->max_connections = absl::GetFlag(FLAGS_max_connections);
  network->max_streams_per_connection = absl::GetFlag(FLAGS_max_streams_per_connection);
  network->grpc_args = absl::GetFlag(FLAGS_grpc_arg);
  const std::string mode = absl::GetFlag(FLAGS_unix_socket_mode);
  char* end = nullptr;
  const unsigned long bits = std::strtoul(mode.c_str(), &end, 8);
  if (mode.empty() || *end != '\0' || bits > 0777) {
    return absl::InvalidArgumentError("--unix_socket_mode: '" + mode + "' is not octal permission bits (e.g. 0660)");
  }
  network->unix_socket_mode = static_cast<uint32_t>(bits);
  return absl::OkStatus();
}

// TLS, bearer tokens and CUDA IPC; the metrics endpoint and the access log.
void SecurityAndObservabilityFlags(ServerOptions::Security* security, ServerOptions::Observability* observability) {
  security->tls_cert = absl::GetFlag(FLAGS_tls_cert);
  security->tls_key = absl::GetFlag(FLAGS_tls_key);
  security->tls_client_ca = absl::GetFlag(FLAGS_tls_client_ca);
  security->auth_token_file = absl::GetFlag(FLAGS_auth_token_file);
  security->peer_secret_file = absl::GetFlag(FLAGS_peer_secret_file);
  security->peer_tls_ca = absl::GetFlag(FLAGS_peer_tls_ca);
  security->peer_tls_server_name = absl::GetFlag(FLAGS_peer_tls_server_name);
  security->enable_cuda_ipc = absl::GetFlag(FLAGS_enable_cuda_ipc);
  security->ipc_over_tcp = absl::GetFlag(FLAGS_ipc_over_tcp);
  security->reflection = absl::GetFlag(FLAGS_reflection);
  observability->metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  observability->access_log = absl::GetFlag(FLAGS_access_log);
}

// `backend` gives the pool's size when --kv_pool_mb leaves it to the backend.
absl::StatusOr<SequenceOptions> SequenceFlags(const attnd::server::Backend& backend) {
  SequenceOptions so;
  so.enabled = absl::GetFlag(FLAGS_sequences);
  so.pool_bytes = absl::GetFlag(FLAGS_kv_pool_mb) << 20;
  if (so.pool_bytes == 0) so.pool_bytes = backend.default_kv_pool_bytes();
  so.max_pools = absl::GetFlag(FLAGS_kv_max_pools);
  if (so.max_pools < 1) return absl::InvalidArgumentError("--kv_max_pools: must be >= 1");
  so.page_tokens = absl::GetFlag(FLAGS_kv_page_tokens);
  if (so.page_tokens < 16 || so.page_tokens > 256 || (so.page_tokens & (so.page_tokens - 1)) != 0) {
    return absl::InvalidArgumentError("--kv_page_tokens: must be a power of two from 16 to 256");
  }
  so.max_tokens = absl::GetFlag(FLAGS_max_sequence_tokens);
  if (so.max_tokens < 1 || so.max_tokens > INT32_MAX) {
    return absl::InvalidArgumentError("--max_sequence_tokens: must be 1..2^31-1");
  }
  const double ttl = absl::GetFlag(FLAGS_sequence_ttl_s);
  if (!(ttl >= 0)) return absl::InvalidArgumentError("--sequence_ttl_s: must be >= 0");
  so.ttl = ttl == 0 ? absl::InfiniteDuration() : absl::Seconds(ttl);
  so.max_per_client = absl::GetFlag(FLAGS_max_sequences_per_client);
  so.max_pages_per_client = absl::GetFlag(FLAGS_max_pages_per_client);
  so.device_moves = absl::GetFlag(FLAGS_sequence_device_moves);
  const std::string share = absl::GetFlag(FLAGS_sequence_device_moves_share_pool);
  if (share == "never") {
    so.device_moves_share_pool = SharePool::kNever;
  } else if (share == "peers") {
    so.device_moves_share_pool = SharePool::kPeers;
  } else if (share == "always") {
    so.device_moves_share_pool = SharePool::kAlways;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--sequence_device_moves_share_pool: '", share, "' is not never, peers or always"));
  }
  so.max_batch = absl::GetFlag(FLAGS_max_step_batch);
  if (so.max_batch < 1) return absl::InvalidArgumentError("--max_step_batch: must be >= 1");
  so.max_open = so.max_batch;
  if (absl::GetFlag(FLAGS_step_batch_wait_us) < 0) {
    return absl::InvalidArgumentError("--step_batch_wait_us: must be >= 0");
  }
  so.batch_wait = absl::Microseconds(absl::GetFlag(FLAGS_step_batch_wait_us));
  so.launches_in_flight = absl::GetFlag(FLAGS_step_launches_in_flight);
  if (so.launches_in_flight < 1) return absl::InvalidArgumentError("--step_launches_in_flight: must be >= 1");
  const double order_timeout = absl::GetFlag(FLAGS_step_order_timeout_s);
  if (!(order_timeout >= 0)) return absl::InvalidArgumentError("--step_order_timeout_s: must be >= 0");
  so.order_timeout = order_timeout == 0 ? absl::InfiniteDuration() : absl::Seconds(order_timeout);
  so.max_waiting = absl::GetFlag(FLAGS_max_queue);
  so.advertise_address = absl::GetFlag(FLAGS_advertise_address);
  return so;
}

// Waits for SIGINT or SIGTERM, then shuts the server down within the grace (and kExitMargin).
int ServeUntilSignalled(attnd::server::Server& server, const sigset_t& signals, const ServerOptions& options) {
  int sig = 0;
  sigwait(&signals, &sig);
  spdlog::info("received {}, finishing accepted requests", sig == SIGINT ? "SIGINT" : "SIGTERM");
  absl::Notification stopped;
  std::thread stopper([&] {
    server.Shutdown();
    stopped.Notify();
  });
  const absl::Duration grace = options.timeouts.shutdown_grace;
  if (grace < absl::Hours(365 * 24) && !stopped.WaitForNotificationWithTimeout(grace + kExitMargin)) {
    spdlog::warn("attnd exits with a computation still running past --shutdown_grace_s (its call was cancelled)");
    struct stat st;
    if (!options.network.unix_socket.empty() && ::lstat(options.network.unix_socket.c_str(), &st) == 0 &&
        S_ISSOCK(st.st_mode)) {
      ::unlink(options.network.unix_socket.c_str());
    }
    std::fflush(nullptr);
    std::_Exit(0);
  }
  stopper.join();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("attnd: fused attention as a gRPC service.\n  attnd --listen=0.0.0.0:50051 [--backend=auto]");
  attnd::HandleHelpFlag(argc, argv, __FILE__);
  absl::ParseCommandLine(argc, argv);

  if (absl::Status s = SetLogLevel(); !s.ok()) return Fail(s);
  // Every connection and shared-memory channel takes descriptors; the soft limit (often 1024) is raised to
  // what the hard limit allows.
  const uint64_t fd_limit = attnd::server::RaiseDescriptorLimit();
  spdlog::debug("descriptor limit {}", fd_limit);
  if (absl::Status s = HeapFlags(); !s.ok()) return Fail(s);
  const sigset_t signals = BlockShutdownSignals();

  absl::StatusOr<BackendOptions> backend_options = BackendFlags();
  if (!backend_options.ok()) return Fail(backend_options.status());
  ServerOptions options;
  if (absl::Status s = TimeoutFlags(&options.timeouts); !s.ok()) return Fail(s);
  if (absl::Status s = LimitFlags(&options.limits); !s.ok()) return Fail(s);
  auto backend = attnd::server::MakeBackend(absl::GetFlag(FLAGS_backend), *backend_options);
  if (!backend.ok()) return Fail(std::string(backend.status().message()));
  if (absl::Status s = ShmFlags(&options.shm); !s.ok()) return Fail(s);
  if (absl::Status s = ListenerFlags(&options.network); !s.ok()) return Fail(s);
  SecurityAndObservabilityFlags(&options.security, &options.observability);
  options.drain.to = absl::GetFlag(FLAGS_sequence_drain_to);
  options.drain.moves_in_flight = absl::GetFlag(FLAGS_sequence_drain_moves);
  absl::StatusOr<SequenceOptions> sequences = SequenceFlags(**backend);
  if (!sequences.ok()) return Fail(sequences.status());
  options.sequences = *std::move(sequences);

  auto server = attnd::server::Server::Create(options, std::move(*backend));
  if (!server.ok()) return Fail(std::string(server.status().message()));
  return ServeUntilSignalled(**server, signals, options);
}
