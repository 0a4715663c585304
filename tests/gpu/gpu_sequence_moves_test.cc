// Same-host sequence moves on one GPU: two `attnd --backend=cuda` processes share the device, and Client::MoveSequence
// carries each sequence's rows through one CUDA IPC buffer (MovePath::kDevice), or, from an exporter that shares its
// pool (--sequence_device_moves_share_pool=always), from the exporter's pages in place into an importer whose pages
// hold another number of tokens; by default only an export that carries the fleet's peer secret (a drain's) gets the
// pool, an ordinary caller's a buffer. An importer that refuses the device path gets the bytes. Sequences of bf16 and
// float8 caches, several layers, lengths that are no whole number of pages, and a fork sharing its parent's pages are
// prefilled with random rows on A, forked there once more (the copy that stays on A), and moved to B. On B each answers
// a decode step exactly as its copy on A answers the same step (the same kernel over the same rows: bit for bit), and
// the old id answers NOT_FOUND "moved to". Another caller stepping a sequence while it moves back and forth loses no
// step it was answered OK for. A device_rows chunk whose handle is not one is refused naming the field and leaves
// nothing on B, and so is a pool that does not fit its allocation. Skipped without a usable GPU.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "attnd/client/client.h"
#include "attnd/client/tensors.h"
#include "e2e_util.h"
#include "gpu_test_util.h"
#include "gtest/gtest.h"

#ifndef ATTND_BINARY
#error "ATTND_BINARY must name the attnd executable"
#endif

