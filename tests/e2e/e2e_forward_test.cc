// End to end through the client library against an in-process server, over a loopback port and a unix
// socket: answers checked against the double-precision reference for every mask, GQA ratio and head dim,
// async calls, statuses of bad requests as the client sees them, health, reflection and the IPC RPCs.
#include <algorithm>
#include <future>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "e2e_util.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/completion_queue.h"

namespace attnd::e2e {
namespace {

class ForwardTest : public SharedServerSuite<::testing::TestWithParam<Listener>> {
 protected:
  void SetUp() override {
    SharedServerSuite::SetUp();
    if (HasFatalFailure()) return;
    client_ = Connect(server_->Target(GetParam()));
    ASSERT_NE(client_, nullptr);
  }

  std::unique_ptr<client::Client> client_;
};

TEST_P(ForwardTest, MatchesReferenceAcrossMasksGqaHeadDimsAndLengths) {
  struct Shape6 {
    int64_t b, lq, lk, hq, hkv, d;
  };
  const std::vector<Shape6> shapes = {
      {1, 1, 1, 1, 1, 64},     {2, 17, 17, 4, 1, 64},   {1, 64, 65, 8, 8, 128}, {1, 65, 127, 8, 1, 64},
      {2, 127, 64, 4, 4, 128}, {1, 100, 33, 8, 2, 128},
  };
  const Mask masks[] = {Mask::kNone, Mask::kCausalTopLeft, Mask::kCausalBottomRight};
  uint64_t seed = 100;
  for (const auto& s : shapes) {
    for (Mask m : masks) {
      for (bool lse : {false, true}) {
        const Case c = MakeCase(Spec(s.b, s.lq, s.lk, s.hq, s.hkv, s.d, m, lse), ++seed);
        auto r = client_->Forward(*c.request);
        SCOPED_TRACE(absl::StrCat("b=", s.b, " lq=", s.lq, " lk=", s.lk, " hq=", s.hq, " hkv=", s.hkv, " d=", s.d,
                                  " mask=", MaskName(m), " lse=", lse));
        EXPECT_EQ(CheckReply(c, r), "");
        if (r.ok()) {
          EXPECT_EQ(r->backend, "cpu");
          EXPECT_EQ(r->transport, client::Transport::kUnary);  // small requests go unary
          EXPECT_GE(r->timing.total_us(), r->timing.kernel_us());
          EXPECT_GT(r->timing.kernel_us(), 0);
        }
      }
    }
  }
}

TEST_P(ForwardTest, ExplicitScaleAndFp16) {
  client::RequestSpec s = Spec(1, 33, 48, 4, 2, 64, Mask::kCausalBottomRight, true);
  s.scale = 0.37f;
  Case c = MakeCase(s, 7);
  EXPECT_EQ(CheckReply(c, client_->Forward(*c.request)), "");

  client::RequestSpec h = Spec(1, 40, 40, 2, 2, 128, Mask::kCausalTopLeft);
  h.dtype = DType::kFP16;
  auto info = client_->ServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  bool fp16 = false;
  for (int t : info->supported_dtypes()) fp16 |= t == v1::DTYPE_FP16;
  if (!fp16) GTEST_SKIP() << "server does not accept fp16";
  Case hc = MakeCase(h, 8);
  EXPECT_EQ(CheckReply(hc, client_->Forward(*hc.request)), "");
}

TEST_P(ForwardTest, RequestIdIsEchoed) {
  client::RequestSpec s = Spec(1, 8, 8, 2, 2, 64);
  s.request_id = "req-e2e-42";
  Case c = MakeCase(s, 9);
  auto r = client_->Forward(*c.request);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->request_id, "req-e2e-42");
}

TEST_P(ForwardTest, AsyncCallbacksAndFuturesAllCorrect) {
  std::vector<Case> cases;
  for (int i = 0; i < 8; ++i) {
    cases.push_back(MakeCase(Spec(1, 40 + i, 70 - i, 4, i % 2 ? 1 : 4, i % 3 ? 64 : 128,
                                  static_cast<Mask>(i % 3), i % 2 == 0),
                             200 + i));
  }
  std::vector<std::promise<std::string>> verdicts(cases.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    client_->ForwardAsync(cases[i].request, [&, i](absl::StatusOr<client::ForwardResult> r) {
      verdicts[i].set_value(CheckReply(cases[i], r));
    });
  }
  std::vector<std::future<absl::StatusOr<client::ForwardResult>>> futures;
  for (const auto& c : cases) futures.push_back(client_->ForwardFuture(c.request));
  for (size_t i = 0; i < cases.size(); ++i) {
    EXPECT_EQ(verdicts[i].get_future().get(), "") << "callback call " << i;
    EXPECT_EQ(CheckReply(cases[i], futures[i].get()), "") << "future call " << i;
  }
}

// The server validates; the client must hand its status through unchanged (code and field name).
TEST_P(ForwardTest, BadRequestsKeepTheirStatusThroughTheClient) {
  Case c = MakeCase(Spec(1, 16, 16, 4, 4, 64), 11);
  struct Bad {
    std::string name;
    std::function<void(v1::ForwardRequest&)> mutate;
    absl::StatusCode code;
    std::string field;
  };
  const std::vector<Bad> bad = {
      {"short q", [](v1::ForwardRequest& r) { r.mutable_q()->mutable_data()->resize(10); },
       absl::StatusCode::kInvalidArgument, "q"},
      {"zero batch", [](v1::ForwardRequest& r) { r.mutable_shape()->set_batch(0); }, absl::StatusCode::kInvalidArgument,
       "batch"},
      {"gqa", [](v1::ForwardRequest& r) { r.mutable_shape()->set_kv_heads(3); }, absl::StatusCode::kInvalidArgument,
       "kv_heads"},
      {"head_dim", [](v1::ForwardRequest& r) { r.mutable_shape()->set_head_dim(7); },
       absl::StatusCode::kInvalidArgument, "head_dim"},
      {"nan scale", [](v1::ForwardRequest& r) { r.set_softmax_scale(std::nanf("")); },
       absl::StatusCode::kInvalidArgument, "softmax_scale"},
      {"mask enum", [](v1::ForwardRequest& r) { r.set_mask(static_cast<v1::MaskType>(9)); },
       absl::StatusCode::kInvalidArgument, "mask"},
      {"unset mask", [](v1::ForwardRequest& r) { r.clear_mask(); }, absl::StatusCode::kInvalidArgument,
       "mask: MASK_TYPE_UNSPECIFIED"},
      {"unset dtype", [](v1::ForwardRequest& r) { r.clear_dtype(); }, absl::StatusCode::kInvalidArgument,
       "dtype: DTYPE_UNSPECIFIED"},
      {"missing v", [](v1::ForwardRequest& r) { r.clear_v(); }, absl::StatusCode::kInvalidArgument, "v"},
  };
  for (client::Transport t : {client::Transport::kUnary, client::Transport::kStream}) {
    for (const Bad& b : bad) {
      auto r = std::make_shared<v1::ForwardRequest>(*c.request);
      b.mutate(*r);
      client::CallOptions call;
      call.transport = t;
      // The blocking call borrows the request (serialised by copy); the future owns a share of it (unary:
      // serialised by reference, zero_copy.h). Both must carry the server's status unchanged.
      for (bool owned : {false, true}) {
        auto res = owned ? client_->ForwardFuture(r, call).get() : client_->Forward(*r, call);
        SCOPED_TRACE(absl::StrCat(b.name, " over ", client::TransportName(t), owned ? ", owned" : ", borrowed"));
        ASSERT_FALSE(res.ok());
        EXPECT_EQ(res.status().code(), b.code) << res.status();
        EXPECT_TRUE(absl::StrContains(res.status().message(), b.field)) << res.status();
      }
    }
  }
}

TEST_P(ForwardTest, AnOwnedRequestGoesByReferenceAndIsReleasedAfterTheCall) {
  // 1 MiB per tensor: far above what protobuf copies rather than references.
  Case c = MakeCase(Spec(1, 512, 512, 8, 8, 128, Mask::kCausalTopLeft, true), 13);
  auto request = std::make_shared<const v1::ForwardRequest>(*c.request);
  client::CallOptions call;
  call.transport = client::Transport::kUnary;
  for (int i = 0; i < 3; ++i) {
    auto r = client_->ForwardFuture(request, call).get();
    EXPECT_EQ(CheckReply(c, r), "") << "call " << i;
  }
  // gRPC may hold the slices a moment after the reply; then every share it had is gone.
  const absl::Time end = absl::Now() + absl::Seconds(10);
  while (request.use_count() > 1 && absl::Now() < end) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(request.use_count(), 1);
}

TEST_P(ForwardTest, ExpiredDeadlineIsDeadlineExceeded) {
  Case c = MakeCase(Spec(1, 256, 256, 8, 8, 128), 12);
  client::CallOptions call;
  call.deadline = absl::Microseconds(1);
  auto r = client_->Forward(*c.request, call);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
}

TEST_P(ForwardTest, ServerInfoStatsAndIpcPassthroughs) {
  auto info = client_->ServerInfo(/*refresh=*/true);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->backend(), "cpu");
  EXPECT_FALSE(info->version().empty());
  EXPECT_GT(info->limits().max_message_bytes(), 0u);
  EXPECT_FALSE(info->supported_head_dims().empty());

