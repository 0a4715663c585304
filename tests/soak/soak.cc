// attnd_soak: mixed traffic against a running attnd for a given time, and the server's RSS, descriptors and
// threads sampled from /proc while it runs (scripts/soak.sh starts the server and runs this).
//
// Every call has the outcomes it may end with; any other is an error, and so is a wrong answer (every valid
// Forward is checked against the double-precision reference). The traffic, per client thread, at random:
//   Forward unary and ForwardStream (verified), GetServerInfo, GetStats, health Check;
//   Forward cancelled after 0-20 ms (OK or CANCELLED), a ForwardStream cancelled mid-upload (CANCELLED);
//   Forward with a 1-30 ms deadline (OK or DEADLINE_EXCEEDED);
//   bad input: an unsupported head_dim, random bytes as a Forward message, a stream opening with a chunk
//   (INVALID_ARGUMENT), an unknown method (UNIMPLEMENTED).
//
// Leak rules, checked at the end (the closing line counts them as passed/failed checks). The server is sampled
// quiet twice, after the warm-up and after the run: no call in flight and none for --quiet_s, long enough for its
// idle heap trimmer to hand freed memory back and for gRPC's surplus threads to exit. The second sample is
// retaken every second for up to --settle_s until it is within these bounds of the first:
//   descriptors and threads: at most --slack more (gRPC's own pools come and go);
//   RSS: at most max(--rss_growth_mib, 10% of the first) more. Under load the resident size follows the heap's
//     high-water mark (the server retains freed heap, --retain_heap), so only the quiet, trimmed size shows what
//     is still held: memory a leak keeps grows with the calls made, and a run makes tens of thousands.
#include <dirent.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "attnd/client/client.h"
#include "attnd/client/tensors.h"
#include "attnd/v1/attention.grpc.pb.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "attnd's address");
ABSL_FLAG(int, server_pid, 0, "pid of the server, for RSS, descriptors and threads (0: not sampled)");
ABSL_FLAG(double, duration_s, 120, "seconds of traffic after the warm-up");
ABSL_FLAG(double, warmup_s, 60, "seconds of traffic before the quiet baseline is taken");
ABSL_FLAG(int, clients, 4, "client threads, each with its own connection");
ABSL_FLAG(double, sample_every_s, 2, "seconds between samples");
ABSL_FLAG(int, slack, 2, "descriptors or threads the idle server may hold beyond its idle baseline");
ABSL_FLAG(double, rss_growth_mib, 16, "quiet RSS rise (MiB) after the run over the baseline that counts as a leak");
// The server trims its heap after 10-20 s without a call (kHeapTrimPeriod in server/src/server.cc).
ABSL_FLAG(double, quiet_s, 22, "seconds without a call before a quiet sample");
ABSL_FLAG(double, settle_s, 30, "seconds the after-run sample may take to come within the bounds");
ABSL_FLAG(std::string, csv, "", "write the samples here (t_s,rss_kib,fds,threads,calls,errors)");
ABSL_FLAG(uint64_t, seed, 1, "random seed");

namespace {

using attnd::DType;
using attnd::Shape;
using attnd::client::Client;
using attnd::client::RequestSpec;

struct Sample {
  double t = 0;
  int64_t rss_kib = -1, fds = -1, threads = -1;
  uint64_t calls = 0, errors = 0;
};

Sample Probe(int pid) {
  Sample s;
  if (pid <= 0) return s;
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmRSS:", 0) == 0) s.rss_kib = std::stoll(line.substr(6));
    if (line.rfind("Threads:", 0) == 0) s.threads = std::stoll(line.substr(8));
  }
  if (DIR* d = ::opendir(absl::StrCat("/proc/", pid, "/fd").c_str())) {
    s.fds = 0;
    while (dirent* e = ::readdir(d)) s.fds += e->d_name[0] != '.';
    ::closedir(d);
  }
  return s;
}

