// The same-host shared-memory channel (--shm_socket; attnd/transport/shm_channel.h): Forward without gRPC. Runs on the CPU
// backend with inline tensors (the channel carries any ForwardRequest that fits its areas), so it needs no GPU:
// correct answers, errors with the field named, a reply too large for the channel, refused handshakes (token,
// unsealed or mis-sized memfd, too many channels), many channels at once, a caller that vanishes mid-request,
// and a shutdown that still answers the request it holds; hand-made hellos with several descriptors or a bad
// magic, and a caller at the server's descriptor limit.
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "attnd/client/shm_channel.h"
#include "attnd/transport/shm_channel.h"
#include "gtest/gtest.h"
#include "server_test_util.h"

namespace attnd {
namespace {

using client::ShmChannel;
using client::ShmChannelOptions;
using testing::ExpectCorrect;
using testing::Gate;
using testing::MakeRequest;
using testing::TestServer;
using testing::WaitFor;

std::string SocketPath(const char* tag) {
  return absl::StrCat(::testing::TempDir(), "attnd_shm_", tag, "_", ::getpid(), ".sock");
}

server::ServerOptions WithShm(const std::string& path) {
  server::ServerOptions o;
  o.shm.socket = path;
  return o;
}

ShmChannelOptions Opts(const std::string& path) {
  ShmChannelOptions o;
  o.socket_path = path;
  return o;
}

TEST(ShmChannel, ForwardMatchesTheReference) {
  const std::string path = SocketPath("fwd");
  TestServer ts(WithShm(path));
  ASSERT_NE(ts.server, nullptr);
  auto ch = ShmChannel::Connect(Opts(path));
  ASSERT_TRUE(ch.ok()) << ch.status();
  const struct {
    Shape shape;
    v1::MaskType mask;
    bool lse;
  } cases[] = {{{1, 33, 33, 2, 2, 64}, v1::MASK_TYPE_NONE, false},
               {{2, 17, 40, 4, 2, 128}, v1::MASK_TYPE_CAUSAL_BOTTOM_RIGHT, true},
               {{1, 64, 64, 2, 1, 64}, v1::MASK_TYPE_CAUSAL_TOP_LEFT, true}};
  uint64_t seed = 7;
  for (const auto& c : cases) {
    const v1::ForwardRequest req = MakeRequest(c.shape, c.mask, c.lse, ++seed);
    absl::StatusOr<v1::ForwardResponse> r = (*ch)->Forward(req);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->request_id(), req.request_id());
    EXPECT_EQ(r->backend(), "cpu");
    EXPECT_GT(r->timing().total_us(), 0);
    ExpectCorrect(req, r->o(), r->lse());
  }
}

TEST(ShmChannel, GrpcMessageLimitDoesNotApply) {
  const std::string path = SocketPath("msg");
  server::ServerOptions o = WithShm(path);
  o.limits.max_message_bytes = 64 * 1024;  // the request below is ~200 KB: too large for one gRPC message
  TestServer ts(o);
  auto ch = ShmChannel::Connect(Opts(path));
  ASSERT_TRUE(ch.ok()) << ch.status();
  const v1::ForwardRequest req = MakeRequest({1, 256, 256, 2, 2, 64}, v1::MASK_TYPE_NONE, false, 11);
  ASSERT_GT(req.ByteSizeLong(), o.limits.max_message_bytes);
  absl::StatusOr<v1::ForwardResponse> r = (*ch)->Forward(req);
  ASSERT_TRUE(r.ok()) << r.status();
  ExpectCorrect(req, r->o(), r->lse());
}

TEST(ShmChannel, BadRequestsGetTheFieldNamed) {
  const std::string path = SocketPath("bad");
  TestServer ts(WithShm(path));
  auto ch = ShmChannel::Connect(Opts(path));
  ASSERT_TRUE(ch.ok()) << ch.status();
  v1::ForwardRequest req = MakeRequest({1, 16, 16, 2, 2, 64});
  req.mutable_shape()->set_head_dim(96);
  absl::StatusOr<v1::ForwardResponse> r = (*ch)->Forward(req);
  ASSERT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find("head_dim"), std::string::npos) << r.status();
  req = MakeRequest({1, 16, 16, 2, 2, 64});
  req.mutable_k()->mutable_data()->resize(10);
  r = (*ch)->Forward(req);
  ASSERT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find("k"), std::string::npos) << r.status();
  req = MakeRequest({1, 16, 16, 2, 2, 64});
  req.clear_mask();  // no default: refused, not run unmasked
  r = (*ch)->Forward(req);
  ASSERT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_TRUE(absl::StartsWith(r.status().message(), "mask: MASK_TYPE_UNSPECIFIED")) << r.status();
  // The channel stays usable after errors.
  const v1::ForwardRequest good = MakeRequest({1, 16, 16, 2, 2, 64}, v1::MASK_TYPE_NONE, false, 3);
  r = (*ch)->Forward(good);
  ASSERT_TRUE(r.ok()) << r.status();
  ExpectCorrect(good, r->o(), r->lse());
}

