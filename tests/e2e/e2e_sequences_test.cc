// KV sequences end to end through the client library against an in-process CPU-backend server, over gRPC on a
// loopback port (StepStream, and the unary Step), on the unix socket and over the shared-memory channel's Step
// frames: every step's O and LSE
// checked against the double-precision reference of the whole history this test keeps, forks (and forks of
// forks) diverging from their parents, truncation, closing, the statuses of bad input, and '@address' pinning.
#include <sys/wait.h>

#include <atomic>
#include <cstdio>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "attnd/client/bench.h"
#include "attnd/client/shm_channel.h"
#include "e2e_util.h"
#include "gated_backend.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"

#ifndef ATTN_BINARY
#error "ATTN_BINARY (path of the built attn) must be defined by the build"
#endif

namespace attnd::e2e {
namespace {

// kTcp and kUnix step over StepStream (the client's default), kTcpUnary over the unary Step RPC.
enum class Via { kTcp, kTcpUnary, kUnix, kShm };
const char* ViaName(Via v) {
  switch (v) {
    case Via::kTcp:
      return "tcp";
    case Via::kTcpUnary:
      return "tcp_unary";
    case Via::kUnix:
      return "unix";
    case Via::kShm:
      return "shm";
  }
  return "?";
}
client::Transport StepTransport(Via v) {
  return v == Via::kShm ? client::Transport::kShm
                        : v == Via::kTcpUnary ? client::Transport::kUnary : client::Transport::kStream;
}

// One sequence as the client knows it: the K and V rows it sent, per layer.
struct History {
  std::vector<std::string> k, v;
  explicit History(int64_t layers) : k(layers), v(layers) {}
};

client::SequenceShape TestShape(int64_t layers = 2) {
  client::SequenceShape s;
  s.layers = layers;
  s.kv_heads = 2;
  s.head_dim = 64;
  return s;
}
constexpr int64_t kQHeads = 4;

// Empty when `o` (and `lse`) are causal attention of q's `tokens` rows over the cached `k`/`v`; else why not.
std::string CheckRows(const client::SequenceShape& shape, int64_t q_heads, const std::string& q, const std::string& k,
                      const std::string& v, std::string_view o, std::string_view lse, bool want_lse) {
  const int64_t row = q_heads * shape.head_dim * 2, kv_row = shape.kv_heads * shape.head_dim * 2;
  Problem p;
  p.shape = Shape{1, static_cast<int64_t>(q.size()) / row, static_cast<int64_t>(k.size()) / kv_row, q_heads,
                  shape.kv_heads, shape.head_dim};
  p.dtype = shape.dtype;
  p.mask = Mask::kCausalBottomRight;
  p.scale = DefaultScale(shape.head_dim);
  p.want_lse = want_lse;
  auto oracle = client::Oracle::Compute(p, q, k, v);
  if (!oracle.ok()) return oracle.status().ToString();
  const client::VerifyReport r = oracle->Check(o, lse);
  return r.pass ? "" : r.detail;
}

class SequencesTest : public ::testing::TestWithParam<Via> {
 protected:
  static void SetUpTestSuite() {
    server_ = new TestServer;
    StartServer(server_, 64ull << 20, /*threads=*/2, /*max_queue=*/256, /*shm=*/true);
  }
  static void TearDownTestSuite() {
    if (server_->server) server_->server->Shutdown();
    delete server_;
    server_ = nullptr;
  }

  void SetUp() override {
    ASSERT_NE(server_->server, nullptr);
    client::ClientOptions o;
    // The shm channel's caller is "local", as the unix socket's is: it opens its sequences there.
    o.target = server_->Target(GetParam() == Via::kTcp || GetParam() == Via::kTcpUnary ? Listener::kTcp
                                                                                        : Listener::kUnix);
    o.transport = GetParam() == Via::kShm       ? client::Transport::kShm
                  : GetParam() == Via::kTcpUnary ? client::Transport::kUnary
                                                 : client::Transport::kAuto;
    o.shm_socket = server_->shm_path;
    o.default_deadline = absl::Seconds(60);
    auto c = client::Client::Create(o);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = *std::move(c);
  }

  std::vector<std::string> Open(const client::SequenceShape& shape, uint32_t count = 1) {
    auto opened = client_->OpenSequence(shape, 0, count);
    EXPECT_TRUE(opened.ok()) << opened.status();
    if (!opened.ok()) return {};
    EXPECT_EQ(opened->ids.size(), count);
    EXPECT_GT(opened->page_tokens, 0);
    EXPECT_GT(opened->max_tokens, 0);
    return opened->ids;
  }

  // Appends `tokens` random rows to `id` at `layer` and attends; checks the reply against `h` (which it extends).
  void StepAndCheck(const std::string& id, History& h, const client::SequenceShape& shape, int64_t layer,
                    int64_t tokens, bool lse, uint64_t seed) {
    SCOPED_TRACE(absl::StrCat("layer ", layer, ", ", tokens, " tokens, seed ", seed));
    const std::string q = client::RandomTensor(shape.dtype, tokens * kQHeads * shape.head_dim, seed * 3);
    const std::string k = client::RandomTensor(shape.dtype, tokens * shape.kv_heads * shape.head_dim, seed * 3 + 1);
    const std::string v = client::RandomTensor(shape.dtype, tokens * shape.kv_heads * shape.head_dim, seed * 3 + 2);
    client::StepSpec spec;
    spec.sequences = {{id, tokens}};
    spec.layer = layer;
    spec.q_heads = kQHeads;
    spec.want_lse = lse;
    spec.q.data = q;
    spec.k.data = k;
    spec.v.data = v;
    auto r = client_->Step(spec);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->transport, StepTransport(GetParam()));
    EXPECT_EQ(r->backend, "cpu");
    h.k[layer] += k;
    h.v[layer] += v;
    const int64_t keys = static_cast<int64_t>(h.k[layer].size()) / (shape.kv_heads * shape.head_dim * 2);
    ASSERT_EQ(r->lengths.size(), 1u);
    EXPECT_EQ(r->lengths[0], keys);
    EXPECT_GE(r->timing.batch_sequences(), 1u);
    EXPECT_EQ(CheckRows(shape, kQHeads, q, h.k[layer], h.v[layer], r->o, r->lse, lse), "");
  }

  static inline TestServer* server_ = nullptr;
  std::unique_ptr<client::Client> client_;
};

TEST_P(SequencesTest, PrefillThenDecodeMatchesTheReferenceOverTheWholeHistory) {
  const client::SequenceShape shape = TestShape();
  const std::vector<std::string> ids = Open(shape);
  ASSERT_EQ(ids.size(), 1u);
  History h(shape.layers);
  uint64_t seed = 1;
  for (int64_t layer = 0; layer < shape.layers; ++layer) StepAndCheck(ids[0], h, shape, layer, 37, true, ++seed);
  for (int step = 0; step < 4; ++step) {
    for (int64_t layer = 0; layer < shape.layers; ++layer) StepAndCheck(ids[0], h, shape, layer, 1, step % 2, ++seed);
  }
  auto info = client_->GetSequence(ids[0]);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->sequence_id(), ids[0]);
  EXPECT_EQ(std::vector<int64_t>(info->lengths().begin(), info->lengths().end()), std::vector<int64_t>({41, 41}));
  EXPECT_EQ(info->shape().kv_heads(), shape.kv_heads);
  ASSERT_TRUE(client_->CloseSequence(ids).ok());
  EXPECT_EQ(client_->GetSequence(ids[0]).status().code(), absl::StatusCode::kNotFound);
}

