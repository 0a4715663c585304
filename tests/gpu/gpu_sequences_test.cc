// GPU tests of the CUDA backend's KV sequences (server/cuda/src/sequence_runner.cc), driven directly through
// Backend::MakeKvPool / AcceptStep / SubmitSteps with hand-built StepJobs: this file plays the sequences core
// (page tables over a shuffled free list, forks sharing pages, copy-on-write copies) on a host model of every
// sequence's K/V per layer, and checks each step against the double-precision CPU reference.
//
// Each step: random inputs; O and LSE poisoned (CudaBackendHooks::poison_outputs, and NaN-filled registered O
// buffers); the whole pool NaN-filled when it is made, so a kernel that reads a row no step wrote, or a page
// through a wrong table entry, turns the output into NaN. Per sequence:
//   max|O - O_f64| <= kTolFactor * max|O_ref - O_f64| + kAtol, no NaN, |LSE - LSE_f64| <= kLseAtol
// where O_ref is the plain reference (fp32 math, O rounded once). At the end of a scenario the pool itself is
// read back: every cached row of every sequence, layer, K and V must equal the model's bytes exactly (appends
// landed on the right pages and copy-on-write copied every layer). Without a GPU the tests skip.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "attnd/half.h"
#include "attnd/problem.h"
#include "attnd/reference.h"
#include "attnd/server/backend.h"
#include "attnd/server/cuda_backend.h"
#include "attnd/server/step.h"
#include "cuda_device.h"
#include "gpu_sequences_util.h"
#include "gpu_test_util.h"

namespace attnd::server {
namespace {

using ::attnd::testing::HaveSupportedGpu;
using sequences_testing::Outcome;
using sequences_testing::Part;
using sequences_testing::RunBatch;
using sequences_testing::SequenceLife;
using sequences_testing::SequenceOps;
using sequences_testing::SharedBackend;
using sequences_testing::TestOptions;

constexpr double kTolFactor = 3.0;
constexpr double kAtol = 1e-3;
constexpr double kLseAtol = 2e-3;

// A shape whose cache holds K/V as `dtype`.
SequenceShape Shape16(int layers, int kv_heads, int head_dim, DType dtype) {
  SequenceShape s;
  s.layers = layers;
  s.kv_heads = kv_heads;
  s.head_dim = head_dim;
  s.dtype = dtype;
  return s;
}

struct Case {
  std::string name;
  int head_dim = 128;
  DType dtype = DType::kBF16;
  int kv_heads = 2;
  int group = 4;  // q_heads / kv_heads
  int layers = 2;
  int page_tokens = 16;
  bool lse = true;
  bool refs = false;  // q, k, v and O in device buffers instead of inline
  uint32_t seed = 1;
};
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

// The sequences core in miniature: page tables, forks, copy-on-write, lengths per layer, and the K/V rows each
// sequence holds per layer (the model the pool is checked against).
class Model {
 public:
  Model(const Case& c, int32_t num_pages, std::mt19937& rng)
      : c_(c), row_kv_(int64_t{c.kv_heads} * c.head_dim), rng_(rng), refs_(num_pages, 0) {
    free_.resize(num_pages);
    std::iota(free_.begin(), free_.end(), 0);
    std::shuffle(free_.begin(), free_.end(), rng_);  // sequences get scattered pages
  }

  struct Seq {
    std::vector<int32_t> pages;
    std::vector<int32_t> len;                 // per layer
    std::vector<std::vector<uint16_t>> k, v;  // per layer: [len, kv_heads, head_dim]
  };

  int Open() {
    Seq s;
    s.len.assign(c_.layers, 0);
    s.k.resize(c_.layers);
    s.v.resize(c_.layers);
    seqs_.push_back(std::move(s));
    return static_cast<int>(seqs_.size()) - 1;
  }
  // A child sharing every page of `parent`.
  int Fork(int parent) {
    seqs_.push_back(seqs_[parent]);
    for (int32_t p : seqs_.back().pages) ++refs_[p];
    return static_cast<int>(seqs_.size()) - 1;
  }
  Seq& seq(int i) { return seqs_[i]; }

