// What the KV-sequence GPU suites share (gpu_sequences_test.cc, gpu_sequences_fp8_test.cc): one CUDA backend for the
// binary, and a batch of steps submitted and waited for.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
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

// One request of a step batch: the test's sequences (indices) and the tokens of each.
struct Part {
  std::vector<int> seqs;
  std::vector<int> tokens;
};

// What a suite's fixture does for SequenceLife: open a sequence, fork one, run one batch at a layer (append and
// attend as asked) and check it.
struct SequenceOps {
  std::function<int()> open;
  std::function<int(int parent)> fork;
  std::function<void(int layer, const std::vector<Part>& parts, bool append, bool attend, const std::string& what)>
      step;
};

// The life of a few sequences, every layer stepping alike: a ragged prefill (long prompts on the prefill kernels
// from an empty cache, short ones on the decode kernel), forks sharing pages (copy-on-write on their next
// append), uniform decode batches of several requests at 1, 4 and 16 tokens, a chunked prefill over a cache (the
// gather), attention without append (the last cached rows again), an append without attention, a ragged batch
// mixing all of it. Returns the sequence forked second, for the caller's own checks.
inline int SequenceLife(int layers, const SequenceOps& ops) {
  const int a = ops.open(), b = ops.open(), c = ops.open(), d = ops.open(), e = ops.open();
  for (int layer = 0; layer < layers; ++layer) {
    ops.step(layer, {{{a, b, c, d, e}, {37, 5, 16, 100, 1}}}, true, true,
             absl::StrCat("ragged prefill, layer ", layer));
  }
  const int a1 = ops.fork(a), a2 = ops.fork(a), d1 = ops.fork(d);
  for (int layer = 0; layer < layers; ++layer) {
    // Several requests in one batch, one token each; the forks copy their shared last pages first.
    ops.step(layer, {{{a, b}, {1, 1}}, {{a1}, {1}}, {{a2, c, d1}, {1, 1, 1}}, {{e}, {1}}}, true, true,
             absl::StrCat("decode q1 after forks, layer ", layer));
  }
  for (int layer = 0; layer < layers; ++layer) {
    ops.step(layer, {{{a, a1, d}, {4, 4, 4}}, {{a2}, {4}}}, true, true, absl::StrCat("decode q4, layer ", layer));
    ops.step(layer, {{{b, d1}, {16, 16}}}, true, true, absl::StrCat("decode q16, layer ", layer));
  }
  for (int layer = 0; layer < layers; ++layer) {
    // Prefill chunks over a cache: the keys gathered from the pages.
    ops.step(layer, {{{c, e}, {40, 40}}}, true, true, absl::StrCat("chunked prefill q40, layer ", layer));
    ops.step(layer, {{{a2}, {75}}}, true, true, absl::StrCat("chunked prefill q75, layer ", layer));
  }
  for (int layer = 0; layer < layers; ++layer) {
    // Without k and v, q's rows are the last cached positions.
    ops.step(layer, {{{a, b}, {3, 3}}}, false, true, absl::StrCat("reattend q3, layer ", layer));
    ops.step(layer, {{{d}, {20}}}, false, true, absl::StrCat("reattend q20, layer ", layer));
    ops.step(layer, {{{a1, e}, {7, 33}}}, true, false, absl::StrCat("append only, layer ", layer));
  }
  for (int layer = 0; layer < layers; ++layer) {
    // Ragged: runs of equal short tokens share a decode launch, long ones take the prefill path.
    ops.step(layer, {{{a, a1, a2, b, c, d, d1, e}, {2, 2, 1, 18, 3, 3, 3, 1}}}, true, true,
             absl::StrCat("ragged mix, layer ", layer));
  }
  return a2;
}

}  // namespace attnd::server::sequences_testing
