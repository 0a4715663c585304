#include "attnd/client/shm_channel.h"

#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace attnd::client {
namespace {

constexpr absl::Duration kPoll = absl::Milliseconds(20);
// Calls of this process waiting for their replies now, and how many of them may poll past `spin`.
std::atomic<int> g_polling{0};
constexpr int kLongPollersAtMost = 2;

bool ServerGone(int socket) {
  pollfd p{socket, POLLIN | POLLRDHUP, 0};
  if (::poll(&p, 1, 0) <= 0) return false;
  return (p.revents & (POLLHUP | POLLRDHUP | POLLERR | POLLNVAL | POLLIN)) != 0;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ShmChannel>> ShmChannel::Connect(const ShmChannelOptions& options) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (options.socket_path.empty() || options.socket_path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("shm socket path '", options.socket_path, "' is empty or too long"));
  }
  std::memcpy(addr.sun_path, options.socket_path.c_str(), options.socket_path.size() + 1);
  absl::StatusOr<int> memfd = shm::CreateChannelMemfd(options.request_capacity, options.reply_capacity);
  if (!memfd.ok()) return memfd.status();
  const int s = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0 || ::connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    const std::string why = std::strerror(errno);
    if (s >= 0) ::close(s);
    ::close(*memfd);
    return absl::UnavailableError(absl::StrCat("shm channel: cannot connect to ", options.socket_path, ": ", why));
  }
  // A server that accepted (the listen backlog) but never answers must not hold the caller for ever.
  const timeval handshake_timeout{5, 0};
  ::setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &handshake_timeout, sizeof(handshake_timeout));
  auto fail = [&](absl::Status st) {
    ::close(s);
    ::close(*memfd);
    return st;
  };
  // The server's answer: OK or its refusal; *answered false when none could be read (the read's error).
  auto answer = [&](bool* answered) {
    shm::HelloReply reply{};
    absl::Status got = shm::ReceiveAll(s, &reply, sizeof(reply));
    *answered = got.ok();
    if (!got.ok() || reply.status_code == 0) return got;
    std::string message(std::min(reply.message_bytes, shm::kMaxHelloMessageBytes), '\0');
    if (!message.empty()) (void)shm::ReceiveAll(s, message.data(), message.size());
    return absl::Status(static_cast<absl::StatusCode>(reply.status_code), message);
  };
  const shm::Hello hello{shm::kMagic, shm::kVersion, static_cast<uint32_t>(options.auth_token.size()), 0};
  absl::Status sent = shm::SendWithFd(s, &hello, sizeof(hello), *memfd);
  if (sent.ok() && !options.auth_token.empty()) sent = shm::SendAll(s, options.auth_token.data(), options.auth_token.size());
  bool answered = false;
  if (!sent.ok()) {
    // A server that refuses at once (--shm_max_channels reached) answers and closes without reading the hello,
    // so the send can fail with the refusal already waiting to be read: that is the reason to report.
    const absl::Status refusal = answer(&answered);
    return fail(answered && !refusal.ok() ? refusal : sent);
  }
  if (absl::Status st = answer(&answered); !st.ok()) return fail(st);
  absl::StatusOr<shm::Mapping> m = shm::MapClientSide(*memfd, options.request_capacity, options.reply_capacity);
  ::close(*memfd);
  if (!m.ok()) {
    ::close(s);
    return m.status();
  }
  return std::unique_ptr<ShmChannel>(new ShmChannel(options, s, *m));
}

ShmChannel::~ShmChannel() {
  ::munmap(map_.header, map_.bytes);
  ::close(socket_);
}

