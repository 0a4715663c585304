#include "attnd/server/server.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "attnd/transport/channel_args.h"
#include "attnd/transport/heap_tuning.h"
#include "attnd/server/cuda_backend.h"
#include "attnd/server/dispatcher.h"
#include "attnd/server/status_util.h"
#include "attnd/server/transports.h"
#include "auth.h"
#include "listener_guard.h"
#include "call_observer.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/resource_quota.h"
#include "grpcpp/impl/server_builder_option.h"
#include "grpcpp/impl/server_builder_plugin.h"
#include "health_service.h"
#include "metrics.h"
#include "sequence_drain.h"
#include "service.h"
#include "shm_listener.h"
#include "spdlog/spdlog.h"
#include "tls.h"

namespace attnd::server {
namespace {

constexpr const char* kServiceName = "attnd.v1.Attention";
// Loopback and LAN round trips are far below this; it bounds what every shutdown pays.
constexpr absl::Duration kDrainLinger = absl::Milliseconds(50);
// Once the accepted requests are answered, what is left holds no request (health Watch and reflection streams,
// idle connections, calls that arrived during the drain and are being refused UNAVAILABLE): gRPC gets this long
// to send those refusals and its GOAWAYs, then cancels the rest and closes every connection.
constexpr absl::Duration kLateCallWindow = absl::Milliseconds(200);
// A server quiet this long hands its freed heap back (IdleHeapTrimmer): soon enough that a burst's memory is not
// kept for good, long enough that a steady client never pays the page faults.
constexpr absl::Duration kHeapTrimPeriod = absl::Seconds(10);
// gRPC's default, stated: the third ping from a client within --min_client_ping_interval without data in
// between closes its connection.
constexpr int kMaxPingStrikes = 2;

// Server reflection on one builder, or off. gRPC's reflection library registers its plugin for every builder of
// the process once it is linked in (a static initializer calls InitProtoReflectionServerBuilderPlugin), so the
// option takes it out of the builder's plugins, then adds one back when asked for.
class ReflectionOption final : public grpc::ServerBuilderOption {
 public:
  explicit ReflectionOption(bool on) : on_(on) {}
  void UpdateArguments(grpc::ChannelArguments*) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    const std::string name = grpc::reflection::ProtoServerReflectionPlugin().name();
    plugins->erase(std::remove_if(plugins->begin(), plugins->end(), [&](const auto& p) { return p->name() == name; }),
                   plugins->end());
    if (on_) plugins->push_back(std::make_unique<grpc::reflection::ProtoServerReflectionPlugin>());
  }

 private:
  const bool on_;
};

// A duration as gRPC's int milliseconds; zero (off) and anything beyond INT_MAX ms as INT_MAX (gRPC's "never").
int ToGrpcMillis(absl::Duration d) {
  if (d <= absl::ZeroDuration()) return INT_MAX;
  const int64_t ms = absl::ToInt64Milliseconds(d);
  return ms >= INT_MAX ? INT_MAX : static_cast<int>(std::max<int64_t>(ms, 1));
}

int ClampToInt(uint64_t v) { return v > static_cast<uint64_t>(INT_MAX) ? INT_MAX : static_cast<int>(v); }

// A socket file left by a server that died would make bind fail; anything that is not a socket is left alone.
void RemoveStaleSocket(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode)) ::unlink(path.c_str());
}

// --max_transport_memory_bytes, or its default: the largest message and 16 MiB of read buffers beside it, at
// least 64 MiB. gRPC 1.51 gives no way to stop one message short of its announced length, so the quota is what
// one hostile upload can cost; servers that hold many large unary requests at once raise it.
size_t TransportMemoryBytes(const ServerOptions::Limits& l) {
  const uint64_t bytes = l.max_transport_memory_bytes > 0
                             ? l.max_transport_memory_bytes
                             : std::max<uint64_t>(l.max_message_bytes + (16ull << 20), 64ull << 20);
  return static_cast<size_t>(std::min<uint64_t>(bytes, SIZE_MAX));
}

