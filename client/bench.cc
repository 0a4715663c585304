#include "attnd/client/bench.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

namespace attnd::client {
namespace {

// State shared by the dispatching thread and the completion callbacks (which run on gRPC threads).
struct Run {
  absl::Mutex mu;
  int in_flight ABSL_GUARDED_BY(mu) = 0;
  std::vector<double> latencies_us ABSL_GUARDED_BY(mu);  // successful measured calls
  int64_t ok ABSL_GUARDED_BY(mu) = 0, errors ABSL_GUARDED_BY(mu) = 0, warmup_done ABSL_GUARDED_BY(mu) = 0;
  int64_t verified ABSL_GUARDED_BY(mu) = 0, verify_failures ABSL_GUARDED_BY(mu) = 0;
  std::map<std::string, int64_t> errors_by_code ABSL_GUARDED_BY(mu);
  std::string first_error ABSL_GUARDED_BY(mu), first_verify_failure ABSL_GUARDED_BY(mu);
  std::string backend ABSL_GUARDED_BY(mu), kernel ABSL_GUARDED_BY(mu), transport ABSL_GUARDED_BY(mu);
  double bytes ABSL_GUARDED_BY(mu) = 0;
  double queue_us ABSL_GUARDED_BY(mu) = 0, h2d_us ABSL_GUARDED_BY(mu) = 0, kernel_us ABSL_GUARDED_BY(mu) = 0,
         d2h_us ABSL_GUARDED_BY(mu) = 0, total_us ABSL_GUARDED_BY(mu) = 0;
  absl::Time last_done ABSL_GUARDED_BY(mu) = absl::InfinitePast();
  // Since the last progress line.
  int64_t window_ok ABSL_GUARDED_BY(mu) = 0, window_err ABSL_GUARDED_BY(mu) = 0;
  double window_lat_us ABSL_GUARDED_BY(mu) = 0;
  // BenchOptions::reuse_outputs: one O (+LSE) buffer per call in flight, taken at its start and given back
  // with its record.
  std::vector<std::unique_ptr<char[]>> output_memory;
  std::vector<ForwardOutputs> outputs;
  std::vector<int> free_outputs ABSL_GUARDED_BY(mu);
};

// Buffers for `n` calls in flight of `request`, written once so that their pages are resident before the
// first call.
void AllocateOutputs(Run& run, const v1::ForwardRequest& request, int n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(run.mu) {
  const ReplyBytes sizes = ExpectedReplyBytes(request);
  const uint64_t o = sizes.o, lse = sizes.lse;
  for (int i = 0; i < n; ++i) {
    // At least one byte, so that an empty O still has an address; the spans below have the exact sizes.
    run.output_memory.push_back(std::make_unique<char[]>(std::max<uint64_t>(o + lse, 1)));
    char* base = run.output_memory.back().get();
    run.outputs.push_back(ForwardOutputs{absl::Span<char>(base, o), absl::Span<char>(base + o, lse)});
    run.free_outputs.push_back(i);
  }
}

// When calls start, shared by both engines (guarded by Run::mu): closed loop starts a call whenever the caller
// asks, open loop (--rate) at start + n / rate; calls scheduled after the warm-up are the measured ones.
struct Schedule {
  Schedule(const BenchOptions& opt, absl::Time start)
      : opt(opt),
        start(start),
        warmup_end(start + opt.warmup),
        measure_end(opt.requests > 0 ? absl::InfiniteFuture() : warmup_end + opt.duration),
        hard_end(start + opt.max_duration) {}

  struct Start {
    bool measured;
    int64_t seq;
    absl::Time t0;  // what its latency counts from: the scheduled start (open loop) or now (closed loop)
  };
  enum class Next { kStart, kWait, kStop };
  // kStart: the call `*call` may start now (counted as started); kWait: not before *wake; kStop: no more calls.
  Next Take(absl::Time now, Start* call, absl::Time* wake) {
    if (now >= hard_end) {
      hit_max_duration = true;
      return Next::kStop;
    }
    if (now >= measure_end || (opt.requests > 0 && measured_started >= opt.requests)) return Next::kStop;
    absl::Time scheduled = now;
    if (opt.rate > 0) {
      scheduled = start + absl::Seconds(static_cast<double>(started) / opt.rate);
      if (scheduled > now) {
        *wake = std::min({scheduled, hard_end, measure_end});
        return Next::kWait;
      }
      if (now - scheduled > absl::Milliseconds(1) && scheduled >= warmup_end) ++late_starts;
    }
    call->measured = scheduled >= warmup_end;
    if (call->measured) {
      ++measured_started;
      first_measured = std::min(first_measured, scheduled);
    }
    call->seq = started++;
    call->t0 = opt.rate > 0 ? scheduled : now;
    return Next::kStart;
  }

  const BenchOptions& opt;
  const absl::Time start, warmup_end, measure_end, hard_end;
  absl::Time first_measured = absl::InfiniteFuture();
  int64_t started = 0, measured_started = 0, late_starts = 0;
  bool hit_max_duration = false;
};

absl::Status CheckOptions(const BenchOptions& opt, const Oracle* oracle) {
  if (opt.concurrency < 1) return absl::InvalidArgumentError("concurrency: must be >= 1");
  if (!(opt.rate >= 0) || !std::isfinite(opt.rate)) return absl::InvalidArgumentError("rate: must be >= 0");
  if (opt.requests < 0) return absl::InvalidArgumentError("requests: must be >= 0");
  if (opt.requests == 0 && opt.duration <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("duration: must be positive (or give requests)");
  }
  if (opt.warmup < absl::ZeroDuration()) return absl::InvalidArgumentError("warmup: must be >= 0");
  if (opt.max_duration <= absl::ZeroDuration()) return absl::InvalidArgumentError("max_duration: must be positive");
  if (opt.verify_every < 0) return absl::InvalidArgumentError("verify_every: must be >= 0");
  if (opt.verify_every > 0 && oracle == nullptr) return absl::InvalidArgumentError("verify_every: needs an oracle");
  return absl::OkStatus();
}

// The report's "what ran" from the options and the request.
absl::StatusOr<BenchReport> NewReport(const std::string& target, int connections, const v1::ForwardRequest& request,
                                      const BenchOptions& opt) {
  BenchReport report;
  report.target = target;
  report.concurrency = opt.concurrency;
  report.connections = connections;
  report.rate = opt.rate;
  report.reuse_outputs = opt.reuse_outputs;
  auto dtype = FromProto(request.dtype());
  auto mask = FromProto(request.mask());
  if (!dtype.ok()) return dtype.status();
  if (!mask.ok()) return mask.status();
  const auto& s = request.shape();
  report.problem.shape = Shape{s.batch(), s.q_len(), s.kv_len(), s.q_heads(), s.kv_heads(), s.head_dim()};
  report.problem.dtype = *dtype;
  report.problem.mask = *mask;
  report.problem.scale = request.has_softmax_scale() ? request.softmax_scale() : DefaultScale(s.head_dim());
  report.problem.want_lse = request.return_lse();
  return report;
}

// One finished call into the counts (measured or warmup); verification runs outside the lock.
// `output` (>= 0): the Run::outputs buffer the call wrote, free again once verified.
void Record(Run& run, const Oracle* oracle, int64_t verify_every, bool measured, int64_t seq, absl::Time t0,
            absl::StatusOr<ForwardResult> r, int output = -1) ABSL_LOCKS_EXCLUDED(run.mu) {
  const absl::Time now = absl::Now();
  std::optional<VerifyReport> vr;
  if (r.ok() && measured && verify_every > 0 && seq % verify_every == 0) {
    vr = oracle->Check(r->o_bytes(), r->lse_bytes());
  }
  absl::MutexLock lock(&run.mu);
  --run.in_flight;
  if (output >= 0) run.free_outputs.push_back(output);
  if (!measured) {
    ++run.warmup_done;
    // The progress line shows the warmup's pace too.
    if (r.ok()) {
      ++run.window_ok;
      run.window_lat_us += absl::ToDoubleMicroseconds(now - t0);
    } else {
      ++run.window_err;
    }
    return;
  }
  run.last_done = std::max(run.last_done, now);
  if (!r.ok()) {
    ++run.errors;
    ++run.window_err;
    ++run.errors_by_code[absl::StatusCodeToString(r.status().code())];
    if (run.first_error.empty()) run.first_error = r.status().ToString();
    return;
  }
  const double lat = absl::ToDoubleMicroseconds(now - t0);
  ++run.ok;
  ++run.window_ok;
  run.window_lat_us += lat;
  run.latencies_us.push_back(lat);
  run.bytes += static_cast<double>(r->bytes_sent + r->bytes_received);
  run.queue_us += r->timing.queue_us();
  run.h2d_us += r->timing.h2d_us();
  run.kernel_us += r->timing.kernel_us();
  run.d2h_us += r->timing.d2h_us();
  run.total_us += r->timing.total_us();
  if (run.backend.empty()) {
    run.backend = r->backend;
    run.kernel = r->kernel;
    run.transport = TransportName(r->transport);
  }
  if (vr) {
    ++run.verified;
    if (!vr->pass) {
      ++run.verify_failures;
      if (run.first_verify_failure.empty()) run.first_verify_failure = vr->detail;
    }
  }
}

// The once-a-second progress line (when asked for), and a new window for the next one.
void Progress(Run& run, const BenchOptions& opt, absl::Time now, absl::Time start, absl::Time warmup_end,
              absl::Time* window_start, absl::Time* next_progress) ABSL_EXCLUSIVE_LOCKS_REQUIRED(run.mu) {
  if (opt.progress) {
    const double avg_ms = run.window_ok ? run.window_lat_us / run.window_ok / 1000.0 : 0;
    opt.progress(absl::StrFormat(
        "[%6.1fs] %s%lld ok, %lld errors, %.1f req/s, mean latency %.2f ms, in flight %d",
        absl::ToDoubleSeconds(now - start),
        now < warmup_end ? absl::StrCat("warmup ", run.warmup_done, " done, ") : std::string(),
        static_cast<long long>(run.ok),
        static_cast<long long>(run.errors),
        static_cast<double>(run.window_ok + run.window_err) / absl::ToDoubleSeconds(now - *window_start), avg_ms,
        run.in_flight));
  }
  run.window_ok = run.window_err = 0;
  run.window_lat_us = 0;
  *window_start = now;
  *next_progress = now + absl::Seconds(1);
}

// The counts of a finished run into the report. `transport`: shown when no call succeeded to say which carried it.
void Finish(Run& run, absl::Time first_measured, const std::string& transport, BenchReport& report)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(run.mu) {
  std::sort(run.latencies_us.begin(), run.latencies_us.end());
  report.ok = run.ok;
  report.errors = run.errors;
  report.warmup_requests = run.warmup_done;
  report.verified = run.verified;
  report.verify_failures = run.verify_failures;
  report.errors_by_code = run.errors_by_code;
  report.first_error = run.first_error;
  report.first_verify_failure = run.first_verify_failure;
  report.backend = run.backend;
  report.kernel = run.kernel;
  report.transport = run.transport.empty() ? transport : run.transport;
  if (run.ok + run.errors > 0 && run.last_done > first_measured) {
    report.elapsed_s = absl::ToDoubleSeconds(run.last_done - first_measured);
  }
  if (report.elapsed_s > 0) {
    report.req_per_s = static_cast<double>(run.ok) / report.elapsed_s;
    report.tflops = ForwardFlops(report.problem) * static_cast<double>(run.ok) / report.elapsed_s / 1e12;
    report.gbps = run.bytes / report.elapsed_s / 1e9;
  }
  if (!run.latencies_us.empty()) {
    const auto& l = run.latencies_us;
    double sum = 0;
    for (double x : l) sum += x;
    report.lat_min_us = l.front();
    report.lat_max_us = l.back();
    report.lat_mean_us = sum / static_cast<double>(l.size());
    report.lat_p50_us = Percentile(l, 50);
    report.lat_p90_us = Percentile(l, 90);
    report.lat_p95_us = Percentile(l, 95);
    report.lat_p99_us = Percentile(l, 99);
    const double n = static_cast<double>(run.ok);
    report.srv_queue_us = run.queue_us / n;
    report.srv_h2d_us = run.h2d_us / n;
    report.srv_kernel_us = run.kernel_us / n;
    report.srv_d2h_us = run.d2h_us / n;
    report.srv_total_us = run.total_us / n;
    report.bytes_per_request = run.bytes / n;
  }
}

}  // namespace

double Percentile(const std::vector<double>& sorted, double p) {
  if (sorted.empty()) return 0;
  const double rank = std::ceil(p / 100.0 * static_cast<double>(sorted.size()));
  const size_t idx = rank < 1 ? 0 : std::min(sorted.size() - 1, static_cast<size_t>(rank) - 1);
  return sorted[idx];
}

absl::StatusOr<BenchReport> RunBench(Client& client, std::shared_ptr<const v1::ForwardRequest> request,
                                     const Oracle* oracle, const BenchOptions& opt) {
  return RunBench(std::vector<Client*>{&client}, std::move(request), oracle, opt);
}

absl::StatusOr<BenchReport> RunBench(const std::vector<Client*>& clients,
                                     std::shared_ptr<const v1::ForwardRequest> request, const Oracle* oracle,
                                     const BenchOptions& opt) {
  if (clients.empty() || std::find(clients.begin(), clients.end(), nullptr) != clients.end()) {
    return absl::InvalidArgumentError("clients: at least one, none null");
  }
  if (request == nullptr) return absl::InvalidArgumentError("request: required");
  Client& client = *clients.front();
  if (absl::Status s = CheckOptions(opt, oracle); !s.ok()) return s;
  const Transport transport = opt.call.transport.value_or(client.options().transport);
  if (transport == Transport::kShm) {
    return absl::InvalidArgumentError(
        "transport: shm is not carried by gRPC clients; bench shared-memory channels as blocking callers "
        "(OpenShmCallers)");
  }
  absl::StatusOr<BenchReport> described =
      NewReport(client.options().target, static_cast<int>(clients.size()), *request, opt);
  if (!described.ok()) return described.status();
  BenchReport& report = *described;
  if (transport == Transport::kAuto) {
    // Fetch the server's limits and stream preference (kAuto's inputs) now so that no completion callback ever
    // blocks on them.
    for (Client* c : clients) {
      auto info = c->ServerInfo(false, opt.call);
      if (!info.ok()) return info.status();
    }
  }

  // Shared with the completion callbacks: the last of them may still be unlocking the mutex when this
  // function returns.
  auto state = std::make_shared<Run>();
  Run& run = *state;
  const absl::Time start = absl::Now();
  Schedule sched(opt, start);
  absl::Time window_start = start;
  absl::Time next_progress = start + absl::Seconds(1);
  const int64_t verify_every = opt.verify_every;

  auto on_done = [state, oracle, verify_every](bool measured, int64_t seq, absl::Time t0, int output,
                                               absl::StatusOr<ForwardResult> r) {
    Record(*state, oracle, verify_every, measured, seq, t0, std::move(r), output);
  };

  const int concurrency = opt.concurrency;
  auto slot_free = [&run, concurrency]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(run.mu) { return run.in_flight < concurrency; };
  auto all_done = [&run]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(run.mu) { return run.in_flight == 0; };

  run.mu.Lock();
  if (opt.reuse_outputs) AllocateOutputs(run, *request, concurrency);
  for (;;) {
    const absl::Time now = absl::Now();
    if (now >= next_progress) Progress(run, opt, now, start, sched.warmup_end, &window_start, &next_progress);
    if (run.in_flight >= concurrency && now < std::min({sched.hard_end, sched.measure_end})) {
      run.mu.AwaitWithDeadline(absl::Condition(&slot_free), std::min({next_progress, sched.hard_end, sched.measure_end}));
      continue;
    }
    Schedule::Start call;
    absl::Time wake;
    const Schedule::Next next = sched.Take(now, &call, &wake);
    if (next == Schedule::Next::kStop) break;
    if (next == Schedule::Next::kWait) {
      run.mu.Unlock();
      absl::SleepFor(std::min(wake, next_progress) - now);
      run.mu.Lock();
      continue;
    }
    ++run.in_flight;
    CallOptions options = opt.call;
    int output = -1;
    if (opt.reuse_outputs) {  // in_flight < concurrency, so one is free
      output = run.free_outputs.back();
      run.free_outputs.pop_back();
      options.outputs = run.outputs[static_cast<size_t>(output)];
    }
    run.mu.Unlock();
    // Calls rotate over the clients (connections) so that no single HTTP/2 connection carries all the bytes.
    clients[static_cast<size_t>(call.seq) % clients.size()]->ForwardAsync(
        request,
        [on_done, call, output](absl::StatusOr<ForwardResult> r) {
          on_done(call.measured, call.seq, call.t0, output, std::move(r));
        },
        options);
    run.mu.Lock();
  }
  // Every call ends by its deadline, so this wait is bounded too.
  run.mu.Await(absl::Condition(&all_done));
  report.late_starts = sched.late_starts;
  report.hit_max_duration = sched.hit_max_duration;
  Finish(run, sched.first_measured, TransportName(transport), report);
  run.mu.Unlock();
  return report;
}

absl::StatusOr<BenchReport> RunBench(const std::vector<SyncForward>& callers, const std::string& target,
                                     std::shared_ptr<const v1::ForwardRequest> request, const Oracle* oracle,
                                     const BenchOptions& opt) {
  if (callers.empty() || std::any_of(callers.begin(), callers.end(), [](const SyncForward& f) { return !f; })) {
    return absl::InvalidArgumentError("callers: at least one, none empty");
  }
  if (request == nullptr) return absl::InvalidArgumentError("request: required");
  if (absl::Status s = CheckOptions(opt, oracle); !s.ok()) return s;
  if (static_cast<size_t>(opt.concurrency) != callers.size()) {
    return absl::InvalidArgumentError(absl::StrCat("concurrency: ", opt.concurrency, ", but ", callers.size(),
                                                   " callers (one per call in flight)"));
  }
  absl::StatusOr<BenchReport> described = NewReport(target, static_cast<int>(callers.size()), *request, opt);
  if (!described.ok()) return described.status();
  BenchReport& report = *described;
  report.reuse_outputs = false;  // blocking callers return their results as ForwardOverShm gives them

  Run run;
  const absl::Time start = absl::Now();
  Schedule sched(opt, start);  // shared by the callers' threads under run.mu
  int running = static_cast<int>(callers.size());

  auto caller_loop = [&](const SyncForward& forward) {
    run.mu.Lock();
    for (;;) {
      const absl::Time now = absl::Now();
      Schedule::Start call;
      absl::Time wake;
      const Schedule::Next next = sched.Take(now, &call, &wake);
      if (next == Schedule::Next::kStop) break;
      if (next == Schedule::Next::kWait) {
        // Not yet: another free caller may take it first, so the schedule is looked at again after the sleep.
        run.mu.Unlock();
        absl::SleepFor(wake - now);
        run.mu.Lock();
        continue;
      }
      ++run.in_flight;
      run.mu.Unlock();
      absl::StatusOr<ForwardResult> r = forward(*request);
      Record(run, oracle, opt.verify_every, call.measured, call.seq, call.t0, std::move(r));
      run.mu.Lock();
    }
    --running;
    run.mu.Unlock();
  };
  std::vector<std::thread> threads;
  threads.reserve(callers.size());
  for (const SyncForward& f : callers) threads.emplace_back(caller_loop, std::cref(f));

  // This thread writes the progress lines until every caller is done (each call ends by its timeout).
  absl::Time window_start = start;
  absl::Time next_progress = start + absl::Seconds(1);
  auto all_done = [&running]() { return running == 0; };
  run.mu.Lock();
  for (;;) {
    const absl::Time now = absl::Now();
    if (now >= next_progress) Progress(run, opt, now, start, sched.warmup_end, &window_start, &next_progress);
    if (running == 0) break;
    run.mu.AwaitWithDeadline(absl::Condition(&all_done), next_progress);
  }
  run.mu.Unlock();
  for (std::thread& t : threads) t.join();

  run.mu.Lock();
  report.late_starts = sched.late_starts;
  report.hit_max_duration = sched.hit_max_duration;
  Finish(run, sched.first_measured, TransportName(Transport::kShm), report);
  run.mu.Unlock();
  return report;
}

absl::StatusOr<ShmChannelOptions> ShmChannelOptionsFor(const v1::ForwardRequest& request, const std::string& socket_path,
                                                       uint64_t max_area_bytes) {
  if (socket_path.empty()) return absl::InvalidArgumentError("--shm_socket: required with --transport=shm");
  const uint64_t request_bytes = request.ByteSizeLong();
  // O and LSE as the shape says; a shape that overflows cannot be sized (the server refuses it anyway).
  const auto& s = request.shape();
  uint64_t reply_bytes = kShmReplySlackBytes + request.request_id().size();
  bool overflow = false;
  auto add_product = [&](std::initializer_list<int64_t> factors) {
    uint64_t p = 1;
    for (int64_t f : factors) {
      if (f < 0 || __builtin_mul_overflow(p, static_cast<uint64_t>(f), &p)) overflow = true;
    }
    if (__builtin_add_overflow(reply_bytes, p, &reply_bytes)) overflow = true;
  };
  if (!request.has_o_ref()) add_product({s.batch(), s.q_len(), s.q_heads(), s.head_dim(), 2});
  if (request.return_lse()) add_product({s.batch(), s.q_heads(), s.q_len(), 4});
  if (overflow) return absl::InvalidArgumentError("shape: O and LSE sizes overflow (cannot size the reply area)");
  auto too_big = [&](const char* area, uint64_t bytes, const char* what) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "--transport=shm: the channel's %s area would need %d bytes (%s), above --shm_max_bytes=%d; raise "
        "--shm_max_bytes here and on the server, or use --transport=auto (gRPC streams any size)",
        area, bytes, what, max_area_bytes));
  };
  if (request_bytes > max_area_bytes) return too_big("request", request_bytes, "the serialized ForwardRequest");
  if (reply_bytes > max_area_bytes) return too_big("reply", reply_bytes, "O and LSE plus the reply's other fields");
  ShmChannelOptions o;
  o.socket_path = socket_path;
  o.request_capacity = request_bytes;
  o.reply_capacity = reply_bytes;
  return o;
}