absl::Status ShmChannel::Call(shm::RequestKind kind, const google::protobuf::MessageLite& request,
                              google::protobuf::MessageLite* response, absl::Duration timeout) {
  if (broken_) return absl::FailedPreconditionError("shm channel: an earlier call was abandoned; open a new channel");
  const size_t n = request.ByteSizeLong();
  if (n > map_.request_capacity) {
    return absl::ResourceExhaustedError(absl::StrCat("request: ", n, " bytes do not fit the channel's request area of ",
                                                     map_.request_capacity, " bytes (ShmChannelOptions::request_capacity)"));
  }
  if (!request.SerializeToArray(map_.request(), static_cast<int>(n))) {
    return absl::InternalError("request: serialization failed");
  }
  shm::Header* h = map_.header;
  h->request_bytes = n;
  h->kind = kind;
  const absl::Time sent = absl::Now();
  shm::Publish(&h->state, shm::kRequest, &h->server_sleeping);
  const absl::Time deadline = timeout == absl::InfiniteDuration() ? absl::InfiniteFuture() : sent + timeout;
  // Poll about as long as the last call took while few calls wait (ShmChannelOptions::long_spin says why).
  absl::Duration spin = options_.spin;
  if (g_polling.fetch_add(1, std::memory_order_relaxed) < kLongPollersAtMost) {
    spin = std::max(spin, std::min(options_.long_spin, last_call_ * 3 / 2));
  }
  bool gone = false;
  const bool replied = shm::AwaitState(&h->state, shm::kReply, &h->client_sleeping, spin, deadline, kPoll,
                                       [&] { return gone = ServerGone(socket_); });
  g_polling.fetch_sub(1, std::memory_order_relaxed);
  last_call_ = absl::Now() - sent;
  if (!replied) {
    broken_ = true;
    return gone ? absl::UnavailableError("shm channel: the server closed the channel before replying")
                : absl::DeadlineExceededError("shm channel: no reply before the timeout");
  }
  const uint64_t bytes = std::min<uint64_t>(h->reply_bytes, map_.reply_capacity);
  const int32_t raw = h->status_code;
  if (raw < 0 || raw > static_cast<int32_t>(absl::StatusCode::kUnauthenticated)) {
    return absl::InternalError(absl::StrCat("shm channel: the reply carries an unknown status code ", raw));
  }
  const auto code = static_cast<absl::StatusCode>(raw);
  if (code != absl::StatusCode::kOk) {
    return absl::Status(code, std::string(reinterpret_cast<const char*>(map_.reply()), bytes));
  }
  if (!response->ParseFromArray(map_.reply(), static_cast<int>(bytes))) {
    return absl::InternalError("shm channel: unparseable reply");
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::ForwardResponse> ShmChannel::Forward(const v1::ForwardRequest& request, absl::Duration timeout) {
  v1::ForwardResponse response;
  if (absl::Status s = Call(shm::kForwardRequest, request, &response, timeout); !s.ok()) return s;
  return response;
}

absl::StatusOr<v1::StepResponse> ShmChannel::Step(const v1::StepRequest& request, absl::Duration timeout) {
  v1::StepResponse response;
  if (absl::Status s = Call(shm::kStepRequest, request, &response, timeout); !s.ok()) return s;
  return response;
}

absl::StatusOr<ForwardResult> ForwardOverShm(ShmChannel& channel, const v1::ForwardRequest& request,
                                             absl::Duration timeout) {
  const absl::Time start = absl::Now();
  absl::StatusOr<v1::ForwardResponse> r = channel.Forward(request, timeout);
  if (!r.ok()) return r.status();
  ForwardResult res;
  res.request_id = std::move(*r->mutable_request_id());
  res.o = std::move(*r->mutable_o());
  res.lse = std::move(*r->mutable_lse());
  res.timing = r->timing();
  res.backend = std::move(*r->mutable_backend());
  res.kernel = std::move(*r->mutable_kernel());
  res.device = r->device();
  res.transport = Transport::kShm;
  res.latency = absl::Now() - start;
  for (const v1::TensorInput* t : {&request.q(), &request.k(), &request.v()}) {
    if (t->source_case() == v1::TensorInput::kData) res.bytes_sent += t->data().size();
  }
  res.bytes_received = res.o.size() + res.lse.size();
  if (absl::Status sizes = CheckReplySizes(request, res); !sizes.ok()) return sizes;
  return res;
}

absl::StatusOr<StepResult> StepOverShm(ShmChannel& channel, const v1::StepRequest& request, absl::Duration timeout) {
  const absl::Time start = absl::Now();
  absl::StatusOr<v1::StepResponse> r = channel.Step(request, timeout);
  if (!r.ok()) return r.status();
  return StepResultOf(request, *std::move(r), Transport::kShm, start);
}

uint64_t StepReplyBytes(const v1::StepRequest& request) {
  uint64_t rows = 0;
  for (const auto& s : request.sequences()) rows += static_cast<uint64_t>(std::max<int64_t>(s.tokens(), 0));
  uint64_t n = 4096 + 16 * static_cast<uint64_t>(request.sequences_size()) + request.request_id().size();
  // O has Q's size; with Q in a registered buffer its size is unknown here, so the area's limit decides.
  if (request.q().source_case() == v1::TensorInput::kData && !request.has_o_ref()) n += request.q().data().size();
  if (request.q().has_ref() && !request.has_o_ref()) n += shm::kMaxAreaBytes;
  if (request.return_lse()) n += rows * static_cast<uint64_t>(std::max<int64_t>(request.q_heads(), 0)) * 4;
  return n;
}

}  // namespace attnd::client
