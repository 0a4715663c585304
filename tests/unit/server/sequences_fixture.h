// The fixture of the KV-sequence core's tests (sequences_test.cc, sequences_limits_test.cc): Sequences on the
// CPU backend behind a gate, the steps it runs, and the history of every sequence that checks each step's O and
// LSE against the double reference.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "attnd/half.h"
#include "attnd/server/cpu_backend.h"
#include "attnd/server/sequences.h"
#include "gated_backend.h"
#include "gtest/gtest.h"
#include "server_test_util.h"

namespace attnd::sequences_test {

using server::CallInfo;
using testing::GatedBackend;
using server::SequenceOptions;
using server::Sequences;
using server::StepJob;
using server::Transport;
using server::ValidationLimits;

struct Outcome {
  absl::Status status;
  std::string o, lse;
  std::vector<int64_t> lengths;
  uint32_t batch_sequences = 0, batch_requests = 0;
};

// Steps started without waiting (StepEach); Await blocks until every one is answered.
struct StepsInFlight {
  std::vector<v1::StepRequest> steps;
  std::vector<std::shared_ptr<Outcome>> outs;
  std::shared_ptr<absl::Mutex> mu = std::make_shared<absl::Mutex>();
  std::shared_ptr<int> finished = std::make_shared<int>(0);
  void Await() {
    absl::MutexLock lock(mu.get());
    mu->Await(absl::Condition(
        +[](StepsInFlight* f) { return static_cast<size_t>(*f->finished) == f->steps.size(); }, this));
  }
};

// The history the test keeps of one sequence: every layer's K and V rows as sent.
struct History {
  std::vector<std::string> k, v;  // per layer, [tokens, kv_heads, head_dim] bytes
};

class SequencesTest : public ::testing::Test {
 protected:
  static constexpr int kLayers = 3, kKvHeads = 2, kQHeads = 8, kHeadDim = 64;

  void Start(SequenceOptions options = {}) {
    server::BackendOptions bo;
    bo.threads = 2;
    auto gated = std::make_unique<GatedBackend>(std::make_unique<server::CpuBackend>(bo));
    gate_ = gated.get();
    backend_ = std::move(gated);
    if (wrap_) backend_ = wrap_(std::move(backend_));
    ValidationLimits limits = limits_;
    limits.supported_head_dims = {64, 128, 256};
    limits.supported_dtypes = {DType::kBF16, DType::kFP16};
    if (options.pool_bytes == (1ull << 30)) options.pool_bytes = 64ull << 20;
    sequences_ = std::make_unique<Sequences>(options, limits, backend_.get(), nullptr);
  }
  // One step of one token per sequence at layer 0, each its own call, all started before any is awaited.
  StepsInFlight StepEach(const std::vector<std::string>& ids) {
    StepsInFlight f;
    for (const std::string& id : ids) f.steps.push_back(MakeStep({id}, {1}, 0));
    for (size_t i = 0; i < f.steps.size(); ++i) {
      auto out = std::make_shared<Outcome>();
      f.outs.push_back(out);
      sequences_->Step("alice", f.steps[i], Transport::kShm, CallFor(),
                       [out, mu = f.mu, finished = f.finished](absl::Status s, StepJob* job) {
                         out->status = s;
                         if (job != nullptr) {
                           out->o = job->o;
                           out->lse = job->lse;
                           out->batch_requests = job->batch_requests;
                           out->batch_sequences = job->batch_sequences;
                         }
                         absl::MutexLock lock(mu.get());
                         ++*finished;
                       });
    }
    return f;
  }
  void TearDown() override {
    if (gate_ != nullptr) gate_->Open();
    if (sequences_ != nullptr) sequences_->Shutdown();
    sequences_.reset();
    if (backend_ != nullptr) backend_->Shutdown();
  }

  std::vector<std::string> Open(int count = 1, const std::string& owner = "alice", int head_dim = kHeadDim,
                                v1::Dtype dtype = v1::DTYPE_BF16) {
    v1::OpenSequenceRequest r;
    r.mutable_shape()->set_layers(kLayers);
    r.mutable_shape()->set_kv_heads(kKvHeads);
    r.mutable_shape()->set_head_dim(head_dim);
    r.mutable_shape()->set_dtype(dtype);
    r.set_count(count);
    absl::StatusOr<v1::OpenSequenceResponse> opened = sequences_->Open(owner, r);
    EXPECT_TRUE(opened.ok()) << opened.status();
    if (!opened.ok()) return {};
    return {opened->sequence_ids().begin(), opened->sequence_ids().end()};
  }

  // Runs a step and waits for its reply.
  Outcome Run(const v1::StepRequest& request, const std::string& owner = "alice",
              Transport transport = Transport::kShm) {
    auto out = std::make_shared<Outcome>();
    auto done = std::make_shared<absl::Notification>();
    sequences_->Step(owner, request, transport, CallFor(), [this, out, done](absl::Status s, StepJob* job) {
      out->status = s;
      if (job != nullptr && s.ok()) {
        v1::StepResponse response;
        sequences_->FillStepResponse(*job, &response);
        out->o = job->o;
        out->lse = job->lse;
        out->lengths.assign(response.lengths().begin(), response.lengths().end());
        out->batch_sequences = job->batch_sequences;
        out->batch_requests = job->batch_requests;
      }
      done->Notify();
    });
    done->WaitForNotification();
    return *out;
  }

  static CallInfo CallFor() {
    CallInfo call;
    call.accepted = absl::Now();
    return call;
  }

