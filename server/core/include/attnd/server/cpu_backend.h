// The CPU backend: a bounded queue in front of worker threads that run attnd::ReferenceAttention
// (fp32 accumulation, bf16/fp16 in and out; float8 inputs with per-head descales and a bf16 O through
// ReferenceAttentionFp8). It serves machines without a GPU and is the oracle of the tests.
// Of BackendOptions it uses threads, max_queue and memory_budget_bytes (fp32 working memory of one
// computation; 0: a quarter of physical memory).
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "attnd/server/backend.h"
#include "attnd/server/queue_expiry.h"

namespace attnd::server {

// Test seams. Production code leaves them empty.
struct CpuBackendHooks {
  // Runs on the worker right before the computation of a job that passed its deadline/cancel checks;
  // tests block here to hold a worker busy deterministically.
  std::function<void(const ForwardJob&)> before_compute;
};

class CpuBackend final : public Backend {
 public:
  static constexpr const char* kKernelName = "cpu_reference_fp32";

  explicit CpuBackend(const BackendOptions& options, CpuBackendHooks hooks = {});
  ~CpuBackend() override;  // Shutdown()
  CpuBackend(const CpuBackend&) = delete;
  CpuBackend& operator=(const CpuBackend&) = delete;

  std::string name() const override { return "cpu"; }
  std::vector<DeviceDescription> devices() const override { return {}; }
  std::vector<int64_t> supported_head_dims() const override;
  std::vector<DType> supported_dtypes() const override { return {DType::kBF16, DType::kFP16, DType::kFP8E4M3}; }
  std::vector<std::string> kernels() const override { return {kKernelName}; }

  absl::Status Accept(ForwardJob* job) const override;
  absl::Status Submit(std::unique_ptr<ForwardJob> job) override;
  uint32_t queue_depth() const override;
  uint32_t in_flight() const override;
  void Shutdown() override;

  uint32_t max_queue() const override { return max_queue_; }

  // KV sequences on host memory, computed by the reference: the oracle the CUDA backend is tested against.
  absl::StatusOr<std::shared_ptr<KvPool>> MakeKvPool(const SequenceShape& shape, int page_tokens,
                                                     int32_t num_pages) override;
  absl::Status CopyKvRows(const KvPool& pool, absl::Span<const int32_t> pages, int layer, int kv, int64_t first,
                          int64_t rows, bool to_host, uint8_t* host) override;
  absl::Status WriteKvRows(const KvPool& pool, absl::Span<const int32_t> pages, int layer, int kv, int64_t first,
                           int64_t rows, HostPieces src) override;
  absl::Status SubmitSteps(std::unique_ptr<StepBatch> batch) override;

  // Jobs whose computation ran (not those answered DEADLINE_EXCEEDED/CANCELLED before starting).
  uint64_t jobs_computed() const;
  int worker_count() const { return static_cast<int>(workers_.size()); }

 private:
  void WorkerLoop();
  // Deadline/cancel checks, then the computation; fills the job's outputs and timing.
  absl::Status Run(ForwardJob& job, int compute_threads);
  // One step of a batch: copies, append, attention.
  absl::Status RunStep(StepJob& job, int compute_threads);
  // QueueExpiry's sweep: answers and drops the queued jobs whose deadline is at or before `now`.
  absl::Time DropExpired(absl::Time now);

  const uint32_t max_queue_;
  const int threads_;
  const uint64_t memory_budget_;  // bytes of fp32 working memory the computation may take (all threads)
  const CpuBackendHooks hooks_;

  mutable absl::Mutex mu_;
  std::deque<std::unique_ptr<ForwardJob>> queue_ ABSL_GUARDED_BY(mu_);
  // Step batches, taken before forward jobs (a decode step is short and on a caller's critical path); they
  // count against max_queue together.
  std::deque<std::unique_ptr<StepBatch>> steps_ ABSL_GUARDED_BY(mu_);
  uint32_t running_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t computed_ ABSL_GUARDED_BY(mu_) = 0;

  absl::Mutex shutdown_mu_;  // serialises Shutdown so a second caller waits for the first to finish
  QueueExpiry expiry_;       // after the queue: its sweeps read it
  std::vector<std::thread> workers_;
};

}  // namespace attnd::server
