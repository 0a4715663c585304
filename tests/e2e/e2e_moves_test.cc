// Moving a sequence between two CPU servers (ExportSequence, ImportSequence, Client::MoveSequence): its tokens
// arrive whole, its new id is stepped on the new server and gives the answers the old one gave, the old id says
// where it went, and a move that fails anywhere leaves the sequence where it was and nothing on the other server.
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "e2e_sequences_util.h"
#include "e2e_util.h"

namespace attnd::e2e {
namespace {

class Moves : public ::testing::Test {
 protected:
  // Servers A (0) and B (1), each advertising its loopback address; B with `b_sequences` when given. The client
  // targets A.
  void Start(const server::SequenceOptions* b_sequences = nullptr, absl::Duration idle = absl::Seconds(30)) {
    for (int i = 0; i < 2; ++i) {
      const int port = FreeLoopbackPort();
      ASSERT_GT(port, 0);
      address_[i] = absl::StrCat("127.0.0.1:", port);
      server::ServerOptions so;
      so.network.listen = address_[i];
      if (i == 1 && b_sequences != nullptr) so.sequences = *b_sequences;
      so.timeouts.stream_idle_timeout = idle;
      so.sequences.advertise_address = address_[i];
      server::BackendOptions bo;
      bo.threads = 2;
      ServeOnCpu(&servers_[i], so, bo, nullptr);
      if (HasFatalFailure()) return;
    }
    client_ = Connect(address_[0]);
    direct_b_ = Connect(address_[1]);
    ASSERT_NE(client_, nullptr);
    ASSERT_NE(direct_b_, nullptr);
    stub_a_ = v1::Attention::NewStub(client_->channel());
    stub_b_ = v1::Attention::NewStub(direct_b_->channel());
  }
  void TearDown() override {
    client_.reset();
    direct_b_.reset();
    for (TestServer& s : servers_) {
      if (s.server != nullptr) s.server->Shutdown();
    }
  }

  // A sequence of the test's shape opened on A; "" (and a failure) if it cannot be.
  std::string OpenOnA() {
    auto opened = client_->OpenSequence(shape_);
    EXPECT_TRUE(opened.ok()) << opened.status();
    return opened.ok() ? opened->ids[0] : "";
  }

  // An ExportSequence call on A that the test reads itself; chunk_bytes 0: the server's size.
  std::unique_ptr<grpc::ClientReader<v1::ExportSequenceResponse>> Export(grpc::ClientContext* ctx,
                                                                         const std::string& id,
                                                                         uint64_t chunk_bytes = 0) {
    v1::ExportSequenceRequest request;
    request.set_sequence_id(id);
    request.set_chunk_bytes(chunk_bytes);
    return stub_a_->ExportSequence(ctx, request);
  }

  // Attention over `id` once it is no longer held by an export (ABORTED meanwhile), retried for up to 10 s.
  absl::StatusOr<std::string> AttendOnceReleased(const std::string& id) {
    const absl::Time give_up = absl::Now() + absl::Seconds(10);
    for (;;) {
      absl::StatusOr<std::string> o = Attend(id, 0, 1, 5);
      if (!absl::IsAborted(o.status()) || absl::Now() >= give_up) return o;
      absl::SleepFor(absl::Milliseconds(10));
    }
  }

  uint64_t Open(int server) {
    auto stats = (server == 0 ? client_ : direct_b_)->Stats();
    EXPECT_TRUE(stats.ok()) << stats.status();
    return stats.ok() ? stats->sequences().open() : ~0ull;
  }

  // Appends `tokens` random rows (seed) to `id` at `layer`, keeping them in the mirror.
  void Append(const std::string& id, int64_t layer, int64_t tokens, uint64_t seed) {
    const int64_t row = shape_.kv_heads * shape_.head_dim;
    const std::string k = client::RandomTensor(shape_.dtype, tokens * row, seed);
    const std::string v = client::RandomTensor(shape_.dtype, tokens * row, seed + 1);
    client::StepSpec spec;
    spec.sequences = {{id, tokens}};
    spec.layer = layer;
    spec.k.data = k;
    spec.v.data = v;
    auto r = client_->Step(spec);
    ASSERT_TRUE(r.ok()) << r.status();
    k_[layer] += k;
    v_[layer] += v;
  }

  // O of `rows` query rows (seed) over what `id` caches at `layer`, without appending.
  absl::StatusOr<std::string> Attend(const std::string& id, int64_t layer, int64_t rows, uint64_t seed) {
    const std::string q = client::RandomTensor(shape_.dtype, rows * kQHeads * shape_.head_dim, seed);
    client::StepSpec spec;
    spec.sequences = {{id, rows}};
    spec.layer = layer;
    spec.q_heads = kQHeads;
    spec.q.data = q;
    auto r = client_->Step(spec);
    if (!r.ok()) return r.status();
    return r->o;
  }