// Append-only (prefill without q) and attend-only (q without k/v) steps, and the layers filled unevenly.
TEST_P(SequencesTest, AppendOnlyAndAttendOnlySteps) {
  const client::SequenceShape shape = TestShape();
  const std::vector<std::string> ids = Open(shape);
  ASSERT_EQ(ids.size(), 1u);
  History h(shape.layers);
  const std::string k = client::RandomTensor(shape.dtype, 20 * shape.kv_heads * shape.head_dim, 91);
  const std::string v = client::RandomTensor(shape.dtype, 20 * shape.kv_heads * shape.head_dim, 92);
  client::StepSpec append;
  append.sequences = {{ids[0], 20}};
  append.layer = 1;
  append.k.data = k;
  append.v.data = v;
  auto a = client_->Step(append);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_TRUE(a->o.empty());
  EXPECT_EQ(a->lengths, std::vector<int64_t>({20}));
  h.k[1] = k;
  h.v[1] = v;
  // The queries of the last 3 cached positions.
  const std::string q = client::RandomTensor(shape.dtype, 3 * kQHeads * shape.head_dim, 93);
  client::StepSpec attend;
  attend.sequences = {{ids[0], 3}};
  attend.layer = 1;
  attend.q_heads = kQHeads;
  attend.want_lse = true;
  attend.q.data = q;
  auto r = client_->Step(attend);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->lengths, std::vector<int64_t>({20}));
  EXPECT_EQ(CheckRows(shape, kQHeads, q, h.k[1], h.v[1], r->o, r->lse, true), "");
  auto info = client_->GetSequence(ids[0]);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(std::vector<int64_t>(info->lengths().begin(), info->lengths().end()), std::vector<int64_t>({0, 20}));
  EXPECT_TRUE(client_->CloseSequence(ids).ok());
}

// Several sequences of different lengths in ONE Step (the engine's batch): each one's rows of O and LSE are its
// own attention.
TEST_P(SequencesTest, ManySequencesInOneStep) {
  const client::SequenceShape shape = TestShape(1);
  const std::vector<std::string> ids = Open(shape, 3);
  ASSERT_EQ(ids.size(), 3u);
  std::vector<History> hs(3, History(1));
  const int64_t prefill[3] = {5, 33, 17};
  for (int i = 0; i < 3; ++i) StepAndCheck(ids[i], hs[i], shape, 0, prefill[i], false, 200 + i);
  for (int64_t tokens : {1, 2}) {
    const int64_t kv_row = shape.kv_heads * shape.head_dim, q_row = kQHeads * shape.head_dim;
    const std::string q = client::RandomTensor(shape.dtype, 3 * tokens * q_row, 300 + tokens);
    const std::string k = client::RandomTensor(shape.dtype, 3 * tokens * kv_row, 310 + tokens);
    const std::string v = client::RandomTensor(shape.dtype, 3 * tokens * kv_row, 320 + tokens);
    client::StepSpec spec;
    for (const std::string& id : ids) spec.sequences.push_back({id, tokens});
    spec.q_heads = kQHeads;
    spec.want_lse = true;
    spec.q.data = q;
    spec.k.data = k;
    spec.v.data = v;
    auto r = client_->Step(spec);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_GE(r->timing.batch_sequences(), 3u);
    for (int i = 0; i < 3; ++i) {
      SCOPED_TRACE(absl::StrCat("sequence ", i, ", ", tokens, " tokens"));
      const size_t qb = tokens * q_row * 2, kb = tokens * kv_row * 2, lb = tokens * kQHeads * 4;
      hs[i].k[0] += k.substr(i * kb, kb);
      hs[i].v[0] += v.substr(i * kb, kb);
      EXPECT_EQ(r->lengths[i], static_cast<int64_t>(hs[i].k[0].size() / (kv_row * 2)));
      EXPECT_EQ(CheckRows(shape, kQHeads, q.substr(i * qb, qb), hs[i].k[0], hs[i].v[0],
                          std::string_view(r->o).substr(i * qb, qb), std::string_view(r->lse).substr(i * lb, lb), true),
                "");
    }
  }
  EXPECT_TRUE(client_->CloseSequence(ids).ok());
}

// A fork shares its parent's tokens and then goes its own way; so does a fork of the fork. Each is checked
// against its own history, and the parent is unaffected by what its children append.
TEST_P(SequencesTest, ForksAndForksOfForksDiverge) {
  const client::SequenceShape shape = TestShape();
  const std::vector<std::string> ids = Open(shape);
  ASSERT_EQ(ids.size(), 1u);
  History parent(shape.layers);
  uint64_t seed = 400;
  // Past a page boundary (pages are at least 16 tokens), so that the copy-on-write of a partly filled page shows.
  for (int64_t layer = 0; layer < shape.layers; ++layer) StepAndCheck(ids[0], parent, shape, layer, 21, false, ++seed);
  auto child = client_->ForkSequence(ids[0], 2);
  ASSERT_TRUE(child.ok()) << child.status();
  ASSERT_EQ(child->size(), 2u);
  History c0 = parent, c1 = parent;
  for (int64_t layer = 0; layer < shape.layers; ++layer) StepAndCheck((*child)[0], c0, shape, layer, 1, true, ++seed);
  auto grandchild = client_->ForkSequence((*child)[0]);
  ASSERT_TRUE(grandchild.ok()) << grandchild.status();
  ASSERT_EQ(grandchild->size(), 1u);
  History g = c0;
  for (int round = 0; round < 3; ++round) {
    for (int64_t layer = 0; layer < shape.layers; ++layer) {
      StepAndCheck(ids[0], parent, shape, layer, 1, true, ++seed);
      StepAndCheck((*child)[0], c0, shape, layer, 2, true, ++seed);
      StepAndCheck((*child)[1], c1, shape, layer, 1, false, ++seed);
      StepAndCheck((*grandchild)[0], g, shape, layer, 1, true, ++seed);
    }
  }
  auto info = client_->GetSequence((*grandchild)[0]);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->lengths(0), 21 + 1 + 3);
  EXPECT_GT(info->shared_pages(), 0);  // the parent's first full page is still shared
  // Closing the parent leaves its children intact.
  ASSERT_TRUE(client_->CloseSequence(ids).ok());
  StepAndCheck((*grandchild)[0], g, shape, 0, 1, true, ++seed);
  EXPECT_TRUE(client_->CloseSequence({(*child)[0], (*child)[1], (*grandchild)[0]}).ok());
}

