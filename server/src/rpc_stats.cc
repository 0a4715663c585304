#include "rpc_stats.h"

#include "absl/time/clock.h"

namespace attnd::server {

RpcStatsTable::RpcStatsTable() : start_(absl::Now()) {
  // Every method is listed from the start so that a client sees zeros rather than a missing row.
  absl::MutexLock lock(&mu_);
  for (const char* m : {"Forward", "ForwardStream", "RegisterCudaBuffer", "UnregisterCudaBuffer", "ListCudaBuffers",
                        "GetServerInfo", "GetStats"}) {
    entries_[m];
  }
}

void RpcStatsTable::Record(const std::string& method, const absl::Status& status, absl::Duration duration) {
  absl::MutexLock lock(&mu_);
  Entry& e = entries_[method];
  ++e.count;
  e.total_us += absl::ToDoubleMicroseconds(duration);
  if (!status.ok()) {
    ++e.errors;
    ++e.errors_by_code[absl::StatusCodeToString(status.code())];
  }
}

void RpcStatsTable::AddBytes(uint64_t in, uint64_t out) {
  absl::MutexLock lock(&mu_);
  bytes_in_ += in;
  bytes_out_ += out;
}

void RpcStatsTable::Fill(v1::ServerStats* out) const {
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
