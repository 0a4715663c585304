// MoveSequence's relay (docs/sequences.md, "Moving a sequence"): the chunks of an ExportSequence pass on to an
// ImportSequence as gRPC delivered them. ExportSequenceResponse and ImportSequenceRequest are the same message on
// the wire (a SequenceChunk in field 1), so the relay neither parses nor serialises a chunk: each one is the byte
// buffer read from the exporter, written to the importer by reference to the same slices. Both calls run on one
// completion queue driven by the calling thread, so that the next chunk is read while the previous one is being
// written, with at most kRelayChunks chunks held at once.
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
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
      : export_ctx_(export_ctx), import_ctx_(import_ctx) {}

  RelayOutcome Run(grpc::GenericStub* from, grpc::GenericStub* to, const v1::ExportSequenceRequest& request) {
    grpc::ByteBuffer request_buf;
    bool own = false;
    if (grpc::Status st = grpc::SerializationTraits<v1::ExportSequenceRequest>::Serialize(request, &request_buf, &own);
        !st.ok()) {
      RelayOutcome out;
      out.exported = absl::InternalError("the export request did not serialise");
      return out;
    }
    ex_ = from->PrepareCall(export_ctx_, kExportMethod, &cq_);
    im_ = to->PrepareCall(import_ctx_, kImportMethod, &cq_);
    request_buf_ = std::move(request_buf);
    // A call's first write waits for its start: gRPC sends the start's headers with the same operation set.
    ex_->StartCall(Tag(kExStart));
    im_->StartCall(Tag(kImStart));
    im_->Read(&response_buf_, Tag(kImRead));  // comes back when the importer answers, or ends early
    outstanding_ = 3;
    ReadChunk();
    while (outstanding_ > 0) {
      void* tag;
      bool ok;
      if (!cq_.Next(&tag, &ok)) break;
      --outstanding_;
      On(static_cast<Op>(reinterpret_cast<intptr_t>(tag)), ok);
    }
    cq_.Shutdown();
    void* tag;
    bool ok;
    while (cq_.Next(&tag, &ok)) {
    }
    return Outcome();
  }

 private:
  enum Op : intptr_t {
    kExStart = 1, kExWrite, kExRead, kExFinish,
    kImStart, kImWrite, kImRead, kImWritesDone, kImFinish,
  };
  static void* Tag(Op op) { return reinterpret_cast<void*>(static_cast<intptr_t>(op)); }

  void On(Op op, bool ok) {
    switch (op) {
      case kExStart:
        ++outstanding_;
        ex_->WriteLast(request_buf_, grpc::WriteOptions(), Tag(kExWrite));
        return;
      case kImStart:
        import_started_ = true;
        return WriteChunk();
      case kExWrite:
      case kImWritesDone:
        return;  // a failure shows in the reads and the status
      case kExRead:
        reading_ = false;
        if (!ok) {
          export_over_ = true;  // its stream has ended: the status says how
          return FinishExport();
        }
        if (stopped()) return FinishExport();  // the import has ended: the export was cancelled (below)
        chunks_.push_back(std::move(incoming_));
        WriteChunk();
        return ReadChunk();
      case kImWrite:
        writing_ = false;
        chunks_.pop_front();
        // Not ok: the importer has ended the call, and the read of its answer says so too.
        if (ok) {
          WriteChunk();
          ReadChunk();
          MaybeHalfClose();
        }
        return FinishImport();
      case kImRead:
        import_answered_ = ok;
        import_read_done_ = true;
        return FinishImport();
      case kExFinish:
        exported_ = FromGrpcStatus(ex_status_);
        export_finished_ = true;
        if (!exported_.ok() && !import_failed_first_) {
          export_failed_first_ = true;
          import_ctx_->TryCancel();  // the importer frees what it took
        }
        return MaybeHalfClose();
      case kImFinish:
        imported_ = FromGrpcStatus(im_status_);
        if (export_over_) return;
        // The importer ended before the export did: a refusal (the export is cut short, the sequence stays), or an
        // answer it should not have given yet.
        if (imported_.ok()) imported_ = absl::InternalError("the import answered before the export ended");
        import_failed_first_ = true;
        export_ctx_->TryCancel();
        if (!reading_) FinishExport();
        return;
    }
  }

  // The next read from the exporter, while fewer than kRelayChunks chunks are held.
  void ReadChunk() {
    if (reading_ || export_finishing_ || stopped() || chunks_.size() >= kRelayChunks) return;
    reading_ = true;
    ++outstanding_;
    ex_->Read(&incoming_, Tag(kExRead));
  }

  // The oldest chunk held to the importer, unless one is being written. The buffer is written by reference: gRPC
  // holds the same slices until they are on the wire.
  void WriteChunk() {
    if (!import_started_ || writing_ || chunks_.empty() || stopped()) return;
    writing_ = true;
    ++outstanding_;
    im_->Write(chunks_.front(), Tag(kImWrite));
  }

  void FinishExport() {
    if (export_finishing_) return;
    export_finishing_ = true;
    ++outstanding_;
    ex_->Finish(&ex_status_, Tag(kExFinish));
  }

  // Once the export has ended whole and every chunk is written, the import is told so; its answer follows.
  void MaybeHalfClose() {
    if (half_closed_ || !export_finished_ || !exported_.ok() || writing_ || !chunks_.empty() || stopped()) return;
    half_closed_ = true;
    ++outstanding_;
    im_->WritesDone(Tag(kImWritesDone));
  }

  // After the importer's answer (or the end of its call): its status, once no write is pending.
  void FinishImport() {
    if (import_finishing_ || writing_ || !import_read_done_) return;
    import_finishing_ = true;
    ++outstanding_;
    im_->Finish(&im_status_, Tag(kImFinish));
  }

  // The importer has ended the call (answered or failed): nothing more goes to it.
  bool stopped() const { return import_read_done_ || export_failed_first_; }

  RelayOutcome Outcome() {
    RelayOutcome out;
    out.exported = exported_;
    out.imported = imported_;
    out.import_failed_first = import_failed_first_;
    if (imported_.ok() && !export_failed_first_) {
      if (!import_answered_) {
        out.imported = absl::InternalError("the import ended OK without its answer");
      } else if (!grpc::SerializationTraits<v1::ImportSequenceResponse>::Deserialize(&response_buf_, &out.response)
                      .ok()) {
        out.imported = absl::InternalError("the import's answer did not parse");
      }
    }
    return out;
  }

  grpc::ClientContext* const export_ctx_;
  grpc::ClientContext* const import_ctx_;
  grpc::CompletionQueue cq_;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> ex_, im_;
  grpc::ByteBuffer request_buf_, incoming_, response_buf_;
  std::deque<grpc::ByteBuffer> chunks_;  // read from the exporter; the front one is being written when writing_
  grpc::Status ex_status_, im_status_;
  absl::Status exported_, imported_;
  int outstanding_ = 0;  // operations started whose tags have not come back
  bool import_started_ = false, reading_ = false, writing_ = false;
  bool export_over_ = false, export_finishing_ = false, export_finished_ = false, half_closed_ = false;
  bool import_read_done_ = false, import_answered_ = false, import_finishing_ = false;
  bool export_failed_first_ = false, import_failed_first_ = false;
};

}  // namespace

RelayOutcome RelaySequence(std::shared_ptr<grpc::Channel> from, std::shared_ptr<grpc::Channel> to,
                           grpc::ClientContext* export_ctx, grpc::ClientContext* import_ctx,
                           const v1::ExportSequenceRequest& request) {
  grpc::GenericStub source(std::move(from)), target(std::move(to));
  return Relay(export_ctx, import_ctx).Run(&source, &target, request);
}

}  // namespace attnd::client
