// KV sequences: `attn seq` and `attn bench --workload=decode`.
#include "attnd/client/bench.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"

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

// "<old id> -> <new id>: <MB> in <ms> (<GB/s>)".
std::string MoveText(const SeqRunReport& r) {
  return absl::StrFormat("%s -> %s: %.1f MB of K and V in %.3f ms (%.2f GB/s)", r.moved_from, r.sequence_id,
                         r.moved_bytes / 1e6, r.move_us / 1e3, r.move_us > 0 ? r.moved_bytes / r.move_us / 1e3 : 0.0);
}

// attn seq --move_to: the sequence moves after the prefill; `token_bytes`: K and V of one token, every layer.
absl::Status MoveDuringRun(Client& client, const SeqRunOptions& o, uint64_t token_bytes, SeqRunReport& report) {
  const absl::Time t0 = absl::Now();
  absl::StatusOr<std::string> moved = client.MoveSequence(report.sequence_id, o.move_to, o.call);
  if (!moved.ok()) return absl::Status(moved.status().code(), absl::StrCat("move: ", moved.status().message()));
  report.move_us = absl::ToDoubleMicroseconds(absl::Now() - t0);
  report.moved_from = std::exchange(report.sequence_id, *moved);
  report.moved_bytes = static_cast<uint64_t>(o.prefill) * token_bytes;
  if (o.line) o.line(absl::StrCat("move: ", MoveText(report)));
  return absl::OkStatus();
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
    k_hist[layer] += CachedRows(shape, shape.k_descale, layer, k);
    v_hist[layer] += CachedRows(shape, shape.v_descale, layer, v);
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
    if (!o.move_to.empty()) {
      const uint64_t token_bytes = 2 * static_cast<uint64_t>(shape.kv_heads * shape.head_dim) * shape.kv_bytes();
      if (absl::Status s = MoveDuringRun(client, o, token_bytes * shape.layers, report); !s.ok()) return s;
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
  if (!r.moved_from.empty()) absl::StrAppend(&out, "  moved: ", MoveText(r), "\n");
  absl::StrAppend(&out, "  cached tokens per layer at the end: ", absl::StrJoin(r.final_lengths, ","), "\n");
  if (r.verified > 0) {
    absl::StrAppendFormat(&out, "  verified: %d layer-steps, %d failed%s\n", r.verified, r.verify_failures,
                          r.first_verify_failure.empty() ? "" : " (first: " + r.first_verify_failure + ")");
  }
  return out;
}

namespace {

// One decode caller's counts, written by that caller's thread alone.
struct CallerStats {
  std::vector<double> lat_us, outside_us;
  std::map<uint32_t, int64_t> batches;
  double queue = 0, h2d = 0, kernel = 0, d2h = 0, total = 0;
  double bytes_read = 0, kernel_share_us = 0;
  int64_t tokens = 0, ok = 0, errors = 0;
  std::map<std::string, int64_t> errors_by_code;
  std::string first_error;
};

// What the decode phase's callers share. Each caller owns a set of sequences (one, or all of them in one_message
// mode).
struct DecodePhase {
  Client& client;
  const DecodeBenchOptions& o;
  const std::vector<std::string>& ids;
  int64_t q_heads = 0;
  int per_caller = 1;
  absl::Time start, hard_stop;
  std::atomic<bool> stop{false};
  std::atomic<int64_t> progress_calls{0};
};

// Opened in groups within the server's per-call limit (SequenceLimits.max_open). `ids` keeps those opened, also
// after a failure, for the caller to close.
absl::Status OpenDecodeSequences(Client& client, const DecodeBenchOptions& o, std::vector<std::string>& ids) {
  uint32_t group = 64;
  absl::StatusOr<v1::ServerInfo> info = client.ServerInfo(false, o.call);
  if (info.ok() && info->sequences().max_open() > 0) group = info->sequences().max_open();
  while (static_cast<int>(ids.size()) < o.sequences) {
    const uint32_t n = std::min<uint32_t>(group, o.sequences - ids.size());
    absl::StatusOr<OpenedSequences> opened = client.OpenSequence(o.shape, 0, n, o.call);
    if (!opened.ok()) {
      return absl::Status(opened.status().code(), absl::StrCat("open: ", opened.status().message()));
    }
    ids.insert(ids.end(), opened->ids.begin(), opened->ids.end());
  }
  return absl::OkStatus();
}

// Prefill, untimed: append-only Steps in message-sized chunks. Every sequence gets the same random context
// (values do not matter to the timing).
absl::Status PrefillDecodeSequences(Client& client, const DecodeBenchOptions& o, const std::vector<std::string>& ids) {
  const SequenceShape& shape = o.shape;
  const int64_t kv_elems_row = shape.kv_heads * shape.head_dim;
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
            return absl::Status(r.status().code(), absl::StrCat("prefill: ", r.status().message()));
          }
        }
      }
    }
  }
  return absl::OkStatus();
}