  // One decode step (append and attend) at `layer`, checked against attention over the mirror.
  void DecodeAndCheck(const std::string& id, int64_t layer, uint64_t seed) {
    OneTokenStep s(shape_, id, seed);
    s.spec.layer = layer;
    auto r = client_->Step(s.spec);
    ASSERT_TRUE(r.ok()) << r.status();
    k_[layer] += s.k;
    v_[layer] += s.v;
    EXPECT_EQ(CheckRows(shape_, kQHeads, s.q, k_[layer], v_[layer], r->o, "", false), "");
  }

  const client::SequenceShape shape_ = TestShape(2);
  std::string address_[2];
  TestServer servers_[2];
  std::unique_ptr<client::Client> client_, direct_b_;
  std::unique_ptr<v1::Attention::Stub> stub_a_, stub_b_;  // the raw API over the same channels
  std::string k_[2], v_[2];  // the rows each layer caches
};

TEST_F(Moves, ASequenceMovesWithItsTokensAndItsIdFollows) {
  Start();
  ASSERT_FALSE(HasFatalFailure());
  const std::string id = OpenOnA();
  ASSERT_FALSE(id.empty());
  // Layers of different lengths, neither a whole number of pages.
  Append(id, 0, 37, 10);
  Append(id, 1, 20, 20);
  ASSERT_FALSE(HasFatalFailure());
  std::string before[2];
  for (int layer = 0; layer < 2; ++layer) {
    auto o = Attend(id, layer, 3, 100 + layer);
    ASSERT_TRUE(o.ok()) << o.status();
    before[layer] = *o;
  }

  auto moved = client_->MoveSequence(id, address_[1]);
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ(client::SequenceAddress(*moved), address_[1]);
  EXPECT_EQ(Open(0), 0u);
  EXPECT_EQ(Open(1), 1u);
  auto info = client_->GetSequence(*moved);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(std::vector<int64_t>(info->lengths().begin(), info->lengths().end()), std::vector<int64_t>({37, 20}));
  EXPECT_FALSE(info->step_in_flight());
  // The same queries give the same answers, bit for bit: the rows arrived as they were.
  for (int layer = 0; layer < 2; ++layer) {
    auto o = Attend(*moved, layer, 3, 100 + layer);
    ASSERT_TRUE(o.ok()) << o.status();
    EXPECT_EQ(*o, before[layer]) << "layer " << layer;
  }
  // The old id says where the sequence went, in its message and in trailing metadata.
  grpc::ClientContext ctx;
  v1::SequenceInfo gone;
  const grpc::Status old = GetSequenceAsSent(stub_a_.get(), id, &ctx, &gone);
  EXPECT_EQ(old.error_code(), grpc::StatusCode::NOT_FOUND) << old.error_message();
  EXPECT_TRUE(absl::StrContains(old.error_message(), "moved to " + *moved)) << old.error_message();
  const auto trailer = ctx.GetServerTrailingMetadata().find("attnd-moved-to");
  ASSERT_NE(trailer, ctx.GetServerTrailingMetadata().end());
  EXPECT_EQ(std::string(trailer->second.data(), trailer->second.size()), *moved);
  // The moved sequence goes on: decode steps over the cache it brought.
  for (int n = 0; n < 3; ++n) DecodeAndCheck(*moved, n % 2, 500 + 10 * n);
  ASSERT_TRUE(client_->CloseSequence({*moved}).ok());
  EXPECT_EQ(Open(1), 0u);
}

// A step another caller sends while the sequence moves is either taken before the export or refused ("being moved")
// until the old copy is closed and then follows the move: never applied to the old copy after its rows were read, to
// be lost with it. That caller appends and attends a token at a time through its own client, naming the first id
// throughout, while the sequence moves back and forth; each answer is checked against every row it was answered OK
// for, and the last copy holds exactly those.
TEST_F(Moves, StepsSentDuringMovesAreNeverLost) {
  Start();
  ASSERT_FALSE(HasFatalFailure());
  const std::string first = OpenOnA();
  ASSERT_FALSE(first.empty());
  Append(first, 0, 64, 70);
  ASSERT_FALSE(HasFatalFailure());
  std::unique_ptr<client::Client> stepper = Connect(address_[0]);
  ASSERT_NE(stepper, nullptr);
  std::atomic<bool> moving{true};
  std::string k = k_[0], v = v_[0];  // the stepper's mirror of layer 0
  int steps = 0;
  std::string problem;  // the caller's; read once it has joined
  std::atomic<bool> failed{false};
  std::thread caller([&] {
    for (uint64_t seed = 5000; moving.load() && problem.empty(); seed += 10) {
      OneTokenStep s(shape_, first, seed);
      absl::StatusOr<client::StepResult> r = stepper->Step(s.spec);
      if (!r.ok()) {
        problem = absl::StrCat("step ", steps, ": ", r.status().ToString());
        break;
      }
      k += s.k;
      v += s.v;
      ++steps;
      problem = CheckRows(shape_, kQHeads, s.q, k, v, r->o, "", false);
      if (!problem.empty()) problem = absl::StrCat("step ", steps, " answered over other rows: ", problem);
    }
    failed.store(!problem.empty());
  });
  // Six moves: the stepper's client follows at most 8 ids from the first.
  std::string current = first;
  for (int move = 0; move < 6 && !failed.load(); ++move) {
    absl::SleepFor(absl::Milliseconds(15));  // steps land on this copy first
    // A step in flight refuses the export ABORTED: the client tries the move again (moving_step_retry).
    auto moved = client_->MoveSequence(current, address_[(move + 1) % 2]);
    if (!moved.ok()) {
      ADD_FAILURE() << "move " << move << ": " << moved.status();
      break;
    }
    current = *moved;
  }
  absl::SleepFor(absl::Milliseconds(15));
  moving.store(false);
  caller.join();
  EXPECT_EQ(problem, "");
  EXPECT_GT(steps, 6);
  auto info = client_->GetSequence(current);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->lengths(0), 64 + steps) << "steps answered OK are missing from the moved copy";
  k_[0] = k;
  v_[0] = v;
  DecodeAndCheck(current, 0, 7000);
  EXPECT_TRUE(client_->CloseSequence({current}).ok());
  EXPECT_EQ(Open(0) + Open(1), 0u);
}

// A caller that still names a moved sequence's old id is followed to the new one, once, and the client remembers
// where it went: over StepStream (the answer's message names the new id), unary Step and the other calls (the
// attnd-moved-to trailer), a step of several sequences following each in turn.
TEST_F(Moves, ACallNamingAMovedIdFollowsItAndTheClientRemembers) {
  Start();
  ASSERT_FALSE(HasFatalFailure());
  const std::string first = OpenOnA(), second = OpenOnA(), third = OpenOnA();
  ASSERT_FALSE(first.empty() || second.empty() || third.empty());
  for (const std::string& id : {first, second}) DecodeAndCheck(id, 0, 7);
  k_[0] = v_[0] = "";
  auto moved = client_->MoveSequence(first, address_[1]);
  ASSERT_TRUE(moved.ok()) << moved.status();
  auto moved_too = client_->MoveSequence(second, address_[1]);
  ASSERT_TRUE(moved_too.ok()) << moved_too.status();
  for (const client::Transport t : {client::Transport::kStream, client::Transport::kUnary}) {
    SCOPED_TRACE(client::TransportName(t));
    auto other = Connect(address_[0], t);  // knows only the ids as opened
    ASSERT_NE(other, nullptr);
    EXPECT_EQ(other->CurrentSequenceId(first), first);
    client::StepSpec attend;
    attend.sequences = {{first, 1}, {second, 1}};
    attend.q_heads = kQHeads;
    const std::string q = client::RandomTensor(shape_.dtype, 2 * kQHeads * shape_.head_dim, 3);
    attend.q.data = q;
    auto r = other->Step(attend);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->lengths, std::vector<int64_t>({1, 1}));
    EXPECT_EQ(other->CurrentSequenceId(first), *moved);
    EXPECT_EQ(other->CurrentSequenceId(second), *moved_too);
    EXPECT_EQ(other->moves_followed(), 2u);
    auto info = other->GetSequence(first);  // remembered: straight to B
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->sequence_id(), *moved);
    EXPECT_EQ(other->moves_followed(), 2u);
  }
  // A fresh client's unary call follows the trailer; a close naming old ids closes the new ones.
  auto fresh = Connect(address_[0]);
  ASSERT_NE(fresh, nullptr);
  auto truncated = fresh->TruncateSequence(second, 0);
  ASSERT_TRUE(truncated.ok()) << truncated.status();
  EXPECT_EQ(fresh->CurrentSequenceId(second), *moved_too);
  ASSERT_TRUE(fresh->CloseSequence({first, second}).ok());
  EXPECT_EQ(Open(1), 0u);
  // An id that did not move, and one unknown, answer as before.
  EXPECT_TRUE(fresh->GetSequence(third).ok());
  EXPECT_EQ(fresh->GetSequence(first).status().code(), absl::StatusCode::kNotFound);
}

