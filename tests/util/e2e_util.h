// Shared pieces of the end-to-end tests: an in-process server on the CPU backend (loopback port and unix
// socket), clients for either transport, and random requests with their double-precision oracle.
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "attnd/client/client.h"
#include "attnd/client/tensors.h"
#include "attnd/server/backend.h"
#include "attnd/server/server.h"
#include "gtest/gtest.h"

namespace attnd::e2e {

enum class Listener { kTcp, kUnix };
// Runs a command (the attn binary, in the CLI suites); returns its exit status and its stdout+stderr.
inline std::pair<int, std::string> RunCommand(const std::string& cmd) {
  std::string out;
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  if (p == nullptr) return {-1, "popen failed"};
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int st = ::pclose(p);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, out};
}

inline const char* ListenerName(Listener l) { return l == Listener::kTcp ? "tcp" : "unix"; }

struct TestServer {
  std::unique_ptr<server::Server> server;
  std::string unix_path;
  std::string shm_path;  // the --shm_socket of shared-memory channels, when started with them
  int port = 0;

  std::string Target(Listener l) const {
    return l == Listener::kTcp ? absl::StrCat("127.0.0.1:", port) : absl::StrCat("unix:", unix_path);
  }
};

using WrapBackend = std::function<std::unique_ptr<server::Backend>(std::unique_ptr<server::Backend>)>;

// A loopback port free now: servers of a fleet must know their address before they start, to advertise it.
inline int FreeLoopbackPort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    if (fd >= 0) ::close(fd);
    return 0;
  }
  ::close(fd);
  return ntohs(a.sin_port);
}

// Serves `so` on the CPU backend made with `bo` (through `wrap` when set) and records the TCP port. Fails the
// test (fatally) if it cannot start.
inline void ServeOnCpu(TestServer* out, const server::ServerOptions& so, const server::BackendOptions& bo,
                       const WrapBackend& wrap) {
  auto backend = server::MakeBackend("cpu", bo);
  ASSERT_TRUE(backend.ok()) << backend.status();
  std::unique_ptr<server::Backend> served = std::move(*backend);
  if (wrap) served = wrap(std::move(served));
  auto s = server::Server::Create(so, std::move(served));
  ASSERT_TRUE(s.ok()) << s.status();
  out->server = std::move(*s);
  out->port = out->server->tcp_port();
}

// A server on 127.0.0.1:<free port> and on a fresh unix socket (and, with `shm`, shared-memory channels on
// another). `wrap`, when set, is given the CPU backend and returns the one served (tests that fake what a
// backend reports). Fails the test (fatally) if it cannot start.
inline void StartServer(TestServer* out, uint64_t max_message_bytes = 64ull << 20, int threads = 2,
                        uint32_t max_queue = 256, bool shm = false, const WrapBackend& wrap = nullptr) {
  static std::atomic<int> counter{0};
  server::ServerOptions so;
  so.network.listen = "127.0.0.1:0";
  out->unix_path = absl::StrCat(::testing::TempDir(), "/attnd_e2e_", ::getpid(), "_", counter++, ".sock");
  so.network.unix_socket = out->unix_path;
  if (shm) {
    out->shm_path = absl::StrCat(::testing::TempDir(), "/attnd_e2e_", ::getpid(), "_", counter++, ".shm");
    so.shm.socket = out->shm_path;
  }
  so.limits.max_message_bytes = max_message_bytes;
  so.security.reflection = true;  // off by default; ForwardTest.ReflectionListsTheService calls it
  server::BackendOptions bo;
  bo.threads = threads;
  bo.max_queue = max_queue;
  ServeOnCpu(out, so, bo, wrap);
  if (::testing::Test::HasFatalFailure()) return;
  ASSERT_GT(out->port, 0);
}