  // A step of `tokens` new rows for each of `ids` at `layer` with random Q/K/V (append and attend), recorded
  // in the histories. Large logits when `hard` (scores rise along the keys, a few outlier channels).
  v1::StepRequest MakeStep(const std::vector<std::string>& ids, const std::vector<int>& tokens, int layer,
                           bool append = true, bool attend = true, bool lse = true, bool hard = false) {
    v1::StepRequest r;
    r.set_layer(layer);
    r.set_q_heads(kQHeads);
    r.set_return_lse(lse && attend);
    int64_t rows = 0;
    for (size_t i = 0; i < ids.size(); ++i) {
      v1::SequenceTokens* st = r.add_sequences();
      st->set_sequence_id(ids[i]);
      st->set_tokens(tokens[i]);
      rows += tokens[i];
    }
    const int hd = head_dim_;
    if (attend) r.mutable_q()->set_data(Tensor(rows * kQHeads * hd, hard));
    if (append) {
      r.mutable_k()->set_data(Tensor(rows * kKvHeads * hd, hard));
      r.mutable_v()->set_data(Tensor(rows * kKvHeads * hd, false));
    }
    return r;
  }

  std::string Tensor(int64_t elems, bool hard) {
    std::string t = testing::RandomTensor(elems, dtype_, rng_);
    if (!hard) return t;
    auto* h = reinterpret_cast<uint16_t*>(t.data());
    for (int64_t i = 0; i < elems; ++i) {
      float x = HalfToFloat(dtype_, h[i]) * 4.0f;
      if (i % head_dim_ == 3) x *= 8.0f;  // an outlier channel
      h[i] = FloatToHalf(dtype_, x);
    }
    return t;
  }

  // Appends the step's K/V rows to the histories (after an OK step).
  void Record(const v1::StepRequest& r) {
    if (!r.has_k()) return;
    const size_t row = static_cast<size_t>(kKvHeads) * head_dim_ * 2;
    size_t offset = 0;
    for (const v1::SequenceTokens& st : r.sequences()) {
      History& h = history_[st.sequence_id()];
      h.k.resize(kLayers);
      h.v.resize(kLayers);
      h.k[r.layer()].append(r.k().data(), offset, st.tokens() * row);
      h.v[r.layer()].append(r.v().data(), offset, st.tokens() * row);
      offset += st.tokens() * row;
    }
  }

  // Checks each sequence's O and LSE against the reference over its history at the step's layer.
  void Verify(const v1::StepRequest& r, const Outcome& out) {
    ASSERT_TRUE(out.status.ok()) << out.status;
    const size_t q_row = static_cast<size_t>(kQHeads) * head_dim_ * 2;
    size_t q_offset = 0, lse_offset = 0;
    for (const v1::SequenceTokens& st : r.sequences()) {
      const History& h = history_[st.sequence_id()];
      const int64_t keys = static_cast<int64_t>(h.k[r.layer()].size() / (kKvHeads * head_dim_ * 2));
      v1::ForwardRequest f;
      f.mutable_shape()->set_batch(1);
      f.mutable_shape()->set_q_len(st.tokens());
      f.mutable_shape()->set_kv_len(keys);
      f.mutable_shape()->set_q_heads(kQHeads);
      f.mutable_shape()->set_kv_heads(kKvHeads);
      f.mutable_shape()->set_head_dim(head_dim_);
      f.set_dtype(dtype_ == DType::kFP16 ? v1::DTYPE_FP16 : v1::DTYPE_BF16);
      f.set_mask(v1::MASK_TYPE_CAUSAL_BOTTOM_RIGHT);
      f.set_return_lse(r.return_lse());
      f.mutable_q()->set_data(r.q().data().substr(q_offset, st.tokens() * q_row));
      f.mutable_k()->set_data(h.k[r.layer()]);
      f.mutable_v()->set_data(h.v[r.layer()]);
      const std::string lse =
          r.return_lse() ? out.lse.substr(lse_offset, st.tokens() * kQHeads * 4) : std::string();
      testing::ExpectCorrect(f, out.o.substr(q_offset, st.tokens() * q_row), lse);
      q_offset += st.tokens() * q_row;
      lse_offset += st.tokens() * kQHeads * 4;
    }
    ASSERT_EQ(out.o.size(), q_offset);
  }

  // Step, record, verify.
  void StepAndVerify(const std::vector<std::string>& ids, const std::vector<int>& tokens, int layer,
                     bool hard = false) {
    const v1::StepRequest r = MakeStep(ids, tokens, layer, true, true, true, hard);
    const Outcome out = Run(r);
    ASSERT_TRUE(out.status.ok()) << out.status;
    Record(r);
    Verify(r, out);
  }

  v1::SequenceInfo Info(const std::string& id, const std::string& owner = "alice") {
    v1::GetSequenceRequest g;
    g.set_sequence_id(id);
    absl::StatusOr<v1::SequenceInfo> info = sequences_->Get(owner, g);
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? *info : v1::SequenceInfo();
  }

  void ExpectStatus(const absl::Status& s, absl::StatusCode code, const std::string& prefix) {
    EXPECT_EQ(s.code(), code) << s;
    EXPECT_TRUE(absl::StartsWith(s.message(), prefix)) << s;
  }

  // Set before Start: the limits the core checks steps against (head dims and dtypes are Start's), and what wraps
  // the gated CPU backend.
  ValidationLimits limits_;
  std::function<std::unique_ptr<server::Backend>(std::unique_ptr<server::Backend>)> wrap_;
  std::unique_ptr<server::Backend> backend_;
  GatedBackend* gate_ = nullptr;
  std::unique_ptr<Sequences> sequences_;
  std::mt19937_64 rng_{7};
  int head_dim_ = kHeadDim;
  DType dtype_ = DType::kBF16;
  std::map<std::string, History> history_;
};

}  // namespace attnd::sequences_test
