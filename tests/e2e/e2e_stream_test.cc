// The streaming path end to end: a server with a 1 MiB message limit, requests several times that size
// (which the unary RPC cannot carry), the client's automatic choice of transport, and odd chunk sizes.
#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "e2e_util.h"
#include "forwarding_backend.h"
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

// Refused by the client before it sends the 2.5 MiB (gRPC's own refusal, after the bytes, reads "Received message
// larger than max"), naming the limit and the way out; the same for the client's own send limit.
TEST_P(StreamTest, ForcedUnaryOverTheLimitIsResourceExhausted) {
  auto client = Connect(server_->Target(GetParam()), client::Transport::kUnary);
  ASSERT_NE(client, nullptr);
  const Case c = MakeCase(BigSpec(), 2);
  auto r = client->Forward(*c.request);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  EXPECT_TRUE(absl::StrContains(r.status().message(), absl::StrCat("above the server's max_message_bytes of ", kLimit)))
      << r.status();
  EXPECT_TRUE(absl::StrContains(r.status().message(), "transport stream")) << r.status();

  client::ClientOptions o;
  o.target = server_->Target(GetParam());
  o.transport = client::Transport::kUnary;
  o.max_send_message_bytes = 100000;
  auto capped = client::Client::Create(o);
  ASSERT_TRUE(capped.ok()) << capped.status();
  auto small = (*capped)->Forward(*MakeCase(Spec(1, 32, 32, 2, 2, 64), 5).request);  // ~25 KB: still goes
  EXPECT_TRUE(small.ok()) << small.status();
  auto rc = (*capped)->Forward(*c.request);
  ASSERT_FALSE(rc.ok());
  EXPECT_EQ(rc.status().code(), absl::StatusCode::kResourceExhausted) << rc.status();
  EXPECT_TRUE(absl::StrContains(rc.status().message(), "above this client's max_send_message_bytes of 100000"))
      << rc.status();
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

// O and LSE into the caller's memory, in chunks that split elements: nothing lands in the result's strings,
// every byte lands in the caller's spans, and the bytes around them stay as they were.
TEST_P(StreamTest, OutputsGoIntoTheCallersMemoryAcrossChunks) {
  const Case c = MakeCase(BigSpec(), 8);
  for (uint64_t chunk : {uint64_t{0}, uint64_t{4099}}) {
    SCOPED_TRACE(chunk);
    auto client = Connect(server_->Target(GetParam()), client::Transport::kStream, chunk);
    ASSERT_NE(client, nullptr);
    const uint64_t o = c.spec.o_bytes(), lse = c.spec.lse_bytes();
    // NaN bit patterns (bf16 and fp32 alike) around and in the outputs: a byte left unwritten fails the check.
    std::string memory(8 + o + 8 + lse + 8, '\xff');
    client::CallOptions call;
    call.outputs = client::ForwardOutputs{absl::Span<char>(memory.data() + 8, o),
                                          absl::Span<char>(memory.data() + 16 + o, lse)};
    auto r = client->Forward(*c.request, call);
    EXPECT_EQ(CheckReply(c, r), "");
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->transport, client::Transport::kStream);
    EXPECT_TRUE(r->o.empty() && r->lse.empty());
    ASSERT_TRUE(r->outputs.has_value());
    EXPECT_EQ(r->outputs->o.data(), memory.data() + 8);
    EXPECT_EQ(r->o_bytes().size(), o);
    EXPECT_EQ(r->lse_bytes().size(), lse);
    EXPECT_EQ(r->bytes_received, o + lse);
    for (size_t at : {size_t{0}, 8 + o, 16 + o + lse}) {
      EXPECT_EQ(memory.substr(at, 8), std::string(8, '\xff')) << "a byte written outside the outputs at " << at;
    }
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
    // Owned (futures) and borrowed (blocking) requests take the same reading path; so does O written into the
    // caller's memory, which must not be written past its end whatever the server sends.
    for (int way = 0; way < 3; ++way) {
      SCOPED_TRACE(way);
      const bool into_caller = way == 2;
      std::string memory(spec.o_bytes() + 64, '\xab');
      client::CallOptions call;
      if (into_caller) call.outputs = client::ForwardOutputs{absl::Span<char>(memory.data(), spec.o_bytes()), {}};
      auto r = way == 0 ? client->ForwardFuture(c.request, call).get() : client->Forward(*c.request, call);
      if (script.error.empty()) {
        ASSERT_TRUE(r.ok()) << r.status();
        EXPECT_TRUE(r->o_bytes() == o);
        EXPECT_EQ(r->o.empty(), into_caller);
        EXPECT_EQ(r->outputs.has_value(), into_caller);
        EXPECT_EQ(r->request_id, "scripted");
      } else {
        ASSERT_FALSE(r.ok());
        EXPECT_TRUE(absl::StrContains(r.status().message(), script.error)) << r.status();
      }
      EXPECT_EQ(memory.substr(spec.o_bytes()), std::string(64, '\xab')) << "written past the caller's O";
    }
    server->Shutdown();
  }
}