  // The core's admission of one sequence's step at `layer`: pages for the new rows, copy-on-write of shared pages
  // they land in. Returns the StepSequence.
  StepSequence Admit(int i, int layer, int tokens, bool append, std::vector<PageCopy>* copies) {
    Seq& s = seqs_[i];
    StepSequence out;
    out.cached = s.len[layer];
    out.tokens = tokens;
    if (append) {
      const int64_t end = int64_t{s.len[layer]} + tokens;
      while (static_cast<int64_t>(s.pages.size()) * c_.page_tokens < end) {
        const int32_t p = Take();
        ++refs_[p];
        s.pages.push_back(p);
      }
      for (int64_t j = s.len[layer] / c_.page_tokens; j * c_.page_tokens < end; ++j) {
        int32_t& page = s.pages[j];
        if (refs_[page] > 1) {
          const int32_t fresh = Take();
          copies->push_back({page, fresh});
          --refs_[page];
          ++refs_[fresh];
          page = fresh;
        }
      }
    }
    out.pages = s.pages;
    return out;
  }
  void Commit(int i, int layer, const uint16_t* k, const uint16_t* v, int tokens) {
    Seq& s = seqs_[i];
    s.k[layer].insert(s.k[layer].end(), k, k + tokens * row_kv_);
    s.v[layer].insert(s.v[layer].end(), v, v + tokens * row_kv_);
    s.len[layer] += tokens;
  }

 private:
  int32_t Take() {
    EXPECT_FALSE(free_.empty()) << "the test's pool is too small";
    const int32_t p = free_.back();
    free_.pop_back();
    return p;
  }

  const Case c_;
  const int64_t row_kv_;
  std::mt19937& rng_;
  std::vector<int> refs_;
  std::vector<int32_t> free_;
  std::vector<Seq> seqs_;
};

class SequencesTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    if (!HaveSupportedGpu()) GTEST_SKIP() << "no CUDA device";
    backend_ = SharedBackend();
    ASSERT_NE(backend_, nullptr) << "the CUDA backend did not start";
    device_ = backend_->devices().front().index;
    c_ = GetParam();
    rng_.seed(c_.seed);
    shape_ = Shape16(c_.layers, c_.kv_heads, c_.head_dim, c_.dtype);
    absl::StatusOr<std::shared_ptr<KvPool>> pool = backend_->MakeKvPool(shape_, c_.page_tokens, kPages);
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = *pool;
    const uint64_t bytes = shape_.page_bytes(c_.page_tokens) * kPages;
    CUDA_OK(cudaSetDevice(device_));
    CUDA_OK(cudaMemset(cuda::KvPoolData(*pool_), 0xFF, bytes));  // NaN in bf16 and fp16
    CUDA_OK(cudaDeviceSynchronize());
    model_ = std::make_unique<Model>(c_, kPages, rng_);
  }
  void TearDown() override {
    for (void* p : device_buffers_) cudaFree(p);
  }

  std::vector<uint16_t> Random(int64_t n) {
    std::uniform_real_distribution<float> d(-1.f, 1.f);
    std::vector<uint16_t> out(n);
    for (uint16_t& x : out) x = FloatToHalf(c_.dtype, d(rng_));
    return out;
  }

