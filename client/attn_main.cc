// attn: the attnd command-line client.
//   attn info                 what the server runs on and accepts
//   attn stats                the server's counters
//   attn call [--verify]      one Forward with random (seeded) or file inputs
//   attn bench                a bounded load test with a live progress line and a final report
//   attn seq [--verify]       one KV sequence: open, prefill, decode steps (checked against the reference), close
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "attnd/client/bench.h"
#include "attnd/client/client.h"
#include "attnd/client/shm_channel.h"
#include "attnd/client/tensors.h"
#include "attnd/transport/flags_help.h"
#include "attnd/transport/heap_tuning.h"

// Connection.
ABSL_FLAG(std::string, target, "127.0.0.1:50051", "server: host:port, unix:/path/to/socket, or dns:///name:port");
ABSL_FLAG(int64_t, deadline_ms, 60000, "per-call deadline in milliseconds");
ABSL_FLAG(std::string, transport, "auto",
          "auto (streaming from the server's stream_preferred_from_bytes of inline tensors, see attn info; below "
          "it unary when it fits the server's message limit, else streaming) | unary | stream | shm (call and "
          "bench: Forward over a same-host shared-memory channel at --shm_socket instead of gRPC). Steps of seq "
          "and bench --workload=decode: auto and stream over StepStream, unary over the unary Step RPC, shm over "
          "the channel");
ABSL_FLAG(uint64_t, chunk_bytes, 0, "ForwardStream chunk size in bytes (0: 1 MiB, capped by the server's limit)");
ABSL_FLAG(std::vector<std::string>, grpc_arg, {},
          "transport tuning: gRPC channel arguments, comma-separated name=value (e.g. "
          "grpc.http2.lookahead_bytes=8388608); applied last");
ABSL_FLAG(int32_t, move_connections, attnd::client::ClientOptions().move_connections,
          "seq --move_to by bytes: connections of the move's own to each server (0: the calls' connections)");
ABSL_FLAG(bool, wait_for_ready, false, "wait for the server to come up instead of failing fast");
ABSL_FLAG(std::string, shm_socket, "",
          "--transport=shm: the server's --shm_socket (a unix socket on this host); call and bench send their Forward "
          "calls over shared-memory channels there, everything else still goes to --target");
ABSL_FLAG(uint64_t, shm_max_bytes, 64ull << 20,
          "--transport=shm: largest request or reply area a channel may ask for (the server's --shm_max_bytes must "
          "allow it too); areas are sized from the request");
ABSL_FLAG(int64_t, step_poll_us, 300,
          "steps on a StepStream (seq, bench --workload=decode): microseconds a caller polls for a step's answer "
          "before it sleeps, while at most two steps of the process wait (0: sleeps at once)");
// Security (docs/security-and-metrics.md).
ABSL_FLAG(std::string, tls_ca, "", "PEM CA bundle that signed the server's certificate: connect with TLS");
ABSL_FLAG(std::string, tls_cert, "", "PEM client certificate for mutual TLS (with --tls_key)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_server_name, "", "name to verify the server's certificate against (default: the target's host)");
ABSL_FLAG(std::string, auth_token_file, "", "file whose first non-comment line is the bearer token to send");
ABSL_FLAG(std::string, auth_token, "", "bearer token to send (prefer --auth_token_file: flags show in ps)");

// Problem.
ABSL_FLAG(int64_t, batch, 1, "sequences per request");
ABSL_FLAG(int64_t, q_len, 512, "query rows per sequence");
ABSL_FLAG(int64_t, kv_len, 0, "key/value rows per sequence (0: q_len)");
ABSL_FLAG(int64_t, q_heads, 8, "query heads");
ABSL_FLAG(int64_t, kv_heads, 0, "key/value heads (0: q_heads; fewer for GQA/MQA)");
ABSL_FLAG(int64_t, head_dim, 128, "head dimension");
ABSL_FLAG(std::string, dtype, "bf16",
          "bf16 | fp16 | fp8_e4m3 (call, bench: float8 Q, K and V read through --q_descale, --k_descale, "
          "--v_descale; O bf16)");
ABSL_FLAG(std::vector<std::string>, q_descale, {},
          "--dtype=fp8_e4m3: Q's descale, 1 value or one per q head (comma-separated); element x of head h is read "
          "as x * descale[h]. Empty: random inputs get the amax / 448 of their values, file inputs must give it");
ABSL_FLAG(std::vector<std::string>, k_descale, {}, "--dtype=fp8_e4m3: K's descale, 1 value or one per kv head");
ABSL_FLAG(std::vector<std::string>, v_descale, {}, "--dtype=fp8_e4m3: V's descale, 1 value or one per kv head");
ABSL_FLAG(std::string, mask, "none", "none | causal (top-left, torch is_causal) | causal_bottom_right (FlashAttention)");
ABSL_FLAG(bool, causal, false, "shorthand for --mask=causal");
ABSL_FLAG(std::string, scale, "", "softmax scale (empty: 1/sqrt(head_dim))");
ABSL_FLAG(bool, lse, false, "also return the log-sum-exp");
ABSL_FLAG(uint64_t, seed, 1, "seed of the random inputs");

// call.
ABSL_FLAG(std::string, q_file, "", "call: raw Q bytes [batch, q_len, q_heads, head_dim] (with --k_file, --v_file)");
ABSL_FLAG(std::string, k_file, "", "call: raw K bytes [batch, kv_len, kv_heads, head_dim]");
ABSL_FLAG(std::string, v_file, "", "call: raw V bytes [batch, kv_len, kv_heads, head_dim]");
ABSL_FLAG(std::string, o_file, "", "call: write O here");
ABSL_FLAG(std::string, lse_file, "", "call: write the LSE (fp32) here (implies --lse)");
ABSL_FLAG(bool, verify, false, "call: recompute on the CPU reference (double) and check the error bound");
ABSL_FLAG(std::string, request_id, "", "call: request id echoed by the server");