// Caller `c`'s decode steps: every layer of each step, until o.steps, the hard stop, or another caller's stop.
void DecodeCaller(DecodePhase& p, int c, CallerStats& st) {
  Client& client = p.client;
  const DecodeBenchOptions& o = p.o;
  const SequenceShape& shape = o.shape;
  const int per_caller = p.per_caller;
  const int64_t kv_elems_row = shape.kv_heads * shape.head_dim;
  const int64_t q_elems_row = p.q_heads * shape.head_dim;
  const uint64_t ebytes = shape.kv_bytes();  // of a cached element, what attention reads
  const std::string q = RandomTensor(shape.dtype, per_caller * q_elems_row, o.seed * 11 + c);
  const std::string k = RandomTensor(shape.dtype, per_caller * kv_elems_row, o.seed * 13 + c);
  const std::string v = RandomTensor(shape.dtype, per_caller * kv_elems_row, o.seed * 17 + c);
  StepSpec spec;
  for (int i = 0; i < per_caller; ++i) spec.sequences.push_back({p.ids[c * per_caller + i], 1});
  spec.q_heads = p.q_heads;
  spec.q.data = q;
  spec.k.data = k;
  spec.v.data = v;
  for (int64_t s = 0; s < o.steps && !p.stop.load(std::memory_order_relaxed); ++s) {
    bool all_ok = true;
    for (int64_t layer = 0; layer < shape.layers; ++layer) {
      if (absl::Now() >= p.hard_stop) {
        p.stop.store(true);
        return;
      }
      spec.layer = layer;
      absl::StatusOr<StepResult> r = client.Step(spec, o.call);
      p.progress_calls.fetch_add(1, std::memory_order_relaxed);
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
}

// One thread per caller, and with o.progress a line about once a second until they are done.
void RunDecodeCallers(DecodePhase& p, std::vector<CallerStats>& stats) {
  const int callers = static_cast<int>(stats.size());
  std::vector<std::thread> threads;
  for (int c = 0; c < callers; ++c) threads.emplace_back([&p, &stats, c] { DecodeCaller(p, c, stats[c]); });
  if (p.o.progress) {
    std::thread watcher([&] {
      const int64_t total = static_cast<int64_t>(callers) * p.o.steps * p.o.shape.layers;
      while (!p.stop.load()) {
        absl::SleepFor(absl::Seconds(1));  // a progress line's period, not synchronisation
        const int64_t n = p.progress_calls.load();
        if (n >= total) break;
        p.o.progress(absl::StrFormat("decode: %d of %d Step calls, %.1f s", n, total,
                                     absl::ToDoubleSeconds(absl::Now() - p.start)));
      }
    });
    for (auto& t : threads) t.join();
    p.stop.store(true);
    watcher.join();
  } else {
    for (auto& t : threads) t.join();
  }
}

// The callers' counts into the report; report.elapsed_s is already set.
void SummarizeDecode(const std::vector<CallerStats>& stats, DecodeBenchReport& report) {
  std::vector<double> lat, outside;
  double queue = 0, h2d = 0, kernel = 0, d2h = 0, total = 0, bytes_read = 0, kernel_share = 0;
  int64_t tokens = 0;
  for (const CallerStats& st : stats) {
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
}

}  // namespace

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
  auto close_all = [&] {
    if (!ids.empty()) (void)client.CloseSequence(ids, o.call);
  };
  if (absl::Status s = OpenDecodeSequences(client, o, ids); !s.ok()) {
    close_all();
    return s;
  }
  if (absl::Status s = PrefillDecodeSequences(client, o, ids); !s.ok()) {
    close_all();
    return s;
  }

  // The decode phase.
  const int callers = o.one_message ? 1 : o.sequences;
  std::vector<CallerStats> stats(callers);
  const absl::Time start = absl::Now();
  DecodePhase phase{client, o, ids, q_heads, o.one_message ? o.sequences : 1, start, start + o.max_duration};
  RunDecodeCallers(phase, stats);
  report.elapsed_s = absl::ToDoubleSeconds(absl::Now() - start);
  report.hit_max_duration = absl::Now() >= phase.hard_stop;
  close_all();
  SummarizeDecode(stats, report);
  return report;
}

std::string FormatDecodeReport(const DecodeBenchReport& r) {
  std::string out;
  absl::StrAppendFormat(&out, "bench decode: %s over %s\n", r.target, r.transport);
  absl::StrAppendFormat(&out, "  shape: %d layers, q_heads %d, kv_heads %d, head_dim %d, %s%s\n", r.shape.layers,
                        r.q_heads, r.shape.kv_heads, r.shape.head_dim, DTypeName(r.shape.dtype),
                        r.shape.kv_format == KvFormat::kFp8E4M3 ? ", fp8_e4m3 K/V cache" : "");
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
  absl::StrAppend(&out, FormatErrors(r.errors_by_code, r.first_error));
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
      "  \"q_heads\": %d,\n  \"kv_heads\": %d,\n  \"head_dim\": %d,\n  \"dtype\": \"%s\",\n"
      "  \"kv_dtype\": \"%s\",\n  \"sequences\": %d,\n"
      "  \"context\": %d,\n  \"steps\": %d,\n  \"one_message\": %s,\n  \"calls_ok\": %d,\n  \"errors\": %d,\n"
      "  \"elapsed_s\": %.6f,\n  \"tokens_per_s\": %.3f,\n  \"lat_mean_us\": %.3f,\n  \"lat_p50_us\": %.3f,\n"
      "  \"lat_p90_us\": %.3f,\n  \"lat_p99_us\": %.3f,\n  \"lat_max_us\": %.3f,\n  \"srv_queue_us\": %.3f,\n"
      "  \"srv_h2d_us\": %.3f,\n  \"srv_kernel_us\": %.3f,\n  \"srv_d2h_us\": %.3f,\n  \"srv_total_us\": %.3f,\n"
      "  \"outside_p50_us\": %.3f,\n  \"outside_p99_us\": %.3f,\n"
      "  \"hbm_gbps\": %.4f,\n  \"batch_sequences\": {%s},\n  \"errors_by_code\": {%s}\n}\n",
      r.target, r.transport, r.shape.layers, r.q_heads, r.shape.kv_heads, r.shape.head_dim, DTypeName(r.shape.dtype),
      KvDtypeName(r.shape), r.sequences, r.context, r.steps, r.one_message ? "true" : "false", r.calls_ok, r.errors,
      r.elapsed_s, r.tokens_per_s, r.lat_mean_us, r.lat_p50_us, r.lat_p90_us, r.lat_p99_us, r.lat_max_us,
      r.srv_queue_us, r.srv_h2d_us, r.srv_kernel_us, r.srv_d2h_us, r.srv_total_us, r.outside_p50_us, r.outside_p99_us,
      r.hbm_gbps, batches, codes);
}

}  // namespace attnd::client
