// `attn bench`'s reports of a BenchReport: text, JSON and CSV.
#include "attnd/client/bench.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace attnd::client {
namespace {

std::string JsonEscape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          out += absl::StrFormat("\\u%04x", static_cast<int>(c));
        } else {
          out += c;
        }
    }
  }
  return out;
}

std::string CsvField(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) {
    if (c == '"') out += '"';
    out += c;
  }
  return out + "\"";
}

// The report's fields in one ordered list, shared by the JSON and the CSV writers so the two cannot drift.
std::vector<std::pair<std::string, std::string>> Fields(const BenchReport& r) {
  const Shape& s = r.problem.shape;
  auto num = [](double v) { return absl::StrFormat("%.6g", v); };
  auto str = [](const std::string& v) { return "\"" + JsonEscape(v) + "\""; };
  std::string codes;
  for (const auto& [code, n] : r.errors_by_code) absl::StrAppend(&codes, codes.empty() ? "" : ";", code, "=", n);
  return {
      {"target", str(r.target)},
      {"backend", str(r.backend)},
      {"kernel", str(r.kernel)},
      {"transport", str(r.transport)},
      {"batch", absl::StrCat(s.batch)},
      {"q_len", absl::StrCat(s.q_len)},
      {"kv_len", absl::StrCat(s.kv_len)},
      {"q_heads", absl::StrCat(s.q_heads)},
      {"kv_heads", absl::StrCat(s.kv_heads)},
      {"head_dim", absl::StrCat(s.head_dim)},
      {"dtype", str(DTypeName(r.problem.dtype))},
      {"mask", str(MaskName(r.problem.mask))},
      {"lse", r.problem.want_lse ? "true" : "false"},
      {"concurrency", absl::StrCat(r.concurrency)},
      {"connections", absl::StrCat(r.connections)},
      {"rate", num(r.rate)},
      {"ok", absl::StrCat(r.ok)},
      {"errors", absl::StrCat(r.errors)},
      {"warmup_requests", absl::StrCat(r.warmup_requests)},
      {"verified", absl::StrCat(r.verified)},
      {"verify_failures", absl::StrCat(r.verify_failures)},
      {"late_starts", absl::StrCat(r.late_starts)},
      {"hit_max_duration", r.hit_max_duration ? "true" : "false"},
      {"elapsed_s", num(r.elapsed_s)},
      {"req_per_s", num(r.req_per_s)},
      {"tflops", num(r.tflops)},
      {"gbps", num(r.gbps)},
      {"lat_min_us", num(r.lat_min_us)},
      {"lat_mean_us", num(r.lat_mean_us)},
      {"lat_p50_us", num(r.lat_p50_us)},
      {"lat_p90_us", num(r.lat_p90_us)},
      {"lat_p95_us", num(r.lat_p95_us)},
      {"lat_p99_us", num(r.lat_p99_us)},
      {"lat_max_us", num(r.lat_max_us)},
      {"srv_queue_us", num(r.srv_queue_us)},
      {"srv_h2d_us", num(r.srv_h2d_us)},
      {"srv_kernel_us", num(r.srv_kernel_us)},
      {"srv_d2h_us", num(r.srv_d2h_us)},
      {"srv_total_us", num(r.srv_total_us)},
      {"bytes_per_request", num(r.bytes_per_request)},
      {"tcp_p50_us", num(r.tcp_p50_us)},
      {"rpc_floor_us", num(r.rpc_floor_us)},
      {"errors_by_code", str(codes)},
      {"first_error", str(r.first_error)},
      {"reuse_outputs", r.reuse_outputs ? "true" : "false"},
  };
}

}  // namespace

std::string FormatErrors(const std::map<std::string, int64_t>& errors_by_code, const std::string& first_error) {
  if (errors_by_code.empty()) return "";
  std::vector<std::string> parts;
  for (const auto& [code, n] : errors_by_code) parts.push_back(absl::StrCat(code, " ", n));
  return absl::StrCat("  errors by code: ", absl::StrJoin(parts, ", "), "\n  first error: ", first_error, "\n");
}