  Case c = MakeCase(Spec(1, 8, 8, 2, 2, 64), 13);
  ASSERT_TRUE(client_->Forward(*c.request).ok());
  auto stats = client_->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  uint64_t forwards = 0;
  for (const auto& rpc : stats->rpcs()) {
    if (rpc.method() == "Forward") forwards = rpc.count();
  }
  EXPECT_GE(forwards, 1u);

  v1::RegisterCudaBufferRequest reg;
  reg.set_ipc_handle(std::string(64, '\1'));
  reg.set_byte_size(1024);
  auto id = client_->RegisterCudaBuffer(reg);
  ASSERT_FALSE(id.ok());
  EXPECT_EQ(id.status().code(), absl::StatusCode::kFailedPrecondition) << id.status();
  absl::Status un = client_->UnregisterCudaBuffer("nope");
  EXPECT_FALSE(un.ok());
  auto list = client_->ListCudaBuffers();
  if (list.ok()) {
    EXPECT_TRUE(list->empty());
  } else {
    EXPECT_EQ(list.status().code(), absl::StatusCode::kFailedPrecondition) << list.status();
  }
}

TEST_P(ForwardTest, HealthAnswersServing) {
  EXPECT_TRUE(client_->CheckHealth("").ok());
  EXPECT_TRUE(client_->CheckHealth("attnd.v1.Attention").ok());
  absl::Status unknown = client_->CheckHealth("no.such.Service");
  EXPECT_EQ(unknown.code(), absl::StatusCode::kNotFound) << unknown;
}

