#include "attnd/client/client.h"

#include <algorithm>
#include <fstream>
#include <sstream>
#include <type_traits>
#include <utility>
#include <variant>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "attnd/client/shm_channel.h"
#include "attnd/transport/channel_args.h"
#include "client_internal.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/channel_arguments.h"

namespace attnd::client {
namespace {

// ClientOptions::move_connections' bound: each is a socket and a channel per server moved to or from.
constexpr int kMaxMoveConnections = 64;
// Servers whose move connections are kept: a fleet's addresses come and go (pods), so past this many, those of
// servers no move is using are dropped.
constexpr size_t kMoveServersKept = 64;

// The channel's credentials: TLS when any tls_* file is given (client.h), plaintext otherwise.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials(const ClientOptions& o) {
  if (o.tls_ca_file.empty() && o.tls_cert_file.empty() && o.tls_key_file.empty()) {
    return grpc::InsecureChannelCredentials();
  }
  if (o.tls_cert_file.empty() != o.tls_key_file.empty()) {
    return absl::InvalidArgumentError("tls_cert/tls_key: a client certificate needs both files");
  }
  grpc::SslCredentialsOptions ssl;
  const std::pair<const std::string*, std::string*> files[] = {
      {&o.tls_ca_file, &ssl.pem_root_certs}, {&o.tls_cert_file, &ssl.pem_cert_chain}, {&o.tls_key_file, &ssl.pem_private_key}};
  for (const auto& [path, pem] : files) {
    if (path->empty()) continue;
    std::ifstream in(*path, std::ios::binary);
    if (!in) return absl::InvalidArgumentError(absl::StrCat("tls: cannot read '", *path, "'"));
    std::stringstream text;
    text << in.rdbuf();
    *pem = text.str();
  }
  return grpc::SslCredentials(ssl);
}

}  // namespace

const char* TransportName(Transport t) {
  switch (t) {
    case Transport::kAuto:
      return "auto";
    case Transport::kUnary:
      return "unary";
    case Transport::kStream:
      return "stream";
    case Transport::kShm:
      return "shm";
  }
  return "?";
}

absl::StatusOr<Transport> ParseTransport(const std::string& name) {
  if (name == "auto") return Transport::kAuto;
  if (name == "unary") return Transport::kUnary;
  if (name == "stream") return Transport::kStream;
  if (name == "shm") return Transport::kShm;
  return absl::InvalidArgumentError(absl::StrCat("transport: '", name, "' is not one of auto, unary, stream, shm"));
}

Problem RequestSpec::ToProblem() const {
  Problem p;
  p.shape = shape;
  p.dtype = dtype;
  p.mask = mask;
  p.scale = scale ? *scale : DefaultScale(shape.head_dim);
  p.want_lse = want_lse;
  return p;
}

uint64_t RequestSpec::q_bytes() const { return static_cast<uint64_t>(QElems(shape)) * DTypeBytes(dtype); }
uint64_t RequestSpec::kv_bytes() const { return static_cast<uint64_t>(KVElems(shape)) * DTypeBytes(dtype); }
uint64_t RequestSpec::o_bytes() const {
  return static_cast<uint64_t>(QElems(shape)) * DTypeBytes(OutputDType(dtype));
}
uint64_t RequestSpec::lse_bytes() const { return want_lse ? static_cast<uint64_t>(LseElems(shape)) * 4 : 0; }

