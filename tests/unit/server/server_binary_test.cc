// The attnd binary as users run it: it serves on a unix socket, answers SIGTERM (and SIGINT) by finishing
// every accepted request and exiting 0, refuses bad flags with exit status 2, and lists its flags on --help.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "child_process.h"
#include "gtest/gtest.h"
#include "server_raw_call.h"
#include "server_test_util.h"

#ifndef ATTND_BINARY
#error "ATTND_BINARY must name the attnd executable"
#endif

namespace attnd {
namespace {

using testing::ChildGuard;
using testing::Spawn;
using testing::WaitExit;

bool Serving(const std::shared_ptr<grpc::Channel>& channel) {
  const testing::RawResult r = testing::RawCall(channel, "/grpc.health.v1.Health/Check", testing::HealthRequest(""),
                                                16, std::chrono::milliseconds(500));
  return r.status.ok() && r.messages.size() == 1 && testing::HealthStatus(r.messages[0]) == 1;
}

class Binary : public ::testing::TestWithParam<int> {};

TEST_P(Binary, SignalFinishesAcceptedRequestsAndExitsZero) {
  const int sig = GetParam();
  const std::string sock = "/tmp/attnd_bin_" + std::to_string(::getpid()) + "_" + std::to_string(sig) + ".sock";
  const pid_t pid = Spawn({ATTND_BINARY, "--listen=", "--unix_socket=" + sock, "--backend=cpu", "--threads=1",
                           "--log_level=warn"});
  ASSERT_GT(pid, 0);
  ChildGuard guard{pid};
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  auto channel = grpc::CreateCustomChannel("unix:" + sock, grpc::InsecureChannelCredentials(), args);
  const absl::Time end = absl::Now() + absl::Seconds(20);
  while (!Serving(channel) && absl::Now() < end) absl::SleepFor(absl::Milliseconds(20));
  ASSERT_TRUE(Serving(channel)) << "attnd did not start";
  auto stub = v1::Attention::NewStub(channel);

  // Several requests queue on the single worker; the signal arrives while they are in flight.
  constexpr int kCalls = 6;
  std::vector<v1::ForwardRequest> requests;
  for (int i = 0; i < kCalls; ++i) {
    requests.push_back(testing::MakeRequest({1, 256, 256, 4, 1, 128}, v1::MASK_TYPE_NONE, true, 40 + i));
  }
  std::vector<v1::ForwardResponse> responses(kCalls);
  std::vector<grpc::Status> statuses(kCalls);
  std::vector<std::thread> threads;
  struct JoinAll {  // on an early return too: the server is alive until `guard` goes, so the calls end
    std::vector<std::thread>& t;
    ~JoinAll() {
      for (auto& x : t) {
        if (x.joinable()) x.join();
      }
    }
  } join_all{threads};
  for (int i = 0; i < kCalls; ++i) {
    threads.emplace_back([&, i] {
      grpc::ClientContext ctx;
      statuses[i] = stub->Forward(&ctx, requests[i], &responses[i]);
    });
  }
  // Wait until the server has accepted all of them (finished + in flight) with some still in flight.
  bool all_in = false;
  uint32_t in_flight = 0;
  for (const absl::Time until = absl::Now() + absl::Seconds(20); !all_in && absl::Now() < until;) {
    grpc::ClientContext ctx;
    v1::ServerStats stats;
    if (stub->GetStats(&ctx, v1::GetStatsRequest(), &stats).ok()) {
      uint64_t finished = 0;
      for (const auto& r : stats.rpcs()) {
        if (r.method() == "Forward") finished = r.count();
      }
      in_flight = stats.in_flight();
      all_in = finished + in_flight == kCalls;
    }
    if (!all_in) absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_TRUE(all_in);
  ASSERT_EQ(::kill(pid, sig), 0);
  EXPECT_GT(in_flight, 0u) << "every call finished before the signal: the test proved nothing";
  for (auto& t : threads) t.join();
  EXPECT_EQ(WaitExit(pid, absl::Seconds(60)), 0);
  guard.reaped = true;
  for (int i = 0; i < kCalls; ++i) {
    ASSERT_TRUE(statuses[i].ok()) << i << ": " << statuses[i].error_message();
    testing::ExpectCorrect(requests[i], responses[i].o(), responses[i].lse());
  }
  struct stat st;
  EXPECT_NE(::stat(sock.c_str(), &st), 0) << "socket file left behind";
}

INSTANTIATE_TEST_SUITE_P(Signals, Binary, ::testing::Values(SIGTERM, SIGINT),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return std::string(info.param == SIGTERM ? "SIGTERM" : "SIGINT");
                         });

// A port free now (bound and released): the binary is told it explicitly, so the test can reach it over TCP.
int FreePort() {
  const int s = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  int port = 0;
  if (::bind(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      ::getsockname(s, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  ::close(s);
  return port;
}

int ConnectTcp(int port) {
  const int s = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (s >= 0 && ::connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(s);
    return -1;
  }
  return s;
}

// Whether the server has closed connection `s` (EOF) within `timeout`.
bool ClosedByServer(int s, absl::Duration timeout) {
  const int64_t us = std::max<int64_t>(absl::ToInt64Microseconds(timeout), 1);  // {0, 0} would wait for ever
  timeval tv{static_cast<time_t>(us / 1000000), static_cast<suseconds_t>(us % 1000000)};
  ::setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  char c;
  const ssize_t n = ::recv(s, &c, 1, 0);
  return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK);
}

struct FloodCase {
  const char* name;
  std::vector<std::string> flags;
};

void PrintTo(const FloodCase& c, std::ostream* os) { *os << c.name; }

class DescriptorFlood : public ::testing::TestWithParam<FloodCase> {};

// Idle connections past the descriptor limit (128) and past --max_connections: the excess is closed at once,
// and once the flood is gone the TCP listener serves a new connection. Without a cap the flood reaches the
// limit itself (accept4 fails with EMFILE), which used to leave the port deaf for good.
TEST_P(DescriptorFlood, ExcessIsRefusedAndTheListenerServesAfterwards) {
  const int port = FreePort();
  ASSERT_GT(port, 0);
  std::vector<std::string> args = {ATTND_BINARY, "--listen=127.0.0.1:" + std::to_string(port), "--backend=cpu",
                                   "--threads=1", "--log_level=warn"};
  for (const std::string& f : GetParam().flags) args.push_back(f);
  const pid_t pid = Spawn(args, 128);
  ASSERT_GT(pid, 0);
  ChildGuard guard{pid};
  const std::string target = "127.0.0.1:" + std::to_string(port);
  auto fresh_channel = [&] {
    grpc::ChannelArguments a;
    a.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // a new connection, not one shared with an earlier channel
    return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), a);
  };
  const absl::Time end = absl::Now() + absl::Seconds(20);
  while (!Serving(fresh_channel()) && absl::Now() < end) absl::SleepFor(absl::Milliseconds(20));
  ASSERT_TRUE(Serving(fresh_channel())) << "attnd did not start";

  constexpr int kFlood = 200;
  std::vector<int> flood;
  for (int i = 0; i < kFlood; ++i) {
    const int s = ConnectTcp(port);  // completes in the kernel's backlog whether or not attnd accepts it
    if (s >= 0) flood.push_back(s);
  }
  int closed = 0;
  for (int s : flood) closed += ClosedByServer(s, absl::Milliseconds(1)) ? 1 : 0;
  // The last connection is past the limit under either rule: it must be closed, not left hanging.
  EXPECT_TRUE(ClosedByServer(flood.back(), absl::Seconds(5))) << "the connection past the limit was left open";
  for (int s : flood) closed += ClosedByServer(s, absl::Milliseconds(1)) ? 1 : 0;
  EXPECT_GE(closed, kFlood - 128) << "fewer connections refused than the descriptor limit implies";
  for (int s : flood) ::close(s);

  // A new call over a new TCP connection succeeds once the server has seen the flood go.
  bool served = false;
  for (const absl::Time until = absl::Now() + absl::Seconds(15); !served && absl::Now() < until;) {
    auto stub = v1::Attention::NewStub(fresh_channel());
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    const v1::ForwardRequest r = testing::MakeRequest({1, 16, 16, 2, 1, 64}, v1::MASK_TYPE_NONE, true, 61);
    v1::ForwardResponse resp;
    served = stub->Forward(&ctx, r, &resp).ok();
    if (served) testing::ExpectCorrect(r, resp.o(), resp.lse());
    if (!served) absl::SleepFor(absl::Milliseconds(200));
  }
  EXPECT_TRUE(served) << "the TCP listener stopped accepting after the flood";
  EXPECT_TRUE(Serving(fresh_channel()));
  ASSERT_EQ(::kill(pid, SIGTERM), 0);
  EXPECT_EQ(WaitExit(pid, absl::Seconds(20)), 0);
  guard.reaped = true;
}

INSTANTIATE_TEST_SUITE_P(Limits, DescriptorFlood,
                         ::testing::Values(FloodCase{"ConnectionCap", {"--max_connections=64"}},
                                           FloodCase{"DescriptorLimit", {"--max_connections=100000"}}),
                         [](const ::testing::TestParamInfo<FloodCase>& info) { return std::string(info.param.name); });

// VmRSS of `pid` in bytes (0 when unreadable).
uint64_t RssBytes(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::strtoull(line.c_str() + 6, nullptr, 10) * 1024;
  }
  return 0;
}

std::string H2Frame(uint8_t type, uint8_t flags, uint32_t stream, const std::string& payload) {
  const uint32_t n = static_cast<uint32_t>(payload.size());
  std::string f = {static_cast<char>(n >> 16), static_cast<char>(n >> 8), static_cast<char>(n), static_cast<char>(type),
                   static_cast<char>(flags), static_cast<char>((stream >> 24) & 0x7f), static_cast<char>(stream >> 16),
                   static_cast<char>(stream >> 8), static_cast<char>(stream)};
  return f + payload;
}

uint32_t Be32(const std::string& b, size_t at) {
  return (uint32_t{static_cast<uint8_t>(b[at])} << 24) | (uint32_t{static_cast<uint8_t>(b[at + 1])} << 16) |
         (uint32_t{static_cast<uint8_t>(b[at + 2])} << 8) | uint32_t{static_cast<uint8_t>(b[at + 3])};
}

// A CPU-backend attnd on 127.0.0.1 with one compute thread and `flags`, serving (health) before this returns; its
// process is killed and reaped with the object unless the test reaps it (`guard.reaped`).
struct TcpServer {
  explicit TcpServer(const std::vector<std::string>& flags) : port(FreePort()) {
    if (port <= 0) return;
    std::vector<std::string> args = {ATTND_BINARY, "--listen=127.0.0.1:" + std::to_string(port), "--backend=cpu",
                                     "--threads=1", "--log_level=warn"};
    args.insert(args.end(), flags.begin(), flags.end());
    guard.pid = Spawn(args);
    if (guard.pid <= 0) return;
    channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials());
    const absl::Time end = absl::Now() + absl::Seconds(20);
    while (!Serving(channel) && absl::Now() < end) absl::SleepFor(absl::Milliseconds(20));
    serving = Serving(channel);
  }
  int port;
  ChildGuard guard{-1};
  std::shared_ptr<grpc::Channel> channel;
  bool serving = false;
};

