// What the client library's files share beyond client.h: the channel factory, what one Forward call
// sends, and the StepStream call.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "attnd/client/client.h"
#include "attnd/v1/attention.grpc.pb.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/completion_queue.h"
#include "grpcpp/support/async_stream.h"

namespace attnd::client {

// Room for the request's non-tensor fields and the framing of one message on top of its tensor bytes.
constexpr uint64_t kMessageOverhead = 64 << 10;

// A target naming several servers (dns:..., or ipv4:/ipv6: with more than one address): calls are spread by
// ClientOptions::load_balancing.
bool IsFleetTarget(const std::string& target);
// The servers an ipv4:/ipv6: target lists (ipv4:a:p,b:p: 2); 0 for any other target (dns: finds its own).
size_t ListedServers(const std::string& target);

// A channel to `target` with `options`' arguments and credentials: the main one, and those of pinned sequences.
absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeChannel(const ClientOptions& options, const std::string& target);

// The reply header's fields (all but O and LSE) into `res`, moved out of `header`.
void FillResultHeader(v1::ForwardResponse& header, ForwardResult& res);

// MoveSequence's relay (sequence_relay.cc): ExportSequence on `from` with `request`, each chunk passed on as it
// arrives to ImportSequence on `to`, unparsed, with at most kRelayChunks chunks held at once. A failure on one side
// cancels the other: `import_failed_first` says which side ended the move (the other's status is then CANCELLED).
constexpr size_t kRelayChunks = 3;
struct RelayOutcome {
  absl::Status exported, imported;
  bool import_failed_first = false;
  v1::ImportSequenceResponse response;  // when both are OK
};
RelayOutcome RelaySequence(std::shared_ptr<grpc::Channel> from, std::shared_ptr<grpc::Channel> to,
                           grpc::ClientContext* export_ctx, grpc::ClientContext* import_ctx,
                           const v1::ExportSequenceRequest& request,
                           absl::FunctionRef<void(const v1::ImportSequenceResponse&)> imported);
// With `request.hold` the exporter keeps the sequence held after its rows and sends `end`, which the relay takes as
// the end of the rows (half-closing the import) without passing it on; once the import has ended, `imported` runs
// (when it answered) and then the export is cancelled, so the mover closes the old copy before anything can step it.
// An exporter that does not hold ends its stream instead, and `imported` does not run: the caller closes after.
// The same move on one GPU (`request.device` set): the export's header and device_rows chunks go to the import,
// which is half-closed and answers; only then is the export cancelled, because the exporter frees the buffer the
// handle names when its stream ends (the importer has closed the handle before answering). `imported` runs between
// the import's answer and that cancel, while the exporter still holds the sequence (a step on it is refused as
// "being moved"), so the mover can close the old copy before any step can land on it. A failure on either side
// cancels both.
RelayOutcome RelaySequenceOnDevice(v1::Attention::Stub* from, v1::Attention::Stub* to, grpc::ClientContext* export_ctx,
                                   grpc::ClientContext* import_ctx, const v1::ExportSequenceRequest& request,
                                   absl::FunctionRef<void(const v1::ImportSequenceResponse&)> imported);

// What one Forward call sends: every request field but the inline tensor bytes, and those bytes, which
// go out by reference while `owner` keeps them alive (zero_copy.h) or are copied when it is null.
struct Client::Outgoing {
  v1::ForwardRequest header;                   // q, k, v unset or references
  std::optional<std::string_view> tensors[3];  // Q, K, V inline bytes; nullopt: not inline
  std::shared_ptr<const void> owner;

  uint64_t inline_bytes() const {
    uint64_t n = 0;
    for (const auto& t : tensors) n += t ? t->size() : 0;
    return n;
  }
};

// One StepStream, driven from the calling thread through a completion queue of its own (no gRPC thread and no
// hand-over between threads: the caller's AsyncNext reads the socket, as a blocking unary call's does). Used by
// one caller at a time. Between steps a read stays posted, so that a stream the server has ended while it sat
// idle (a restart, a shutdown) is seen as such before a step is written to it.
class Client::StepStreamCall {
 public:
  StepStreamCall(v1::Attention::Stub* stub, const std::string& auth_token, bool wait_for_ready, absl::Duration poll);
  ~StepStreamCall();

  bool usable() const { return !broken_; }

  // One step: writes the request and reads its answer into `response`, or fails the stream. `*sent` says
  // whether the request may have left this client (one that has not can go on a new stream).
  absl::Status Round(const v1::StepStreamRequest& request, v1::StepStreamResponse* response, absl::Time deadline,
                     bool* sent);

 private:
  enum : intptr_t { kWrite = 1, kRead, kFinish };
  static void* Tag(intptr_t t) { return reinterpret_cast<void*>(t); }

  // Waits for every operation started; `sent` (when given) learns whether a write went through.
  void Drain(bool* sent = nullptr);

  const absl::Duration poll_;  // ClientOptions::step_poll
  grpc::ClientContext ctx_;
  grpc::CompletionQueue cq_;
  std::unique_ptr<grpc::ClientAsyncReaderWriter<v1::StepStreamRequest, v1::StepStreamResponse>> rw_;
  v1::StepStreamResponse response_;  // the posted read's destination
  grpc::Status final_;
  int outstanding_ = 0;  // operations started whose tags have not come back
  bool read_posted_ = false, broken_ = false, finish_started_ = false;
};

}  // namespace attnd::client