// The CPU backend with the stream preference a CUDA backend reports under --stream_to_device, changeable
// while it serves.
class PrefersStreams final : public testing::ForwardingBackend {
 public:
  PrefersStreams(std::unique_ptr<server::Backend> inner, std::shared_ptr<std::atomic<uint64_t>> from_bytes)
      : ForwardingBackend(std::move(inner)), from_bytes_(std::move(from_bytes)) {}
  uint64_t stream_preferred_from_bytes() const override { return from_bytes_->load(); }

 private:
  const std::shared_ptr<std::atomic<uint64_t>> from_bytes_;
};

// Calls of `method` the server has finished: which RPC carried a call, as the server saw it.
uint64_t ServerCalls(client::Client& c, const std::string& method) {
  auto stats = c.Stats();
  EXPECT_TRUE(stats.ok()) << stats.status();
  if (!stats.ok()) return 0;
  for (const auto& rpc : stats->rpcs()) {
    if (rpc.method() == method) return rpc.count();
  }
  return 0;
}

struct Carried {
  uint64_t unary = 0, stream = 0;
};
Carried ServerCalls(client::Client& c) { return {ServerCalls(c, "Forward"), ServerCalls(c, "ForwardStream")}; }

// A CPU server whose backend reports *from as its stream preference, and a client of it (null if either failed).
std::unique_ptr<client::Client> StartPreferringStreams(TestServer* srv, std::shared_ptr<std::atomic<uint64_t>> from) {
  StartServer(srv, 64ull << 20, 2, 256, false, [from](std::unique_ptr<server::Backend> cpu) {
    return std::unique_ptr<server::Backend>(new PrefersStreams(std::move(cpu), from));
  });
  if (srv->server == nullptr) return nullptr;
  return Connect(srv->Target(Listener::kTcp));
}

TEST(StreamPreference, AutoStreamsFromTheServersThresholdAndSendsUnaryBelowIt) {
  auto from = std::make_shared<std::atomic<uint64_t>>(0);
  TestServer srv;
  auto client = StartPreferringStreams(&srv, from);
  ASSERT_NE(client, nullptr);
  // 96 KiB of inline tensors: far below the 64 MiB message limit, so without a preference it goes unary.
  const Case c = MakeCase(Spec(1, 64, 128, 4, 2, 64), 40);
  const uint64_t inline_bytes = c.spec.q_bytes() + 2 * c.spec.kv_bytes();
  ASSERT_EQ(inline_bytes, 96u << 10);
  const auto q = std::make_shared<const std::string>(c.request->q().data());
  const auto k = std::make_shared<const std::string>(c.request->k().data());
  const auto v = std::make_shared<const std::string>(c.request->v().data());

  struct Step {
    uint64_t from_bytes;
    client::Transport want;
  };
  // At the threshold exactly, one byte short of it, with no preference, and well above it.
  for (const Step& step : {Step{inline_bytes, client::Transport::kStream},
                           Step{inline_bytes + 1, client::Transport::kUnary}, Step{0, client::Transport::kUnary},
                           Step{inline_bytes / 2, client::Transport::kStream}}) {
    SCOPED_TRACE(absl::StrCat("stream_preferred_from_bytes ", step.from_bytes));
    from->store(step.from_bytes);
    auto info = client->ServerInfo(/*refresh=*/true);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->stream_preferred_from_bytes(), step.from_bytes);  // what the backend says, as is
    auto chosen = client->ChooseTransport(*c.request);
    ASSERT_TRUE(chosen.ok()) << chosen.status();
    EXPECT_STREQ(client::TransportName(*chosen), client::TransportName(step.want));

    // A request (copied: the blocking Forward) and tensors in the caller's own memory (ForwardInputs) take
    // the transport ChooseTransport named, and the server counts them under that RPC.
    const Carried before = ServerCalls(*client);
    auto r = client->Forward(*c.request);
    EXPECT_EQ(CheckReply(c, r), "");
    if (r.ok()) {
      EXPECT_STREQ(client::TransportName(r->transport), client::TransportName(step.want));
    }
    auto keep = std::make_shared<std::vector<std::shared_ptr<const std::string>>>(
        std::vector<std::shared_ptr<const std::string>>{q, k, v});
    auto u = client->ForwardFuture(c.spec, client::ForwardInputs{*q, *k, *v, keep}).get();
    EXPECT_EQ(CheckReply(c, u), "");
    if (u.ok()) {
      EXPECT_STREQ(client::TransportName(u->transport), client::TransportName(step.want));
    }
    const Carried after = ServerCalls(*client);
    const bool streamed = step.want == client::Transport::kStream;
    EXPECT_EQ(after.stream - before.stream, streamed ? 2u : 0u);
    EXPECT_EQ(after.unary - before.unary, streamed ? 0u : 2u);
  }
}

