// The KV-sequence RPCs of attnd.v1.Attention: each decodes its message, names the caller (OwnerOf) and calls
// the Sequences core; Step's reply comes from a backend thread, as Forward's does, and so does each answer of a
// StepStream.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "attnd/server/status_util.h"
#include "auth.h"
#include "call_observer.h"
#include "core_messages.h"
#include "metrics.h"
#include "service.h"

namespace attnd::server {

absl::StatusOr<std::string> AttentionService::OwnerOf(grpc::CallbackServerContext* ctx) const {
  absl::StatusOr<std::optional<std::string>> peer = PeerOwnerOf(ctx->client_metadata(), peer_secret_);
  if (!peer.ok()) return peer.status();
  if (peer->has_value()) return **std::move(peer);
  if (auth_ != nullptr) {
    // The processor admitted the call, so its header names a token; -1 only for the open health service.
    const int index = auth_->IndexOf(ctx->client_metadata());
    if (index >= 0) return absl::StrCat("token:", index);
  }
  // "ipv4:10.0.0.7:51234" -> "ipv4:10.0.0.7": a client keeps its sequences across reconnects (a new port).
  const std::string address = ctx->peer();
  if (absl::StartsWith(address, "unix:")) return std::string("local");
  const size_t colon = address.rfind(':');
  const size_t scheme = address.find(':');
  if (colon != std::string::npos && colon != scheme) return address.substr(0, colon);
  return address;
}

absl::Status AttentionService::ServeOpenSequence(grpc::CallbackServerContext* ctx,
                                                const v1::OpenSequenceRequest& request,
                                                v1::OpenSequenceResponse* response) {
  absl::StatusOr<OpenArgs> args = OpenArgsFromProto(request);
  if (!args.ok()) return args.status();
  absl::StatusOr<std::string> owner = OwnerOf(ctx);
  if (!owner.ok()) return owner.status();
  absl::StatusOr<OpenedSequences> opened = sequences_->Open(*owner, *args);
  if (!opened.ok()) return opened.status();
  for (std::string& id : opened->sequence_ids) response->add_sequence_ids(std::move(id));
  response->set_max_tokens(opened->max_tokens);
  response->set_page_tokens(opened->page_tokens);
  return absl::OkStatus();
}

absl::Status AttentionService::ServeForkSequence(grpc::CallbackServerContext* ctx,
                                                const v1::ForkSequenceRequest& request,
                                                v1::ForkSequenceResponse* response) {
  absl::StatusOr<std::string> owner = OwnerOf(ctx);
  if (!owner.ok()) return owner.status();
  absl::StatusOr<std::vector<std::string>> forked = sequences_->Fork(*owner, request.sequence_id(), request.count());
  if (!forked.ok()) return forked.status();
  for (std::string& id : *forked) response->add_sequence_ids(std::move(id));
  return absl::OkStatus();
}

absl::Status AttentionService::ServeTruncateSequence(grpc::CallbackServerContext* ctx,
                                                    const v1::TruncateSequenceRequest& request,
                                                    v1::TruncateSequenceResponse* response) {
  absl::StatusOr<std::string> owner = OwnerOf(ctx);
  if (!owner.ok()) return owner.status();
  absl::StatusOr<std::vector<int64_t>> lengths = sequences_->Truncate(*owner, request.sequence_id(), request.tokens());
  if (!lengths.ok()) return lengths.status();
  for (int64_t len : *lengths) response->add_lengths(len);
  return absl::OkStatus();
}

absl::Status AttentionService::ServeCloseSequence(grpc::CallbackServerContext* ctx,
                                                 const v1::CloseSequenceRequest& request, v1::CloseSequenceResponse*) {
  absl::StatusOr<std::string> owner = OwnerOf(ctx);
  if (!owner.ok()) return owner.status();
  const std::vector<absl::string_view> ids(request.sequence_ids().begin(), request.sequence_ids().end());
  return sequences_->Close(*owner, ids, request.moved_to());
}

absl::Status AttentionService::ServeGetSequence(grpc::CallbackServerContext* ctx,
                                               const v1::GetSequenceRequest& request, v1::SequenceInfo* response) {
  absl::StatusOr<std::string> owner = OwnerOf(ctx);
  if (!owner.ok()) return owner.status();
  absl::StatusOr<SequenceState> state = sequences_->Get(*owner, request.sequence_id());
  if (!state.ok()) return state.status();
  *response = SequenceInfoToProto(*state);
  return absl::OkStatus();
}

void AttentionService::ServeStep(grpc::CallbackServerContext* ctx, absl::Time start, const v1::StepRequest* request,
                                 v1::StepResponse* response, Done done) {
  std::string request_id = request->request_id();
  if (request_id.empty()) {
    request_id = GenerateRequestId();
    ctx->AddTrailingMetadata(std::string(kRequestIdMetadata), request_id);
  }
  CallInfo call = CallFor(ctx, start);
  absl::StatusOr<std::string> owner = OwnerOf(ctx);
  if (!owner.ok()) {
    done(owner.status());
    return;
  }
  // The request message stays alive until the call finishes: the job's inline tensors point into it.
  sequences_->Step(*owner, StepArgsFromProto(*request), call,
                   [this, ctx, response, request_id, start, done = std::move(done)](absl::Status status, StepJob* job) {
                     if (job != nullptr && status.ok()) {
                       FillStepReply(*job, backend()->name(), response);
                       response->set_request_id(request_id);
                       const uint64_t in = job->q.host_bytes + job->k.host_bytes + job->v.host_bytes;
                       response->set_o(std::move(job->o));
                       response->set_lse(std::move(job->lse));
                       stats_->Annotate(ctx, in, response->o().size() + response->lse().size());
                       if (stats_->metrics() != nullptr) stats_->metrics()->RecordStep(job->batch_sequences);
                     }
                     LogOutcome("Step", request_id, status, start);
                     done(status);
                   });
}

namespace {

constexpr const char* kStepStreamMethod = "StepStream";

// One StepStream call: reads a step, hands it to the Sequences core, writes its answer from the thread that
// finished it and reads the next; one step at a time, so a stream holds at most one request and one reply. The
// stream ends (OK) once the client has half-closed (or the call has ended) and no step is in flight: a step
// admitted is always run and answered, also when the call is cancelled meanwhile, before the reactor lets gRPC
// drop the call.
class StepStreamReactor final : public grpc::ServerBidiReactor<v1::StepStreamRequest, v1::StepStreamResponse> {
 public:
  StepStreamReactor(grpc::CallbackServerContext* ctx, Sequences* sequences, std::string backend_name, CallStats* stats,
                    CallInfo call, std::string owner)
      : sequences_(sequences),
        backend_name_(std::move(backend_name)),
        stats_(stats),
        owner_(std::move(owner)),
        peer_(ctx->peer()),
        call_(std::move(call)) {
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the client half-closed, or the call ended
      bool finish = false;
      {
        absl::MutexLock lock(&mu_);
        reads_done_ = true;
        finish = FinishableLocked();
      }
      if (finish) Finish(grpc::Status::OK);
      return;
    }
    {
      absl::MutexLock lock(&mu_);
      step_in_flight_ = true;
    }
    RunStep();
  }