namespace attnd::gpu {
namespace {

using e2e::Connect;
using e2e::FreeLoopbackPort;

// attnd next to this test binary (binaries are carried together to a GPU host), else the build tree's.
std::string AttndBinary() {
  char self[4096];
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
  if (n > 0) {
    std::string dir(self, static_cast<size_t>(n));
    const std::string sibling = dir.substr(0, dir.rfind('/')) + "/attnd";
    if (::access(sibling.c_str(), X_OK) == 0) return sibling;
  }
  return ATTND_BINARY;
}

// One attnd process on the CUDA backend, advertising its loopback address; killed when the test ends.
struct AttndProcess {
  pid_t pid = -1;
  std::string address;
  ~AttndProcess() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  }
  bool Start(const std::vector<std::string>& flags) {
    const int port = FreeLoopbackPort();
    if (port <= 0) return false;
    address = absl::StrCat("127.0.0.1:", port);
    std::vector<std::string> args = {AttndBinary(), "--backend=cuda", "--listen=" + address,
                                     "--advertise_address=" + address, "--kv_pool_mb=256",
                                     "--memory_budget_mb=2048", "--log_level=warn"};
    args.insert(args.end(), flags.begin(), flags.end());
    pid = ::fork();
    if (pid == 0) {
      std::vector<char*> argv;
      for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
    return pid > 0;
  }
};

// Sequences of `layers` layers of 2 kv heads x 128, bf16.
client::SequenceShape Bf16Shape(int layers) {
  client::SequenceShape shape;
  shape.layers = layers;
  shape.kv_heads = 2;
  shape.head_dim = 128;
  shape.dtype = DType::kBF16;
  return shape;
}

// A float8 cache: 4 layers of 4 kv heads x 64, descales per layer and head.
client::SequenceShape Float8Shape() {
  client::SequenceShape shape;
  shape.layers = 4;
  shape.kv_heads = 4;
  shape.head_dim = 64;
  shape.dtype = DType::kBF16;
  shape.kv_format = KvFormat::kFp8E4M3;
  shape.k_descale = {0.5f, 0.25f, 1.0f, 0.125f};
  shape.v_descale = {0.25f, 0.5f, 0.125f, 1.0f};
  return shape;
}

// ServerInfo of the server at `address` once it answers (up to 60 s: a CUDA server warms up first).
absl::StatusOr<v1::ServerInfo> AwaitServing(const std::string& address) {
  auto c = Connect(address);
  if (c == nullptr) return absl::UnavailableError("no client");
  const absl::Time end = absl::Now() + absl::Seconds(60);
  for (;;) {
    absl::StatusOr<v1::ServerInfo> info = c->ServerInfo(/*refresh=*/true);
    if (info.ok() || absl::Now() > end) return info;
    absl::SleepFor(absl::Milliseconds(200));
  }
}

class GpuSequenceMoves : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!testing::HaveSupportedGpu()) GTEST_SKIP() << "no supported GPU";
    for (int i = 0; i < 2; ++i) ASSERT_TRUE(servers_[i].Start(ServerFlags(i)));
    std::string uuid[2];
    for (int i = 0; i < 2; ++i) {
      absl::StatusOr<v1::ServerInfo> info = AwaitServing(servers_[i].address);
      ASSERT_TRUE(info.ok()) << servers_[i].address << ": " << info.status();
      ASSERT_EQ(info->backend(), "cuda");
      ASSERT_FALSE(info->devices().empty());
      uuid[i] = info->devices(0).uuid();
    }
    ASSERT_EQ(uuid[0].size(), 32u) << uuid[0];
    ASSERT_EQ(uuid[0], uuid[1]);
    uuid_ = uuid[0];
    client_ = Connect(servers_[0].address);
    direct_b_ = Connect(servers_[1].address);
    ASSERT_NE(client_, nullptr);
    ASSERT_NE(direct_b_, nullptr);
    stub_a_ = v1::Attention::NewStub(client_->channel());
    stub_b_ = v1::Attention::NewStub(direct_b_->channel());
  }

  // A device export of `id` from A, read as far as its header and device-rows chunks (as an import's); the export
  // stays open until `ctx` is cancelled.
  void ReadDeviceExport(grpc::ClientContext* ctx, const std::string& id, v1::ImportSequenceRequest* header,
                        v1::ImportSequenceRequest* rows,
                        std::unique_ptr<grpc::ClientReader<v1::ExportSequenceResponse>>* reader) {
    v1::ExportSequenceRequest request;
    request.set_sequence_id(id);
    request.set_device(true);
    *reader = stub_a_->ExportSequence(ctx, request);
    v1::ExportSequenceResponse first, device;
    ASSERT_TRUE((*reader)->Read(&first));
    ASSERT_TRUE((*reader)->Read(&device));
    ASSERT_TRUE(device.chunk().has_device_rows());
    EXPECT_EQ(device.chunk().device_rows().device_uuid(), uuid_);
    *header->mutable_chunk() = first.chunk();
    *rows->mutable_chunk() = device.chunk();
  }

  // An import on B of `header`, then `rows`: its status, after which B must hold nothing.
  grpc::Status ImportOnB(const v1::ImportSequenceRequest& header, const v1::ImportSequenceRequest& rows) {
    grpc::ClientContext ctx;
    v1::ImportSequenceResponse response;
    auto writer = stub_b_->ImportSequence(&ctx, &response);
    writer->Write(header);
    writer->Write(rows);
    writer->WritesDone();
    const grpc::Status st = writer->Finish();
    auto stats = direct_b_->Stats();
    EXPECT_TRUE(stats.ok()) << stats.status();
    if (stats.ok()) {
      EXPECT_EQ(stats->sequences().open(), 0u);
      EXPECT_EQ(stats->sequences().pages_used(), 0u);
    }
    return st;
  }

  virtual std::vector<std::string> ServerFlags(int server) const {
    (void)server;
    return {};
  }

  // Appends `tokens` random rows to `id` at `layer`.
  void Append(const client::SequenceShape& shape, const std::string& id, int64_t layer, int64_t tokens,
              uint64_t seed) {
    const std::string k = client::RandomTensor(shape.dtype, tokens * shape.kv_heads * shape.head_dim, seed);
    const std::string v = client::RandomTensor(shape.dtype, tokens * shape.kv_heads * shape.head_dim, seed + 1);
    client::StepSpec spec;
    spec.sequences = {{id, tokens}};
    spec.layer = layer;
    spec.k.data = k;
    spec.v.data = v;
    auto r = client_->Step(spec);
    ASSERT_TRUE(r.ok()) << r.status();
  }

  // A sequence opened on A with `tokens` random rows at layer 0; empty (the failure reported) when that fails.
  std::string OpenWithRows(const client::SequenceShape& shape, int64_t tokens, uint64_t seed) {
    auto opened = client_->OpenSequence(shape);
    if (!opened.ok()) {
      ADD_FAILURE() << opened.status();
      return "";
    }
    Append(shape, opened->ids[0], 0, tokens, seed);
    return HasFailure() ? "" : opened->ids[0];
  }

  // O of one decode step (a token appended and attended) of `id` at `layer`, from seeded inputs.
  absl::StatusOr<std::string> Decode(const client::SequenceShape& shape, const std::string& id, int64_t layer,
                                     uint64_t seed) {
    const int64_t q_heads = 4 * shape.kv_heads;
    const std::string q = client::RandomTensor(shape.dtype, q_heads * shape.head_dim, seed);
    const std::string k = client::RandomTensor(shape.dtype, shape.kv_heads * shape.head_dim, seed + 1);
    const std::string v = client::RandomTensor(shape.dtype, shape.kv_heads * shape.head_dim, seed + 2);
    client::StepSpec spec;
    spec.sequences = {{id, 1}};
    spec.layer = layer;
    spec.q_heads = q_heads;
    spec.q.data = q;
    spec.k.data = k;
    spec.v.data = v;
    auto r = client_->Step(spec);
    if (!r.ok()) return r.status();
    return r->o;
  }

  // Decode at layer 0 once an export that was cancelled has let the sequence go (ABORTED "being moved" until then,
  // a moment after the cancel).
  absl::StatusOr<std::string> DecodeOnceReleased(const client::SequenceShape& shape, const std::string& id,
                                                 uint64_t seed) {
    const absl::Time end = absl::Now() + absl::Seconds(10);
    absl::StatusOr<std::string> o;
    do {
      o = Decode(shape, id, 0, seed);
    } while (absl::IsAborted(o.status()) && absl::Now() < end);
    return o;
  }

  // Moves `id` to B (by the device path unless B refuses it) and checks it against `copy` (a fork of it kept on
  // A) at every layer, then that the old id says where it went.
  void MoveAndCompare(const client::SequenceShape& shape, const std::string& id, const std::string& copy,
                      const std::vector<int64_t>& lengths) {
    client::MoveOptions automatic;
    auto moved = client_->MoveSequence(id, servers_[1].address, automatic);
    ASSERT_TRUE(moved.ok()) << moved.status();
    EXPECT_EQ(moved->path, expected_path_);
    EXPECT_EQ(client::SequenceAddress(moved->sequence_id), servers_[1].address);
    auto info = client_->GetSequence(moved->sequence_id);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(std::vector<int64_t>(info->lengths().begin(), info->lengths().end()), lengths);
    for (int64_t layer = 0; layer < shape.layers; ++layer) {
      for (int step = 0; step < 2; ++step) {
        const uint64_t seed = 9000 + 100 * layer + 10 * step;
        auto on_b = Decode(shape, moved->sequence_id, layer, seed);
        auto on_a = Decode(shape, copy, layer, seed);
        ASSERT_TRUE(on_b.ok()) << on_b.status();
        ASSERT_TRUE(on_a.ok()) << on_a.status();
        EXPECT_TRUE(*on_b == *on_a) << "layer " << layer << " step " << step << ": O differs after the move";
      }
    }
    // Asked directly (the client library would follow the old id to the new one).
    grpc::ClientContext ctx;
    v1::SequenceInfo gone;
    const grpc::Status old = e2e::GetSequenceAsSent(stub_a_.get(), id, &ctx, &gone);
    EXPECT_EQ(old.error_code(), grpc::StatusCode::NOT_FOUND) << old.error_message();
    EXPECT_TRUE(absl::StrContains(old.error_message(), "moved to " + moved->sequence_id)) << old.error_message();
    EXPECT_TRUE(client_->CloseSequence({moved->sequence_id}).ok());
    EXPECT_TRUE(client_->CloseSequence({copy}).ok());
  }

  // A sequence of `shape` on A with `lengths` random rows per layer, a fork of it that shares its pages and takes
  // one more token at layer 0, and a fork of each kept on A; both sequences move.
  void PrefillForkAndMove(const client::SequenceShape& shape, const std::vector<int64_t>& lengths, uint64_t seed) {
    auto opened = client_->OpenSequence(shape);
    ASSERT_TRUE(opened.ok()) << opened.status();
    const std::string id = opened->ids[0];
    for (int64_t layer = 0; layer < shape.layers; ++layer) {
      if (lengths[layer] == 0) continue;  // a layer that holds no token moves as one
      Append(shape, id, layer, lengths[layer], seed + 10 * layer);
      ASSERT_FALSE(HasFatalFailure());
    }
    auto child = client_->ForkSequence(id);
    ASSERT_TRUE(child.ok()) << child.status();
    Append(shape, (*child)[0], 0, 1, seed + 500);  // copy-on-write of its last page at every layer
    ASSERT_FALSE(HasFatalFailure());
    std::vector<int64_t> child_lengths = lengths;
    child_lengths[0] += 1;
    for (const auto& [seq, lens] : {std::make_pair(id, lengths), std::make_pair((*child)[0], child_lengths)}) {
      auto copy = client_->ForkSequence(seq);
      ASSERT_TRUE(copy.ok()) << copy.status();
      MoveAndCompare(shape, seq, (*copy)[0], lens);
      ASSERT_FALSE(HasFatalFailure());
    }
  }

  AttndProcess servers_[2];
  client::MovePath expected_path_ = client::MovePath::kDevice;
  std::string uuid_;
  std::unique_ptr<client::Client> client_, direct_b_;
  std::unique_ptr<v1::Attention::Stub> stub_a_, stub_b_;
};

