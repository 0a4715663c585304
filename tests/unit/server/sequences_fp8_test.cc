// Float8 KV caches in the sequence core on the CPU backend: every step's O and LSE checked against the double
// reference over the history as the cache holds it (each row quantized with its layer's and kv head's descale, then
// read back), the stored codes read out of the pages, the pool's halved bytes, moves, forks, and bad shapes.
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnd/fp8.h"
#include "gtest/gtest.h"
#include "sequences_fixture.h"

namespace attnd::sequences_test {
namespace {

class Fp8SequencesTest : public SequencesTest {
 protected:
  // A different descale for every layer and kv head, so that a step reading another layer's or head's would fail.
  void UseFloat8() {
    k_descale_.clear();
    v_descale_.clear();
    for (int i = 0; i < kLayers * kKvHeads; ++i) {
      k_descale_.push_back(0.004f * static_cast<float>(i + 1));
      v_descale_.push_back(0.003f * static_cast<float>(2 * i + 1));
    }
  }
};

TEST_F(Fp8SequencesTest, StepsSeeTheQuantizedHistoryAtEveryLayer) {
  for (v1::Dtype dt : {v1::DTYPE_BF16, v1::DTYPE_FP16}) {
    for (int hd : {64, 128}) {
      SCOPED_TRACE(absl::StrCat("hd ", hd, " dtype ", dt));
      Start();
      UseFloat8();
      head_dim_ = hd;
      dtype_ = dt == v1::DTYPE_FP16 ? DType::kFP16 : DType::kBF16;
      const std::vector<std::string> ids = Open(2, "alice", hd, dt);
      ASSERT_EQ(ids.size(), 2u);
      // Prefill chunks (one past a page), decode steps, a ragged batch; large logits and outliers in one chunk.
      for (int layer = 0; layer < kLayers; ++layer) StepAndVerify(ids, {37, 5}, layer, /*hard=*/layer == 1);
      for (int step = 0; step < 2; ++step) {
        for (int layer = 0; layer < kLayers; ++layer) StepAndVerify(ids, {1, 1}, layer);
      }
      StepAndVerify(ids, {4, 17}, 2);
      TearDown();
      gate_ = nullptr;
      history_.clear();
    }
  }
  sequences_.reset();
  backend_.reset();
}

TEST_F(Fp8SequencesTest, PagesHoldCodesAndMovesAndForksKeepThem) {
  Start();
  UseFloat8();
  const std::vector<std::string> ids = Open(1);
  for (int layer = 0; layer < kLayers; ++layer) StepAndVerify(ids, {20 + layer}, layer);
  // The shape reads back as opened, descales spread to one per layer and kv head.
  v1::GetSequenceRequest g;
  g.set_sequence_id(ids[0]);
  const absl::StatusOr<v1::SequenceInfo> info = sequences_->Get("alice", g);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->shape().kv_dtype(), v1::DTYPE_FP8_E4M3);
  EXPECT_EQ(std::vector<float>(info->shape().k_descale().begin(), info->shape().k_descale().end()), k_descale_);
  EXPECT_EQ(std::vector<float>(info->shape().v_descale().begin(), info->shape().v_descale().end()), v_descale_);

  // The pages hold one byte per element: the e4m3 code of x / descale of the row's layer and kv head.
  Sequences* core = sequences_->core();
  absl::StatusOr<server::MovingSequence> held = core->BeginExport("alice", ids[0]);
  ASSERT_TRUE(held.ok()) << held.status();
  ASSERT_EQ(held->row_bytes(), static_cast<uint64_t>(kKvHeads * head_dim_));
  const int layer = 2;
  std::string codes(held->lengths[layer] * held->row_bytes(), '\0');
  ASSERT_TRUE(core->ReadRows(*held, layer, 0, 0, held->lengths[layer], reinterpret_cast<uint8_t*>(codes.data()))
                  .ok());
  const std::string& cached = history_[ids[0]].k[layer];  // already read back: code x descale in bf16
  int64_t wrong = 0;
  for (size_t i = 0; i < codes.size(); ++i) {
    const float d = k_descale_[layer * kKvHeads + (i / head_dim_) % kKvHeads];
    const float want = HalfToFloat(dtype_, reinterpret_cast<const uint16_t*>(cached.data())[i]);
    const float got = HalfToFloat(dtype_, FloatToHalf(dtype_, Fp8E4M3ToFloat(static_cast<uint8_t>(codes[i])) * d));
    wrong += got != want;
  }
  EXPECT_EQ(wrong, 0);