  void OnWriteDone(bool ok) override {
    v1::StepStreamResponse* next = nullptr;
    bool finish = false;
    {
      absl::MutexLock lock(&mu_);
      writing_.reset();
      if (ok && queued_ != nullptr) {
        writing_ = std::move(queued_);
        next = writing_.get();
      }
      queued_.reset();  // a failed write ended the call: nothing more reaches the client
      finish = FinishableLocked();
    }
    if (next != nullptr) StartWrite(next);
    if (finish) Finish(grpc::Status::OK);
  }

  void OnDone() override { delete this; }

 private:
  void RunStep() {
    const absl::Time start = absl::Now();
    v1::StepRequest* step = request_.mutable_step();
    if (step->request_id().empty()) step->set_request_id(GenerateRequestId());
    CallInfo call = call_;
    call.accepted = start;
    if (request_.timeout_us() < 0) {
      Answer(start, absl::InvalidArgumentError(absl::StrCat("timeout_us: must be >= 0 (0: the stream's deadline), got ",
                                                            request_.timeout_us())),
             nullptr);
      return;
    }
    if (request_.timeout_us() > 0) {
      call.deadline = std::min(call.deadline, start + absl::Microseconds(request_.timeout_us()));
    }
    // A step read from a stream already cancelled is refused. Once admitted it runs and commits even if the stream
    // is cancelled, or its client goes away, before its launch (docs/sequences.md, "StepStream"): the server took
    // it, and a caller whose answer was lost learns the outcome from GetSequence. Its deadline still drops it while
    // it waits.
    if (call.cancelled && call.cancelled()) {
      Answer(start, absl::CancelledError("the stream was cancelled before the step was admitted; nothing was done"),
             nullptr);
      return;
    }
    call.cancelled = nullptr;
    // The request message is not read into again before the step is answered: the job's inline tensors point
    // into it.
    sequences_->Step(owner_, StepArgsFromProto(*step), call,
                     [this, start](absl::Status status, StepJob* job) { Answer(start, std::move(status), job); });
  }

