// The Prometheus endpoint, scraped over HTTP from a live server after real RPCs: counters move by exactly the
// calls and bytes sent, histograms are well formed, gauges follow the backend; plus the access log and the
// generated request ids.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/notification.h"
#include "absl/strings/str_cat.h"
#include "attnd/client/client.h"
#include "attnd/client/shm_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "metrics.h"
#include "server_raw_call.h"
#include "server_test_util.h"
#include "spdlog/sinks/ostream_sink.h"
#include "spdlog/spdlog.h"

namespace attnd::testing {
namespace {

// One HTTP/1.0 GET; returns the whole response (status line, headers, body).
std::string HttpGet(int port, const std::string& path) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string out;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string req = "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    if (::write(fd, req.data(), req.size()) == static_cast<ssize_t>(req.size())) {
      char buf[65536];
      ssize_t n;
      while ((n = ::read(fd, buf, sizeof(buf))) > 0) out.append(buf, static_cast<size_t>(n));
    }
  }
  ::close(fd);
  return out;
}

// A parsed exposition: sample values by "name{labels}" exactly as written, and the TYPE of each family.
struct Scrape {
  std::map<std::string, double> samples;
  std::map<std::string, std::string> types, helps;

  double Get(const std::string& series) const {
    auto it = samples.find(series);
    return it == samples.end() ? -1 : it->second;
  }
};

Scrape Parse(const std::string& http) {
  Scrape s;
  const size_t body = http.find("\r\n\r\n");
  EXPECT_NE(body, std::string::npos) << http;
  EXPECT_TRUE(absl::StartsWith(http, "HTTP/1.1 200") || absl::StartsWith(http, "HTTP/1.0 200")) << http.substr(0, 80);
  // prometheus-cpp 1.0 says "text/plain; charset=utf-8"; Prometheus reads any text/plain as format 0.0.4.
  EXPECT_TRUE(absl::StrContains(http, "Content-Type: text/plain")) << "content type of the text format";
  for (absl::string_view line : absl::StrSplit(http.substr(body + 4), '\n', absl::SkipEmpty())) {
    if (absl::ConsumePrefix(&line, "# TYPE ")) {
      std::vector<std::string> f = absl::StrSplit(line, ' ');
      EXPECT_EQ(f.size(), 2u) << line;
      if (f.size() == 2) s.types[f[0]] = f[1];
      continue;
    }
    if (absl::ConsumePrefix(&line, "# HELP ")) {
      s.helps[std::string(line.substr(0, line.find(' ')))] = std::string(line.substr(line.find(' ') + 1));
      continue;
    }
    const size_t space = line.rfind(' ');
    EXPECT_NE(space, absl::string_view::npos) << line;
    double v = 0;
    const std::string value(line.substr(space + 1));
    if (value == "Nan" || value == "NaN") continue;  // prometheus-cpp's own summary before its first scrape
    EXPECT_TRUE(absl::SimpleAtod(value, &v)) << line;
    s.samples[std::string(line.substr(0, space))] = v;
  }
  return s;
}

std::string Series(const std::string& name, const std::string& labels) { return name + "{" + labels + "}"; }

class MetricsTest : public ::testing::Test {
 protected:
  void Start(server::CpuBackendHooks hooks = {}, const std::string& shm_socket = "") {
    server::ServerOptions o;
    o.observability.metrics_listen = "127.0.0.1:0";
    o.shm.socket = shm_socket;
    server_ = std::make_unique<TestServer>(o, server::BackendOptions{}, std::move(hooks));
    ASSERT_NE(server_->server, nullptr);
    port_ = server_->server->metrics_port();
    ASSERT_GT(port_, 0);
  }
  Scrape Get() { return Parse(HttpGet(port_, "/metrics")); }

  std::unique_ptr<TestServer> server_;
  int port_ = 0;
};

