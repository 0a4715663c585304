// What the KV-sequence GPU suites share (gpu_sequences_test.cc, gpu_sequences_fp8_test.cc): one CUDA backend for the
// binary, and a batch of steps submitted and waited for.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "attnd/server/backend.h"
#include "attnd/server/cuda_backend.h"
#include "attnd/server/step.h"

namespace attnd::server::sequences_testing {

inline BackendOptions TestOptions() {
  BackendOptions o;
  o.streams_per_device = 2;
  o.memory_budget_bytes = 4ull << 30;
  o.copy_threads = 0;
  return o;
}

// One backend for the binary's suites: its start (every kernel configuration launched once) is the slow part.
inline Backend* SharedBackend() {
  static Backend* backend = [] {
    CudaBackendHooks hooks;
    hooks.poison_outputs = true;
    absl::StatusOr<std::unique_ptr<Backend>> b = MakeCudaBackend(TestOptions(), hooks);
    return b.ok() ? b->release() : nullptr;
  }();
  return backend;
}

// What came back for one job.
struct Outcome {
  absl::Status status = absl::UnknownError("done not called");
  int calls = 0;
  std::string o, lse, kernel;
  uint32_t batch_sequences = 0, batch_requests = 0;
  Timing timing;
};

// Submits the jobs as one batch and waits (bounded) for every done; each done must come exactly once.
inline std::vector<Outcome> RunBatch(Backend& backend, std::vector<std::unique_ptr<StepJob>> jobs,
                                     absl::Status* submit_status = nullptr) {
  struct Shared {
    absl::Mutex mu;
    size_t left = 0;
    std::vector<Outcome> out;
  };
  auto shared = std::make_shared<Shared>();
  shared->left = jobs.size();
  shared->out.resize(jobs.size());
  auto batch = std::make_unique<StepBatch>();
  for (size_t i = 0; i < jobs.size(); ++i) {
    StepJob* job = jobs[i].get();
    job->done = [shared, i, job](absl::Status st) {
      absl::MutexLock lock(&shared->mu);
      Outcome& out = shared->out[i];
      out.status = st;
      ++out.calls;
      out.o = std::move(job->o);
      out.lse = std::move(job->lse);
      out.kernel = job->kernel;
      out.batch_sequences = job->batch_sequences;
      out.batch_requests = job->batch_requests;
      out.timing = job->timing;
      --shared->left;
    };
    batch->jobs.push_back(std::move(jobs[i]));
  }
  const absl::Status st = backend.SubmitSteps(std::move(batch));
  if (submit_status != nullptr) *submit_status = st;
  if (!st.ok()) {
    if (submit_status == nullptr) ADD_FAILURE() << "SubmitSteps: " << st;
    return {};
  }
  absl::MutexLock lock(&shared->mu);
  const bool all = shared->mu.AwaitWithTimeout(
      absl::Condition(+[](size_t* left) { return *left == 0; }, &shared->left), absl::Seconds(120));
  EXPECT_TRUE(all) << shared->left << " jobs never got their done";
  for (const Outcome& o : shared->out) EXPECT_LE(o.calls, 1) << "done called more than once";
  return shared->out;
}

}  // namespace attnd::server::sequences_testing