TEST_P(SequencesTest, TruncateDropsTheTailOnEveryLayer) {
  const client::SequenceShape shape = TestShape();
  const std::vector<std::string> ids = Open(shape);
  ASSERT_EQ(ids.size(), 1u);
  History h(shape.layers);
  uint64_t seed = 500;
  StepAndCheck(ids[0], h, shape, 0, 30, false, ++seed);
  StepAndCheck(ids[0], h, shape, 1, 12, false, ++seed);
  auto lengths = client_->TruncateSequence(ids[0], 17);
  ASSERT_TRUE(lengths.ok()) << lengths.status();
  EXPECT_EQ(*lengths, std::vector<int64_t>({17, 12}));  // a shorter layer is unchanged
  const size_t kv_row = shape.kv_heads * shape.head_dim * 2;
  h.k[0].resize(17 * kv_row);
  h.v[0].resize(17 * kv_row);
  // The next token lands at position 17 and sees only the first 17 (the rejected ones are gone).
  StepAndCheck(ids[0], h, shape, 0, 1, true, ++seed);
  StepAndCheck(ids[0], h, shape, 1, 1, true, ++seed);
  auto zero = client_->TruncateSequence(ids[0], 0);
  ASSERT_TRUE(zero.ok()) << zero.status();
  EXPECT_EQ(*zero, std::vector<int64_t>({0, 0}));
  History fresh(shape.layers);
  StepAndCheck(ids[0], fresh, shape, 0, 3, true, ++seed);
  EXPECT_EQ(client_->TruncateSequence(ids[0], -1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(client_->CloseSequence(ids).ok());
}

// Each refusal names what is wrong; none leaves anything behind (the sequence steps fine afterwards).
TEST_P(SequencesTest, BadInputIsRefusedWithAClearStatus) {
  const client::SequenceShape shape = TestShape();
  const std::vector<std::string> ids = Open(shape);
  ASSERT_EQ(ids.size(), 1u);
  const int64_t kv_elems = shape.kv_heads * shape.head_dim, q_elems = kQHeads * shape.head_dim;
  const std::string q = client::RandomTensor(shape.dtype, q_elems, 1);
  const std::string k = client::RandomTensor(shape.dtype, kv_elems, 2);
  const std::string v = client::RandomTensor(shape.dtype, kv_elems, 3);
  auto spec = [&](const std::string& id) {
    client::StepSpec s;
    s.sequences = {{id, 1}};
    s.q_heads = kQHeads;
    s.q.data = q;
    s.k.data = k;
    s.v.data = v;
    return s;
  };
  auto expect = [&](const client::StepSpec& s, absl::StatusCode code, const std::string& names) {
    auto r = client_->Step(s);
    EXPECT_EQ(r.status().code(), code) << names << ": " << r.status();
    EXPECT_TRUE(absl::StrContains(r.status().message(), names)) << r.status();
  };
  // Unknown: well-formed but never opened, and garbage.
  std::string unknown = ids[0];
  unknown[0] = unknown[0] == 'a' ? 'b' : 'a';
  expect(spec(unknown), absl::StatusCode::kNotFound, "sequence");
  expect(spec("nonsense"), absl::StatusCode::kNotFound, "sequence");
  EXPECT_EQ(client_->GetSequence(unknown).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->ForkSequence(unknown).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->TruncateSequence(unknown, 0).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->CloseSequence({unknown}).code(), absl::StatusCode::kNotFound);
  // Layer out of range.
  client::StepSpec s = spec(ids[0]);
  s.layer = shape.layers;
  expect(s, absl::StatusCode::kInvalidArgument, "layer");
  s.layer = -1;
  expect(s, absl::StatusCode::kInvalidArgument, "layer");
  // q_heads not a multiple of the sequence's kv_heads.
  s = spec(ids[0]);
  s.q_heads = 3;
  expect(s, absl::StatusCode::kInvalidArgument, "q_heads");
  // Byte sizes that do not match tokens x heads x head_dim.
  s = spec(ids[0]);
  s.sequences[0].tokens = 2;
  expect(s, absl::StatusCode::kInvalidArgument, "q");
  const std::string short_k = k.substr(0, k.size() - 2);
  s = spec(ids[0]);
  s.k.data = short_k;
  expect(s, absl::StatusCode::kInvalidArgument, "k");
  // A sequence twice in one step.
  s = spec(ids[0]);
  s.sequences.push_back({ids[0], 1});
  const std::string q2 = q + q, k2 = k + k, v2 = v + v;
  s.q.data = q2;
  s.k.data = k2;
  s.v.data = v2;
  expect(s, absl::StatusCode::kInvalidArgument, "sequences");
  // k without v: refused by the client before sending (MakeStepRequest), and by the server as a raw request.
  s = spec(ids[0]);
  s.v.data = {};
  EXPECT_EQ(client_->Step(s).status().code(), absl::StatusCode::kInvalidArgument);
  v1::StepRequest raw;
  auto* t = raw.add_sequences();
  t->set_sequence_id(ids[0]);
  t->set_tokens(1);
  raw.set_q_heads(kQHeads);
  raw.mutable_q()->set_data(q);
  raw.mutable_k()->set_data(k);
  auto rr = client_->Step(raw);
  EXPECT_EQ(rr.status().code(), absl::StatusCode::kInvalidArgument) << rr.status();
  // Open with a bad shape.
  client::SequenceShape bad = shape;
  bad.head_dim = 0;
  EXPECT_EQ(client_->OpenSequence(bad).status().code(), absl::StatusCode::kInvalidArgument);
  bad = shape;
  bad.layers = 0;
  EXPECT_EQ(client_->OpenSequence(bad).status().code(), absl::StatusCode::kInvalidArgument);
  {
    // The dtype has no default: a raw request that leaves it unset (as a JSON client's misspelled name arrives) is
    // refused naming it, not opened as bf16.
    const Listener via = GetParam() == Via::kTcp || GetParam() == Via::kTcpUnary ? Listener::kTcp : Listener::kUnix;
    auto stub = v1::Attention::NewStub(grpc::CreateChannel(server_->Target(via), grpc::InsecureChannelCredentials()));
    v1::OpenSequenceRequest open;
    open.mutable_shape()->set_layers(shape.layers);
    open.mutable_shape()->set_kv_heads(shape.kv_heads);
    open.mutable_shape()->set_head_dim(shape.head_dim);
    grpc::ClientContext ctx;
    v1::OpenSequenceResponse opened;
    const grpc::Status st = stub->OpenSequence(&ctx, open, &opened);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
    EXPECT_TRUE(absl::StartsWith(st.error_message(), "shape.dtype: DTYPE_UNSPECIFIED")) << st.error_message();
  }
  // Nothing was appended by any of the refusals.
  History h(shape.layers);
  StepAndCheck(ids[0], h, shape, 0, 1, true, 77);
  // Closed: NOT_FOUND, and a close of an already closed one too.
  ASSERT_TRUE(client_->CloseSequence(ids).ok());
  expect(spec(ids[0]), absl::StatusCode::kNotFound, "sequence");
  EXPECT_EQ(client_->CloseSequence(ids).code(), absl::StatusCode::kNotFound);
}

// One decode step of one sequence: random Q, K and V rows (seeds seed, seed + 1, seed + 2) and the spec that
// points at them (so it neither copies nor moves).
struct OneTokenStep {
  OneTokenStep(const client::SequenceShape& shape, const std::string& id, uint64_t seed)
      : q(client::RandomTensor(shape.dtype, kQHeads * shape.head_dim, seed)),
        k(client::RandomTensor(shape.dtype, shape.kv_heads * shape.head_dim, seed + 1)),
        v(client::RandomTensor(shape.dtype, shape.kv_heads * shape.head_dim, seed + 2)) {
    spec.sequences = {{id, 1}};
    spec.q_heads = kQHeads;
    spec.q.data = q;
    spec.k.data = k;
    spec.v.data = v;
  }
  OneTokenStep(const OneTokenStep&) = delete;
  OneTokenStep& operator=(const OneTokenStep&) = delete;

  const std::string q, k, v;
  client::StepSpec spec;
};

// StreamOrder: over the shared-memory channel a step waits until the channel's wait word reaches its value (here
// stored by the test, in place of a CUDA stream), then runs as any step; over gRPC it is FAILED_PRECONDITION, and a
// wait value of 0 INVALID_ARGUMENT naming it. Nothing is appended by a refusal.
TEST_P(SequencesTest, StreamOrderWaitsForTheChannelsWaitWord) {
  const client::SequenceShape shape = TestShape();
  const std::vector<std::string> ids = Open(shape);
  ASSERT_EQ(ids.size(), 1u);
  auto info = client_->ServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_TRUE(info->stream_ordered_steps());  // the suite's server has a --shm_socket
  EXPECT_EQ(info->sequences().order_timeout_s(), 30);
  const OneTokenStep one(shape, ids[0], 1);
  auto made = client::MakeStepRequest(one.spec);
  ASSERT_TRUE(made.ok()) << made.status();
  v1::StepRequest r = *std::move(made);
  r.mutable_order()->set_wait_value(3);
  if (GetParam() != Via::kShm) {
    auto got = client_->Step(r);
    EXPECT_EQ(got.status().code(), absl::StatusCode::kFailedPrecondition) << got.status();
    EXPECT_TRUE(absl::StrContains(got.status().message(), "order")) << got.status();
  } else {
    client::ShmChannelOptions co;
    co.socket_path = server_->shm_path;
    auto channel = client::ShmChannel::Connect(co);
    ASSERT_TRUE(channel.ok()) << channel.status();
    v1::StepRequest zero = r;
    zero.mutable_order()->set_wait_value(0);
    auto refused = (*channel)->Step(zero);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
    EXPECT_TRUE(absl::StrContains(refused.status().message(), "order.wait_value")) << refused.status();
    // The word reaches 2, then 3 (the value) 100 ms after the step was sent: the step runs only after that.
    (*channel)->wait_word()->store(2);
    const absl::Time sent = absl::Now();
    std::thread writer([&] {
      absl::SleepFor(absl::Milliseconds(100));
      (*channel)->wait_word()->store(3);
    });
    auto got = client::StepOverShm(**channel, r);
    const absl::Duration took = absl::Now() - sent;
    writer.join();
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_GE(took, absl::Milliseconds(100));
    EXPECT_EQ(CheckRows(shape, kQHeads, one.q, one.k, one.v, got->o, got->lse, false), "");
    ASSERT_EQ(got->lengths.size(), 1u);
    EXPECT_EQ(got->lengths[0], 1);
    // A word already past the value: no wait (values are compared as a wrapping sequence).
    (*channel)->wait_word()->store(10);
    r.mutable_order()->set_wait_value(4);
    got = client::StepOverShm(**channel, r);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->lengths[0], 2);
  }
  auto seq = client_->GetSequence(ids[0]);
  ASSERT_TRUE(seq.ok()) << seq.status();
  EXPECT_EQ(seq->lengths(0), GetParam() == Via::kShm ? 2 : 0);
  ASSERT_TRUE(client_->CloseSequence(ids).ok());
}

// A stream-ordered step whose word never comes is refused after --step_order_timeout_s, nothing done, and the
// channel serves the next step.
TEST(StreamOrder, AWordThatNeverComesTimesOut) {
  server::ServerOptions so;
  so.unix_socket = absl::StrCat(::testing::TempDir(), "/attnd_order_", ::getpid(), ".sock");
  so.shm_socket = absl::StrCat(::testing::TempDir(), "/attnd_order_", ::getpid(), ".shm");
  so.sequences.order_timeout = absl::Milliseconds(200);
  server::BackendOptions bo;
  bo.threads = 2;
  auto backend = server::MakeBackend("cpu", bo);
  ASSERT_TRUE(backend.ok()) << backend.status();
  auto srv = server::Server::Create(so, std::move(*backend));
  ASSERT_TRUE(srv.ok()) << srv.status();
  auto c = Connect(absl::StrCat("unix:", so.unix_socket));
  const client::SequenceShape shape = TestShape();
  auto opened = c->OpenSequence(shape);
  ASSERT_TRUE(opened.ok()) << opened.status();
  client::ShmChannelOptions co;
  co.socket_path = so.shm_socket;
  auto channel = client::ShmChannel::Connect(co);
  ASSERT_TRUE(channel.ok()) << channel.status();
  const OneTokenStep one(shape, opened->ids[0], 1);
  auto made = client::MakeStepRequest(one.spec);
  ASSERT_TRUE(made.ok()) << made.status();
  v1::StepRequest r = *std::move(made);
  r.mutable_order()->set_wait_value(1);
  auto got = (*channel)->Step(r);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDeadlineExceeded) << got.status();
  EXPECT_TRUE(absl::StrContains(got.status().message(), "order.wait_value")) << got.status();
  auto seq = c->GetSequence(opened->ids[0]);
  ASSERT_TRUE(seq.ok()) << seq.status();
  EXPECT_EQ(seq->lengths(0), 0);
  (*channel)->wait_word()->store(1);
  got = (*channel)->Step(r);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->lengths_size(), 1);
  EXPECT_EQ(got->lengths(0), 1);
  (*srv)->Shutdown();
}