// Rows travel token by token, not page by page: a server with pages of another size takes them as they were.
TEST_F(Moves, ToAServerWithAnotherPageSize) {
  server::SequenceOptions big_pages;
  big_pages.page_tokens = 64;
  Start(&big_pages);
  ASSERT_FALSE(HasFatalFailure());
  const std::string id = OpenOnA();
  ASSERT_FALSE(id.empty());
  Append(id, 0, 83, 60);
  Append(id, 1, 17, 70);
  ASSERT_FALSE(HasFatalFailure());
  auto before = Attend(id, 0, 5, 80);
  ASSERT_TRUE(before.ok()) << before.status();
  auto moved = client_->MoveSequence(id, address_[1]);
  ASSERT_TRUE(moved.ok()) << moved.status();
  auto info = client_->GetSequence(*moved);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->pages(), 2);  // 83 tokens in pages of 64
  auto after = Attend(*moved, 0, 5, 80);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(*after, *before);
  for (int n = 0; n < 2; ++n) DecodeAndCheck(*moved, n, 90 + 10 * n);
}

// Moves by bytes at once, over the connections the mover keeps for moves (fewer than the moves, so two share one)
// and over the calls' own: each sequence arrives whole and answers as it did. A count outside [0, 64] is refused.
TEST_F(Moves, MovesAtOnceGoOverConnectionsOfTheirOwnOrTheCallsOnes) {
  Start();
  ASSERT_FALSE(HasFatalFailure());
  constexpr int kAtOnce = 3;
  for (const int lanes : {2, 0}) {
    SCOPED_TRACE(absl::StrCat("move_connections ", lanes));
    client::ClientOptions o;
    o.target = address_[0];
    o.move_connections = lanes;
    absl::StatusOr<std::unique_ptr<client::Client>> mover = client::Client::Create(o);
    ASSERT_TRUE(mover.ok()) << mover.status();
    std::string ids[kAtOnce], before[kAtOnce];
    for (int i = 0; i < kAtOnce; ++i) {
      ids[i] = OpenOnA();
      ASSERT_FALSE(ids[i].empty());
      Append(ids[i], 0, 40 + 7 * i, 200 + 10 * i);
      Append(ids[i], 1, 9 + i, 300 + 10 * i);
      ASSERT_FALSE(HasFatalFailure());
      auto o0 = Attend(ids[i], 0, 2, 400 + i);
      ASSERT_TRUE(o0.ok()) << o0.status();
      before[i] = *o0;
    }
    absl::StatusOr<client::MovedSequence> moved[kAtOnce];
    std::vector<std::thread> threads;
    client::MoveOptions bytes;
    bytes.path = client::MovePath::kBytes;
    for (int i = 0; i < kAtOnce; ++i) {
      threads.emplace_back([&, i] { moved[i] = (*mover)->MoveSequence(ids[i], address_[1], bytes); });
    }
    for (std::thread& t : threads) t.join();
    for (int i = 0; i < kAtOnce; ++i) {
      ASSERT_TRUE(moved[i].ok()) << moved[i].status();
      EXPECT_EQ(moved[i]->path, client::MovePath::kBytes);
      auto info = client_->GetSequence(moved[i]->sequence_id);
      ASSERT_TRUE(info.ok()) << info.status();
      EXPECT_EQ(std::vector<int64_t>(info->lengths().begin(), info->lengths().end()),
                std::vector<int64_t>({40 + 7 * i, 9 + i}));
      auto after = Attend(moved[i]->sequence_id, 0, 2, 400 + i);
      ASSERT_TRUE(after.ok()) << after.status();
      EXPECT_EQ(*after, before[i]) << "sequence " << i;
      ASSERT_TRUE(client_->CloseSequence({moved[i]->sequence_id}).ok());
    }
    EXPECT_EQ(Open(0), 0u);
    EXPECT_EQ(Open(1), 0u);
  }
  for (const int bad : {-1, 65}) {
    client::ClientOptions o;
    o.target = address_[0];
    o.move_connections = bad;
    absl::StatusOr<std::unique_ptr<client::Client>> refused = client::Client::Create(o);
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(refused.status().message(), "move_connections")) << refused.status();
  }
}