// bench.
ABSL_FLAG(int32_t, concurrency, 1, "bench: calls in flight");
ABSL_FLAG(int32_t, connections, 1, "bench: connections (channels) the calls rotate over");
ABSL_FLAG(double, rate, 0, "bench: open-loop arrival rate in req/s (0: closed loop)");
ABSL_FLAG(absl::Duration, duration, absl::Seconds(10), "bench: measured duration (ignored with --requests)");
ABSL_FLAG(int64_t, requests, 0, "bench: number of measured requests (0: use --duration)");
ABSL_FLAG(absl::Duration, warmup, absl::Seconds(1), "bench: unmeasured warmup before measuring");
ABSL_FLAG(absl::Duration, max_duration, absl::Minutes(10), "bench: hard stop of the whole run");
ABSL_FLAG(int64_t, verify_every, 0, "bench: verify every Nth reply against the reference (0: never)");
ABSL_FLAG(std::string, json, "", "bench: write the report as JSON to this file");
ABSL_FLAG(std::string, csv, "", "bench: write the report as CSV (header + one row) to this file");
ABSL_FLAG(bool, progress, true, "bench: live progress line on stderr");
ABSL_FLAG(bool, reuse_outputs, true,
          "bench: each call in flight writes O (and LSE) into a buffer kept for the run, as an engine writing into "
          "memory it holds would; false: into fresh memory per call (allocated and page-faulted every time)");
ABSL_FLAG(bool, rpc_floor, false,
          "bench: first time 500 GetStats round trips (the service's smallest RPC) on the same channel and report "
          "how far above that floor the Forward latency is");
ABSL_FLAG(bool, tcp_baseline, false,
          "bench: first time a plain TCP loopback transfer of the same bytes (no RPC layer) and report the "
          "transport's rate against it (meaningful when the server is on this host)");

// KV sequences (seq, and bench --workload=decode); the shape is --layers --kv_heads --q_heads --head_dim --dtype.
ABSL_FLAG(std::string, workload, "forward",
          "bench: forward (one Forward with the shape flags, repeated) | decode (KV sequences: --sequences opened, "
          "--context tokens prefilled untimed, then --steps decode steps each over every layer)");
ABSL_FLAG(int64_t, layers, 2, "seq, bench --workload=decode: layers of the sequence (each its own K/V)");
ABSL_FLAG(std::string, kv_dtype, "",
          "seq, bench --workload=decode: how the sequences' cache stores K and V: bf16 | fp16 (must equal --dtype) | "
          "fp8_e4m3 (float8 codes of x / --kv_descale, half the bytes); empty: --dtype");
ABSL_FLAG(double, kv_descale, 1.0 / 64,
          "seq, bench --workload=decode with --kv_dtype=fp8_e4m3: the descale of K and of V, every layer and kv head "
          "(finite, > 0). The default 1/64 suits the tools' N(0, 1) rows, whose |x| stays near 5 and below: x / "
          "(1/64) keeps clear of e4m3's subnormals and of its 448 saturation until |x| = 7, for a round-trip RMSE of "
          "0.027 (1/256 saturates from |x| = 1.75: 0.155). Real K/V: amax / 448 per layer and head");
ABSL_FLAG(int64_t, prefill, 16, "seq: tokens prefilled on every layer (append and attend) before decoding");
ABSL_FLAG(std::string, move_to, "",
          "seq: after the prefill, move the sequence to the server at this address (the one after its ids' '@'), "
          "report the move's time and rate, and decode there");
ABSL_FLAG(int64_t, steps, 8, "seq, bench --workload=decode: decode steps (per sequence), each over every layer");
ABSL_FLAG(int32_t, sequences, 4, "bench --workload=decode: sequences decoding concurrently");
ABSL_FLAG(int64_t, context, 128, "bench --workload=decode: tokens prefilled per sequence and layer (untimed)");
ABSL_FLAG(bool, one_message, false,
          "bench --workload=decode: every sequence's token in ONE Step per layer (the engine-shaped batch) instead "
          "of one Step per sequence from a thread per sequence");

