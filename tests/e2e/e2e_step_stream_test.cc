// StepStream end to end: steps over one long-lived stream against a server of each test's own, with bad steps,
// cancelled and late ones, a stream the server ended, and a server without StepStream.
#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "e2e_sequences_util.h"
#include "e2e_util.h"
#include "gated_backend.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"

namespace attnd::e2e {
namespace {

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
    v1::SequenceInfo info;
    ASSERT_TRUE(GetSequenceAsSent(stub.get(), id_, &ctx, &info).ok());
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
