#include "listener_guard.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <unordered_map>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "attnd/server/server.h"

namespace attnd::server {

struct ListenerGuard::State {
  explicit State(ListenerGuardOptions o) : options(std::move(o)) {}
  const ListenerGuardOptions options;
  std::atomic<uint64_t> refused{0};
  std::atomic<bool> lost_reported{false};
  absl::Mutex mu;
  // Accepted connections by descriptor, with the socket's inode: a descriptor gRPC has closed (or that now names
  // something else) is found by fstat and dropped, so no hook on close is needed.
  std::unordered_map<int, ino_t> connections ABSL_GUARDED_BY(mu);
  absl::Time last_prune ABSL_GUARDED_BY(mu) = absl::InfinitePast();
};

namespace {

// Checking every tracked descriptor costs one fstat each: at the cap this is done at most this often, and the
// connections arriving in between are refused.
constexpr absl::Duration kPruneInterval = absl::Milliseconds(100);

int SysAccept4(int fd, sockaddr* addr, socklen_t* len, int flags) {
  return static_cast<int>(::syscall(SYS_accept4, fd, addr, len, flags));
}

struct Registry {
  absl::Mutex mu;
  std::unordered_map<int, std::shared_ptr<ListenerGuard::State>> listeners ABSL_GUARDED_BY(mu);
  absl::Mutex reserve_mu;
  int reserve ABSL_GUARDED_BY(reserve_mu) = -1;  // /dev/null, closed to make room for shedding
};

Registry& Reg() {
  static Registry* r = new Registry();  // never destroyed: gRPC's threads may accept until the process ends
  return *r;
}

void TakeReserve() ABSL_EXCLUSIVE_LOCKS_REQUIRED(Reg().reserve_mu) {
  if (Reg().reserve < 0) Reg().reserve = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
}

// At the descriptor limit: frees the reserve, accepts and closes every pending connection (each client sees its
// connection end instead of waiting in the backlog), and takes the reserve again.
void ShedPending(int listen_fd, ListenerGuard::State& state) {
  absl::MutexLock lock(&Reg().reserve_mu);
  for (;;) {
    if (Reg().reserve >= 0) {
      ::close(Reg().reserve);
      Reg().reserve = -1;
    }
    const int c = SysAccept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
    if (c >= 0) ::close(c);
    TakeReserve();
    if (c < 0) break;
    state.refused.fetch_add(1, std::memory_order_relaxed);
    if (state.options.on_refused) state.options.on_refused();
  }
}

bool SameSocket(int fd, ino_t ino) {
  struct stat st;
  return ::fstat(fd, &st) == 0 && S_ISSOCK(st.st_mode) && st.st_ino == ino;
}

// Whether connection `fd` may stay: under the cap it is tracked and kept.
bool Admit(int fd, ListenerGuard::State& state) {
  const uint32_t cap = state.options.max_connections;
  struct stat st;
  const ino_t ino = ::fstat(fd, &st) == 0 ? st.st_ino : 0;
  absl::MutexLock lock(&state.mu);
  state.connections.erase(fd);  // a descriptor number gRPC closed and the kernel handed out again
  if (cap > 0 && state.connections.size() >= cap) {
    const absl::Time now = absl::Now();
    if (now - state.last_prune >= kPruneInterval) {
      state.last_prune = now;
      for (auto it = state.connections.begin(); it != state.connections.end();) {
        it = SameSocket(it->first, it->second) ? std::next(it) : state.connections.erase(it);
      }
    }
    if (state.connections.size() >= cap) return false;
  }
  state.connections.emplace(fd, ino);
  return true;
}

int GuardedAccept(int fd, sockaddr* addr, socklen_t* len, int flags) {
  std::shared_ptr<ListenerGuard::State> state;
  {
    absl::ReaderMutexLock lock(&Reg().mu);
    auto it = Reg().listeners.find(fd);
    if (it != Reg().listeners.end()) state = it->second;
  }
  if (state == nullptr) return SysAccept4(fd, addr, len, flags);
  for (;;) {
    const int c = SysAccept4(fd, addr, len, flags);
    if (c >= 0) {
      if (Admit(c, *state)) return c;
      ::close(c);
      state->refused.fetch_add(1, std::memory_order_relaxed);
      if (state->options.on_refused) state->options.on_refused();
      continue;  // the next pending one: gRPC re-arms only after EAGAIN, and no new edge comes for the backlog
    }
    const int err = errno;
    switch (err) {
      case EAGAIN:
#if EWOULDBLOCK != EAGAIN
      case EWOULDBLOCK:
#endif
      case EINTR:
      case ECONNABORTED:
        break;
      case EMFILE:
      case ENFILE:
        ShedPending(fd, *state);
        errno = EAGAIN;
        break;
      case ENOBUFS:
      case ENOMEM:
        errno = EAGAIN;
        break;
      default:
        if (!state->lost_reported.exchange(true) && state->options.on_lost) state->options.on_lost(err);
        errno = err;
        break;
    }
    return -1;
  }
}

bool IsListening(int fd) {
  int on = 0;
  socklen_t len = sizeof(on);
  return ::getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &on, &len) == 0 && on != 0;
}

bool BoundTo(int fd, int tcp_port, const std::string& unix_path) {
  sockaddr_storage addr;
  socklen_t len = sizeof(addr);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return false;
  if (tcp_port > 0 && addr.ss_family == AF_INET) {
    return ntohs(reinterpret_cast<const sockaddr_in*>(&addr)->sin_port) == tcp_port;
  }
  if (tcp_port > 0 && addr.ss_family == AF_INET6) {
    return ntohs(reinterpret_cast<const sockaddr_in6*>(&addr)->sin6_port) == tcp_port;
  }
  if (!unix_path.empty() && addr.ss_family == AF_UNIX) {
    const auto* un = reinterpret_cast<const sockaddr_un*>(&addr);
    const size_t n = len > offsetof(sockaddr_un, sun_path) ? len - offsetof(sockaddr_un, sun_path) : 0;
    return unix_path == std::string(un->sun_path, strnlen(un->sun_path, n));
  }
  return false;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ListenerGuard>> ListenerGuard::Install(int tcp_port, const std::string& unix_path,
                                                                      ListenerGuardOptions options) {
  std::vector<int> fds;
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return absl::FailedPreconditionError("listener guard: /proc/self/fd cannot be read");
  while (dirent* e = ::readdir(dir)) {
    int fd;
    if (!absl::SimpleAtoi(e->d_name, &fd) || fd == ::dirfd(dir)) continue;
    if (IsListening(fd) && BoundTo(fd, tcp_port, unix_path)) fds.push_back(fd);
  }
  ::closedir(dir);
  if (fds.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("listener guard: no listening socket on port ", tcp_port, " or at '", unix_path, "'"));
  }
  auto state = std::make_shared<State>(std::move(options));
  {
    absl::MutexLock lock(&Reg().reserve_mu);
    TakeReserve();
  }
  absl::MutexLock lock(&Reg().mu);
  for (int fd : fds) Reg().listeners[fd] = state;
  return std::unique_ptr<ListenerGuard>(new ListenerGuard(std::move(fds), std::move(state)));
}

ListenerGuard::ListenerGuard(std::vector<int> fds, std::shared_ptr<State> state)
    : fds_(std::move(fds)), state_(std::move(state)) {}

ListenerGuard::~ListenerGuard() {
  absl::MutexLock lock(&Reg().mu);
  for (int fd : fds_) {
    auto it = Reg().listeners.find(fd);
    if (it != Reg().listeners.end() && it->second == state_) Reg().listeners.erase(it);
  }
}

uint64_t ListenerGuard::refused() const { return state_->refused.load(std::memory_order_relaxed); }

uint64_t RaiseDescriptorLimit() {
  rlimit rl;
  if (::getrlimit(RLIMIT_NOFILE, &rl) != 0) return 0;
  if (rl.rlim_cur != rl.rlim_max) {
    rlimit raised = rl;
    raised.rlim_cur = rl.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) rl = raised;
  }
  return rl.rlim_cur == RLIM_INFINITY ? UINT64_MAX : rl.rlim_cur;
}

uint64_t DescriptorLimit() {
  rlimit rl;
  if (::getrlimit(RLIMIT_NOFILE, &rl) != 0) return 0;
  return rl.rlim_cur == RLIM_INFINITY ? UINT64_MAX : rl.rlim_cur;
}

uint32_t DefaultMaxConnections(uint64_t descriptor_limit) {
  const uint64_t cap = descriptor_limit - descriptor_limit / 8;
  return static_cast<uint32_t>(std::clamp<uint64_t>(cap, 1, UINT32_MAX));
}

}  // namespace attnd::server

// The accept4 gRPC's listeners call (see listener_guard.h); the system call itself for every other socket.
extern "C" int accept4(int fd, sockaddr* addr, socklen_t* len, int flags) {
  return attnd::server::GuardedAccept(fd, addr, len, flags);
}