TEST(ShmChannel, ReplyLargerThanTheChannelIsResourceExhausted) {
  const std::string path = SocketPath("big");
  TestServer ts(WithShm(path));
  ShmChannelOptions o = Opts(path);
  o.reply_capacity = 4096;  // O of the request below is 64 KiB
  auto ch = ShmChannel::Connect(o);
  ASSERT_TRUE(ch.ok()) << ch.status();
  absl::StatusOr<v1::ForwardResponse> r = (*ch)->Forward(MakeRequest({1, 128, 128, 4, 4, 64}));
  ASSERT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  EXPECT_NE(r.status().message().find("reply area"), std::string::npos) << r.status();
  // And a request larger than the caller's own request area never leaves the caller.
  ShmChannelOptions small = Opts(path);
  small.request_capacity = 1024;
  auto ch2 = ShmChannel::Connect(small);
  ASSERT_TRUE(ch2.ok()) << ch2.status();
  r = (*ch2)->Forward(MakeRequest({1, 64, 64, 2, 2, 64}));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
}

TEST(ShmChannel, HandshakeChecksTokenSealsSizeAndChannelCount) {
  const std::string token_file = absl::StrCat(::testing::TempDir(), "attnd_shm_tokens_", ::getpid());
  std::ofstream(token_file) << "s3cret\n";
  const std::string path = SocketPath("auth");
  server::ServerOptions so = WithShm(path);
  so.security.auth_token_file = token_file;
  so.shm.max_channels = 2;
  so.shm.max_bytes = 1 << 20;
  TestServer ts(so);
  ASSERT_NE(ts.server, nullptr);
  EXPECT_EQ(ShmChannel::Connect(Opts(path)).status().code(), absl::StatusCode::kUnauthenticated);
  ShmChannelOptions o = Opts(path);
  o.auth_token = "wrong";
  EXPECT_EQ(ShmChannel::Connect(o).status().code(), absl::StatusCode::kUnauthenticated);
  o.auth_token = "s3cret";
  o.reply_capacity = 2 << 20;  // over --shm_max_bytes
  EXPECT_EQ(ShmChannel::Connect(o).status().code(), absl::StatusCode::kResourceExhausted);
  o.reply_capacity = 1 << 20;
  auto a = ShmChannel::Connect(o);
  auto b = ShmChannel::Connect(o);
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << " " << b.status();
  absl::Status third = ShmChannel::Connect(o).status();
  EXPECT_EQ(third.code(), absl::StatusCode::kResourceExhausted) << third;
  EXPECT_NE(third.message().find("shm_max_channels"), std::string::npos) << third;
  a->reset();  // a closed channel frees its place
  ASSERT_TRUE(WaitFor([&] { return ShmChannel::Connect(o).ok(); }));

  // A hand-made hello with an unsealed memfd is refused: the caller could shrink it under the server.
  const int fd = static_cast<int>(syscall(SYS_memfd_create, "unsealed", MFD_CLOEXEC));
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, static_cast<off_t>(shm::ChannelBytes(4096, 4096))), 0);
  b->reset();
  const auto hand_hello = [&]() -> int32_t {
    const int s = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path.c_str());
    shm::HelloReply reply{-1, 0};
    const shm::Hello hello{shm::kMagic, shm::kVersion, 6, 0};
    if (::connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
      // A server that refuses at once (too many channels) has answered and closed: the sends may fail then, and
      // the answer is still there to read.
      (void)shm::SendWithFd(s, &hello, sizeof(hello), fd);
      (void)shm::SendAll(s, "s3cret", 6);
      (void)shm::ReceiveAll(s, &reply, sizeof(reply));
    }
    ::close(s);
    return reply.status_code;
  };
  int32_t code = -1;
  // The closed channels' places come back once the server has noticed (it polls every 50 ms).
  ASSERT_TRUE(WaitFor([&] {
    code = hand_hello();
    return code != static_cast<int32_t>(absl::StatusCode::kResourceExhausted);
  }));
  EXPECT_EQ(code, static_cast<int32_t>(absl::StatusCode::kInvalidArgument));
  ::close(fd);
  std::remove(token_file.c_str());
}

