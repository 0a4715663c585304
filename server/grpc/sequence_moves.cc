// ExportSequence and ImportSequence (docs/sequences.md, "Moving a sequence"): a sequence's rows streamed out of this
// server, and a stream of them taken in as a new sequence. The rows go in a fixed order (layer 0 K, layer 0 V,
// layer 1 K, ..., each from token 0), so the importer knows where every chunk belongs and that none is missing; one
// or two chunks are in memory at a time on either side.
//
// Both streams are bounded as a ForwardStream's upload is: a stream that makes no progress (a chunk read, a chunk's
// write completed) for --stream_idle_timeout_s ends DEADLINE_EXCEEDED, and an import must arrive whole within
// --upload_timeout_s, so a stalled mover cannot hold a sequence (export) or pool pages (import) for ever. The
// checks run on a gRPC alarm; mu_ orders it against the stream's callbacks, and the reactor is deleted by whichever
// of OnDone, the last alarm callback and a device copy (an import's, an export's gather) comes last (refs_).
#include <algorithm>
#include <atomic>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "attnd/transport/zero_copy.h"
#include "auth.h"
#include "call_observer.h"
#include "core_messages.h"
#include "grpc_status.h"
#include "service.h"

namespace attnd::server {
namespace {

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

// What both streams share: the progress clock, its alarm and the reactor's references.
class Bounded {
 public:
  Bounded(absl::Duration idle, absl::Time upload_due) : idle_(idle), upload_due_(upload_due) {}
  virtual ~Bounded() = default;

 protected:
  // Arms the first check; the caller holds no lock yet (constructor).
  void StartClock(absl::Time now) {
    absl::MutexLock lock(&mu_);
    last_progress_ = now;
    Arm();
  }
  void Progress() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { last_progress_ = absl::Now(); }
  void Ref() { refs_.fetch_add(1, std::memory_order_relaxed); }
  void Unref() {
    if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }
  // From OnDone: no check runs after it; its pending callback drops its reference.
  void StopClock() {
    absl::MutexLock lock(&mu_);
    stopped_ = true;
    if (alarm_ != nullptr) alarm_->Cancel();
  }
  // Past its bound: the stream ends, with why (under mu_).
  virtual void Expired(const absl::Status& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) = 0;

  absl::Mutex mu_;

 private:
  absl::Time Due() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return std::min(idle_ > absl::ZeroDuration() ? last_progress_ + idle_ : absl::InfiniteFuture(), upload_due_);
  }
  // A fresh alarm each time: one may not be set again from its own callback.
  void Arm() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const absl::Time due = Due();
    if (due == absl::InfiniteFuture() || stopped_) return;
    Ref();
    alarm_ = std::make_unique<grpc::Alarm>();
    alarm_->Set(absl::ToChronoTime(due), [this](bool fired) { Check(fired); });
  }
  void Check(bool fired) {
    if (fired) {
      absl::MutexLock lock(&mu_);
      if (!stopped_) {
        if (absl::Now() < Due()) {
          Arm();
        } else if (Due() == upload_due_) {
          Expired(absl::DeadlineExceededError("upload_timeout_s: the import did not arrive whole in time"));
        } else {
          Expired(absl::DeadlineExceededError(absl::StrCat("stream_idle_timeout_s: no progress for ",
                                                           absl::FormatDuration(idle_), "; the stream is ended")));
        }
      }
    }
    Unref();
  }

  const absl::Duration idle_;
  const absl::Time upload_due_;
  std::atomic<int> refs_{1};  // the stream's (dropped at OnDone) and each armed alarm's
  absl::Time last_progress_ ABSL_GUARDED_BY(mu_);
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  std::unique_ptr<grpc::Alarm> alarm_ ABSL_GUARDED_BY(mu_);
};