TEST_F(Moves, AnEmptySequenceAndAForkedOneMove) {
  Start();
  ASSERT_FALSE(HasFatalFailure());
  auto opened = client_->OpenSequence(shape_, 0, 2);
  ASSERT_TRUE(opened.ok()) << opened.status();
  // Nothing cached yet.
  auto empty = client_->MoveSequence(opened->ids[1], address_[1]);
  ASSERT_TRUE(empty.ok()) << empty.status();
  auto info = client_->GetSequence(*empty);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(std::vector<int64_t>(info->lengths().begin(), info->lengths().end()), std::vector<int64_t>({0, 0}));

  // A child shares its parent's pages: it moves with its own copy of them, and the parent keeps its own.
  const std::string parent = opened->ids[0];
  Append(parent, 0, 40, 30);
  ASSERT_FALSE(HasFatalFailure());
  auto child = client_->ForkSequence(parent);
  ASSERT_TRUE(child.ok()) << child.status();
  auto moved = client_->MoveSequence((*child)[0], address_[1]);
  ASSERT_TRUE(moved.ok()) << moved.status();
  const std::string k = k_[0], v = v_[0];
  DecodeAndCheck(*moved, 0, 700);
  k_[0] = k, v_[0] = v;
  DecodeAndCheck(parent, 0, 800);
  auto parent_info = client_->GetSequence(parent);
  ASSERT_TRUE(parent_info.ok()) << parent_info.status();
  EXPECT_EQ(parent_info->shared_pages(), 0);
}

