// The streaming path end to end: a server with a 1 MiB message limit, requests several times that size
// (which the unary RPC cannot carry), the client's automatic choice of transport, and odd chunk sizes.
#include <string>

#include "e2e_util.h"

namespace attnd::e2e {
namespace {

constexpr uint64_t kLimit = 1 << 20;

class StreamTest : public SharedServerSuite<::testing::TestWithParam<Listener>, kLimit> {};

// Q 512 KiB, K and V 1 MiB each: 2.5 MiB of request against a 1 MiB message limit.
client::RequestSpec BigSpec() { return Spec(1, 512, 1024, 4, 4, 128, Mask::kCausalBottomRight, /*lse=*/true); }

TEST_P(StreamTest, TensorLargerThanTheUnaryLimitStreamsAndIsCorrect) {
  auto client = Connect(server_->Target(GetParam()));
  ASSERT_NE(client, nullptr);
  const Case c = MakeCase(BigSpec(), 1);
  ASSERT_GT(c.request->ByteSizeLong(), 2 * kLimit);
  auto r = client->Forward(*c.request);
  EXPECT_EQ(CheckReply(c, r), "");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->transport, client::Transport::kStream);
  EXPECT_EQ(r->o.size(), c.spec.o_bytes());
  EXPECT_EQ(r->lse.size(), c.spec.lse_bytes());
  EXPECT_EQ(r->bytes_sent, c.spec.q_bytes() + 2 * c.spec.kv_bytes());
}

TEST_P(StreamTest, ForcedUnaryOverTheLimitIsResourceExhausted) {
  auto client = Connect(server_->Target(GetParam()), client::Transport::kUnary);
  ASSERT_NE(client, nullptr);
  const Case c = MakeCase(BigSpec(), 2);
  auto r = client->Forward(*c.request);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
}

TEST_P(StreamTest, AutoPicksUnaryWhenItFitsAndStreamWhenNot) {
  auto client = Connect(server_->Target(GetParam()));
  ASSERT_NE(client, nullptr);
  const Case small = MakeCase(Spec(1, 64, 64, 4, 4, 64), 3);
  const Case big = MakeCase(BigSpec(), 4);
  auto ts = client->ChooseTransport(*small.request);
  auto tb = client->ChooseTransport(*big.request);
  ASSERT_TRUE(ts.ok()) << ts.status();
  ASSERT_TRUE(tb.ok()) << tb.status();
  EXPECT_EQ(*ts, client::Transport::kUnary);
  EXPECT_EQ(*tb, client::Transport::kStream);
  auto rs = client->Forward(*small.request);
  EXPECT_EQ(CheckReply(small, rs), "");
  if (rs.ok()) {
    EXPECT_EQ(rs->transport, client::Transport::kUnary);
  }
}

// Chunk boundaries that split 16-bit elements and do not divide the tensors must not matter.
TEST_P(StreamTest, OddSmallChunksReassembleExactly) {
  auto client = Connect(server_->Target(GetParam()), client::Transport::kStream, /*chunk_bytes=*/1001);
  ASSERT_NE(client, nullptr);
  const Case c = MakeCase(Spec(2, 33, 47, 4, 2, 64, Mask::kCausalTopLeft, true), 5);
  auto r = client->Forward(*c.request);
  EXPECT_EQ(CheckReply(c, r), "");
  if (r.ok()) {
    EXPECT_EQ(r->transport, client::Transport::kStream);
  }
  // The same request over unary gives the same bytes: the transport does not change the answer.
  client::CallOptions unary;
  unary.transport = client::Transport::kUnary;
  auto u = client->Forward(*c.request, unary);
  ASSERT_TRUE(u.ok() && r.ok());
  EXPECT_EQ(u->o, r->o);
  EXPECT_EQ(u->lse, r->lse);
}

TEST_P(StreamTest, AsyncStreamsInParallel) {
  auto client = Connect(server_->Target(GetParam()), client::Transport::kStream, 64 << 10);
  ASSERT_NE(client, nullptr);
  std::vector<Case> cases;
  std::vector<std::future<absl::StatusOr<client::ForwardResult>>> futures;
  for (int i = 0; i < 4; ++i) cases.push_back(MakeCase(Spec(1, 96 + i, 200, 4, 1, 64, Mask::kNone, i % 2), 10 + i));
  for (const auto& c : cases) futures.push_back(client->ForwardFuture(c.request));
  for (size_t i = 0; i < cases.size(); ++i) EXPECT_EQ(CheckReply(cases[i], futures[i].get()), "") << i;
}

INSTANTIATE_TEST_SUITE_P(Listeners, StreamTest, ::testing::Values(Listener::kTcp, Listener::kUnix),
                         [](const auto& info) { return std::string(ListenerName(info.param)); });

}  // namespace
}  // namespace attnd::e2e