  // A device copy of `host` (or NaN-filled `bytes` when host is null) as a resolved reference.
  TensorSource Ref(const void* host, uint64_t bytes) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, bytes), cudaSuccess);
    device_buffers_.push_back(p);
    if (host != nullptr) {
      EXPECT_EQ(cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice), cudaSuccess);
    } else {
      EXPECT_EQ(cudaMemset(p, 0xFF, bytes), cudaSuccess);
    }
    TensorSource s;
    s.buffer_id = "test-buffer";
    s.device_data = static_cast<uint8_t*>(p);
    s.device = device_;
    return s;
  }

  // One request of a step: its sequences (model indices) and their tokens.

  // Runs one batch of requests at `layer` and checks every output and the model against the reference.
  void Step(int layer, const std::vector<Part>& parts, bool append, bool attend, const std::string& what) {
    SCOPED_TRACE(what);
    const int q_heads = c_.kv_heads * c_.group;
    const int64_t row_q = int64_t{q_heads} * c_.head_dim, row_kv = int64_t{c_.kv_heads} * c_.head_dim;
    const float scale = DefaultScale(c_.head_dim);
    std::vector<std::unique_ptr<StepJob>> jobs;
    struct Inputs {
      std::vector<uint16_t> q, k, v;
    };
    std::vector<Inputs> inputs(parts.size());
    std::vector<std::vector<StepSequence>> admitted(parts.size());
    for (size_t j = 0; j < parts.size(); ++j) {
      const Part& part = parts[j];
      auto job = std::make_unique<StepJob>();
      job->request_id = absl::StrCat(what, "/", j);
      job->pool = pool_;
      job->layer = layer;
      job->q_heads = attend ? q_heads : 0;
      job->scale = scale;
      job->want_lse = attend && c_.lse;
      job->append = append;
      job->attend = attend;
      for (size_t i = 0; i < part.seqs.size(); ++i) {
        job->sequences.push_back(model_->Admit(part.seqs[i], layer, part.tokens[i], append, &job->copies));
        job->rows += part.tokens[i];
      }
      Inputs& in = inputs[j];
      if (attend) in.q = Random(job->rows * row_q);
      if (append) in.k = Random(job->rows * row_kv), in.v = Random(job->rows * row_kv);
      const auto bind = [&](const std::vector<uint16_t>& data, TensorSource* src) {
        if (data.empty()) return;
        if (c_.refs) {
          *src = Ref(data.data(), data.size() * 2);
        } else {
          src->host = reinterpret_cast<const uint8_t*>(data.data());
          src->host_bytes = data.size() * 2;
        }
      };
      bind(in.q, &job->q);
      bind(in.k, &job->k);
      bind(in.v, &job->v);
      if (attend && c_.refs) {
        job->o_to_buffer = true;
        job->o_ref = Ref(nullptr, job->rows * row_q * 2);
      }
      job->accepted = absl::Now();
      admitted[j] = job->sequences;
      ASSERT_TRUE(backend_->AcceptStep(*job).ok()) << backend_->AcceptStep(*job);
      jobs.push_back(std::move(job));
    }
    std::vector<TensorSource> o_refs;
    for (const auto& job : jobs) o_refs.push_back(job->o_ref);
    std::vector<Outcome> out = RunBatch(*backend_, std::move(jobs));
    ASSERT_EQ(out.size(), parts.size());
    size_t total_seqs = 0;
    for (const Part& p : parts) total_seqs += p.seqs.size();
    for (size_t j = 0; j < parts.size(); ++j) {
      ASSERT_TRUE(out[j].status.ok()) << "request " << j << ": " << out[j].status;
      EXPECT_EQ(out[j].calls, 1);
      EXPECT_EQ(out[j].batch_requests, parts.size());
      EXPECT_EQ(out[j].batch_sequences, total_seqs);
      EXPECT_FALSE(out[j].kernel.empty());
      EXPECT_GT(out[j].timing.kernel_us, 0);
      EXPECT_GE(out[j].timing.total_us, out[j].timing.kernel_us);
    }
    // The model takes the new rows (the core commits after an OK step).
    for (size_t j = 0; j < parts.size(); ++j) {
      int64_t row = 0;
      for (size_t i = 0; i < parts[j].seqs.size(); ++i) {
        const int t = parts[j].tokens[i];
        if (append) {
          model_->Commit(parts[j].seqs[i], layer, inputs[j].k.data() + row * row_kv, inputs[j].v.data() + row * row_kv,
                         t);
        }
        row += t;
      }
    }
    if (!attend) return;
    for (size_t j = 0; j < parts.size(); ++j) {
      const int64_t rows = std::accumulate(parts[j].tokens.begin(), parts[j].tokens.end(), int64_t{0});
      std::vector<uint16_t> o(rows * row_q);
      if (c_.refs) {
        ASSERT_TRUE(out[j].o.empty());
        CUDA_OK(cudaMemcpy(o.data(), o_refs[j].device_data, o.size() * 2, cudaMemcpyDeviceToHost));
      } else {
        ASSERT_EQ(out[j].o.size(), o.size() * 2);
        std::memcpy(o.data(), out[j].o.data(), out[j].o.size());
      }
      if (c_.lse) {
        ASSERT_EQ(out[j].lse.size(), static_cast<size_t>(rows * q_heads) * sizeof(float));
      } else {
        EXPECT_TRUE(out[j].lse.empty());
      }
      int64_t row = 0, lse_at = 0;
      for (size_t i = 0; i < parts[j].seqs.size(); ++i) {
        const int tokens = parts[j].tokens[i];
        const Model::Seq& s = model_->seq(parts[j].seqs[i]);
        const int64_t keys = admitted[j][i].keys(append);
        SCOPED_TRACE(absl::StrCat("request ", j, " sequence ", i, ": ", tokens, " tokens over ", keys, " keys"));
        Problem p;
        p.shape = Shape{1, tokens, keys, q_heads, c_.kv_heads, c_.head_dim};
        p.dtype = c_.dtype;
        p.mask = Mask::kCausalBottomRight;
        p.scale = scale;
        p.want_lse = true;
        const Layout layout = ContiguousLayout(p.shape);
        const uint16_t* q = inputs[j].q.data() + row * row_q;
        const uint16_t* k = s.k[layer].data();
        const uint16_t* v = s.v[layer].data();
        std::vector<uint16_t> o_ref(tokens * row_q);
        std::vector<float> lse_ref(tokens * q_heads);
        std::vector<double> o64(tokens * row_q), lse64(tokens * q_heads);
        ReferenceAttention(p, layout, q, k, v, o_ref.data(), lse_ref.data());
        ReferenceAttentionF64(p, layout, q, k, v, o64.data(), lse64.data());
        double err = 0, err_ref = 0;
        int64_t nans = 0;
        for (int64_t e = 0; e < tokens * row_q; ++e) {
          const double g = HalfToFloat(c_.dtype, o[row * row_q + e]);
          if (!std::isfinite(g)) {
            ++nans;
            continue;
          }
          err = std::max(err, std::abs(g - o64[e]));
          err_ref = std::max(err_ref, std::abs(HalfToFloat(c_.dtype, o_ref[e]) - o64[e]));
        }
        EXPECT_EQ(nans, 0) << "unwritten (poisoned) or non-finite O";
        EXPECT_LE(err, kTolFactor * err_ref + kAtol) << "reference error " << err_ref;
        if (c_.lse) {
          const float* lse = reinterpret_cast<const float*>(out[j].lse.data()) + lse_at;
          double lse_err = 0;
          for (int64_t e = 0; e < tokens * q_heads; ++e) {
            lse_err = std::isfinite(lse[e]) ? std::max(lse_err, std::abs(lse[e] - lse64[e])) : 1e30;
          }
          EXPECT_LE(lse_err, kLseAtol) << "LSE ([q_heads, tokens] per sequence)";
        }
        row += tokens;
        lse_at += int64_t{tokens} * q_heads;
      }
    }
  }

  // Every cached row of every sequence, at every layer, K and V, equals the model's.
  void CheckPool() {
    const uint64_t bytes = shape_.page_bytes(c_.page_tokens) * kPages;
    std::vector<uint16_t> pool(bytes / 2);
    CUDA_OK(cudaMemcpy(pool.data(), cuda::KvPoolData(*pool_), bytes, cudaMemcpyDeviceToHost));
    const int64_t row_kv = int64_t{c_.kv_heads} * c_.head_dim;
    const int64_t page_elems = shape_.page_elems(c_.page_tokens);
    int64_t checked = 0, wrong = 0;
    for (int i = 0;; ++i) {
      // The model has no count accessor: sequences are opened densely from 0.
      if (i >= seqs_opened_) break;
      const Model::Seq& s = model_->seq(i);
      for (int layer = 0; layer < c_.layers; ++layer) {
        for (int kv = 0; kv < 2; ++kv) {
          const uint16_t* base = pool.data() + pool_->pool_offset(layer, kv);
          const std::vector<uint16_t>& rows = kv == 0 ? s.k[layer] : s.v[layer];
          for (int32_t t = 0; t < s.len[layer]; ++t) {
            const uint16_t* got = base + int64_t{s.pages[t / c_.page_tokens]} * page_elems +
                                  int64_t{t % c_.page_tokens} * row_kv;
            wrong += std::memcmp(got, rows.data() + t * row_kv, row_kv * 2) != 0;
            ++checked;
          }
        }
      }
    }
    EXPECT_GT(checked, 0);
    EXPECT_EQ(wrong, 0) << "of " << checked << " cached rows differ from what was appended";
  }

  // What moving a sequence copies (Backend::CopyKvRows, WriteKvRows): every layer's K and V rows of sequence `i`
  // read out as the model has them, from token 0 and from a token inside a page; random rows written over part of
  // one layer from pieces that cut rows anywhere (a received message's slices) read back as written; then the
  // model's rows written back (CheckPool after this sees them).
  void CheckMovingRows(int i) {
    const Model::Seq& s = model_->seq(i);
    const int64_t row = int64_t{c_.kv_heads} * c_.head_dim;
    for (int layer = 0; layer < c_.layers; ++layer) {
      for (int kv = 0; kv < 2; ++kv) {
        const std::vector<uint16_t>& want = kv == 0 ? s.k[layer] : s.v[layer];
        for (int32_t first : {0, 5}) {
          const int32_t rows = s.len[layer] - first;
          ASSERT_GT(rows, c_.page_tokens);
          std::vector<uint16_t> got(rows * row, 0xFFFF);
          absl::Status st = backend_->CopyKvRows(*pool_, s.pages, layer, kv, first, rows, true,
                                                 reinterpret_cast<uint8_t*>(got.data()));
          ASSERT_TRUE(st.ok()) << st;
          EXPECT_TRUE(std::equal(got.begin(), got.end(), want.begin() + first * row))
              << "layer " << layer << " kv " << kv << " from token " << first;
        }
      }
    }
    const int32_t first = 3, rows = c_.page_tokens + 7;
    std::vector<uint16_t> noise(rows * row), back(rows * row);
    for (uint16_t& x : noise) x = static_cast<uint16_t>(rng_() & 0x3FFF);
    const auto* noise_bytes = reinterpret_cast<const uint8_t*>(noise.data());
    const size_t noise_size = noise.size() * sizeof(uint16_t);
    std::vector<absl::Span<const uint8_t>> pieces;
    for (size_t at = 0, cut = 1; at < noise_size; at += cut, cut = cut * 3 + 1) {
      pieces.emplace_back(noise_bytes + at, std::min(cut, noise_size - at));
    }
    ASSERT_TRUE(backend_->WriteKvRows(*pool_, s.pages, 0, 1, first, rows, pieces).ok());
    ASSERT_TRUE(backend_->CopyKvRows(*pool_, s.pages, 0, 1, first, rows, true,
                                     reinterpret_cast<uint8_t*>(back.data())).ok());
    EXPECT_EQ(back, noise);
    std::vector<uint16_t> original(s.v[0].begin() + first * row, s.v[0].begin() + (first + rows) * row);
    ASSERT_TRUE(backend_->CopyKvRows(*pool_, s.pages, 0, 1, first, rows, false,
                                     reinterpret_cast<uint8_t*>(original.data())).ok());
  }

  int Open() {
    ++seqs_opened_;
    return model_->Open();
  }
  int Fork(int parent) {
    ++seqs_opened_;
    return model_->Fork(parent);
  }

  static constexpr int32_t kPages = 512;
  Case c_;
  Backend* backend_ = nullptr;
  int device_ = 0;
  std::mt19937 rng_;
  SequenceShape shape_;
  std::shared_ptr<KvPool> pool_;
  std::unique_ptr<Model> model_;
  int seqs_opened_ = 0;
  std::vector<void*> device_buffers_;
};