absl::StatusOr<std::vector<SyncForward>> OpenShmCallers(const ShmChannelOptions& options, int n,
                                                        absl::Duration timeout) {
  if (n < 1) return absl::InvalidArgumentError("concurrency: must be >= 1");
  // One caller's channel: used by one thread at a time (RunBench gives each caller its own).
  struct Caller {
    ShmChannelOptions options;
    std::unique_ptr<ShmChannel> channel;
  };
  std::vector<SyncForward> out;
  out.reserve(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    absl::StatusOr<std::unique_ptr<ShmChannel>> ch = ShmChannel::Connect(options);
    if (!ch.ok()) {
      return absl::Status(ch.status().code(), absl::StrCat("shm channel ", i + 1, " of ", n, " on ",
                                                           options.socket_path, ": ", ch.status().message()));
    }
    auto caller = std::make_shared<Caller>(Caller{options, *std::move(ch)});
    out.push_back([caller, timeout](const v1::ForwardRequest& request) -> absl::StatusOr<ForwardResult> {
      if (caller->channel == nullptr) {
        absl::StatusOr<std::unique_ptr<ShmChannel>> reopened = ShmChannel::Connect(caller->options);
        if (!reopened.ok()) {
          return absl::Status(reopened.status().code(),
                              absl::StrCat("reopening the shm channel: ", reopened.status().message()));
        }
        caller->channel = *std::move(reopened);
      }
      absl::StatusOr<ForwardResult> r = ForwardOverShm(*caller->channel, request, timeout);
      if (!r.ok() && (r.status().code() == absl::StatusCode::kDeadlineExceeded ||
                      r.status().code() == absl::StatusCode::kUnavailable)) {
        caller->channel.reset();
      }
      return r;
    });
  }
  return out;
}

}  // namespace attnd::client

