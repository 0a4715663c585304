// The shared-memory channel's hello as the server receives it (shm::ReceiveWithFd, transport/shm_channel.cc):
// any bytes, cut short or not, with zero to four descriptors attached as SCM_RIGHTS in one or two control
// messages. Whatever arrives, the server must end up holding at most the one descriptor it hands back, and
// none when it refuses: every descriptor the process holds after the call (and after closing the one returned)
// must have been there before it.
// Input: how many descriptors and in how many messages, how many bytes to send; then the bytes.
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "attnd/transport/shm_channel.h"
#include "fuzz_util.h"

namespace shm = attnd::shm;

namespace {

// Sends `bytes` with `fds` attached, split over `messages` control messages (1 or 2).
void SendWithFds(int socket, const std::string& bytes, const std::vector<int>& fds, int messages) {
  iovec iov{const_cast<char*>(bytes.data()), bytes.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[2 * CMSG_SPACE(4 * sizeof(int))] = {};
  if (!fds.empty()) {
    const size_t first = messages == 1 ? fds.size() : (fds.size() + 1) / 2;
    const size_t counts[2] = {first, fds.size() - first};
    msg.msg_control = control;
    msg.msg_controllen = 0;
    for (size_t i = 0; i < 2; ++i) msg.msg_controllen += counts[i] > 0 ? CMSG_SPACE(counts[i] * sizeof(int)) : 0;
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    size_t at = 0;
    for (size_t count : counts) {
      if (count == 0) continue;
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(count * sizeof(int));
      std::memcpy(CMSG_DATA(c), fds.data() + at, count * sizeof(int));
      at += count;
      c = CMSG_NXTHDR(&msg, c);
    }
  }
  // An empty message without descriptors sends nothing: then the peer sees only the close.
  if (!bytes.empty() || !fds.empty()) ATTND_FUZZ_CHECK(::sendmsg(socket, &msg, MSG_NOSIGNAL) >= 0);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  const int nfds = in.ConsumeIntegralInRange<int>(0, 4);
  const int messages = in.ConsumeIntegralInRange<int>(1, 2);
  const size_t nbytes = in.ConsumeIntegralInRange<size_t>(0, 2 * sizeof(shm::Hello));
  std::string bytes = in.ConsumeBytesAsString(nbytes);

  int pair[2];
  ATTND_FUZZ_CHECK(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) == 0);
  const int before = attnd::fuzz::OpenDescriptors();
  std::vector<int> fds;
  for (int i = 0; i < nfds; ++i) fds.push_back(::dup(pair[1]));
  SendWithFds(pair[1], bytes, fds, messages);
  for (int fd : fds) ::close(fd);  // in flight, the kernel holds its own references
  ::shutdown(pair[1], SHUT_WR);

  shm::Hello hello{};
  int received = -1;
  const absl::Status s = shm::ReceiveWithFd(pair[0], &hello, sizeof(hello), &received);
  if (!s.ok()) ATTND_FUZZ_CHECK(received == -1);
  if (received >= 0) ::close(received);
  const int after = attnd::fuzz::OpenDescriptors();
  ::close(pair[0]);
  ::close(pair[1]);
  if (after != before) {
    std::fprintf(stderr, "%d descriptor(s) leaked: %d sent in %d message(s), %zu bytes, status %s\n", after - before,
                 nfds, messages, bytes.size(), s.ToString().c_str());
  }
  ATTND_FUZZ_CHECK(after == before);
  return 0;
}