// The life of a few sequences (SequenceLife), then the pool and a moved sequence's rows read back.
TEST_P(SequencesTest, PrefillForkDecodeChunkReattend) {
  const SequenceOps ops{[this] { return Open(); }, [this](int parent) { return Fork(parent); },
                        [this](int layer, const std::vector<Part>& parts, bool append, bool attend,
                               const std::string& what) { Step(layer, parts, append, attend, what); }};
  const int a2 = SequenceLife(c_.layers, ops);
  CheckPool();
  CheckMovingRows(a2);
  CheckPool();
}

std::vector<Case> Cases() {
  std::vector<Case> out;
  uint32_t seed = 7;
  for (int hd : {64, 128, 256}) {
    for (DType dt : {DType::kBF16, DType::kFP16}) {
      for (int group : {1, 4, 8}) {
        Case c;
        c.head_dim = hd;
        c.dtype = dt;
        c.group = group;
        c.kv_heads = group == 8 ? 1 : 2;
        c.lse = group != 1;  // some cases without LSE
        c.seed = seed++;
        c.name = absl::StrCat("d", hd, "_", DTypeName(dt), "_g", group, c.lse ? "_lse" : "");
        out.push_back(c);
      }
    }
  }
  Case refs;
  refs.name = "d128_bf16_g4_refs";
  refs.refs = true;
  refs.seed = 99;
  out.push_back(refs);
  Case pages64;
  pages64.name = "d128_fp16_g4_page64_layers3";
  pages64.dtype = DType::kFP16;
  pages64.page_tokens = 64;
  pages64.layers = 3;
  pages64.seed = 100;
  out.push_back(pages64);
  return out;
}

