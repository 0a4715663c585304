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
#include "attnd/fp8.h"
#include "attnd/half.h"
#include "attnd/server/cpu_backend.h"
#include "attnd/server/sequences.h"
#include "core_messages.h"
#include "gated_backend.h"
#include "gtest/gtest.h"
#include "server_test_util.h"

namespace attnd::sequences_test {

using server::CallInfo;
using testing::GatedBackend;
using server::SequenceOptions;
using server::Sequences;
using server::StepJob;
using server::ValidationLimits;

// How a step arrives: in one gRPC message each way (bounded by max_message_bytes), or in a shared-memory
// channel's areas (no message bound).
enum class Via { kUnary, kShm };

// The core's limits and the gRPC frontend's message limit, as a server sets them together.
struct StepLimits : ValidationLimits {
  uint64_t max_message_bytes = 256ull << 20;
};

// The core driven as the frontends drive it: each message decoded into the core's arguments and each answer
// encoded (core_messages.h), so that the tests speak the API's messages.
class SequencesOverProto {
 public:
  SequencesOverProto(std::unique_ptr<Sequences> core, uint64_t max_message_bytes)
      : core_(std::move(core)), max_message_bytes_(max_message_bytes) {}

  absl::StatusOr<v1::OpenSequenceResponse> Open(const std::string& owner, const v1::OpenSequenceRequest& r) {
    absl::StatusOr<server::OpenArgs> args = server::OpenArgsFromProto(r);
    if (!args.ok()) return args.status();
    absl::StatusOr<server::OpenedSequences> opened = core_->Open(owner, *args);
    if (!opened.ok()) return opened.status();
    v1::OpenSequenceResponse out;
    for (const std::string& id : opened->sequence_ids) out.add_sequence_ids(id);
    out.set_max_tokens(opened->max_tokens);
    out.set_page_tokens(opened->page_tokens);
    return out;
  }
  absl::StatusOr<v1::ForkSequenceResponse> Fork(const std::string& owner, const v1::ForkSequenceRequest& r) {
    absl::StatusOr<std::vector<std::string>> ids = core_->Fork(owner, r.sequence_id(), r.count());
    if (!ids.ok()) return ids.status();
    v1::ForkSequenceResponse out;
    for (const std::string& id : *ids) out.add_sequence_ids(id);
    return out;
  }
  absl::StatusOr<v1::TruncateSequenceResponse> Truncate(const std::string& owner,
                                                        const v1::TruncateSequenceRequest& r) {
    absl::StatusOr<std::vector<int64_t>> lengths = core_->Truncate(owner, r.sequence_id(), r.tokens());
    if (!lengths.ok()) return lengths.status();
    v1::TruncateSequenceResponse out;
    for (int64_t len : *lengths) out.add_lengths(len);
    return out;
  }
  absl::Status Close(const std::string& owner, const v1::CloseSequenceRequest& r) {
    const std::vector<absl::string_view> ids(r.sequence_ids().begin(), r.sequence_ids().end());
    return core_->Close(owner, ids);
  }
  absl::StatusOr<v1::SequenceInfo> Get(const std::string& owner, const v1::GetSequenceRequest& r) {
    absl::StatusOr<server::SequenceState> state = core_->Get(owner, r.sequence_id());
    if (!state.ok()) return state.status();
    return server::SequenceInfoToProto(*state);
  }
  // The request must outlive the reply (the job's inline tensors point into it).
  void Step(const std::string& owner, const v1::StepRequest& r, Via via, CallInfo call, Sequences::StepReply reply) {
    call.message_limit = via == Via::kUnary ? max_message_bytes_ : 0;
    core_->Step(owner, server::StepArgsFromProto(r), call, std::move(reply));
  }
  void FillStepResponse(const StepJob& job, v1::StepResponse* response) const {
    server::FillStepReply(job, "cpu", response);
  }
  v1::SequenceLimits limits() const { return server::SequenceLimitsToProto(core_->options()); }
  v1::SequenceStats stats() const { return server::SequenceStatsToProto(core_->stats()); }
  int ExpireIdle(absl::Time now) { return core_->ExpireIdle(now); }
  uint32_t waiting() const { return core_->waiting(); }
  void Shutdown() { core_->Shutdown(); }
  Sequences* core() { return core_.get(); }