// Reflection is checked with a hand-encoded ServerReflectionRequest{list_services: ""} over a generic bidi
// call on a completion queue: Debian ships no reflection.proto for the client side.
TEST_P(ForwardTest, ReflectionListsTheService) {
  grpc::GenericStub stub(client_->channel());
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  grpc::CompletionQueue cq;
  // Each step is started and then awaited on the queue before the next (one tag at a time).
  auto await = [&cq](intptr_t want) {
    void* tag = nullptr;
    bool ok = false;
    if (!cq.Next(&tag, &ok)) return false;
    return reinterpret_cast<intptr_t>(tag) == want && ok;
  };
  auto call = stub.PrepareCall(&ctx, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  ASSERT_NE(call, nullptr);
  call->StartCall(reinterpret_cast<void*>(1));
  ASSERT_TRUE(await(1));
  const std::string req("\x3a\x00", 2);  // field 7 (list_services), length 0
  grpc::Slice slice(req);
  grpc::ByteBuffer out(&slice, 1), in;
  call->Write(out, reinterpret_cast<void*>(2));
  ASSERT_TRUE(await(2));
  call->WritesDone(reinterpret_cast<void*>(3));
  ASSERT_TRUE(await(3));
  call->Read(&in, reinterpret_cast<void*>(4));
  ASSERT_TRUE(await(4));
  std::string reply;
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(in.Dump(&slices).ok());
  for (const auto& sl : slices) reply.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
  // Drain to the end of the stream, then the status.
  for (;;) {
    call->Read(&in, reinterpret_cast<void*>(5));
    if (!await(5)) break;
  }
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(6));
  ASSERT_TRUE(await(6));
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_TRUE(absl::StrContains(reply, "attnd.v1.Attention")) << "reflection reply of " << reply.size() << " bytes";
  cq.Shutdown();
  void* tag;
  bool ok;
  while (cq.Next(&tag, &ok)) {
  }
}

