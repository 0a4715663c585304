// The load-test engine behind `attn bench`: N calls in flight (closed loop) or a fixed arrival rate (open
// loop), a warmup that is not measured, exact latency percentiles, the server-side breakdown averaged from
// the replies' timing metadata, and errors by status code. Always bounded in time. Runs over the gRPC client
// (Client::ForwardAsync) or over blocking callers such as shared-memory channels (--transport=shm).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "attnd/client/client.h"
#include "attnd/client/shm_channel.h"
#include "attnd/client/tensors.h"

namespace attnd::client {

struct BenchOptions {
  int concurrency = 1;                           // calls in flight at most
  double rate = 0;                               // open loop: requests started per second; 0: closed loop
  absl::Duration duration = absl::Seconds(10);   // measured phase, when requests == 0
  int64_t requests = 0;                          // measured requests; > 0 overrides duration
  absl::Duration warmup = absl::Seconds(1);      // calls started in this first span are not measured
  int64_t verify_every = 0;                      // check every Nth reply against the oracle (needs one); 0: none
  absl::Duration max_duration = absl::Minutes(10);  // hard stop of the whole run, whatever else is asked
  CallOptions call;                              // per-call deadline and transport (gRPC clients only)
  // gRPC clients: each call in flight writes O (and LSE) into one of `concurrency` buffers kept for the whole
  // run (CallOptions::outputs), as an engine writing into memory it holds would; false: into fresh strings
  // in each result (allocated, and for large O page-faulted, per call).
  bool reuse_outputs = true;
  // Called about once a second with a one-line progress summary; empty: silent.
  std::function<void(const std::string&)> progress;
};

struct BenchReport {
  // What ran. Over shared-memory channels: target is the channel socket's path, connections the channels.
  std::string target, transport, backend, kernel;
  Problem problem;
  int concurrency = 0;
  int connections = 1;
  bool reuse_outputs = false;  // BenchOptions::reuse_outputs (gRPC clients)
  double rate = 0;
  // Counts of measured calls (warmup calls are only counted in warmup_requests).
  int64_t ok = 0, errors = 0, warmup_requests = 0;
  int64_t verified = 0, verify_failures = 0;
  int64_t late_starts = 0;     // open loop: starts more than 1 ms behind schedule (concurrency cap reached)
  bool hit_max_duration = false;
  std::string first_error, first_verify_failure;
  std::map<std::string, int64_t> errors_by_code;
  // Throughput over the measured span (first measured start to last measured completion).
  double elapsed_s = 0, req_per_s = 0, tflops = 0, gbps = 0;
  // Client-side latency of successful calls, microseconds. Open loop measures from the scheduled start, so a
  // server that falls behind shows it (no coordinated omission).
  double lat_min_us = 0, lat_mean_us = 0, lat_p50_us = 0, lat_p90_us = 0, lat_p95_us = 0, lat_p99_us = 0,
         lat_max_us = 0;
  // Server-reported timing averaged over successful calls, microseconds.
  double srv_queue_us = 0, srv_h2d_us = 0, srv_kernel_us = 0, srv_d2h_us = 0, srv_total_us = 0;
  // Payload (tensor bytes up and down) of one successful call, averaged.
  double bytes_per_request = 0;
  // The plain-TCP baseline of the same bytes (MeasureTcpLoopback), when the caller measured one; 0: none.
  double tcp_p50_us = 0;
  // The service's RPC floor on the same channel (MeasureRpcFloor), when measured; 0: none.
  double rpc_floor_us = 0;
};

// One request/response over a TCP loopback connection with no RPC layer: `up` bytes to a peer thread, `down`
// bytes back, `iters` times after two unmeasured rounds. The yardstick for the inline transport: the same
// bytes, the same host, the same run. Returns the p50 round trip in microseconds.
absl::StatusOr<double> MeasureTcpLoopback(uint64_t up, uint64_t down, int iters);

// The round trip of the service's smallest RPC (GetStats: no backend, a few hundred bytes) on `client`'s
// channel, p50 of `calls` after 50 unmeasured: what every Forward pays before the server does any work, so
// that a latency can be split into RPC floor and the rest. Fails if any call fails.
absl::StatusOr<double> MeasureRpcFloor(Client& client, int calls);

// Sends `request` repeatedly as `options` says. `oracle` may be null unless options.verify_every > 0.
// Fails only on bad options; call failures are counted in the report.
absl::StatusOr<BenchReport> RunBench(Client& client, std::shared_ptr<const v1::ForwardRequest> request,
                                     const Oracle* oracle, const BenchOptions& options);
// The same over several clients (each its own connection: ClientOptions::own_connection), calls rotating
// among them, so that large tensors are not all funnelled through one HTTP/2 connection.
absl::StatusOr<BenchReport> RunBench(const std::vector<Client*>& clients,
                                     std::shared_ptr<const v1::ForwardRequest> request, const Oracle* oracle,
                                     const BenchOptions& options);

// A Forward that blocks until its reply, for one caller making one call at a time (a shared-memory channel's:
// OpenShmCallers). Called from one thread only.
using SyncForward = std::function<absl::StatusOr<ForwardResult>(const v1::ForwardRequest&)>;

// The same load over blocking callers, one thread per caller: options.concurrency must equal callers.size()
// (each caller is one call in flight). Closed loop: each thread calls again as soon as its reply is in. Open loop:
// a free thread takes the next start of the schedule (late_starts counts those taken more than 1 ms behind it:
// all callers were busy). A call is timed from its scheduled start (open) or from its actual start (closed).
// options.call is not used (the callers carry their own timeouts). `target` names the callers in the report;
// the report's transport is that of the results (ForwardResult::transport; "shm" when none succeeded).
absl::StatusOr<BenchReport> RunBench(const std::vector<SyncForward>& callers, const std::string& target,
                                     std::shared_ptr<const v1::ForwardRequest> request, const Oracle* oracle,
                                     const BenchOptions& options);

// --transport=shm (`attn call` and `attn bench`).
// Reply-area room for the ForwardResponse's fields besides O and LSE (request id, backend and kernel names,
// timing, tags and lengths); the request id is added on top, since the reply echoes it.
constexpr uint64_t kShmReplySlackBytes = 64 << 10;
// Channel options for sending `request` to the server's --shm_socket at `socket_path`: a request area of the
// request's serialized size, a reply area for its O (unless o_ref) and LSE (when asked for) plus the slack.
// RESOURCE_EXHAUSTED naming --shm_max_bytes when either area would exceed max_area_bytes (the server refuses
// areas above its own --shm_max_bytes as well). auth_token is left empty: the caller sets it.
absl::StatusOr<ShmChannelOptions> ShmChannelOptionsFor(const v1::ForwardRequest& request, const std::string& socket_path,
                                                       uint64_t max_area_bytes);
// `n` shared-memory channels opened now, one per concurrent caller, as SyncForwards (ForwardOverShm) whose calls
// time out after `timeout`. A call that leaves its channel unusable (DEADLINE_EXCEEDED or UNAVAILABLE: the
// server gone, or a reply abandoned) closes it, and that caller's next call opens a new one (failing, with the
// reason, when it cannot). Fails, naming the channel, when any of the `n` cannot be opened.
absl::StatusOr<std::vector<SyncForward>> OpenShmCallers(const ShmChannelOptions& options, int n,
                                                        absl::Duration timeout);

// Nearest-rank percentile (p in (0, 100]) of an ascending vector; 0 for an empty one.
double Percentile(const std::vector<double>& sorted, double p);

std::string FormatBenchReport(const BenchReport& r);  // human-readable, several lines
std::string BenchReportJson(const BenchReport& r);
std::string BenchReportCsv(const BenchReport& r);     // a header line and one data line
// The lines of a human-readable report about failed calls: their count by status code and the first one's status
// ("" when none failed).
std::string FormatErrors(const std::map<std::string, int64_t>& errors_by_code, const std::string& first_error);

// ---- KV sequences (`attn seq`, `attn bench --workload=decode`; docs/sequences.md, "Client and CLI") ----------

// `attn seq`: one sequence opened, prefilled with `prefill` random tokens on every layer (append and attend),
// decoded `steps` steps (each step appends one token and attends, on every layer in turn), then closed (also
// after a failure). With verify, every step's O (and LSE) on every layer is checked against the double-precision
// reference over the whole cached history, which the run keeps on the client as the cache gives it back
// (CachedRows: quantized with the descales for a float8 cache).
struct SeqRunOptions {
  SequenceShape shape;
  int64_t q_heads = 0;  // 0: kv_heads
  int64_t prefill = 16;
  std::string move_to;  // after the prefill, the sequence moves to this server (Client::MoveSequence)
  int64_t steps = 8;
  bool verify = false;
  bool want_lse = false;
  uint64_t seed = 1;
  CallOptions call;
  std::function<void(const std::string&)> line;  // one line per step (and the prefill); empty: silent
};

struct SeqRunReport {
  std::string sequence_id;
  std::string transport;         // of the steps ("unary" for gRPC, "shm")
  int64_t steps = 0;             // decode steps finished (each over every layer)
  int64_t verified = 0, verify_failures = 0;  // layer-steps checked (prefill included)
  std::string first_verify_failure;
  double prefill_us = 0;              // the prefill, every layer, client-side
  std::string moved_from;             // the id before the move (move_to), and what the move took
  double move_us = 0;
  uint64_t moved_bytes = 0;           // K and V of every layer
  std::vector<double> step_us;        // each decode step over every layer, client-side
  double step_p50_us = 0, step_p99_us = 0;
  double layer_step_mean_us = 0;      // one Step call, mean
  double srv_kernel_mean_us = 0;      // server-reported kernel time of one Step call, mean
  std::vector<int64_t> final_lengths;  // per layer, from GetSequence before the close
};

absl::StatusOr<SeqRunReport> RunSequence(Client& client, const SeqRunOptions& options);
std::string FormatSeqReport(const SeqRunReport& r);

// `attn bench --workload=decode`: `sequences` sequences opened and prefilled with `context` random tokens on
// every layer (untimed, in chunks that fit a message), then `steps` decode steps per sequence, each over every
// layer (one Step call per layer). one_message: one caller sends every sequence's token in ONE Step per layer
// (the engine-shaped batch); otherwise one thread per sequence sends its own Steps concurrently, and the server
// forms batches of whatever arrives together. The sequences are closed at the end, also after failures.
struct DecodeBenchOptions {
  SequenceShape shape;
  int64_t q_heads = 0;  // 0: kv_heads
  int sequences = 1;
  int64_t context = 128;
  int64_t steps = 16;
  bool one_message = false;
  uint64_t seed = 1;
  absl::Duration max_duration = absl::Minutes(10);  // the decode phase stops here (hit_max_duration)
  CallOptions call;
  std::function<void(const std::string&)> progress;  // about once a second; empty: silent
};

struct DecodeBenchReport {
  std::string target, transport;  // transport: grpc-tcp, grpc-unix or shm (then target is the shm socket)
  SequenceShape shape;
  int64_t q_heads = 0;
  int sequences = 0;
  int64_t context = 0, steps = 0;
  bool one_message = false, hit_max_duration = false;
  int64_t calls_ok = 0, errors = 0;  // Step calls of the decode phase
  std::string first_error;
  std::map<std::string, int64_t> errors_by_code;
  double elapsed_s = 0;
  double tokens_per_s = 0;  // decoded tokens (one per sequence per step, every layer done) per second
  // Client-side latency of one Step call (one layer), microseconds.
  double lat_mean_us = 0, lat_p50_us = 0, lat_p90_us = 0, lat_p99_us = 0, lat_max_us = 0;
  // StepTiming.batch_sequences of each call: how many sequences the server launched together -> calls.
  std::map<uint32_t, int64_t> batch_sequences;
  double srv_queue_us = 0, srv_h2d_us = 0, srv_kernel_us = 0, srv_d2h_us = 0, srv_total_us = 0;  // means
  // Per call, client latency minus the server's total for it: the time outside the server's timer (the client
  // library, the transport, the server's handling before and after the step), p50 and p99 in microseconds.
  double outside_p50_us = 0, outside_p99_us = 0;
  // Achieved K/V read bandwidth, GB/s = sum over calls of B_c / sum over calls of (kernel_c x n_c / N_c), where
  // B_c = sum over the call's sequences of 2 x keys x kv_heads x head_dim x bytes of a cached element (the dtype's,
  // 1 for float8: K and V of every cached key, the new one included, as attention reads them), n_c the call's
  // sequences and N_c its batch_sequences (a call's share of the launch it joined, whose kernel time every joined
  // call reports).
  double hbm_gbps = 0;
};

absl::StatusOr<DecodeBenchReport> RunDecodeBench(Client& client, const DecodeBenchOptions& options);
std::string FormatDecodeReport(const DecodeBenchReport& r);
std::string DecodeReportJson(const DecodeBenchReport& r);

}  // namespace attnd::client