// Raw (ByteBuffer) messages: each chunk is built in one slice that its rows are read into straight from the pages
// (SerializeSequenceChunk), and the next chunk is read while the previous one is being written, so two chunks are
// in memory at a time.
class ExportReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer>, public Bounded {
 public:
  ExportReactor(grpc::CallbackServerContext* ctx, Sequences* sequences, WorkQueue* device_copies,
                const std::string& owner, bool peer, const grpc::ByteBuffer* request_bytes,
                uint64_t stream_chunk_bytes, absl::Duration idle, absl::Time start)
      : Bounded(idle, absl::InfiniteFuture()),
        ctx_(ctx),
        sequences_(sequences),
        device_copies_(device_copies),
        peer_(peer),
        start_(start) {
    v1::ExportSequenceRequest request;
    grpc::ByteBuffer copy(*request_bytes);  // shares the slices; parsing consumes the buffer it is given
    absl::StatusOr<MovingSequence> held =
        grpc::SerializationTraits<v1::ExportSequenceRequest>::Deserialize(&copy, &request).ok()
            ? sequences_->BeginExport(owner, request.sequence_id())
            : absl::InvalidArgumentError("request: not an ExportSequenceRequest");
    if (!held.ok()) {
      LogOutcome("ExportSequence", "", held.status(), start_);
      AddStatusTrailers(ctx_, held.status());
      Finish(ToGrpcStatus(held.status()));
      return;
    }
    moving_ = *std::move(held);
    device_ = request.device();
    hold_ = request.hold();
    // Chunks as large as the server's ForwardStream replies at most: those fit a message by construction.
    const uint64_t want = request.chunk_bytes() == 0 ? stream_chunk_bytes
                                                     : std::min<uint64_t>(request.chunk_bytes(), stream_chunk_bytes);
    chunk_rows_ = std::max<int64_t>(1, static_cast<int64_t>(want / moving_.row_bytes()));
    v1::SequenceChunk header;
    *header.mutable_sequence() = SequenceHeaderToProto(moving_);
    absl::StatusOr<grpc::ByteBuffer> first =
        SerializeSequenceChunk(header, 0, [](uint8_t*) { return absl::OkStatus(); });
    StartClock(start_);
    absl::MutexLock lock(&mu_);
    if (!first.ok()) {
      End(first.status());
      return;
    }
    out_ = *std::move(first);
    if (!device_) {
      StartWrite(&out_);
      ReadNext();
      return;
    }
    // The header goes out once the device rows are ready, so a refusal (a mover then falls back to bytes) comes
    // before anything was sent.
    if (sequences_->ExportSharesPool(peer_)) {
      std::shared_ptr<void> none;
      absl::StatusOr<grpc::ByteBuffer> rows = DeviceRowsChunk(&none);
      SendDeviceRows(std::move(rows), std::move(none));
      return;
    }
    // Gathering the rows into a buffer of their own waits for the GPU: on a thread of device_copies_, not gRPC's.
    // No write is pending meanwhile, so nothing ends the call before SendDeviceRows: a cancel or an expiry makes the
    // header's write fail, and OnWriteDone ends the stream.
    Ref();
    device_copies_->Run([this] {
      std::shared_ptr<void> buffer;
      absl::StatusOr<grpc::ByteBuffer> rows = DeviceRowsChunk(&buffer);
      {
        absl::MutexLock lock(&mu_);
        SendDeviceRows(std::move(rows), std::move(buffer));
      }
      Unref();
    });
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    if (!ok) {
      return End(expired_.ok() ? absl::CancelledError("the export stream broke before its last chunk") : expired_);
    }
    Progress();
    if (!more_) {
      if (!device_ && !hold_) return End(absl::OkStatus());
      if (!device_ && !end_sent_) {
        // Held: the rows are out, and the chunk saying so goes after them.
        end_sent_ = true;
        sequences_->ExportSent(moving_);
        v1::SequenceChunk end;
        end.set_end(true);
        absl::StatusOr<grpc::ByteBuffer> last =
            SerializeSequenceChunk(end, 0, [](uint8_t*) { return absl::OkStatus(); });
        if (!last.ok()) return End(last.status());
        out_ = *std::move(last);
        StartWrite(&out_);
        return;
      }
      // Everything is out: the sequence (and a device export's buffer) stays held until the mover, its import
      // answered and the old sequence closed, cancels the call.
      if (cancelled_) return End(absl::OkStatus());
      waiting_ = true;
      return;
    }
    if (!next_.ok()) return End(next_.status());
    out_ = *std::move(next_);
    StartWrite(&out_);
    if (device_) {
      more_ = false;  // the device chunk is the last
    } else {
      ReadNext();  // while that chunk is written
    }
  }