ValidationLimits LimitsFor(const ServerOptions::Limits& l, const Backend& backend) {
  return ValidationLimits{l.max_request_bytes, backend.supported_head_dims(), backend.supported_dtypes(),
                          l.max_batch,         l.max_q_len,                  l.max_kv_len,
                          l.max_heads};
}

// The cuda-ipc buffers: a registry over the devices the cuda backend serves, when enabled; null otherwise.
std::unique_ptr<BufferRegistry> MakeBufferRegistry(const ServerOptions& o, const Backend& backend) {
  if (!o.security.enable_cuda_ipc || !backend.cuda_ipc()) return nullptr;
#if defined(ATTND_HAVE_CUDA_BACKEND)
  std::vector<int> devices;
  for (const DeviceDescription& d : backend.devices()) devices.push_back(d.index);
  return MakeCudaIpcRegistry(std::move(devices));
#else
  return nullptr;
#endif
}

class ServerImpl final : public Server {
 public:
  ServerImpl(const ServerOptions& options, std::unique_ptr<Backend> backend)
      : options_(options),
        backend_(std::move(backend)),
        stats_(options_.observability.access_log),
        peers_(options_.limits.max_calls_per_client),
        buffers_(MakeBufferRegistry(options_, *backend_)),
        dispatcher_(LimitsFor(options_.limits, *backend_), backend_.get(), buffers_.get()),
        sequences_(options_.sequences, LimitsFor(options_.limits, *backend_), backend_.get(), buffers_.get()),
        service_(options_, &dispatcher_, &sequences_, buffers_.get(), &stats_) {}

  ~ServerImpl() override { Shutdown(); }

