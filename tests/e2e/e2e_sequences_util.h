// Shared pieces of the KV-sequence end-to-end tests: their sequence shape, the reference check of a step's rows,
// a one-token decode step, callers that step their sequences checking every step, and a server of a test's own
// with given sequence options.
#pragma once

#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "e2e_util.h"
#include "gtest/gtest.h"

namespace attnd::e2e {

inline client::SequenceShape TestShape(int64_t layers = 2) {
  client::SequenceShape s;
  s.layers = layers;
  s.kv_heads = 2;
  s.head_dim = 64;
  return s;
}
inline constexpr int64_t kQHeads = 4;

// Empty when `o` (and `lse`) are causal attention of q's `tokens` rows over the cached `k`/`v`; else why not.
inline std::string CheckRows(const client::SequenceShape& shape, int64_t q_heads, const std::string& q,
                             const std::string& k, const std::string& v, std::string_view o, std::string_view lse,
                             bool want_lse) {
  const int64_t row = q_heads * shape.head_dim * 2, kv_row = shape.kv_heads * shape.head_dim * 2;
  Problem p;
  p.shape = Shape{1, static_cast<int64_t>(q.size()) / row, static_cast<int64_t>(k.size()) / kv_row, q_heads,
                  shape.kv_heads, shape.head_dim};
  p.dtype = shape.dtype;
  p.mask = Mask::kCausalBottomRight;
  p.scale = DefaultScale(shape.head_dim);
  p.want_lse = want_lse;
  auto oracle = client::Oracle::Compute(p, q, k, v);
  if (!oracle.ok()) return oracle.status().ToString();
  const client::VerifyReport r = oracle->Check(o, lse);
  return r.pass ? "" : r.detail;
}

// One decode step of one sequence: random Q, K and V rows (seeds seed, seed + 1, seed + 2) and the spec that
// points at them (so it neither copies nor moves).
struct OneTokenStep {
  OneTokenStep(const client::SequenceShape& shape, const std::string& id, uint64_t seed)
      : q(client::RandomTensor(shape.dtype, kQHeads * shape.head_dim, seed)),
        k(client::RandomTensor(shape.dtype, shape.kv_heads * shape.head_dim, seed + 1)),
        v(client::RandomTensor(shape.dtype, shape.kv_heads * shape.head_dim, seed + 2)) {
    spec.sequences = {{id, 1}};
    spec.q_heads = kQHeads;
    spec.q.data = q;
    spec.k.data = k;
    spec.v.data = v;
  }
  OneTokenStep(const OneTokenStep&) = delete;
  OneTokenStep& operator=(const OneTokenStep&) = delete;

  const std::string q, k, v;
  client::StepSpec spec;
};

// Callers, a thread each, that step their own sequences in turn until Stop, one token a step, every step checked
// against the double reference over the sequence's whole history: the load of the fleet tests. A step that fails
// or answers wrong is counted, the first such named in first_problem.
struct VerifiedCallers {
  struct Owned {
    std::string id, k, v;  // the id the caller names; the K and V rows it has appended
    int moves = 0;
  };
  std::vector<std::vector<Owned>> owned;  // per caller, filled before Start
  std::atomic<int> steps{0}, wrong{0}, failed{0};

  VerifiedCallers(client::Client* client, const client::SequenceShape& shape, int callers)
      : owned(callers), client_(client), shape_(shape) {}
  ~VerifiedCallers() { Stop(); }

  // `before_step` (may be empty) runs before each step of a sequence: a test's own doing (a move).
  void Start(std::function<void(Owned&)> before_step = nullptr) {
    for (size_t c = 0; c < owned.size(); ++c) threads_.emplace_back([this, c, before_step] { Call(c, before_step); });
  }
  void Stop() {
    stop_ = true;
    for (std::thread& t : threads_) t.join();
    threads_.clear();
  }
  std::string first_problem() {
    absl::MutexLock lock(&mu_);
    return first_problem_;
  }

 private:
  void Call(size_t c, const std::function<void(Owned&)>& before_step) {
    uint64_t seed = 10000 * (c + 1);
    while (!stop_.load()) {
      for (Owned& o : owned[c]) {
        if (before_step) before_step(o);
        OneTokenStep s(shape_, o.id, seed += 3);
        auto r = client_->Step(s.spec);
        if (!r.ok()) {
          ++failed;
          Problem(absl::StrCat(o.id, ": ", r.status().ToString()));
          continue;
        }
        o.k += s.k;
        o.v += s.v;
        const std::string check = CheckRows(shape_, kQHeads, s.q, o.k, o.v, r->o, "", false);
        if (!check.empty()) {
          ++wrong;
          Problem(absl::StrCat(o.id, ": ", check));
        }
        ++steps;
      }
    }
  }
  void Problem(const std::string& what) {
    absl::MutexLock lock(&mu_);
    if (first_problem_.empty()) first_problem_ = what;
  }

  client::Client* const client_;
  const client::SequenceShape shape_;
  std::atomic<bool> stop_{false};
  std::vector<std::thread> threads_;
  absl::Mutex mu_;
  std::string first_problem_;
};

inline std::string FreshSocketPath() {
  static std::atomic<int> counter{0};
  return absl::StrCat(::testing::TempDir(), "/attnd_seq_", ::getpid(), "_", counter++, ".sock");
}

// A CPU-backend server on a loopback port and the unix socket `unix_path` (empty: a fresh one), with
// `sequences` as its sequence options; `wrap`, when set, gets the CPU backend and returns the one served.
inline void StartSequenceServer(TestServer* out, const server::SequenceOptions& sequences,
                                std::string unix_path = "", const WrapBackend& wrap = nullptr) {
  server::ServerOptions so;
  so.network.listen = "127.0.0.1:0";
  out->unix_path = unix_path.empty() ? FreshSocketPath() : std::move(unix_path);
  so.network.unix_socket = out->unix_path;
  so.sequences = sequences;
  server::BackendOptions bo;
  bo.threads = 2;
  ServeOnCpu(out, so, bo, wrap);
}

}  // namespace attnd::e2e