  // A device or held export's normal end: the mover cancels once its import has answered. With a write pending, the
  // write fails and OnWriteDone ends the stream instead.
  void OnCancel() override {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    if (waiting_ && !finished_) End(absl::OkStatus());
  }

  void OnDone() override {
    StopClock();
    Unref();
  }

 private:
  // The one chunk that carries the device rows, written after the header: the handle of a buffer the rows are
  // gathered into (kept by *buffer), or of the pool with the sequence's pages.
  absl::StatusOr<grpc::ByteBuffer> DeviceRowsChunk(std::shared_ptr<void>* buffer) {
    absl::StatusOr<DeviceRows> rows = sequences_->ExportOnDevice(moving_, peer_, buffer);
    if (!rows.ok()) return rows.status();
    // A buffer of its own holds the rows now; an importer reads a shared pool's pages in place, after this.
    if (!rows->from_pool) sequences_->ExportSent(moving_);
    v1::SequenceChunk fields;
    v1::DeviceRows* out = fields.mutable_device_rows();
    out->set_ipc_handle(rows->ipc_handle);
    out->set_bytes(rows->bytes);
    out->set_device_uuid(rows->device_uuid);
    if (rows->from_pool) {
      v1::DevicePool* pool = out->mutable_pool();
      pool->set_num_pages(rows->pool_num_pages);
      pool->set_page_tokens(rows->pool_page_tokens);
      pool->mutable_pages()->Assign(rows->pool_pages.begin(), rows->pool_pages.end());
    }
    return SerializeSequenceChunk(fields, 0, [](uint8_t*) { return absl::OkStatus(); });
  }

  // The header (out_) goes out, and the device rows' chunk after it; or the export ends refused.
  void SendDeviceRows(absl::StatusOr<grpc::ByteBuffer> rows, std::shared_ptr<void> buffer)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    device_rows_ = std::move(buffer);
    if (!rows.ok()) return End(rows.status());
    next_ = std::move(rows);
    more_ = true;
    StartWrite(&out_);
  }

  // The chunk after the one being written, from the cursor (more_ false: the rows are all sent).
  void ReadNext() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    more_ = cursor_.Settle(moving_);
    if (!more_) return;
    const int64_t rows = std::min(chunk_rows_, moving_.lengths[cursor_.layer] - cursor_.next);
    v1::SequenceChunk fields;
    fields.set_layer(cursor_.layer);
    fields.set_kv(cursor_.kv);
    fields.set_first_token(cursor_.next);
    next_ = SerializeSequenceChunk(fields, static_cast<size_t>(rows) * moving_.row_bytes(), [&](uint8_t* dst) {
      return sequences_->ReadRows(moving_, cursor_.layer, cursor_.kv, cursor_.next, rows, dst);
    });
    cursor_.next += rows;
  }

  // A write is pending: cancelling the call completes it (not ok), and OnWriteDone ends the stream with `why`.
  // A device export waiting for its mover has no write pending: it ends here.
  void Expired(const absl::Status& why) override ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    expired_ = why;
    if (waiting_) {
      if (!finished_) End(why);
      return;
    }
    ctx_->TryCancel();
  }
  void End(const absl::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    finished_ = true;
    waiting_ = false;
    device_rows_.reset();  // the importer has closed its handle, or never opened it in time
    sequences_->EndExport(moving_);
    LogOutcome("ExportSequence", "", status, start_);
    Finish(ToGrpcStatus(status));
  }

  grpc::CallbackServerContext* const ctx_;
  Sequences* const sequences_;
  WorkQueue* const device_copies_;
  const bool peer_;  // the call carried the fleet's peer secret
  const absl::Time start_;
  MovingSequence moving_;
  absl::Status expired_ ABSL_GUARDED_BY(mu_);
  int64_t chunk_rows_ = 1;
  RowCursor cursor_ ABSL_GUARDED_BY(mu_);
  grpc::ByteBuffer out_ ABSL_GUARDED_BY(mu_);               // being written
  absl::StatusOr<grpc::ByteBuffer> next_ ABSL_GUARDED_BY(mu_);  // read ahead (or why it could not be)
  bool more_ ABSL_GUARDED_BY(mu_) = false;                   // next_ holds rows still to send
  bool device_ = false;                                       // ExportSequenceRequest.device
  bool hold_ = false;                                         // ExportSequenceRequest.hold
  bool end_sent_ ABSL_GUARDED_BY(mu_) = false;                // a held export's `end` chunk is out
  std::shared_ptr<void> device_rows_ ABSL_GUARDED_BY(mu_);    // the device buffer the handle names
  bool waiting_ ABSL_GUARDED_BY(mu_) = false;                 // every chunk is out; the mover is to cancel
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

