// A Backend that passes every call to another one: tests derive from it and override the calls they watch.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "attnd/server/backend.h"

namespace attnd::testing {

class ForwardingBackend : public server::Backend {
 public:
  explicit ForwardingBackend(std::unique_ptr<server::Backend> inner) : inner_(std::move(inner)) {}

  std::string name() const override { return inner_->name(); }
  bool cuda_ipc() const override { return inner_->cuda_ipc(); }
  std::vector<server::DeviceDescription> devices() const override { return inner_->devices(); }
  std::vector<int64_t> supported_head_dims() const override { return inner_->supported_head_dims(); }
  std::vector<DType> supported_dtypes() const override { return inner_->supported_dtypes(); }
  std::vector<std::string> kernels() const override { return inner_->kernels(); }
  absl::Status Accept(server::ForwardJob* job) const override { return inner_->Accept(job); }
  absl::Status Submit(std::unique_ptr<server::ForwardJob> job) override { return inner_->Submit(std::move(job)); }
  absl::StatusOr<std::unique_ptr<server::InputSink>> OpenInputs(
      const server::ForwardJob& job, const uint64_t (&sizes)[server::InputSink::kTensors]) override {
    return inner_->OpenInputs(job, sizes);
  }
  uint32_t queue_depth() const override { return inner_->queue_depth(); }
  uint32_t in_flight() const override { return inner_->in_flight(); }
  void Shutdown() override { inner_->Shutdown(); }
  server::BackendStats stats() const override { return inner_->stats(); }
  std::vector<server::DeviceMemoryUse> device_memory() const override { return inner_->device_memory(); }
  uint32_t max_queue() const override { return inner_->max_queue(); }
  uint64_t stream_preferred_from_bytes() const override { return inner_->stream_preferred_from_bytes(); }
  absl::StatusOr<std::shared_ptr<server::KvPool>> MakeKvPool(const server::SequenceShape& shape, int page_tokens,
                                                             int32_t num_pages) override {
    return inner_->MakeKvPool(shape, page_tokens, num_pages);
  }
  uint64_t default_kv_pool_bytes() const override { return inner_->default_kv_pool_bytes(); }
  absl::Status AcceptStep(const server::StepJob& job) const override { return inner_->AcceptStep(job); }
  absl::Status CopyKvRows(const server::KvPool& pool, absl::Span<const int32_t> pages, int layer, int kv,
                          int64_t first, int64_t rows, bool to_host, uint8_t* host) override {
    return inner_->CopyKvRows(pool, pages, layer, kv, first, rows, to_host, host);
  }
  absl::Status WriteKvRows(const server::KvPool& pool, absl::Span<const int32_t> pages, int layer, int kv,
                           int64_t first, int64_t rows, server::HostPieces src) override {
    return inner_->WriteKvRows(pool, pages, layer, kv, first, rows, src);
  }
  bool device_order() const override { return inner_->device_order(); }
  absl::StatusOr<MappedHostMemory> MapHostMemory(void* page, size_t bytes) override {
    return inner_->MapHostMemory(page, bytes);
  }
  absl::Status SubmitSteps(std::unique_ptr<server::StepBatch> batch) override {
    return inner_->SubmitSteps(std::move(batch));
  }

 private:
  std::unique_ptr<server::Backend> inner_;
};

}  // namespace attnd::testing