TEST_F(GpuSequenceMoves, Bf16SequencesAndAForkMoveOnTheDevice) {
  const client::SequenceShape shape = Bf16Shape(3);
  PrefillForkAndMove(shape, {37, 70, 5}, 100);
}

TEST_F(GpuSequenceMoves, Float8CacheMovesOnTheDevice) {
  const client::SequenceShape shape = Float8Shape();
  PrefillForkAndMove(shape, {129, 17, 0, 33}, 200);
}

// A step another caller sends while the sequence moves is either refused until the move is over and then follows it,
// or taken before the export: never applied to the old copy after its rows were copied (it would be lost with it).
// One caller appends a token at a time through its own client, naming the first id throughout, while the sequence
// moves between the servers; every step it was answered OK for is in the last copy.
TEST_F(GpuSequenceMoves, StepsSentDuringMovesAreNeverLost) {
  const client::SequenceShape shape = Bf16Shape(1);
  constexpr int64_t kPrefill = 64;
  const std::string first = OpenWithRows(shape, kPrefill, 900);
  ASSERT_FALSE(first.empty());
  std::unique_ptr<client::Client> stepper = Connect(servers_[0].address);
  ASSERT_NE(stepper, nullptr);
  std::atomic<bool> moving{true};
  std::atomic<int64_t> appended{0};
  absl::Status step_failed;
  std::thread steps([&] {
    const std::string k = client::RandomTensor(shape.dtype, shape.kv_heads * shape.head_dim, 910);
    const std::string v = client::RandomTensor(shape.dtype, shape.kv_heads * shape.head_dim, 911);
    while (moving.load()) {
      client::StepSpec spec;
      spec.sequences = {{first, 1}};
      spec.layer = 0;
      spec.k.data = k;
      spec.v.data = v;
      absl::StatusOr<client::StepResult> r = stepper->Step(spec);
      if (!r.ok()) {
        step_failed = r.status();
        return;
      }
      appended.fetch_add(1);
    }
  });
  // Six moves, A to B and back: the stepper's client follows at most kMaxMoveHops (8) ids from the first.
  std::string current = first;
  for (int move = 0; move < 6; ++move) {
    absl::SleepFor(absl::Milliseconds(30));  // steps land on this copy first
    // A step in flight refuses the export ABORTED: the client tries the move again (moving_step_retry).
    auto moved = client_->MoveSequence(current, servers_[(move + 1) % 2].address, client::MoveOptions());
    if (!moved.ok()) {
      ADD_FAILURE() << "move " << move << ": " << moved.status();
      break;
    }
    EXPECT_EQ(moved->path, client::MovePath::kDevice);
    current = moved->sequence_id;
  }
  absl::SleepFor(absl::Milliseconds(20));
  moving.store(false);
  steps.join();
  ASSERT_TRUE(step_failed.ok()) << step_failed;
  EXPECT_GT(appended.load(), 6);
  auto info = client_->GetSequence(current);
  ASSERT_TRUE(info.ok()) << info.status();
  ASSERT_EQ(info->lengths_size(), 1);
  EXPECT_EQ(info->lengths(0), kPrefill + appended.load()) << "steps answered OK are missing from the moved copy";
  EXPECT_TRUE(client_->CloseSequence({current}).ok());
}