  // Imported elsewhere with the same shape, the codes step on as they were.
  server::ImportArgs header;
  header.open.layers = kLayers, header.open.kv_heads = kKvHeads, header.open.head_dim = head_dim_;
  header.open.dtype = dtype_;
  header.open.kv_format = KvFormat::kFp8E4M3;
  header.open.k_descale = k_descale_;
  header.open.v_descale = v_descale_;
  header.lengths = held->lengths;
  absl::StatusOr<server::MovingSequence> in = core->BeginImport("carol", header);
  ASSERT_TRUE(in.ok()) << in.status();
  EXPECT_EQ(in->shape, held->shape);
  for (int l = 0; l < kLayers; ++l) {
    for (int kv = 0; kv < 2; ++kv) {
      std::string rows(held->lengths[l] * held->row_bytes(), '\0');
      ASSERT_TRUE(core->ReadRows(*held, l, kv, 0, held->lengths[l], reinterpret_cast<uint8_t*>(rows.data())).ok());
      ASSERT_TRUE(
          core->WriteRows(*in, l, kv, 0, held->lengths[l], reinterpret_cast<const uint8_t*>(rows.data())).ok());
    }
  }
  core->EndExport(*held);
  ASSERT_TRUE(core->EndImport(*in, true).ok());
  history_[in->sequence_id] = history_[ids[0]];
  for (int l = 0; l < kLayers; ++l) StepAndVerify({in->sequence_id}, {3}, l, false, "carol");

  // A fork shares the pages; both go on from the same codes.
  v1::ForkSequenceRequest fr;
  fr.set_sequence_id(ids[0]);
  absl::StatusOr<v1::ForkSequenceResponse> forked = sequences_->Fork("alice", fr);
  ASSERT_TRUE(forked.ok()) << forked.status();
  history_[forked->sequence_ids(0)] = history_[ids[0]];
  for (int l = 0; l < kLayers; ++l) StepAndVerify({ids[0], forked->sequence_ids(0)}, {2, 1}, l);
}

TEST_F(Fp8SequencesTest, AFloat8PoolHoldsTwiceThePages) {
  SequenceOptions options;
  options.pool_bytes = 8ull << 20;
  Start(options);
  Open(1);
  const uint64_t bf16_pages = sequences_->stats().pages_free() + sequences_->stats().pages_used();
  TearDown();
  Start(options);
  UseFloat8();
  Open(1);
  const uint64_t fp8_pages = sequences_->stats().pages_free() + sequences_->stats().pages_used();
  EXPECT_EQ(fp8_pages, 2 * bf16_pages);
}

TEST_F(Fp8SequencesTest, BadFloat8ShapesNameTheirField) {
  Start();
  v1::OpenSequenceRequest r;
  v1::SequenceShape* s = r.mutable_shape();
  s->set_layers(2);
  s->set_kv_heads(3);
  s->set_head_dim(64);
  s->set_dtype(v1::DTYPE_BF16);
  const auto refused = [&](const std::string& prefix) {
    ExpectStatus(sequences_->Open("alice", r).status(), absl::StatusCode::kInvalidArgument, prefix);
  };
  s->set_kv_dtype(v1::DTYPE_FP8_E4M3);
  refused("shape.k_descale: 0 values");
  s->add_k_descale(0.5f);
  refused("shape.v_descale: 0 values");
  for (int i = 0; i < 4; ++i) s->add_v_descale(0.5f);  // neither 1, 2 (layers) nor 6 (layers x kv_heads)
  refused("shape.v_descale: 4 values");
  s->clear_v_descale();
  s->add_v_descale(0.5f);
  s->add_v_descale(std::numeric_limits<float>::infinity());
  refused("shape.v_descale[1]:");
  s->set_v_descale(1, 0.f);
  refused("shape.v_descale[1]:");
  s->set_v_descale(1, -1.f);
  refused("shape.v_descale[1]:");
  s->set_v_descale(1, std::nanf(""));
  refused("shape.v_descale[1]:");
  s->set_v_descale(1, 0.25f);  // one per layer
  ASSERT_TRUE(sequences_->Open("alice", r).ok());
  // Float8 only as the cache's dtype; a 16-bit kv_dtype must be the dtype; descales only for float8.
  s->set_dtype(v1::DTYPE_FP8_E4M3);
  refused("shape.dtype: DTYPE_FP8_E4M3 is served as a sequence's shape.kv_dtype and as a Forward's dtype, not here");
  s->set_dtype(v1::DTYPE_BF16);
  s->set_kv_dtype(v1::DTYPE_FP16);
  refused("shape.kv_dtype: DTYPE_FP16 is neither shape.dtype nor DTYPE_FP8_E4M3");
  s->set_kv_dtype(v1::DTYPE_UNSPECIFIED);
  refused("shape.kv_dtype: DTYPE_UNSPECIFIED");
  s->set_kv_dtype(v1::DTYPE_BF16);
  refused("shape.k_descale: given for a 16-bit cache");
  s->clear_kv_dtype();
  s->clear_k_descale();
  refused("shape.v_descale: given for a 16-bit cache");
  // A shape no pool can hold is refused before its descales are looked at (and spread to layers x kv_heads values,
  // 16.7 million here): the page check comes first, so the descales' count (2: neither 1 nor layers) is not reached.
  s->clear_v_descale();
  s->set_kv_dtype(v1::DTYPE_FP8_E4M3);
  s->add_k_descale(1.f);
  s->add_k_descale(1.f);
  s->add_v_descale(1.f);
  s->set_layers(4096);
  s->set_kv_heads(4096);
  ExpectStatus(sequences_->Open("alice", r).status(), absl::StatusCode::kResourceExhausted, "kv pool: one page of");
}

}  // namespace
}  // namespace attnd::sequences_test