// ---------------------------------------------------------------------------------------------------------
// KV sequences: `attn seq` and `attn bench --workload=decode`.
namespace attnd::client {
namespace {

// Rows per prefill Step: K of one chunk at most this many bytes, well inside any sensible message limit.
constexpr uint64_t kPrefillChunkBytes = 4 << 20;

int64_t PrefillChunkTokens(const SequenceShape& s) {
  const uint64_t row = static_cast<uint64_t>(s.kv_heads * s.head_dim) * DTypeBytes(s.dtype);
  return std::max<int64_t>(1, static_cast<int64_t>(kPrefillChunkBytes / std::max<uint64_t>(row, 1)));
}

absl::Status CheckSequenceShape(const SequenceShape& s, int64_t q_heads) {
  if (s.layers < 1) return absl::InvalidArgumentError("layers: must be >= 1");
  if (s.kv_heads < 1) return absl::InvalidArgumentError("kv_heads: must be >= 1");
  if (s.head_dim < 1) return absl::InvalidArgumentError("head_dim: must be >= 1");
  if (q_heads < 1 || q_heads % s.kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("q_heads: ", q_heads, " is not a positive multiple of kv_heads ",
                                                   s.kv_heads));
  }
  return absl::OkStatus();
}

std::string StepTransportName(const Client& client, const CallOptions& call) {
  const Transport t = call.transport ? *call.transport : client.options().transport;
  if (t == Transport::kShm) return "shm";
  return absl::StrCat(absl::StartsWith(client.options().target, "unix:") ? "grpc-unix" : "grpc-tcp",
                      t == Transport::kUnary ? " (unary Step)" : " (StepStream)");
}

}  // namespace

