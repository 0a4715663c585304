// Per-RPC counters behind GetStats: calls finished, errors by code, cumulative server-side duration.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "attnd/v1/attention.pb.h"

namespace attnd::server {

class RpcStatsTable {
 public:
  RpcStatsTable();
  void Record(const std::string& method, const absl::Status& status, absl::Duration duration);
  void AddBytes(uint64_t in, uint64_t out);
  // Fills rpcs, bytes_in, bytes_out and uptime_s.
  void Fill(v1::ServerStats* out) const;

 private:
  struct Entry {
    uint64_t count = 0, errors = 0;
    double total_us = 0;
    std::map<std::string, uint64_t> errors_by_code;
  };
  const absl::Time start_;
  mutable absl::Mutex mu_;
  std::map<std::string, Entry> entries_ ABSL_GUARDED_BY(mu_);
  uint64_t bytes_in_ ABSL_GUARDED_BY(mu_) = 0, bytes_out_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace attnd::server