// A problem, its inputs and its reference answer, shared by every call that sends it.
struct Case {
  RequestSpec spec;
  std::shared_ptr<const attnd::v1::ForwardRequest> request;
  std::unique_ptr<attnd::client::Oracle> oracle;
};

Case MakeCase(Shape shape, attnd::Mask mask, uint64_t seed, bool verify) {
  Case c;
  c.spec.shape = shape;
  c.spec.mask = mask;
  c.spec.want_lse = true;
  const int64_t q = shape.batch * shape.q_len * shape.q_heads * shape.head_dim;
  const int64_t kv = shape.batch * shape.kv_len * shape.kv_heads * shape.head_dim;
  std::string qb = attnd::client::RandomTensor(DType::kBF16, q, seed);
  std::string kb = attnd::client::RandomTensor(DType::kBF16, kv, seed + 1);
  std::string vb = attnd::client::RandomTensor(DType::kBF16, kv, seed + 2);
  if (verify) {
    auto o = attnd::client::Oracle::Compute(c.spec.ToProblem(), qb, kb, vb, 1);
    if (!o.ok()) {
      std::fprintf(stderr, "soak: reference: %s\n", o.status().ToString().c_str());
      std::exit(2);
    }
    c.oracle = std::make_unique<attnd::client::Oracle>(*std::move(o));
  }
  c.request = std::make_shared<const attnd::v1::ForwardRequest>(
      attnd::client::MakeForwardRequest(c.spec, std::move(qb), std::move(kb), std::move(vb)));
  return c;
}

class Soak {
 public:
  Soak() {
    small_.push_back(MakeCase({1, 64, 96, 4, 2, 64}, attnd::Mask::kNone, 11, true));
    small_.push_back(MakeCase({2, 33, 70, 2, 1, 128}, attnd::Mask::kCausalBottomRight, 21, true));
    big_ = MakeCase({1, 512, 1024, 4, 4, 64}, attnd::Mask::kNone, 31, false);
    // KV steps of 4 q heads : 2 kv heads, head_dim 64: one token, and 64.
    kv_q_ = attnd::client::RandomTensor(DType::kBF16, 4 * 64, 41);
    kv_k_ = attnd::client::RandomTensor(DType::kBF16, 2 * 64, 42);
    kv_v_ = attnd::client::RandomTensor(DType::kBF16, 2 * 64, 43);
    kv_q64_ = attnd::client::RandomTensor(DType::kBF16, 64 * 4 * 64, 44);
    kv_k64_ = attnd::client::RandomTensor(DType::kBF16, 64 * 2 * 64, 45);
    kv_v64_ = attnd::client::RandomTensor(DType::kBF16, 64 * 2 * 64, 46);
  }

  // Runs `seconds` of traffic on `clients` threads.
  void Traffic(double seconds, int clients, uint64_t seed) {
    const absl::Time end = absl::Now() + absl::Seconds(seconds);
    std::vector<std::thread> threads;
    for (int i = 0; i < clients; ++i) {
      threads.emplace_back([this, end, seed, i] {
        attnd::client::ClientOptions o;
        o.target = absl::GetFlag(FLAGS_target);
        o.own_connection = true;
        auto client = Client::Create(o);
        if (!client.ok()) return Error("connect", client.status().ToString());
        std::mt19937_64 rng(seed * 1000 + i);
        while (absl::Now() < end) Step(**client, rng);
      });
    }
    for (auto& t : threads) t.join();
  }

