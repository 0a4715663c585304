// A Backend that holds every step batch while gated, so that tests keep steps in flight (and steps of the same
// layer waiting for a launch) for as long as they need.
#pragma once

#include <memory>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "forwarding_backend.h"
#include "gtest/gtest.h"

namespace attnd::testing {

class GatedBackend final : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  absl::Status SubmitSteps(std::unique_ptr<server::StepBatch> batch) override {
    absl::MutexLock lock(&mu_);
    if (!gated_) return ForwardingBackend::SubmitSteps(std::move(batch));
    held_.push_back(std::move(batch));
    return absl::OkStatus();
  }
  void Gate() {
    absl::MutexLock lock(&mu_);
    gated_ = true;
  }
  // Lets the held batches through and stops holding.
  void Open() {
    std::vector<std::unique_ptr<server::StepBatch>> held;
    {
      absl::MutexLock lock(&mu_);
      gated_ = false;
      held.swap(held_);
    }
    for (auto& b : held) ASSERT_TRUE(ForwardingBackend::SubmitSteps(std::move(b)).ok());
  }
  std::vector<size_t> held_batch_sizes() {
    absl::MutexLock lock(&mu_);
    std::vector<size_t> sizes;
    for (const auto& b : held_) sizes.push_back(b->jobs.size());
    return sizes;
  }

 private:
  absl::Mutex mu_;
  bool gated_ = false;
  std::vector<std::unique_ptr<server::StepBatch>> held_;
};

}  // namespace attnd::testing