// A hello made by hand: `fds` as one SCM_RIGHTS message with it, then `token`. Returns the server's answer.
struct HandReply {
  int32_t code = -1;
  std::string message;
};
HandReply SendHandHello(const std::string& path, const shm::Hello& hello, const std::vector<int>& fds,
                        const std::string& token) {
  HandReply out;
  const int s = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path.c_str());
  if (::connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    iovec iov{const_cast<shm::Hello*>(&hello), sizeof(hello)};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    std::vector<char> control(CMSG_SPACE(fds.size() * sizeof(int)));
    if (!fds.empty()) {
      msg.msg_control = control.data();
      msg.msg_controllen = control.size();
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(fds.size() * sizeof(int));
      std::memcpy(CMSG_DATA(c), fds.data(), fds.size() * sizeof(int));
    }
    (void)::sendmsg(s, &msg, MSG_NOSIGNAL);
    if (!token.empty()) (void)shm::SendAll(s, token.data(), token.size());
    shm::HelloReply reply{-1, 0};
    if (shm::ReceiveAll(s, &reply, sizeof(reply)).ok()) {
      out.code = reply.status_code;
      out.message.resize(std::min(reply.message_bytes, shm::kMaxHelloMessageBytes));
      if (!shm::ReceiveAll(s, out.message.data(), out.message.size()).ok()) out.message.clear();
    }
  }
  ::close(s);
  return out;
}

int OpenDescriptors() {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) n += e.is_symlink() ? 1 : 0;
  return n;
}

TEST(ShmChannel, HelloWithSeveralDescriptorsIsRefusedAndLeaksNone) {
  const std::string path = SocketPath("fds");
  TestServer ts(WithShm(path));
  ASSERT_NE(ts.server, nullptr);
  // Warm: the first channel starts the server's threads (and their descriptors) once.
  ASSERT_TRUE(ShmChannel::Connect(Opts(path)).ok());
  const int before = OpenDescriptors();
  const shm::Hello hello{shm::kMagic, shm::kVersion, 0, 0};
  for (const int count : {2, 3, 2, 16, 40}) {
    std::vector<int> fds;
    for (int i = 0; i < count; ++i) {
      absl::StatusOr<int> fd = shm::CreateChannelMemfd(4096, 4096);
      ASSERT_TRUE(fd.ok()) << fd.status();
      fds.push_back(*fd);
    }
    const HandReply r = SendHandHello(path, hello, fds, "");
    for (const int fd : fds) ::close(fd);
    // More than fit the server's control buffer arrive truncated: refused as such, the excess closed by the kernel.
    const int32_t want = count <= 16 ? static_cast<int32_t>(absl::StatusCode::kInvalidArgument)
                                     : static_cast<int32_t>(absl::StatusCode::kUnavailable);
    EXPECT_EQ(r.code, want) << count << " descriptors: " << r.message;
    if (count <= 16) {
      EXPECT_NE(r.message.find("descriptors"), std::string::npos) << r.message;
    }
  }
  // The server closes its copies before it answers; its channel thread (and socket) may take a moment to go.
  EXPECT_TRUE(WaitFor([&] { return OpenDescriptors() <= before; })) << OpenDescriptors() << " open, " << before
                                                                    << " before";
  EXPECT_TRUE(ShmChannel::Connect(Opts(path)).ok());
}