// One gRPC call of `path` over a hand-made HTTP/2 connection (gRPC clients cannot be made to send a prefix that
// disagrees with the message, or a message a byte at a time): the preface, a SETTINGS frame and the call's
// headers (HPACK without Huffman: :method POST, :scheme http (static), :path and :authority (indexed names),
// content-type (name 31), te: trailers (new name)) on stream 1.
class RawGrpcCall {
 public:
  struct Frame {
    uint8_t type = 0, flags = 0;
    uint32_t stream = 0;
    std::string payload;
  };

  RawGrpcCall(int port, const std::string& path) : s_(ConnectTcp(port)) {
    if (s_ < 0) return;
    auto literal = [](const std::string& v) { return std::string(1, static_cast<char>(v.size())) + v; };
    const std::string headers = std::string("\x83\x86\x04") + literal(path) + "\x01" + literal("localhost") +
                                "\x0f\x10" + literal("application/grpc") + std::string(1, '\0') + literal("te") +
                                literal("trailers");
    Send(std::string("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n") + H2Frame(4, 0, 0, "") + H2Frame(1, 4, 1, headers));
  }
  ~RawGrpcCall() {
    if (s_ >= 0) ::close(s_);
  }
  bool ok() const { return s_ >= 0; }

  bool Send(const std::string& b) {
    for (size_t at = 0; at < b.size();) {
      const ssize_t n = ::send(s_, b.data() + at, b.size() - at, MSG_NOSIGNAL);
      if (n <= 0) return false;
      at += static_cast<size_t>(n);
    }
    return true;
  }
  bool SendData(const std::string& bytes) { return Send(H2Frame(0, 0, 1, bytes)); }