// The resolver-based targets users give: dns:/// (with the round-robin policy the client configures for
// it), ipv4: and a unix socket in URI form.
TEST_P(ForwardTest, TensorsInTheCallersOwnMemoryGoUncopiedOverBothRpcs) {
  Case c = MakeCase(Spec(1, 256, 320, 8, 2, 128, Mask::kCausalBottomRight, true), 15);
  // The caller's buffer: Q, K and V back to back in one allocation it manages itself.
  struct Buffer {
    std::string bytes;
  };
  auto buffer = std::make_shared<Buffer>();
  buffer->bytes = c.request->q().data() + c.request->k().data() + c.request->v().data();
  const std::string_view all = buffer->bytes;
  const size_t qn = c.request->q().data().size(), kn = c.request->k().data().size();
  std::weak_ptr<Buffer> watch = buffer;
  for (client::Transport t : {client::Transport::kUnary, client::Transport::kStream}) {
    client::ForwardInputs in{all.substr(0, qn), all.substr(qn, kn), all.substr(qn + kn), buffer};
    client::CallOptions call;
    call.transport = t;
    EXPECT_EQ(CheckReply(c, client_->ForwardFuture(c.spec, std::move(in), call).get()), "")
        << client::TransportName(t);
  }
  buffer.reset();
  const absl::Time end = absl::Now() + absl::Seconds(10);
  while (!watch.expired() && absl::Now() < end) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_TRUE(watch.expired()) << "the client kept the caller's buffer after the calls";
  // Without something to keep the bytes alive the call is refused before anything is sent.
  auto r = client_->ForwardFuture(c.spec, client::ForwardInputs{"q", "k", "v", nullptr}).get();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(r.status().message(), "keep_alive")) << r.status();
  // Wrong sizes are the server's to refuse, naming the tensor.
  auto owner = std::make_shared<std::string>("0123456789");
  auto w = client_->ForwardFuture(c.spec, client::ForwardInputs{*owner, *owner, *owner, owner}).get();
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument) << w.status();
}