TEST(ShmChannel, BadMagicIsNamed) {
  const std::string path = SocketPath("magic");
  TestServer ts(WithShm(path));
  ASSERT_NE(ts.server, nullptr);
  absl::StatusOr<int> fd = shm::CreateChannelMemfd(4096, 4096);
  ASSERT_TRUE(fd.ok()) << fd.status();
  HandReply r = SendHandHello(path, shm::Hello{0x12345678, shm::kVersion, 0, 0}, {*fd}, "");
  EXPECT_EQ(r.code, static_cast<int32_t>(absl::StatusCode::kInvalidArgument));
  EXPECT_NE(r.message.find("bad magic"), std::string::npos) << r.message;
  EXPECT_EQ(r.message.find("version"), std::string::npos) << r.message;
  r = SendHandHello(path, shm::Hello{shm::kMagic, shm::kVersion + 1, 0, 0}, {*fd}, "");
  EXPECT_EQ(r.code, static_cast<int32_t>(absl::StatusCode::kInvalidArgument));
  EXPECT_NE(r.message.find(absl::StrCat("version ", shm::kVersion + 1)), std::string::npos) << r.message;
  ::close(*fd);
}

TEST(ShmChannel, AtTheDescriptorLimitACallerIsRefusedAndTheAcceptorDoesNotSpin) {
  const std::string path = SocketPath("emfile");
  TestServer ts(WithShm(path));
  ASSERT_NE(ts.server, nullptr);
  const int s = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);  // made before the limit is reached
  ASSERT_GE(s, 0);
  const timeval tv{3, 0};
  ASSERT_EQ(::setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)), 0);
  rlimit saved{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &saved), 0);
  int highest = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
    highest = std::max(highest, std::atoi(e.path().filename().c_str()));
  }
  rlimit low = saved;
  low.rlim_cur = std::min<rlim_t>(saved.rlim_cur, static_cast<rlim_t>(highest) + 64);
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &low), 0);
  std::vector<int> filler;
  for (int f; (f = ::dup(s)) >= 0;) filler.push_back(f);
  ASSERT_EQ(errno, EMFILE);
  // Other threads of the process open a descriptor for a moment on their first use of some library call (glibc's
  // get_nprocs reads /sys/devices/system/cpu/online for absl's NumCPUs and for a new malloc arena). One held across
  // the fill is closed after it, and that free slot would let the caller in as an ordinary channel, which then waits
  // for its hello. So the fill is topped up until a whole pause passes with no slot coming free.
  for (int pauses = 0;; ++pauses) {
    ASSERT_LT(pauses, 50) << "descriptors kept coming free after the fill";
    absl::SleepFor(absl::Milliseconds(100));
    const size_t filled = filler.size();
    for (int f; (f = ::dup(s)) >= 0;) filler.push_back(f);
    ASSERT_EQ(errno, EMFILE);
    if (filler.size() == filled) break;
  }

  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path.c_str());
  ASSERT_EQ(::connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  shm::HelloReply reply{-1, 0};
  const absl::Status heard = shm::ReceiveAll(s, &reply, sizeof(reply));
  rusage a{}, b{};
  ::getrusage(RUSAGE_SELF, &a);
  absl::SleepFor(absl::Milliseconds(300));  // still at the limit: the window the CPU time is measured over
  ::getrusage(RUSAGE_SELF, &b);
  for (const int f : filler) ::close(f);
  ::setrlimit(RLIMIT_NOFILE, &saved);
  ::close(s);

  EXPECT_TRUE(heard.ok()) << heard;
  EXPECT_EQ(reply.status_code, static_cast<int32_t>(absl::StatusCode::kResourceExhausted));
  const auto cpu = [](const rusage& r) {
    return absl::DurationFromTimeval(r.ru_utime) + absl::DurationFromTimeval(r.ru_stime);
  };
  EXPECT_LT(cpu(b) - cpu(a), absl::Milliseconds(100));
  // With descriptors free again, channels open as before.
  auto ch = ShmChannel::Connect(Opts(path));
  ASSERT_TRUE(ch.ok()) << ch.status();
  const v1::ForwardRequest req = MakeRequest({1, 16, 16, 2, 2, 64}, v1::MASK_TYPE_NONE, false, 5);
  absl::StatusOr<v1::ForwardResponse> r = (*ch)->Forward(req);
  ASSERT_TRUE(r.ok()) << r.status();
  ExpectCorrect(req, r->o(), r->lse());
}