  absl::Status Start() {
    const absl::Status secured = StartSecurityAndMetrics();
    if (!secured.ok()) return AbandonStart(secured);
    const ServerOptions::Network& network = options_.network;
    const ServerOptions::Timeouts& timeouts = options_.timeouts;
    grpc::ServerBuilder builder;
    builder.SetOption(std::make_unique<ReflectionOption>(options_.security.reflection));
    if (!network.listen.empty()) builder.AddListeningPort(network.listen, tcp_credentials_, &tcp_port_);
    if (!network.unix_socket.empty()) {
      RemoveStaleSocket(network.unix_socket);
      builder.AddListeningPort("unix:" + network.unix_socket, UnixListenerCredentials(auth_));
    }
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> observers;
    observers.push_back(std::make_unique<CallObserverFactory>(&stats_, &peers_, &drain_));
    builder.experimental().SetInterceptorCreators(std::move(observers));
    service_.set_peer_calls(&peers_);
    service_.set_auth(auth_.get());
    builder.SetMaxReceiveMessageSize(ClampToInt(options_.limits.max_message_bytes));
    builder.SetMaxSendMessageSize(ClampToInt(options_.limits.max_message_bytes));
    builder.RegisterService(&service_);
    builder.RegisterService(&health_);
    // gRPC 1.51 grants a message all the flow-control window its length prefix asks for and checks the
    // message limit only once the whole message is in, so a prefix announcing 1 GiB has the server buffer
    // 1 GiB. The quota bounds what the transport holds in all (read buffers, messages being received, unary
    // requests still held by the backend): near it gRPC shrinks the windows, beyond it resets streams
    // RESOURCE_EXHAUSTED "Buffers full".
    quota_.Resize(TransportMemoryBytes(options_.limits));
    builder.SetResourceQuota(quota_);
    // Slow and idle clients; a --grpc_arg of the same name replaces each (SetsChannelArg).
    const std::pair<const char*, int> limits[] = {
        {GRPC_ARG_MAX_CONNECTION_IDLE_MS, ToGrpcMillis(timeouts.max_connection_idle)},
        {GRPC_ARG_KEEPALIVE_TIME_MS, ToGrpcMillis(timeouts.keepalive_time)},
        {GRPC_ARG_KEEPALIVE_TIMEOUT_MS, ToGrpcMillis(timeouts.keepalive_timeout)},
        // Keepalive pings go out also on a connection whose calls send nothing (a stalled upload's).
        {GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0},
        {GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
         timeouts.min_client_ping_interval > absl::ZeroDuration() ? ToGrpcMillis(timeouts.min_client_ping_interval)
                                                                  : 0},
        {GRPC_ARG_HTTP2_MAX_PING_STRIKES, kMaxPingStrikes},
    };
    for (const auto& [name, value] : limits) {
      if (!SetsChannelArg(grpc_args_, name)) builder.AddChannelArgument(name, value);
    }
    if (network.max_streams_per_connection > 0 && !SetsChannelArg(grpc_args_, GRPC_ARG_MAX_CONCURRENT_STREAMS)) {
      builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, ClampToInt(network.max_streams_per_connection));
    }
    for (const ChannelArg& arg : grpc_args_) {
      std::visit([&](const auto& v) { builder.AddChannelArgument(arg.name, v); }, arg.value);
    }
    // A probe that comes before the listeners are guarded hears NOT_SERVING rather than NOT_FOUND.
    SetServing(false);
    server_ = builder.BuildAndStart();
    if (server_ == nullptr || (!network.listen.empty() && tcp_port_ == 0)) {
      return AbandonStart(absl::UnavailableError(absl::StrCat("cannot listen on '", network.listen, "'",
                                                              network.unix_socket.empty() ? "" : " and unix:",
                                                              network.unix_socket, " (address in use or invalid?)")));
    }
    // gRPC binds with the process umask; narrow it to the configured mode before anyone is told we are up.
    if (!network.unix_socket.empty() && ::chmod(network.unix_socket.c_str(), network.unix_socket_mode) != 0) {
      return AbandonStart(
          absl::PermissionDeniedError(absl::StrCat("unix_socket_mode: cannot chmod ", network.unix_socket)));
    }
    GuardListeners();
    {
      absl::MutexLock lock(&health_mu_);
      if (!listener_lost_) SetServing(true);
    }
    if (!options_.shm.socket.empty()) {
      ShmListenerOptions so;
      so.path = options_.shm.socket;
      so.mode = network.unix_socket_mode;
      so.max_area_bytes = options_.shm.max_bytes;
      so.max_channels = options_.shm.max_channels;
      so.spin = options_.shm.spin;
      so.reply_spin = options_.shm.reply_spin;
      so.order_timeout = options_.sequences.order_timeout;
      so.device_order = options_.shm.device_order;
      so.tokens = auth_tokens_;
      so.stats = &stats_;
      absl::StatusOr<std::unique_ptr<ShmListener>> shm = ShmListener::Start(so, &dispatcher_, &sequences_);
      if (!shm.ok()) return AbandonStart(shm.status());
      shm_ = *std::move(shm);
    }
    spdlog::info("attnd listening on {}{}{} (backend {}{}, max_message_bytes {}, max_request_bytes {}, "
                 "max_transport_memory_bytes {})",
                 network.listen.empty() ? "" : absl::StrCat(kGrpcTcp, " ", network.listen, " [port ", tcp_port_, "]"),
                 network.listen.empty() || network.unix_socket.empty() ? "" : " and ",
                 network.unix_socket.empty() ? "" : absl::StrCat(kGrpcUnix, " ", network.unix_socket),
                 backend_->name(), buffers_ != nullptr ? absl::StrCat(", ", kCudaIpc, " buffers") : "",
                 options_.limits.max_message_bytes, options_.limits.max_request_bytes,
                 TransportMemoryBytes(options_.limits));
    return absl::OkStatus();
  }

  int tcp_port() const override { return tcp_port_; }
  int metrics_port() const override { return metrics_ != nullptr ? metrics_->port() : 0; }

  void Shutdown() override {
    absl::MutexLock lock(&shutdown_mu_);  // a second caller waits here until the first has finished
    if (done_.HasBeenNotified() || server_ == nullptr) return;
    spdlog::info("attnd shutting down: {} requests in flight", backend_->in_flight());
    {
      absl::MutexLock lock(&health_mu_);
      stopping_ = true;
    }
    SetServing(false);
    // Graces beyond a year (infinite included) mean "wait for ever".
    const absl::Duration grace = options_.timeouts.shutdown_grace;
    const bool forever = grace >= absl::Hours(24 * 365);
    const absl::Time deadline =
        forever ? absl::InfiniteFuture() : absl::Now() + std::max(grace, absl::ZeroDuration());
    DrainSequences(std::min(deadline, absl::Now() + options_.timeouts.sequence_drain));
    // gRPC shuts its listeners down from here on: their errors are no loss.
    guard_.reset();
    // In this order: a call the service still accepts has had its metadata, so DrainTracker counted it.
    dispatcher_.BeginShutdown();
    // New steps are refused from here; every admitted one is answered (the backend still runs).
    sequences_.Shutdown();
    // Shm channels finish the requests they hold (the backend still runs) and close.
    if (shm_ != nullptr) shm_->Stop();
    drain_.BeginDrain();
    // Every accepted Forward ends (its reply handed to the transport) before gRPC is told to stop: see
    // DrainTracker for the connection reset that telling it earlier invites.
    if (drain_.AwaitDrained(deadline)) {
      // The clients' last frames for those replies (flow-control updates) arrive and are read before the
      // connections close, so the close is a FIN, not a reset.
      absl::SleepFor(std::min(kDrainLinger, std::max(deadline - absl::Now(), absl::ZeroDuration())));
    } else {
      spdlog::warn("attnd shutdown_grace ran out with {} calls unfinished; cancelling them", drain_.live());
    }
    // No accepted request is left open (or the grace is spent): the health Watches end, and gRPC stops accepting,
    // answers what is in hand within kLateCallWindow, then cancels the rest and closes the connections. An idle
    // connection or a reflection stream therefore never holds the exit either.
    health_.Shutdown();
    server_->Shutdown(absl::ToChronoTime(absl::Now() + kLateCallWindow));
    backend_->Shutdown();
    if (!options_.network.unix_socket.empty()) RemoveStaleSocket(options_.network.unix_socket);
    spdlog::info("attnd stopped");
    done_.Notify();
  }

  void Wait() override { done_.WaitForNotification(); }

  // Refuses new sequences, then serves the open ones until their callers have closed them or `until`. The refusal
  // comes first and whatever is open: an OpenSequence taken after SIGTERM would be lost with the process, where a
  // refusal (UNAVAILABLE) sends the fleet client on to another server.
  void DrainSequences(absl::Time until) {
    if (!options_.sequences.enabled) return;
    sequences_.BeginDrain();
    const uint64_t open = sequences_.stats().open;
    if (options_.timeouts.sequence_drain <= absl::ZeroDuration() || open == 0) return;
    if (!options_.drain.to.empty()) {
      MoveSequences(until);
      if (sequences_.stats().open == 0) return;
    }
    spdlog::info("attnd draining {} KV sequences for up to {} (--sequence_drain_s); new ones are refused",
                 sequences_.stats().open, absl::FormatDuration(until - absl::Now()));
    if (const size_t left = sequences_.AwaitClosed(until); left > 0) {
      spdlog::warn("attnd drain over with {} KV sequences still open; they are lost", left);
    } else {
      spdlog::info("attnd drain over: every KV sequence was closed");
    }
  }

  // --sequence_drain_to: the open sequences move to the target, then their old ids keep answering "moved to" until
  // each has been named once more (its caller knows where it went) or `until`.
  void MoveSequences(absl::Time until) {
    DrainMovesOptions moves;
    moves.self = SelfTarget();
    moves.to = options_.drain.to;
    moves.peer_secret = peer_secret_;
    moves.grpc_args = options_.network.grpc_args;
    if (!options_.security.tls_cert.empty()) {
      moves.tls_ca_file = options_.security.peer_tls_ca;
      moves.tls_cert_file = options_.security.tls_cert;
      moves.tls_key_file = options_.security.tls_key;
      moves.tls_server_name = options_.security.peer_tls_server_name;
    }
    moves.in_flight = options_.drain.moves_in_flight;
    moves.retry = options_.drain.retry;
    MoveSequencesAway(sequences_, moves, until);
    const absl::Time start = absl::Now();
    if (const size_t unfollowed = sequences_.AwaitFollowed(until); unfollowed > 0) {
      spdlog::info("attnd drain: {} moved KV sequences were not named again before the drain time ran out",
                   unfollowed);
    } else {
      spdlog::info("attnd drain: the callers of every moved KV sequence were told where it went (in {})",
                   absl::FormatDuration(absl::Trunc(absl::Now() - start, absl::Milliseconds(1))));
    }
  }

  // A target that reaches this server from itself, for the drain's exports of ids without '@': the TCP port over
  // loopback, else the unix socket.
  std::string SelfTarget() const {
    if (options_.network.listen.empty()) return absl::StrCat("unix:", options_.network.unix_socket);
    const std::string& listen = options_.network.listen;
    const std::string host = listen.substr(0, listen.rfind(':'));
    const bool any = host.empty() || host == "0.0.0.0" || host == "[::]";
    return absl::StrCat(!any ? host : host == "[::]" ? "[::1]" : "127.0.0.1", ":", tcp_port_);
  }

 private:
  // A start that failed: the gRPC server, if built, is stopped (its health watches first: Shutdown without a
  // deadline would wait for them), then the backend.
  absl::Status AbandonStart(absl::Status why) {
    if (server_ != nullptr) {
      health_.Shutdown();
      server_->Shutdown();
      server_.reset();
    }
    backend_->Shutdown();
    return why;
  }

  // Health for the whole server and the service, unless a listener was lost (it then stays NOT_SERVING).
  void SetServing(bool serving) {
    health_.SetServingStatus("", serving);
    health_.SetServingStatus(kServiceName, serving);
  }

  // listener_guard.h: the gRPC listeners keep accepting at the descriptor limit and take at most
  // max_connections; a listener gRPC gives up on turns health NOT_SERVING for good.
  void GuardListeners() {
    ListenerGuardOptions g;
    const uint64_t fd_limit = DescriptorLimit();
    const uint32_t configured = options_.network.max_connections;
    g.max_connections = configured > 0 ? configured : DefaultMaxConnections(fd_limit);
    ServerMetrics* metrics = metrics_.get();
    g.on_refused = [metrics, configured, this] {
      if (metrics != nullptr) metrics->RecordConnectionRefused();
      const absl::Time now = absl::Now();
      absl::MutexLock lock(&health_mu_);
      if (now - last_refusal_log_ < absl::Seconds(10)) return;
      last_refusal_log_ = now;
      spdlog::warn("attnd refusing gRPC connections: {} open (--max_connections) or descriptor limit {} reached",
                   configured > 0 ? configured : DefaultMaxConnections(DescriptorLimit()),
                   DescriptorLimit());
    };
    g.on_lost = [metrics, this](int error) {
      if (metrics != nullptr) metrics->RecordListenerLost();
      absl::MutexLock lock(&health_mu_);
      listener_lost_ = true;
      if (stopping_) return;
      spdlog::error("attnd: a gRPC listener stopped accepting ({}); health is NOT_SERVING until restart",
                    std::strerror(error));
      SetServing(false);
    };
    absl::StatusOr<std::unique_ptr<ListenerGuard>> guard = ListenerGuard::Install(
        options_.network.listen.empty() ? 0 : tcp_port_, options_.network.unix_socket, std::move(g));
    if (!guard.ok()) {
      spdlog::warn("attnd: {}; the gRPC listeners run unguarded", std::string(guard.status().message()));
      return;
    }
    guard_ = *std::move(guard);
    spdlog::info("attnd accepts up to {} gRPC connections (descriptor limit {})",
                 configured > 0 ? configured : DefaultMaxConnections(fd_limit), fd_limit);
  }

  // Credentials, the token check and the metrics endpoint: everything that can fail on a bad flag is done
  // before a port is bound.
  absl::Status StartSecurityAndMetrics() {
    absl::StatusOr<std::vector<ChannelArg>> grpc_args = ParseChannelArgs(options_.network.grpc_args, "grpc_arg");
    if (!grpc_args.ok()) return grpc_args.status();
    grpc_args_ = *std::move(grpc_args);
    // One source of truth for the message limit: GetServerInfo reports --max_message_bytes to clients.
    for (const char* owned : {GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, GRPC_ARG_MAX_SEND_MESSAGE_LENGTH}) {
      if (SetsChannelArg(grpc_args_, owned)) {
        return absl::InvalidArgumentError(absl::StrCat("grpc_arg: ", owned, " is set by --max_message_bytes; use that"));
      }
    }
    if (!options_.observability.metrics_listen.empty()) {
      metrics_ = std::make_unique<ServerMetrics>(
          backend_.get(), [this] { return service_.streams_receiving(); }, [this] { return sequences_.stats(); });
      ATTND_RETURN_IF_ERROR(metrics_->Serve(options_.observability.metrics_listen));
      stats_.set_metrics(metrics_.get());
      spdlog::info("attnd metrics on http://{}/metrics [port {}]", options_.observability.metrics_listen,
                   metrics_->port());
    }
    if (!options_.security.peer_secret_file.empty()) {
      absl::StatusOr<std::string> secret = LoadPeerSecret(options_.security.peer_secret_file);
      if (!secret.ok()) return secret.status();
      peer_secret_ = *std::move(secret);
      service_.set_peer_secret(peer_secret_);
    }
    if (!options_.security.auth_token_file.empty()) {
      absl::StatusOr<std::vector<std::string>> tokens = LoadAuthTokens(options_.security.auth_token_file);
      if (!tokens.ok()) return tokens.status();
      ServerMetrics* metrics = metrics_.get();
      auth_tokens_ = *tokens;
      auth_ = std::make_shared<BearerTokenProcessor>(
          std::move(*tokens),
          [metrics] {
            if (metrics != nullptr) metrics->RecordAuthFailure();
          },
          peer_secret_);
    }
    if (!options_.network.listen.empty()) {
      const TlsFiles tls{options_.security.tls_cert, options_.security.tls_key, options_.security.tls_client_ca};
      absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> creds =
          TcpListenerCredentials(options_.network.listen, tls, auth_);
      if (!creds.ok()) return creds.status();
      tcp_credentials_ = std::move(*creds);
      spdlog::info("attnd {} security: {}{}", kGrpcTcp, !tls.enabled() ? "plaintext" : tls.client_ca.empty() ? "TLS" : "mutual TLS",
                   auth_ != nullptr ? ", bearer tokens" : "");
    }
    return absl::OkStatus();
  }

  const ServerOptions options_;
  std::unique_ptr<Backend> backend_;
  // Used by gRPC's threads (interceptors, the token check) and the metrics HTTP threads: declared before
  // server_ so that they outlive it.
  std::unique_ptr<ServerMetrics> metrics_;
  CallStats stats_;  // the one stats sink: GetStats, metrics_ and the access log read it
  PeerCalls peers_;
  // Steps in flight on a sequence or a shm channel do not pass through CallStats until they end; a trim then
  // only costs their next allocations a page fault.
  IdleHeapTrimmer heap_trimmer_{[this] { return stats_.service_calls(); }, kHeapTrimPeriod};
  DrainTracker drain_;
  std::shared_ptr<BearerTokenProcessor> auth_;
  std::string peer_secret_;  // --peer_secret_file's; empty without it
  std::shared_ptr<grpc::ServerCredentials> tcp_credentials_;
  std::unique_ptr<BufferRegistry> buffers_;  // cuda-ipc buffers; null unless enable_cuda_ipc on the cuda backend
  Dispatcher dispatcher_;
  Sequences sequences_;
  AttentionService service_;
  HealthService health_{options_.timeouts.upload_timeout};  // declared before server_: it outlives the calls
  std::vector<ChannelArg> grpc_args_;
  std::unique_ptr<grpc::Server> server_;
  std::vector<std::string> auth_tokens_;  // for the shared-memory channels' hello
  std::unique_ptr<ShmListener> shm_;
  int tcp_port_ = 0;
  std::unique_ptr<ListenerGuard> guard_;
  grpc::ResourceQuota quota_{"attnd"};
  absl::Mutex health_mu_;
  bool stopping_ ABSL_GUARDED_BY(health_mu_) = false;
  bool listener_lost_ ABSL_GUARDED_BY(health_mu_) = false;
  absl::Time last_refusal_log_ ABSL_GUARDED_BY(health_mu_) = absl::InfinitePast();
  absl::Mutex shutdown_mu_;
  absl::Notification done_;
};