namespace {

using attnd::client::Client;
using attnd::client::ClientOptions;
using attnd::client::RequestSpec;
using attnd::client::Transport;

constexpr int kExitFail = 1;
constexpr int kExitUsage = 2;

int Fail(const absl::Status& s, const std::string& what) {
  std::cerr << "attn: " << what << ": " << s << "\n";
  return kExitFail;
}

absl::StatusOr<std::unique_ptr<Client>> Connect(bool own_connection = false) {
  ClientOptions o;
  o.own_connection = own_connection;
  o.target = absl::GetFlag(FLAGS_target);
  const int64_t ms = absl::GetFlag(FLAGS_deadline_ms);
  if (ms <= 0) return absl::InvalidArgumentError("--deadline_ms: must be positive");
  o.default_deadline = absl::Milliseconds(ms);
  auto t = attnd::client::ParseTransport(absl::GetFlag(FLAGS_transport));
  if (!t.ok()) return t.status();
  o.transport = *t;
  o.stream_chunk_bytes = absl::GetFlag(FLAGS_chunk_bytes);
  o.tls_ca_file = absl::GetFlag(FLAGS_tls_ca);
  o.tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
  o.tls_key_file = absl::GetFlag(FLAGS_tls_key);
  o.tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  o.auth_token = absl::GetFlag(FLAGS_auth_token);
  o.grpc_args = absl::GetFlag(FLAGS_grpc_arg);
  o.move_connections = absl::GetFlag(FLAGS_move_connections);
  o.shm_socket = absl::GetFlag(FLAGS_shm_socket);
  o.shm_max_area_bytes = absl::GetFlag(FLAGS_shm_max_bytes);
  if (absl::GetFlag(FLAGS_step_poll_us) < 0) return absl::InvalidArgumentError("--step_poll_us: must be >= 0");
  o.step_poll = absl::Microseconds(absl::GetFlag(FLAGS_step_poll_us));
  if (const std::string path = absl::GetFlag(FLAGS_auth_token_file); !path.empty()) {
    std::ifstream in(path);
    if (!in) return absl::InvalidArgumentError("--auth_token_file: cannot read '" + path + "'");
    std::string line;
    o.auth_token.clear();
    while (o.auth_token.empty() && std::getline(in, line)) {
      const absl::string_view t = absl::StripAsciiWhitespace(line);
      if (!t.empty() && t[0] != '#') o.auth_token = std::string(t);
    }
    if (o.auth_token.empty()) return absl::InvalidArgumentError("--auth_token_file: '" + path + "' holds no token");
  }
  return Client::Create(o);
}

attnd::client::CallOptions CallOpts() {
  attnd::client::CallOptions c;
  c.wait_for_ready = absl::GetFlag(FLAGS_wait_for_ready);
  return c;
}

// --transport=shm: Forward calls go over shared-memory channels at --shm_socket, not through `client`.
bool UseShm(const Client& client) { return client.options().transport == Transport::kShm; }

// Options of a channel that carries `request` (its areas sized from it), with the gRPC client's token.
absl::StatusOr<attnd::client::ShmChannelOptions> ShmOptions(const Client& client,
                                                            const attnd::v1::ForwardRequest& request) {
  auto o = attnd::client::ShmChannelOptionsFor(request, absl::GetFlag(FLAGS_shm_socket),
                                               absl::GetFlag(FLAGS_shm_max_bytes));
  if (o.ok()) o->auth_token = client.options().auth_token;
  return o;
}

absl::StatusOr<attnd::DType> DTypeFromFlags() {
  const std::string dtype = absl::GetFlag(FLAGS_dtype);
  if (dtype == "bf16") return attnd::DType::kBF16;
  if (dtype == "fp16") return attnd::DType::kFP16;
  if (dtype == "fp8_e4m3") return attnd::DType::kFP8E4M3;
  return absl::InvalidArgumentError(absl::StrCat("--dtype: '", dtype, "' is not bf16, fp16 or fp8_e4m3"));
}

// --q_descale, --k_descale, --v_descale as numbers (the server checks their counts and values, naming the field);
// only with --dtype=fp8_e4m3.
absl::Status DescalesFromFlags(RequestSpec& s) {
  const std::pair<const char*, std::vector<std::string>> flags[] = {{"--q_descale", absl::GetFlag(FLAGS_q_descale)},
                                                                    {"--k_descale", absl::GetFlag(FLAGS_k_descale)},
                                                                    {"--v_descale", absl::GetFlag(FLAGS_v_descale)}};
  std::vector<float>* out[] = {&s.q_descale, &s.k_descale, &s.v_descale};
  for (int i = 0; i < 3; ++i) {
    const auto& [name, values] = flags[i];
    if (!values.empty() && s.dtype != attnd::DType::kFP8E4M3) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": only with --dtype=fp8_e4m3"));
    }
    for (const std::string& v : values) {
      float f;
      if (!absl::SimpleAtof(v, &f)) {
        return absl::InvalidArgumentError(absl::StrCat(name, ": '", v, "' is not a number"));
      }
      out[i]->push_back(f);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<RequestSpec> SpecFromFlags() {
  RequestSpec s;
  s.shape.batch = absl::GetFlag(FLAGS_batch);
  s.shape.q_len = absl::GetFlag(FLAGS_q_len);
  s.shape.kv_len = absl::GetFlag(FLAGS_kv_len) ? absl::GetFlag(FLAGS_kv_len) : s.shape.q_len;
  s.shape.q_heads = absl::GetFlag(FLAGS_q_heads);
  s.shape.kv_heads = absl::GetFlag(FLAGS_kv_heads) ? absl::GetFlag(FLAGS_kv_heads) : s.shape.q_heads;
  s.shape.head_dim = absl::GetFlag(FLAGS_head_dim);
  const auto& sh = s.shape;
  if (sh.batch <= 0 || sh.q_len <= 0 || sh.kv_len <= 0 || sh.q_heads <= 0 || sh.kv_heads <= 0 || sh.head_dim <= 0) {
    return absl::InvalidArgumentError("--batch, --q_len, --kv_len, --q_heads, --kv_heads, --head_dim: must be positive");
  }
  if (sh.q_heads % sh.kv_heads != 0) return absl::InvalidArgumentError("--q_heads: must be a multiple of --kv_heads");
  absl::StatusOr<attnd::DType> dtype = DTypeFromFlags();
  if (!dtype.ok()) return dtype.status();
  s.dtype = *dtype;
  if (absl::Status d = DescalesFromFlags(s); !d.ok()) return d;
  const std::string mask = absl::GetFlag(FLAGS_mask);
  if (mask == "none") {
    s.mask = attnd::Mask::kNone;
  } else if (mask == "causal" || mask == "causal_top_left") {
    s.mask = attnd::Mask::kCausalTopLeft;
  } else if (mask == "causal_bottom_right") {
    s.mask = attnd::Mask::kCausalBottomRight;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("--mask: '", mask, "' is not none, causal or causal_bottom_right"));
  }
  if (absl::GetFlag(FLAGS_causal)) {
    if (s.mask == attnd::Mask::kCausalBottomRight) {
      return absl::InvalidArgumentError("--causal: conflicts with --mask=causal_bottom_right");
    }
    s.mask = attnd::Mask::kCausalTopLeft;
  }
  const std::string scale = absl::GetFlag(FLAGS_scale);
  if (!scale.empty()) {
    float f;
    if (!absl::SimpleAtof(scale, &f) || !std::isfinite(f)) {
      return absl::InvalidArgumentError(absl::StrCat("--scale: '", scale, "' is not a finite number"));
    }
    s.scale = f;
  }
  s.want_lse = absl::GetFlag(FLAGS_lse) || !absl::GetFlag(FLAGS_lse_file).empty();
  s.request_id = absl::GetFlag(FLAGS_request_id);
  return s;
}