TEST_F(MetricsTest, CountersMoveByTheCallsAndBytesSent) {
  Start();
  const Scrape before = Get();
  // Families and their TYPEs are present before any call, with Prometheus naming (base units, _total).
  for (const char* counter : {"attnd_requests_total", "attnd_bytes_received_total", "attnd_bytes_sent_total",
                              "attnd_tensor_map_cache_hits_total", "attnd_tensor_map_cache_misses_total",
                              "attnd_auth_failures_total"}) {
    EXPECT_EQ(before.types.count(counter) ? before.types.at(counter) : "", "counter") << counter;
    EXPECT_FALSE(before.helps.count(counter) == 0 || before.helps.at(counter).empty()) << counter;
  }
  EXPECT_EQ(before.types.at("attnd_request_duration_seconds"), "histogram");
  for (const char* gauge : {"attnd_in_flight", "attnd_queue_depth", "attnd_device_memory_used_bytes",
                            "attnd_streams_receiving"}) {
    EXPECT_EQ(before.types.count(gauge) ? before.types.at(gauge) : "", "gauge") << gauge;
  }
  EXPECT_EQ(before.Get("attnd_streams_receiving"), 0);
  EXPECT_EQ(before.Get(Series("attnd_requests_total", "code=\"OK\",method=\"Forward\"")), 0);

  auto stub = server_->Stub();
  uint64_t sent = 0, received = 0;
  const Shape shapes[] = {{1, 16, 16, 2, 2, 64}, {2, 33, 17, 4, 1, 64}, {1, 8, 40, 2, 1, 128}};
  uint64_t seed = 100;
  for (const Shape& s : shapes) {
    ++seed;
    const v1::ForwardRequest r = MakeRequest(s, v1::MASK_TYPE_NONE, seed % 2 == 0, seed);
    grpc::ClientContext ctx;
    v1::ForwardResponse resp;
    ASSERT_TRUE(stub->Forward(&ctx, r, &resp).ok());
    ExpectCorrect(r, resp.o(), resp.lse());
    sent += r.ByteSizeLong();
    received += resp.ByteSizeLong();
  }
  {
    v1::ForwardRequest bad = MakeRequest({1, 4, 4, 1, 1, 64}, v1::MASK_TYPE_NONE, false, 7);
    bad.mutable_shape()->set_head_dim(96);  // unsupported: INVALID_ARGUMENT, after the bytes were received
    grpc::ClientContext ctx;
    v1::ForwardResponse resp;
    EXPECT_EQ(stub->Forward(&ctx, bad, &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    sent += bad.ByteSizeLong();
  }
  {
    grpc::ClientContext ctx;
    v1::ServerInfo info;
    ASSERT_TRUE(stub->GetServerInfo(&ctx, v1::GetServerInfoRequest(), &info).ok());
  }

  const Scrape after = Get();
  auto delta = [&](const std::string& series) { return after.Get(series) - std::max(0.0, before.Get(series)); };
  EXPECT_EQ(delta(Series("attnd_requests_total", "code=\"OK\",method=\"Forward\"")), 3);
  EXPECT_EQ(after.Get(Series("attnd_requests_total", "code=\"INVALID_ARGUMENT\",method=\"Forward\"")), 1);
  EXPECT_EQ(after.Get(Series("attnd_requests_total", "code=\"OK\",method=\"GetServerInfo\"")), 1);
  EXPECT_EQ(delta(Series("attnd_bytes_received_total", "method=\"Forward\"")), static_cast<double>(sent));
  EXPECT_EQ(delta(Series("attnd_bytes_sent_total", "method=\"Forward\"")), static_cast<double>(received));

  // Histograms: total counts every call, queue and kernel the ones that computed; buckets cumulative, the
  // +Inf bucket equals the count, and the sums are positive durations in seconds.
  const std::string h = "attnd_request_duration_seconds";
  for (const auto& [phase, n] : std::vector<std::pair<std::string, double>>{{"total", 4}, {"queue", 3}, {"kernel", 3}}) {
    SCOPED_TRACE(phase);
    const std::string labels = "method=\"Forward\",phase=\"" + phase + "\"";
    EXPECT_EQ(after.Get(Series(h + "_count", labels)), n);
    EXPECT_GT(after.Get(Series(h + "_sum", labels)), 0);
    EXPECT_LT(after.Get(Series(h + "_sum", labels)), 60);
    EXPECT_EQ(after.Get(Series(h + "_bucket", labels + ",le=\"+Inf\"")), n);
    std::map<double, double> buckets;  // le -> cumulative count, ordered by le
    const std::string prefix = h + "_bucket{" + labels + ",le=\"";
    for (const auto& [series, v] : after.samples) {
      if (!absl::StartsWith(series, prefix) || absl::StrContains(series, "+Inf")) continue;
      double le = 0;
      ASSERT_TRUE(absl::SimpleAtod(series.substr(prefix.size(), series.size() - prefix.size() - 2), &le)) << series;
      buckets[le] = v;
    }
    EXPECT_GE(buckets.size(), 10u);
    double last = 0;
    for (const auto& [le, v] : buckets) {
      EXPECT_GE(v, last) << "le=" << le;
      last = v;
    }
    EXPECT_LE(last, n);
  }
  // The kernel time of the CPU backend is what the replies reported; total is at least kernel.
  EXPECT_GE(after.Get(Series(h + "_sum", "method=\"Forward\",phase=\"total\"")),
            after.Get(Series(h + "_sum", "method=\"Forward\",phase=\"kernel\"")));
  EXPECT_EQ(after.Get("attnd_in_flight"), 0);
  EXPECT_EQ(after.Get("attnd_queue_depth"), 0);
  EXPECT_EQ(after.Get("attnd_queue_capacity"), 256);

  // Anything but /metrics is not the endpoint.
  EXPECT_FALSE(absl::StartsWith(HttpGet(port_, "/nothing-here"), "HTTP/1.1 200"));
}

TEST_F(MetricsTest, SharedMemoryChannelCallsAreCountedAsForwardShm) {
  const std::string shm = absl::StrCat(::testing::TempDir(), "attnd_metrics_shm_", ::getpid(), ".sock");
  Start({}, shm);
  client::ShmChannelOptions so;
  so.socket_path = shm;
  auto ch = client::ShmChannel::Connect(so);
  ASSERT_TRUE(ch.ok()) << ch.status();
  uint64_t sent = 0, received = 0;
  for (uint64_t seed : {201, 202}) {
    const v1::ForwardRequest r = MakeRequest({1, 16, 24, 2, 1, 64}, v1::MASK_TYPE_CAUSAL_TOP_LEFT, seed % 2 == 0, seed);
    absl::StatusOr<v1::ForwardResponse> resp = (*ch)->Forward(r);
    ASSERT_TRUE(resp.ok()) << resp.status();
    ExpectCorrect(r, resp->o(), resp->lse());
    sent += r.ByteSizeLong();
    received += resp->ByteSizeLong();
  }
  v1::ForwardRequest bad = MakeRequest({1, 4, 4, 1, 1, 64}, v1::MASK_TYPE_NONE, false, 7);
  bad.mutable_shape()->set_head_dim(96);
  EXPECT_EQ((*ch)->Forward(bad).status().code(), absl::StatusCode::kInvalidArgument);
  sent += bad.ByteSizeLong();

  const Scrape after = Get();
  EXPECT_EQ(after.Get(Series("attnd_requests_total", "code=\"OK\",method=\"ForwardShm\"")), 2);
  EXPECT_EQ(after.Get(Series("attnd_requests_total", "code=\"INVALID_ARGUMENT\",method=\"ForwardShm\"")), 1);
  EXPECT_EQ(after.Get(Series("attnd_bytes_received_total", "method=\"ForwardShm\"")), static_cast<double>(sent));
  EXPECT_EQ(after.Get(Series("attnd_bytes_sent_total", "method=\"ForwardShm\"")), static_cast<double>(received));
  const std::string h = "attnd_request_duration_seconds";
  EXPECT_EQ(after.Get(Series(h + "_count", "method=\"ForwardShm\",phase=\"total\"")), 3);
  EXPECT_EQ(after.Get(Series(h + "_count", "method=\"ForwardShm\",phase=\"kernel\"")), 2);
  // Not counted as gRPC Forward calls.
  EXPECT_LE(after.Get(Series("attnd_requests_total", "code=\"OK\",method=\"Forward\"")), 0);
}

TEST_F(MetricsTest, ForwardStreamIsCountedUnderItsOwnMethod) {
  Start();
  client::ClientOptions co;
  co.target = "127.0.0.1:" + std::to_string(server_->server->tcp_port());
  co.transport = client::Transport::kStream;
  co.stream_chunk_bytes = 4096;
  auto c = client::Client::Create(co);
  ASSERT_TRUE(c.ok());
  const v1::ForwardRequest r = MakeRequest({1, 64, 64, 2, 2, 64}, v1::MASK_TYPE_CAUSAL_TOP_LEFT, true, 5);
  auto res = (*c)->Forward(r);
  ASSERT_TRUE(res.ok()) << res.status();
  ExpectCorrect(r, res->o, res->lse);
  const Scrape s = Get();
  EXPECT_EQ(s.Get(Series("attnd_requests_total", "code=\"OK\",method=\"ForwardStream\"")), 1);
  EXPECT_EQ(s.Get(Series("attnd_requests_total", "code=\"OK\",method=\"Forward\"")), 0);
  // Every tensor byte crossed the stream (plus framing of the header and chunk messages).
  const double tensors_in = static_cast<double>(r.q().data().size() + r.k().data().size() + r.v().data().size());
  EXPECT_GT(s.Get(Series("attnd_bytes_received_total", "method=\"ForwardStream\"")), tensors_in);
  EXPECT_LT(s.Get(Series("attnd_bytes_received_total", "method=\"ForwardStream\"")), tensors_in + 4096);
  EXPECT_GT(s.Get(Series("attnd_bytes_sent_total", "method=\"ForwardStream\"")),
            static_cast<double>(res->o.size() + res->lse.size()));
  EXPECT_EQ(s.Get(Series("attnd_request_duration_seconds_count", "method=\"ForwardStream\",phase=\"kernel\"")), 1);
}

TEST_F(MetricsTest, InFlightAndQueueDepthFollowTheBackend) {
  absl::Notification release;
  Start({[&](const server::ForwardJob&) { release.WaitForNotification(); }});
  // Two workers (TestServer's default) held, one more request queued behind them.
  auto stub = server_->Stub();
  std::vector<std::thread> callers;
  for (int i = 0; i < 3; ++i) {
    callers.emplace_back([&, i] {
      const v1::ForwardRequest r = MakeRequest({1, 8, 8, 1, 1, 64}, v1::MASK_TYPE_NONE, false, 200 + i);
      grpc::ClientContext ctx;
      v1::ForwardResponse resp;
      EXPECT_TRUE(stub->Forward(&ctx, r, &resp).ok());
    });
  }
  Scrape s;
  for (int i = 0; i < 500; ++i) {
    s = Get();
    if (s.Get("attnd_in_flight") == 3 && s.Get("attnd_queue_depth") == 1) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(s.Get("attnd_in_flight"), 3);
  EXPECT_EQ(s.Get("attnd_queue_depth"), 1);
  release.Notify();
  for (std::thread& t : callers) t.join();
  s = Get();
  EXPECT_EQ(s.Get("attnd_in_flight"), 0);
  EXPECT_EQ(s.Get("attnd_queue_depth"), 0);
  EXPECT_EQ(s.Get(Series("attnd_requests_total", "code=\"OK\",method=\"Forward\"")), 3);
}

TEST(MetricsListenTest, AnAddressInUseFailsTheStartNamingTheFlag) {
  server::ServerOptions o;
  o.observability.metrics_listen = "127.0.0.1:0";
  TestServer first(o);
  ASSERT_NE(first.server, nullptr);
  o.observability.metrics_listen = "127.0.0.1:" + std::to_string(first.server->metrics_port());
  auto backend = std::make_unique<server::CpuBackend>(server::BackendOptions{});
  o.network.listen = "127.0.0.1:0";
  auto second = server::Server::Create(o, std::move(backend));
  ASSERT_FALSE(second.ok());
  EXPECT_TRUE(absl::StrContains(second.status().message(), "metrics_listen")) << second.status();
}

// The backend's gauges and cache counters as a CUDA backend would report them, through ServerMetrics alone.
class FakeGpuBackend final : public server::Backend {
 public:
  std::string name() const override { return "cuda"; }
  std::vector<server::DeviceDescription> devices() const override { return {}; }
  std::vector<int64_t> supported_head_dims() const override { return {64}; }
  std::vector<DType> supported_dtypes() const override { return {DType::kBF16}; }
  std::vector<std::string> kernels() const override { return {}; }
  absl::Status Accept(server::ForwardJob*) const override { return absl::OkStatus(); }
  absl::Status Submit(std::unique_ptr<server::ForwardJob>) override { return absl::UnavailableError("fake"); }
  uint32_t queue_depth() const override { return 5; }
  uint32_t in_flight() const override { return 7; }
  void Shutdown() override {}
  server::BackendStats stats() const override { return {11, 3}; }
  std::vector<server::DeviceMemoryUse> device_memory() const override { return {{0, 1ull << 33}, {3, 12345}}; }
  uint32_t max_queue() const override { return 64; }
};

TEST(ServerMetricsTest, BackendGaugesPerDevice) {
  FakeGpuBackend backend;
  server::ServerMetrics metrics(&backend);
  const Scrape s = Parse("HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n" + metrics.Scrape());
  EXPECT_EQ(s.Get("attnd_in_flight"), 7);
  EXPECT_EQ(s.Get("attnd_queue_depth"), 5);
  EXPECT_EQ(s.Get("attnd_queue_capacity"), 64);
  EXPECT_EQ(s.Get("attnd_tensor_map_cache_hits_total"), 11);
  EXPECT_EQ(s.Get("attnd_tensor_map_cache_misses_total"), 3);
  EXPECT_EQ(s.Get(Series("attnd_device_memory_used_bytes", "device=\"0\"")), 8589934592.0);
  EXPECT_EQ(s.Get(Series("attnd_device_memory_used_bytes", "device=\"3\"")), 12345);
}

// The access log: one info line per RPC with method, peer, request id, shape, status, times and bytes;
// a request without an id gets a generated one, echoed in the reply; --access_log=false silences it.
class AccessLogTest : public ::testing::Test {
 protected:
  void SetUp() override {
    previous_ = spdlog::default_logger();
    auto logger = std::make_shared<spdlog::logger>("test", std::make_shared<spdlog::sinks::ostream_sink_mt>(log_));
    logger->set_level(spdlog::level::info);
    spdlog::set_default_logger(logger);
  }
  void TearDown() override { spdlog::set_default_logger(previous_); }
  std::vector<std::string> AccessLines() {
    spdlog::default_logger()->flush();
    std::vector<std::string> out;
    for (absl::string_view l : absl::StrSplit(log_.str(), '\n')) {
      if (absl::StrContains(l, "access method=")) out.emplace_back(l);
    }
    return out;
  }

  std::ostringstream log_;
  std::shared_ptr<spdlog::logger> previous_;
};

TEST_F(AccessLogTest, OneLinePerRequestWithItsIdShapeStatusAndBytes) {
  TestServer server;
  auto stub = server.Stub();
  v1::ForwardRequest r = MakeRequest({2, 16, 24, 4, 2, 64}, v1::MASK_TYPE_NONE, false, 9);
  r.set_request_id("log-me\n forged=1");  // client text: must come out escaped, on one line
  const uint64_t first_bytes = r.ByteSizeLong();
  {
    grpc::ClientContext ctx;
    v1::ForwardResponse resp;
    ASSERT_TRUE(stub->Forward(&ctx, r, &resp).ok());
  }
  r.clear_request_id();
  std::string generated;
  {
    grpc::ClientContext ctx;
    v1::ForwardResponse resp;
    ASSERT_TRUE(stub->Forward(&ctx, r, &resp).ok());
    generated = resp.request_id();
    ExpectCorrect(r, resp.o(), resp.lse());
  }
  EXPECT_TRUE(absl::StartsWith(generated, "attnd-")) << generated;
  {
    v1::ForwardRequest bad = r;
    bad.mutable_shape()->set_q_heads(3);  // not a multiple of kv_heads
    bad.set_request_id("bad-1");
    grpc::ClientContext ctx;
    v1::ForwardResponse resp;
    EXPECT_EQ(stub->Forward(&ctx, bad, &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  std::string named_failure;  // a failing request without an id: the id still reaches client and log
  {
    v1::ForwardRequest bad = r;
    bad.mutable_shape()->set_q_heads(3);
    bad.clear_request_id();
    grpc::ClientContext ctx;
    v1::ForwardResponse resp;
    EXPECT_EQ(stub->Forward(&ctx, bad, &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    const auto& trailing = ctx.GetServerTrailingMetadata();
    const auto it = trailing.find("attnd-request-id");
    ASSERT_NE(it, trailing.end());
    named_failure = std::string(it->second.data(), it->second.size());
  }
  EXPECT_TRUE(absl::StartsWith(named_failure, "attnd-")) << named_failure;
  const std::vector<std::string> lines = AccessLines();
  ASSERT_EQ(lines.size(), 4u) << log_.str();
  EXPECT_TRUE(absl::StrContains(lines[3], "request_id=\"" + named_failure + "\" code=INVALID_ARGUMENT")) << lines[3];
  EXPECT_TRUE(absl::StrContains(lines[0], "request_id=\"log-me\\n forged=1\"")) << lines[0];
  EXPECT_TRUE(absl::StrContains(lines[0], "method=Forward peer=ipv4:127.0.0.1:")) << lines[0];
  EXPECT_TRUE(absl::StrContains(lines[0], "code=OK")) << lines[0];
  EXPECT_TRUE(absl::StrContains(lines[0], "shape=2x16x24x4x2x64/DTYPE_BF16/MASK_TYPE_NONE")) << lines[0];
  EXPECT_TRUE(absl::StrContains(lines[0], "queue_ms=")) << lines[0];
  EXPECT_TRUE(absl::StrContains(lines[0], "kernel_ms=")) << lines[0];
  EXPECT_TRUE(absl::StrContains(lines[0], "bytes_in=" + std::to_string(first_bytes))) << lines[0];
  EXPECT_TRUE(absl::StrContains(lines[1], "request_id=\"" + generated + "\"")) << lines[1];
  EXPECT_TRUE(absl::StrContains(lines[2], "request_id=\"bad-1\" code=INVALID_ARGUMENT")) << lines[2];
  EXPECT_TRUE(absl::StrContains(lines[2], "error=\"shape.")) << lines[2];
}

// A unary Forward whose message never comes: its headers go out, then nothing until `cancel_after` (then the
// client cancels) or the deadline.
grpc::Status ForwardWithoutItsMessage(const std::shared_ptr<grpc::Channel>& channel, absl::Duration deadline,
                                      absl::Duration cancel_after) {
  grpc::GenericStub stub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  grpc::CompletionQueue cq;
  auto call = stub.PrepareCall(&ctx, "/attnd.v1.Attention/Forward", &cq);
  void* tag;
  bool ok;
  call->StartCall(reinterpret_cast<void*>(1));
  EXPECT_TRUE(cq.Next(&tag, &ok) && ok);
  if (cancel_after < deadline) {
    absl::SleepFor(cancel_after);  // the server has the call's headers by then; nothing else tells the client
    ctx.TryCancel();
  }
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(2));
  while (cq.Next(&tag, &ok) && tag != reinterpret_cast<void*>(2)) {
  }
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  return status;
}

// What the client saw is what GetStats, the metrics and the access log book, for a call cancelled or past its
// deadline while its request was arriving, while it was computed, and one answered after the client left.
TEST_F(AccessLogTest, CancellationsAndDeadlinesAreBookedAsTheClientSawThemEverywhere) {
  testing::Gate cancelled_gate, late_gate;
  server::CpuBackendHooks hooks;
  // Each held call is answered OK once the server has seen it end (the client's cancel, or the deadline).
  hooks.before_compute = [&](const server::ForwardJob& job) {
    if (job.request_id == "cancelled") cancelled_gate.Hooks().before_compute(job);
    if (job.request_id == "late") late_gate.Hooks().before_compute(job);
    if (job.request_id == "cancelled" || job.request_id == "late") {
      EXPECT_TRUE(testing::WaitFor(job.cancelled));
    }
  };
  server::ServerOptions o;
  o.observability.metrics_listen = "127.0.0.1:0";
  TestServer server(o, server::BackendOptions{}, hooks);
  ASSERT_NE(server.server, nullptr);
  auto channel = server.Channel();
  const auto line_count = [&](size_t n) { return testing::WaitFor([&] { return AccessLines().size() == n; }); };

  EXPECT_EQ(ForwardWithoutItsMessage(channel, absl::Milliseconds(300), absl::InfiniteDuration()).error_code(),
            grpc::StatusCode::DEADLINE_EXCEEDED);
  ASSERT_TRUE(line_count(1)) << log_.str();
  EXPECT_EQ(ForwardWithoutItsMessage(channel, absl::Seconds(20), absl::Milliseconds(200)).error_code(),
            grpc::StatusCode::CANCELLED);
  ASSERT_TRUE(line_count(2)) << log_.str();

  auto stub = v1::Attention::NewStub(channel);
  const auto held_call = [&](const std::string& id, testing::Gate& gate, absl::Duration deadline, bool cancel) {
    v1::ForwardRequest r = MakeRequest({1, 16, 16, 2, 2, 64});
    r.set_request_id(id);
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
    grpc::Status status;
    std::thread caller([&] {
      v1::ForwardResponse resp;
      status = stub->Forward(&ctx, r, &resp);
    });
    EXPECT_TRUE(testing::WaitFor([&] { return gate.entered() == 1; }));
    if (cancel) ctx.TryCancel();
    caller.join();  // the client has its answer; then the server finishes the computation and replies OK
    gate.Open();
    return status;
  };
  EXPECT_EQ(held_call("cancelled", cancelled_gate, absl::Seconds(20), true).error_code(), grpc::StatusCode::CANCELLED);
  ASSERT_TRUE(line_count(3)) << log_.str();
  EXPECT_EQ(held_call("late", late_gate, absl::Milliseconds(300), false).error_code(),
            grpc::StatusCode::DEADLINE_EXCEEDED);
  ASSERT_TRUE(line_count(4)) << log_.str();

  const std::vector<std::string> lines = AccessLines();
  const char* const want[] = {"code=DEADLINE_EXCEEDED", "code=CANCELLED", "code=CANCELLED", "code=DEADLINE_EXCEEDED"};
  for (int i = 0; i < 4; ++i) {
    EXPECT_TRUE(absl::StrContains(lines[i], "method=Forward ")) << lines[i];
    EXPECT_TRUE(absl::StrContains(lines[i], want[i])) << lines[i];
  }
  EXPECT_TRUE(absl::StrContains(lines[2], "request_id=\"cancelled\"")) << lines[2];
  EXPECT_TRUE(absl::StrContains(lines[3], "request_id=\"late\"")) << lines[3];

  grpc::ClientContext ctx;
  v1::ServerStats stats;
  ASSERT_TRUE(stub->GetStats(&ctx, v1::GetStatsRequest(), &stats).ok());
  bool seen = false;
  for (const v1::RpcStats& r : stats.rpcs()) {
    if (r.method() != "Forward") continue;
    seen = true;
    EXPECT_EQ(r.count(), 4u);
    EXPECT_EQ(r.errors(), 4u);
    EXPECT_EQ(r.errors_by_code().size(), 2u);
    EXPECT_EQ(r.errors_by_code().count("DEADLINE_EXCEEDED") ? r.errors_by_code().at("DEADLINE_EXCEEDED") : 0, 2u);
    EXPECT_EQ(r.errors_by_code().count("CANCELLED") ? r.errors_by_code().at("CANCELLED") : 0, 2u);
  }
  EXPECT_TRUE(seen);

  const Scrape m = Parse(HttpGet(server.server->metrics_port(), "/metrics"));
  EXPECT_EQ(m.Get(Series("attnd_requests_total", "code=\"DEADLINE_EXCEEDED\",method=\"Forward\"")), 2);
  EXPECT_EQ(m.Get(Series("attnd_requests_total", "code=\"CANCELLED\",method=\"Forward\"")), 2);
  EXPECT_LE(m.Get(Series("attnd_requests_total", "code=\"OK\",method=\"Forward\"")), 0);  // -1: no such series
  EXPECT_LE(m.Get(Series("attnd_requests_total", "code=\"INVALID_ARGUMENT\",method=\"Forward\"")), 0);
}

// Health probes come every few seconds from orchestrators: they are counted under their full path but written to
// no access-log line.
TEST_F(AccessLogTest, HealthChecksAreCountedButNotLogged) {
  server::ServerOptions o;
  o.observability.metrics_listen = "127.0.0.1:0";
  TestServer server(o);
  ASSERT_NE(server.server, nullptr);
  for (int i = 0; i < 3; ++i) {
    const RawResult r = RawCall(server.Channel(), "/grpc.health.v1.Health/Check", HealthRequest(""));
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  }
  const RawResult unknown = RawCall(server.Channel(), "/grpc.health.v1.Health/Check", HealthRequest("no.such.Service"));
  EXPECT_EQ(unknown.status.error_code(), grpc::StatusCode::NOT_FOUND);
  const Scrape m = Parse(HttpGet(server.server->metrics_port(), "/metrics"));
  EXPECT_EQ(m.Get(Series("attnd_requests_total", "code=\"OK\",method=\"grpc.health.v1.Health/Check\"")), 3);
  EXPECT_EQ(m.Get(Series("attnd_requests_total", "code=\"NOT_FOUND\",method=\"grpc.health.v1.Health/Check\"")), 1);
  EXPECT_TRUE(AccessLines().empty()) << log_.str();
}

TEST_F(AccessLogTest, OffByOption) {
  server::ServerOptions o;
  o.observability.access_log = false;
  TestServer server(o);
  auto stub = server.Stub();
  const v1::ForwardRequest r = MakeRequest({1, 4, 4, 1, 1, 64});
  grpc::ClientContext ctx;
  v1::ForwardResponse resp;
  ASSERT_TRUE(stub->Forward(&ctx, r, &resp).ok());
  EXPECT_TRUE(AccessLines().empty()) << log_.str();
}

}  // namespace
}  // namespace attnd::testing