// Raw (ByteBuffer) messages: a chunk's rows are copied from the message's slices straight into the pages
// (ReadSequenceChunk), not parsed into a string first, while the next chunk is read: two chunks are held at a time.
class ImportReactor final : public grpc::ServerReadReactor<grpc::ByteBuffer>, public Bounded {
 public:
  ImportReactor(grpc::CallbackServerContext* ctx, Sequences* sequences, WorkQueue* device_copies, std::string owner,
                grpc::ByteBuffer* response, absl::Duration idle, absl::Duration upload, absl::Time start)
      : Bounded(idle, upload > absl::ZeroDuration() ? start + upload : absl::InfiniteFuture()),
        ctx_(ctx),
        sequences_(sequences),
        device_copies_(device_copies),
        owner_(std::move(owner)),
        response_(response),
        start_(start) {
    StartClock(start_);
    StartRead(&in_);
  }

  void OnReadDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    if (finished_) return;  // ended by its bound while this read was pending
    if (!ok) {
      if (copying_) {
        half_closed_ = true;  // the copy's end completes the import
        return;
      }
      return Complete();
    }
    Progress();
    reading_ = false;
    const absl::Status taken = Take();
    if (!taken.ok()) return End(taken);
    ReadNext();
  }

  void OnDone() override {
    StopClock();
    Unref();
  }

 private:
  void Expired(const absl::Status& why) override ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { End(why); }

  void ReadNext() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (reading_) return;
    reading_ = true;
    StartRead(&in_);
  }

  // One chunk: the header (the first), else rows where the cursor says.
  absl::Status Take() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    v1::SequenceChunk chunk;
    InlineBytes data;
    v1::ImportSequenceRequest parsed;  // only for a message in another encoding than ReadSequenceChunk's
    if (!ReadSequenceChunk(in_, &slices_, &chunk, &data)) {
      grpc::ByteBuffer copy(in_);  // shares the slices; parsing consumes the buffer it is given
      if (!grpc::SerializationTraits<v1::ImportSequenceRequest>::Deserialize(&copy, &parsed).ok()) {
        return absl::InvalidArgumentError("chunk: not an ImportSequenceRequest");
      }
      chunk = parsed.chunk();
      data = InlineBytes();
      data.size = chunk.data().size();
      data.pieces.emplace_back(reinterpret_cast<const uint8_t*>(chunk.data().data()), chunk.data().size());
    }
    if (!held_) {
      if (!chunk.has_sequence()) return absl::InvalidArgumentError("sequence: the first chunk carries the header");
      absl::StatusOr<ImportArgs> args = ImportArgsFromProto(chunk.sequence());
      if (!args.ok()) return args.status();
      absl::StatusOr<MovingSequence> held = sequences_->BeginImport(owner_, *args);
      if (!held.ok()) return held.status();
      moving_ = *std::move(held);
      held_ = true;
      return absl::OkStatus();
    }
    if (chunk.has_sequence()) return absl::InvalidArgumentError("sequence: only the first chunk carries the header");
    if (device_taken_) return absl::InvalidArgumentError("chunk: nothing follows the chunk with device rows");
    if (chunk.end()) {
      return absl::InvalidArgumentError("chunk.end: a held export's last chunk is for the mover; half-close instead");
    }
    if (chunk.has_device_rows()) return TakeDeviceRows(chunk, data.present);
    if (!cursor_.Settle(moving_)) {
      return absl::InvalidArgumentError("data: a chunk past the last row the header announced");
    }
    if (chunk.layer() != cursor_.layer || chunk.kv() != cursor_.kv || chunk.first_token() != cursor_.next) {
      return absl::InvalidArgumentError(absl::StrCat("first_token: expected rows of ", cursor_.Text(), ", got layer ",
                                                     chunk.layer(), " kv ", chunk.kv(), " from token ",
                                                     chunk.first_token(), " (rows go in the export's order)"));
    }
    const uint64_t bytes = data.size;
    if (bytes == 0 || bytes % moving_.row_bytes() != 0) {
      return absl::InvalidArgumentError(absl::StrCat("data: ", bytes, " bytes is not a whole number of rows of ",
                                                     moving_.row_bytes(), " bytes"));
    }
    const int64_t rows = static_cast<int64_t>(bytes / moving_.row_bytes());
    // The next chunk arrives while these rows go into the pages: they are read from slices_ (or `parsed`), not in_.
    ReadNext();
    ATTND_RETURN_IF_ERROR(sequences_->WriteRows(moving_, cursor_.layer, cursor_.kv, cursor_.next, rows, data.pieces));
    cursor_.next += rows;
    return absl::OkStatus();
  }

  // Every row at once from the exporter's device buffer or pool (the chunk after the header, and the last): copied
  // into the pages, and the handle closed, on a thread of device_copies_ (the copy waits for the GPU), and the import
  // answers after that. Until then its pages stay taken, whatever ends the call.
  absl::Status TakeDeviceRows(const v1::SequenceChunk& chunk, bool has_data) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (device_taken_ || cursor_.layer != 0 || cursor_.kv != 0 || cursor_.next != 0) {
      return absl::InvalidArgumentError("chunk.device_rows: only the chunk after the header carries device rows");
    }
    if (has_data) return absl::InvalidArgumentError("chunk.device_rows: a chunk carries device rows or data, not both");
    device_taken_ = true;
    DeviceRows rows;
    rows.ipc_handle = chunk.device_rows().ipc_handle();
    rows.bytes = chunk.device_rows().bytes();
    rows.device_uuid = chunk.device_rows().device_uuid();
    if (chunk.device_rows().has_pool()) {
      const v1::DevicePool& pool = chunk.device_rows().pool();
      rows.from_pool = true;
      rows.pool_num_pages = pool.num_pages();
      rows.pool_page_tokens = pool.page_tokens();
      rows.pool_pages.assign(pool.pages().begin(), pool.pages().end());
    }
    copying_ = true;
    Ref();
    device_copies_->Run([this, rows = std::move(rows)] {
      const absl::Status copied = sequences_->ImportOnDevice(moving_, rows);
      {
        absl::MutexLock lock(&mu_);
        copying_ = false;
        if (finished_) {
          if (held_) sequences_->EndImport(moving_, false).IgnoreError();  // End left the pages to this copy
          held_ = false;
        } else if (!copied.ok()) {
          End(copied);
        } else {
          cursor_.layer = moving_.shape.layers;  // every row is in
          if (half_closed_) Complete();
        }
      }
      Unref();
    });
    return absl::OkStatus();
  }

  // The client half-closed (or the call broke): the sequence opens if every row came.
  void Complete() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (ctx_->IsCancelled()) return End(absl::CancelledError("the import was cancelled"));
    if (!held_) return End(absl::InvalidArgumentError("sequence: the stream ended without a header"));
    if (cursor_.Settle(moving_)) {
      return End(absl::InvalidArgumentError(absl::StrCat("data: the stream ended before ", cursor_.Text())));
    }
    held_ = false;
    absl::StatusOr<OpenedSequences> opened = sequences_->EndImport(moving_, true);
    if (opened.ok()) {
      v1::ImportSequenceResponse answer;
      answer.set_sequence_id(opened->sequence_ids.front());
      answer.set_max_tokens(opened->max_tokens);
      answer.set_page_tokens(opened->page_tokens);
      bool own = false;
      if (!grpc::SerializationTraits<v1::ImportSequenceResponse>::Serialize(answer, response_, &own).ok()) {
        opened = absl::InternalError("ImportSequence: the answer did not serialise");
      }
    }
    End(opened.status());
  }

  void End(const absl::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    finished_ = true;
    // A device copy still writing into the pages frees them when it ends.
    if (held_ && !copying_) {
      sequences_->EndImport(moving_, false).IgnoreError();
      held_ = false;
    }
    LogOutcome("ImportSequence", "", status, start_);
    Finish(ToGrpcStatus(status));
  }

  grpc::CallbackServerContext* const ctx_;
  Sequences* const sequences_;
  WorkQueue* const device_copies_;
  const std::string owner_;
  grpc::ByteBuffer* const response_;
  const absl::Time start_;
  MovingSequence moving_;
  bool held_ ABSL_GUARDED_BY(mu_) = false;
  bool device_taken_ = false;  // a device_rows chunk came
  bool copying_ ABSL_GUARDED_BY(mu_) = false;      // its device copy is queued or running
  bool half_closed_ ABSL_GUARDED_BY(mu_) = false;  // the client half-closed during the copy
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  bool reading_ ABSL_GUARDED_BY(mu_) = true;  // a read is pending (the constructor's first)
  RowCursor cursor_;
  grpc::ByteBuffer in_;
  std::vector<grpc::Slice> slices_;  // the chunk being taken's, which its data pieces point into
};

}  // namespace

