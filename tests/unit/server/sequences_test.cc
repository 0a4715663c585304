// The KV-sequence core (Sequences) on the CPU backend: every step's O and LSE checked against the double
// reference over the sequence's whole history, kept by the test; forks, truncation, closing, expiry, ownership,
// the page pool's limits and its bookkeeping, batching of concurrent steps, and bad input naming its field.
#include "attnd/server/sequences.h"

#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "attnd/half.h"
#include "attnd/server/cpu_backend.h"
#include "forwarding_backend.h"
#include "gated_backend.h"
#include "gtest/gtest.h"
#include "server_test_util.h"

namespace attnd {
namespace {

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

TEST_F(SequencesTest, PrefillInChunksThenDecodeEveryLayer) {
  Start();
  const std::vector<std::string> ids = Open(1);
  ASSERT_EQ(ids.size(), 1u);
  // Chunks that end mid-page and a one-token step, at every layer; then decode steps and a speculative one.
  for (int chunk : {37, 16, 1, 50}) {
    for (int layer = 0; layer < kLayers; ++layer) StepAndVerify(ids, {chunk}, layer, /*hard=*/chunk == 50);
  }
  for (int step = 0; step < 3; ++step) {
    for (int layer = 0; layer < kLayers; ++layer) StepAndVerify(ids, {1}, layer);
  }
  StepAndVerify(ids, {4}, 0);
  const v1::SequenceInfo info = Info(ids[0]);
  EXPECT_EQ(info.lengths(0), 37 + 16 + 1 + 50 + 3 + 4);
  EXPECT_EQ(info.lengths(1), 37 + 16 + 1 + 50 + 3);
  EXPECT_EQ(info.pages(), (info.lengths(0) + 15) / 16);
}

TEST_F(SequencesTest, RaggedBatchAndBothDtypesAndHeadDims) {
  for (v1::Dtype dt : {v1::DTYPE_BF16, v1::DTYPE_FP16}) {
    for (int hd : {64, 128, 256}) {
      SCOPED_TRACE(absl::StrCat("hd ", hd, " dtype ", dt));
      Start();
      head_dim_ = hd;
      dtype_ = dt == v1::DTYPE_FP16 ? DType::kFP16 : DType::kBF16;
      const std::vector<std::string> ids = Open(3, "alice", hd, dt);
      StepAndVerify(ids, {5, 33, 17}, 1);
      StepAndVerify(ids, {1, 1, 1}, 1);
      StepAndVerify(ids, {2, 7, 1}, 1);
      TearDown();
      gate_ = nullptr;
      history_.clear();
    }
  }
  sequences_.reset();
  backend_.reset();
}

TEST_F(SequencesTest, AttendWithoutAppendAndAppendWithoutAttend) {
  Start();
  const std::vector<std::string> ids = Open(1);
  v1::StepRequest append = MakeStep(ids, {20}, 0, /*append=*/true, /*attend=*/false);
  Outcome out = Run(append);
  ASSERT_TRUE(out.status.ok()) << out.status;
  EXPECT_TRUE(out.o.empty());
  EXPECT_EQ(out.lengths, std::vector<int64_t>{20});
  Record(append);
  // Q rows for the last 6 cached positions.
  const v1::StepRequest attend = MakeStep(ids, {6}, 0, /*append=*/false, /*attend=*/true);
  out = Run(attend);
  Verify(attend, out);
  EXPECT_EQ(out.lengths, std::vector<int64_t>{20});
}

TEST_F(SequencesTest, ForkSharesPagesAndDiverges) {
  Start();
  const std::vector<std::string> parent = Open(1);
  for (int layer = 0; layer < kLayers; ++layer) StepAndVerify(parent, {40}, layer);  // 2.5 pages
  v1::ForkSequenceRequest fr;
  fr.set_sequence_id(parent[0]);
  fr.set_count(2);
  absl::StatusOr<v1::ForkSequenceResponse> forked = sequences_->Fork("alice", fr);
  ASSERT_TRUE(forked.ok()) << forked.status();
  ASSERT_EQ(forked->sequence_ids_size(), 2);
  const std::string a = forked->sequence_ids(0), b = forked->sequence_ids(1);
  history_[a] = history_[b] = history_[parent[0]];
  EXPECT_EQ(Info(a).shared_pages(), 3);
  const uint64_t used_before = sequences_->stats().pages_used();
  EXPECT_EQ(used_before, 3u);  // shared, not copied
  // Each writes into the shared last page: each gets its own copy; the others keep theirs.
  for (int layer = 0; layer < kLayers; ++layer) {
    StepAndVerify({a}, {1}, layer);
    StepAndVerify({b}, {3}, layer);
  }
  EXPECT_EQ(Info(a).shared_pages(), 2);
  // A fork of a fork, then every one of them steps again and is checked against its own history.
  fr.set_sequence_id(a);
  fr.set_count(1);
  forked = sequences_->Fork("alice", fr);
  ASSERT_TRUE(forked.ok()) << forked.status();
  const std::string c = forked->sequence_ids(0);
  history_[c] = history_[a];
  for (int layer = 0; layer < kLayers; ++layer) StepAndVerify({parent[0], a, b, c}, {2, 1, 1, 30}, layer);
  // Closing everything returns every page.
  v1::CloseSequenceRequest close;
  for (const std::string& id : {parent[0], a, b, c}) close.add_sequence_ids(id);
  ASSERT_TRUE(sequences_->Close("alice", close).ok());
  EXPECT_EQ(sequences_->stats().pages_used(), 0u);
  EXPECT_EQ(sequences_->stats().open(), 0u);
  EXPECT_EQ(sequences_->stats().pools(), 0u);
}

TEST_F(SequencesTest, TruncateDropsTokensAndPages) {
  Start();
  const std::vector<std::string> ids = Open(1);
  for (int layer = 0; layer < kLayers; ++layer) StepAndVerify(ids, {50}, layer);
  v1::TruncateSequenceRequest tr;
  tr.set_sequence_id(ids[0]);
  tr.set_tokens(20);
  absl::StatusOr<v1::TruncateSequenceResponse> t = sequences_->Truncate("alice", tr);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->lengths(0), 20);
  EXPECT_EQ(Info(ids[0]).pages(), 2);
  History& h = history_[ids[0]];
  for (int layer = 0; layer < kLayers; ++layer) {
    h.k[layer].resize(20 * kKvHeads * kHeadDim * 2);
    h.v[layer].resize(20 * kKvHeads * kHeadDim * 2);
  }
  for (int layer = 0; layer < kLayers; ++layer) StepAndVerify(ids, {3}, layer);
  tr.set_tokens(-1);
  ExpectStatus(sequences_->Truncate("alice", tr).status(), absl::StatusCode::kInvalidArgument, "tokens:");
}

TEST_F(SequencesTest, OwnershipClosingAndForeignIds) {
  Start();
  const std::vector<std::string> ids = Open(1);
  v1::GetSequenceRequest g;
  g.set_sequence_id(ids[0]);
  // Another owner: exactly the answer an unknown id of this server gets.
  const absl::Status foreign = sequences_->Get("mallory", g).status();
  ExpectStatus(foreign, absl::StatusCode::kNotFound, "sequence_id: no open sequence");
  v1::StepRequest step = MakeStep(ids, {1}, 0);
  ExpectStatus(Run(step, "mallory").status, absl::StatusCode::kNotFound, "sequences[0].sequence_id:");
  v1::CloseSequenceRequest close;
  close.add_sequence_ids(ids[0]);
  ExpectStatus(sequences_->Close("mallory", close), absl::StatusCode::kNotFound, "sequence_ids[0]:");
  ASSERT_TRUE(sequences_->Close("alice", close).ok());
  ExpectStatus(sequences_->Get("alice", g).status(), absl::StatusCode::kNotFound, "sequence_id: sequence");
  EXPECT_TRUE(absl::StrContains(sequences_->Get("alice", g).status().message(), "closed"));
  // An id of another server process (a restart).
  g.set_sequence_id("00000000-0123456789abcdef0123456789abcdef");
  const absl::Status other = sequences_->Get("alice", g).status();
  EXPECT_EQ(other.code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(absl::StrContains(other.message(), "restarted")) << other;
  // Ids are 128 random bits after the process prefix.
  const std::vector<std::string> more = Open(2);
  EXPECT_NE(more[0], more[1]);
  EXPECT_EQ(more[0].size(), 8u + 1u + 32u);
}

TEST_F(SequencesTest, PoolFullIsResourceExhaustedAndEvictsNothing) {
  SequenceOptions o;
  // Room for 10 pages of this shape: 16 tokens x 2 heads x 64 x 2 bytes x 2 (K, V) x 3 layers each.
  o.pool_bytes = 10 * 16 * kKvHeads * kHeadDim * 2 * 2 * kLayers;
  Start(o);
  const std::vector<std::string> ids = Open(2);
  StepAndVerify({ids[0]}, {100}, 0);  // 7 pages
  const uint64_t used = sequences_->stats().pages_used();
  EXPECT_EQ(used, 7u);
  // 4 more pages do not fit; the first sequence of the batch fits, and must be rolled back with the rest.
  const v1::StepRequest r = MakeStep({ids[1], ids[0]}, {40, 20}, 0);
  const Outcome out = Run(r);
  ExpectStatus(out.status, absl::StatusCode::kResourceExhausted, "kv pool");
  EXPECT_EQ(sequences_->stats().pages_used(), used);
  EXPECT_EQ(Info(ids[1]).pages(), 0);
  // The live sequence is intact and keeps working.
  StepAndVerify({ids[0]}, {1}, 0);
  EXPECT_EQ(Info(ids[0]).lengths(0), 101);
}

// The refusal says what the step needs against what is free, and names the flag that sizes the pool.
TEST_F(SequencesTest, PoolFullSaysWhatTheStepNeedsAndNamesTheFlag) {
  SequenceOptions o;
  o.pool_bytes = 10 * 16 * kKvHeads * kHeadDim * 2 * 2 * kLayers;  // 10 pages
  Start(o);
  const std::vector<std::string> ids = Open(2);
  StepAndVerify({ids[0]}, {100}, 0);  // 7 pages
  // 60 tokens need 4 pages; 3 are free.
  const Outcome short_of = Run(MakeStep({ids[1]}, {60}, 0));
  ExpectStatus(short_of.status, absl::StatusCode::kResourceExhausted, "kv pool");
  EXPECT_TRUE(absl::StrContains(short_of.status.message(), "needs 4 pages, 3 of the pool's 10 are free"))
      << short_of.status;
  EXPECT_FALSE(absl::StrContains(short_of.status.message(), "all 10 pages")) << short_of.status;
  EXPECT_TRUE(absl::StrContains(short_of.status.message(), "--kv_pool_mb")) << short_of.status;
  StepAndVerify({ids[1]}, {48}, 0);  // the last 3
  const Outcome none = Run(MakeStep({ids[1]}, {1}, 0));
  ExpectStatus(none.status, absl::StatusCode::kResourceExhausted, "kv pool");
  EXPECT_TRUE(absl::StrContains(none.status.message(), "all 10 pages are in use")) << none.status;
  EXPECT_TRUE(absl::StrContains(none.status.message(), "--kv_pool_mb")) << none.status;
  // A pool too small for one page names the flag too.
  TearDown();
  o.pool_bytes = 1000;
  Start(o);
  v1::OpenSequenceRequest r;
  r.mutable_shape()->set_layers(kLayers);
  r.mutable_shape()->set_kv_heads(kKvHeads);
  r.mutable_shape()->set_head_dim(kHeadDim);
  r.mutable_shape()->set_dtype(v1::DTYPE_BF16);
  const absl::Status tiny = sequences_->Open("alice", r).status();
  ExpectStatus(tiny, absl::StatusCode::kResourceExhausted, "kv pool");
  EXPECT_TRUE(absl::StrContains(tiny.message(), "--kv_pool_mb")) << tiny;
  EXPECT_FALSE(absl::StrContains(tiny.message(), "--kv_pool_bytes")) << tiny;
}

// Over gRPC a step's request (Q, K, V) and its reply (O, LSE) are two messages, each held to --max_message_bytes
// on its own; --max_request_bytes bounds all of them together.
TEST_F(SequencesTest, RequestAndReplyEachFitOneMessage) {
  limits_.max_message_bytes = 1 << 20;  // 983,040 bytes of tensors after the framing allowance
  Start();
  const std::vector<std::string> ids = Open(1);
  // Per row: Q and O 1,024 bytes each, K and V 256 each, LSE 32. 600 rows: a request of 921,600 bytes and a reply
  // of 633,600, 1,555,200 together.
  const v1::StepRequest both = MakeStep(ids, {600}, 0);
  const Outcome fits = Run(both, "alice", Transport::kUnary);
  ASSERT_TRUE(fits.status.ok()) << fits.status;
  Record(both);
  Verify(both, fits);
  // 700 rows: a request of 1,075,200 bytes.
  const Outcome big_request = Run(MakeStep(ids, {700}, 0), "alice", Transport::kUnary);
  ExpectStatus(big_request.status, absl::StatusCode::kResourceExhausted, "sequences:");
  EXPECT_TRUE(absl::StrContains(big_request.status.message(), "request")) << big_request.status;
  EXPECT_TRUE(absl::StrContains(big_request.status.message(), "1075200")) << big_request.status;
  EXPECT_TRUE(absl::StrContains(big_request.status.message(), "--max_message_bytes=1048576")) << big_request.status;
  // Attending without appending, 950 rows: a request of 972,800 bytes (Q) and a reply of 1,003,200 (O and LSE).
  const v1::StepRequest more = MakeStep(ids, {400}, 0, /*append=*/true, /*attend=*/false);
  ASSERT_TRUE(Run(more, "alice", Transport::kUnary).status.ok());
  Record(more);
  const Outcome big_reply = Run(MakeStep(ids, {950}, 0, /*append=*/false), "alice", Transport::kUnary);
  ExpectStatus(big_reply.status, absl::StatusCode::kResourceExhausted, "sequences:");
  EXPECT_TRUE(absl::StrContains(big_reply.status.message(), "reply")) << big_reply.status;
  EXPECT_TRUE(absl::StrContains(big_reply.status.message(), "1003200")) << big_reply.status;
  EXPECT_TRUE(absl::StrContains(big_reply.status.message(), "--max_message_bytes=1048576")) << big_reply.status;
  // Not over gRPC (the shared-memory channel): no message limit.
  EXPECT_TRUE(Run(MakeStep(ids, {950}, 0, /*append=*/false), "alice", Transport::kShm).status.ok());
  EXPECT_EQ(Info(ids[0]).lengths(0), 1000);

  // The sum is --max_request_bytes's, on every transport.
  TearDown();
  limits_ = ValidationLimits();
  limits_.max_request_bytes = 1 << 20;
  Start();
  const std::vector<std::string> again = Open(1);
  const Outcome total = Run(MakeStep(again, {600}, 0), "alice", Transport::kShm);
  ExpectStatus(total.status, absl::StatusCode::kResourceExhausted, "sequences:");
  EXPECT_TRUE(absl::StrContains(total.status.message(), "1555200")) << total.status;
  EXPECT_TRUE(absl::StrContains(total.status.message(), "--max_request_bytes=1048576")) << total.status;
}

// Pool memory as the CUDA backend has it: one budget, so a pool is refused while an earlier one is still alive,
// and a step's job keeps its pool for `linger` after the step's reply, as a CUDA job does until its batch's GPU
// work is over.
class OnePoolBudget final : public testing::ForwardingBackend {
 public:
  OnePoolBudget(std::unique_ptr<server::Backend> inner, absl::Duration linger)
      : ForwardingBackend(std::move(inner)), linger_(linger) {}
  ~OnePoolBudget() override {
    for (std::thread& t : lingering_) t.join();
  }
  absl::StatusOr<std::shared_ptr<server::KvPool>> MakeKvPool(const server::SequenceShape& shape, int page_tokens,
                                                             int32_t num_pages) override {
    absl::MutexLock lock(&mu_);
    if (!last_.expired()) return absl::ResourceExhaustedError("budget exhausted: an earlier pool is still held");
    absl::StatusOr<std::shared_ptr<server::KvPool>> pool = ForwardingBackend::MakeKvPool(shape, page_tokens, num_pages);
    if (pool.ok()) last_ = *pool;
    return pool;
  }
  absl::Status SubmitSteps(std::unique_ptr<server::StepBatch> batch) override {
    for (std::unique_ptr<StepJob>& job : batch->jobs) {
      job->done = [this, pool = job->pool, done = std::move(job->done)](absl::Status s) mutable {
        done(std::move(s));
        absl::MutexLock lock(&mu_);
        lingering_.emplace_back([pool = std::move(pool), linger = linger_]() mutable {
          absl::SleepFor(linger);
          pool.reset();
        });
      };
    }
    return ForwardingBackend::SubmitSteps(std::move(batch));
  }

 private:
  const absl::Duration linger_;
  absl::Mutex mu_;
  std::weak_ptr<server::KvPool> last_;
  std::vector<std::thread> lingering_;
};

// Closing a shape's last sequence gives its pool back once the last step that ran on it is dropped, which may be
// after that step's reply: an open right then waits for the memory instead of being refused for it.
TEST_F(SequencesTest, AnOpenWaitsForPoolMemoryOnItsWayBack) {
  wrap_ = [](std::unique_ptr<server::Backend> inner) {
    return std::make_unique<OnePoolBudget>(std::move(inner), absl::Milliseconds(200));
  };
  Start();
  const std::vector<std::string> first = Open(1);
  ASSERT_EQ(first.size(), 1u);
  StepAndVerify(first, {3}, 0);
  v1::CloseSequenceRequest close;
  close.add_sequence_ids(first[0]);
  ASSERT_TRUE(sequences_->Close("alice", close).ok());
  const absl::Time start = absl::Now();
  const std::vector<std::string> second = Open(1);
  ASSERT_EQ(second.size(), 1u);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  StepAndVerify(second, {2}, 0);
}

TEST_F(SequencesTest, PerClientLimits) {
  SequenceOptions o;
  o.max_per_client = 2;
  o.max_pages_per_client = 3;
  Start(o);
  const std::vector<std::string> ids = Open(2);
  v1::OpenSequenceRequest r;
  r.mutable_shape()->set_layers(kLayers);
  r.mutable_shape()->set_kv_heads(kKvHeads);
  r.mutable_shape()->set_head_dim(kHeadDim);
  r.mutable_shape()->set_dtype(v1::DTYPE_BF16);
  ExpectStatus(sequences_->Open("alice", r).status(), absl::StatusCode::kResourceExhausted, "count:");
  EXPECT_TRUE(sequences_->Open("bob", r).ok());  // another client is not affected
  StepAndVerify({ids[0]}, {40}, 0);  // 3 pages
  ExpectStatus(Run(MakeStep({ids[1]}, {1}, 0)).status, absl::StatusCode::kResourceExhausted, "kv pool");
}

TEST_F(SequencesTest, IdleSequencesExpire) {
  SequenceOptions o;
  o.ttl = absl::Seconds(30);
  Start(o);
  const std::vector<std::string> ids = Open(2);
  StepAndVerify({ids[0]}, {3}, 0);
  EXPECT_EQ(sequences_->ExpireIdle(absl::Now()), 0);
  EXPECT_EQ(sequences_->ExpireIdle(absl::Now() + absl::Seconds(31)), 2);
  const Outcome out = Run(MakeStep({ids[0]}, {1}, 0));
  ExpectStatus(out.status, absl::StatusCode::kNotFound, "sequences[0].sequence_id:");
  EXPECT_TRUE(absl::StrContains(out.status.message(), "idle")) << out.status;
  EXPECT_EQ(sequences_->stats().expired(), 2u);
  EXPECT_EQ(sequences_->stats().pages_used(), 0u);
}

TEST_F(SequencesTest, OneStepInFlightPerSequenceAndDeferredClose) {
  Start();
  const std::vector<std::string> ids = Open(2);
  StepAndVerify(ids, {1, 1}, 0);
  gate_->Gate();
  const v1::StepRequest first = MakeStep({ids[0]}, {1}, 0);
  auto first_out = std::make_shared<Outcome>();
  absl::Notification first_done;
  sequences_->Step("alice", first, Transport::kShm, CallFor(), [&](absl::Status s, StepJob* job) {
    first_out->status = s;
    if (job != nullptr) first_out->o = job->o;
    first_done.Notify();
  });
  ASSERT_TRUE(testing::WaitFor([&] { return gate_->held_batch_sizes().size() == 1; }));
  // A second step of the same sequence, a fork and a truncate are refused while the first runs.
  ExpectStatus(Run(MakeStep({ids[0]}, {1}, 1)).status, absl::StatusCode::kAborted, "sequences[0].sequence_id:");
  v1::ForkSequenceRequest fr;
  fr.set_sequence_id(ids[0]);
  ExpectStatus(sequences_->Fork("alice", fr).status(), absl::StatusCode::kAborted, "sequence_id:");
  EXPECT_TRUE(Info(ids[0]).step_in_flight());
  // Closing it now is deferred: it is gone for callers at once, its pages return when the step ends.
  v1::CloseSequenceRequest close;
  close.add_sequence_ids(ids[0]);
  ASSERT_TRUE(sequences_->Close("alice", close).ok());
  EXPECT_EQ(sequences_->stats().open(), 2u);
  gate_->Open();
  first_done.WaitForNotification();
  EXPECT_TRUE(first_out->status.ok()) << first_out->status;
  EXPECT_EQ(sequences_->stats().open(), 1u);
  v1::GetSequenceRequest g;
  g.set_sequence_id(ids[0]);
  EXPECT_EQ(sequences_->Get("alice", g).status().code(), absl::StatusCode::kNotFound);
  StepAndVerify({ids[1]}, {2}, 0);
}

TEST_F(SequencesTest, ConcurrentStepsOfOneLayerJoinOneLaunch) {
  SequenceOptions o;
  o.launches_in_flight = 1;
  Start(o);
  const std::vector<std::string> ids = Open(4);
  StepAndVerify(ids, {3, 3, 3, 3}, 0);
  gate_->Gate();
  // The first launches alone (nothing was running); the three that arrive while it runs wait and then go
  // together.
  StepsInFlight f = StepEach(ids);
  EXPECT_EQ(gate_->held_batch_sizes(), std::vector<size_t>{1});
  EXPECT_EQ(sequences_->waiting(), 3u);
  gate_->Open();
  f.Await();
  EXPECT_EQ(f.outs[0]->batch_requests, 1u);
  for (int i = 1; i < 4; ++i) {
    EXPECT_EQ(f.outs[i]->batch_requests, 3u);
    EXPECT_EQ(f.outs[i]->batch_sequences, 3u);
  }
  for (int i = 0; i < 4; ++i) {
    Record(f.steps[i]);
    Verify(f.steps[i], *f.outs[i]);
  }
  EXPECT_EQ(sequences_->stats().launches(), 3u);  // the first verified step, the lone one, the joined three
}

TEST_F(SequencesTest, TwoLaunchesOfOneLayerRunAtOnceAndTheRestJoinTheNext) {
  SequenceOptions o;
  o.launches_in_flight = 2;
  Start(o);
  const std::vector<std::string> ids = Open(5);
  StepAndVerify(ids, {3, 3, 3, 3, 3}, 0);
  gate_->Gate();
  StepsInFlight f = StepEach(ids);
  // The first two launch at once, each alone; the three that arrive while both run wait for one of them.
  EXPECT_EQ(gate_->held_batch_sizes(), (std::vector<size_t>{1, 1}));
  EXPECT_EQ(sequences_->waiting(), 3u);
  gate_->Open();
  f.Await();
  for (int i = 0; i < 5; ++i) {
    ASSERT_TRUE(f.outs[i]->status.ok()) << i << ": " << f.outs[i]->status;
    EXPECT_EQ(f.outs[i]->batch_requests, i < 2 ? 1u : 3u) << i;
    Record(f.steps[i]);
    Verify(f.steps[i], *f.outs[i]);
  }
  EXPECT_EQ(sequences_->stats().launches(), 4u);  // the first verified step, the two alone, the joined three
  EXPECT_EQ(sequences_->limits().launches_in_flight(), 2u);
}

TEST_F(SequencesTest, ShutdownAnswersWaitingStepsAndRefusesNewOnes) {
  Start();
  const std::vector<std::string> ids = Open(2);
  gate_->Gate();
  absl::Notification a, b;
  absl::Status sa, sb;
  sequences_->Step("alice", MakeStep({ids[0]}, {2}, 0), Transport::kShm, CallFor(), [&](absl::Status s, StepJob*) {
    sa = s;
    a.Notify();
  });
  sequences_->Step("alice", MakeStep({ids[1]}, {2}, 0), Transport::kShm, CallFor(), [&](absl::Status s, StepJob*) {
    sb = s;
    b.Notify();
  });
  std::thread opener([&] {
    absl::SleepFor(absl::Milliseconds(50));
    gate_->Open();
  });
  sequences_->Shutdown();  // returns once both are answered
  EXPECT_TRUE(a.HasBeenNotified() && b.HasBeenNotified());
  EXPECT_TRUE(sa.ok()) << sa;
  EXPECT_TRUE(sb.ok()) << sb;
  opener.join();
  ExpectStatus(Run(MakeStep({ids[0]}, {1}, 0)).status, absl::StatusCode::kUnavailable, "the server is shutting down");
}

TEST_F(SequencesTest, BadStepsNameTheirField) {
  SequenceOptions o;
  o.max_pools = 2;
  Start(o);
  const std::vector<std::string> ids = Open(2);
  const std::vector<std::string> other = Open(1, "alice", 128);
  StepAndVerify(ids, {2, 2}, 0);
  struct Case {
    std::string name;
    std::function<void(v1::StepRequest&)> mutate;
    absl::StatusCode code;
    std::string field;
  };
  const std::vector<Case> cases = {
      {"no sequences", [](v1::StepRequest& r) { r.clear_sequences(); }, absl::StatusCode::kInvalidArgument,
       "sequences:"},
      {"layer too big", [](v1::StepRequest& r) { r.set_layer(kLayers); }, absl::StatusCode::kInvalidArgument,
       "layer:"},
      {"negative layer", [](v1::StepRequest& r) { r.set_layer(-1); }, absl::StatusCode::kInvalidArgument, "layer:"},
      {"q_heads not a multiple", [](v1::StepRequest& r) { r.set_q_heads(3); }, absl::StatusCode::kInvalidArgument,
       "q_heads:"},
      {"k without v", [](v1::StepRequest& r) { r.clear_v(); }, absl::StatusCode::kInvalidArgument, "v:"},
      {"nothing to do",
       [](v1::StepRequest& r) {
         r.clear_q();
         r.clear_k();
         r.clear_v();
       },
       absl::StatusCode::kInvalidArgument, "q:"},
      {"short q", [](v1::StepRequest& r) { r.mutable_q()->mutable_data()->pop_back(); },
       absl::StatusCode::kInvalidArgument, "q.data:"},
      {"long k", [](v1::StepRequest& r) { r.mutable_k()->mutable_data()->append("xx"); },
       absl::StatusCode::kInvalidArgument, "k.data:"},
      {"zero tokens", [](v1::StepRequest& r) { r.mutable_sequences(1)->set_tokens(0); },
       absl::StatusCode::kInvalidArgument, "sequences[1].tokens:"},
      {"duplicate", [&](v1::StepRequest& r) { r.mutable_sequences(1)->set_sequence_id(ids[0]); },
       absl::StatusCode::kInvalidArgument, "sequences[1].sequence_id:"},
      {"unknown id", [](v1::StepRequest& r) { r.mutable_sequences(1)->set_sequence_id("nope"); },
       absl::StatusCode::kNotFound, "sequences[1].sequence_id:"},
      {"shape mismatch", [&](v1::StepRequest& r) { r.mutable_sequences(1)->set_sequence_id(other[0]); },
       absl::StatusCode::kInvalidArgument, "sequences[1].sequence_id:"},
      {"infinite scale", [](v1::StepRequest& r) { r.set_softmax_scale(INFINITY); },
       absl::StatusCode::kInvalidArgument, "softmax_scale:"},
      {"o_ref without ipc", [](v1::StepRequest& r) { r.mutable_o_ref()->set_buffer_id("b"); },
       absl::StatusCode::kFailedPrecondition, "o_ref:"},
      {"attend past the cache",
       [](v1::StepRequest& r) {
         r.clear_k();
         r.clear_v();
         r.mutable_sequences(0)->set_tokens(3);
         r.mutable_q()->mutable_data()->append(std::string(kQHeads * kHeadDim * 2, '\1'));
       },
       absl::StatusCode::kInvalidArgument, "sequences[0].tokens:"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    v1::StepRequest r = MakeStep(ids, {1, 1}, 0);
    c.mutate(r);
    ExpectStatus(Run(r).status, c.code, c.field);
  }
  // Nothing leaked, nothing changed.
  EXPECT_EQ(Info(ids[0]).lengths(0), 2);
  EXPECT_FALSE(Info(ids[0]).step_in_flight());
  EXPECT_EQ(sequences_->stats().pages_used(), 2u);
  // Past the sequence's own max_tokens.
  v1::OpenSequenceRequest small;
  small.mutable_shape()->set_layers(kLayers);
  small.mutable_shape()->set_kv_heads(kKvHeads);
  small.mutable_shape()->set_head_dim(kHeadDim);
  small.mutable_shape()->set_dtype(v1::DTYPE_BF16);
  small.set_max_tokens(10);
  absl::StatusOr<v1::OpenSequenceResponse> s = sequences_->Open("alice", small);
  ASSERT_TRUE(s.ok());
  StepAndVerify({s->sequence_ids(0)}, {8}, 0);
  ExpectStatus(Run(MakeStep({s->sequence_ids(0)}, {3}, 0)).status, absl::StatusCode::kResourceExhausted,
               "sequences[0].tokens:");
}

TEST_F(SequencesTest, BadOpensNameTheirField) {
  Start();
  v1::OpenSequenceRequest r;
  r.mutable_shape()->set_layers(2);
  r.mutable_shape()->set_kv_heads(2);
  r.mutable_shape()->set_head_dim(96);
  r.mutable_shape()->set_dtype(v1::DTYPE_BF16);
  ExpectStatus(sequences_->Open("alice", r).status(), absl::StatusCode::kInvalidArgument, "shape.head_dim:");
  r.mutable_shape()->set_head_dim(64);
  // The dtype has no default: left unset (or misspelled by a JSON client, which reads as unset) it is refused,
  // as is a number that names no dtype.
  r.mutable_shape()->clear_dtype();
  absl::Status unset = sequences_->Open("alice", r).status();
  EXPECT_EQ(unset.code(), absl::StatusCode::kInvalidArgument) << unset;
  EXPECT_EQ(unset.message(), "shape.dtype: DTYPE_UNSPECIFIED (set DTYPE_BF16 or DTYPE_FP16)");
  r.mutable_shape()->set_dtype(static_cast<v1::Dtype>(7));
  ExpectStatus(sequences_->Open("alice", r).status(), absl::StatusCode::kInvalidArgument, "shape.dtype:");
  r.mutable_shape()->set_dtype(v1::DTYPE_BF16);
  r.mutable_shape()->set_layers(0);
  ExpectStatus(sequences_->Open("alice", r).status(), absl::StatusCode::kInvalidArgument, "shape.layers:");
  r.mutable_shape()->set_layers(2);
  r.set_max_tokens(1 << 30);
  ExpectStatus(sequences_->Open("alice", r).status(), absl::StatusCode::kResourceExhausted, "max_tokens:");
  r.set_max_tokens(0);
  r.set_count(100000);
  ExpectStatus(sequences_->Open("alice", r).status(), absl::StatusCode::kResourceExhausted, "count:");
  // A second shape while the first holds the only pool.
  r.set_count(1);
  ASSERT_TRUE(sequences_->Open("alice", r).ok());
  r.mutable_shape()->set_head_dim(128);
  ExpectStatus(sequences_->Open("alice", r).status(), absl::StatusCode::kResourceExhausted, "kv pool:");
}

}  // namespace
}  // namespace attnd