struct Inputs {
  std::string q, k, v;
};

// Random inputs (float8 ones quantized with the spec's descales, which get amax / 448 where not given), or the
// files'.
absl::StatusOr<Inputs> InputsFromFlags(RequestSpec& spec) {
  const std::string qf = absl::GetFlag(FLAGS_q_file), kf = absl::GetFlag(FLAGS_k_file), vf = absl::GetFlag(FLAGS_v_file);
  Inputs in;
  const attnd::Shape& sh = spec.shape;
  if (qf.empty() && kf.empty() && vf.empty()) {
    const uint64_t seed = absl::GetFlag(FLAGS_seed);
    if (spec.dtype == attnd::DType::kFP8E4M3) {
      // Quantized per head only with one descale per head: any other count of them is refused here, by name.
      for (const auto& [name, given, heads] : {std::tuple("--q_descale", &spec.q_descale, sh.q_heads),
                                               std::tuple("--k_descale", &spec.k_descale, sh.kv_heads),
                                               std::tuple("--v_descale", &spec.v_descale, sh.kv_heads)}) {
        if (given->empty()) continue;
        if (auto per_head = attnd::client::DescalesPerHead(name, *given, heads); !per_head.ok()) {
          return per_head.status();
        }
      }
      const int64_t d = sh.head_dim;
      in.q = attnd::client::RandomFp8Tensor(attnd::QElems(sh), sh.q_heads, d, seed * 3 + 0, &spec.q_descale);
      in.k = attnd::client::RandomFp8Tensor(attnd::KVElems(sh), sh.kv_heads, d, seed * 3 + 1, &spec.k_descale);
      in.v = attnd::client::RandomFp8Tensor(attnd::KVElems(sh), sh.kv_heads, d, seed * 3 + 2, &spec.v_descale);
      return in;
    }
    in.q = attnd::client::RandomTensor(spec.dtype, attnd::QElems(sh), seed * 3 + 0);
    in.k = attnd::client::RandomTensor(spec.dtype, attnd::KVElems(sh), seed * 3 + 1);
    in.v = attnd::client::RandomTensor(spec.dtype, attnd::KVElems(sh), seed * 3 + 2);
    return in;
  }
  if (qf.empty() || kf.empty() || vf.empty()) {
    return absl::InvalidArgumentError("--q_file, --k_file, --v_file: give all three or none");
  }
  if (spec.dtype == attnd::DType::kFP8E4M3 &&
      (spec.q_descale.empty() || spec.k_descale.empty() || spec.v_descale.empty())) {
    return absl::InvalidArgumentError(
        "--q_descale, --k_descale, --v_descale: required with --dtype=fp8_e4m3 and file inputs (the files' scales)");
  }
  auto q = attnd::client::ReadTensorFile(qf, spec.q_bytes());
  if (!q.ok()) return q.status();
  auto k = attnd::client::ReadTensorFile(kf, spec.kv_bytes());
  if (!k.ok()) return k.status();
  auto v = attnd::client::ReadTensorFile(vf, spec.kv_bytes());
  if (!v.ok()) return v.status();
  in.q = *std::move(q);
  in.k = *std::move(k);
  in.v = *std::move(v);
  return in;
}

std::string ShapeLine(const RequestSpec& s) {
  const attnd::Problem p = s.ToProblem();
  return absl::StrFormat("batch %d, q_len %d, kv_len %d, q_heads %d, kv_heads %d, head_dim %d, %s, mask %s, scale %.6g%s",
                         s.shape.batch, s.shape.q_len, s.shape.kv_len, s.shape.q_heads, s.shape.kv_heads,
                         s.shape.head_dim, attnd::DTypeName(s.dtype), attnd::MaskName(s.mask), p.scale,
                         s.want_lse ? ", lse" : "") +
         (s.dtype == attnd::DType::kFP8E4M3
              ? absl::StrCat(", descales q ", absl::StrJoin(s.q_descale, ","), " k ", absl::StrJoin(s.k_descale, ","),
                             " v ", absl::StrJoin(s.v_descale, ","))
              : "");
}