INSTANTIATE_TEST_SUITE_P(Steps, SequencesTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.name; });

// A job whose caller went away, whose deadline passed or whose registered buffer resolved onto another device is
// answered without running; the batch's other jobs run.
TEST(SequencesBackendTest, CancelledAndExpiredJobsAnsweredTheOthersRun) {
  if (!HaveSupportedGpu()) GTEST_SKIP() << "no CUDA device";
  Backend* backend = SharedBackend();
  ASSERT_NE(backend, nullptr);
  const SequenceShape shape = Shape16(1, 2, 128, DType::kBF16);
  absl::StatusOr<std::shared_ptr<KvPool>> pool = backend->MakeKvPool(shape, 16, 8);
  ASSERT_TRUE(pool.ok()) << pool.status();
  std::vector<uint16_t> q(8 * 128, 0x3f80), kv(2 * 128, 0x3f80);  // 1.0 in bf16
  std::vector<std::unique_ptr<StepJob>> jobs;
  const std::vector<int32_t> tables = {0, 1, 2, 3};  // sequence i's one page: i (outlives the jobs)
  for (int i = 0; i < 4; ++i) {
    auto job = std::make_unique<StepJob>();
    job->pool = *pool;
    job->q_heads = 8;
    job->scale = DefaultScale(128);
    job->append = job->attend = true;
    job->sequences.push_back(StepSequence{0, 1, absl::MakeConstSpan(&tables[i], 1)});
    job->rows = 1;
    job->q.host = reinterpret_cast<const uint8_t*>(q.data());
    job->q.host_bytes = q.size() * 2;
    job->k.host = job->v.host = reinterpret_cast<const uint8_t*>(kv.data());
    job->k.host_bytes = job->v.host_bytes = kv.size() * 2;
    job->accepted = absl::Now();
    jobs.push_back(std::move(job));
  }
  jobs[0]->cancelled = [] { return true; };
  jobs[1]->deadline = absl::Now() - absl::Seconds(1);
  alignas(16) static uint8_t elsewhere[8 * 128 * 2];
  jobs[3]->q = TensorSource{};
  jobs[3]->q.buffer_id = "elsewhere";
  jobs[3]->q.device_data = elsewhere;
  jobs[3]->q.device = 97;
  std::vector<Outcome> out = RunBatch(*backend, std::move(jobs));
  ASSERT_EQ(out.size(), 4u);
  EXPECT_EQ(out[0].status.code(), absl::StatusCode::kCancelled) << out[0].status;
  EXPECT_EQ(out[1].status.code(), absl::StatusCode::kDeadlineExceeded) << out[1].status;
  EXPECT_EQ(out[3].status.code(), absl::StatusCode::kInvalidArgument) << out[3].status;
  ASSERT_TRUE(out[2].status.ok()) << out[2].status;
  EXPECT_EQ(out[2].batch_requests, 1u);
  // One key of all ones, values all ones: O is exactly 1.
  ASSERT_EQ(out[2].o.size(), q.size() * 2);
  const auto* o = reinterpret_cast<const uint16_t*>(out[2].o.data());
  for (size_t i = 0; i < q.size(); ++i) ASSERT_EQ(o[i], 0x3f80) << i;
}

