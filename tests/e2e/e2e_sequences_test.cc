// KV sequences end to end through the client library against an in-process CPU-backend server, over gRPC on a
// loopback port (StepStream, and the unary Step), on the unix socket and over the shared-memory channel's Step
// frames: every step's O and LSE
// checked against the double-precision reference of the whole history this test keeps, forks (and forks of
// forks) diverging from their parents, truncation, closing, the statuses of bad input, stream-ordered steps, and
// the CLI's sequence commands.
#include <sys/wait.h>

#include <cstdio>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "attnd/client/bench.h"
#include "attnd/client/shm_channel.h"
#include "e2e_sequences_util.h"
#include "e2e_util.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"

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
  // `as_sent`, when given, is extended with the rows as sent, and the reply must fail the check against it: a
  // float8 cache's quantization shows.
  void StepAndCheck(const std::string& id, History& h, const client::SequenceShape& shape, int64_t layer,
                    int64_t tokens, bool lse, uint64_t seed, History* as_sent = nullptr) {
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
    h.k[layer] += client::CachedRows(shape, shape.k_descale, layer, k);
    h.v[layer] += client::CachedRows(shape, shape.v_descale, layer, v);
    const int64_t keys = static_cast<int64_t>(h.k[layer].size()) / (shape.kv_heads * shape.head_dim * 2);
    ASSERT_EQ(r->lengths.size(), 1u);
    EXPECT_EQ(r->lengths[0], keys);
    EXPECT_GE(r->timing.batch_sequences(), 1u);
    EXPECT_EQ(CheckRows(shape, kQHeads, q, h.k[layer], h.v[layer], r->o, r->lse, lse), "");
    if (as_sent != nullptr) {
      as_sent->k[layer] += k;
      as_sent->v[layer] += v;
      EXPECT_NE(CheckRows(shape, kQHeads, q, as_sent->k[layer], as_sent->v[layer], r->o, r->lse, lse), "");
    }
  }

  // The attn flags that reach the suite's server as this client does.
  std::string CliTarget() const {
    std::string flags = absl::StrCat(" --target=", client_->options().target);
    if (GetParam() == Via::kShm) absl::StrAppend(&flags, " --transport=shm --shm_socket=", server_->shm_path);
    if (GetParam() == Via::kTcpUnary) absl::StrAppend(&flags, " --transport=unary");
    return flags;
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

// A float8 cache: every step attends over the history as the cache holds it (each row quantized with its layer's and
// kv head's descales), which the reference sees through CachedRows; GetSequence gives the shape back as opened. The
// descales differ by layer and head, down to 1/256, where |x| >= 1.75 saturates: a reference over the rows as sent
// fails, so the check shows the quantization.
TEST_P(SequencesTest, Float8CacheStepsSeeTheQuantizedHistory) {
  client::SequenceShape shape = TestShape();
  shape.kv_format = KvFormat::kFp8E4M3;
  shape.k_descale = {1.f / 64, 1.f / 256, 0.5f, 1.f / 32};  // layers x kv_heads, layer-major
  shape.v_descale = {1.f / 256, 1.f / 16};                   // one per layer
  const std::vector<std::string> ids = Open(shape);
  ASSERT_EQ(ids.size(), 1u);
  auto info = client_->GetSequence(ids[0]);
  ASSERT_TRUE(info.ok()) << info.status();
  absl::StatusOr<client::SequenceShape> back = client::FromProto(info->shape());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->kv_format, KvFormat::kFp8E4M3);
  EXPECT_EQ(back->k_descale, shape.k_descale);
  EXPECT_EQ(back->v_descale, std::vector<float>({1.f / 256, 1.f / 256, 1.f / 16, 1.f / 16}));  // per head
  // In the first step the first query sees one key, so its O is that key's V as cached, far from V as sent.
  History h(shape.layers), as_sent(shape.layers);
  StepAndCheck(ids[0], h, shape, 0, 8, true, 61, &as_sent);
  uint64_t seed = 600;
  StepAndCheck(ids[0], h, shape, 1, 37, true, ++seed);
  for (int step = 0; step < 3; ++step) {
    for (int64_t layer = 0; layer < shape.layers; ++layer) StepAndCheck(ids[0], h, shape, layer, 1, step % 2, ++seed);
  }
  ASSERT_TRUE(client_->CloseSequence(ids).ok());
  // Descales the server refuses, each naming its field.
  for (const auto& [k_descale, v_descale, field] :
       {std::tuple<std::vector<float>, std::vector<float>, std::string>{{}, {1.f}, "shape.k_descale"},
        {{1.f, 1.f, 1.f}, {1.f}, "shape.k_descale"},
        {{1.f}, {0.f}, "shape.v_descale[0]"},
        {{1.f, -1.f}, {1.f}, "shape.k_descale[1]"}}) {
    client::SequenceShape bad = shape;
    bad.k_descale = k_descale;
    bad.v_descale = v_descale;
    auto refused = client_->OpenSequence(bad);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << field << ": " << refused.status();
    EXPECT_TRUE(absl::StartsWith(refused.status().message(), field)) << refused.status();
  }
  client::SequenceShape sixteen = TestShape();
  sixteen.k_descale = {1.f};
  auto refused = client_->OpenSequence(sixteen);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_TRUE(absl::StartsWith(refused.status().message(), "shape.k_descale")) << refused.status();
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
    // The device keeps the order only where the backend can (the CUDA backend). A refusal is not admitted: the
    // admitted word, which a caller pipelining over two channels waits on, stays, and the reply says why.
    EXPECT_FALSE(info->device_ordered_steps());
    v1::StepRequest on_device = r;
    on_device.mutable_order()->set_device(true);
    refused = (*channel)->Step(on_device);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
    EXPECT_TRUE(absl::StrContains(refused.status().message(), "order.device")) << refused.status();
    EXPECT_EQ((*channel)->admitted_word()->load(), 0u);
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
  so.network.unix_socket = absl::StrCat(::testing::TempDir(), "/attnd_order_", ::getpid(), ".sock");
  so.shm.socket = absl::StrCat(::testing::TempDir(), "/attnd_order_", ::getpid(), ".shm");
  so.sequences.order_timeout = absl::Milliseconds(200);
  server::BackendOptions bo;
  bo.threads = 2;
  auto backend = server::MakeBackend("cpu", bo);
  ASSERT_TRUE(backend.ok()) << backend.status();
  auto srv = server::Server::Create(so, std::move(*backend));
  ASSERT_TRUE(srv.ok()) << srv.status();
  auto c = Connect(absl::StrCat("unix:", so.network.unix_socket));
  const client::SequenceShape shape = TestShape();
  auto opened = c->OpenSequence(shape);
  ASSERT_TRUE(opened.ok()) << opened.status();
  client::ShmChannelOptions co;
  co.socket_path = so.shm.socket;
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

TEST_P(SequencesTest, RunSequenceVerifiesFloat8Steps) {
  client::SeqRunOptions o;
  o.shape = TestShape(3);
  o.shape.kv_format = KvFormat::kFp8E4M3;
  o.shape.k_descale = {1.f / 64, 1.f / 256, 1.f / 8};  // per layer; 1/256 saturates the larger rows
  o.shape.v_descale = {1.f / 128};
  o.q_heads = kQHeads;
  o.prefill = 24;
  o.steps = 3;
  o.verify = true;
  o.want_lse = true;
  auto r = client::RunSequence(*client_, o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->verified, 3 * (1 + 3));
  EXPECT_EQ(r->verify_failures, 0) << r->first_verify_failure;
  EXPECT_EQ(r->final_lengths, std::vector<int64_t>({27, 27, 27}));
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

TEST_P(SequencesTest, AttnSeqAndDecodeBench) {
  const std::string common = CliTarget();
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

// attn seq --verify and the decode bench over float8 caches (--kv_dtype=fp8_e4m3, the default --kv_descale), and
// the flags' refusals.
TEST_P(SequencesTest, AttnSeqAndDecodeBenchFloat8) {
  const std::string common = CliTarget();
  const std::string shape = " --layers=2 --q_heads=4 --kv_heads=2 --head_dim=64 --kv_dtype=fp8_e4m3";
  auto [rc, out] = RunCommand(absl::StrCat(ATTN_BINARY, " seq --verify --lse --prefill=24 --steps=3", common, shape));
  EXPECT_EQ(rc, 0) << out;
  EXPECT_TRUE(absl::StrContains(out, "verified: 8 layer-steps, 0 failed")) << out;
  // A descale that saturates most rows (|x| >= 448 / 1024): the reference quantizes them as the cache does.
  auto [s_rc, s_out] = RunCommand(absl::StrCat(ATTN_BINARY, " seq --verify --prefill=8 --steps=2 --dtype=fp16",
                                               " --kv_descale=", 1.0 / 1024, common, shape));
  EXPECT_EQ(s_rc, 0) << s_out;
  EXPECT_TRUE(absl::StrContains(s_out, "verified: 6 layer-steps, 0 failed")) << s_out;

  const std::string json =
      absl::StrCat(::testing::TempDir(), "/attn_decode_fp8_", ::getpid(), "_", ViaName(GetParam()), ".json");
  auto [b_rc, b_out] = RunCommand(absl::StrCat(ATTN_BINARY, " bench --workload=decode --sequences=2 --context=16 "
                                               "--steps=2 --progress=false --json=", json, common, shape));
  EXPECT_EQ(b_rc, 0) << b_out;
  EXPECT_TRUE(absl::StrContains(b_out, "Step calls: 8 ok, 0 errors")) << b_out;
  EXPECT_TRUE(absl::StrContains(b_out, "bf16, fp8_e4m3 K/V cache")) << b_out;
  std::FILE* f = std::fopen(json.c_str(), "r");
  ASSERT_NE(f, nullptr);
  char buf[4096] = {};
  const size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  std::remove(json.c_str());
  EXPECT_TRUE(absl::StrContains(std::string(buf, n), "\"kv_dtype\": \"fp8_e4m3\"")) << buf;

  for (const char* bad : {" --kv_descale=0", " --kv_descale=-1", " --kv_dtype=fp16", " --kv_dtype=int8"}) {
    auto [bad_rc, bad_out] = RunCommand(absl::StrCat(ATTN_BINARY, " seq", common, shape, bad));
    EXPECT_EQ(bad_rc, 1) << bad << ": " << bad_out;
    EXPECT_TRUE(absl::StrContains(bad_out, std::string(bad).substr(1, std::string(bad).find('=') - 1))) << bad_out;
  }
}

INSTANTIATE_TEST_SUITE_P(Transports, SequencesTest,
                         ::testing::Values(Via::kTcp, Via::kTcpUnary, Via::kUnix, Via::kShm),
                         [](const auto& info) { return std::string(ViaName(info.param)); });

}  // namespace
}  // namespace attnd::e2e