  // Called once per step, on the thread that finished it (or on the reading thread for a refused one). The
  // answer is handed to gRPC first and the step booked after: the caller waits for the one, not the other. The
  // reactor stays (FinishableLocked) until the booking is done.
  void Answer(absl::Time start, absl::Status status, StepJob* job) {
    auto response = std::make_unique<v1::StepStreamResponse>();
    const v1::StepRequest& step = request_.step();
    response->set_request_id(step.request_id());
    CallRecord rec;
    rec.method = kStepStreamMethod;
    rec.code = status.code();
    rec.in_stats = true;
    rec.access_log = true;
    rec.peer = peer_;
    rec.request_id = step.request_id();
    rec.shape = absl::StrCat("layer ", step.layer(), ", ", step.sequences_size(), " sequences");
    uint32_t batch_sequences = 0;
    if (job != nullptr && status.ok()) {
      v1::StepResponse* r = response->mutable_step();
      FillStepReply(*job, backend_name_, r);
      rec.tensor_bytes_in = job->q.host_bytes + job->k.host_bytes + job->v.host_bytes;
      r->set_o(std::move(job->o));
      r->set_lse(std::move(job->lse));
      rec.tensor_bytes_out = r->o().size() + r->lse().size();
      rec.queue = absl::Microseconds(r->timing().timing().queue_us());
      rec.kernel = absl::Microseconds(r->timing().timing().kernel_us());
      batch_sequences = job->batch_sequences;
    } else {
      response->set_code(static_cast<int32_t>(status.code()));
      response->set_message(std::string(status.message()));
      rec.error = std::string(status.message());
    }
    rec.total = absl::Now() - start;

    v1::StepStreamResponse* write = nullptr;
    bool read = false;
    {
      absl::MutexLock lock(&mu_);
      step_in_flight_ = false;
      ++bookings_;
      if (writing_ == nullptr) {
        writing_ = std::move(response);
        write = writing_.get();
      } else {
        queued_ = std::move(response);  // the previous answer's write has not completed yet
      }
      read = !reads_done_;
    }
    // Outside the lock: gRPC may run a reaction inline from these.
    if (write != nullptr) StartWrite(write);
    if (read) StartRead(&request_);
    LogOutcome(kStepStreamMethod, rec.request_id, status, start);
    if (batch_sequences > 0 && stats_->metrics() != nullptr) stats_->metrics()->RecordStep(batch_sequences);
    stats_->Record(rec);
    bool finish = false;
    {
      absl::MutexLock lock(&mu_);
      --bookings_;
      finish = FinishableLocked();
    }
    if (finish) Finish(grpc::Status::OK);
  }

  // The call can end: no more steps come, none is in flight, every answer has been written and booked (so a
  // client that sees its stream end finds its steps in the stats).
  bool FinishableLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!reads_done_ || step_in_flight_ || bookings_ > 0 || writing_ != nullptr || queued_ != nullptr || finished_) {
      return false;
    }
    finished_ = true;
    return true;
  }

  Sequences* const sequences_;
  const std::string backend_name_;  // for the replies
  CallStats* const stats_;
  const std::string owner_, peer_;
  const CallInfo call_;  // the stream's deadline, cancellation and admission; `accepted` is set per step
  v1::StepStreamRequest request_;
  absl::Mutex mu_;
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;
  bool step_in_flight_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  int bookings_ ABSL_GUARDED_BY(mu_) = 0;  // answers handed to gRPC whose stats are being recorded
  std::unique_ptr<v1::StepStreamResponse> writing_ ABSL_GUARDED_BY(mu_);  // handed to StartWrite, until its OnWriteDone
  std::unique_ptr<v1::StepStreamResponse> queued_ ABSL_GUARDED_BY(mu_);   // waiting for writing_ to complete
};

}  // namespace

grpc::ServerBidiReactor<v1::StepStreamRequest, v1::StepStreamResponse>* AttentionService::StepStream(
    grpc::CallbackServerContext* ctx) {
  absl::StatusOr<std::string> owner = OwnerOf(ctx);
  if (!owner.ok()) return new RefusedCall<grpc::ServerBidiReactor<v1::StepStreamRequest, v1::StepStreamResponse>>(
      owner.status());
  return new StepStreamReactor(ctx, sequences_, backend()->name(), stats_, CallFor(ctx, absl::Now()),
                               *std::move(owner));
}

}  // namespace attnd::server