int CmdInfo(Client& client) {
  auto info = client.ServerInfo(true, CallOpts());
  if (!info.ok()) return Fail(info.status(), "GetServerInfo");
  std::cout << "server " << client.options().target << "\n";
  std::cout << "  version: " << info->version() << "\n";
  std::cout << "  backend: " << info->backend() << "\n";
  for (const auto& d : info->devices()) {
    std::cout << absl::StrFormat("  device %d: %s, sm_%d%d, %.1f GiB, %d SMs\n", d.index(), d.name(),
                                 d.compute_capability_major(), d.compute_capability_minor(),
                                 static_cast<double>(d.total_memory_bytes()) / (1ull << 30), d.multiprocessor_count());
  }
  std::cout << "  head dims: " << absl::StrJoin(info->supported_head_dims(), ", ") << "\n";
  std::vector<std::string> dtypes;
  for (int t : info->supported_dtypes()) dtypes.push_back(attnd::v1::Dtype_Name(static_cast<attnd::v1::Dtype>(t)));
  std::cout << "  dtypes: " << absl::StrJoin(dtypes, ", ") << "\n";
  const auto& l = info->limits();
  std::cout << absl::StrFormat("  limits: max_request_bytes %d, max_message_bytes %d, max_queue %d, max_head_dim %d\n",
                               l.max_request_bytes(), l.max_message_bytes(), l.max_queue(), l.max_head_dim());
  auto limit = [](int64_t v) { return v > 0 ? absl::StrCat(v) : std::string("none"); };
  std::cout << absl::StrFormat("  shape limits: max_batch %s, max_q_len %s, max_kv_len %s, max_heads %s\n",
                               limit(l.max_batch()), limit(l.max_q_len()), limit(l.max_kv_len()),
                               limit(l.max_heads()));
  std::cout << "  cuda ipc: " << (info->cuda_ipc_enabled() ? "enabled" : "disabled") << "\n";
  std::cout << "  stream preferred from: "
            << (info->stream_preferred_from_bytes() > 0
                    ? absl::StrCat(info->stream_preferred_from_bytes(), " bytes of inline tensors")
                    : std::string("none (auto streams only what does not fit one message)"))
            << "\n";
  std::cout << "  kernels: " << absl::StrJoin(info->kernels(), ", ") << "\n";
  absl::Status health = client.CheckHealth("", CallOpts());
  std::cout << "  health: " << (health.ok() ? "SERVING" : std::string(health.message())) << "\n";
  return health.ok() ? 0 : kExitFail;
}

int CmdStats(Client& client) {
  auto st = client.Stats(CallOpts());
  if (!st.ok()) return Fail(st.status(), "GetStats");
  std::cout << absl::StrFormat(
      "uptime %.1f s, queue depth %d, in flight %d, streams receiving %d, bytes in %d, bytes out %d\n", st->uptime_s(),
      st->queue_depth(), st->in_flight(), st->streams_receiving(), st->bytes_in(), st->bytes_out());
  std::cout << absl::StrFormat("tensor map cache: %d hits, %d misses\n", st->tensor_map_cache_hits(),
                               st->tensor_map_cache_misses());
  for (const auto& r : st->rpcs()) {
    std::vector<std::string> codes;
    for (const auto& [code, n] : r.errors_by_code()) codes.push_back(absl::StrCat(code, " ", n));
    std::cout << absl::StrFormat("  %-22s %8d calls, %6d errors, mean %.3f ms%s\n", r.method(), r.count(), r.errors(),
                                 r.count() ? r.total_duration_us() / static_cast<double>(r.count()) / 1e3 : 0.0,
                                 codes.empty() ? "" : " (" + absl::StrJoin(codes, ", ") + ")");
  }
  return 0;
}

int CmdCall(Client& client) {
  auto spec = SpecFromFlags();
  if (!spec.ok()) return Fail(spec.status(), "flags");
  auto inputs = InputsFromFlags(*spec);
  if (!inputs.ok()) return Fail(inputs.status(), "inputs");
  std::optional<attnd::client::Oracle> oracle;
  if (absl::GetFlag(FLAGS_verify)) {
    // Computed before sending so the inputs can be moved into the request.
    auto o = attnd::client::Oracle::Compute(*spec, inputs->q, inputs->k, inputs->v);
    if (!o.ok()) return Fail(o.status(), "reference");
    oracle = *std::move(o);
  }
  // Shared, so that the tensors go out by reference rather than being copied into the message.
  const auto request = std::make_shared<const attnd::v1::ForwardRequest>(
      attnd::client::MakeForwardRequest(*spec, std::move(inputs->q), std::move(inputs->k), std::move(inputs->v)));
  std::cout << "call: " << ShapeLine(*spec) << "\n";
  absl::StatusOr<attnd::client::ForwardResult> res;
  if (UseShm(client)) {
    auto so = ShmOptions(client, *request);
    if (!so.ok()) return Fail(so.status(), "flags");
    auto channel = attnd::client::ShmChannel::Connect(*so);
    if (!channel.ok()) return Fail(channel.status(), "--shm_socket");
    res = attnd::client::ForwardOverShm(**channel, *request, client.options().default_deadline);
  } else {
    res = client.ForwardFuture(request, CallOpts()).get();
  }
  if (!res.ok()) return Fail(res.status(), "Forward");
  const auto& t = res->timing;
  const double flops = attnd::ForwardFlops(spec->ToProblem());
  std::cout << absl::StrFormat("  reply: backend %s, kernel %s, device %d, transport %s, %d bytes of O%s\n",
                               res->backend, res->kernel, res->device, attnd::client::TransportName(res->transport),
                               res->o.size(), res->lse.empty() ? "" : absl::StrCat(", ", res->lse.size(), " bytes of LSE"));
  std::cout << absl::StrFormat("  latency %.3f ms (client); server ms: queue %.3f, h2d %.3f, kernel %.3f, d2h %.3f, total %.3f\n",
                               absl::ToDoubleMilliseconds(res->latency), t.queue_us() / 1e3, t.h2d_us() / 1e3,
                               t.kernel_us() / 1e3, t.d2h_us() / 1e3, t.total_us() / 1e3);
  if (t.kernel_us() > 0) {
    std::cout << absl::StrFormat("  kernel throughput: %.4f TFLOP/s (%.3g FLOP)\n", flops / t.kernel_us() / 1e6, flops);
  }
  const std::string of = absl::GetFlag(FLAGS_o_file), lf = absl::GetFlag(FLAGS_lse_file);
  if (!of.empty()) {
    absl::Status s = attnd::client::WriteFile(of, res->o);
    if (!s.ok()) return Fail(s, "--o_file");
  }
  if (!lf.empty()) {
    absl::Status s = attnd::client::WriteFile(lf, res->lse);
    if (!s.ok()) return Fail(s, "--lse_file");
  }
  if (oracle) {
    const attnd::client::VerifyReport v = oracle->Check(res->o, res->lse);
    std::cout << absl::StrFormat(
        "verify: max_abs_err %.3e (bound %.3e), rel_l2_err %.3e (bound %.3e)%s; fp32 reference: %.3e, %.3e\n",
        v.max_abs_err, v.bound_max_abs, v.rel_l2_err, v.bound_rel_l2,
        res->lse.empty() ? "" : absl::StrFormat(", lse_max_abs_err %.3e (bound %.3e)", v.lse_max_abs_err, v.bound_lse),
        v.ref_max_abs_err, v.ref_rel_l2_err);
    std::cout << (v.pass ? "verify: PASS\n" : "verify: FAIL: " + v.detail + "\n");
    if (!v.pass) return kExitFail;
  }
  return 0;
}