// References carry a few bytes each and are staged when the request runs (the device sink takes only
// all-inline requests), so requests naming a buffer stay unary whatever their inline bytes. The CPU backend
// refuses them, but the server still counts which RPC brought them.
TEST(StreamPreference, RequestsNamingBuffersStayUnary) {
  auto from = std::make_shared<std::atomic<uint64_t>>(1);  // any inline byte at all would stream
  TestServer srv;
  auto client = StartPreferringStreams(&srv, from);
  ASSERT_NE(client, nullptr);
  const Case c = MakeCase(Spec(1, 64, 128, 4, 2, 64), 41);
  v1::TensorRef ref;
  ref.set_buffer_id("registered");
  struct Variant {
    std::string name;
    v1::ForwardRequest request;
  };
  std::vector<Variant> variants;
  {
    v1::ForwardRequest r = *c.request;
    *r.mutable_q()->mutable_ref() = ref;
    *r.mutable_k()->mutable_ref() = ref;
    *r.mutable_v()->mutable_ref() = ref;
    variants.push_back({"all references", r});
  }
  {
    v1::ForwardRequest r = *c.request;
    *r.mutable_k()->mutable_ref() = ref;
    *r.mutable_v()->mutable_ref() = ref;
    variants.push_back({"q inline, k and v references", r});
  }
  {
    v1::ForwardRequest r = *c.request;
    *r.mutable_o_ref() = ref;
    variants.push_back({"inline inputs, O into a buffer", r});
  }
  // The control: the same request with nothing registered streams.
  auto control = client->ChooseTransport(*c.request);
  ASSERT_TRUE(control.ok()) << control.status();
  EXPECT_STREQ(client::TransportName(*control), client::TransportName(client::Transport::kStream));
  for (const Variant& variant : variants) {
    SCOPED_TRACE(variant.name);
    auto chosen = client->ChooseTransport(variant.request);
    ASSERT_TRUE(chosen.ok()) << chosen.status();
    EXPECT_STREQ(client::TransportName(*chosen), client::TransportName(client::Transport::kUnary));
    const Carried before = ServerCalls(*client);
    auto r = client->Forward(variant.request);
    EXPECT_FALSE(r.ok());  // the CPU backend serves no references
    const Carried after = ServerCalls(*client);
    EXPECT_EQ(after.unary - before.unary, 1u);
    EXPECT_EQ(after.stream - before.stream, 0u);
  }
}

