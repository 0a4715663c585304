// The streaming path end to end: a server with a 1 MiB message limit, requests several times that size
// (which the unary RPC cannot carry), the client's automatic choice of transport, and odd chunk sizes.
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "e2e_util.h"
#include "grpcpp/grpcpp.h"

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

// A server that answers every ForwardStream with a scripted reply, to see the client check what it gets.
class ScriptedReplies final : public v1::Attention::WithRawCallbackMethod_ForwardStream<v1::Attention::Service> {
 public:
  explicit ScriptedReplies(std::vector<std::string> messages) : messages_(std::move(messages)) {}

  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* ForwardStream(grpc::CallbackServerContext*) override {
    class Reactor final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
     public:
      explicit Reactor(const std::vector<std::string>* m) : messages_(m) { StartRead(&in_); }
      void OnReadDone(bool ok) override {
        if (ok) return StartRead(&in_);
        Next();  // the request is in: reply
      }
      void OnWriteDone(bool ok) override {
        if (!ok) return Finish(grpc::Status::CANCELLED);
        Next();
      }
      void OnDone() override { delete this; }

     private:
      void Next() {
        if (next_ == messages_->size()) return Finish(grpc::Status::OK);
        grpc::Slice slice((*messages_)[next_++]);
        out_ = grpc::ByteBuffer(&slice, 1);
        StartWrite(&out_);
      }
      const std::vector<std::string>* messages_;
      size_t next_ = 0;
      grpc::ByteBuffer in_, out_;
    };
    return new Reactor(&messages_);
  }

 private:
  const std::vector<std::string> messages_;
};

TEST(StreamReplies, TheClientChecksWhatTheServerSends) {
  const client::RequestSpec spec = Spec(1, 4, 4, 1, 1, 64);  // O: 512 bytes, no LSE
  const Case c = MakeCase(spec, 30);
  const std::string o = client::RandomTensor(DType::kBF16, 256, 31);
  v1::ForwardStreamResponse header;
  header.mutable_header()->set_request_id("scripted");
  header.mutable_header()->set_backend("fake");
  auto chunk = [](v1::TensorName t, uint64_t offset, const std::string& data) {
    v1::ForwardStreamResponse m;
    m.mutable_chunk()->set_tensor(t);
    m.mutable_chunk()->set_offset(offset);
    m.mutable_chunk()->set_data(data);
    return m.SerializeAsString();
  };
  const std::string h = header.SerializeAsString();
  // The same first chunk with its fields in reverse order: valid protobuf, left to the parser.
  std::string reversed;
  {
    v1::TensorChunk data_only, head_only;
    data_only.set_data(o.substr(0, 200));
    head_only.set_tensor(v1::TENSOR_NAME_O);
    const std::string inner = data_only.SerializeAsString() + head_only.SerializeAsString();
    ASSERT_GE(inner.size(), 128u);  // a two-byte length varint
    ASSERT_LT(inner.size(), 16384u);
    reversed = std::string("\x12") + static_cast<char>((inner.size() & 0x7f) | 0x80) +
               static_cast<char>(inner.size() >> 7) + inner;
  }
  struct Script {
    std::string name;
    std::vector<std::string> messages;
    std::string error;  // empty: the call succeeds and O is `o`
  };
  const std::vector<Script> scripts = {
      {"in one chunk", {h, chunk(v1::TENSOR_NAME_O, 0, o)}, ""},
      {"in three chunks", {h, chunk(v1::TENSOR_NAME_O, 0, o.substr(0, 100)), chunk(v1::TENSOR_NAME_O, 100, o.substr(100, 300)),
                           chunk(v1::TENSOR_NAME_O, 400, o.substr(400))}, ""},
      {"unusual encoding", {h, reversed, chunk(v1::TENSOR_NAME_O, 200, o.substr(200))}, ""},
      {"chunk first", {chunk(v1::TENSOR_NAME_O, 0, o)}, "before the response header"},
      {"a gap", {h, chunk(v1::TENSOR_NAME_O, 0, o.substr(0, 100)), chunk(v1::TENSOR_NAME_O, 200, o.substr(200))}, "chunk at offset 200, expected 100"},
      {"too long", {h, chunk(v1::TENSOR_NAME_O, 0, o + "xy")}, "longer than the 512 bytes"},
      {"an input tensor", {h, chunk(v1::TENSOR_NAME_Q, 0, o)}, "a response chunk of tensor"},
      {"two headers", {h, h}, "a second response header"},
      {"short", {h, chunk(v1::TENSOR_NAME_O, 0, o.substr(0, 500))}, "500 bytes of O, expected 512"},
      {"no header at all", {}, "without a header"},
  };
  for (const Script& script : scripts) {
    SCOPED_TRACE(script.name);
    ScriptedReplies service(script.messages);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service);
    std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
    ASSERT_NE(server, nullptr);
    auto client = Connect(absl::StrCat("127.0.0.1:", port), client::Transport::kStream);
    ASSERT_NE(client, nullptr);
    // Owned (futures) and borrowed (blocking) requests take the same reading path.
    for (bool owned : {true, false}) {
      auto r = owned ? client->ForwardFuture(c.request).get() : client->Forward(*c.request);
      if (script.error.empty()) {
        ASSERT_TRUE(r.ok()) << r.status();
        EXPECT_TRUE(r->o == o);
        EXPECT_EQ(r->request_id, "scripted");
      } else {
        ASSERT_FALSE(r.ok());
        EXPECT_TRUE(absl::StrContains(r.status().message(), script.error)) << r.status();
      }
    }
    server->Shutdown();
  }
}

INSTANTIATE_TEST_SUITE_P(Listeners, StreamTest, ::testing::Values(Listener::kTcp, Listener::kUnix),
                         [](const auto& info) { return std::string(ListenerName(info.param)); });

}  // namespace
}  // namespace attnd::e2e