TEST(SequencesBackendTest, BadPoolsAndStepsAreRefusedNamingTheField) {
  if (!HaveSupportedGpu()) GTEST_SKIP() << "no CUDA device";
  Backend* backend = SharedBackend();
  ASSERT_NE(backend, nullptr);
  absl::StatusOr<std::shared_ptr<KvPool>> bad = backend->MakeKvPool(Shape16(1, 2, 96, DType::kBF16), 16, 8);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("head_dim"), std::string::npos) << bad.status();
  bad = backend->MakeKvPool(Shape16(1, 2, 128, DType::kBF16), 24, 8);
  EXPECT_NE(bad.status().message().find("page_tokens"), std::string::npos) << bad.status();
  // Over the device budget (TestOptions: 4 GiB): RESOURCE_EXHAUSTED naming the pool.
  bad = backend->MakeKvPool(Shape16(32, 8, 128, DType::kBF16), 16, 8192);  // 16 GiB
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(bad.status().message().find("KV page pool"), std::string::npos) << bad.status();
  // Float8: a descale per layer and kv head, else INVALID_ARGUMENT naming them.
  SequenceShape fp8 = Shape16(2, 2, 128, DType::kBF16);
  fp8.kv_format = KvFormat::kFp8E4M3;
  fp8.k_descale = {0.5f, 0.25f, 0.125f};
  fp8.v_descale = {1.f, 2.f, 3.f, 4.f};
  bad = backend->MakeKvPool(fp8, 16, 8);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("descale"), std::string::npos) << bad.status();
  // Its pages take half a 16-bit pool's bytes: 5 GiB of bf16 exceed the budget, the same pages in float8 fit. Its
  // descales are on the device, one layer's [kv_heads] slice a launch.
  fp8.k_descale.push_back(0.0625f);
  const SequenceShape big16 = Shape16(32, 8, 128, DType::kBF16);
  SequenceShape big8 = big16;
  big8.kv_format = KvFormat::kFp8E4M3;
  big8.k_descale.assign(32 * 8, 0.5f);
  big8.v_descale.assign(32 * 8, 0.25f);
  EXPECT_EQ(backend->MakeKvPool(big16, 16, 2560).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(backend->MakeKvPool(big8, 16, 2560).ok());
  absl::StatusOr<std::shared_ptr<KvPool>> fp8_pool = backend->MakeKvPool(fp8, 16, 8);
  ASSERT_TRUE(fp8_pool.ok()) << fp8_pool.status();
  const auto& cuda_pool = dynamic_cast<const cuda::CudaKvPool&>(**fp8_pool);
  EXPECT_EQ(cuda_pool.pool(1, 0) - cuda_pool.pool(0, 0), 2 * 8 * fp8.page_elems(16));  // one byte an element
  for (int layer = 0; layer < 2; ++layer) {
    float got[4];
    CUDA_OK(cudaMemcpy(got, cuda_pool.k_descale(layer), 2 * sizeof(float), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(got + 2, cuda_pool.v_descale(layer), 2 * sizeof(float), cudaMemcpyDeviceToHost));
    for (int h = 0; h < 2; ++h) {
      EXPECT_EQ(got[h], fp8.k_descale[layer * 2 + h]) << "layer " << layer << " head " << h;
      EXPECT_EQ(got[2 + h], fp8.v_descale[layer * 2 + h]) << "layer " << layer << " head " << h;
    }
  }

  absl::StatusOr<std::shared_ptr<KvPool>> pool = backend->MakeKvPool(Shape16(1, 2, 128, DType::kBF16), 16, 8);
  ASSERT_TRUE(pool.ok()) << pool.status();
  StepJob job;
  job.pool = *pool;
  job.q_heads = 4;
  job.scale = 0.1f;
  job.attend = true;
  const int32_t table[1] = {0};
  job.sequences.push_back(StepSequence{4, 1, table});
  job.rows = 1;
  alignas(16) static uint8_t buffer[64];
  job.q.buffer_id = "elsewhere";
  job.q.device_data = buffer;
  job.q.device = 97;
  absl::Status st = backend->AcceptStep(job);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("q:"), std::string::npos) << st;
  job.q.device = backend->devices().front().index;
  job.q.device_data = buffer + 2;
  st = backend->AcceptStep(job);
  EXPECT_NE(st.message().find("aligned"), std::string::npos) << st;
}