int CmdBench(Client& client) {
  auto spec = SpecFromFlags();
  if (!spec.ok()) return Fail(spec.status(), "flags");
  if (!absl::GetFlag(FLAGS_q_file).empty()) {
    return Fail(absl::InvalidArgumentError("--q_file: bench uses random inputs"), "flags");
  }
  auto inputs = InputsFromFlags(*spec);
  if (!inputs.ok()) return Fail(inputs.status(), "inputs");
  attnd::client::BenchOptions opt;
  opt.concurrency = absl::GetFlag(FLAGS_concurrency);
  opt.rate = absl::GetFlag(FLAGS_rate);
  opt.duration = absl::GetFlag(FLAGS_duration);
  opt.requests = absl::GetFlag(FLAGS_requests);
  opt.warmup = absl::GetFlag(FLAGS_warmup);
  opt.max_duration = absl::GetFlag(FLAGS_max_duration);
  opt.verify_every = absl::GetFlag(FLAGS_verify_every);
  opt.reuse_outputs = absl::GetFlag(FLAGS_reuse_outputs);
  opt.call = CallOpts();
  std::optional<attnd::client::Oracle> oracle;
  if (opt.verify_every > 0) {
    auto o = attnd::client::Oracle::Compute(*spec, inputs->q, inputs->k, inputs->v);
    if (!o.ok()) return Fail(o.status(), "reference");
    oracle = *std::move(o);
  }
  if (absl::GetFlag(FLAGS_progress)) {
    // A terminal gets one line rewritten in place; a pipe or file gets one line per second.
    const bool tty = isatty(STDERR_FILENO);
    opt.progress = [tty](const std::string& line) {
      if (tty) {
        std::fprintf(stderr, "\r\033[K%s", line.c_str());
      } else {
        std::fprintf(stderr, "%s\n", line.c_str());
      }
      std::fflush(stderr);
    };
  }
  auto request = std::make_shared<const attnd::v1::ForwardRequest>(
      attnd::client::MakeForwardRequest(*spec, std::move(inputs->q), std::move(inputs->k), std::move(inputs->v)));
  const int connections = absl::GetFlag(FLAGS_connections);
  if (connections < 1) return Fail(absl::InvalidArgumentError("--connections: must be >= 1"), "flags");
  const bool shm = UseShm(client);
  // --transport=shm: one channel per call in flight (a channel carries one request at a time), opened before
  // the clock starts. --connections does not apply, and --rpc_floor (a gRPC round trip) has nothing to compare
  // with: both are ignored with a note, so one command line can sweep every transport.
  std::vector<attnd::client::SyncForward> shm_callers;
  if (shm) {
    if (opt.concurrency < 1) return Fail(absl::InvalidArgumentError("--concurrency: must be >= 1"), "flags");
    if (connections != 1) {
      std::cerr << "attn: note: --connections ignored with --transport=shm (each of the --concurrency callers has "
                   "its own channel)\n";
    }
    if (absl::GetFlag(FLAGS_rpc_floor)) {
      std::cerr << "attn: note: --rpc_floor ignored with --transport=shm (it times a gRPC round trip; the "
                   "shared-memory channel has no RPC layer)\n";
    }
    auto so = ShmOptions(client, *request);
    if (!so.ok()) return Fail(so.status(), "flags");
    auto opened = attnd::client::OpenShmCallers(*so, opt.concurrency, client.options().default_deadline);
    if (!opened.ok()) return Fail(opened.status(), "--shm_socket");
    shm_callers = *std::move(opened);
  }
  std::vector<std::unique_ptr<Client>> extra;
  std::vector<Client*> clients = {&client};
  for (int i = 1; i < connections && !shm; ++i) {
    auto c = Connect(/*own_connection=*/true);
    if (!c.ok()) return Fail(c.status(), "connect");
    extra.push_back(*std::move(c));
    clients.push_back(extra.back().get());
  }
  double tcp_p50_us = 0;
  if (absl::GetFlag(FLAGS_tcp_baseline)) {
    // Before the bench, not beside it: the two would share the cores and each would slow the other.
    const uint64_t up = spec->q_bytes() + 2 * spec->kv_bytes();
    const uint64_t down = spec->o_bytes() + (spec->want_lse ? spec->lse_bytes() : 0);
    absl::StatusOr<double> tcp = attnd::client::MeasureTcpLoopback(up, down, 20);
    if (!tcp.ok()) return Fail(tcp.status(), "--tcp_baseline");
    tcp_p50_us = *tcp;
  }
  double rpc_floor_us = 0;
  if (absl::GetFlag(FLAGS_rpc_floor) && !shm) {
    absl::StatusOr<double> floor = attnd::client::MeasureRpcFloor(client, 500);
    if (!floor.ok()) return Fail(floor.status(), "--rpc_floor");
    rpc_floor_us = *floor;
  }
  std::cerr << "bench: " << ShapeLine(*spec) << "\n";
  auto report = shm ? attnd::client::RunBench(shm_callers, absl::GetFlag(FLAGS_shm_socket), request,
                                              oracle ? &*oracle : nullptr, opt)
                    : attnd::client::RunBench(clients, request, oracle ? &*oracle : nullptr, opt);
  if (report.ok()) {
    report->tcp_p50_us = tcp_p50_us;
    report->rpc_floor_us = rpc_floor_us;
  }
  if (opt.progress && isatty(STDERR_FILENO)) std::fprintf(stderr, "\n");
  if (!report.ok()) return Fail(report.status(), "bench");
  std::cout << attnd::client::FormatBenchReport(*report);
  const std::string json = absl::GetFlag(FLAGS_json), csv = absl::GetFlag(FLAGS_csv);
  if (!json.empty()) {
    absl::Status s = attnd::client::WriteFile(json, attnd::client::BenchReportJson(*report));
    if (!s.ok()) return Fail(s, "--json");
  }
  if (!csv.empty()) {
    absl::Status s = attnd::client::WriteFile(csv, attnd::client::BenchReportCsv(*report));
    if (!s.ok()) return Fail(s, "--csv");
  }
  if (report->ok == 0 || report->errors > 0 || report->verify_failures > 0) {
    std::cerr << "attn: bench: " << report->errors << " errors, " << report->verify_failures
              << " verification failures, " << report->ok << " ok\n";
    return kExitFail;
  }
  return 0;
}