absl::StatusOr<SeqRunReport> RunSequence(Client& client, const SeqRunOptions& o) {
  const SequenceShape& shape = o.shape;
  const int64_t q_heads = o.q_heads > 0 ? o.q_heads : shape.kv_heads;
  if (absl::Status s = CheckSequenceShape(shape, q_heads); !s.ok()) return s;
  if (o.prefill < 0 || o.steps < 0) return absl::InvalidArgumentError("prefill, steps: must be >= 0");
  if (o.prefill + o.steps < 1) return absl::InvalidArgumentError("prefill + steps: at least one token");
  absl::StatusOr<OpenedSequences> opened = client.OpenSequence(shape, 0, 1, o.call);
  if (!opened.ok()) return opened.status();
  SeqRunReport report;
  report.sequence_id = opened->ids[0];
  const uint64_t ebytes = DTypeBytes(shape.dtype);
  const uint64_t kv_row = static_cast<uint64_t>(shape.kv_heads * shape.head_dim) * ebytes;
  std::vector<std::string> k_hist(shape.layers), v_hist(shape.layers);
  uint64_t seed = o.seed * 1000003;
  double layer_us_sum = 0, kernel_us_sum = 0;
  int64_t layer_calls = 0;

  // One Step of `tokens` rows on `layer` (append and attend), checked against the reference when asked.
  auto step = [&](int64_t layer, int64_t tokens) -> absl::Status {
    const std::string q = RandomTensor(shape.dtype, tokens * q_heads * shape.head_dim, ++seed);
    const std::string k = RandomTensor(shape.dtype, tokens * shape.kv_heads * shape.head_dim, ++seed);
    const std::string v = RandomTensor(shape.dtype, tokens * shape.kv_heads * shape.head_dim, ++seed);
    StepSpec spec;
    spec.sequences = {{report.sequence_id, tokens}};
    spec.layer = layer;
    spec.q_heads = q_heads;
    spec.want_lse = o.want_lse;
    spec.q.data = q;
    spec.k.data = k;
    spec.v.data = v;
    absl::StatusOr<StepResult> r = client.Step(spec, o.call);
    if (!r.ok()) {
      return absl::Status(r.status().code(), absl::StrCat("step at layer ", layer, ": ", r.status().message()));
    }
    report.transport = TransportName(r->transport);
    layer_us_sum += absl::ToDoubleMicroseconds(r->latency);
    kernel_us_sum += r->timing.timing().kernel_us();
    ++layer_calls;
    k_hist[layer] += k;
    v_hist[layer] += v;
    const int64_t keys = static_cast<int64_t>(k_hist[layer].size() / kv_row);
    if (r->lengths[0] != keys) {
      return absl::InternalError(absl::StrCat("layer ", layer, ": the server reports ", r->lengths[0],
                                              " cached tokens, the client sent ", keys));
    }
    if (o.verify) {
      Problem p;
      p.shape = Shape{1, tokens, keys, q_heads, shape.kv_heads, shape.head_dim};
      p.dtype = shape.dtype;
      p.mask = Mask::kCausalBottomRight;
      p.scale = DefaultScale(shape.head_dim);
      p.want_lse = o.want_lse;
      absl::StatusOr<Oracle> oracle = Oracle::Compute(p, q, k_hist[layer], v_hist[layer]);
      if (!oracle.ok()) return oracle.status();
      const VerifyReport v = oracle->Check(r->o, r->lse);
      ++report.verified;
      if (!v.pass) {
        ++report.verify_failures;
        if (report.first_verify_failure.empty()) {
          report.first_verify_failure = absl::StrCat("layer ", layer, " at ", keys, " keys: ", v.detail);
        }
      }
    }
    return absl::OkStatus();
  };

  auto run = [&]() -> absl::Status {
    const absl::Time prefill_start = absl::Now();
    const int64_t chunk = PrefillChunkTokens(shape);
    for (int64_t layer = 0; layer < shape.layers; ++layer) {
      for (int64_t done = 0; done < o.prefill; done += chunk) {
        if (absl::Status s = step(layer, std::min(chunk, o.prefill - done)); !s.ok()) return s;
      }
    }
    report.prefill_us = absl::ToDoubleMicroseconds(absl::Now() - prefill_start);
    if (o.line && o.prefill > 0) {
      o.line(absl::StrFormat("prefill: %d tokens x %d layers in %.3f ms", o.prefill, shape.layers,
                             report.prefill_us / 1e3));
    }
    for (int64_t i = 0; i < o.steps; ++i) {
      const absl::Time t0 = absl::Now();
      for (int64_t layer = 0; layer < shape.layers; ++layer) {
        if (absl::Status s = step(layer, 1); !s.ok()) return s;
      }
      report.step_us.push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));
      ++report.steps;
      if (o.line) {
        o.line(absl::StrFormat("step %d: %d tokens cached, %.3f ms over %d layers%s", i + 1, o.prefill + i + 1,
                               report.step_us.back() / 1e3, shape.layers,
                               o.verify ? (report.verify_failures == 0 ? ", verified" : ", VERIFY FAILED") : ""));
      }
    }
    absl::StatusOr<v1::SequenceInfo> info = client.GetSequence(report.sequence_id, o.call);
    if (!info.ok()) return info.status();
    report.final_lengths.assign(info->lengths().begin(), info->lengths().end());
    return absl::OkStatus();
  };
  absl::Status ran = run();
  // Closed whatever happened, so that a failed run leaves nothing behind on the server.
  absl::Status closed = client.CloseSequence({report.sequence_id}, o.call);
  if (!ran.ok()) return ran;
  if (!closed.ok()) return absl::Status(closed.code(), absl::StrCat("close: ", closed.message()));
  if (layer_calls > 0) {
    report.layer_step_mean_us = layer_us_sum / layer_calls;
    report.srv_kernel_mean_us = kernel_us_sum / layer_calls;
  }
  std::vector<double> sorted = report.step_us;
  std::sort(sorted.begin(), sorted.end());
  report.step_p50_us = Percentile(sorted, 50);
  report.step_p99_us = Percentile(sorted, 99);
  return report;
}