// A sequence answers only to the credentials that opened it: without tokens, the peer. One opened over the
// unix socket ("local") does not exist for a caller on TCP.
TEST_P(SequencesTest, AnotherCallersSequenceDoesNotExist) {
  if (GetParam() != Via::kTcp) GTEST_SKIP() << "the foreign caller is the TCP one";
  auto local = Connect(server_->Target(Listener::kUnix));
  ASSERT_NE(local, nullptr);
  auto opened = local->OpenSequence(TestShape());
  ASSERT_TRUE(opened.ok()) << opened.status();
  const std::string id = opened->ids[0];
  EXPECT_EQ(client_->GetSequence(id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->ForkSequence(id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->CloseSequence({id}).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(local->GetSequence(id).ok());  // still there for its owner
  EXPECT_TRUE(local->CloseSequence({id}).ok());
}

// ---- The CLI's sequence commands: the engine behind them, then the attn binary.

TEST_P(SequencesTest, RunSequenceVerifiesEveryStep) {
  client::SeqRunOptions o;
  o.shape = TestShape(3);
  o.q_heads = kQHeads;
  o.prefill = 40;
  o.steps = 5;
  o.verify = true;
  o.want_lse = true;
  auto r = client::RunSequence(*client_, o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->steps, 5);
  EXPECT_EQ(r->verified, 3 * (1 + 5));
  EXPECT_EQ(r->verify_failures, 0) << r->first_verify_failure;
  EXPECT_EQ(r->final_lengths, std::vector<int64_t>({45, 45, 45}));
  EXPECT_EQ(r->step_us.size(), 5u);
  EXPECT_EQ(r->transport, client::TransportName(StepTransport(GetParam())));
  // It closed its sequence.
  EXPECT_EQ(client_->GetSequence(r->sequence_id).status().code(), absl::StatusCode::kNotFound);
}

TEST_P(SequencesTest, DecodeBenchPerSequenceAndOneMessage) {
  for (bool one_message : {false, true}) {
    SCOPED_TRACE(one_message ? "one message" : "per sequence");
    client::DecodeBenchOptions o;
    o.shape = TestShape(2);
    o.q_heads = kQHeads;
    o.sequences = 3;
    o.context = 20;
    o.steps = 4;
    o.one_message = one_message;
    auto r = client::RunDecodeBench(*client_, o);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->errors, 0) << r->first_error;
    EXPECT_EQ(r->calls_ok, (one_message ? 1 : 3) * 4 * 2);
    EXPECT_GT(r->tokens_per_s, 0);
    EXPECT_GT(r->lat_p50_us, 0);
    EXPECT_LE(r->lat_p50_us, r->lat_p99_us);
    EXPECT_GT(r->srv_kernel_us, 0);
    EXPECT_GT(r->hbm_gbps, 0);
    int64_t calls = 0;
    for (const auto& [batch, n] : r->batch_sequences) {
      calls += n;
      if (one_message) {
        EXPECT_GE(batch, 3u);  // the message itself is a batch of 3
      }
    }
    EXPECT_EQ(calls, r->calls_ok);
    const char* want = GetParam() == Via::kShm        ? "shm"
                       : GetParam() == Via::kUnix     ? "grpc-unix (StepStream)"
                       : GetParam() == Via::kTcpUnary ? "grpc-tcp (unary Step)"
                                                      : "grpc-tcp (StepStream)";
    EXPECT_EQ(r->transport, want);
    EXPECT_GT(r->outside_p50_us, 0);
    const std::string text = client::FormatDecodeReport(*r);
    EXPECT_TRUE(absl::StrContains(text, "tokens/s")) << text;
    EXPECT_TRUE(absl::StrContains(client::DecodeReportJson(*r), "\"hbm_gbps\"")) << text;
  }
  // Nothing left open.
  auto stats = client_->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->sequences().open(), 0u);
}

// Runs a command, returns its exit status and its stdout+stderr.
std::pair<int, std::string> RunCommand(const std::string& cmd) {
  std::string out;
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  if (p == nullptr) return {-1, "popen failed"};
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int st = ::pclose(p);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, out};
}

