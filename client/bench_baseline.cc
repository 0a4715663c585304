// The yardsticks a bench report sets its latencies against: a plain TCP loopback transfer of the same bytes,
// and the service's RPC floor on the same channel.
#include "attnd/client/bench.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace attnd::client {

namespace {

absl::Status Errno(const char* what) {
  return absl::UnavailableError(absl::StrCat("tcp loopback baseline: ", what, ": ", std::strerror(errno)));
}

// Closes a socket on every path out.
struct Fd {
  explicit Fd(int f) : fd(f) {}
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int fd;
};

bool SendAll(int fd, const char* p, uint64_t n) {
  while (n > 0) {
    const ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= static_cast<uint64_t>(w);
  }
  return true;
}

bool RecvAll(int fd, char* p, uint64_t n) {
  while (n > 0) {
    const ssize_t r = ::recv(fd, p, n, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= static_cast<uint64_t>(r);
  }
  return true;
}

}  // namespace

absl::StatusOr<double> MeasureTcpLoopback(uint64_t up, uint64_t down, int iters) {
  if (iters < 1) return absl::InvalidArgumentError("tcp loopback baseline: iters must be >= 1");
  Fd listener(::socket(AF_INET, SOCK_STREAM, 0));
  if (listener.fd < 0) return Errno("socket");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  if (::bind(listener.fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) return Errno("bind");
  if (::listen(listener.fd, 1) != 0) return Errno("listen");
  if (::getsockname(listener.fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return Errno("getsockname");
  Fd client(::socket(AF_INET, SOCK_STREAM, 0));
  if (client.fd < 0) return Errno("socket");
  if (::connect(client.fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) return Errno("connect");
  Fd peer(::accept(listener.fd, nullptr, nullptr));
  if (peer.fd < 0) return Errno("accept");
  const int one = 1;
  // Like gRPC's own sockets: the last segment of each direction leaves at once.
  ::setsockopt(client.fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  ::setsockopt(peer.fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  const int rounds = iters + 2;
  std::thread server([&peer, up, down, rounds] {
    std::string in(up, '\0'), out(down, 'o');
    for (int i = 0; i < rounds; ++i) {
      if (!RecvAll(peer.fd, in.data(), up) || !SendAll(peer.fd, out.data(), down)) break;
    }
    ::shutdown(peer.fd, SHUT_RDWR);
  });
  std::string out(up, 'q'), in(down, '\0');
  std::vector<double> lat;
  bool ok = true;
  for (int i = 0; i < rounds && ok; ++i) {
    const absl::Time t0 = absl::Now();
    ok = SendAll(client.fd, out.data(), up) && RecvAll(client.fd, in.data(), down);
    if (ok && i >= 2) lat.push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));
  }
  ::shutdown(client.fd, SHUT_RDWR);
  server.join();
  if (!ok) return absl::UnavailableError("tcp loopback baseline: the transfer failed");
  std::sort(lat.begin(), lat.end());
  return Percentile(lat, 50);
}

absl::StatusOr<double> MeasureRpcFloor(Client& client, int calls) {
  if (calls < 1) return absl::InvalidArgumentError("rpc floor: calls must be >= 1");
  std::vector<double> lat;
  for (int i = 0; i < calls + 50; ++i) {
    const absl::Time t0 = absl::Now();
    absl::StatusOr<v1::ServerStats> stats = client.Stats();
    if (!stats.ok()) {
      return absl::Status(stats.status().code(), absl::StrCat("rpc floor: GetStats: ", stats.status().message()));
    }
    if (i >= 50) lat.push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));
  }
  std::sort(lat.begin(), lat.end());
  return Percentile(lat, 50);
}

}  // namespace attnd::client