std::string FormatSeqReport(const SeqRunReport& r) {
  std::string out;
  absl::StrAppendFormat(&out, "seq: %s over %s: %d decode steps\n", r.sequence_id, r.transport, r.steps);
  absl::StrAppendFormat(&out, "  step (every layer) ms: p50 %.3f, p99 %.3f; one Step call mean %.3f ms, server kernel "
                        "mean %.3f ms\n", r.step_p50_us / 1e3, r.step_p99_us / 1e3, r.layer_step_mean_us / 1e3,
                        r.srv_kernel_mean_us / 1e3);
  absl::StrAppend(&out, "  cached tokens per layer at the end: ", absl::StrJoin(r.final_lengths, ","), "\n");
  if (r.verified > 0) {
    absl::StrAppendFormat(&out, "  verified: %d layer-steps, %d failed%s\n", r.verified, r.verify_failures,
                          r.first_verify_failure.empty() ? "" : " (first: " + r.first_verify_failure + ")");
  }
  return out;
}

absl::StatusOr<DecodeBenchReport> RunDecodeBench(Client& client, const DecodeBenchOptions& o) {
  const SequenceShape& shape = o.shape;
  const int64_t q_heads = o.q_heads > 0 ? o.q_heads : shape.kv_heads;
  if (absl::Status s = CheckSequenceShape(shape, q_heads); !s.ok()) return s;
  if (o.sequences < 1) return absl::InvalidArgumentError("sequences: must be >= 1");
  if (o.context < 0 || o.steps < 1) return absl::InvalidArgumentError("context: must be >= 0; steps: >= 1");
  DecodeBenchReport report;
  report.transport = StepTransportName(client, o.call);
  report.target = report.transport == "shm" ? client.options().shm_socket : client.options().target;
  report.shape = shape;
  report.q_heads = q_heads;
  report.sequences = o.sequences;
  report.context = o.context;
  report.steps = o.steps;
  report.one_message = o.one_message;

  std::vector<std::string> ids;
  // Opened in groups within the server's per-call limit (SequenceLimits.max_open).
  uint32_t group = 64;
  absl::StatusOr<v1::ServerInfo> info = client.ServerInfo(false, o.call);
  if (info.ok() && info->sequences().max_open() > 0) group = info->sequences().max_open();
  auto close_all = [&] {
    if (!ids.empty()) (void)client.CloseSequence(ids, o.call);
  };
  while (static_cast<int>(ids.size()) < o.sequences) {
    const uint32_t n = std::min<uint32_t>(group, o.sequences - ids.size());
    absl::StatusOr<OpenedSequences> opened = client.OpenSequence(shape, 0, n, o.call);
    if (!opened.ok()) {
      close_all();
      return absl::Status(opened.status().code(), absl::StrCat("open: ", opened.status().message()));
    }
    ids.insert(ids.end(), opened->ids.begin(), opened->ids.end());
  }
  const int64_t kv_elems_row = shape.kv_heads * shape.head_dim;
  const int64_t q_elems_row = q_heads * shape.head_dim;
  // Prefill, untimed: append-only Steps in message-sized chunks. Every sequence gets the same random context
  // (values do not matter to the timing).
  if (o.context > 0) {
    const int64_t chunk = std::min(PrefillChunkTokens(shape), o.context);
    const std::string k = RandomTensor(shape.dtype, chunk * kv_elems_row, o.seed * 7 + 1);
    const std::string v = RandomTensor(shape.dtype, chunk * kv_elems_row, o.seed * 7 + 2);
    const uint64_t row_bytes = static_cast<uint64_t>(kv_elems_row) * DTypeBytes(shape.dtype);
    for (const std::string& id : ids) {
      for (int64_t layer = 0; layer < shape.layers; ++layer) {
        for (int64_t done = 0; done < o.context; done += chunk) {
          const int64_t n = std::min(chunk, o.context - done);
          StepSpec spec;
          spec.sequences = {{id, n}};
          spec.layer = layer;
          spec.k.data = std::string_view(k).substr(0, n * row_bytes);
          spec.v.data = std::string_view(v).substr(0, n * row_bytes);
          absl::StatusOr<StepResult> r = client.Step(spec, o.call);
          if (!r.ok()) {
            close_all();
            return absl::Status(r.status().code(), absl::StrCat("prefill: ", r.status().message()));
          }
        }
      }
    }
  }

  // The decode phase. Each caller owns a set of sequences (one, or all of them in one_message mode).
  const int callers = o.one_message ? 1 : o.sequences;
  const int per_caller = o.one_message ? o.sequences : 1;
  struct CallerStats {
    std::vector<double> lat_us, outside_us;
    std::map<uint32_t, int64_t> batches;
    double queue = 0, h2d = 0, kernel = 0, d2h = 0, total = 0;
    double bytes_read = 0, kernel_share_us = 0;
    int64_t tokens = 0, ok = 0, errors = 0;
    std::map<std::string, int64_t> errors_by_code;
    std::string first_error;
  };
  std::vector<CallerStats> stats(callers);
  std::atomic<bool> stop{false};
  std::atomic<int64_t> progress_calls{0};
  const uint64_t ebytes = DTypeBytes(shape.dtype);
  const absl::Time start = absl::Now();
  const absl::Time hard_stop = start + o.max_duration;
  auto caller = [&](int c) {
    CallerStats& st = stats[c];
    const std::string q = RandomTensor(shape.dtype, per_caller * q_elems_row, o.seed * 11 + c);
    const std::string k = RandomTensor(shape.dtype, per_caller * kv_elems_row, o.seed * 13 + c);
    const std::string v = RandomTensor(shape.dtype, per_caller * kv_elems_row, o.seed * 17 + c);
    StepSpec spec;
    for (int i = 0; i < per_caller; ++i) spec.sequences.push_back({ids[c * per_caller + i], 1});
    spec.q_heads = q_heads;
    spec.q.data = q;
    spec.k.data = k;
    spec.v.data = v;
    for (int64_t s = 0; s < o.steps && !stop.load(std::memory_order_relaxed); ++s) {
      bool all_ok = true;
      for (int64_t layer = 0; layer < shape.layers; ++layer) {
        if (absl::Now() >= hard_stop) {
          stop.store(true);
          return;
        }
        spec.layer = layer;
        absl::StatusOr<StepResult> r = client.Step(spec, o.call);
        progress_calls.fetch_add(1, std::memory_order_relaxed);
        if (!r.ok()) {
          all_ok = false;
          ++st.errors;
          ++st.errors_by_code[absl::StatusCodeToString(r.status().code())];
          if (st.first_error.empty()) st.first_error = r.status().ToString();
          continue;
        }
        ++st.ok;
        st.lat_us.push_back(absl::ToDoubleMicroseconds(r->latency));
        const v1::Timing& t = r->timing.timing();
        st.queue += t.queue_us();
        st.h2d += t.h2d_us();
        st.kernel += t.kernel_us();
        st.d2h += t.d2h_us();
        st.total += t.total_us();
        st.outside_us.push_back(absl::ToDoubleMicroseconds(r->latency) - t.total_us());
        const uint32_t batch = std::max<uint32_t>(r->timing.batch_sequences(), 1);
        ++st.batches[batch];
        for (int64_t len : r->lengths) st.bytes_read += 2.0 * len * kv_elems_row * ebytes;
        st.kernel_share_us += t.kernel_us() * per_caller / std::max<uint32_t>(batch, per_caller);
      }
      if (all_ok) st.tokens += per_caller;
    }
  };
  std::vector<std::thread> threads;
  for (int c = 0; c < callers; ++c) threads.emplace_back(caller, c);
  if (o.progress) {
    std::thread watcher([&] {
      const int64_t total = static_cast<int64_t>(callers) * o.steps * shape.layers;
      while (!stop.load()) {
        absl::SleepFor(absl::Seconds(1));  // a progress line's period, not synchronisation
        const int64_t n = progress_calls.load();
        if (n >= total) break;
        o.progress(absl::StrFormat("decode: %d of %d Step calls, %.1f s", n, total,
                                   absl::ToDoubleSeconds(absl::Now() - start)));
      }
    });
    for (auto& t : threads) t.join();
    stop.store(true);
    watcher.join();
  } else {
    for (auto& t : threads) t.join();
  }
  report.elapsed_s = absl::ToDoubleSeconds(absl::Now() - start);
  report.hit_max_duration = absl::Now() >= hard_stop;
  close_all();

  std::vector<double> lat, outside;
  double queue = 0, h2d = 0, kernel = 0, d2h = 0, total = 0, bytes_read = 0, kernel_share = 0;
  int64_t tokens = 0;
  for (CallerStats& st : stats) {
    lat.insert(lat.end(), st.lat_us.begin(), st.lat_us.end());
    outside.insert(outside.end(), st.outside_us.begin(), st.outside_us.end());
    for (const auto& [b, n] : st.batches) report.batch_sequences[b] += n;
    for (const auto& [code, n] : st.errors_by_code) report.errors_by_code[code] += n;
    if (report.first_error.empty()) report.first_error = st.first_error;
    queue += st.queue, h2d += st.h2d, kernel += st.kernel, d2h += st.d2h, total += st.total;
    bytes_read += st.bytes_read, kernel_share += st.kernel_share_us;
    tokens += st.tokens;
    report.calls_ok += st.ok;
    report.errors += st.errors;
  }
  if (report.calls_ok > 0) {
    const double n = static_cast<double>(report.calls_ok);
    report.srv_queue_us = queue / n, report.srv_h2d_us = h2d / n, report.srv_kernel_us = kernel / n;
    report.srv_d2h_us = d2h / n, report.srv_total_us = total / n;
    std::sort(lat.begin(), lat.end());
    double sum = 0;
    for (double l : lat) sum += l;
    report.lat_mean_us = sum / n;
    report.lat_p50_us = Percentile(lat, 50);
    report.lat_p90_us = Percentile(lat, 90);
    report.lat_p99_us = Percentile(lat, 99);
    report.lat_max_us = lat.back();
    std::sort(outside.begin(), outside.end());
    report.outside_p50_us = Percentile(outside, 50);
    report.outside_p99_us = Percentile(outside, 99);
  }
  if (kernel_share > 0) report.hbm_gbps = bytes_read / kernel_share / 1e3;
  if (report.elapsed_s > 0) report.tokens_per_s = tokens / report.elapsed_s;
  return report;
}