std::string FormatBenchReport(const BenchReport& r) {
  const Shape& s = r.problem.shape;
  std::string out;
  absl::StrAppendFormat(&out, "bench: %s, backend %s, kernel %s, transport %s\n", r.target, r.backend, r.kernel,
                        r.transport);
  absl::StrAppendFormat(&out,
                        "  shape: batch %d, q_len %d, kv_len %d, q_heads %d, kv_heads %d, head_dim %d, %s, mask %s%s\n",
                        s.batch, s.q_len, s.kv_len, s.q_heads, s.kv_heads, s.head_dim, DTypeName(r.problem.dtype),
                        MaskName(r.problem.mask), r.problem.want_lse ? ", lse" : "");
  absl::StrAppendFormat(&out, "  load: concurrency %d over %d connection%s, %s, %s\n", r.concurrency, r.connections,
                        r.connections == 1 ? "" : "s",
                        r.rate > 0 ? absl::StrFormat("open loop at %.1f req/s (%d late starts)", r.rate, r.late_starts)
                                   : std::string("closed loop"),
                        r.reuse_outputs ? "outputs into reused buffers" : "outputs into fresh memory per call");
  absl::StrAppendFormat(&out, "  requests: %d ok, %d errors, %d warmup%s\n", r.ok, r.errors, r.warmup_requests,
                        r.hit_max_duration ? " (stopped by max_duration)" : "");
  absl::StrAppendFormat(&out, "  throughput: %.2f req/s, %.4f TFLOP/s, %.4f GB/s over %.2f s\n", r.req_per_s, r.tflops,
                        r.gbps, r.elapsed_s);
  absl::StrAppendFormat(&out,
                        "  latency ms: min %.3f, mean %.3f, p50 %.3f, p90 %.3f, p95 %.3f, p99 %.3f, max %.3f\n",
                        r.lat_min_us / 1e3, r.lat_mean_us / 1e3, r.lat_p50_us / 1e3, r.lat_p90_us / 1e3,
                        r.lat_p95_us / 1e3, r.lat_p99_us / 1e3, r.lat_max_us / 1e3);
  absl::StrAppendFormat(&out, "  server ms (mean): queue %.3f, h2d %.3f, kernel %.3f, d2h %.3f, total %.3f\n",
                        r.srv_queue_us / 1e3, r.srv_h2d_us / 1e3, r.srv_kernel_us / 1e3, r.srv_d2h_us / 1e3,
                        r.srv_total_us / 1e3);
  if (r.tcp_p50_us > 0 && r.bytes_per_request > 0 && r.lat_p50_us > 0) {
    const double tcp_gbps = r.bytes_per_request / r.tcp_p50_us / 1e3;
    const double call_gbps = r.bytes_per_request / r.lat_p50_us / 1e3;
    absl::StrAppendFormat(&out,
                          "  vs TCP loopback of the same %.1f MB: TCP p50 %.3f ms = %.3f GB/s; this transport %.3f GB/s "
                          "per call at p50 (%.2fx), %.3f GB/s aggregate (%.2fx)\n",
                          r.bytes_per_request / 1e6, r.tcp_p50_us / 1e3, tcp_gbps, call_gbps, call_gbps / tcp_gbps,
                          r.gbps, r.gbps / tcp_gbps);
  }
  if (r.rpc_floor_us > 0 && r.lat_p50_us > 0) {
    absl::StrAppendFormat(&out, "  RPC floor (GetStats round trip on this channel) p50 %.3f ms; this call's p50 is %.3f ms above it\n",
                          r.rpc_floor_us / 1e3, (r.lat_p50_us - r.rpc_floor_us) / 1e3);
  }
  if (r.verified > 0) {
    absl::StrAppendFormat(&out, "  verified: %d replies, %d failed%s\n", r.verified, r.verify_failures,
                          r.first_verify_failure.empty() ? "" : " (first: " + r.first_verify_failure + ")");
  }
  absl::StrAppend(&out, FormatErrors(r.errors_by_code, r.first_error));
  return out;
}

std::string BenchReportJson(const BenchReport& r) {
  std::vector<std::string> parts;
  for (const auto& [k, v] : Fields(r)) parts.push_back(absl::StrCat("  \"", k, "\": ", v));
  std::string codes;
  for (const auto& [code, n] : r.errors_by_code) {
    absl::StrAppend(&codes, codes.empty() ? "" : ", ", "\"", code, "\": ", n);
  }
  parts.push_back(absl::StrCat("  \"errors_by_code_map\": {", codes, "}"));
  return absl::StrCat("{\n", absl::StrJoin(parts, ",\n"), "\n}\n");
}

std::string BenchReportCsv(const BenchReport& r) {
  std::vector<std::string> keys, values;
  for (const auto& [k, v] : Fields(r)) {
    keys.push_back(k);
    // Strings were JSON-quoted; CSV wants them plain (quoted only when needed).
    std::string plain = v;
    if (plain.size() >= 2 && plain.front() == '"' && plain.back() == '"') plain = plain.substr(1, plain.size() - 2);
    values.push_back(CsvField(plain));
  }
  return absl::StrCat(absl::StrJoin(keys, ","), "\n", absl::StrJoin(values, ","), "\n");
}

}  // namespace attnd::client