// Step frames (kind 1) run on the server's KV sequences with the caller's identity: the token it presented, the
// same owner as a gRPC caller with that token. A kind the server does not know is refused naming it, and the
// channel goes on serving.
TEST(ShmChannel, StepFramesOwnedByTheTokenAndUnknownKindsRefused) {
  const std::string token_file = absl::StrCat(::testing::TempDir(), "attnd_shm_step_tokens_", ::getpid());
  std::ofstream(token_file) << "first\nsecond\n";
  const std::string path = SocketPath("step");
  server::ServerOptions so = WithShm(path);
  so.security.auth_token_file = token_file;
  TestServer ts(so);
  ASSERT_NE(ts.server, nullptr);
  client::ClientOptions co;
  co.target = absl::StrCat("127.0.0.1:", ts.server->tcp_port());
  co.auth_token = "second";
  auto grpc_client = client::Client::Create(co);
  ASSERT_TRUE(grpc_client.ok()) << grpc_client.status();
  client::SequenceShape shape;
  shape.layers = 1;
  shape.kv_heads = 1;
  shape.head_dim = 64;
  auto opened = (*grpc_client)->OpenSequence(shape);
  ASSERT_TRUE(opened.ok()) << opened.status();

  v1::StepRequest step;
  auto* t = step.add_sequences();
  t->set_sequence_id(opened->ids[0]);
  t->set_tokens(1);
  step.set_q_heads(2);
  std::mt19937_64 rng(5);
  step.mutable_q()->set_data(testing::RandomTensor(2 * 64, DType::kBF16, rng));
  step.mutable_k()->set_data(testing::RandomTensor(64, DType::kBF16, rng));
  step.mutable_v()->set_data(testing::RandomTensor(64, DType::kBF16, rng));
  ShmChannelOptions o = Opts(path);
  o.auth_token = "second";
  auto ch = ShmChannel::Connect(o);
  ASSERT_TRUE(ch.ok()) << ch.status();
  auto r = client::StepOverShm(**ch, step, absl::Seconds(30));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->lengths, std::vector<int64_t>({1}));
  EXPECT_EQ(r->transport, client::Transport::kShm);
  EXPECT_EQ(r->o.size(), 2u * 64 * 2);
  // Another token is another owner: the sequence does not exist for it.
  o.auth_token = "first";
  auto other = ShmChannel::Connect(o);
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_EQ((*other)->Step(step, absl::Seconds(30)).status().code(), absl::StatusCode::kNotFound);

  // A hand-made channel writes a kind no server knows, then a Forward on the same channel.
  absl::StatusOr<int> memfd = shm::CreateChannelMemfd(1 << 20, 1 << 20);
  ASSERT_TRUE(memfd.ok()) << memfd.status();
  const int s = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path.c_str());
  ASSERT_EQ(::connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  const shm::Hello hello{shm::kMagic, shm::kVersion, 5, 0};
  ASSERT_TRUE(shm::SendWithFd(s, &hello, sizeof(hello), *memfd).ok());
  ASSERT_TRUE(shm::SendAll(s, "first", 5).ok());
  shm::HelloReply reply{-1, 0};
  ASSERT_TRUE(shm::ReceiveAll(s, &reply, sizeof(reply)).ok());
  ASSERT_EQ(reply.status_code, 0);
  absl::StatusOr<shm::Mapping> m = shm::MapClientSide(*memfd, 1 << 20, 1 << 20);
  ::close(*memfd);
  ASSERT_TRUE(m.ok()) << m.status();
  const auto call = [&](uint32_t kind, const std::string& bytes) {
    std::memcpy(m->request(), bytes.data(), bytes.size());
    m->header->request_bytes = bytes.size();
    m->header->kind = kind;
    shm::Publish(&m->header->state, shm::kRequest, &m->header->server_sleeping);
    EXPECT_TRUE(shm::AwaitState(&m->header->state, shm::kReply, &m->header->client_sleeping, absl::Milliseconds(1),
                                absl::Now() + absl::Seconds(30), absl::Milliseconds(20), [] { return false; }));
    return std::make_pair(m->header->status_code,
                          std::string(reinterpret_cast<const char*>(m->reply()), m->header->reply_bytes));
  };
  const auto [bad_code, bad_message] = call(7, step.SerializeAsString());
  EXPECT_EQ(bad_code, static_cast<int32_t>(absl::StatusCode::kInvalidArgument));
  EXPECT_NE(bad_message.find("kind"), std::string::npos) << bad_message;
  const v1::ForwardRequest forward = MakeRequest(Shape{1, 4, 4, 2, 1, 64});
  const auto [ok_code, ok_reply] = call(shm::kForwardRequest, forward.SerializeAsString());
  EXPECT_EQ(ok_code, 0) << ok_reply;
  v1::ForwardResponse response;
  ASSERT_TRUE(response.ParseFromString(ok_reply));
  ExpectCorrect(forward, response.o(), response.lse());
  ::munmap(m->header, m->bytes);
  ::close(s);
  std::remove(token_file.c_str());
}

