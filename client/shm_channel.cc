#include "attnd/client/shm_channel.h"

#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace attnd::client {
namespace {

constexpr absl::Duration kPoll = absl::Milliseconds(20);

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
  auto fail = [&](absl::Status st) {
    ::close(s);
    ::close(*memfd);
    return st;
  };
  const shm::Hello hello{shm::kMagic, shm::kVersion, static_cast<uint32_t>(options.auth_token.size()), 0};
  if (absl::Status st = shm::SendWithFd(s, &hello, sizeof(hello), *memfd); !st.ok()) return fail(st);
  if (!options.auth_token.empty()) {
    if (absl::Status st = shm::SendAll(s, options.auth_token.data(), options.auth_token.size()); !st.ok()) return fail(st);
  }
  shm::HelloReply reply{};
  if (absl::Status st = shm::ReceiveAll(s, &reply, sizeof(reply)); !st.ok()) return fail(st);
  if (reply.status_code != 0) {
    std::string message(std::min(reply.message_bytes, shm::kMaxHelloMessageBytes), '\0');
    if (!message.empty()) (void)shm::ReceiveAll(s, message.data(), message.size());
    return fail(absl::Status(static_cast<absl::StatusCode>(reply.status_code), message));
  }
  absl::StatusOr<shm::Mapping> m = shm::MapClientSide(*memfd);
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

absl::StatusOr<v1::ForwardResponse> ShmChannel::Forward(const v1::ForwardRequest& request, absl::Duration timeout) {
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
  shm::Publish(&h->state, shm::kRequest, &h->server_sleeping);
  const absl::Time deadline = timeout == absl::InfiniteDuration() ? absl::InfiniteFuture() : absl::Now() + timeout;
  bool gone = false;
  const bool replied = shm::AwaitState(&h->state, shm::kReply, &h->client_sleeping, options_.spin, deadline, kPoll,
                                       [&] { return gone = ServerGone(socket_); });
  if (!replied) {
    broken_ = true;
    return gone ? absl::UnavailableError("shm channel: the server closed the channel before replying")
                : absl::DeadlineExceededError("shm channel: no reply before the timeout");
  }
  const uint64_t bytes = std::min<uint64_t>(h->reply_bytes, map_.reply_capacity);
  const auto code = static_cast<absl::StatusCode>(h->status_code);
  if (code != absl::StatusCode::kOk) {
    return absl::Status(code, std::string(reinterpret_cast<const char*>(map_.reply()), bytes));
  }
  v1::ForwardResponse response;
  if (!response.ParseFromArray(map_.reply(), static_cast<int>(bytes))) {
    return absl::InternalError("shm channel: unparseable reply");
  }
  return response;
}

}  // namespace attnd::client