absl::Status FromGrpcStatus(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  // grpc::StatusCode and absl::StatusCode share their numeric values (both follow google.rpc.Code).
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

size_t ListedServers(const std::string& target) {
  if (!absl::StartsWith(target, "ipv4:") && !absl::StartsWith(target, "ipv6:")) return 0;
  return static_cast<size_t>(std::count(target.begin(), target.end(), ',')) + 1;
}

bool IsFleetTarget(const std::string& target) {
  return absl::StartsWith(target, "dns:") || ListedServers(target) > 1;
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeChannel(const ClientOptions& options, const std::string& target) {
  absl::StatusOr<std::vector<ChannelArg>> extra = ParseChannelArgs(options.grpc_args, "grpc_arg");
  if (!extra.ok()) return extra.status();
  auto ours = [&extra](absl::string_view name) { return !SetsChannelArg(*extra, name); };
  grpc::ChannelArguments args;
  if (ours(GRPC_ARG_MAX_SEND_MESSAGE_LENGTH)) args.SetMaxSendMessageSize(options.max_send_message_bytes);
  if (ours(GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH)) args.SetMaxReceiveMessageSize(options.max_receive_message_bytes);
  if (IsFleetTarget(target) && !options.load_balancing.empty() && ours(GRPC_ARG_LB_POLICY_NAME) &&
      ours(GRPC_ARG_SERVICE_CONFIG)) {
    // The balancer also watches each server's grpc.health.v1 status for the service: a server going away
    // (NOT_SERVING from the start of its shutdown, its drain included) gets no new calls, while its sequences'
    // calls still reach it over their pinned channels, which do not check health.
    args.SetServiceConfigJSON(absl::StrCat(R"({"loadBalancingConfig":[{")", options.load_balancing,
                                           R"(":{}}],"healthCheckConfig":{"serviceName":"attnd.v1.Attention"}})"));
  }
  if (options.own_connection && ours(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL)) {
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  }
  if (!options.tls_server_name.empty() && ours(GRPC_SSL_TARGET_NAME_OVERRIDE_ARG)) {
    args.SetSslTargetNameOverride(options.tls_server_name);
  }
  for (const ChannelArg& arg : *extra) {
    std::visit(
        [&](const auto& v) {
          if constexpr (std::is_same_v<std::decay_t<decltype(v)>, int>) {
            args.SetInt(arg.name, v);
          } else {
            args.SetString(arg.name, v);
          }
        },
        arg.value);
  }
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> creds = ChannelCredentials(options);
  if (!creds.ok()) return creds.status();
  auto channel = grpc::CreateCustomChannel(target, *creds, args);
  if (!channel) return absl::InvalidArgumentError(absl::StrCat("target: cannot create a channel to '", target, "'"));
  return channel;
}

absl::StatusOr<std::unique_ptr<Client>> Client::Create(const ClientOptions& options) {
  if (options.target.empty()) return absl::InvalidArgumentError("target: empty");
  if (options.default_deadline <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("default_deadline: must be positive");
  }
  if (options.move_connections < 0 || options.move_connections > kMaxMoveConnections) {
    return absl::InvalidArgumentError(absl::StrCat("move_connections: ", options.move_connections,
                                                   " is outside [0, ", kMaxMoveConnections, "]"));
  }
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = MakeChannel(options, options.target);
  if (!channel.ok()) return channel.status();
  return std::unique_ptr<Client>(new Client(options, *std::move(channel)));
}

Client::Client(ClientOptions options, std::shared_ptr<grpc::Channel> channel)
    : options_(std::move(options)),
      channel_(std::move(channel)),
      stub_(v1::Attention::NewStub(channel_)),
      generic_(std::make_unique<grpc::GenericStub>(channel_)) {}

Client::~Client() = default;

absl::StatusOr<Client::MoveChannel> Client::TakeMoveChannel(const std::string& address) {
  // A fleet target would spread a lane's calls over its servers: such moves stay on the pinned channels.
  const std::string& server = address.empty() ? options_.target : address;
  if (options_.move_connections == 0 || IsFleetTarget(server)) {
    absl::StatusOr<std::shared_ptr<grpc::Channel>> shared = ChannelFor(address);
    if (!shared.ok()) return shared.status();
    return MoveChannel{*std::move(shared), -1};
  }
  absl::MutexLock lock(&lanes_mu_);
  if (lanes_.size() >= kMoveServersKept && !lanes_.contains(server)) {
    absl::erase_if(lanes_, [](const auto& entry) {
      return std::all_of(entry.second.begin(), entry.second.end(), [](const MoveLane& l) { return l.moving == 0; });
    });
  }
  std::vector<MoveLane>& lanes = lanes_[server];
  auto least = std::min_element(lanes.begin(), lanes.end(),
                                [](const MoveLane& a, const MoveLane& b) { return a.moving < b.moving; });
  if (least == lanes.end() || (least->moving > 0 && lanes.size() < static_cast<size_t>(options_.move_connections))) {
    ClientOptions own = options_;
    own.own_connection = true;  // a subchannel pool of its own: a connection no other channel shares
    absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = MakeChannel(own, server);
    if (!channel.ok()) {
      return absl::Status(channel.status().code(),
                          absl::StrCat("a move's connection to '", server, "': ", channel.status().message()));
    }
    lanes.push_back(MoveLane{*std::move(channel), 0});
    least = lanes.end() - 1;
  }
  ++least->moving;
  return MoveChannel{least->channel, static_cast<int>(least - lanes.begin())};
}

void Client::ReturnMoveChannel(const std::string& address, const MoveChannel& taken) {
  if (taken.lane < 0) return;
  absl::MutexLock lock(&lanes_mu_);
  --lanes_[address.empty() ? options_.target : address][taken.lane].moving;
}

void Client::Prepare(grpc::ClientContext* ctx, const CallOptions& call) const {
  const absl::Duration d = call.deadline ? *call.deadline : options_.default_deadline;
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + d));
  ctx->set_wait_for_ready(call.wait_for_ready);
  if (!options_.auth_token.empty()) ctx->AddMetadata("authorization", "Bearer " + options_.auth_token);
  for (const auto& [key, value] : call.metadata) ctx->AddMetadata(key, value);
}