TEST_F(Moves, ARefusedImportLeavesTheSequenceWhereItWas) {
  // B's pool holds 2 pages of this shape; the sequence needs 3.
  server::SequenceOptions small;
  small.pool_bytes = 2 * TestShape(2).layers * 2 * 16 * 2 * 64 * 2;
  Start(&small);
  ASSERT_FALSE(HasFatalFailure());
  const std::string id = OpenOnA();
  ASSERT_FALSE(id.empty());
  Append(id, 0, 40, 40);
  ASSERT_FALSE(HasFatalFailure());
  auto moved = client_->MoveSequence(id, address_[1]);
  ASSERT_EQ(moved.status().code(), absl::StatusCode::kResourceExhausted) << moved.status();
  EXPECT_TRUE(absl::StrContains(moved.status().message(), address_[1])) << moved.status();
  EXPECT_EQ(Open(1), 0u);
  EXPECT_EQ(Open(0), 1u);
  auto info = client_->GetSequence(id);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_FALSE(info->step_in_flight());
  DecodeAndCheck(id, 0, 900);

  // Moving to the server it is on already, or to nowhere, is refused before anything moves.
  EXPECT_EQ(client_->MoveSequence(id, address_[0]).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->MoveSequence(id, "").status().code(), absl::StatusCode::kInvalidArgument);
}

// The device path needs both servers on one GPU. CPU servers report none: an automatic move goes by bytes, a move
// that insists on the device is refused by the exporter before anything moves, and so is a raw device export.
TEST_F(Moves, OnCpuServersAMoveGoesByBytesAndTheDevicePathIsRefused) {
  Start();
  ASSERT_FALSE(HasFatalFailure());
  auto info = client_->ServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_TRUE(info->devices().empty());
  const std::string id = OpenOnA();
  ASSERT_FALSE(id.empty());
  Append(id, 0, 37, 10);
  ASSERT_FALSE(HasFatalFailure());

  client::MoveOptions device;
  device.path = client::MovePath::kDevice;
  auto refused = client_->MoveSequence(id, address_[1], device);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "device: ")) << refused.status();
  EXPECT_EQ(Open(1), 0u);
  const absl::StatusOr<std::string> still = AttendOnceReleased(id);
  EXPECT_TRUE(still.ok()) << still.status();

  grpc::ClientContext ctx;
  v1::ExportSequenceRequest request;
  request.set_sequence_id(id);
  request.set_device(true);
  auto reader = stub_a_->ExportSequence(&ctx, request);
  v1::ExportSequenceResponse chunk;
  EXPECT_FALSE(reader->Read(&chunk));  // refused before the header
  const grpc::Status st = reader->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << st.error_message();
  EXPECT_TRUE(absl::StartsWith(st.error_message(), "device: ")) << st.error_message();

  auto moved = client_->MoveSequence(id, address_[1], client::MoveOptions());
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ(moved->path, client::MovePath::kBytes);
  EXPECT_EQ(Open(0), 0u);
  EXPECT_EQ(Open(1), 1u);
  DecodeAndCheck(moved->sequence_id, 0, 20);
}