 private:
  const std::unique_ptr<Sequences> core_;
  const uint64_t max_message_bytes_;
};

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
    bo.threads = backend_threads_;
    auto gated = std::make_unique<GatedBackend>(std::make_unique<server::CpuBackend>(bo));
    gate_ = gated.get();
    backend_ = std::move(gated);
    if (wrap_) backend_ = wrap_(std::move(backend_));
    ValidationLimits limits = limits_;
    limits.supported_head_dims = {64, 128, 256};
    limits.supported_dtypes = {DType::kBF16, DType::kFP16};
    if (options.pool_bytes == (1ull << 30)) options.pool_bytes = 64ull << 20;
    sequences_ = std::make_unique<SequencesOverProto>(
        std::make_unique<Sequences>(options, limits, backend_.get(), nullptr), limits_.max_message_bytes);
  }
  // One step of one token per sequence at layer 0, each its own call, all started before any is awaited.
  StepsInFlight StepEach(const std::vector<std::string>& ids) {
    StepsInFlight f;
    for (const std::string& id : ids) f.steps.push_back(MakeStep({id}, {1}, 0));
    for (size_t i = 0; i < f.steps.size(); ++i) {
      auto out = std::make_shared<Outcome>();
      f.outs.push_back(out);
      sequences_->Step("alice", f.steps[i], Via::kShm, CallFor(),
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

  // An import's header for a sequence of this fixture's shape holding `lengths` tokens per layer.
  server::ImportArgs ImportHeader(const std::vector<int64_t>& lengths) const {
    server::ImportArgs header;
    header.open.layers = kLayers, header.open.kv_heads = kKvHeads, header.open.head_dim = head_dim_;
    header.open.dtype = dtype_;
    header.lengths = lengths;
    return header;
  }

  std::vector<std::string> Open(int count = 1, const std::string& owner = "alice", int head_dim = kHeadDim,
                                v1::Dtype dtype = v1::DTYPE_BF16) {
    v1::OpenSequenceRequest r;
    r.mutable_shape()->set_layers(kLayers);
    r.mutable_shape()->set_kv_heads(kKvHeads);
    r.mutable_shape()->set_head_dim(head_dim);
    r.mutable_shape()->set_dtype(dtype);
    if (!k_descale_.empty()) {
      r.mutable_shape()->set_kv_dtype(v1::DTYPE_FP8_E4M3);
      r.mutable_shape()->mutable_k_descale()->Add(k_descale_.begin(), k_descale_.end());
      r.mutable_shape()->mutable_v_descale()->Add(v_descale_.begin(), v_descale_.end());
    }
    r.set_count(count);
    absl::StatusOr<v1::OpenSequenceResponse> opened = sequences_->Open(owner, r);
    EXPECT_TRUE(opened.ok()) << opened.status();
    if (!opened.ok()) return {};
    return {opened->sequence_ids().begin(), opened->sequence_ids().end()};
  }

  // Runs a step and waits for its reply.
  Outcome Run(const v1::StepRequest& request, const std::string& owner = "alice", Via via = Via::kShm) {
    auto out = std::make_shared<Outcome>();
    auto done = std::make_shared<absl::Notification>();
    sequences_->Step(owner, request, via, CallFor(), [this, out, done](absl::Status s, StepJob* job) {
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
      h.k[r.layer()].append(Cached(r.k().data().substr(offset, st.tokens() * row), k_descale_, r.layer()));
      h.v[r.layer()].append(Cached(r.v().data().substr(offset, st.tokens() * row), v_descale_, r.layer()));
      offset += st.tokens() * row;
    }
  }

  // Rows as a float8 cache gives them back (with descales [kLayers * kKvHeads]): each element quantized to the
  // e4m3 code of x / descale, then code x descale rounded to the dtype. As sent for a 16-bit cache.
  std::string Cached(std::string rows, const std::vector<float>& descale, int layer) const {
    if (descale.empty()) return rows;
    auto* h = reinterpret_cast<uint16_t*>(rows.data());
    for (size_t i = 0; i < rows.size() / 2; ++i) {
      const float d = descale[layer * kKvHeads + (i / head_dim_) % kKvHeads];
      h[i] = FloatToHalf(dtype_, Fp8E4M3ToFloat(FloatToFp8E4M3(HalfToFloat(dtype_, h[i]) / d)) * d);
    }
    return rows;
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
                     bool hard = false, const std::string& owner = "alice") {
    const v1::StepRequest r = MakeStep(ids, tokens, layer, true, true, true, hard);
    const Outcome out = Run(r, owner);
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
  StepLimits limits_;
  std::function<std::unique_ptr<server::Backend>(std::unique_ptr<server::Backend>)> wrap_;
  std::unique_ptr<server::Backend> backend_;
  int backend_threads_ = 2;  // the CPU backend's workers (1: batches run in the order they were submitted)
  GatedBackend* gate_ = nullptr;
  std::unique_ptr<SequencesOverProto> sequences_;
  std::mt19937_64 rng_{7};
  int head_dim_ = kHeadDim;
  DType dtype_ = DType::kBF16;
  // Set before Open for float8 caches: one descale per layer and kv head (layer-major) of K and of V.
  std::vector<float> k_descale_, v_descale_;
  std::map<std::string, History> history_;
};

}  // namespace attnd::sequences_test