std::optional<uint64_t> Client::CachedMaxMessageBytes() const {
  absl::MutexLock lock(&info_mu_);
  if (!info_) return std::nullopt;
  return info_->limits().max_message_bytes();
}

absl::StatusOr<v1::ServerInfo> Client::ServerInfo(bool refresh, const CallOptions& call) {
  if (!refresh) {
    absl::MutexLock lock(&info_mu_);
    if (info_) return *info_;
  }
  grpc::ClientContext ctx;
  Prepare(&ctx, call);
  v1::ServerInfo info;
  absl::Status st = FromGrpcStatus(stub_->GetServerInfo(&ctx, v1::GetServerInfoRequest(), &info));
  if (!st.ok()) return st;
  absl::MutexLock lock(&info_mu_);
  info_ = info;
  return info;
}

absl::StatusOr<v1::ServerStats> Client::Stats(const CallOptions& call) {
  grpc::ClientContext ctx;
  Prepare(&ctx, call);
  v1::ServerStats stats;
  absl::Status st = FromGrpcStatus(stub_->GetStats(&ctx, v1::GetStatsRequest(), &stats));
  if (!st.ok()) return st;
  return stats;
}

absl::StatusOr<std::string> Client::RegisterCudaBuffer(const v1::RegisterCudaBufferRequest& request,
                                                       const CallOptions& call) {
  grpc::ClientContext ctx;
  Prepare(&ctx, call);
  v1::RegisterCudaBufferResponse resp;
  absl::Status st = FromGrpcStatus(stub_->RegisterCudaBuffer(&ctx, request, &resp));
  if (!st.ok()) return st;
  return resp.buffer_id();
}

absl::Status Client::UnregisterCudaBuffer(const std::string& buffer_id, const CallOptions& call) {
  grpc::ClientContext ctx;
  Prepare(&ctx, call);
  v1::UnregisterCudaBufferRequest req;
  req.set_buffer_id(buffer_id);
  v1::UnregisterCudaBufferResponse resp;
  return FromGrpcStatus(stub_->UnregisterCudaBuffer(&ctx, req, &resp));
}

absl::StatusOr<std::vector<v1::CudaBufferInfo>> Client::ListCudaBuffers(const CallOptions& call) {
  grpc::ClientContext ctx;
  Prepare(&ctx, call);
  v1::ListCudaBuffersResponse resp;
  absl::Status st = FromGrpcStatus(stub_->ListCudaBuffers(&ctx, v1::ListCudaBuffersRequest(), &resp));
  if (!st.ok()) return st;
  return std::vector<v1::CudaBufferInfo>(resp.buffers().begin(), resp.buffers().end());
}

absl::Status Client::CheckHealth(const std::string& service, const CallOptions& call) {
  // grpc.health.v1 is called generically: Debian ships neither health.proto nor its generated stubs, and the
  // two messages are one field each (HealthCheckRequest.service = 1, HealthCheckResponse.status = 1).
  std::string req;
  if (!service.empty()) {
    req.push_back(0x0a);  // field 1, length-delimited
    uint64_t n = service.size();
    while (n >= 0x80) {
      req.push_back(static_cast<char>((n & 0x7f) | 0x80));
      n >>= 7;
    }
    req.push_back(static_cast<char>(n));
    req += service;
  }
  grpc::Slice slice(req);
  grpc::ByteBuffer request_buf(&slice, 1), response_buf;
  grpc::GenericStub generic(channel_);
  grpc::ClientContext ctx;
  Prepare(&ctx, call);
  absl::Notification finished;
  grpc::Status status;
  generic.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request_buf, &response_buf,
                    [&](grpc::Status s) {
                      status = std::move(s);
                      finished.Notify();
                    });
  finished.WaitForNotification();
  if (!status.ok()) return FromGrpcStatus(status);
  std::vector<grpc::Slice> slices;
  if (!response_buf.Dump(&slices).ok()) return absl::InternalError("health: unreadable response");
  std::string resp;
  for (const auto& s : slices) resp.append(reinterpret_cast<const char*>(s.begin()), s.size());
  // The response is empty (status 0 = UNKNOWN) or holds field 1 as a one-byte varint.
  int serving_status = 0;
  if (resp.size() >= 2 && resp[0] == 0x08) serving_status = static_cast<unsigned char>(resp[1]);
  static constexpr const char* kNames[] = {"UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN"};
  if (serving_status == 1) return absl::OkStatus();
  return absl::UnavailableError(
      absl::StrCat("health: '", service, "' is ", serving_status < 4 ? kNames[serving_status] : "an unknown status"));
}

}  // namespace attnd::client