// The importer opens the handle itself: one that is not a handle is refused naming the field, before anything is
// copied, and the sequence it took pages for is freed; the sequence stays on A.
TEST_F(GpuSequenceMoves, AnImportWhoseHandleDoesNotOpenLeavesNothing) {
  const client::SequenceShape shape = Bf16Shape(2);
  const std::string id = OpenWithRows(shape, 20, 300);
  ASSERT_FALSE(id.empty());
  v1::ImportSequenceRequest header, rows;
  {
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReader<v1::ExportSequenceResponse>> reader;
    ReadDeviceExport(&ctx, id, &header, &rows, &reader);
    ASSERT_FALSE(HasFatalFailure());
    EXPECT_EQ(rows.chunk().device_rows().bytes(), 2u * 20 * 2 * 128 * 2);
    ctx.TryCancel();
    reader->Finish().ok();
  }
  rows.mutable_chunk()->mutable_device_rows()->set_ipc_handle(std::string(64, 'h'));
  const grpc::Status st = ImportOnB(header, rows);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  EXPECT_TRUE(absl::StartsWith(st.error_message(), "chunk.device_rows.ipc_handle: ")) << st.error_message();
  // The export ended with the cancel: the sequence steps again on A.
  const absl::StatusOr<std::string> o = DecodeOnceReleased(shape, id, 310);
  EXPECT_TRUE(o.ok()) << o.status();
}

