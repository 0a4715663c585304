// ExportSequence and ImportSequence (docs/sequences.md, "Moving a sequence"): a sequence's rows streamed out of this
// server, and a stream of them taken in as a new sequence. The rows go in a fixed order (layer 0 K, layer 0 V,
// layer 1 K, ..., each from token 0), so the importer knows where every chunk belongs and that none is missing; one
// chunk is in memory at a time on either side.
#include <algorithm>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "call_observer.h"
#include "core_messages.h"
#include "grpc_status.h"
#include "service.h"

namespace attnd::server {
namespace {

constexpr uint64_t kDefaultChunkBytes = 1 << 20;
// What a chunk's message holds besides its rows (the header is in the first, which has no rows).
constexpr uint64_t kChunkOverheadBytes = 4096;

// Where the next rows of a moving sequence go: a layer's K or V from a token. Walks the fixed order, skipping
// layers that hold no token.
struct RowCursor {
  int layer = 0, kv = 0;
  int64_t next = 0;
  // Moves past empty layers and past the end of the current layer's K or V; false once every row is done.
  bool Settle(const MovingSequence& m) {
    while (layer < m.shape.layers && next >= m.lengths[layer]) {
      next = 0;
      if (++kv == 2) kv = 0, ++layer;
    }
    return layer < m.shape.layers;
  }
  std::string Text() const { return absl::StrCat("layer ", layer, " ", kv == 0 ? "K" : "V", " from token ", next); }
};

class ExportReactor final : public grpc::ServerWriteReactor<v1::SequenceChunk> {
 public:
  ExportReactor(Sequences* sequences, const std::string& owner, const v1::ExportSequenceRequest& request,
                uint64_t max_message_bytes, absl::Time start)
      : sequences_(sequences), start_(start) {
    absl::StatusOr<MovingSequence> held = sequences_->BeginExport(owner, request.sequence_id());
    if (!held.ok()) {
      LogOutcome("ExportSequence", "", held.status(), start_);
      Finish(ToGrpcStatus(held.status()));
      return;
    }
    moving_ = *std::move(held);
    const uint64_t most = max_message_bytes > 2 * kChunkOverheadBytes ? max_message_bytes - kChunkOverheadBytes
                                                                      : kChunkOverheadBytes;
    const uint64_t want = std::min(request.chunk_bytes() == 0 ? kDefaultChunkBytes : request.chunk_bytes(), most);
    chunk_rows_ = std::max<int64_t>(1, static_cast<int64_t>(want / moving_.row_bytes()));
    *chunk_.mutable_sequence() = SequenceHeaderToProto(moving_);
    StartWrite(&chunk_);
  }

  void OnWriteDone(bool ok) override {
    if (!ok) return End(absl::CancelledError("the export stream broke before its last chunk"));
    chunk_.Clear();
    if (!cursor_.Settle(moving_)) return End(absl::OkStatus());
    const int64_t rows = std::min(chunk_rows_, moving_.lengths[cursor_.layer] - cursor_.next);
    chunk_.set_layer(cursor_.layer);
    chunk_.set_kv(cursor_.kv);
    chunk_.set_first_token(cursor_.next);
    std::string* data = chunk_.mutable_data();
    data->resize(static_cast<size_t>(rows) * moving_.row_bytes());
    const absl::Status read = sequences_->ReadRows(moving_, cursor_.layer, cursor_.kv, cursor_.next, rows,
                                                   reinterpret_cast<uint8_t*>(data->data()));
    if (!read.ok()) return End(read);
    cursor_.next += rows;
    StartWrite(&chunk_);
  }

  void OnDone() override { delete this; }

 private:
  void End(const absl::Status& status) {
    sequences_->EndExport(moving_);
    LogOutcome("ExportSequence", "", status, start_);
    Finish(ToGrpcStatus(status));
  }

  Sequences* const sequences_;
  const absl::Time start_;
  MovingSequence moving_;
  int64_t chunk_rows_ = 1;
  RowCursor cursor_;
  v1::SequenceChunk chunk_;
};

class ImportReactor final : public grpc::ServerReadReactor<v1::SequenceChunk> {
 public:
  ImportReactor(grpc::CallbackServerContext* ctx, Sequences* sequences, std::string owner,
                v1::ImportSequenceResponse* response, absl::Time start)
      : ctx_(ctx), sequences_(sequences), owner_(std::move(owner)), response_(response), start_(start) {
    StartRead(&chunk_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) return Complete();
    const absl::Status taken = Take();
    if (!taken.ok()) return End(taken);
    StartRead(&chunk_);
  }