// An import whose rows come as a device buffer is checked before anything is copied: rows of the wrong size, a GPU
// that is not the importer's, a handle that is no handle, device rows after byte rows. Each is refused with the
// field named, and the pages it took are free again.
TEST_F(Moves, BadDeviceRowsOnImportAreRefusedAndLeaveNothing) {
  Start();
  ASSERT_FALSE(HasFatalFailure());
  const std::string id = OpenOnA();
  ASSERT_FALSE(id.empty());
  Append(id, 0, 37, 10);
  Append(id, 1, 20, 20);
  ASSERT_FALSE(HasFatalFailure());
  v1::ImportSequenceRequest header;
  {
    grpc::ClientContext ctx;
    auto reader = Export(&ctx, id);
    v1::ExportSequenceResponse first;
    ASSERT_TRUE(reader->Read(&first));
    *header.mutable_chunk() = first.chunk();
    ctx.TryCancel();
    reader->Finish().ok();
  }
  const uint64_t row = shape_.kv_heads * shape_.head_dim * 2;
  const uint64_t bytes = 2 * (37 + 20) * row;
  auto pages_used = [&] {
    auto stats = direct_b_->Stats();
    EXPECT_TRUE(stats.ok()) << stats.status();
    return stats.ok() ? stats->sequences().pages_used() : ~0ull;
  };
  struct Case {
    std::string uuid, handle;
    uint64_t bytes;
    bool after_rows;
    grpc::StatusCode code;
    std::string field;
  };
  const std::string uuid(32, 'a');
  const Case cases[] = {
      {uuid, std::string(64, 'h'), bytes - row, false, grpc::StatusCode::INVALID_ARGUMENT, "chunk.device_rows.bytes: "},
      {uuid, std::string(64, 'h'), bytes, false, grpc::StatusCode::FAILED_PRECONDITION,
       "chunk.device_rows.device_uuid: "},
      {"", "not a handle", bytes, false, grpc::StatusCode::FAILED_PRECONDITION, "chunk.device_rows.device_uuid: "},
      {uuid, std::string(64, 'h'), bytes, true, grpc::StatusCode::INVALID_ARGUMENT, "chunk.device_rows: "},
  };
  for (const Case& c : cases) {
    grpc::ClientContext ctx;
    v1::ImportSequenceResponse response;
    auto writer = stub_b_->ImportSequence(&ctx, &response);
    ASSERT_TRUE(writer->Write(header));
    if (c.after_rows) {
      v1::ImportSequenceRequest rows;
      rows.mutable_chunk()->set_data(std::string(row, '\0'));
      writer->Write(rows);
    }
    v1::ImportSequenceRequest device;
    device.mutable_chunk()->mutable_device_rows()->set_ipc_handle(c.handle);
    device.mutable_chunk()->mutable_device_rows()->set_bytes(c.bytes);
    device.mutable_chunk()->mutable_device_rows()->set_device_uuid(c.uuid);
    writer->Write(device);
    writer->WritesDone();
    const grpc::Status st = writer->Finish();
    EXPECT_EQ(st.error_code(), c.code) << c.field << st.error_message();
    EXPECT_TRUE(absl::StartsWith(st.error_message(), c.field)) << st.error_message();
    EXPECT_EQ(Open(1), 0u) << c.field;
    EXPECT_EQ(pages_used(), 0u) << c.field;
  }
  EXPECT_EQ(Open(0), 1u);
  DecodeAndCheck(id, 0, 30);
}

