#include "attnd/transport/shm_channel.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <new>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace attnd::shm {

void FutexWait(std::atomic<uint32_t>* word, uint32_t current, absl::Duration timeout) {
  if (timeout <= absl::ZeroDuration()) return;
  const timespec ts = absl::ToTimespec(timeout);
  // Not FUTEX_PRIVATE_FLAG: the word is in memory shared with another process.
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, current, &ts, nullptr, 0);
}

void FutexWakeAll(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

absl::StatusOr<int> CreateChannelMemfd(uint64_t request_capacity, uint64_t reply_capacity) {
  if (request_capacity > kMaxAreaBytes || reply_capacity > kMaxAreaBytes) {
    return absl::InvalidArgumentError("shm channel: request/reply capacity above 1 TiB");
  }
  const uint64_t bytes = ChannelBytes(request_capacity, reply_capacity);
  const int fd = static_cast<int>(syscall(SYS_memfd_create, "attnd-shm-channel", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (fd < 0) return absl::UnavailableError(absl::StrCat("memfd_create: ", std::strerror(errno)));
  auto fail = [fd](const char* what) {
    const int e = errno;
    ::close(fd);
    return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(e)));
  };
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) return fail("ftruncate");
  // The server maps it: a later shrink would turn its reads into SIGBUS, so the size is sealed.
  if (::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) return fail("sealing the memfd");
  void* p = ::mmap(nullptr, kHeaderBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return fail("mmap");
  Header* h = new (p) Header{};
  h->magic = kMagic;
  h->version = kVersion;
  h->request_capacity = request_capacity;
  h->reply_capacity = reply_capacity;
  ::munmap(p, kHeaderBytes);
  return fd;
}

absl::StatusOr<Mapping> MapServerSide(int fd, uint64_t max_area_bytes) {
  const int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0) return absl::InvalidArgumentError("shm channel: the descriptor is not a memfd");
  if ((seals & F_SEAL_SHRINK) == 0 || (seals & F_SEAL_GROW) == 0) {
    return absl::InvalidArgumentError("shm channel: the memfd must be sealed against shrinking and growing");
  }
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) return absl::InvalidArgumentError("shm channel: not a regular memfd");
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < kHeaderBytes) return absl::InvalidArgumentError("shm channel: smaller than its header");
  Header probe;
  if (::pread(fd, &probe, offsetof(Header, state), 0) != static_cast<ssize_t>(offsetof(Header, state))) {
    return absl::InvalidArgumentError("shm channel: unreadable header");
  }
  if (probe.magic != kMagic) {
    return absl::InvalidArgumentError(absl::StrFormat("shm channel: bad magic 0x%08x in the memfd's header (expected 0x%08x)",
                                                      probe.magic, kMagic));
  }
  if (probe.version != kVersion) {
    return absl::InvalidArgumentError(absl::StrCat("shm channel: the memfd's header is version ", probe.version,
                                                   ", this server speaks ", kVersion));
  }
  max_area_bytes = std::min(max_area_bytes, kMaxAreaBytes);
  if (probe.request_capacity > max_area_bytes || probe.reply_capacity > max_area_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("shm channel: request/reply areas of ", probe.request_capacity,
                                                     " / ", probe.reply_capacity, " bytes exceed --shm_max_bytes=",
                                                     max_area_bytes));
  }
  if (size != ChannelBytes(probe.request_capacity, probe.reply_capacity)) {
    return absl::InvalidArgumentError(absl::StrCat("shm channel: memfd of ", size, " bytes, its header says ",
                                                   ChannelBytes(probe.request_capacity, probe.reply_capacity)));
  }
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return absl::UnavailableError(absl::StrCat("shm channel: mmap: ", std::strerror(errno)));
  return Mapping{static_cast<Header*>(p), size, probe.request_capacity, probe.reply_capacity};
}

absl::Status ReadRequest(const Mapping& m, uint64_t request_bytes, v1::ForwardRequest* request) {
  if (request_bytes > m.request_capacity) {
    return absl::InvalidArgumentError(absl::StrCat("request_bytes: ", request_bytes,
                                                   " exceeds the channel's request area (", m.request_capacity,
                                                   " bytes)"));
  }
  // Copied out first: the caller can write to the mapping while protobuf reads it.
  const std::string bytes(reinterpret_cast<const char*>(m.request()), request_bytes);
  if (!request->ParseFromString(bytes)) {
    return absl::InvalidArgumentError("request: not a ForwardRequest (unparseable)");
  }
  return absl::OkStatus();
}

absl::StatusOr<Mapping> MapClientSide(int fd, uint64_t request_capacity, uint64_t reply_capacity) {
  const uint64_t size = ChannelBytes(request_capacity, reply_capacity);
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return absl::UnavailableError(absl::StrCat("mmap: ", std::strerror(errno)));
  return Mapping{static_cast<Header*>(p), size, request_capacity, reply_capacity};
}

absl::Status SendWithFd(int socket, const void* data, size_t bytes, int fd) {
  iovec iov{const_cast<void*>(data), bytes};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  if (fd >= 0) {
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  }
  ssize_t n;
  do {
    n = ::sendmsg(socket, &msg, MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  if (n != static_cast<ssize_t>(bytes)) return absl::UnavailableError("shm channel: socket send failed");
  return absl::OkStatus();
}

absl::Status ReceiveWithFd(int socket, void* data, size_t bytes, int* fd) {
  *fd = -1;
  iovec iov{data, bytes};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  // Room for more descriptors than a hello may carry: every one that arrives is seen (and closed unless it is the
  // one kept), and only a sender of more than this many gets MSG_CTRUNC, whose excess the kernel closes itself.
  constexpr size_t kRoomForFds = 16;
  alignas(cmsghdr) char control[CMSG_SPACE(kRoomForFds * sizeof(int))] = {};
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  ssize_t n;
  do {
    n = ::recvmsg(socket, &msg, MSG_CMSG_CLOEXEC | MSG_WAITALL);
  } while (n < 0 && errno == EINTR);
  std::vector<int> received;
  if (n >= 0) {
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS || c->cmsg_len < CMSG_LEN(0)) continue;
      const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int f;
        std::memcpy(&f, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        received.push_back(f);
      }
    }
  }
  const auto close_all = [&received] {
    for (const int f : received) ::close(f);
  };
  if (n != static_cast<ssize_t>(bytes) || (msg.msg_flags & MSG_CTRUNC) != 0) {
    close_all();
    return absl::UnavailableError("shm channel: short or truncated hello");
  }
  if (received.size() > 1) {
    close_all();
    return absl::InvalidArgumentError(
        absl::StrCat("shm channel: the hello carried ", received.size(), " descriptors; it carries exactly one memfd"));
  }
  if (!received.empty()) *fd = received.front();
  return absl::OkStatus();
}

absl::Status SendAll(int socket, const void* data, size_t bytes) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::send(socket, p, bytes, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return absl::UnavailableError("shm channel: socket send failed");
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status ReceiveAll(int socket, void* data, size_t bytes) {
  char* p = static_cast<char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::recv(socket, p, bytes, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return absl::UnavailableError("shm channel: the peer closed the socket");
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

}  // namespace attnd::shm