  // The frames that arrived within `wait`, SETTINGS and PING acknowledged; false once the server closed the
  // connection.
  bool Receive(absl::Duration wait, std::vector<Frame>* frames) {
    pollfd p{s_, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(wait))) <= 0) return true;
    char buf[65536];
    const ssize_t got = ::recv(s_, buf, sizeof(buf), 0);
    if (got <= 0) return false;
    in_.append(buf, static_cast<size_t>(got));
    while (in_.size() >= 9) {
      const uint32_t len = Be32(in_, 0) >> 8;
      if (in_.size() < 9 + len) break;
      Frame f{static_cast<uint8_t>(in_[3]), static_cast<uint8_t>(in_[4]), Be32(in_, 5) & 0x7fffffff, in_.substr(9, len)};
      in_.erase(0, 9 + len);
      if (f.type == 4 && (f.flags & 1) == 0) Send(H2Frame(4, 1, 0, ""));
      if (f.type == 6 && (f.flags & 1) == 0) Send(H2Frame(6, 1, 0, f.payload));
      frames->push_back(std::move(f));
    }
    return true;
  }

  // RST_STREAM or trailers on the call's stream, or GOAWAY.
  static bool EndsTheCall(const Frame& f) {
    return (f.stream == 1 && (f.type == 3 || (f.type == 1 && (f.flags & 1) != 0))) || f.type == 7;
  }

 private:
  const int s_;
  std::string in_;
};