// An export leaves its sequence open, also when it is cut short; a close during one frees the sequence at its end.
// (That the sequence takes no step while its export runs is the core's test: here the stream may have been
// written in full before the client reads it.)
TEST_F(Moves, AnExportLeavesItsSequenceOpenUntilItIsClosed) {
  Start();
  ASSERT_FALSE(HasFatalFailure());
  const std::string id = OpenOnA();
  ASSERT_FALSE(id.empty());
  Append(id, 0, 20, 50);
  ASSERT_FALSE(HasFatalFailure());
  {
    grpc::ClientContext ctx;
    auto reader = Export(&ctx, id);
    v1::ExportSequenceResponse header;
    ASSERT_TRUE(reader->Read(&header));
    ASSERT_TRUE(header.chunk().has_sequence());
    EXPECT_EQ(header.chunk().sequence().lengths(0), 20);
    ctx.TryCancel();
    reader->Finish().ok();
  }
  // The sequence steps again once the server has ended the export.
  const absl::StatusOr<std::string> after = AttendOnceReleased(id);
  EXPECT_TRUE(after.ok()) << after.status();

  // A close during an export (or after it) frees the sequence, and the export still gives every row.
  grpc::ClientContext ctx;
  auto reader = Export(&ctx, id, /*chunk_bytes=*/1);  // a row per chunk
  v1::ExportSequenceResponse chunk;
  ASSERT_TRUE(reader->Read(&chunk));
  ASSERT_TRUE(client_->CloseSequence({id}).ok());
  int rows = 0;
  while (reader->Read(&chunk)) {
    rows += static_cast<int>(chunk.chunk().data().size() / (shape_.kv_heads * shape_.head_dim * 2));
  }
  EXPECT_TRUE(reader->Finish().ok());
  EXPECT_EQ(rows, 2 * 20);  // layer 0's K and V; layer 1 holds none
  EXPECT_EQ(client_->GetSequence(id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Open(0), 0u);
}

// A mover that stalls holds nothing for long: an export whose reader stops reading lets its sequence step again
// after --stream_idle_timeout_s, and an import that stops sending is ended and freed as soon.
TEST_F(Moves, AStalledMoveIsEndedAfterTheIdleTimeout) {
  Start(nullptr, absl::Milliseconds(400));
  ASSERT_FALSE(HasFatalFailure());
  const std::string id = OpenOnA();
  ASSERT_FALSE(id.empty());
  // 16 MiB of K and V: more than the stream's flow-control window, so the export cannot finish unread.
  for (int layer = 0; layer < 2; ++layer) {
    for (int n = 0; n < 8; ++n) Append(id, layer, 2048, 1000 * layer + 10 * n);
  }
  ASSERT_FALSE(HasFatalFailure());
  grpc::ClientContext ctx;
  auto reader = Export(&ctx, id);
  v1::ExportSequenceResponse header;
  ASSERT_TRUE(reader->Read(&header));
  // Held while the export runs: a step is refused ABORTED "is being moved", which the client retries until the
  // export is ended.
  const absl::Time stalled = absl::Now();
  const absl::StatusOr<std::string> after = Attend(id, 0, 1, 5);
  EXPECT_TRUE(after.ok()) << after.status();
  EXPECT_GE(absl::Now() - stalled, absl::Milliseconds(300));
  ctx.TryCancel();
  reader->Finish().ok();

  grpc::ClientContext import_ctx;
  v1::ImportSequenceResponse response;
  auto writer = stub_b_->ImportSequence(&import_ctx, &response);
  v1::ImportSequenceRequest announce;
  *announce.mutable_chunk() = header.chunk();
  ASSERT_TRUE(writer->Write(announce));  // a header announcing 16 MiB, then nothing
  for (int i = 0; i < 500 && Open(1) == 0; ++i) absl::SleepFor(absl::Milliseconds(2));
  EXPECT_EQ(Open(1), 1u);  // held, its pages taken
  const grpc::Status st = writer->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << st.error_message();
  EXPECT_TRUE(absl::StrContains(st.error_message(), "stream_idle_timeout_s")) << st.error_message();
  EXPECT_EQ(Open(1), 0u);
}

// An import takes only the stream its header announces, in the export's order; anything else is refused and
// leaves nothing open.
TEST_F(Moves, AnImportChecksItsStream) {
  Start();
  ASSERT_FALSE(HasFatalFailure());
  const int64_t row_bytes = shape_.kv_heads * shape_.head_dim * 2;
  v1::SequenceChunk header;
  v1::SequenceShape* s = header.mutable_sequence()->mutable_shape();
  s->set_layers(2);
  s->set_kv_heads(shape_.kv_heads);
  s->set_head_dim(shape_.head_dim);
  s->set_dtype(v1::DTYPE_BF16);
  header.mutable_sequence()->add_lengths(3);
  header.mutable_sequence()->add_lengths(0);
  const auto rows = [&](int kv, int64_t first, int64_t n) {
    v1::SequenceChunk c;
    c.set_layer(0);
    c.set_kv(kv);
    c.set_first_token(first);
    c.set_data(client::RandomTensor(DType::kBF16, n * row_bytes / 2, 7 + first));
    return c;
  };
  const auto Wrap = [](const v1::SequenceChunk& c) {
    v1::ImportSequenceRequest m;
    *m.mutable_chunk() = c;
    return m;
  };
  struct Try {
    const char* name;
    std::vector<v1::SequenceChunk> chunks;
    const char* says;
  };
  v1::SequenceChunk bad_lengths = header;
  bad_lengths.mutable_sequence()->add_lengths(1);
  const std::vector<Try> tries = {
      {"no header", {rows(0, 0, 3)}, "sequence: the first chunk"},
      {"a header with three lengths for two layers", {bad_lengths}, "sequence.lengths"},
      {"V before K", {header, rows(1, 0, 3)}, "first_token: expected rows of layer 0 K"},
      {"a gap", {header, rows(0, 1, 2)}, "first_token"},
      {"rows past the end", {header, rows(0, 0, 3), rows(1, 0, 3), rows(1, 3, 1)}, "past the last row"},
      {"a short stream", {header, rows(0, 0, 3), rows(1, 0, 2)}, "ended before layer 0 V from token 2"},
      {"a second header", {header, header}, "only the first chunk"},
  };
  for (const Try& t : tries) {
    SCOPED_TRACE(t.name);
    grpc::ClientContext ctx;
    v1::ImportSequenceResponse response;
    auto writer = stub_b_->ImportSequence(&ctx, &response);
    for (const v1::SequenceChunk& c : t.chunks) {
      if (!writer->Write(Wrap(c))) break;
    }
    writer->WritesDone();
    const grpc::Status st = writer->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
    EXPECT_TRUE(absl::StrContains(st.error_message(), t.says)) << st.error_message();
    EXPECT_EQ(Open(1), 0u);
  }
  // The whole stream opens the sequence.
  grpc::ClientContext ctx;
  v1::ImportSequenceResponse response;
  auto writer = stub_b_->ImportSequence(&ctx, &response);
  for (const v1::SequenceChunk& c : {header, rows(0, 0, 2), rows(0, 2, 1), rows(1, 0, 3)}) {
    ASSERT_TRUE(writer->Write(Wrap(c)));
  }
  writer->WritesDone();
  const grpc::Status st = writer->Finish();
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(client::SequenceAddress(response.sequence_id()), address_[1]);
  EXPECT_EQ(Open(1), 1u);
}

// A rolling restart that loses no sequence: each server in turn is asked to stop with a drain, and the callers
// whose sequences it holds move them to a server still SERVING when its health turns NOT_SERVING, then step on;
// the drain ends as soon as the last one has left, and the server comes back on its port. Every step of every
// sequence is checked against the double reference over its whole history, before and after its moves.
TEST(FleetRollingRestart, SequencesMovedOffEachDrainingServerSurviveEveryRestart) {
  constexpr int kServers = 3, kCallers = 3, kPerCaller = 2;
  TestServer servers[kServers];
  server::ServerOptions options[kServers];
  std::unique_ptr<client::Client> direct[kServers];
  std::vector<std::string> addresses;
  for (int i = 0; i < kServers; ++i) {
    const int port = FreeLoopbackPort();
    ASSERT_GT(port, 0);
    options[i].network.listen = absl::StrCat("127.0.0.1:", port);
    options[i].sequences.advertise_address = options[i].network.listen;
    options[i].timeouts.sequence_drain = absl::Seconds(20);
    addresses.push_back(options[i].network.listen);
  }
  server::BackendOptions bo;
  bo.threads = 2;
  for (int i = 0; i < kServers; ++i) {
    ServeOnCpu(&servers[i], options[i], bo, nullptr);
    ASSERT_FALSE(::testing::Test::HasFatalFailure());
    direct[i] = Connect(addresses[i]);
  }
  auto fleet = Connect(absl::StrCat("ipv4:", absl::StrJoin(addresses, ",")));
  ASSERT_NE(fleet, nullptr);
  const client::SequenceShape shape = TestShape(1);
  const auto serving = [&](const std::string& address) {
    for (int i = 0; i < kServers; ++i) {
      if (addresses[i] == address) return direct[i]->CheckHealth("attnd.v1.Attention").ok();
    }
    return false;
  };

  VerifiedCallers load(fleet.get(), shape, kCallers);
  for (auto& mine : load.owned) {
    for (int n = 0; n < kPerCaller; ++n) {
      auto opened = fleet->OpenSequence(shape);
      ASSERT_TRUE(opened.ok()) << opened.status();
      mine.push_back({opened->ids[0], "", "", 0});
    }
  }
  // Before each step: a sequence whose server is leaving moves to one still SERVING.
  load.Start([&](VerifiedCallers::Owned& o) {
    const std::string here = client::SequenceAddress(o.id);
    if (serving(here)) return;
    for (const std::string& there : addresses) {
      if (there == here || !serving(there)) continue;
      auto moved = fleet->MoveSequence(o.id, there);
      if (moved.ok()) {
        o.id = *moved;
        ++o.moves;
        return;
      }
    }
  });
  for (int i = 0; i < kServers; ++i) {
    absl::SleepFor(absl::Milliseconds(200));
    const absl::Time asked = absl::Now();
    servers[i].server->Shutdown();  // returns once the drain is over: every sequence moved off
    EXPECT_LT(absl::Now() - asked, absl::Seconds(15)) << "server " << i << " waited out its drain";
    servers[i].server.reset();
    ServeOnCpu(&servers[i], options[i], bo, nullptr);
    ASSERT_FALSE(::testing::Test::HasFatalFailure());
    for (int n = 0; n < 500 && !direct[i]->CheckHealth("attnd.v1.Attention").ok(); ++n) {
      absl::SleepFor(absl::Milliseconds(10));
    }
  }
  absl::SleepFor(absl::Milliseconds(200));
  load.Stop();
  EXPECT_EQ(load.failed.load(), 0) << load.first_problem();
  EXPECT_EQ(load.wrong.load(), 0) << load.first_problem();
  EXPECT_GT(load.steps.load(), 100);
  int moves = 0;
  for (const auto& mine : load.owned) {
    for (const VerifiedCallers::Owned& o : mine) {
      moves += o.moves;
      auto info = fleet->GetSequence(o.id);
      ASSERT_TRUE(info.ok()) << info.status();
      EXPECT_EQ(info->lengths(0), static_cast<int64_t>(o.k.size() / (shape.kv_heads * shape.head_dim * 2)));
      EXPECT_TRUE(fleet->CloseSequence({o.id}).ok());
    }
  }
  EXPECT_GE(moves, kCallers * kPerCaller);  // each sequence left at least the server it started on
  for (TestServer& srv : servers) srv.server->Shutdown();
}

}  // namespace
}  // namespace attnd::e2e