// A's exports hand out its pool's handle; A's pages hold 16 tokens, B's 64, so runs split on both sides' pages.
class GpuSequenceMovesFromPool : public GpuSequenceMoves {
 protected:
  std::vector<std::string> ServerFlags(int server) const override {
    if (server == 0) return {"--sequence_device_moves_share_pool=always", "--kv_page_tokens=16"};
    return {"--kv_page_tokens=64"};
  }
};

TEST_F(GpuSequenceMovesFromPool, Bf16SequencesAndAForkMoveFromThePool) {
  const client::SequenceShape shape = Bf16Shape(3);
  PrefillForkAndMove(shape, {37, 130, 5}, 400);
}

TEST_F(GpuSequenceMovesFromPool, Float8CacheMovesFromThePool) {
  const client::SequenceShape shape = Float8Shape();
  PrefillForkAndMove(shape, {129, 17, 0, 33}, 500);
}

// B refuses rows on the device (--sequence_device_moves=false) though both servers report the same GPU: the
// automatic move falls back to bytes once A has let the sequence go, and every row arrives.
class GpuSequenceMovesToARefusingImporter : public GpuSequenceMoves {
 protected:
  std::vector<std::string> ServerFlags(int server) const override {
    if (server == 0) return {};
    return {"--sequence_device_moves=false"};
  }
};