  void OnDone() override { delete this; }

 private:
  // One chunk: the header (the first), else rows where the cursor says.
  absl::Status Take() {
    if (!held_) {
      if (!chunk_.has_sequence()) return absl::InvalidArgumentError("sequence: the first chunk carries the header");
      absl::StatusOr<ImportArgs> args = ImportArgsFromProto(chunk_.sequence());
      if (!args.ok()) return args.status();
      absl::StatusOr<MovingSequence> held = sequences_->BeginImport(owner_, *args);
      if (!held.ok()) return held.status();
      moving_ = *std::move(held);
      held_ = true;
      return absl::OkStatus();
    }
    if (chunk_.has_sequence()) return absl::InvalidArgumentError("sequence: only the first chunk carries the header");
    if (!cursor_.Settle(moving_)) {
      return absl::InvalidArgumentError("data: a chunk past the last row the header announced");
    }
    if (chunk_.layer() != cursor_.layer || chunk_.kv() != cursor_.kv || chunk_.first_token() != cursor_.next) {
      return absl::InvalidArgumentError(absl::StrCat("first_token: expected rows of ", cursor_.Text(), ", got layer ",
                                                     chunk_.layer(), " kv ", chunk_.kv(), " from token ",
                                                     chunk_.first_token(), " (rows go in the export's order)"));
    }
    const uint64_t bytes = chunk_.data().size();
    if (bytes == 0 || bytes % moving_.row_bytes() != 0) {
      return absl::InvalidArgumentError(absl::StrCat("data: ", bytes, " bytes is not a whole number of rows of ",
                                                     moving_.row_bytes(), " bytes"));
    }
    const int64_t rows = static_cast<int64_t>(bytes / moving_.row_bytes());
    ATTND_RETURN_IF_ERROR(sequences_->WriteRows(moving_, cursor_.layer, cursor_.kv, cursor_.next, rows,
                                                reinterpret_cast<const uint8_t*>(chunk_.data().data())));
    cursor_.next += rows;
    return absl::OkStatus();
  }

  // The client half-closed (or the call broke): the sequence opens if every row came.
  void Complete() {
    if (ctx_->IsCancelled()) return End(absl::CancelledError("the import was cancelled"));
    if (!held_) return End(absl::InvalidArgumentError("sequence: the stream ended without a header"));
    if (cursor_.Settle(moving_)) {
      return End(absl::InvalidArgumentError(absl::StrCat("data: the stream ended before ", cursor_.Text())));
    }
    held_ = false;
    absl::StatusOr<OpenedSequences> opened = sequences_->EndImport(moving_, true);
    if (opened.ok()) {
      response_->set_sequence_id(opened->sequence_ids.front());
      response_->set_max_tokens(opened->max_tokens);
      response_->set_page_tokens(opened->page_tokens);
    }
    End(opened.status());
  }

  void End(const absl::Status& status) {
    if (held_) sequences_->EndImport(moving_, false).IgnoreError();
    held_ = false;
    LogOutcome("ImportSequence", "", status, start_);
    Finish(ToGrpcStatus(status));
  }

  grpc::CallbackServerContext* const ctx_;
  Sequences* const sequences_;
  const std::string owner_;
  v1::ImportSequenceResponse* const response_;
  const absl::Time start_;
  MovingSequence moving_;
  bool held_ = false;
  RowCursor cursor_;
  v1::SequenceChunk chunk_;
};

}  // namespace

grpc::ServerWriteReactor<v1::SequenceChunk>* AttentionService::ExportSequence(
    grpc::CallbackServerContext* ctx, const v1::ExportSequenceRequest* request) {
  return new ExportReactor(sequences_, OwnerOf(ctx), *request, options_.limits.max_message_bytes, absl::Now());
}

grpc::ServerReadReactor<v1::SequenceChunk>* AttentionService::ImportSequence(grpc::CallbackServerContext* ctx,
                                                                            v1::ImportSequenceResponse* response) {
  return new ImportReactor(ctx, sequences_, OwnerOf(ctx), response, absl::Now());
}

}  // namespace attnd::server
