// The KV-sequence core (Sequences) on the CPU backend: every step's O and LSE checked against the double
// reference over the sequence's whole history, kept by the test; forks, truncation, closing, ownership, expiry,
// and bad input naming its field.
#include "attnd/server/sequences.h"

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "sequences_fixture.h"

namespace attnd::sequences_test {
namespace {

TEST_F(SequencesTest, PrefillInChunksThenDecodeEveryLayer) {
  Start();
  const std::vector<std::string> ids = Open(1);
  ASSERT_EQ(ids.size(), 1u);
  // Chunks that end mid-page and a one-token step, at every layer; then decode steps and a speculative one.
  for (int chunk : {37, 16, 1, 50}) {
    for (int layer = 0; layer < kLayers; ++layer) StepAndVerify(ids, {chunk}, layer, /*hard=*/chunk == 50);
  }
  for (int step = 0; step < 3; ++step) {
    for (int layer = 0; layer < kLayers; ++layer) StepAndVerify(ids, {1}, layer);
  }
  StepAndVerify(ids, {4}, 0);
  const v1::SequenceInfo info = Info(ids[0]);
  EXPECT_EQ(info.lengths(0), 37 + 16 + 1 + 50 + 3 + 4);
  EXPECT_EQ(info.lengths(1), 37 + 16 + 1 + 50 + 3);
  EXPECT_EQ(info.pages(), (info.lengths(0) + 15) / 16);
}

TEST_F(SequencesTest, RaggedBatchAndBothDtypesAndHeadDims) {
  for (v1::Dtype dt : {v1::DTYPE_BF16, v1::DTYPE_FP16}) {
    for (int hd : {64, 128, 256}) {
      SCOPED_TRACE(absl::StrCat("hd ", hd, " dtype ", dt));
      Start();
      head_dim_ = hd;
      dtype_ = dt == v1::DTYPE_FP16 ? DType::kFP16 : DType::kBF16;
      const std::vector<std::string> ids = Open(3, "alice", hd, dt);
      StepAndVerify(ids, {5, 33, 17}, 1);
      StepAndVerify(ids, {1, 1, 1}, 1);
      StepAndVerify(ids, {2, 7, 1}, 1);
      TearDown();
      gate_ = nullptr;
      history_.clear();
    }
  }
  sequences_.reset();
  backend_.reset();
}

TEST_F(SequencesTest, AttendWithoutAppendAndAppendWithoutAttend) {
  Start();
  const std::vector<std::string> ids = Open(1);
  v1::StepRequest append = MakeStep(ids, {20}, 0, /*append=*/true, /*attend=*/false);
  Outcome out = Run(append);
  ASSERT_TRUE(out.status.ok()) << out.status;
  EXPECT_TRUE(out.o.empty());
  EXPECT_EQ(out.lengths, std::vector<int64_t>{20});
  Record(append);
  // Q rows for the last 6 cached positions.
  const v1::StepRequest attend = MakeStep(ids, {6}, 0, /*append=*/false, /*attend=*/true);
  out = Run(attend);
  Verify(attend, out);
  EXPECT_EQ(out.lengths, std::vector<int64_t>{20});
}

TEST_F(SequencesTest, ForkSharesPagesAndDiverges) {
  Start();
  const std::vector<std::string> parent = Open(1);
  for (int layer = 0; layer < kLayers; ++layer) StepAndVerify(parent, {40}, layer);  // 2.5 pages
  v1::ForkSequenceRequest fr;
  fr.set_sequence_id(parent[0]);
  fr.set_count(2);
  absl::StatusOr<v1::ForkSequenceResponse> forked = sequences_->Fork("alice", fr);
  ASSERT_TRUE(forked.ok()) << forked.status();
  ASSERT_EQ(forked->sequence_ids_size(), 2);
  const std::string a = forked->sequence_ids(0), b = forked->sequence_ids(1);
  history_[a] = history_[b] = history_[parent[0]];
  EXPECT_EQ(Info(a).shared_pages(), 3);
  const uint64_t used_before = sequences_->stats().pages_used();
  EXPECT_EQ(used_before, 3u);  // shared, not copied
  // Each writes into the shared last page: each gets its own copy; the others keep theirs.
  for (int layer = 0; layer < kLayers; ++layer) {
    StepAndVerify({a}, {1}, layer);
    StepAndVerify({b}, {3}, layer);
  }
  EXPECT_EQ(Info(a).shared_pages(), 2);
  // A fork of a fork, then every one of them steps again and is checked against its own history.
  fr.set_sequence_id(a);
  fr.set_count(1);
  forked = sequences_->Fork("alice", fr);
  ASSERT_TRUE(forked.ok()) << forked.status();
  const std::string c = forked->sequence_ids(0);
  history_[c] = history_[a];
  for (int layer = 0; layer < kLayers; ++layer) StepAndVerify({parent[0], a, b, c}, {2, 1, 1, 30}, layer);
  // Closing everything returns every page.
  v1::CloseSequenceRequest close;
  for (const std::string& id : {parent[0], a, b, c}) close.add_sequence_ids(id);
  ASSERT_TRUE(sequences_->Close("alice", close).ok());
  EXPECT_EQ(sequences_->stats().pages_used(), 0u);
  EXPECT_EQ(sequences_->stats().open(), 0u);
  EXPECT_EQ(sequences_->stats().pools(), 0u);
}

// What a drain that moves the sequences reads, holds and waits on: the open sequences with their owners and bytes;
// an id closed with moved_to answers NOT_FOUND with the new id as its payload, and counts as followed once named
// again; a held sequence takes no step until released.
TEST_F(SequencesTest, AMovedIdNamesItsNewIdAndIsFollowedOnceNamedAgain) {
  Start();
  const std::vector<std::string> ids = Open(2);
  StepAndVerify({ids[0]}, {3}, 0);
  Sequences* core = sequences_->core();
  std::vector<Sequences::HeldSequence> held = core->OpenSequences();
  ASSERT_EQ(held.size(), 2u);
  if (held[0].id != ids[0]) std::swap(held[0], held[1]);
  EXPECT_EQ(held[0].id, ids[0]);
  EXPECT_EQ(held[0].owner, "alice");
  EXPECT_EQ(held[0].bytes, 3u * 2 * kKvHeads * kHeadDim * 2);  // 3 rows of K and of V, bf16
  EXPECT_EQ(held[1].bytes, 0u);
  for (const std::string& id : ids) core->ExpectFollow(id);
  const absl::string_view first[] = {ids[0]};
  ASSERT_TRUE(core->Close("alice", first, "elsewhere-1@10.0.0.2:50051").ok());
  EXPECT_EQ(core->AwaitFollowed(absl::Now()), 2u);
  const absl::Status gone = core->Get("alice", ids[0]).status();
  ExpectStatus(gone, absl::StatusCode::kNotFound, "sequence_id: ");
  EXPECT_TRUE(absl::StrContains(gone.message(), "moved to elsewhere-1@10.0.0.2:50051")) << gone;
  ASSERT_TRUE(gone.GetPayload(server::kMovedToPayload).has_value());
  EXPECT_EQ(std::string(*gone.GetPayload(server::kMovedToPayload)), "elsewhere-1@10.0.0.2:50051");
  EXPECT_EQ(core->AwaitFollowed(absl::Now()), 1u);
  // A drain's hold refuses steps, forks and truncations as an export does, until it is released (a failed move).
  ASSERT_TRUE(core->HoldForMove("alice", ids[1]).ok());
  const absl::Status refused = Run(MakeStep({ids[1]}, {1}, 0)).status;
  ExpectStatus(refused, absl::StatusCode::kAborted, "sequences[0].sequence_id: ");
  EXPECT_TRUE(absl::StrContains(refused.message(), " is being moved")) << refused;
  v1::ForkSequenceRequest fork;
  fork.set_sequence_id(ids[1]);
  ExpectStatus(sequences_->Fork("alice", fork).status(), absl::StatusCode::kAborted, "sequence_id: ");
  ExpectStatus(core->HoldForMove("bob", ids[1]), absl::StatusCode::kNotFound, "sequence_id: ");
  core->ReleaseHold(ids[1]);
  core->Unexpect(ids[1]);  // its move failed: it stays, and nobody needs telling
  StepAndVerify({ids[1]}, {2}, 0);
  EXPECT_EQ(core->AwaitFollowed(absl::Now()), 0u);
  EXPECT_EQ(core->OpenSequences().size(), 1u);
}

// A mover closes the old copy while its export still holds it: from that close on, a step, a Get or a second export
// reads NOT_FOUND naming the new id (what the tombstone says once the export ends), never an unknown id. The pages go
// at the export's end, or at the close once the export has read every row it sends.
TEST_F(SequencesTest, AnIdClosedDuringItsExportReadsAsMovedAtOnce) {
  Start();
  const std::vector<std::string> ids = Open(1);
  StepAndVerify(ids, {5}, 0);
  Sequences* core = sequences_->core();
  absl::StatusOr<server::MovingSequence> held = core->BeginExport("alice", ids[0]);
  ASSERT_TRUE(held.ok()) << held.status();
  const absl::string_view first[] = {ids[0]};
  ASSERT_TRUE(core->Close("alice", first, "elsewhere-2@10.0.0.2:50051").ok());
  const auto expect_moved = [&](const absl::Status& status, const std::string& field) {
    ExpectStatus(status, absl::StatusCode::kNotFound, field);
    EXPECT_TRUE(absl::StrContains(status.message(), "moved to elsewhere-2@10.0.0.2:50051")) << status;
    ASSERT_TRUE(status.GetPayload(server::kMovedToPayload).has_value()) << status;
    EXPECT_EQ(std::string(*status.GetPayload(server::kMovedToPayload)), "elsewhere-2@10.0.0.2:50051");
  };
  expect_moved(Run(MakeStep(ids, {1}, 0)).status, "sequences[0].sequence_id: ");
  expect_moved(core->Get("alice", ids[0]).status(), "sequence_id: ");
  expect_moved(core->BeginExport("alice", ids[0]).status(), "sequence_id: ");
  // Another caller still reads it as unknown, as it would any foreign id.
  const absl::Status foreign = core->Get("bob", ids[0]).status();
  ExpectStatus(foreign, absl::StatusCode::kNotFound, "sequence_id: ");
  EXPECT_FALSE(foreign.GetPayload(server::kMovedToPayload).has_value()) << foreign;
  EXPECT_EQ(sequences_->stats().open(), 1u);  // its pages stay until the export ends: it may still read them
  core->EndExport(*held);
  EXPECT_EQ(sequences_->stats().open(), 0u);
  EXPECT_EQ(sequences_->stats().pages_used(), 0u);
  expect_moved(core->Get("alice", ids[0]).status(), "sequence_id: ");

  // An export that has read every row it sends (ExportSent) holds against steps, but a close frees it at once.
  const std::vector<std::string> second = Open(1);
  StepAndVerify(second, {7}, 0);
  held = core->BeginExport("alice", second[0]);
  ASSERT_TRUE(held.ok()) << held.status();
  core->ExportSent(*held);
  ExpectStatus(Run(MakeStep(second, {1}, 0)).status, absl::StatusCode::kAborted, "sequences[0].sequence_id: ");
  const absl::string_view again[] = {second[0]};
  ASSERT_TRUE(core->Close("alice", again, "elsewhere-2@10.0.0.2:50051").ok());
  EXPECT_EQ(sequences_->stats().open(), 0u);
  EXPECT_EQ(sequences_->stats().pages_used(), 0u);
  expect_moved(Run(MakeStep(second, {1}, 0)).status, "sequences[0].sequence_id: ");
  core->EndExport(*held);  // finds it gone
  EXPECT_EQ(sequences_->stats().open(), 0u);
}

// Moving a sequence, in the core: an export holds it (no step, fork or truncate; a close waits for the end) and
// reads its rows as they were sent, shared pages included; an import opens it only once it is complete.
TEST_F(SequencesTest, AnExportHoldsItsSequenceAndAnImportOpensItWhole) {
  Start();
  const std::vector<std::string> ids = Open(1);
  for (int layer = 0; layer < kLayers; ++layer) StepAndVerify(ids, {20 + 7 * layer}, layer);
  v1::ForkSequenceRequest fr;
  fr.set_sequence_id(ids[0]);
  const std::string child = sequences_->Fork("alice", fr)->sequence_ids(0);
  Sequences* core = sequences_->core();
  absl::StatusOr<server::MovingSequence> held = core->BeginExport("alice", child);
  ASSERT_TRUE(held.ok()) << held.status();
  ExpectStatus(core->BeginExport("alice", child).status(), absl::StatusCode::kAborted, "sequence_id: ");
  ExpectStatus(core->BeginExport("bob", ids[0]).status(), absl::StatusCode::kNotFound, "sequence_id: ");
  ExpectStatus(Run(MakeStep({child}, {1}, 0)).status, absl::StatusCode::kAborted, "sequences[0].sequence_id: ");
  EXPECT_TRUE(absl::StrContains(Run(MakeStep({child}, {1}, 0)).status.message(), "being moved"));
  v1::TruncateSequenceRequest tr;
  tr.set_sequence_id(child);
  ExpectStatus(sequences_->Truncate("alice", tr).status(), absl::StatusCode::kAborted, "sequence_id: ");
  fr.set_sequence_id(child);
  ExpectStatus(sequences_->Fork("alice", fr).status(), absl::StatusCode::kAborted, "sequence_id: ");
  EXPECT_FALSE(Info(child).step_in_flight());  // held, not stepping
  StepAndVerify(ids, {1}, 0);  // the parent it shares pages with steps on

  // Every row of every layer as the child's history has it, into a new sequence of another owner.
  server::ImportArgs header = ImportHeader(held->lengths);
  EXPECT_EQ(held->lengths, std::vector<int64_t>({20, 27, 34}));
  absl::StatusOr<server::MovingSequence> in = core->BeginImport("carol", header);
  ASSERT_TRUE(in.ok()) << in.status();
  const History& h = history_[ids[0]];
  for (int layer = 0; layer < kLayers; ++layer) {
    for (int kv = 0; kv < 2; ++kv) {
      std::string rows(held->lengths[layer] * held->row_bytes(), '\0');
      ASSERT_TRUE(core->ReadRows(*held, layer, kv, 0, held->lengths[layer], reinterpret_cast<uint8_t*>(rows.data()))
                      .ok());
      // The parent's history, less the token it appended after the fork at layer 0.
      EXPECT_EQ(rows, (kv == 0 ? h.k : h.v)[layer].substr(0, rows.size())) << "layer " << layer << " kv " << kv;
      // In two writes, the second not page-aligned and from pieces that cut rows anywhere, as a received
      // message's slices do.
      const auto* bytes = reinterpret_cast<const uint8_t*>(rows.data());
      ASSERT_TRUE(core->WriteRows(*in, layer, kv, 0, 5, bytes).ok());
      std::vector<absl::Span<const uint8_t>> pieces;
      for (size_t at = 5 * held->row_bytes(), cut = 1; at < rows.size(); at += cut, cut = cut * 3 + 1) {
        pieces.emplace_back(bytes + at, std::min(cut, rows.size() - at));
      }
      ASSERT_TRUE(core->WriteRows(*in, layer, kv, 5, held->lengths[layer] - 5, pieces).ok());
    }
  }
  const std::string one_row(held->row_bytes(), '\0');
  const absl::Span<const uint8_t> short_piece(reinterpret_cast<const uint8_t*>(one_row.data()), one_row.size());
  ExpectStatus(core->WriteRows(*in, 0, 0, 0, 2, server::HostPieces(&short_piece, 1)),
               absl::StatusCode::kInvalidArgument, "data: ");
  ExpectStatus(core->WriteRows(*in, 0, 0, 15, 6, nullptr), absl::StatusCode::kInvalidArgument, "first_token: ");
  ExpectStatus(core->WriteRows(*in, 0, 2, 0, 1, nullptr), absl::StatusCode::kInvalidArgument, "kv: ");
  // Not yet opened: its owner cannot step it.
  ExpectStatus(Run(MakeStep({in->sequence_id}, {1}, 0), "carol").status, absl::StatusCode::kAborted,
               "sequences[0].sequence_id: ");
  absl::StatusOr<server::OpenedSequences> opened = core->EndImport(*in, true);
  ASSERT_TRUE(opened.ok()) << opened.status();
  ASSERT_EQ(opened->sequence_ids, std::vector<std::string>({in->sequence_id}));
  History copy = h;
  copy.k[0].resize(held->lengths[0] * held->row_bytes());
  copy.v[0].resize(held->lengths[0] * held->row_bytes());
  history_[in->sequence_id] = copy;
  for (int layer = 0; layer < kLayers; ++layer) StepAndVerify({in->sequence_id}, {2}, layer, false, "carol");

  // A close during the export waits for its end, and the tombstone says where the sequence went.
  const absl::string_view child_id[] = {child};
  ASSERT_TRUE(core->Close("alice", child_id, in->sequence_id).ok());
  EXPECT_EQ(sequences_->stats().open(), 3u);
  core->EndExport(*held);
  EXPECT_EQ(sequences_->stats().open(), 2u);
  v1::GetSequenceRequest g;
  g.set_sequence_id(child);
  ExpectStatus(sequences_->Get("alice", g).status(), absl::StatusCode::kNotFound, "sequence_id: ");
  EXPECT_TRUE(absl::StrContains(sequences_->Get("alice", g).status().message(), "moved to " + in->sequence_id))
      << sequences_->Get("alice", g).status();

  // An import that does not complete leaves nothing behind.
  const uint64_t used = sequences_->stats().pages_used();
  absl::StatusOr<server::MovingSequence> partial = core->BeginImport("carol", header);
  ASSERT_TRUE(partial.ok()) << partial.status();
  EXPECT_GT(sequences_->stats().pages_used(), used);
  EXPECT_FALSE(core->EndImport(*partial, false).ok());
  EXPECT_EQ(sequences_->stats().pages_used(), used);
  EXPECT_EQ(sequences_->stats().open(), 2u);
  header.lengths = {20};
  ExpectStatus(core->BeginImport("carol", header).status(), absl::StatusCode::kInvalidArgument, "sequence.lengths: ");
}

// A move on the device needs a GPU: the CPU backend refuses to export rows on one (the sequence is released as
// before), and an import of device rows is checked (their bytes against the header, then the GPU) and, refused,
// frees what it took.
TEST_F(SequencesTest, DeviceRowsAreRefusedOnTheCpuBackendAndLeaveNothing) {
  Start();
  const std::vector<std::string> ids = Open(1);
  for (int layer = 0; layer < kLayers; ++layer) StepAndVerify(ids, {20 + 7 * layer}, layer);
  Sequences* core = sequences_->core();
  absl::StatusOr<server::MovingSequence> held = core->BeginExport("alice", ids[0]);
  ASSERT_TRUE(held.ok()) << held.status();
  std::shared_ptr<void> hold;
  ExpectStatus(core->ExportOnDevice(*held, /*peer=*/false, &hold).status(), absl::StatusCode::kFailedPrecondition, "device: ");
  EXPECT_EQ(hold, nullptr);
  core->EndExport(*held);
  StepAndVerify(ids, {1}, 0);  // released

  const uint64_t used = sequences_->stats().pages_used();
  server::ImportArgs header = ImportHeader(held->lengths);
  absl::StatusOr<server::MovingSequence> in = core->BeginImport("carol", header);
  ASSERT_TRUE(in.ok()) << in.status();
  EXPECT_EQ(in->total_bytes(), 2 * (20 + 27 + 34) * in->row_bytes());
  server::DeviceRows rows;
  rows.ipc_handle = std::string(64, 'x');
  rows.device_uuid = "00112233445566778899aabbccddeeff";
  rows.bytes = in->total_bytes() - in->row_bytes();
  ExpectStatus(core->ImportOnDevice(*in, rows), absl::StatusCode::kInvalidArgument, "chunk.device_rows.bytes: ");
  rows.bytes = in->total_bytes();
  ExpectStatus(core->ImportOnDevice(*in, rows), absl::StatusCode::kFailedPrecondition,
               "chunk.device_rows.device_uuid: ");
  // An exporter's pool pages: what can be checked without opening the pool is, before the backend sees them.
  rows.from_pool = true;
  rows.pool_num_pages = 8;
  rows.pool_page_tokens = 24;
  rows.pool_pages = {5, 0, 7};  // 34 tokens in pages of 16
  ExpectStatus(core->ImportOnDevice(*in, rows), absl::StatusCode::kInvalidArgument,
               "chunk.device_rows.pool.page_tokens: ");
  rows.pool_page_tokens = 16;
  rows.pool_num_pages = 0;
  ExpectStatus(core->ImportOnDevice(*in, rows), absl::StatusCode::kInvalidArgument,
               "chunk.device_rows.pool.num_pages: ");
  rows.pool_num_pages = 8;
  rows.pool_pages = {5, 0};
  ExpectStatus(core->ImportOnDevice(*in, rows), absl::StatusCode::kInvalidArgument, "chunk.device_rows.pool.pages: ");
  rows.pool_pages = {5, 8, 7};
  ExpectStatus(core->ImportOnDevice(*in, rows), absl::StatusCode::kInvalidArgument,
               "chunk.device_rows.pool.pages[1]: ");
  rows.pool_pages = {5, 0, 7};
  ExpectStatus(core->ImportOnDevice(*in, rows), absl::StatusCode::kFailedPrecondition,
               "chunk.device_rows.device_uuid: ");
  EXPECT_FALSE(core->EndImport(*in, false).ok());
  EXPECT_EQ(sequences_->stats().pages_used(), used);
  EXPECT_EQ(sequences_->stats().open(), 1u);
}

// --sequence_device_moves=false: an export on the device and device rows on import are refused before the backend
// sees them, naming the flag, and the held sequences are as before.
TEST_F(SequencesTest, DeviceMovesTurnedOffAreRefusedNamingTheFlag) {
  SequenceOptions options;
  options.device_moves = false;
  Start(options);
  const std::vector<std::string> ids = Open(1);
  StepAndVerify(ids, {9}, 0);
  Sequences* core = sequences_->core();
  absl::StatusOr<server::MovingSequence> held = core->BeginExport("alice", ids[0]);
  ASSERT_TRUE(held.ok()) << held.status();
  std::shared_ptr<void> hold;
  ExpectStatus(core->ExportOnDevice(*held, /*peer=*/false, &hold).status(), absl::StatusCode::kFailedPrecondition,
               "device: this server moves sequences by bytes only (--sequence_device_moves=false)");
  EXPECT_EQ(hold, nullptr);
  core->EndExport(*held);

  server::ImportArgs header = ImportHeader(held->lengths);
  absl::StatusOr<server::MovingSequence> in = core->BeginImport("carol", header);
  ASSERT_TRUE(in.ok()) << in.status();
  server::DeviceRows rows;
  rows.ipc_handle = std::string(64, 'x');
  rows.bytes = in->total_bytes();
  ExpectStatus(core->ImportOnDevice(*in, rows), absl::StatusCode::kFailedPrecondition,
               "chunk.device_rows: this server moves sequences by bytes only");
  EXPECT_FALSE(core->EndImport(*in, false).ok());
  EXPECT_EQ(sequences_->stats().open(), 1u);
  StepAndVerify(ids, {1}, 0);  // the exported sequence steps again
}

TEST_F(SequencesTest, TruncateDropsTokensAndPages) {
  Start();
  const std::vector<std::string> ids = Open(1);
  for (int layer = 0; layer < kLayers; ++layer) StepAndVerify(ids, {50}, layer);
  v1::TruncateSequenceRequest tr;
  tr.set_sequence_id(ids[0]);
  tr.set_tokens(20);
  absl::StatusOr<v1::TruncateSequenceResponse> t = sequences_->Truncate("alice", tr);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->lengths(0), 20);
  EXPECT_EQ(Info(ids[0]).pages(), 2);
  History& h = history_[ids[0]];
  for (int layer = 0; layer < kLayers; ++layer) {
    h.k[layer].resize(20 * kKvHeads * kHeadDim * 2);
    h.v[layer].resize(20 * kKvHeads * kHeadDim * 2);
  }
  for (int layer = 0; layer < kLayers; ++layer) StepAndVerify(ids, {3}, layer);
  tr.set_tokens(-1);
  ExpectStatus(sequences_->Truncate("alice", tr).status(), absl::StatusCode::kInvalidArgument, "tokens:");
}

TEST_F(SequencesTest, OwnershipClosingAndForeignIds) {
  Start();
  const std::vector<std::string> ids = Open(1);
  v1::GetSequenceRequest g;
  g.set_sequence_id(ids[0]);
  // Another owner: exactly the answer an unknown id of this server gets.
  const absl::Status foreign = sequences_->Get("mallory", g).status();
  ExpectStatus(foreign, absl::StatusCode::kNotFound, "sequence_id: no open sequence");
  v1::StepRequest step = MakeStep(ids, {1}, 0);
  ExpectStatus(Run(step, "mallory").status, absl::StatusCode::kNotFound, "sequences[0].sequence_id:");
  v1::CloseSequenceRequest close;
  close.add_sequence_ids(ids[0]);
  ExpectStatus(sequences_->Close("mallory", close), absl::StatusCode::kNotFound, "sequence_ids[0]:");
  ASSERT_TRUE(sequences_->Close("alice", close).ok());
  ExpectStatus(sequences_->Get("alice", g).status(), absl::StatusCode::kNotFound, "sequence_id: sequence");
  EXPECT_TRUE(absl::StrContains(sequences_->Get("alice", g).status().message(), "closed"));
  // An id of another server process (a restart).
  g.set_sequence_id("00000000-0123456789abcdef0123456789abcdef");
  const absl::Status other = sequences_->Get("alice", g).status();
  EXPECT_EQ(other.code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(absl::StrContains(other.message(), "restarted")) << other;
  // Ids are 128 random bits after the process prefix.
  const std::vector<std::string> more = Open(2);
  EXPECT_NE(more[0], more[1]);
  EXPECT_EQ(more[0].size(), 8u + 1u + 32u);
}

TEST_F(SequencesTest, IdleSequencesExpire) {
  SequenceOptions o;
  o.ttl = absl::Seconds(30);
  Start(o);
  const std::vector<std::string> ids = Open(2);
  StepAndVerify({ids[0]}, {3}, 0);
  EXPECT_EQ(sequences_->ExpireIdle(absl::Now()), 0);
  EXPECT_EQ(sequences_->ExpireIdle(absl::Now() + absl::Seconds(31)), 2);
  const Outcome out = Run(MakeStep({ids[0]}, {1}, 0));
  ExpectStatus(out.status, absl::StatusCode::kNotFound, "sequences[0].sequence_id:");
  EXPECT_TRUE(absl::StrContains(out.status.message(), "idle")) << out.status;
  EXPECT_EQ(sequences_->stats().expired(), 2u);
  EXPECT_EQ(sequences_->stats().pages_used(), 0u);
}

TEST_F(SequencesTest, BadStepsNameTheirField) {
  SequenceOptions o;
  o.max_pools = 2;
  Start(o);
  const std::vector<std::string> ids = Open(2);
  const std::vector<std::string> other = Open(1, "alice", 128);
  StepAndVerify(ids, {2, 2}, 0);
  struct Case {
    std::string name;
    std::function<void(v1::StepRequest&)> mutate;
    absl::StatusCode code;
    std::string field;
  };
  const std::vector<Case> cases = {
      {"no sequences", [](v1::StepRequest& r) { r.clear_sequences(); }, absl::StatusCode::kInvalidArgument,
       "sequences:"},
      {"layer too big", [](v1::StepRequest& r) { r.set_layer(kLayers); }, absl::StatusCode::kInvalidArgument,
       "layer:"},
      {"negative layer", [](v1::StepRequest& r) { r.set_layer(-1); }, absl::StatusCode::kInvalidArgument, "layer:"},
      {"q_heads not a multiple", [](v1::StepRequest& r) { r.set_q_heads(3); }, absl::StatusCode::kInvalidArgument,
       "q_heads:"},
      {"k without v", [](v1::StepRequest& r) { r.clear_v(); }, absl::StatusCode::kInvalidArgument, "v:"},
      {"nothing to do",
       [](v1::StepRequest& r) {
         r.clear_q();
         r.clear_k();
         r.clear_v();
       },
       absl::StatusCode::kInvalidArgument, "q:"},
      {"short q", [](v1::StepRequest& r) { r.mutable_q()->mutable_data()->pop_back(); },
       absl::StatusCode::kInvalidArgument, "q.data:"},
      {"long k", [](v1::StepRequest& r) { r.mutable_k()->mutable_data()->append("xx"); },
       absl::StatusCode::kInvalidArgument, "k.data:"},
      {"zero tokens", [](v1::StepRequest& r) { r.mutable_sequences(1)->set_tokens(0); },
       absl::StatusCode::kInvalidArgument, "sequences[1].tokens:"},
      {"duplicate", [&](v1::StepRequest& r) { r.mutable_sequences(1)->set_sequence_id(ids[0]); },
       absl::StatusCode::kInvalidArgument, "sequences[1].sequence_id:"},
      {"unknown id", [](v1::StepRequest& r) { r.mutable_sequences(1)->set_sequence_id("nope"); },
       absl::StatusCode::kNotFound, "sequences[1].sequence_id:"},
      {"shape mismatch", [&](v1::StepRequest& r) { r.mutable_sequences(1)->set_sequence_id(other[0]); },
       absl::StatusCode::kInvalidArgument, "sequences[1].sequence_id:"},
      {"infinite scale", [](v1::StepRequest& r) { r.set_softmax_scale(INFINITY); },
       absl::StatusCode::kInvalidArgument, "softmax_scale:"},
      {"o_ref without ipc", [](v1::StepRequest& r) { r.mutable_o_ref()->set_buffer_id("b"); },
       absl::StatusCode::kFailedPrecondition, "o_ref:"},
      {"attend past the cache",
       [](v1::StepRequest& r) {
         r.clear_k();
         r.clear_v();
         r.mutable_sequences(0)->set_tokens(3);
         r.mutable_q()->mutable_data()->append(std::string(kQHeads * kHeadDim * 2, '\1'));
       },
       absl::StatusCode::kInvalidArgument, "sequences[0].tokens:"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    v1::StepRequest r = MakeStep(ids, {1, 1}, 0);
    c.mutate(r);
    ExpectStatus(Run(r).status, c.code, c.field);
  }
  // Nothing leaked, nothing changed.
  EXPECT_EQ(Info(ids[0]).lengths(0), 2);
  EXPECT_FALSE(Info(ids[0]).step_in_flight());
  EXPECT_EQ(sequences_->stats().pages_used(), 2u);
  // Past the sequence's own max_tokens.
  v1::OpenSequenceRequest small;
  small.mutable_shape()->set_layers(kLayers);
  small.mutable_shape()->set_kv_heads(kKvHeads);
  small.mutable_shape()->set_head_dim(kHeadDim);
  small.mutable_shape()->set_dtype(v1::DTYPE_BF16);
  small.set_max_tokens(10);
  absl::StatusOr<v1::OpenSequenceResponse> s = sequences_->Open("alice", small);
  ASSERT_TRUE(s.ok());
  StepAndVerify({s->sequence_ids(0)}, {8}, 0);
  ExpectStatus(Run(MakeStep({s->sequence_ids(0)}, {3}, 0)).status, absl::StatusCode::kResourceExhausted,
               "sequences[0].tokens:");
}

TEST_F(SequencesTest, BadOpensNameTheirField) {
  Start();
  v1::OpenSequenceRequest r;
  r.mutable_shape()->set_layers(2);
  r.mutable_shape()->set_kv_heads(2);
  r.mutable_shape()->set_head_dim(96);
  r.mutable_shape()->set_dtype(v1::DTYPE_BF16);
  ExpectStatus(sequences_->Open("alice", r).status(), absl::StatusCode::kInvalidArgument, "shape.head_dim:");
  r.mutable_shape()->set_head_dim(64);
  // The dtype has no default: left unset (or misspelled by a JSON client, which reads as unset) it is refused,
  // as is a number that names no dtype.
  r.mutable_shape()->clear_dtype();
  absl::Status unset = sequences_->Open("alice", r).status();
  EXPECT_EQ(unset.code(), absl::StatusCode::kInvalidArgument) << unset;
  EXPECT_EQ(unset.message(), "shape.dtype: DTYPE_UNSPECIFIED (set DTYPE_BF16 or DTYPE_FP16)");
  r.mutable_shape()->set_dtype(static_cast<v1::Dtype>(7));
  ExpectStatus(sequences_->Open("alice", r).status(), absl::StatusCode::kInvalidArgument, "shape.dtype:");
  r.mutable_shape()->set_dtype(v1::DTYPE_BF16);
  r.mutable_shape()->set_layers(0);
  ExpectStatus(sequences_->Open("alice", r).status(), absl::StatusCode::kInvalidArgument, "shape.layers:");
  r.mutable_shape()->set_layers(2);
  r.set_max_tokens(1 << 30);
  ExpectStatus(sequences_->Open("alice", r).status(), absl::StatusCode::kResourceExhausted, "max_tokens:");
  r.set_max_tokens(0);
  r.set_count(100000);
  ExpectStatus(sequences_->Open("alice", r).status(), absl::StatusCode::kResourceExhausted, "count:");
  // A second shape while the first holds the only pool.
  r.set_count(1);
  ASSERT_TRUE(sequences_->Open("alice", r).ok());
  r.mutable_shape()->set_head_dim(128);
  ExpectStatus(sequences_->Open("alice", r).status(), absl::StatusCode::kResourceExhausted, "kv pool:");
}

}  // namespace
}  // namespace attnd::sequences_test
