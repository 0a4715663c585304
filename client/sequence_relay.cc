// MoveSequence's relay (docs/sequences.md, "Moving a sequence"): the chunks of an ExportSequence pass on to an
// ImportSequence as gRPC delivered them. ExportSequenceResponse and ImportSequenceRequest are the same message on
// the wire (a SequenceChunk in field 1), so the relay neither parses nor serialises a chunk: each one is the byte
// buffer read from the exporter, written to the importer by reference to the same slices.
//
// Both calls run on gRPC's callback API, so that reading from one server and writing to the other go on in
// different threads: the socket work of the two hops, most of a move's cost in the client, is not serialised in
// one. At most kRelayChunks chunks are held. Every decision is taken under mu_ and acted on after it is released
// (a reaction may run inline from a Start* call); each call is held (AddHold) until no operation will be started
// on it, so that its OnDone comes after the last one.
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "client_internal.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/byte_buffer.h"

namespace attnd::client {
namespace {

const std::string kExportMethod = absl::StrCat("/", v1::Attention::service_full_name(), "/ExportSequence");
const std::string kImportMethod = absl::StrCat("/", v1::Attention::service_full_name(), "/ImportSequence");

class Relay {
 public:
  Relay(grpc::ClientContext* export_ctx, grpc::ClientContext* import_ctx)
      : export_ctx_(export_ctx), import_ctx_(import_ctx), export_(this), import_(this) {}

  RelayOutcome Run(grpc::GenericStub* from, grpc::GenericStub* to, const v1::ExportSequenceRequest& request,
                   absl::FunctionRef<void(const v1::ImportSequenceResponse&)> imported) {
    hold_ = request.hold();
    bool own = false;
    if (!grpc::SerializationTraits<v1::ExportSequenceRequest>::Serialize(request, &request_buf_, &own).ok()) {
      RelayOutcome out;
      out.exported = absl::InternalError("the export request did not serialise");
      return out;
    }
    from->PrepareBidiStreamingCall(export_ctx_, kExportMethod, grpc::StubOptions(), &export_);
    to->PrepareBidiStreamingCall(import_ctx_, kImportMethod, grpc::StubOptions(), &import_);
    export_.AddHold();
    import_.AddHold();
    export_.StartWriteLast(&request_buf_, grpc::WriteOptions());
    export_.StartRead(&incoming_);       // reading_ starts true
    import_.StartRead(&response_buf_);   // comes back when the importer answers, or ends the call early
    export_.StartCall();
    import_.StartCall();
    import_done_.WaitForNotification();
    if (HeldToTheEnd()) {
      // The exporter still holds the sequence: the old copy closes while nothing can step it, then the export ends
      // (its stream is cancelled whatever the import answered).
      RelayOutcome answered = Outcome();
      if (answered.imported.ok()) imported(answered.response);
      export_ctx_->TryCancel();
    }
    export_done_.WaitForNotification();
    return Outcome();
  }

 private:
  class ExportSide final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
   public:
    explicit ExportSide(Relay* relay) : relay_(relay) {}
    void OnReadDone(bool ok) override { relay_->OnChunk(ok); }
    void OnDone(const grpc::Status& s) override { relay_->OnExportDone(s); }

   private:
    Relay* const relay_;
  };
  class ImportSide final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
   public:
    explicit ImportSide(Relay* relay) : relay_(relay) {}
    void OnWriteDone(bool ok) override { relay_->OnWritten(ok); }
    void OnReadDone(bool ok) override { relay_->OnAnswer(ok); }
    void OnDone(const grpc::Status& s) override { relay_->OnImportDone(s); }

   private:
    Relay* const relay_;
  };