TEST(ShmChannel, ManyChannelsAtOnceAllCorrect) {
  const std::string path = SocketPath("many");
  server::BackendOptions bo;
  bo.threads = 4;
  TestServer ts(WithShm(path), bo);
  constexpr int kChannels = 8, kCalls = 12;
  std::atomic<int> good{0}, bad{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kChannels; ++t) {
    threads.emplace_back([&, t] {
      auto ch = ShmChannel::Connect(Opts(path));
      if (!ch.ok()) {
        bad.fetch_add(kCalls);
        return;
      }
      for (int i = 0; i < kCalls; ++i) {
        const v1::ForwardRequest req =
            MakeRequest({1, 24 + t, 24 + i, 2, 2, 64}, i % 2 ? v1::MASK_TYPE_CAUSAL_TOP_LEFT : v1::MASK_TYPE_NONE,
                        i % 3 == 0, 100 * t + i);
        absl::StatusOr<v1::ForwardResponse> r = (*ch)->Forward(req);
        if (!r.ok()) {
          bad.fetch_add(1);
          continue;
        }
        ExpectCorrect(req, r->o(), r->lse());
        good.fetch_add(1);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_EQ(good.load(), kChannels * kCalls);
}

TEST(ShmChannel, ShutdownAnswersTheRequestItHolds) {
  const std::string path = SocketPath("down");
  Gate gate;
  server::BackendOptions bo;
  bo.threads = 1;
  TestServer ts(WithShm(path), bo, gate.Hooks());
  auto ch = ShmChannel::Connect(Opts(path));
  ASSERT_TRUE(ch.ok()) << ch.status();
  const v1::ForwardRequest req = MakeRequest({1, 32, 32, 2, 2, 64}, v1::MASK_TYPE_NONE, false, 9);
  absl::StatusOr<v1::ForwardResponse> r;
  std::thread caller([&] { r = (*ch)->Forward(req); });
  ASSERT_TRUE(WaitFor([&] { return gate.entered() == 1; }));
  std::thread stopper([&] { ts.server->Shutdown(); });
  absl::SleepFor(absl::Milliseconds(50));  // the shutdown is waiting for the held request
  gate.Open();
  caller.join();
  stopper.join();
  ASSERT_TRUE(r.ok()) << r.status();
  ExpectCorrect(req, r->o(), r->lse());
  // The channel is closed now: a further call fails instead of hanging.
  EXPECT_FALSE((*ch)->Forward(req).ok());
  EXPECT_FALSE(ShmChannel::Connect(Opts(path)).ok());
}

TEST(ShmChannel, CallerVanishingMidRequestLeavesTheServerServing) {
  const std::string path = SocketPath("gone");
  Gate gate;
  server::BackendOptions bo;
  bo.threads = 1;
  TestServer ts(WithShm(path), bo, gate.Hooks());
  {
    auto ch = ShmChannel::Connect(Opts(path));
    ASSERT_TRUE(ch.ok()) << ch.status();
    // Gives up after 20 ms while the server holds the request; then the channel goes away entirely.
    EXPECT_EQ((*ch)->Forward(MakeRequest({1, 16, 16, 2, 2, 64}), absl::Milliseconds(20)).status().code(),
              absl::StatusCode::kDeadlineExceeded);
    EXPECT_EQ((*ch)->Forward(MakeRequest({1, 16, 16, 2, 2, 64})).status().code(),
              absl::StatusCode::kFailedPrecondition);
  }
  gate.Open();
  auto ch = ShmChannel::Connect(Opts(path));
  ASSERT_TRUE(ch.ok()) << ch.status();
  const v1::ForwardRequest req = MakeRequest({1, 16, 16, 2, 2, 64}, v1::MASK_TYPE_NONE, false, 4);
  absl::StatusOr<v1::ForwardResponse> r = (*ch)->Forward(req);
  ASSERT_TRUE(r.ok()) << r.status();
  ExpectCorrect(req, r->o(), r->lse());
}

}  // namespace
}  // namespace attnd