struct PrefixFlood {
  uint64_t sent = 0;       // bytes of the message sent (prefix included)
  uint64_t peak_rss = 0;   // the server's, sampled while sending
  bool stream_ended = false;  // RST_STREAM, GOAWAY or trailers from the server
};

// A unary Forward whose gRPC length prefix announces `announce` bytes, fed with zeros as fast as the server's flow
// control allows until it ends the stream, `announce` is sent, or `limit` passes.
PrefixFlood FloodAnnouncedMessage(int port, pid_t server, uint32_t announce, absl::Duration limit) {
  PrefixFlood out;
  RawGrpcCall call(port, "/attnd.v1.Attention/Forward");
  if (!call.ok()) return out;
  int64_t conn_window = 65535, stream_window = 65535, initial_window = 65535;
  const uint64_t total = uint64_t{announce} + 5;
  const std::string prefix = {0, static_cast<char>(announce >> 24), static_cast<char>(announce >> 16),
                              static_cast<char>(announce >> 8), static_cast<char>(announce)};
  const std::string zeros(16384, '\0');
  const absl::Time end = absl::Now() + limit;
  while (!out.stream_ended && absl::Now() < end) {
    out.peak_rss = std::max(out.peak_rss, RssBytes(server));
    while (conn_window > 0 && stream_window > 0 && out.sent < total) {
      const uint64_t n = std::min<uint64_t>({16384, static_cast<uint64_t>(conn_window),
                                             static_cast<uint64_t>(stream_window), total - out.sent});
      if (!call.SendData(out.sent == 0 ? prefix + zeros.substr(0, n - 5) : zeros.substr(0, n))) return out;
      out.sent += n;
      conn_window -= static_cast<int64_t>(n);
      stream_window -= static_cast<int64_t>(n);
    }
    std::vector<RawGrpcCall::Frame> frames;
    if (!call.Receive(absl::Milliseconds(20), &frames)) out.stream_ended = true;
    for (const RawGrpcCall::Frame& f : frames) {
      if (f.type == 4 && (f.flags & 1) == 0) {  // SETTINGS: INITIAL_WINDOW_SIZE moves the stream's window
        for (size_t i = 0; i + 6 <= f.payload.size(); i += 6) {
          if (((static_cast<uint8_t>(f.payload[i]) << 8) | static_cast<uint8_t>(f.payload[i + 1])) != 4) continue;
          const int64_t v = Be32(f.payload, i + 2);
          stream_window += v - initial_window;
          initial_window = v;
        }
      } else if (f.type == 8) {  // WINDOW_UPDATE
        (f.stream == 0 ? conn_window : stream_window) += Be32(f.payload, 0) & 0x7fffffff;
      }
      if (RawGrpcCall::EndsTheCall(f)) out.stream_ended = true;
    }
  }
  out.peak_rss = std::max(out.peak_rss, RssBytes(server));
  return out;
}