// --kv_dtype and --kv_descale into a shape whose dtype is set.
absl::Status KvFormatFromFlags(attnd::client::SequenceShape& s) {
  const std::string kv = absl::GetFlag(FLAGS_kv_dtype);
  if (kv.empty() || kv == attnd::DTypeName(s.dtype)) return absl::OkStatus();
  if (kv != "fp8_e4m3") {
    return absl::InvalidArgumentError(
        absl::StrCat("--kv_dtype: '", kv, "' is not fp8_e4m3 or --dtype (", attnd::DTypeName(s.dtype), ")"));
  }
  const double d = absl::GetFlag(FLAGS_kv_descale);
  if (!std::isfinite(static_cast<float>(d)) || static_cast<float>(d) <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("--kv_descale: ", d, " is not a finite float > 0"));
  }
  s.kv_format = attnd::KvFormat::kFp8E4M3;
  s.k_descale = s.v_descale = {static_cast<float>(d)};
  return absl::OkStatus();
}

// What `attn seq` (SeqRunOptions) and the decode bench (DecodeBenchOptions) read alike: the sequence shape,
// --kv_heads (0: --q_heads) of --head_dim over --layers in --dtype, cached as --kv_dtype, with --q_heads, --steps,
// --seed and the call options.
template <typename SequenceOptions>
absl::Status SequenceOptionsFromFlags(SequenceOptions& o) {
  attnd::client::SequenceShape& s = o.shape;
  s.layers = absl::GetFlag(FLAGS_layers);
  o.q_heads = absl::GetFlag(FLAGS_q_heads);
  s.kv_heads = absl::GetFlag(FLAGS_kv_heads) ? absl::GetFlag(FLAGS_kv_heads) : o.q_heads;
  s.head_dim = absl::GetFlag(FLAGS_head_dim);
  if (s.layers <= 0 || o.q_heads <= 0 || s.kv_heads <= 0 || s.head_dim <= 0) {
    return absl::InvalidArgumentError("--layers, --q_heads, --kv_heads, --head_dim: must be positive");
  }
  if (o.q_heads % s.kv_heads != 0) return absl::InvalidArgumentError("--q_heads: must be a multiple of --kv_heads");
  absl::StatusOr<attnd::DType> dtype = DTypeFromFlags();
  if (!dtype.ok()) return dtype.status();
  if (*dtype == attnd::DType::kFP8E4M3) {
    return absl::InvalidArgumentError("--dtype: a sequence's Q and O are bf16 or fp16 (--kv_dtype=fp8_e4m3 stores its "
                                      "K and V as float8)");
  }
  s.dtype = *dtype;
  if (absl::Status kv = KvFormatFromFlags(s); !kv.ok()) return kv;
  o.steps = absl::GetFlag(FLAGS_steps);
  o.seed = absl::GetFlag(FLAGS_seed);
  o.call = CallOpts();
  return absl::OkStatus();
}

// `attn seq`: one sequence through its whole life, a line per step.
int CmdSeq(Client& client) {
  attnd::client::SeqRunOptions o;
  if (absl::Status s = SequenceOptionsFromFlags(o); !s.ok()) return Fail(s, "flags");
  o.prefill = absl::GetFlag(FLAGS_prefill);
  o.move_to = absl::GetFlag(FLAGS_move_to);
  o.verify = absl::GetFlag(FLAGS_verify);
  o.want_lse = absl::GetFlag(FLAGS_lse);
  o.line = [](const std::string& line) { std::cout << line << "\n" << std::flush; };
  auto report = attnd::client::RunSequence(client, o);
  if (!report.ok()) return Fail(report.status(), "seq");
  std::cout << attnd::client::FormatSeqReport(*report);
  if (report->verify_failures > 0) {
    std::cerr << "attn: seq: " << report->verify_failures << " of " << report->verified
              << " layer-steps failed verification\n";
    return kExitFail;
  }
  return 0;
}