TEST_P(SequencesTest, AttnSeqAndDecodeBench) {
  std::string common = absl::StrCat(" --target=", client_->options().target);
  if (GetParam() == Via::kShm) absl::StrAppend(&common, " --transport=shm --shm_socket=", server_->shm_path);
  if (GetParam() == Via::kTcpUnary) absl::StrAppend(&common, " --transport=unary");
  const std::string shape = " --layers=2 --q_heads=4 --kv_heads=2 --head_dim=64";
  auto [rc, out] = RunCommand(absl::StrCat(ATTN_BINARY, " seq --verify --lse --prefill=24 --steps=3", common, shape));
  EXPECT_EQ(rc, 0) << out;
  EXPECT_TRUE(absl::StrContains(out, "step 3: 27 tokens cached")) << out;
  EXPECT_TRUE(absl::StrContains(out, "verified: 8 layer-steps, 0 failed")) << out;
  EXPECT_TRUE(absl::StrContains(out, "cached tokens per layer at the end: 27,27")) << out;

  const std::string json =
      absl::StrCat(::testing::TempDir(), "/attn_decode_", ::getpid(), "_", ViaName(GetParam()), ".json");
  auto [b_rc, b_out] = RunCommand(absl::StrCat(ATTN_BINARY, " bench --workload=decode --sequences=3 --context=16 "
                                               "--steps=3 --progress=false --json=", json, common, shape));
  EXPECT_EQ(b_rc, 0) << b_out;
  EXPECT_TRUE(absl::StrContains(b_out, "Step calls: 18 ok, 0 errors")) << b_out;
  EXPECT_TRUE(absl::StrContains(b_out, "server batches")) << b_out;
  EXPECT_TRUE(absl::StrContains(b_out, "K/V read")) << b_out;
  std::FILE* f = std::fopen(json.c_str(), "r");
  ASSERT_NE(f, nullptr);
  std::fclose(f);
  std::remove(json.c_str());

  auto [o_rc, o_out] = RunCommand(absl::StrCat(ATTN_BINARY, " bench --workload=decode --one_message --sequences=4 "
                                               "--context=8 --steps=2 --progress=false", common, shape));
  EXPECT_EQ(o_rc, 0) << o_out;
  EXPECT_TRUE(absl::StrContains(o_out, "Step calls: 4 ok, 0 errors")) << o_out;

  auto [bad_rc, bad_out] = RunCommand(absl::StrCat(ATTN_BINARY, " seq --q_heads=3 --kv_heads=2", common));
  EXPECT_EQ(bad_rc, 1) << bad_out;
  EXPECT_TRUE(absl::StrContains(bad_out, "--q_heads")) << bad_out;
  auto [w_rc, w_out] = RunCommand(absl::StrCat(ATTN_BINARY, " bench --workload=nope", common));
  EXPECT_EQ(w_rc, 2) << w_out;
}

INSTANTIATE_TEST_SUITE_P(Transports, SequencesTest,
                         ::testing::Values(Via::kTcp, Via::kTcpUnary, Via::kUnix, Via::kShm),
                         [](const auto& info) { return std::string(ViaName(info.param)); });

// ---- Servers of their own: a small pool, and a second server that sequences are pinned to.

std::string FreshSocketPath() {
  static std::atomic<int> counter{0};
  return absl::StrCat(::testing::TempDir(), "/attnd_seq_", ::getpid(), "_", counter++, ".sock");
}

// A CPU-backend server on a loopback port and the unix socket `unix_path` (empty: a fresh one), with
// `sequences` as its sequence options; `wrap`, when set, gets the CPU backend and returns the one served.
void StartSequenceServer(TestServer* out, const server::SequenceOptions& sequences, std::string unix_path = "",
                         const WrapBackend& wrap = nullptr) {
  server::ServerOptions so;
  so.listen = "127.0.0.1:0";
  out->unix_path = unix_path.empty() ? FreshSocketPath() : std::move(unix_path);
  so.unix_socket = out->unix_path;
  so.sequences = sequences;
  server::BackendOptions bo;
  bo.threads = 2;
  auto backend = server::MakeBackend("cpu", bo);
  ASSERT_TRUE(backend.ok()) << backend.status();
  std::unique_ptr<server::Backend> served = std::move(*backend);
  if (wrap) served = wrap(std::move(served));
  auto s = server::Server::Create(so, std::move(served));
  ASSERT_TRUE(s.ok()) << s.status();
  out->server = std::move(*s);
  out->port = out->server->tcp_port();
}

// Opening or appending past the pool is RESOURCE_EXHAUSTED naming the pool, never the eviction of a live
// sequence; closing one makes room again.
TEST(SequencePool, FullPoolIsResourceExhaustedAndClosingFreesIt) {
  const client::SequenceShape shape = TestShape(2);
  server::SequenceOptions so;
  so.page_tokens = 16;
  // 8 pages of 16 tokens: [16, kv_heads 2, head_dim 64] bf16, K and V, 2 layers = 16 KiB a page.
  so.pool_bytes = 8 * 16 * 2 * 64 * 2 * 2 * 2;
  TestServer srv;
  StartSequenceServer(&srv, so);
  auto c = Connect(srv.Target(Listener::kUnix));
  ASSERT_NE(c, nullptr);
  auto opened = c->OpenSequence(shape, 0, 2);
  ASSERT_TRUE(opened.ok()) << opened.status();
  const int64_t kv = shape.kv_heads * shape.head_dim;
  const std::string k = client::RandomTensor(shape.dtype, 100 * kv, 1);
  const std::string v = client::RandomTensor(shape.dtype, 100 * kv, 2);
  auto append = [&](const std::string& id) {
    client::StepSpec s;
    s.sequences = {{id, 100}};
    s.k.data = k;
    s.v.data = v;
    return c->Step(s);
  };
  auto first = append(opened->ids[0]);  // 7 of the 8 pages
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = append(opened->ids[1]);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kResourceExhausted) << second.status();
  EXPECT_TRUE(absl::StrContains(second.status().message(), "pool")) << second.status();
  // The first sequence is untouched: still all its tokens.
  auto info = c->GetSequence(opened->ids[0]);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->lengths(0), 100);
  ASSERT_TRUE(c->CloseSequence({opened->ids[0]}).ok());
  auto retry = append(opened->ids[1]);
  EXPECT_TRUE(retry.ok()) << retry.status();
  EXPECT_TRUE(c->CloseSequence({opened->ids[1]}).ok());
  srv.server->Shutdown();
}

// Over gRPC a step's request and its reply are two messages, each held to --max_message_bytes: a step goes through
// when each fits, however large the two are together, on the unary Step as on StepStream.
TEST(SequenceLimits, RequestAndReplyEachFitOneMessage) {
  TestServer srv;
  StartServer(&srv, /*max_message_bytes=*/1 << 20);
  auto c = Connect(srv.Target(Listener::kUnix));
  ASSERT_NE(c, nullptr);
  const client::SequenceShape shape = TestShape(1);
  // 900 rows: a request of 921,600 bytes (Q 512 a row, K and V 256 each), a reply of 460,800; 1,382,400 together.
  constexpr int64_t kTokens = 900;
  const std::string q = client::RandomTensor(shape.dtype, kTokens * kQHeads * shape.head_dim, 81);
  const std::string k = client::RandomTensor(shape.dtype, kTokens * shape.kv_heads * shape.head_dim, 82);
  const std::string v = client::RandomTensor(shape.dtype, kTokens * shape.kv_heads * shape.head_dim, 83);
  for (client::Transport t : {client::Transport::kUnary, client::Transport::kStream}) {
    SCOPED_TRACE(t == client::Transport::kUnary ? "unary" : "stream");
    auto opened = c->OpenSequence(shape);
    ASSERT_TRUE(opened.ok()) << opened.status();
    client::StepSpec s;
    s.sequences = {{opened->ids[0], kTokens}};
    s.q_heads = kQHeads;
    s.q.data = q;
    s.k.data = k;
    s.v.data = v;
    client::CallOptions call;
    call.transport = t;
    auto r = c->Step(s, call);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->transport, t);
    EXPECT_EQ(CheckRows(shape, kQHeads, q, k, v, r->o, "", false), "");
    EXPECT_TRUE(c->CloseSequence(opened->ids).ok());
  }
  srv.server->Shutdown();
}