std::string FormatDecodeReport(const DecodeBenchReport& r) {
  std::string out;
  absl::StrAppendFormat(&out, "bench decode: %s over %s\n", r.target, r.transport);
  absl::StrAppendFormat(&out, "  shape: %d layers, q_heads %d, kv_heads %d, head_dim %d, %s\n", r.shape.layers,
                        r.q_heads, r.shape.kv_heads, r.shape.head_dim, DTypeName(r.shape.dtype));
  absl::StrAppendFormat(&out, "  load: %d sequences, context %d, %d steps each, %s\n", r.sequences, r.context, r.steps,
                        r.one_message ? "one Step message per layer for all sequences"
                                      : "one Step message per sequence per layer, one thread per sequence");
  absl::StrAppendFormat(&out, "  Step calls: %d ok, %d errors%s\n", r.calls_ok, r.errors,
                        r.hit_max_duration ? " (stopped by max_duration)" : "");
  absl::StrAppendFormat(&out, "  throughput: %.1f tokens/s over %.2f s\n", r.tokens_per_s, r.elapsed_s);
  absl::StrAppendFormat(&out, "  Step latency ms: mean %.3f, p50 %.3f, p90 %.3f, p99 %.3f, max %.3f\n",
                        r.lat_mean_us / 1e3, r.lat_p50_us / 1e3, r.lat_p90_us / 1e3, r.lat_p99_us / 1e3,
                        r.lat_max_us / 1e3);
  std::vector<std::string> batches;
  for (const auto& [b, n] : r.batch_sequences) batches.push_back(absl::StrCat(b, ":", n));
  absl::StrAppend(&out, "  server batches (sequences per launch: calls): ", absl::StrJoin(batches, " "), "\n");
  absl::StrAppendFormat(&out, "  server ms (mean): queue %.3f, h2d %.3f, kernel %.3f, d2h %.3f, total %.3f\n",
                        r.srv_queue_us / 1e3, r.srv_h2d_us / 1e3, r.srv_kernel_us / 1e3, r.srv_d2h_us / 1e3,
                        r.srv_total_us / 1e3);
  absl::StrAppendFormat(&out, "  outside the server's total, per call ms: p50 %.3f, p99 %.3f\n",
                        r.outside_p50_us / 1e3, r.outside_p99_us / 1e3);
  absl::StrAppendFormat(&out, "  K/V read: %.2f GB/s (bytes attention reads / its kernel time)\n", r.hbm_gbps);
  if (!r.errors_by_code.empty()) {
    std::vector<std::string> parts;
    for (const auto& [code, n] : r.errors_by_code) parts.push_back(absl::StrCat(code, " ", n));
    absl::StrAppend(&out, "  errors by code: ", absl::StrJoin(parts, ", "), "\n  first error: ", r.first_error, "\n");
  }
  return out;
}

