#include "attnd/client/bench.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
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

  // Take() for a caller holding `mu`, which on kWait sleeps without it until *wake (or `until`, if sooner) and
  // answers kWait: another caller may take that call first, so the schedule is looked at again after the sleep.
  Next TakeOrSleep(absl::Mutex& mu, absl::Time now, absl::Time until, Start* call) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    absl::Time wake;
    const Next next = Take(now, call, &wake);
    if (next == Next::kWait) {
      mu.Unlock();
      absl::SleepFor(std::min(wake, until) - now);
      mu.Lock();
    }
    return next;
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
    const Schedule::Next next = sched.TakeOrSleep(run.mu, now, next_progress, &call);
    if (next == Schedule::Next::kStop) break;
    if (next == Schedule::Next::kWait) continue;
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
      const Schedule::Next next = sched.TakeOrSleep(run.mu, now, absl::InfiniteFuture(), &call);
      if (next == Schedule::Next::kStop) break;
      if (next == Schedule::Next::kWait) continue;
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
