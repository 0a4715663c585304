// KV sequences end to end on servers of a test's own (a small pool, a small message limit, a second server that
// sequences are pinned to with '@address'), and the client's own rules about sequence ids and replies.
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "e2e_sequences_util.h"
#include "e2e_util.h"

namespace attnd::e2e {
namespace {

// ---- Servers of their own: a small pool, and a second server that sequences are pinned to.

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

}  // namespace
}  // namespace attnd::e2e
