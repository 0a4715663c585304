// Shared pieces of the GPU server tests: an in-process server on the CUDA backend (skipped when no usable
// GPU is present), with outputs poisoned before every launch so that a kernel that writes nothing fails.
#pragma once

#include <unistd.h>

#include <atomic>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "attnd/server/backend.h"
#include "attnd/server/cuda_backend.h"
#include "attnd/server/server.h"
#include "attnd/client/client.h"
#include "attnd/client/tensors.h"
#include "e2e_util.h"
#include "forwarding_backend.h"
#include "gtest/gtest.h"

namespace attnd::gpu {

// The CPU end-to-end tests' helpers (listeners, clients, random requests with their oracle), shared as is.
using e2e::CheckReply;
using e2e::Connect;
using e2e::Case;
using e2e::Listener;
using e2e::MakeCase;
using e2e::Spec;
using e2e::TestServer;

// Counts what the backend accepted (Submit returned OK) and how those jobs ended, so a test can tell an
// accepted request from one turned away before acceptance.
struct AcceptCounter {
  std::atomic<int> accepted{0}, done_ok{0}, done_error{0};
};

// Forwards everything to the real backend, counting into an AcceptCounter.
class CountingBackend final : public testing::ForwardingBackend {
 public:
  CountingBackend(std::unique_ptr<server::Backend> inner, AcceptCounter* counter)
      : ForwardingBackend(std::move(inner)), counter_(counter) {}
  absl::Status Submit(std::unique_ptr<server::ForwardJob> job) override {
    AcceptCounter* c = counter_;
    job->done = [c, done = std::move(job->done)](absl::Status st) {
      ++(st.ok() ? c->done_ok : c->done_error);
      done(std::move(st));
    };
    const absl::Status st = ForwardingBackend::Submit(std::move(job));
    if (st.ok()) ++c->accepted;
    return st;
  }

 private:
  AcceptCounter* const counter_;
};

struct CudaServerOptions {
  bool enable_ipc = false;
  int streams = 4;
  bool shared_compute_stream = false;
  bool shm = false;  // also serve shared-memory channels, on TestServer::unix_path + ".shm"
  uint32_t max_queue = 256;
  uint64_t memory_budget_bytes = 0;
  uint64_t max_message_bytes = 256ull << 20;
  std::string warm_shapes;
  bool stream_to_device = true;
  AcceptCounter* counter = nullptr;  // when set, the backend is wrapped in a CountingBackend
};

// Starts the server, or sets *skip with the reason when there is no usable GPU.
inline void StartCudaServer(TestServer* out, const CudaServerOptions& o, std::string* skip) {
  static std::atomic<int> counter{0};
  server::BackendOptions bo;
  bo.streams_per_device = o.streams;
  bo.shared_compute_stream = o.shared_compute_stream;
  bo.max_queue = o.max_queue;
  bo.memory_budget_bytes = o.memory_budget_bytes;
  bo.warm_shapes = o.warm_shapes;
  bo.stream_to_device = o.stream_to_device;
  server::CudaBackendHooks hooks;
  hooks.poison_outputs = true;
  auto backend = server::MakeCudaBackend(bo, hooks);
  if (!backend.ok() && (absl::IsUnavailable(backend.status()) || absl::IsFailedPrecondition(backend.status()))) {
    *skip = absl::StrCat("no usable GPU: ", backend.status().ToString());
    return;
  }
  ASSERT_TRUE(backend.ok()) << backend.status();
  server::ServerOptions so;
  so.network.listen = "127.0.0.1:0";
  out->unix_path = absl::StrCat(::testing::TempDir(), "/attnd_gpu_", ::getpid(), "_", counter++, ".sock");
  so.network.unix_socket = out->unix_path;
  if (o.shm) so.shm.socket = out->unix_path + ".shm";
  so.limits.max_message_bytes = o.max_message_bytes;
  so.security.enable_cuda_ipc = o.enable_ipc;
  std::unique_ptr<server::Backend> b = std::move(*backend);
  if (o.counter != nullptr) b = std::make_unique<CountingBackend>(std::move(b), o.counter);
  auto s = server::Server::Create(so, std::move(b));
  ASSERT_TRUE(s.ok()) << s.status();
  out->server = std::move(*s);
  out->port = out->server->tcp_port();
  ASSERT_GT(out->port, 0);
}

}  // namespace attnd::gpu

// Skips the test when the server could not start for lack of a GPU.
#define ATTND_START_CUDA_SERVER(server, options)                \
  do {                                                          \
    std::string _skip;                                          \
    ::attnd::gpu::StartCudaServer(&(server), (options), &_skip); \
    if (!_skip.empty()) GTEST_SKIP() << _skip;                  \
    if (::testing::Test::HasFatalFailure()) return;             \
  } while (0)