grpc::ServerWriteReactor<grpc::ByteBuffer>* AttentionService::ExportSequence(grpc::CallbackServerContext* ctx,
                                                                            const grpc::ByteBuffer* request) {
  absl::StatusOr<std::string> owner = OwnerOf(ctx);
  if (!owner.ok()) return new RefusedCall<grpc::ServerWriteReactor<grpc::ByteBuffer>>(owner.status());
  // OwnerOf admitted the call, so a peer secret it carries is this fleet's.
  const bool peer = ctx->client_metadata().count(kPeerSecretMetadata) > 0;
  return new ExportReactor(ctx, sequences_, &device_copies_, *owner, peer, request, stream_chunk_bytes(),
                           stream_idle_timeout(), absl::Now());
}

grpc::ServerReadReactor<grpc::ByteBuffer>* AttentionService::ImportSequence(grpc::CallbackServerContext* ctx,
                                                                        grpc::ByteBuffer* response) {
  absl::StatusOr<std::string> owner = OwnerOf(ctx);
  if (!owner.ok()) return new RefusedCall<grpc::ServerReadReactor<grpc::ByteBuffer>>(owner.status());
  return new ImportReactor(ctx, sequences_, &device_copies_, *std::move(owner), response, stream_idle_timeout(),
                           upload_timeout(), absl::Now());
}

}  // namespace attnd::server