// One in-process server for a whole test suite: starting one per test would dominate the suites' time.
template <typename Base = ::testing::Test, uint64_t kMaxMessageBytes = (64ull << 20)>
class SharedServerSuite : public Base {
 protected:
  static void SetUpTestSuite() {
    server_ = new TestServer;
    StartServer(server_, kMaxMessageBytes);
  }
  static void TearDownTestSuite() {
    if (server_->server) server_->server->Shutdown();
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override { ASSERT_NE(server_->server, nullptr); }

  static inline TestServer* server_ = nullptr;
};

inline std::unique_ptr<client::Client> Connect(const std::string& target, client::Transport transport = client::Transport::kAuto,
                                               uint64_t chunk_bytes = 0, bool own_connection = false) {
  client::ClientOptions o;
  o.target = target;
  o.transport = transport;
  o.stream_chunk_bytes = chunk_bytes;
  o.own_connection = own_connection;
  o.default_deadline = absl::Seconds(120);
  auto c = client::Client::Create(o);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(*c) : nullptr;
}

// GetSequence of `id` through `stub` itself, as sent: the client library would follow a moved id to its new one,
// where this returns the NOT_FOUND "moved to" (its trailer in `ctx`).
inline grpc::Status GetSequenceAsSent(v1::Attention::Stub* stub, const std::string& id, grpc::ClientContext* ctx,
                                      v1::SequenceInfo* info) {
  v1::GetSequenceRequest get;
  get.set_sequence_id(id);
  return stub->GetSequence(ctx, get, info);
}

// A request with random inputs (distinct per seed) and the oracle of its answer.
struct Case {
  client::RequestSpec spec;
  std::shared_ptr<const v1::ForwardRequest> request;
  std::shared_ptr<const client::Oracle> oracle;
};

inline client::RequestSpec Spec(int64_t batch, int64_t q_len, int64_t kv_len, int64_t q_heads, int64_t kv_heads,
                                int64_t head_dim, Mask mask = Mask::kNone, bool lse = false) {
  client::RequestSpec s;
  s.shape = Shape{batch, q_len, kv_len, q_heads, kv_heads, head_dim};
  s.mask = mask;
  s.want_lse = lse;
  return s;
}

// A float8 spec's inputs are quantized with its descales; those left empty get the values' amax / 448 (the spec in
// the case holds them).
inline Case MakeCase(const client::RequestSpec& spec, uint64_t seed) {
  Case c;
  c.spec = spec;
  std::string q, k, v;
  const Shape& s = spec.shape;
  if (spec.dtype == DType::kFP8E4M3) {
    q = client::RandomFp8Tensor(QElems(s), s.q_heads, s.head_dim, seed * 3, &c.spec.q_descale);
    k = client::RandomFp8Tensor(KVElems(s), s.kv_heads, s.head_dim, seed * 3 + 1, &c.spec.k_descale);
    v = client::RandomFp8Tensor(KVElems(s), s.kv_heads, s.head_dim, seed * 3 + 2, &c.spec.v_descale);
  } else {
    q = client::RandomTensor(spec.dtype, QElems(s), seed * 3);
    k = client::RandomTensor(spec.dtype, KVElems(s), seed * 3 + 1);
    v = client::RandomTensor(spec.dtype, KVElems(s), seed * 3 + 2);
  }
  const client::RequestSpec& sent = c.spec;
  auto oracle = client::Oracle::Compute(sent, q, k, v);
  EXPECT_TRUE(oracle.ok()) << oracle.status();
  if (oracle.ok()) c.oracle = std::make_shared<const client::Oracle>(*std::move(oracle));
  c.request = std::make_shared<const v1::ForwardRequest>(
      client::MakeForwardRequest(sent, std::move(q), std::move(k), std::move(v)));
  return c;
}

// Empty when the reply is correct; otherwise why not.
inline std::string CheckReply(const Case& c, const absl::StatusOr<client::ForwardResult>& r) {
  if (!r.ok()) return absl::StrCat("call failed: ", r.status().ToString());
  if (c.oracle == nullptr) return "no oracle";
  if (c.spec.want_lse && r->lse_bytes().empty()) return "LSE missing";
  if (!c.spec.want_lse && !r->lse_bytes().empty()) return "LSE returned unasked";
  const client::VerifyReport v = c.oracle->Check(r->o_bytes(), r->lse_bytes());
  if (!v.pass) return absl::StrCat("wrong answer: ", v.detail);
  return "";
}

}  // namespace attnd::e2e