  void OnChunk(bool ok) {
    {
      absl::MutexLock lock(&mu_);
      reading_ = false;
      if (!ok) {
        export_over_ = true;  // its stream has ended: OnDone says how
      } else if (hold_ && IsEnd(incoming_)) {
        end_seen_ = true;  // every row is in; the export stays open, the sequence held
      } else if (!Stopped()) {
        chunks_.push_back(std::move(incoming_));
      }
    }
    Step();
  }
  // A held export's `end` chunk: a few bytes (a chunk of rows or a header is larger), so only small ones are parsed.
  static bool IsEnd(const grpc::ByteBuffer& chunk) {
    constexpr size_t kEndBytes = 16;
    if (chunk.Length() > kEndBytes) return false;
    grpc::ByteBuffer copy(chunk);  // shares the slices; parsing consumes the buffer it is given
    v1::ExportSequenceResponse parsed;
    return grpc::SerializationTraits<v1::ExportSequenceResponse>::Deserialize(&copy, &parsed).ok() &&
           parsed.chunk().end();
  }
  void OnWritten(bool ok) {
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      chunks_.pop_front();
      if (!ok) write_failed_ = true;  // the importer has ended the call: its answer's read says so too
    }
    Step();
  }
  void OnAnswer(bool ok) {
    {
      absl::MutexLock lock(&mu_);
      import_ended_ = true;
      import_answered_ = ok;
      // Before the export's end: a refusal (the export is cut short, the sequence stays), or an answer given early.
      if (!export_over_ && !end_seen_ && !export_failed_) import_failed_first_ = true;
    }
    Step();
  }
  void OnExportDone(const grpc::Status& s) {
    {
      absl::MutexLock lock(&mu_);
      export_finished_ = true;
      // A held export ends by Run's cancel once every row was relayed, whatever status that reports.
      exported_ = end_seen_ ? absl::OkStatus() : FromGrpcStatus(s);
      if (!exported_.ok() && !import_failed_first_) export_failed_ = true;  // the importer frees what it took
    }
    Step();
    export_done_.Notify();
  }
  void OnImportDone(const grpc::Status& s) {
    {
      absl::MutexLock lock(&mu_);
      imported_ = FromGrpcStatus(s);
    }
    Step();
    import_done_.Notify();
  }

  bool HeldToTheEnd() {
    absl::MutexLock lock(&mu_);
    return end_seen_;
  }

  // Nothing more goes to the importer: it has ended the call, or the export failed.
  bool Stopped() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return import_ended_ || write_failed_ || export_failed_; }

  // What the state calls for next, decided under mu_ and started after it.
  void Step() {
    grpc::ByteBuffer* write = nullptr;
    bool read = false, half_close = false, release_export = false, release_import = false;
    bool cancel_export = false, cancel_import = false;
    {
      absl::MutexLock lock(&mu_);
      const bool stopped = Stopped();
      const bool rows_over = export_over_ || end_seen_;
      if (!reading_ && !rows_over && !stopped && chunks_.size() < kRelayChunks) read = reading_ = true;
      if (!writing_ && !chunks_.empty() && !stopped) {
        writing_ = true;
        write = &chunks_.front();  // stays put until its OnWriteDone pops it
      }
      // The export ended whole (or sent `end`) and every chunk is written: the import is told so, and its answer
      // follows.
      const bool whole = end_seen_ || (export_finished_ && exported_.ok());
      if (!half_closed_ && whole && !writing_ && chunks_.empty() && !stopped) {
        half_close = half_closed_ = true;
      }
      if (!import_released_ && (half_closed_ || stopped) && !writing_) release_import = import_released_ = true;
      if (!export_released_ && (rows_over || stopped) && !reading_) release_export = export_released_ = true;
      if (import_failed_first_ && !export_cancelled_) cancel_export = export_cancelled_ = true;
      if (export_failed_ && !import_cancelled_) cancel_import = import_cancelled_ = true;
    }
    if (cancel_export) export_ctx_->TryCancel();
    if (cancel_import) import_ctx_->TryCancel();
    if (read) export_.StartRead(&incoming_);
    if (write != nullptr) import_.StartWrite(write);
    if (half_close) import_.StartWritesDone();
    if (release_import) import_.RemoveHold();
    if (release_export) export_.RemoveHold();
  }

  RelayOutcome Outcome() {
    absl::MutexLock lock(&mu_);
    RelayOutcome out;
    out.exported = exported_;
    out.imported = imported_;
    out.import_failed_first = import_failed_first_;
    if (import_failed_first_ && out.imported.ok()) {
      out.imported = absl::InternalError("the import answered before the export ended");
    } else if (out.imported.ok() && !export_failed_) {
      if (!import_answered_) {
        out.imported = absl::InternalError("the import ended OK without its answer");
      } else if (grpc::ByteBuffer answer(response_buf_);  // shares the slices: Outcome may be asked twice
                 !grpc::SerializationTraits<v1::ImportSequenceResponse>::Deserialize(&answer, &out.response).ok()) {
        out.imported = absl::InternalError("the import's answer did not parse");
      }
    }
    return out;
  }

  grpc::ClientContext* const export_ctx_;
  grpc::ClientContext* const import_ctx_;
  ExportSide export_;
  ImportSide import_;
  grpc::ByteBuffer request_buf_;
  grpc::ByteBuffer incoming_;      // the pending read from the exporter (reading_)
  grpc::ByteBuffer response_buf_;  // the importer's answer
  absl::Notification export_done_, import_done_;  // each call's OnDone has run

  absl::Mutex mu_;
  std::deque<grpc::ByteBuffer> chunks_ ABSL_GUARDED_BY(mu_);  // read, not yet written; the front one being written
  bool reading_ ABSL_GUARDED_BY(mu_) = true;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool export_over_ ABSL_GUARDED_BY(mu_) = false;      // the export's stream has ended (a read came back empty)
  bool export_finished_ ABSL_GUARDED_BY(mu_) = false;  // its status is in
  bool export_failed_ ABSL_GUARDED_BY(mu_) = false;    // with an error, before the importer ended anything
  bool import_ended_ ABSL_GUARDED_BY(mu_) = false;     // the importer answered or ended the call
  bool import_answered_ ABSL_GUARDED_BY(mu_) = false;
  bool import_failed_first_ ABSL_GUARDED_BY(mu_) = false;
  bool hold_ = false;                            // ExportSequenceRequest.hold
  bool end_seen_ ABSL_GUARDED_BY(mu_) = false;  // a held export sent `end`: every row is in, the export open
  bool write_failed_ ABSL_GUARDED_BY(mu_) = false;
  bool half_closed_ ABSL_GUARDED_BY(mu_) = false;
  bool export_released_ ABSL_GUARDED_BY(mu_) = false, import_released_ ABSL_GUARDED_BY(mu_) = false;
  bool export_cancelled_ ABSL_GUARDED_BY(mu_) = false, import_cancelled_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status exported_ ABSL_GUARDED_BY(mu_), imported_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