// Shutdown answers every accepted batch: each job's done exactly once, and later batches are refused.
TEST(SequencesBackendTest, ShutdownAnswersEveryAcceptedJobOnce) {
  if (!HaveSupportedGpu()) GTEST_SKIP() << "no CUDA device";
  BackendOptions options = TestOptions();
  options.streams_per_device = 1;
  absl::StatusOr<std::unique_ptr<Backend>> backend = MakeCudaBackend(options);
  ASSERT_TRUE(backend.ok()) << backend.status();
  absl::StatusOr<std::shared_ptr<KvPool>> pool =
      (*backend)->MakeKvPool(Shape16(2, 2, 64, DType::kFP16), 16, 64);
  ASSERT_TRUE(pool.ok()) << pool.status();
  std::vector<uint16_t> q(4 * 64 * 4, 0x3c00), kv(2 * 64 * 4, 0x3c00);  // 1.0 in fp16
  absl::Mutex mu;
  std::vector<int> calls(32, 0);
  int submitted = 0;
  std::vector<int32_t> tables(64);  // sequence i's one page: i (outlives the jobs)
  for (int i = 0; i < 64; ++i) tables[i] = i;
  for (int i = 0; i < 32; ++i) {
    auto batch = std::make_unique<StepBatch>();
    auto job = std::make_unique<StepJob>();
    job->pool = *pool;
    job->layer = i % 2;
    job->q_heads = 4;
    job->scale = DefaultScale(64);
    job->append = job->attend = true;
    job->sequences.push_back(StepSequence{0, 4, absl::MakeConstSpan(&tables[i % 64], 1)});
    job->rows = 4;
    job->q.host = reinterpret_cast<const uint8_t*>(q.data());
    job->q.host_bytes = q.size() * 2;
    job->k.host = job->v.host = reinterpret_cast<const uint8_t*>(kv.data());
    job->k.host_bytes = job->v.host_bytes = kv.size() * 2;
    job->accepted = absl::Now();
    job->done = [&mu, &calls, i](absl::Status) {
      absl::MutexLock lock(&mu);
      ++calls[i];
    };
    batch->jobs.push_back(std::move(job));
    if ((*backend)->SubmitSteps(std::move(batch)).ok()) ++submitted;
  }
  (*backend)->Shutdown();
  {
    absl::MutexLock lock(&mu);
    int answered = 0;
    for (int c : calls) {
      EXPECT_LE(c, 1);
      answered += c;
    }
    EXPECT_EQ(answered, submitted);
  }
  auto late = std::make_unique<StepBatch>();
  late->jobs.push_back(std::make_unique<StepJob>());
  late->jobs.back()->pool = *pool;
  EXPECT_EQ((*backend)->SubmitSteps(std::move(late)).code(), absl::StatusCode::kUnavailable);
  pool->reset();  // the pool's memory goes back to a backend that has stopped: still valid
}

}  // namespace
}  // namespace attnd::server
