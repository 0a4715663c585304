#include "call_stats.h"

#include <string>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "metrics.h"
#include "spdlog/spdlog.h"

namespace attnd::server {

CallStats::CallStats(bool access_log) : access_log_(access_log), start_(absl::Now()) {
  // Every method is listed from the start so that a client sees zeros rather than a missing row.
  absl::MutexLock lock(&mu_);
  for (const char* m : {"Forward", "ForwardStream", "RegisterCudaBuffer", "UnregisterCudaBuffer", "ListCudaBuffers",
                        "GetServerInfo", "GetStats"}) {
    entries_[m];
  }
}

void CallStats::Record(const CallRecord& call) {
  const bool ok = call.code == absl::StatusCode::kOk;
  const std::string code = absl::StatusCodeToString(call.code);
  if (call.in_stats) {
    service_calls_.fetch_add(1, std::memory_order_relaxed);
    absl::MutexLock lock(&mu_);
    Entry& e = entries_[call.method];
    ++e.count;
    e.total_us += absl::ToDoubleMicroseconds(call.total);
    if (!ok) {
      ++e.errors;
      ++e.errors_by_code[code];
    }
    bytes_in_ += call.tensor_bytes_in;
    bytes_out_ += call.tensor_bytes_out;
  }
  if (metrics_ != nullptr) metrics_->RecordCall(call);
  if (!access_log_ || !call.access_log || !spdlog::should_log(spdlog::level::info)) return;
  std::string line = absl::StrFormat("access method=%s peer=%s request_id=\"%s\" code=%s total_ms=%.3f", call.method,
                                     call.peer.empty() ? "-" : call.peer, absl::CHexEscape(call.request_id), code,
                                     absl::ToDoubleMilliseconds(call.total));
  if (!call.shape.empty()) absl::StrAppend(&line, " shape=", call.shape);
  if (ok && call.queue) {
    absl::StrAppendFormat(&line, " queue_ms=%.3f kernel_ms=%.3f", absl::ToDoubleMilliseconds(*call.queue),
                          absl::ToDoubleMilliseconds(call.kernel.value_or(absl::ZeroDuration())));
  }
  if (call.data_plane) absl::StrAppend(&line, " bytes_in=", call.bytes_in, " bytes_out=", call.bytes_out);
  if (!ok) absl::StrAppend(&line, " error=\"", absl::CHexEscape(call.error), "\"");
  spdlog::info("{}", line);
}

void CallStats::Annotate(const grpc::ServerContextBase* call, uint64_t tensor_bytes_in, uint64_t tensor_bytes_out) {
  absl::MutexLock lock(&annotations_mu_);
  annotations_[call] = {tensor_bytes_in, tensor_bytes_out};
}

void CallStats::TakeAnnotation(const grpc::ServerContextBase* call, CallRecord* record) {
  absl::MutexLock lock(&annotations_mu_);
  auto it = annotations_.find(call);
  if (it == annotations_.end()) return;
  record->tensor_bytes_in = it->second.first;
  record->tensor_bytes_out = it->second.second;
  annotations_.erase(it);
}

void CallStats::Fill(v1::ServerStats* out) const {
  absl::MutexLock lock(&mu_);
  for (const auto& [method, e] : entries_) {
    v1::RpcStats* r = out->add_rpcs();
    r->set_method(method);
    r->set_count(e.count);
    r->set_errors(e.errors);
    r->set_total_duration_us(e.total_us);
    for (const auto& [code, n] : e.errors_by_code) (*r->mutable_errors_by_code())[code] = n;
  }
  out->set_bytes_in(bytes_in_);
  out->set_bytes_out(bytes_out_);
  out->set_uptime_s(absl::ToDoubleSeconds(absl::Now() - start_));
}

}  // namespace attnd::server