// O and LSE written into memory the caller holds, over both RPCs and call after call into the same bytes
// (poisoned before each call, so a stale answer cannot pass); outputs of the wrong size are refused before
// anything is sent, naming the field.
TEST_P(ForwardTest, OutputsGoIntoTheCallersMemoryOverBothRpcs) {
  const Case cases[2] = {MakeCase(Spec(1, 96, 160, 8, 2, 64, Mask::kCausalBottomRight, true), 40),
                         MakeCase(Spec(2, 33, 70, 4, 4, 128), 41)};
  for (const Case& c : cases) {
    const uint64_t o = c.spec.o_bytes(), lse = c.spec.want_lse ? c.spec.lse_bytes() : 0;
    std::string memory(o + lse, '\0');
    for (client::Transport t : {client::Transport::kUnary, client::Transport::kStream, client::Transport::kUnary}) {
      SCOPED_TRACE(client::TransportName(t));
      std::fill(memory.begin(), memory.end(), '\xff');
      client::CallOptions call;
      call.transport = t;
      call.outputs = client::ForwardOutputs{absl::Span<char>(memory.data(), o), absl::Span<char>(memory.data() + o, lse)};
      auto r = client_->Forward(*c.request, call);
      EXPECT_EQ(CheckReply(c, r), "");
      ASSERT_TRUE(r.ok());
      EXPECT_EQ(r->transport, t);
      EXPECT_TRUE(r->o.empty() && r->lse.empty());
      EXPECT_EQ(r->o_bytes().data(), memory.data());
      EXPECT_EQ(r->bytes_received, o + lse);
    }
  }
  const Case& c = cases[0];
  const uint64_t o = c.spec.o_bytes(), lse = c.spec.lse_bytes();
  std::string memory(o + lse + 1, '\0');
  struct Bad {
    uint64_t o, lse;
    std::string error;
  };
  for (const Bad& bad : {Bad{o - 1, lse, "outputs.o"}, Bad{o, 0, "outputs.lse"}, Bad{o, lse + 1, "outputs.lse"}}) {
    client::CallOptions call;
    call.outputs = client::ForwardOutputs{absl::Span<char>(memory.data(), bad.o),
                                          absl::Span<char>(memory.data() + bad.o, bad.lse)};
    auto r = client_->Forward(*c.request, call);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    EXPECT_TRUE(absl::StrContains(r.status().message(), bad.error)) << r.status();
  }
}

TEST_P(ForwardTest, ClientGrpcArgsApplyAndOverrideTheLibrarysOwn) {
  client::ClientOptions o;
  o.target = server_->Target(GetParam());
  o.grpc_args = {"grpc.max_receive_message_length=100"};  // the library sets no limit; this one wins
  absl::StatusOr<std::unique_ptr<client::Client>> tight = client::Client::Create(o);
  ASSERT_TRUE(tight.ok()) << tight.status();
  Case c = MakeCase(Spec(1, 16, 16, 2, 2, 64), 14);  // a 4 KiB reply
  client::CallOptions unary;
  unary.transport = client::Transport::kUnary;
  auto r = (*tight)->Forward(*c.request, unary);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  o.grpc_args = {"grpc.primary_user_agent=attn-test", "grpc.http2.lookahead_bytes=8388608"};
  absl::StatusOr<std::unique_ptr<client::Client>> tuned = client::Client::Create(o);
  ASSERT_TRUE(tuned.ok()) << tuned.status();
  EXPECT_EQ(CheckReply(c, (*tuned)->Forward(*c.request, unary)), "");
  o.grpc_args = {"lookahead"};
  absl::StatusOr<std::unique_ptr<client::Client>> bad = client::Client::Create(o);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(bad.status().message(), "grpc_arg")) << bad.status();
}

TEST(E2eTargets, DnsIpv4AndUnixUriTargets) {
  TestServer srv;
  StartServer(&srv);
  ASSERT_NE(srv.server, nullptr);
  const Case c = MakeCase(Spec(1, 20, 30, 4, 2, 64, Mask::kCausalTopLeft), 300);
  for (const std::string& target : {absl::StrCat("dns:///127.0.0.1:", srv.port), absl::StrCat("ipv4:127.0.0.1:", srv.port),
                                    absl::StrCat("unix://", srv.unix_path)}) {
    auto client = Connect(target);
    ASSERT_NE(client, nullptr);
    EXPECT_EQ(CheckReply(c, client->Forward(*c.request)), "") << target;
  }
  srv.server->Shutdown();
}

INSTANTIATE_TEST_SUITE_P(Listeners, ForwardTest, ::testing::Values(Listener::kTcp, Listener::kUnix),
                         [](const auto& info) { return std::string(ListenerName(info.param)); });

}  // namespace
}  // namespace attnd::e2e