RelayOutcome RelaySequence(std::shared_ptr<grpc::Channel> from, std::shared_ptr<grpc::Channel> to,
                           grpc::ClientContext* export_ctx, grpc::ClientContext* import_ctx,
                           const v1::ExportSequenceRequest& request,
                           absl::FunctionRef<void(const v1::ImportSequenceResponse&)> imported) {
  grpc::GenericStub source(std::move(from)), target(std::move(to));
  return Relay(export_ctx, import_ctx).Run(&source, &target, request, imported);
}

RelayOutcome RelaySequenceOnDevice(v1::Attention::Stub* from, v1::Attention::Stub* to, grpc::ClientContext* export_ctx,
                                   grpc::ClientContext* import_ctx, const v1::ExportSequenceRequest& request,
                                   absl::FunctionRef<void(const v1::ImportSequenceResponse&)> imported) {
  RelayOutcome out;
  std::unique_ptr<grpc::ClientReader<v1::ExportSequenceResponse>> exporter = from->ExportSequence(export_ctx, request);
  // Two small chunks: the header, then the buffer's handle. The stream stays open after them, the buffer held.
  v1::ImportSequenceRequest chunks[2];
  for (v1::ImportSequenceRequest& chunk : chunks) {
    v1::ExportSequenceResponse got;
    if (!exporter->Read(&got)) {
      out.exported = FromGrpcStatus(exporter->Finish());
      if (out.exported.ok()) out.exported = absl::InternalError("the device export ended before its device rows");
      return out;
    }
    *chunk.mutable_chunk() = std::move(*got.mutable_chunk());
  }
  if (!chunks[0].chunk().has_sequence() || !chunks[1].chunk().has_device_rows()) {
    export_ctx->TryCancel();
    exporter->Finish();
    out.exported = absl::InternalError("the device export did not send a header, then device rows");
    return out;
  }
  std::unique_ptr<grpc::ClientWriter<v1::ImportSequenceRequest>> importer =
      to->ImportSequence(import_ctx, &out.response);
  // Both chunks and the half-close in one flush: the header is held back (buffer hint) for the last write.
  const bool written = importer->Write(chunks[0], grpc::WriteOptions().set_buffer_hint()) &&
                       importer->Write(chunks[1], grpc::WriteOptions().set_last_message());
  out.imported = FromGrpcStatus(importer->Finish());
  if (out.imported.ok() && !written) out.imported = absl::InternalError("the import ended OK without its rows");
  // The importer has closed the handle (answered or failed): the exporter may free the buffer now.
  out.import_failed_first = !out.imported.ok();
  if (out.imported.ok()) imported(out.response);
  // Its end is this cancellation, whatever status it reports: the rows are on `to` or the import failed.
  export_ctx->TryCancel();
  exporter->Finish().ok();
  return out;
}

}  // namespace attnd::client