  uint64_t calls() const { return calls_.load(); }
  uint64_t errors() const { return errors_.load(); }
  void PrintCounts() {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [k, n] : outcomes_) std::printf("  %-40s %8lu\n", k.c_str(), static_cast<unsigned long>(n));
  }

 private:
  void Error(const std::string& what, const std::string& detail) {
    const uint64_t n = errors_.fetch_add(1);
    if (n < 20) std::fprintf(stderr, "soak: ERROR %s: %s\n", what.c_str(), detail.c_str());
  }

  // Records a finished call: `code` must be one of `allowed`.
  void Done(const char* what, grpc::StatusCode code, std::initializer_list<grpc::StatusCode> allowed,
            const std::string& message) {
    calls_.fetch_add(1);
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++outcomes_[absl::StrCat(what, " ", static_cast<int>(code))];
    }
    if (std::find(allowed.begin(), allowed.end(), code) == allowed.end()) {
      Error(what, absl::StrCat("code ", static_cast<int>(code), ": ", message));
    }
  }

  void Step(Client& client, std::mt19937_64& rng) {
    const int pick = static_cast<int>(rng() % 100);
    auto stub = attnd::v1::Attention::NewStub(client.channel());
    if (pick < 20) return Verified(client, rng, attnd::client::Transport::kUnary, "forward");
    if (pick < 35) return Verified(client, rng, attnd::client::Transport::kStream, "stream");
    if (pick < 40) {
      auto r = client.ServerInfo(/*refresh=*/true);
      return Done("info", static_cast<grpc::StatusCode>(r.status().code()), {grpc::StatusCode::OK}, r.status().ToString());
    }
    if (pick < 45) {
      auto r = client.Stats();
      return Done("stats", static_cast<grpc::StatusCode>(r.status().code()), {grpc::StatusCode::OK}, r.status().ToString());
    }
    if (pick < 50) {
      absl::Status s = client.CheckHealth();
      return Done("health", static_cast<grpc::StatusCode>(s.code()), {grpc::StatusCode::OK}, s.ToString());
    }
    if (pick < 60) return CancelUnary(*stub, rng);
    if (pick < 65) return CancelStream(*stub, rng);
    if (pick < 75) {
      attnd::client::CallOptions call;
      call.deadline = absl::Milliseconds(1 + static_cast<int>(rng() % 30));
      auto r = client.Forward(*big_.request, call);
      return Done("deadline", static_cast<grpc::StatusCode>(r.status().code()),
                  {grpc::StatusCode::OK, grpc::StatusCode::DEADLINE_EXCEEDED}, r.status().ToString());
    }
    if (pick < 80) {
      attnd::v1::ForwardRequest bad = *small_[0].request;
      bad.mutable_shape()->set_head_dim(96);
      auto r = client.Forward(bad);
      return Done("bad_shape", static_cast<grpc::StatusCode>(r.status().code()), {grpc::StatusCode::INVALID_ARGUMENT},
                  r.status().ToString());
    }
    if (pick < 90) return RawBytes(client, rng);
    if (pick < 93) return ChunkFirst(*stub);
    if (pick < 96) return KvSteps(client, rng);
    if (pick < 98) return KvStreamCancelled(client, *stub, rng);
    grpc::GenericStub generic(client.channel());
    grpc::ClientContext ctx;
    grpc::Slice empty;
    grpc::ByteBuffer req(&empty, 1), resp;  // a default ByteBuffer is no message at all: gRPC aborts on it
    std::promise<grpc::Status> done;
    generic.UnaryCall(&ctx, "/attnd.v1.Attention/NoSuchMethod", grpc::StubOptions(), &req, &resp,
                      [&](grpc::Status s) { done.set_value(s); });
    const grpc::Status s = done.get_future().get();
    Done("unknown_method", s.error_code(), {grpc::StatusCode::UNIMPLEMENTED}, s.error_message());
  }

  void Verified(Client& client, std::mt19937_64& rng, attnd::client::Transport t, const char* what) {
    const Case& c = small_[rng() % small_.size()];
    attnd::client::CallOptions call;
    call.transport = t;
    auto r = client.Forward(*c.request, call);
    Done(what, static_cast<grpc::StatusCode>(r.status().code()), {grpc::StatusCode::OK}, r.status().ToString());
    if (!r.ok()) return;
    const attnd::client::VerifyReport v = c.oracle->Check(r->o_bytes(), r->lse_bytes());
    if (!v.pass) Error(absl::StrCat(what, " answer"), v.detail);
  }

  // A KV sequence opened, stepped 4-8 times over the client's StepStream (each answer's length checked) and closed.
  void KvSteps(Client& client, std::mt19937_64& rng) {
    auto opened = client.OpenSequence(KvShape());
    Done("kv_open", static_cast<grpc::StatusCode>(opened.status().code()), {grpc::StatusCode::OK},
         opened.status().ToString());
    if (!opened.ok()) return;
    const std::string id = opened->ids[0];
    const int steps = 4 + static_cast<int>(rng() % 5);
    for (int i = 0; i < steps; ++i) {
      attnd::client::StepSpec spec;
      spec.sequences = {{id, 1}};
      spec.q_heads = 4;
      spec.q.data = kv_q_;
      spec.k.data = kv_k_;
      spec.v.data = kv_v_;
      auto r = client.Step(spec);
      Done("kv_step", static_cast<grpc::StatusCode>(r.status().code()), {grpc::StatusCode::OK}, r.status().ToString());
      if (!r.ok()) break;
      if (r->lengths.size() != 1 || r->lengths[0] != i + 1) Error("kv_step answer", "wrong length");
    }
    const absl::Status closed = client.CloseSequence({id});
    Done("kv_close", static_cast<grpc::StatusCode>(closed.code()), {grpc::StatusCode::OK}, closed.ToString());
  }

  // A StepStream whose client goes away 0-5 ms after sending a 64-token step; the sequence is then closed (at once,
  // or when that step ends).
  void KvStreamCancelled(Client& client, attnd::v1::Attention::Stub& stub, std::mt19937_64& rng) {
    auto opened = client.OpenSequence(KvShape());
    Done("kv_open", static_cast<grpc::StatusCode>(opened.status().code()), {grpc::StatusCode::OK},
         opened.status().ToString());
    if (!opened.ok()) return;
    grpc::ClientContext ctx;
    auto stream = stub.StepStream(&ctx);
    attnd::v1::StepStreamRequest m;
    attnd::v1::StepRequest* step = m.mutable_step();
    auto* t = step->add_sequences();
    t->set_sequence_id(opened->ids[0]);
    t->set_tokens(64);
    step->set_q_heads(4);
    step->mutable_q()->set_data(kv_q64_);
    step->mutable_k()->set_data(kv_k64_);
    step->mutable_v()->set_data(kv_v64_);
    stream->Write(m);
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % 5000));  // a random moment, not synchronisation
    ctx.TryCancel();
    const grpc::Status s = stream->Finish();
    Done("kv_stream_cancelled", s.error_code(), {grpc::StatusCode::CANCELLED}, s.error_message());
    const absl::Status closed = client.CloseSequence({opened->ids[0]});
    Done("kv_close", static_cast<grpc::StatusCode>(closed.code()), {grpc::StatusCode::OK}, closed.ToString());
  }

  static attnd::client::SequenceShape KvShape() {
    attnd::client::SequenceShape shape;
    shape.layers = 1;
    shape.kv_heads = 2;
    shape.head_dim = 64;
    return shape;
  }

  void CancelUnary(attnd::v1::Attention::Stub& stub, std::mt19937_64& rng) {
    grpc::ClientContext ctx;
    attnd::v1::ForwardResponse resp;
    std::promise<grpc::Status> done;
    stub.async()->Forward(&ctx, big_.request.get(), &resp, [&](grpc::Status s) { done.set_value(s); });
    std::future<grpc::Status> f = done.get_future();
    if (f.wait_for(std::chrono::milliseconds(rng() % 20)) == std::future_status::timeout) ctx.TryCancel();
    const grpc::Status s = f.get();
    Done("cancel_unary", s.error_code(), {grpc::StatusCode::OK, grpc::StatusCode::CANCELLED}, s.error_message());
  }

  // A stream that sends its header and part of Q, then is cancelled.
  void CancelStream(attnd::v1::Attention::Stub& stub, std::mt19937_64& rng) {
    grpc::ClientContext ctx;
    auto stream = stub.ForwardStream(&ctx);
    attnd::v1::ForwardStreamRequest m;
    *m.mutable_header() = *big_.request;
    m.mutable_header()->clear_q();
    m.mutable_header()->clear_k();
    m.mutable_header()->clear_v();
    stream->Write(m);
    attnd::v1::ForwardStreamRequest chunk;
    chunk.mutable_chunk()->set_tensor(attnd::v1::TENSOR_NAME_Q);
    chunk.mutable_chunk()->set_data(big_.request->q().data().substr(0, 1 + rng() % 4096));
    stream->Write(chunk);
    ctx.TryCancel();
    const grpc::Status s = stream->Finish();
    Done("cancel_stream", s.error_code(), {grpc::StatusCode::CANCELLED}, s.error_message());
  }

  void RawBytes(Client& client, std::mt19937_64& rng) {
    std::string junk(static_cast<size_t>(rng() % 512), '\0');
    for (char& ch : junk) ch = static_cast<char>(rng());
    grpc::GenericStub generic(client.channel());
    grpc::ClientContext ctx;
    grpc::Slice slice(junk);
    grpc::ByteBuffer req(&slice, 1), resp;
    std::promise<grpc::Status> done;
    generic.UnaryCall(&ctx, "/attnd.v1.Attention/Forward", grpc::StubOptions(), &req, &resp,
                      [&](grpc::Status s) { done.set_value(s); });
    const grpc::Status s = done.get_future().get();
    Done("random_bytes", s.error_code(), {grpc::StatusCode::INVALID_ARGUMENT}, s.error_message());
  }

  void ChunkFirst(attnd::v1::Attention::Stub& stub) {
    grpc::ClientContext ctx;
    auto stream = stub.ForwardStream(&ctx);
    attnd::v1::ForwardStreamRequest chunk;
    chunk.mutable_chunk()->set_tensor(attnd::v1::TENSOR_NAME_Q);
    chunk.mutable_chunk()->set_data("0123456789abcdef");
    stream->Write(chunk);
    stream->WritesDone();
    attnd::v1::ForwardStreamResponse ignored;
    while (stream->Read(&ignored)) {
    }
    const grpc::Status s = stream->Finish();
    Done("chunk_first", s.error_code(), {grpc::StatusCode::INVALID_ARGUMENT}, s.error_message());
  }

  std::vector<Case> small_;
  Case big_;
  std::string kv_q_, kv_k_, kv_v_, kv_q64_, kv_k64_, kv_v64_;
  std::atomic<uint64_t> calls_{0}, errors_{0};
  std::mutex mu_;
  std::map<std::string, uint64_t> outcomes_;
};