TEST_F(GpuSequenceMovesToARefusingImporter, AnAutomaticMoveFallsBackToBytes) {
  expected_path_ = client::MovePath::kBytes;
  const client::SequenceShape shape = Bf16Shape(2);
  PrefillForkAndMove(shape, {45, 16}, 700);
}

// The pool an export names is checked against the allocation its handle opens: a pool claimed larger is refused
// naming the field, before anything is copied, and leaves nothing on B.
TEST_F(GpuSequenceMovesFromPool, APoolLargerThanItsAllocationIsRefused) {
  const client::SequenceShape shape = Bf16Shape(2);
  const std::string id = OpenWithRows(shape, 20, 600);
  ASSERT_FALSE(id.empty());
  grpc::ClientContext export_ctx;
  std::unique_ptr<grpc::ClientReader<v1::ExportSequenceResponse>> reader;
  v1::ImportSequenceRequest header, rows;
  ReadDeviceExport(&export_ctx, id, &header, &rows, &reader);
  ASSERT_FALSE(HasFatalFailure());
  ASSERT_TRUE(rows.chunk().device_rows().has_pool());
  EXPECT_EQ(rows.chunk().device_rows().pool().page_tokens(), 16);
  EXPECT_EQ(rows.chunk().device_rows().pool().pages_size(), 2);
  rows.mutable_chunk()->mutable_device_rows()->mutable_pool()->set_num_pages(1 << 30);
  rows.mutable_chunk()->mutable_device_rows()->mutable_pool()->set_pages(1, (1 << 30) - 1);
  const grpc::Status st = ImportOnB(header, rows);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  EXPECT_TRUE(absl::StartsWith(st.error_message(), "chunk.device_rows.pool.num_pages: ")) << st.error_message();
  export_ctx.TryCancel();
  reader->Finish().ok();
}

// By default (--sequence_device_moves_share_pool=peers) an export hands out the pool only to a call carrying the
// fleet's peer secret, as a drain's moves do; an ordinary caller's gets a buffer of the sequence's rows alone.
class GpuSequenceMovesSharedWithPeers : public GpuSequenceMoves {
 protected:
  static constexpr char kSecret[] = "gpu-sequence-moves-peer-secret";
  void SetUp() override {
    secret_file_ = absl::StrCat(::testing::TempDir(), "/peer_secret_", ::getpid());
    FILE* f = std::fopen(secret_file_.c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fputs(kSecret, f);
    std::fclose(f);
    GpuSequenceMoves::SetUp();
  }
  void TearDown() override { std::remove(secret_file_.c_str()); }
  std::vector<std::string> ServerFlags(int server) const override {
    (void)server;
    return {"--peer_secret_file=" + secret_file_};
  }
  std::string secret_file_;
};

TEST_F(GpuSequenceMovesSharedWithPeers, OnlyAPeersExportGetsThePool) {
  const client::SequenceShape shape = Bf16Shape(2);
  const std::string id = OpenWithRows(shape, 20, 800);
  ASSERT_FALSE(id.empty());
  for (const bool peer : {false, true}) {
    SCOPED_TRACE(peer ? "with the peer secret" : "without");
    grpc::ClientContext ctx;
    if (peer) {
      // The owner the client's calls are (its loopback host, OwnerOf), so the export finds the sequence.
      ctx.AddMetadata("attnd-peer-secret", kSecret);
      ctx.AddMetadata("attnd-owner", "ipv4:127.0.0.1");
    }
    std::unique_ptr<grpc::ClientReader<v1::ExportSequenceResponse>> reader;
    v1::ImportSequenceRequest header, rows;
    ReadDeviceExport(&ctx, id, &header, &rows, &reader);
    ASSERT_FALSE(HasFatalFailure());
    EXPECT_EQ(rows.chunk().device_rows().has_pool(), peer);
    ctx.TryCancel();
    reader->Finish().ok();
    const absl::StatusOr<std::string> o = DecodeOnceReleased(shape, id, 810);
    ASSERT_TRUE(o.ok()) << o.status();
  }
}

}  // namespace
}  // namespace attnd::gpu