// The SETTINGS_MAX_CONCURRENT_STREAMS (0x3) the server announces on a new connection; -1 when it sends none.
int64_t AnnouncedStreamCap(int port) {
  RawGrpcCall call(port, "/grpc.health.v1.Health/Check");
  const absl::Time end = absl::Now() + absl::Seconds(5);
  while (call.ok() && absl::Now() < end) {
    std::vector<RawGrpcCall::Frame> frames;
    if (!call.Receive(absl::Milliseconds(50), &frames)) break;
    for (const RawGrpcCall::Frame& f : frames) {
      if (f.type != 4 || (f.flags & 1) != 0 || f.stream != 0) continue;
      for (size_t i = 0; i + 6 <= f.payload.size(); i += 6) {
        const int id = (static_cast<uint8_t>(f.payload[i]) << 8) | static_cast<uint8_t>(f.payload[i + 1]);
        if (id == 3) return Be32(f.payload, i + 2);
      }
      return -1;
    }
  }
  return -1;
}

TEST(BinaryLimits, OneConnectionHoldsAtMostItsStreamCap) {
  // Each call in progress costs the server its state beyond the transport quota: a connection may hold
  // --max_streams_per_connection of them (1024 unless set), announced in the server's first SETTINGS frame.
  for (const auto& [flags, want] : std::vector<std::pair<std::vector<std::string>, int64_t>>{
           {{}, 1024}, {{"--max_streams_per_connection=7"}, 7}}) {
    TcpServer server(flags);
    ASSERT_TRUE(server.serving) << "attnd did not start";
    EXPECT_EQ(AnnouncedStreamCap(server.port), want);
  }
}