// The CPU backend has no device sink, so it states no preference even though BackendOptions carries the CUDA
// default: kAuto keeps sending what fits one message as unary, also above that default.
TEST(StreamPreference, TheCpuBackendStatesNoneAndAutoStaysUnaryWhatFits) {
  TestServer srv;
  StartServer(&srv, 64ull << 20);
  ASSERT_NE(srv.server, nullptr);
  ASSERT_GT(server::BackendOptions().stream_preferred_from_bytes, 0u);
  auto client = Connect(srv.Target(Listener::kUnix));
  ASSERT_NE(client, nullptr);
  auto info = client->ServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->backend(), "cpu");
  EXPECT_EQ(info->stream_preferred_from_bytes(), 0u);
  // 16 MiB of K and V: above the CUDA default, well inside the 64 MiB message limit.
  const Case c = MakeCase(Spec(1, 16, 16384, 4, 4, 64), 42);
  ASSERT_GT(c.spec.q_bytes() + 2 * c.spec.kv_bytes(), server::BackendOptions().stream_preferred_from_bytes);
  auto chosen = client->ChooseTransport(*c.request);
  ASSERT_TRUE(chosen.ok()) << chosen.status();
  EXPECT_STREQ(client::TransportName(*chosen), client::TransportName(client::Transport::kUnary));
  const Carried before = ServerCalls(*client);
  auto r = client->Forward(*c.request);
  EXPECT_EQ(CheckReply(c, r), "");
  if (r.ok()) {
    EXPECT_STREQ(client::TransportName(r->transport), client::TransportName(client::Transport::kUnary));
  }
  const Carried after = ServerCalls(*client);
  EXPECT_EQ(after.unary - before.unary, 1u);
  EXPECT_EQ(after.stream - before.stream, 0u);
}

// The CPU backend lending O as the CUDA backend lends its pinned block (ForwardJob::o_loan): O is moved into
// memory of the test's own, `o` is left empty, and every loan counts itself back in when it is dropped.
class LendsO final : public testing::ForwardingBackend {
 public:
  struct Loans {
    std::atomic<int> made{0}, returned{0};
  };
  LendsO(std::unique_ptr<server::Backend> inner, std::shared_ptr<Loans> loans)
      : ForwardingBackend(std::move(inner)), loans_(std::move(loans)) {}
  absl::Status Submit(std::unique_ptr<server::ForwardJob> job) override {
    server::ForwardJob* j = job.get();
    j->done = [j, loans = loans_, done = std::move(j->done)](absl::Status status) {
      if (status.ok() && j->accepts_lent_o && !j->o.empty()) {
        auto memory = std::make_shared<std::string>(std::move(j->o));
        j->o.clear();
        j->o_lent = *memory;
        loans->made.fetch_add(1);
        j->o_loan = std::shared_ptr<const void>(memory->data(), [memory, loans](const void*) {
          memory->assign(memory->size(), '\xff');  // a reply that read it after the loan ended would be wrong
          loans->returned.fetch_add(1);
        });
      }
      done(status);
    };
    return ForwardingBackend::Submit(std::move(job));
  }

 private:
  const std::shared_ptr<Loans> loans_;
};

// ForwardStream takes a loan of O (its chunks point into it), unary Forward does not (its reply references
// `o`); either way the reply is right, and every loan is returned once gRPC has sent its stream's chunks. A
// loan returned while a chunk still pointed into it would have sent the poison (0xff) written on return.
TEST(StreamReplies, LentOutputsAreSentFromTheLoanAndReturned) {
  auto loans = std::make_shared<LendsO::Loans>();
  TestServer srv;
  StartServer(&srv, 64ull << 20, 2, 256, false, [loans](std::unique_ptr<server::Backend> cpu) {
    return std::unique_ptr<server::Backend>(new LendsO(std::move(cpu), loans));
  });
  ASSERT_NE(srv.server, nullptr);
  auto client = Connect(srv.Target(Listener::kTcp));
  ASSERT_NE(client, nullptr);
  // 3 MiB of O (three 1 MiB chunks and a last partial one) over few keys, so the CPU computes it quickly.
  const Case c = MakeCase(Spec(1, 4097, 17, 6, 2, 64), 43);
  client::CallOptions stream, unary;
  stream.transport = client::Transport::kStream;
  unary.transport = client::Transport::kUnary;
  for (int i = 0; i < 3; ++i) {
    auto r = client->Forward(*c.request, stream);
    EXPECT_EQ(CheckReply(c, r), "") << i;
  }
  EXPECT_EQ(loans->made.load(), 3);
  auto u = client->Forward(*c.request, unary);
  EXPECT_EQ(CheckReply(c, u), "");
  EXPECT_EQ(loans->made.load(), 3);  // unary replies reference `o`: no loan
  // The last slices may be released just after the client has read them: wait a while for the returns.
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (loans->returned.load() < 3 && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(loans->returned.load(), 3);
}

INSTANTIATE_TEST_SUITE_P(Listeners, StreamTest, ::testing::Values(Listener::kTcp, Listener::kUnix),
                         [](const auto& info) { return std::string(ListenerName(info.param)); });

}  // namespace
}  // namespace attnd::e2e