// Waits until the server has nothing in flight (bounded), then --quiet_s without a call.
void WaitQuiet(Client& client) {
  const absl::Time end = absl::Now() + absl::Seconds(30);
  while (absl::Now() < end) {
    auto s = client.Stats();
    if (s.ok() && s->in_flight() == 0 && s->queue_depth() == 0) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  absl::SleepFor(absl::Seconds(absl::GetFlag(FLAGS_quiet_s)));
}

int64_t PeakRssKib(const std::vector<Sample>& samples) {
  int64_t peak = 0;
  for (const Sample& s : samples) peak = std::max(peak, s.rss_kib);
  return peak;
}

int64_t RssLimitKib(const Sample& base) {
  const double mib = std::max(absl::GetFlag(FLAGS_rss_growth_mib), 0.10 * base.rss_kib / 1024.0);
  return base.rss_kib + static_cast<int64_t>(mib * 1024);
}

// The quiet sample after the run, retaken every second (up to --settle_s) until it is within the leak bounds.
Sample SettledSample(int pid, const Sample& base) {
  const int slack = absl::GetFlag(FLAGS_slack);
  const absl::Time end = absl::Now() + absl::Seconds(absl::GetFlag(FLAGS_settle_s));
  Sample s = Probe(pid);
  while (absl::Now() < end &&
         (s.fds > base.fds + slack || s.threads > base.threads + slack || s.rss_kib > RssLimitKib(base))) {
    absl::SleepFor(absl::Seconds(1));
    s = Probe(pid);
  }
  return s;
}

void Print(const char* label, const Sample& s) {
  std::printf("%-8s t=%6.1fs rss=%7.1f MiB fds=%4lld threads=%4lld calls=%8lu errors=%lu\n", label, s.t,
              s.rss_kib / 1024.0, static_cast<long long>(s.fds), static_cast<long long>(s.threads),
              static_cast<unsigned long>(s.calls), static_cast<unsigned long>(s.errors));
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int pid = absl::GetFlag(FLAGS_server_pid);
  const int clients = absl::GetFlag(FLAGS_clients);
  const double every = absl::GetFlag(FLAGS_sample_every_s);
  attnd::client::ClientOptions o;
  o.target = absl::GetFlag(FLAGS_target);
  auto control = Client::Create(o);
  if (!control.ok()) {
    std::fprintf(stderr, "soak: %s\n", control.status().ToString().c_str());
    return 2;
  }
  Soak soak;
  const absl::Time start = absl::Now();
  const auto now_s = [&] { return absl::ToDoubleSeconds(absl::Now() - start); };

  soak.Traffic(absl::GetFlag(FLAGS_warmup_s), clients, absl::GetFlag(FLAGS_seed));
  WaitQuiet(**control);
  Sample base = Probe(pid);
  base.t = now_s();
  Print("quiet", base);

  std::vector<Sample> samples;
  std::atomic<bool> running{true};
  std::thread sampler([&] {
    while (running.load()) {
      absl::SleepFor(absl::Seconds(every));
      Sample s = Probe(pid);
      s.t = now_s();
      s.calls = soak.calls();
      s.errors = soak.errors();
      Print("load", s);
      samples.push_back(s);
    }
  });
  soak.Traffic(absl::GetFlag(FLAGS_duration_s), clients, absl::GetFlag(FLAGS_seed) + 1);
  running.store(false);
  sampler.join();
  WaitQuiet(**control);
  Sample end = SettledSample(pid, base);
  end.t = now_s();
  end.calls = soak.calls();
  end.errors = soak.errors();
  Print("quiet", end);
  soak.PrintCounts();

  if (!absl::GetFlag(FLAGS_csv).empty()) {
    std::ofstream csv(absl::GetFlag(FLAGS_csv));
    csv << "t_s,rss_kib,fds,threads,calls,errors\n";
    for (const Sample& s : samples) csv << s.t << ',' << s.rss_kib << ',' << s.fds << ',' << s.threads << ',' << s.calls << ',' << s.errors << '\n';
  }

  int passed = 0, failed = 0;
  const auto check = [&](bool ok, const std::string& what) {
    (ok ? passed : failed)++;
    std::printf("soak: %s %s\n", ok ? "ok:" : "FAIL:", what.c_str());
  };
  check(end.calls > 0, absl::StrCat(end.calls, " calls"));
  check(end.errors == 0, absl::StrCat(end.errors, " unexpected outcomes or wrong answers"));
  if (pid > 0) {
    const int slack = absl::GetFlag(FLAGS_slack);
    check(end.fds <= base.fds + slack, absl::StrCat("descriptors idle: ", base.fds, " before, ", end.fds, " after"));
    check(end.threads <= base.threads + slack,
          absl::StrCat("threads idle: ", base.threads, " before, ", end.threads, " after"));
    check(end.rss_kib <= RssLimitKib(base),
          absl::StrFormat("RSS quiet: %.1f MiB before, %.1f MiB after (limit %.1f; %.1f MiB at the peak under load)",
                          base.rss_kib / 1024.0, end.rss_kib / 1024.0, RssLimitKib(base) / 1024.0,
                          PeakRssKib(samples) / 1024.0));
  }
  std::printf("soak: %d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