TEST(BinaryLimits, AHugeLengthPrefixIsNotBufferedWhole) {
  // --max_message_bytes=4 MiB; a call announcing 1 GiB. The server's memory must stay near the transport's
  // quota (4 + 16 MiB, at least 64 MiB) instead of following the prefix, and the server must carry on.
  TcpServer server({"--max_message_bytes=4194304"});
  ASSERT_TRUE(server.serving) << "attnd did not start";
  const pid_t pid = server.guard.pid;
  const int port = server.port;
  const uint64_t before = RssBytes(pid);
  const PrefixFlood f = FloodAnnouncedMessage(port, pid, 1u << 30, absl::Seconds(20));
  std::printf("announced 1 GiB: sent %.1f MiB, server VmRSS %.1f MiB before, peak %.1f MiB; stream ended: %d\n",
              f.sent / 1048576.0, before / 1048576.0, f.peak_rss / 1048576.0, f.stream_ended);
  EXPECT_TRUE(f.stream_ended) << "the server kept taking the message";
  EXPECT_LT(f.sent, uint64_t{256} << 20);
  EXPECT_LT(f.peak_rss, before + (uint64_t{160} << 20));
  // The server carries on: a real call on a new connection is answered. The transport quota's reclaimer may still
  // be resetting connections just after the flood (UNAVAILABLE "Broken pipe"), so the call may take a few tries.
  auto stub = v1::Attention::NewStub(
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
  const v1::ForwardRequest r = testing::MakeRequest({1, 64, 64, 4, 2, 64}, v1::MASK_TYPE_NONE, true, 63);
  v1::ForwardResponse resp;
  grpc::Status s;
  for (const absl::Time until = absl::Now() + absl::Seconds(10);; absl::SleepFor(absl::Milliseconds(100))) {
    grpc::ClientContext ctx;
    s = stub->Forward(&ctx, r, &resp);
    if (s.error_code() != grpc::StatusCode::UNAVAILABLE || absl::Now() > until) break;
  }
  ASSERT_TRUE(s.ok()) << s.error_message();
  testing::ExpectCorrect(r, resp.o(), resp.lse());
  ASSERT_EQ(::kill(pid, SIGTERM), 0);
  EXPECT_EQ(WaitExit(pid, absl::Seconds(20)), 0);
  server.guard.reaped = true;
}

// Default limits (256 MiB messages, so a 272 MiB transport quota): a call announcing 1 GiB is cut off near the
// quota, and once the server is quiet (10 s without a call) it purges every jemalloc arena, so its resident size
// comes back to within a fifth of where it was, a minute at most after the reset. Measured on a 2-core machine:
// 19.7-19.8 MiB before, 21.6-21.9 MiB 15 s after the reset: what stays is jemalloc's bookkeeping for the ~7,000
// extents the upload was buffered in and the threads gRPC started, 9-11% of the fresh server (the goal is 10%; the
// bound leaves room for a loaded machine, where gRPC starts more threads). glibc's allocator with the heap retained
// keeps far more: its gRPC threads' arenas keep what they free at their tops, which malloc_trim cannot release
// (38-110 MiB after); the test fails so.
void FloodAndWatchTheMemory(const std::vector<std::string>& flags, double slack_share) {
  TcpServer server(flags);
  ASSERT_TRUE(server.serving) << "attnd did not start";
  const pid_t pid = server.guard.pid;
  auto channel = server.channel;
  const int port = server.port;
  const uint64_t before = RssBytes(pid);
  const PrefixFlood f = FloodAnnouncedMessage(port, pid, 1u << 30, absl::Seconds(30));
  EXPECT_TRUE(f.stream_ended) << "the server kept taking the message";
  // gRPC resets the stream once its reclaimer runs, a little past the quota (6-25 MiB in quiet runs; more on a
  // loaded machine): far below what the old default let through (512 MiB).
  EXPECT_LE(f.sent, uint64_t{256 + 16 + 64} << 20) << "sent " << f.sent;
  const uint64_t bound = before + static_cast<uint64_t>(before * slack_share);
  uint64_t after = RssBytes(pid);
  const absl::Time quiet_from = absl::Now();
  while (after > bound && absl::Now() - quiet_from < absl::Minutes(1)) {
    absl::SleepFor(absl::Milliseconds(500));
    after = RssBytes(pid);
  }
  std::printf("%s, announced 1 GiB: sent %.1f MiB; server VmRSS %.1f MiB before, peak %.1f MiB, "
              "%.1f MiB %.0f s later\n",
              absl::StrJoin(flags, " ").c_str(), f.sent / 1048576.0, before / 1048576.0, f.peak_rss / 1048576.0,
              after / 1048576.0, absl::ToDoubleSeconds(absl::Now() - quiet_from));
  EXPECT_LE(after, bound) << "VmRSS " << after << " before " << before << " peak " << f.peak_rss;
  ASSERT_EQ(::kill(pid, SIGTERM), 0);
  EXPECT_EQ(WaitExit(pid, absl::Seconds(20)), 0);
  server.guard.reaped = true;
}

TEST(BinaryLimits, AHostileUploadIsCutNearTheQuotaAndItsMemoryGivenBack) {
  FloodAndWatchTheMemory({"--retain_heap=false"}, 0.2);
}
TEST(BinaryLimits, AHostileUploadsMemoryIsGivenBackWhileRetainingTheHeap) {
  FloodAndWatchTheMemory({"--retain_heap=true"}, 0.2);
}

// A unary call of `path` whose 1,000-byte message comes one byte every `every`. Returns how long until the server
// ended the call, and what its frames on the call's stream carried (trailers' grpc-message is not Huffman-coded
// by gRPC's encoder).
struct Trickle {
  bool ended = false;
  absl::Duration took;
  std::string stream_frames;
};
Trickle TrickleUnary(int port, const std::string& path, absl::Duration every, absl::Duration limit) {
  Trickle out;
  const absl::Time start = absl::Now();
  RawGrpcCall call(port, path);
  if (!call.ok()) return out;
  call.SendData(std::string("\0\0\0\x03\xe8", 5));
  absl::Time next_byte = start;
  while (!out.ended && absl::Now() - start < limit) {
    if (absl::Now() >= next_byte) {
      call.SendData(std::string(1, '\x01'));
      next_byte += every;
    }
    std::vector<RawGrpcCall::Frame> frames;
    if (!call.Receive(absl::Milliseconds(10), &frames)) out.ended = true;
    for (const RawGrpcCall::Frame& f : frames) {
      if (f.stream == 1) out.stream_frames += f.payload;
      if (RawGrpcCall::EndsTheCall(f)) out.ended = true;
    }
  }
  out.took = absl::Now() - start;
  return out;
}

TEST(BinaryLimits, TrickledUnaryRequestsAreEndedAtTheUploadTimeout) {
  // A byte every 100 ms keeps the connection busy (no idle or keepalive limit applies), so only
  // --upload_timeout_s bounds the call: Forward and Step, which carry tensors, the control methods and the health
  // service (whose probes need no token) alike.
  TcpServer server({"--upload_timeout_s=1"});
  ASSERT_TRUE(server.serving) << "attnd did not start";
  const pid_t pid = server.guard.pid;
  auto channel = server.channel;
  const int port = server.port;
  for (const char* method : {"/attnd.v1.Attention/Forward", "/attnd.v1.Attention/Step",
                             "/attnd.v1.Attention/OpenSequence", "/attnd.v1.Attention/GetServerInfo",
                             "/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"}) {
    const Trickle t = TrickleUnary(port, method, absl::Milliseconds(100), absl::Seconds(20));
    std::printf("trickled %s ended by the server after %.0f ms (upload timeout 1 s)\n", method,
                absl::ToDoubleMilliseconds(t.took));
    EXPECT_TRUE(t.ended) << method;
    EXPECT_GE(t.took, absl::Milliseconds(950)) << method;
    EXPECT_LT(t.took, absl::Seconds(4)) << method;
    EXPECT_TRUE(absl::StrContains(t.stream_frames, "upload_timeout_s")) << method << ": " << absl::CHexEscape(t.stream_frames);
  }
  // A method the server does not have is answered at once, its request never waited for.
  const Trickle unknown = TrickleUnary(port, "/attnd.v1.Attention/NoSuchMethod", absl::Milliseconds(100),
                                       absl::Seconds(20));
  EXPECT_TRUE(unknown.ended);
  EXPECT_LT(unknown.took, absl::Milliseconds(900));
  // The server carries on.
  auto stub = v1::Attention::NewStub(channel);
  const v1::ForwardRequest r = testing::MakeRequest({1, 64, 64, 4, 2, 64}, v1::MASK_TYPE_NONE, true, 64);
  grpc::ClientContext ctx;
  v1::ForwardResponse resp;
  const grpc::Status st = stub->Forward(&ctx, r, &resp);
  ASSERT_TRUE(st.ok()) << st.error_message();
  testing::ExpectCorrect(r, resp.o(), resp.lse());
  ASSERT_EQ(::kill(pid, SIGTERM), 0);
  EXPECT_EQ(WaitExit(pid, absl::Seconds(20)), 0);
  server.guard.reaped = true;
}

TEST(BinaryShutdown, ACallArrivingDuringTheGraceIsRefusedUnavailableBeforeItsRequestIsIn) {
  // A Forward whose message never completes holds the shutdown in its grace; a second one that arrives then is
  // answered UNAVAILABLE as soon as its headers are in, not cancelled later when the connections close.
  TcpServer server({"--shutdown_grace_s=20"});
  ASSERT_TRUE(server.serving) << "attnd did not start";
  const pid_t pid = server.guard.pid;
  auto channel = server.channel;
  const int port = server.port;
  const std::string forward = "/attnd.v1.Attention/Forward";
  Trickle held;
  std::thread holder([&] { held = TrickleUnary(port, forward, absl::Hours(1), absl::Seconds(4)); });
  absl::SleepFor(absl::Milliseconds(500));
  ASSERT_EQ(::kill(pid, SIGTERM), 0);
  absl::SleepFor(absl::Milliseconds(300));
  const Trickle late = TrickleUnary(port, forward, absl::Hours(1), absl::Seconds(3));
  holder.join();
  std::printf("late call ended after %.0f ms\n", absl::ToDoubleMilliseconds(late.took));
  EXPECT_TRUE(late.ended);
  EXPECT_LT(late.took, absl::Seconds(1));
  EXPECT_TRUE(absl::StrContains(late.stream_frames, "shutting down")) << absl::CHexEscape(late.stream_frames);
  EXPECT_FALSE(held.ended) << "the call in the grace was not waited for";
  EXPECT_EQ(WaitExit(pid, absl::Seconds(20)), 0);
  server.guard.reaped = true;
}

TEST(BinaryShutdown, GraceBoundsTheExitWhileACpuComputationRuns) {
  // One request whose CPU computation takes far longer than --shutdown_grace_s=1: SIGTERM cancels it to its
  // client when the grace is spent, and the process exits shortly after instead of finishing the computation.
  const std::string sock = "/tmp/attnd_bin_grace_" + std::to_string(::getpid()) + ".sock";
  const pid_t pid = Spawn({ATTND_BINARY, "--listen=", "--unix_socket=" + sock, "--backend=cpu", "--threads=1",
                           "--log_level=warn", "--shutdown_grace_s=1"});
  ASSERT_GT(pid, 0);
  ChildGuard guard{pid};
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  auto channel = grpc::CreateCustomChannel("unix:" + sock, grpc::InsecureChannelCredentials(), args);
  const absl::Time end = absl::Now() + absl::Seconds(20);
  while (!Serving(channel) && absl::Now() < end) absl::SleepFor(absl::Milliseconds(20));
  ASSERT_TRUE(Serving(channel)) << "attnd did not start";
  auto stub = v1::Attention::NewStub(channel);
  const v1::ForwardRequest r = testing::MakeRequest({1, 2048, 2048, 16, 16, 128}, v1::MASK_TYPE_NONE, false, 62);
  grpc::Status status;
  std::thread caller([&] {
    grpc::ClientContext ctx;
    v1::ForwardResponse resp;
    status = stub->Forward(&ctx, r, &resp);
  });
  struct Join {
    std::thread& t;
    ~Join() {
      if (t.joinable()) t.join();
    }
  } join{caller};
  bool computing = false;
  for (const absl::Time until = absl::Now() + absl::Seconds(20); !computing && absl::Now() < until;) {
    grpc::ClientContext ctx;
    v1::ServerStats stats;
    computing = stub->GetStats(&ctx, v1::GetStatsRequest(), &stats).ok() && stats.in_flight() == 1 &&
                stats.queue_depth() == 0;
    if (!computing) absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_TRUE(computing);
  const absl::Time signalled = absl::Now();
  ASSERT_EQ(::kill(pid, SIGTERM), 0);
  EXPECT_EQ(WaitExit(pid, absl::Seconds(30)), 0);
  guard.reaped = true;
  const absl::Duration took = absl::Now() - signalled;
  caller.join();
  EXPECT_LT(took, absl::Seconds(3)) << "the exit waited for the computation";
  EXPECT_GE(took, absl::Milliseconds(900)) << "the grace was not given";
  EXPECT_FALSE(status.ok());
  struct stat st;
  EXPECT_NE(::stat(sock.c_str(), &st), 0) << "socket file left behind";
}

TEST(BinaryFlags, BadFlagsExitTwo) {
  const std::vector<std::vector<std::string>> bad = {
      {ATTND_BINARY, "--backend=tpu"},
      {ATTND_BINARY, "--log_level=loud"},
      {ATTND_BINARY, "--devices=0,x"},
      {ATTND_BINARY, "--listen=", "--unix_socket="},
      {ATTND_BINARY, "--max_queue=0"},
      {ATTND_BINARY, "--grpc_arg=not-a-pair"},
      {ATTND_BINARY, "--stream_idle_timeout_s=-1"},
      {ATTND_BINARY, "--keepalive_time_s=nan"},
      {ATTND_BINARY, "--sequence_device_moves_share_pool=sometimes"},
  };
  for (const auto& args : bad) {
    SCOPED_TRACE(args.back());
    const pid_t pid = Spawn(args);
    ASSERT_GT(pid, 0);
    EXPECT_EQ(WaitExit(pid, absl::Seconds(20)), 2);
  }
}

TEST(BinaryFlags, HelpListsTheFlagsAndExitsZero) {
  for (const char* flag : {"--help", "--helpshort", "-h"}) {
    SCOPED_TRACE(flag);
    FILE* p = ::popen((std::string(ATTND_BINARY) + " " + flag + " 2>&1").c_str(), "r");
    ASSERT_NE(p, nullptr);
    std::string out;
    char buf[4096];
    for (size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
    const int st = ::pclose(p);
    ASSERT_TRUE(WIFEXITED(st));
    EXPECT_EQ(WEXITSTATUS(st), 0) << out;
    EXPECT_NE(out.find("attnd --listen="), std::string::npos) << out;  // the usage message
    EXPECT_NE(out.find("--listen (TCP listener"), std::string::npos) << out;
    EXPECT_NE(out.find("--max_calls_per_client ("), std::string::npos) << out;
    EXPECT_NE(out.find("default: 256"), std::string::npos) << out;  // --max_queue
    EXPECT_EQ(out.find("No flags matched"), std::string::npos) << out;
  }
}

}  // namespace
}  // namespace attnd