// `attn bench --workload=decode`.
int CmdBenchDecode(Client& client) {
  attnd::client::DecodeBenchOptions o;
  if (absl::Status s = SequenceOptionsFromFlags(o); !s.ok()) return Fail(s, "flags");
  o.sequences = absl::GetFlag(FLAGS_sequences);
  o.context = absl::GetFlag(FLAGS_context);
  o.one_message = absl::GetFlag(FLAGS_one_message);
  o.max_duration = absl::GetFlag(FLAGS_max_duration);
  if (absl::GetFlag(FLAGS_progress)) {
    o.progress = [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); };
  }
  auto report = attnd::client::RunDecodeBench(client, o);
  if (!report.ok()) return Fail(report.status(), "bench");
  std::cout << attnd::client::FormatDecodeReport(*report);
  if (const std::string json = absl::GetFlag(FLAGS_json); !json.empty()) {
    absl::Status s = attnd::client::WriteFile(json, attnd::client::DecodeReportJson(*report));
    if (!s.ok()) return Fail(s, "--json");
  }
  if (report->calls_ok == 0 || report->errors > 0) {
    std::cerr << "attn: bench: " << report->errors << " errors, " << report->calls_ok << " Step calls ok\n";
    return kExitFail;
  }
  return 0;
}

// `attn health`: the grpc.health.v1 check alone, for container HEALTHCHECKs and scripts (exit 0 only when
// SERVING). Unlike `attn info` it calls no Attention RPC, so it needs nothing a health check is exempt from.
int CmdHealth(Client& client) {
  absl::Status health = client.CheckHealth("", CallOpts());
  std::cout << client.options().target << ": " << (health.ok() ? "SERVING" : std::string(health.message())) << "\n";
  return health.ok() ? 0 : kExitFail;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "attnd client.\n"
      "  attn info  [--target=host:port]             server, backend, devices, limits, health\n"
      "  attn stats [--target=...]                   server counters\n"
      "  attn health [--target=...]                  grpc.health.v1 check: exit 0 when SERVING\n"
      "  attn call  [shape flags] [--verify]         one Forward (random or --q_file/--k_file/--v_file inputs)\n"
      "  attn bench [shape flags] [--concurrency=N] [--connections=C] [--rate=R] [--duration=10s | --requests=N] [--warmup=1s]\n"
      "             [--verify_every=N] [--reuse_outputs=false] [--json=F] [--csv=F]   load test\n"
      "  attn seq   [--layers --q_heads --kv_heads --head_dim --dtype] [--prefill=P] [--steps=N] [--verify] [--lse]\n"
      "             [--kv_dtype=fp8_e4m3 --kv_descale=D]\n"
      "             one KV sequence: open, prefill, decode N steps (per-step latency), close\n"
      "  attn bench --workload=decode [--sequences=S] [--context=C] [--steps=N] [--layers=L] [--one_message]\n"
      "             decode load over KV sequences: tokens/s, Step latency, server batches, K/V read GB/s\n"
      "  call, bench and seq: --transport=auto|unary|stream over gRPC, or --transport=shm --shm_socket=PATH\n"
      "             (same host)\n"
      "Shape flags: --batch --q_len --kv_len --q_heads --kv_heads --head_dim --dtype --mask|--causal --scale --lse\n"
      "             (call, bench --dtype=fp8_e4m3: float8 inputs with --q_descale --k_descale --v_descale, O bf16)");
  attnd::HandleHelpFlag(argc, argv, __FILE__);
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() != 2) {
    std::cerr << "usage: attn info|stats|call|bench|seq|health [flags]   (attn --help for the flags)\n";
    return kExitUsage;
  }
  const std::string cmd = args[1];
  // Requests and replies of megabytes per call: without this, each one page-faults its buffers in anew
  // (attnd/transport/heap_tuning.h). Where the C library cannot be tuned, the defaults are only slower.
  attnd::RetainFreedHeapMemory();
  if (cmd != "info" && cmd != "stats" && cmd != "call" && cmd != "bench" && cmd != "seq" && cmd != "health") {
    std::cerr << "attn: unknown command '" << cmd << "' (info, stats, call, bench, seq, health)\n";
    return kExitUsage;
  }
  auto client = Connect();
  if (!client.ok()) {
    std::cerr << "attn: " << client.status() << "\n";
    return kExitUsage;
  }
  if (cmd == "call" || cmd == "bench" || cmd == "seq") {
    const bool shm = UseShm(**client), socket = !absl::GetFlag(FLAGS_shm_socket).empty();
    if (shm && !socket) {
      std::cerr << "attn: --transport=shm needs --shm_socket=PATH (the server's --shm_socket, a unix socket on "
                   "this host)\n";
      return kExitUsage;
    }
    if (!shm && socket) std::cerr << "attn: note: --shm_socket is ignored without --transport=shm\n";
  }
  if (cmd == "info") return CmdInfo(**client);
  if (cmd == "stats") return CmdStats(**client);
  if (cmd == "call") return CmdCall(**client);
  if (cmd == "health") return CmdHealth(**client);
  if (cmd == "seq") return CmdSeq(**client);
  const std::string workload = absl::GetFlag(FLAGS_workload);
  if (workload == "decode") return CmdBenchDecode(**client);
  if (workload != "forward") {
    std::cerr << "attn: --workload: '" << workload << "' is not forward or decode\n";
    return kExitUsage;
  }
  return CmdBench(**client);
}