// --sequence_drain_to is refused at startup when the drain it asks for could not happen at shutdown.
absl::Status CheckDrainOptions(const ServerOptions& options) {
  if (options.drain.to.empty()) return absl::OkStatus();
  if (options.timeouts.sequence_drain <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "sequence_drain_to: needs --sequence_drain_s > 0 (the time the moves and the callers' following get)");
  }
  if (options.security.peer_secret_file.empty()) {
    return absl::InvalidArgumentError(
        "sequence_drain_to: needs --peer_secret_file (the secret the fleet shares; the moves act as each "
        "sequence's owner on both servers)");
  }
  if (!options.security.tls_cert.empty()) {
    if (options.security.peer_tls_ca.empty()) {
      return absl::InvalidArgumentError(
          "sequence_drain_to: with --tls_cert the drain's moves speak TLS to the fleet's servers: needs --peer_tls_ca "
          "(the CA their certificates chain to)");
    }
    if (std::ifstream ca(options.security.peer_tls_ca); !ca.good()) {
      return absl::InvalidArgumentError(
          absl::StrCat("peer_tls_ca: cannot read '", options.security.peer_tls_ca, "'"));
    }
  }
  if (options.drain.moves_in_flight == 0) {
    return absl::InvalidArgumentError("sequence_drain_moves: must be >= 1");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Server>> Server::Create(const ServerOptions& options, std::unique_ptr<Backend> backend) {
  if (backend == nullptr) return absl::InvalidArgumentError("backend: null");
  if (options.network.listen.empty() && options.network.unix_socket.empty()) {
    return absl::InvalidArgumentError("listen: no listener (set listen and/or unix_socket)");
  }
  if (options.limits.max_message_bytes < 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_message_bytes: ", options.limits.max_message_bytes, " is below 4096"));
  }
  if (options.limits.max_request_bytes == 0) return absl::InvalidArgumentError("max_request_bytes: must be > 0");
  ATTND_RETURN_IF_ERROR(CheckDrainOptions(options));
  // gRPC counts message sizes in int: a larger limit would be silently capped by gRPC while validation and
  // GetServerInfo promised more, so the effective value is used everywhere.
  ServerOptions effective = options;
  effective.limits.max_message_bytes =
      std::min<uint64_t>(options.limits.max_message_bytes, static_cast<uint64_t>(INT_MAX));
  auto server = std::make_unique<ServerImpl>(effective, std::move(backend));
  absl::Status s = server->Start();
  if (!s.ok()) return s;
  return std::unique_ptr<Server>(std::move(server));
}

}  // namespace attnd::server