// Ids of a server with an advertised address carry it after '@': a client whose target is another server
// sends every call about those sequences to the one that holds them.
TEST(SequencePinning, CallsFollowTheIdToItsServer) {
  TestServer a, b;
  StartSequenceServer(&a, server::SequenceOptions{});
  server::SequenceOptions pinned;
  // The unix socket is an address every client here reaches, and its callers are all "local".
  const std::string b_socket = FreshSocketPath();
  pinned.advertise_address = absl::StrCat("unix:", b_socket);
  StartSequenceServer(&b, pinned, b_socket);
  auto on_b = Connect(b.Target(Listener::kUnix));
  auto via_a = Connect(a.Target(Listener::kUnix));
  ASSERT_NE(on_b, nullptr);
  ASSERT_NE(via_a, nullptr);
  const client::SequenceShape shape = TestShape(1);
  auto opened = on_b->OpenSequence(shape);
  ASSERT_TRUE(opened.ok()) << opened.status();
  const std::string id = opened->ids[0];
  ASSERT_EQ(client::SequenceAddress(id), pinned.advertise_address) << id;

  // Every call through the client targeting A reaches B.
  const int64_t q_elems = kQHeads * shape.head_dim, kv_elems = shape.kv_heads * shape.head_dim;
  const std::string q = client::RandomTensor(shape.dtype, 5 * q_elems, 1);
  const std::string k = client::RandomTensor(shape.dtype, 5 * kv_elems, 2);
  const std::string v = client::RandomTensor(shape.dtype, 5 * kv_elems, 3);
  client::StepSpec s;
  s.sequences = {{id, 5}};
  s.q_heads = kQHeads;
  s.q.data = q;
  s.k.data = k;
  s.v.data = v;
  auto r = via_a->Step(s);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(CheckRows(shape, kQHeads, q, k, v, r->o, r->lse, false), "");
  auto info = via_a->GetSequence(id);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->lengths(0), 5);
  auto children = via_a->ForkSequence(id);
  ASSERT_TRUE(children.ok()) << children.status();
  EXPECT_EQ(client::SequenceAddress((*children)[0]), pinned.advertise_address);
  auto truncated = via_a->TruncateSequence((*children)[0], 2);
  ASSERT_TRUE(truncated.ok()) << truncated.status();
  EXPECT_EQ(*truncated, std::vector<int64_t>({2}));
  auto a_stats = via_a->Stats();
  auto b_stats = on_b->Stats();
  ASSERT_TRUE(a_stats.ok() && b_stats.ok());
  EXPECT_EQ(a_stats->sequences().open(), 0u);
  EXPECT_EQ(b_stats->sequences().open(), 2u);

  // One of A's own sequences and one of B's in one step: refused by the client.
  auto mine = via_a->OpenSequence(shape);
  ASSERT_TRUE(mine.ok()) << mine.status();
  EXPECT_EQ(client::SequenceAddress(mine->ids[0]), "");
  client::StepSpec both;
  both.sequences = {{mine->ids[0], 1}, {id, 1}};
  both.k.data = std::string_view(k).substr(0, 2 * kv_elems * 2);
  both.v.data = std::string_view(v).substr(0, 2 * kv_elems * 2);
  auto mixed = via_a->Step(both);
  EXPECT_EQ(mixed.status().code(), absl::StatusCode::kInvalidArgument) << mixed.status();

  EXPECT_TRUE(via_a->CloseSequence({id, (*children)[0]}).ok());
  EXPECT_TRUE(via_a->CloseSequence(mine->ids).ok());
  b_stats = on_b->Stats();
  ASSERT_TRUE(b_stats.ok());
  EXPECT_EQ(b_stats->sequences().open(), 0u);
  a.server->Shutdown();
  b.server->Shutdown();
}

// ---- Client-side rules: nothing here needs a server.

TEST(SequenceClient, AddressIsThePartAfterTheLastAt) {
  EXPECT_EQ(client::SequenceAddress("abc"), "");
  EXPECT_EQ(client::SequenceAddress("abc@10.0.0.7:50051"), "10.0.0.7:50051");
  EXPECT_EQ(client::SequenceAddress("abc@attnd-1.attnd:50051"), "attnd-1.attnd:50051");
}