std::string DecodeReportJson(const DecodeBenchReport& r) {
  std::string batches;
  for (const auto& [b, n] : r.batch_sequences) {
    absl::StrAppend(&batches, batches.empty() ? "" : ", ", "\"", b, "\": ", n);
  }
  std::string codes;
  for (const auto& [c, n] : r.errors_by_code) absl::StrAppend(&codes, codes.empty() ? "" : ", ", "\"", c, "\": ", n);
  return absl::StrFormat(
      "{\n  \"workload\": \"decode\",\n  \"target\": \"%s\",\n  \"transport\": \"%s\",\n  \"layers\": %d,\n"
      "  \"q_heads\": %d,\n  \"kv_heads\": %d,\n  \"head_dim\": %d,\n  \"dtype\": \"%s\",\n  \"sequences\": %d,\n"
      "  \"context\": %d,\n  \"steps\": %d,\n  \"one_message\": %s,\n  \"calls_ok\": %d,\n  \"errors\": %d,\n"
      "  \"elapsed_s\": %.6f,\n  \"tokens_per_s\": %.3f,\n  \"lat_mean_us\": %.3f,\n  \"lat_p50_us\": %.3f,\n"
      "  \"lat_p90_us\": %.3f,\n  \"lat_p99_us\": %.3f,\n  \"lat_max_us\": %.3f,\n  \"srv_queue_us\": %.3f,\n"
      "  \"srv_h2d_us\": %.3f,\n  \"srv_kernel_us\": %.3f,\n  \"srv_d2h_us\": %.3f,\n  \"srv_total_us\": %.3f,\n"
      "  \"outside_p50_us\": %.3f,\n  \"outside_p99_us\": %.3f,\n"
      "  \"hbm_gbps\": %.4f,\n  \"batch_sequences\": {%s},\n  \"errors_by_code\": {%s}\n}\n",
      r.target, r.transport, r.shape.layers, r.q_heads, r.shape.kv_heads, r.shape.head_dim, DTypeName(r.shape.dtype),
      r.sequences, r.context, r.steps, r.one_message ? "true" : "false", r.calls_ok, r.errors, r.elapsed_s,
      r.tokens_per_s, r.lat_mean_us, r.lat_p50_us, r.lat_p90_us, r.lat_p99_us, r.lat_max_us, r.srv_queue_us,
      r.srv_h2d_us, r.srv_kernel_us, r.srv_d2h_us, r.srv_total_us, r.outside_p50_us, r.outside_p99_us, r.hbm_gbps,
      batches, codes);
}

}  // namespace attnd::client