TEST(SequenceClient, AStepAcrossServersIsRefusedBeforeSending) {
  client::ClientOptions o;
  o.target = "127.0.0.1:1";  // nothing listens: a call that went out would be UNAVAILABLE
  auto c = client::Client::Create(o);
  ASSERT_TRUE(c.ok()) << c.status();
  client::StepSpec s;
  s.sequences = {{"a@10.0.0.1:50051", 1}, {"b@10.0.0.2:50051", 1}};
  const std::string kv(2 * 64 * 2 * 2, '\0');
  s.k.data = kv;
  s.v.data = kv;
  auto r = (*c)->Step(s);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_TRUE(absl::StrContains(r.status().message(), "sequences[1]")) << r.status();
  EXPECT_EQ((*c)->CloseSequence({"a", "b@10.0.0.2:50051"}).code(), absl::StatusCode::kInvalidArgument);
  // An empty batch and a k without v never leave the client either.
  EXPECT_EQ((*c)->Step(client::StepSpec{}).status().code(), absl::StatusCode::kInvalidArgument);
  s.sequences.pop_back();
  s.v.data = {};
  EXPECT_EQ((*c)->Step(s).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(SequenceClient, ShortRepliesAreErrors) {
  v1::StepRequest req;
  auto* t = req.add_sequences();
  t->set_sequence_id("s");
  t->set_tokens(2);
  req.set_q_heads(4);
  req.set_return_lse(true);
  req.mutable_q()->set_data(std::string(2 * 4 * 64 * 2, '\1'));
  v1::StepResponse good;
  good.set_o(std::string(2 * 4 * 64 * 2, '\0'));
  good.set_lse(std::string(2 * 4 * 4, '\0'));
  good.add_lengths(9);
  EXPECT_TRUE(client::StepResultOf(req, good, client::Transport::kUnary, absl::Now()).ok());
  v1::StepResponse short_o = good;
  short_o.mutable_o()->pop_back();
  EXPECT_EQ(client::StepResultOf(req, short_o, client::Transport::kUnary, absl::Now()).status().code(),
            absl::StatusCode::kInternal);
  v1::StepResponse no_lse = good;
  no_lse.clear_lse();
  EXPECT_EQ(client::StepResultOf(req, no_lse, client::Transport::kUnary, absl::Now()).status().code(),
            absl::StatusCode::kInternal);
  v1::StepResponse no_lengths = good;
  no_lengths.clear_lengths();
  EXPECT_EQ(client::StepResultOf(req, no_lengths, client::Transport::kUnary, absl::Now()).status().code(),
            absl::StatusCode::kInternal);
}

// ---- StepStream: steps over one long-lived stream.

v1::StepStreamRequest StreamStep(const std::string& id, int64_t tokens, int64_t layer, const std::string& q,
                                 const std::string& k, const std::string& v) {
  v1::StepStreamRequest m;
  v1::StepRequest* s = m.mutable_step();
  auto* t = s->add_sequences();
  t->set_sequence_id(id);
  t->set_tokens(tokens);
  s->set_layer(layer);
  s->set_q_heads(kQHeads);
  if (!q.empty()) s->mutable_q()->set_data(q);
  if (!k.empty()) s->mutable_k()->set_data(k);
  if (!v.empty()) s->mutable_v()->set_data(v);
  return m;
}

uint64_t MethodCount(client::Client& c, const std::string& method, uint64_t* errors = nullptr) {
  auto stats = c.Stats();
  EXPECT_TRUE(stats.ok()) << stats.status();
  if (!stats.ok()) return 0;
  for (const v1::RpcStats& r : stats->rpcs()) {
    if (r.method() != method) continue;
    if (errors != nullptr) *errors = r.errors();
    return r.count();
  }
  return 0;
}

// A server of its own with one open sequence `id_` of `shape_`, and a client on the listener the test names;
// the sequence is closed and the server shut down after the test.
class StepStreamTest : public ::testing::Test {
 protected:
  void Open(Listener via, int layers, const server::SequenceOptions& options = {}, const WrapBackend& wrap = nullptr) {
    StartSequenceServer(&srv_, options, "", wrap);
    via_ = via;
    c_ = Connect(srv_.Target(via));
    ASSERT_NE(c_, nullptr);
    shape_ = TestShape(layers);
    auto opened = c_->OpenSequence(shape_);
    ASSERT_TRUE(opened.ok()) << opened.status();
    id_ = opened->ids[0];
  }

  void TearDown() override {
    if (c_ != nullptr && !id_.empty()) {
      EXPECT_TRUE(c_->CloseSequence({id_}).ok());
    }
    if (srv_.server) srv_.server->Shutdown();
  }

  // A raw StepStream to the server (the client library's own is not exposed).
  std::unique_ptr<v1::Attention::Stub> RawStub() const {
    return v1::Attention::NewStub(grpc::CreateChannel(srv_.Target(via_), grpc::InsecureChannelCredentials()));
  }

  // Polls the sequence (bounded) until `done` says so; its last state.
  v1::SequenceInfo Await(const std::function<bool(const v1::SequenceInfo&)>& done) {
    v1::SequenceInfo last;
    for (const absl::Time until = absl::Now() + absl::Seconds(30); absl::Now() < until;) {
      auto info = c_->GetSequence(id_);
      EXPECT_TRUE(info.ok()) << info.status();
      if (!info.ok()) break;
      last = *info;
      if (done(last)) break;
      absl::SleepFor(absl::Milliseconds(1));  // polling the server's state, bounded above
    }
    return last;
  }

  TestServer srv_;
  Listener via_ = Listener::kUnix;
  std::unique_ptr<client::Client> c_;
  client::SequenceShape shape_;
  std::string id_;
};

// Each bad step on a stream gets the status the unary Step would end with, in its answer; the stream stays open
// and the next good step runs on a sequence the refusals left untouched. Every step is counted as a call.
TEST_F(StepStreamTest, BadStepsAreAnsweredAndTheStreamGoesOn) {
  ASSERT_NO_FATAL_FAILURE(Open(Listener::kUnix, 2));
  const client::SequenceShape& shape = shape_;
  const std::string& id = id_;
  const int64_t q_row = kQHeads * shape.head_dim, kv_row = shape.kv_heads * shape.head_dim;
  const std::string q = client::RandomTensor(shape.dtype, 3 * q_row, 11);
  const std::string k = client::RandomTensor(shape.dtype, 3 * kv_row, 12);
  const std::string v = client::RandomTensor(shape.dtype, 3 * kv_row, 13);

  auto stub = RawStub();
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
  auto rw = stub->StepStream(&ctx);
  auto round = [&](const v1::StepStreamRequest& m) {
    v1::StepStreamResponse r;
    EXPECT_TRUE(rw->Write(m));
    EXPECT_TRUE(rw->Read(&r));
    return r;
  };
  auto expect_refused = [&](const v1::StepStreamRequest& m, absl::StatusCode code, const std::string& names) {
    const v1::StepStreamResponse r = round(m);
    EXPECT_EQ(r.code(), static_cast<int>(code)) << names << ": " << r.message();
    EXPECT_TRUE(absl::StrContains(r.message(), names)) << r.message();
    EXPECT_FALSE(r.has_step());
    EXPECT_FALSE(r.request_id().empty());  // the server named it
  };
  std::string unknown = id;
  unknown[0] = unknown[0] == 'a' ? 'b' : 'a';
  expect_refused(StreamStep(unknown, 3, 0, q, k, v), absl::StatusCode::kNotFound, "sequences[0].sequence_id");
  expect_refused(StreamStep(id, 3, 2, q, k, v), absl::StatusCode::kInvalidArgument, "layer");
  expect_refused(StreamStep(id, 3, 0, q, k, ""), absl::StatusCode::kInvalidArgument, "v");
  expect_refused(StreamStep(id, 3, 0, q, k.substr(2), v), absl::StatusCode::kInvalidArgument, "k.data");
  expect_refused(v1::StepStreamRequest(), absl::StatusCode::kInvalidArgument, "sequences");
  v1::StepStreamRequest negative = StreamStep(id, 3, 0, q, k, v);
  negative.set_timeout_us(-1);
  expect_refused(negative, absl::StatusCode::kInvalidArgument, "timeout_us");

  // Nothing was appended by the refusals: the first good step attends over its own 3 rows only.
  v1::StepStreamRequest good = StreamStep(id, 3, 0, q, k, v);
  good.mutable_step()->set_request_id("mine");
  good.set_timeout_us(30'000'000);
  v1::StepStreamResponse r = round(good);
  ASSERT_EQ(r.code(), 0) << r.message();
  EXPECT_EQ(r.request_id(), "mine");
  EXPECT_EQ(r.step().request_id(), "mine");
  ASSERT_EQ(r.step().lengths_size(), 1);
  EXPECT_EQ(r.step().lengths(0), 3);
  EXPECT_EQ(CheckRows(shape, kQHeads, q, k, v, r.step().o(), "", false), "");
  // And the stream goes on.
  const std::string q1 = client::RandomTensor(shape.dtype, q_row, 14);
  const std::string k1 = client::RandomTensor(shape.dtype, kv_row, 15);
  const std::string v1 = client::RandomTensor(shape.dtype, kv_row, 16);
  r = round(StreamStep(id, 1, 0, q1, k1, v1));
  ASSERT_EQ(r.code(), 0) << r.message();
  EXPECT_EQ(r.step().lengths(0), 4);
  EXPECT_EQ(CheckRows(shape, kQHeads, q1, k + k1, v + v1, r.step().o(), "", false), "");
  EXPECT_TRUE(rw->WritesDone());
  const grpc::Status end = rw->Finish();
  EXPECT_TRUE(end.ok()) << end.error_message();
  uint64_t errors = 0;
  EXPECT_EQ(MethodCount(*c_, "StepStream", &errors), 8u);
  EXPECT_EQ(errors, 6u);
}

// A client that goes away with a step in flight: the step finishes or is dropped, the sequence is free again and
// its length is one of the two outcomes, and the next step sees exactly what was committed.
TEST_F(StepStreamTest, AClientGoneMidStepLeavesTheSequenceConsistent) {
  ASSERT_NO_FATAL_FAILURE(Open(Listener::kUnix, 1));
  const client::SequenceShape& shape = shape_;
  const std::string& id = id_;
  const int64_t q_row = kQHeads * shape.head_dim, kv_row = shape.kv_heads * shape.head_dim;
  constexpr int64_t kTokens = 1500;  // a prefill the CPU backend takes a while over
  const std::string q = client::RandomTensor(shape.dtype, kTokens * q_row, 21);
  const std::string k = client::RandomTensor(shape.dtype, kTokens * kv_row, 22);
  const std::string v = client::RandomTensor(shape.dtype, kTokens * kv_row, 23);
  {
    auto stub = RawStub();
    grpc::ClientContext ctx;
    auto rw = stub->StepStream(&ctx);
    ASSERT_TRUE(rw->Write(StreamStep(id, kTokens, 0, q, k, v)));
    // Admitted (running, or already done): nothing of it is still on its way when the client goes.
    Await([](const v1::SequenceInfo& i) { return i.step_in_flight() || i.lengths(0) > 0; });
    ctx.TryCancel();
    (void)rw->Finish();
  }
  const v1::SequenceInfo settled = Await([](const v1::SequenceInfo& i) { return !i.step_in_flight(); });
  ASSERT_FALSE(settled.step_in_flight());
  ASSERT_EQ(settled.lengths_size(), 1);
  const int64_t length = settled.lengths(0);
  ASSERT_TRUE(length == 0 || length == kTokens) << length;
  const OneTokenStep next(shape, id, 24);
  auto r = c_->Step(next.spec);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->transport, client::Transport::kStream);
  ASSERT_EQ(r->lengths.size(), 1u);
  EXPECT_EQ(r->lengths[0], length + 1);
  const std::string keys = length == 0 ? next.k : k + next.k, values = length == 0 ? next.v : v + next.v;
  EXPECT_EQ(CheckRows(shape, kQHeads, next.q, keys, values, r->o, "", false), "");
}

// A step the server has admitted from a stream is run and committed even when the stream is cancelled while the
// step waits for its launch (its answer reaches no one): the sequence advances by exactly that step, and the next
// step attends over it.
TEST_F(StepStreamTest, AStepWaitingForItsLaunchWhenTheStreamIsCancelledIsCommitted) {
  server::SequenceOptions options;
  options.launches_in_flight = 1;  // a layer's second step waits for the first one's launch to end
  testing::GatedBackend* gate = nullptr;
  ASSERT_NO_FATAL_FAILURE(Open(Listener::kUnix, 1, options, [&gate](std::unique_ptr<server::Backend> inner) {
    auto gated = std::make_unique<testing::GatedBackend>(std::move(inner));
    gate = gated.get();
    return gated;
  }));
  auto other = c_->OpenSequence(shape_);
  ASSERT_TRUE(other.ok()) << other.status();
  const std::string held_id = other->ids[0];
  // A step of the other sequence holds the layer's one launch.
  gate->Gate();
  const OneTokenStep held(shape_, held_id, 71);
  std::thread holder([&] {
    auto r = c_->Step(held.spec);
    EXPECT_TRUE(r.ok()) << r.status();
  });
  absl::Cleanup release = [&] {
    gate->Open();
    holder.join();
  };
  for (const absl::Time until = absl::Now() + absl::Seconds(30); gate->held_batch_sizes().empty();) {
    ASSERT_LT(absl::Now(), until) << "the holding step never reached the backend";
    absl::SleepFor(absl::Milliseconds(1));
  }
  // The step on the stream is admitted (the sequence shows it in flight) and waits behind it.
  const OneTokenStep cancelled(shape_, id_, 72);
  auto stub = RawStub();
  {
    grpc::ClientContext ctx;
    auto rw = stub->StepStream(&ctx);
    ASSERT_TRUE(rw->Write(StreamStep(id_, 1, 0, cancelled.q, cancelled.k, cancelled.v)));
    ASSERT_TRUE(Await([](const v1::SequenceInfo& i) { return i.step_in_flight(); }).step_in_flight());
    ctx.TryCancel();
    EXPECT_EQ(rw->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  // A call on the same connection after the cancellation: the server has read the cancellation before it.
  {
    grpc::ClientContext ctx;
    v1::GetSequenceRequest get;
    get.set_sequence_id(id_);
    v1::SequenceInfo info;
    ASSERT_TRUE(stub->GetSequence(&ctx, get, &info).ok());
    EXPECT_TRUE(info.step_in_flight());
    EXPECT_EQ(info.lengths(0), 0);
  }
  std::move(release).Invoke();
  const v1::SequenceInfo settled = Await([](const v1::SequenceInfo& i) { return !i.step_in_flight(); });
  ASSERT_FALSE(settled.step_in_flight());
  EXPECT_EQ(settled.lengths(0), 1);
  const OneTokenStep next(shape_, id_, 73);
  auto r = c_->Step(next.spec);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->lengths.size(), 1u);
  EXPECT_EQ(r->lengths[0], 2);
  EXPECT_EQ(CheckRows(shape_, kQHeads, next.q, cancelled.k + next.k, cancelled.v + next.v, r->o, "", false), "");
  EXPECT_TRUE(c_->CloseSequence({held_id}).ok());
}

// A step whose deadline passes is DEADLINE_EXCEEDED (the server's refusal in the answer, or the client's wait
// running out, which cancels that stream); the client's next step goes through, over the committed length.
TEST_F(StepStreamTest, AStepPastItsDeadlineFailsAloneAndTheNextStepGoesThrough) {
  ASSERT_NO_FATAL_FAILURE(Open(Listener::kTcp, 1));
  const OneTokenStep step(shape_, id_, 51);
  const client::StepSpec& s = step.spec;
  client::CallOptions hurried;
  hurried.deadline = absl::Microseconds(1);
  for (int i = 0; i < 3; ++i) {
    auto late = c_->Step(s, hurried);
    EXPECT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded) << late.status();
  }
  const v1::SequenceInfo settled = Await([](const v1::SequenceInfo& i) { return !i.step_in_flight(); });
  ASSERT_FALSE(settled.step_in_flight());
  ASSERT_EQ(settled.lengths_size(), 1);
  const int64_t length = settled.lengths(0);
  ASSERT_GE(length, 0);
  ASSERT_LE(length, 3);
  auto r = c_->Step(s);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->transport, client::Transport::kStream);
  EXPECT_EQ(r->lengths[0], length + 1);
}

// The client keeps a stream for its next step. One the server ended while it sat idle (here: the server was
// restarted on the same socket) is replaced before the step is sent, so the step reaches the new server, which
// answers for itself: the old sequence is gone (NOT_FOUND), a new one steps normally.
TEST(StepStream, AStreamEndedWhileIdleIsReplaced) {
  const std::string socket = FreshSocketPath();
  const std::string target = absl::StrCat("unix:", socket);
  auto c = Connect(target);
  ASSERT_NE(c, nullptr);
  const client::SequenceShape shape = TestShape(1);
  OneTokenStep one(shape, "", 31);
  auto step = [&](const std::string& id) {
    one.spec.sequences[0].sequence_id = id;
    return c->Step(one.spec);
  };
  std::string old_id;
  {
    TestServer first;
    StartSequenceServer(&first, server::SequenceOptions{}, socket);
    auto opened = c->OpenSequence(shape);
    ASSERT_TRUE(opened.ok()) << opened.status();
    old_id = opened->ids[0];
    auto r = step(old_id);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->transport, client::Transport::kStream);
    first.server->Shutdown();
  }
  TestServer second;
  StartSequenceServer(&second, server::SequenceOptions{}, socket);
  auto gone = step(old_id);
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound) << gone.status();
  auto opened = c->OpenSequence(shape);
  ASSERT_TRUE(opened.ok()) << opened.status();
  auto r = step(opened->ids[0]);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->lengths[0], 1);
  EXPECT_EQ(CheckRows(shape, kQHeads, one.q, one.k, one.v, r->o, "", false), "");
  second.server->Shutdown();
}

// A server without StepStream (an attnd from before it) gets the same steps as unary Step calls.
class UnaryStepOnly final : public v1::Attention::Service {
 public:
  grpc::Status Step(grpc::ServerContext*, const v1::StepRequest* request, v1::StepResponse* response) override {
    ++steps;
    response->set_o(std::string(request->q().data().size(), '\0'));
    for (int i = 0; i < request->sequences_size(); ++i) response->add_lengths(steps);
    return grpc::Status::OK;
  }
  std::atomic<int> steps{0};
};

TEST(StepStream, AServerWithoutItGetsUnarySteps) {
  UnaryStepOnly service;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  auto c = Connect(absl::StrCat("127.0.0.1:", port));
  ASSERT_NE(c, nullptr);
  const std::string q = client::RandomTensor(DType::kBF16, kQHeads * 64, 41);
  client::StepSpec s;
  s.sequences = {{"some-sequence", 1}};
  s.q_heads = kQHeads;
  s.q.data = q;
  for (int i = 1; i <= 3; ++i) {
    auto r = c->Step(s);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->transport, client::Transport::kUnary);
    EXPECT_EQ(r->lengths[0], i);  // each step reached the server once
  }
  EXPECT_EQ(service.steps.load(), 3);
  server->Shutdown();
}

}  // namespace
}  // namespace attnd::e2e
