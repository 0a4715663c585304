#include "service.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include "absl/strings/match.h"
#include "google/protobuf/descriptor.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "attnd/proto/enums.h"
#include "attnd/server/status_util.h"
#include "attnd/server/validation.h"
#include "attnd/transport/zero_copy.h"
#include "call_observer.h"
#include "core_messages.h"
#include "grpc_status.h"
#include "grpcpp/alarm.h"
#include "spdlog/spdlog.h"

#ifndef ATTND_VERSION
#define ATTND_VERSION "unknown"
#endif

namespace attnd::server {
namespace {

// Reply chunks stay well under the message limit and small enough that a client with gRPC's default 4 MiB
// receive limit can read them.
uint64_t ChunkBytes(uint64_t max_message_bytes) {
  return std::clamp<uint64_t>(max_message_bytes / 2, 4096, 1u << 20);
}

// --max_uploads_per_client, or its default: a quarter of the queue, so that three other clients still find room.
uint32_t UploadsPerClient(const ServerOptions& o, uint32_t max_queue) {
  if (o.limits.max_uploads_per_client > 0) return o.limits.max_uploads_per_client;
  return max_queue == 0 ? 0 : std::max<uint32_t>(1, max_queue / 4);
}

// Lifecycle of one ForwardStream call; each state is entered once, in this order (Failed from any).
enum class StreamState {
  kAwaitingHeader,  // nothing received yet
  kReceiving,       // header validated, assembling Q/K/V chunks
  kComputing,       // submitted to the backend
  kReplying,        // writing the header then O/LSE chunks
  kFinished,        // Finish called
};

// On the raw (ByteBuffer) API, so that tensor bytes are copied once on the way in (from gRPC's slices into
// the backend's InputSink: ReadStreamChunk) and not at all on the way out (O and LSE chunks point into the
// reply's buffers, or into the backend's memory when it lends O: SerializeStreamChunk). Headers and anything
// unusual go through protobuf.
//
// A stream that sends nothing for --stream_idle_timeout_s while the server waits for its header or its inputs is
// ended DEADLINE_EXCEEDED by an alarm (IdleCheck), which frees its inputs and its place among the streams
// receiving. The alarm and OnReadDone both run on gRPC threads: mu_ orders them, and the reactor is deleted by
// whichever of OnDone and the last alarm callback comes last (refs_).
class ForwardStreamReactor final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  ForwardStreamReactor(AttentionService* service, grpc::CallbackServerContext* ctx)
      : service_(service),
        ctx_(ctx),
        start_(absl::Now()),
        idle_timeout_(service->stream_idle_timeout()),
        upload_due_(service->upload_timeout() > absl::ZeroDuration() ? start_ + service->upload_timeout()
                                                                       : absl::InfiniteFuture()) {
    {
      absl::MutexLock lock(&mu_);
      last_input_ = start_;
      if (const absl::Time due = InputDue(); due != absl::InfiniteFuture()) ArmIdleCheck(due);
    }
    StartRead(&in_buf_);
  }

  void OnReadDone(bool ok) override {
    Ref();  // Submit may end the call, and OnDone come, before this returns
    {
      absl::MutexLock lock(&mu_);
      ReadDone(ok);
    }
    Unref();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) return End(absl::CancelledError("the client went away while the reply was being sent"));
    WriteNext();
  }

  void OnDone() override {
    {
      absl::MutexLock lock(&mu_);
      if (idle_alarm_ != nullptr) idle_alarm_->Cancel();  // its callback (ok=false) drops its reference
    }
    Unref();
  }

 private:
  void ReadDone(bool ok) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (state_ == StreamState::kFinished) return;  // ended by IdleCheck while this read was pending
    if (!ok) {  // the client half-closed, or the call died
      if (ctx_->IsCancelled()) return End(EndedEarly(start_, absl::FromChrono(ctx_->deadline()), "while receiving"));
      const absl::Status complete = CheckComplete();
      if (!complete.ok()) return End(complete);
      return Submit();
    }
    last_input_ = absl::Now();
    const absl::Status s = Receive();
    if (!s.ok()) return End(s);
    StartRead(&in_buf_);
  }

  void Ref() { refs_.fetch_add(1, std::memory_order_relaxed); }
  void Unref() {
    if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }

  // A fresh alarm each time: one may not be set again from its own callback.
  void ArmIdleCheck(absl::Time when) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Ref();
    idle_alarm_ = std::make_unique<grpc::Alarm>();
    idle_alarm_->Set(absl::ToChronoTime(when), [this](bool fired) { IdleCheck(fired); });
  }

  // When the inputs must have made progress: the idle timeout after the last message, or the upload's end.
  absl::Time InputDue() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const absl::Time idle_due =
        idle_timeout_ > absl::ZeroDuration() ? last_input_ + idle_timeout_ : absl::InfiniteFuture();
    return std::min(idle_due, upload_due_);
  }

  void IdleCheck(bool fired) {
    if (fired) {
      absl::MutexLock lock(&mu_);
      if (awaiting_input_.load(std::memory_order_relaxed)) {
        const absl::Time due = InputDue();
        const char* waiting =
            state_ == StreamState::kAwaitingHeader ? "waiting for the header" : "receiving the inputs";
        if (absl::Now() < due) {
          ArmIdleCheck(due);
        } else if (due == upload_due_) {
          // A client that keeps sending, however slowly, is held to a whole upload's time.
          End(absl::DeadlineExceededError(absl::StrCat(
              "upload_timeout_s: the header and inputs did not arrive within ",
              absl::FormatDuration(service_->upload_timeout()), " of the stream's start (", bytes_in_,
              " bytes in); the stream is ended")));
        } else {
          End(absl::DeadlineExceededError(absl::StrCat("stream_idle_timeout_s: no message for ",
                                                       absl::FormatDuration(idle_timeout_), " while ", waiting,
                                                       "; the stream is ended")));
        }
      }
    }
    Unref();
  }

  struct Input {
    Input(int i, const char* n, v1::TensorName t) : index(i), name(n), tensor(t) {}
    int index;  // in the InputSink
    const char* name;
    v1::TensorName tensor;
    bool chunked = false;  // bytes come as chunks (false: a reference)
    uint64_t size = 0, received = 0;
    uint8_t* data = nullptr;  // in the job's InputSink
  };

  absl::Status Receive() {
    if (state_ == StreamState::kReceiving) {
      Input* into = nullptr;
      uint64_t size = 0;
      const absl::StatusOr<ChunkRead> r = ReadStreamChunk(in_buf_, [&](const ChunkHead& h) -> absl::StatusOr<char*> {
        const absl::StatusOr<Input*> placed = Place(h);
        if (!placed.ok()) return placed.status();
        into = *placed;
        size = h.size;
        return reinterpret_cast<char*>(into->data + into->received);
      });
      if (!r.ok()) return r.status();
      if (*r == ChunkRead::kDone) return Received(*into, size);
    }
    const grpc::Status parsed = grpc::SerializationTraits<v1::ForwardStreamRequest>::Deserialize(&in_buf_, &in_);
    if (!parsed.ok()) return absl::InvalidArgumentError("message: not a ForwardStreamRequest (unparseable)");
    return Consume();
  }

  absl::Status Consume() {
    if (in_.message_case() == v1::ForwardStreamRequest::kHeader) {
      if (state_ != StreamState::kAwaitingHeader) {
        return absl::InvalidArgumentError("header: sent twice (only the first message may be a header)");
      }
      return AcceptHeader();
    }
    if (in_.message_case() != v1::ForwardStreamRequest::kChunk) {
      return absl::InvalidArgumentError("message: empty ForwardStreamRequest (set header or chunk)");
    }
    const v1::TensorChunk& c = in_.chunk();
    absl::StatusOr<Input*> t = Place({c.tensor(), c.offset(), c.data().size()});
    if (!t.ok()) return t.status();
    std::memcpy((*t)->data + (*t)->received, c.data().data(), c.data().size());
    return Received(**t, c.data().size());
  }

  absl::Status Received(Input& t, uint64_t size) {
    t.received += size;
    bytes_in_ += size;
    return job_->inputs->Arrived(t.index, t.received);
  }

  // The input a chunk's bytes go to (at its `received`), after checking the chunk against the header.
  absl::StatusOr<Input*> Place(const ChunkHead& c) {
    if (state_ != StreamState::kReceiving) {
      return absl::InvalidArgumentError("header: the first ForwardStream message must be a header, got a chunk");
    }
    Input* t = nullptr;
    for (Input& in : inputs_) {
      if (in.tensor == c.tensor) t = &in;
    }
    if (t == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("chunk.tensor: ", v1::TensorName_IsValid(c.tensor)
                                                                            ? v1::TensorName_Name(c.tensor)
                                                                            : absl::StrCat(c.tensor),
                                                     " is not an input (expected TENSOR_NAME_Q, _K or _V)"));
    }
    if (!t->chunked) {
      return absl::InvalidArgumentError(
          absl::StrCat("chunk.tensor: ", t->name, " is given as a reference in the header and takes no chunks"));
    }
    if (c.offset != t->received) {
      return absl::InvalidArgumentError(absl::StrCat(
          t->name, " chunk.offset: ", c.offset, ", expected ", t->received,
          " (a tensor's chunks must arrive in order, without gaps or overlaps)"));
    }
    if (c.size > t->size - t->received) {
      return absl::InvalidArgumentError(absl::StrCat(t->name, " chunk.data: bytes up to ", c.offset, "+", c.size,
                                                     " run past the tensor's ", t->size, " bytes"));
    }
    return t;
  }

  absl::Status AcceptHeader() {
    header_ = std::move(*in_.mutable_header());
    service_->NameRequest(ctx_, header_);
    job_ = std::make_unique<ForwardJob>();
    job_->accepts_lent_o = true;  // the chunks point into the loan, which they keep alive
    ForwardArgs args;
    ATTND_RETURN_IF_ERROR(ForwardArgsFromProto(header_, nullptr, &args));
    CallInfo call = service_->CallFor(ctx_, start_);
    call.inputs_follow = true;  // as chunks, which no one message bounds
    call.message_limit = 0;
    ATTND_RETURN_IF_ERROR(service_->dispatcher().Prepare(args, call, job_.get(), &bytes_));
    absl::StatusOr<std::string> uploader = service_->UploaderOf(ctx_);
    if (!uploader.ok()) return uploader.status();
    uploader_ = *std::move(uploader);
    ATTND_RETURN_IF_ERROR(service_->receiving().Acquire(uploader_));
    holds_upload_slot_ = true;
    const TensorSource* sources[3] = {&job_->q, &job_->k, &job_->v};
    const uint64_t sizes[3] = {bytes_.q, bytes_.k, bytes_.v};
    uint64_t inline_sizes[InputSink::kTensors] = {};
    for (int i = 0; i < 3; ++i) {
      Input& in = inputs_[i];
      in.size = sizes[i];
      in.chunked = sources[i]->buffer_id.empty();
      if (in.chunked) inline_sizes[i] = in.size;
    }
    // The sizes are validated, so bounded by --max_request_bytes; the backend may place the bytes where
    // it will use them (the CUDA backend: pinned memory, copied to the device while the rest arrives).
    absl::StatusOr<std::unique_ptr<InputSink>> sink = service_->dispatcher().OpenInputs(*job_, inline_sizes);
    if (!sink.ok()) return sink.status();
    job_->inputs = *std::move(sink);
    for (Input& in : inputs_) {
      if (in.chunked) in.data = job_->inputs->data(in.index);
    }
    SetState(StreamState::kReceiving);
    return absl::OkStatus();
  }

  absl::Status CheckComplete() {
    if (state_ == StreamState::kAwaitingHeader) {
      return absl::InvalidArgumentError("header: missing (the stream ended before a header)");
    }
    for (const Input& in : inputs_) {
      if (in.chunked && in.received != in.size) {
        return absl::InvalidArgumentError(
            absl::StrCat(in.name, ": the stream ended after ", in.received, " of ", in.size, " bytes"));
      }
    }
    return absl::OkStatus();
  }

  void Submit() {
    TensorSource* sources[3] = {&job_->q, &job_->k, &job_->v};
    for (int i = 0; i < 3; ++i) {
      if (!inputs_[i].chunked) continue;
      sources[i]->host = inputs_[i].data;
      sources[i]->host_bytes = inputs_[i].size;
    }
    // The deadline may have passed while the bytes arrived.
    if (absl::Now() >= job_->deadline) {
      return End(absl::DeadlineExceededError("the deadline expired while the request was being received"));
    }
    // Queue time starts once every byte is in: the upload is the client's time, not the server's queue.
    job_->accepted = absl::Now();
    SetState(StreamState::kComputing);
    service_->dispatcher().Submit(std::move(job_), [this](absl::Status status, ForwardJob* job) {
      if (job == nullptr) return End(status);
      OnJobDone(*job, status);
    });
  }

  // On a backend thread. After StartWrite this object may be deleted at any moment by OnDone, so nothing of
  // `this` is touched after WriteNext.
  void OnJobDone(ForwardJob& job, const absl::Status& status) {
    if (!status.ok()) return End(status);
    v1::ForwardStreamResponse header;
    FillForwardReply(job, service_->backend()->name(), header.mutable_header());
    bool own_buffer = false;
    const grpc::Status serialized =
        grpc::SerializationTraits<v1::ForwardStreamResponse>::Serialize(header, &out_buf_, &own_buffer);
    if (!serialized.ok()) return End(absl::InternalError("ForwardStream: the reply header did not serialise"));
    // Shared: the chunk slices point into these and keep them alive, possibly past this reactor, until
    // gRPC has written them. Lent O too: its memory goes back to the backend when the last slice drops it.
    // (Copying it into the chunks instead cost 8 MiB of copies and eight 1 MiB allocations per reply at 1k
    // tokens x 32 heads, on the thread that starts each write.)
    if (job.o_loan != nullptr) {
      outputs_[0] = {job.o_lent, std::move(job.o_loan), v1::TENSOR_NAME_O};
    } else {
      auto o = std::make_shared<const std::string>(std::move(job.o));
      outputs_[0] = {*o, std::move(o), v1::TENSOR_NAME_O};
    }
    auto lse = std::make_shared<const std::string>(std::move(job.lse));
    outputs_[1] = {*lse, std::move(lse), v1::TENSOR_NAME_LSE};
    SetState(StreamState::kReplying);
    StartWrite(&out_buf_);
  }

  // After the header: the next O or LSE chunk, or the end.
  void WriteNext() {
    const uint64_t chunk = service_->stream_chunk_bytes();
    while (out_index_ < 2 && out_offset_ >= outputs_[out_index_].bytes.size()) {
      ++out_index_;
      out_offset_ = 0;
    }
    if (out_index_ == 2) {
      for (Output& out : outputs_) out.owner.reset();  // what is still unsent lives on in gRPC's slices
      return End(absl::OkStatus());
    }
    const Output& src = outputs_[out_index_];
    const uint64_t n = std::min<uint64_t>(chunk, src.bytes.size() - out_offset_);
    out_buf_ = SerializeStreamChunk(src.name, out_offset_, src.bytes.data() + out_offset_, n, src.owner);
    out_offset_ += n;
    bytes_out_ += n;
    StartWrite(&out_buf_);
  }

  // Every change of state goes through here, so that the service's count of receiving streams stays exact: the
  // slot taken with the header is given back as the stream leaves kReceiving, whichever way.
  void SetState(StreamState next) {
    if (next != StreamState::kReceiving && holds_upload_slot_) {
      service_->receiving().Release(uploader_);
      holds_upload_slot_ = false;
    }
    if (next != StreamState::kReceiving) awaiting_input_.store(false, std::memory_order_relaxed);
    state_ = next;
  }

  void End(const absl::Status& status) {
    SetState(StreamState::kFinished);
    service_->stats().Annotate(ctx_, bytes_in_, bytes_out_);
    LogOutcome("ForwardStream", header_.request_id(), status, start_);
    Finish(ToGrpcStatus(status));
  }

  AttentionService* const service_;
  grpc::CallbackServerContext* const ctx_;
  const absl::Time start_;
  const absl::Duration idle_timeout_;  // zero: no idle check
  const absl::Time upload_due_;        // --upload_timeout_s after the start (infinite: off)
  absl::Mutex mu_;                     // OnReadDone and IdleCheck
  absl::Time last_input_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<grpc::Alarm> idle_alarm_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> awaiting_input_{true};  // awaiting the header or receiving: what IdleCheck may end
  std::atomic<int> refs_{1};                // OnDone's, plus one per armed alarm and per OnReadDone running
  StreamState state_ = StreamState::kAwaitingHeader;
  std::string uploader_;            // UploaderOf(ctx_), once the header came
  bool holds_upload_slot_ = false;  // a slot of service_->receiving()
  grpc::ByteBuffer in_buf_;
  v1::ForwardStreamRequest in_;  // a message protobuf parses (headers, unusual encodings)
  v1::ForwardRequest header_;
  std::unique_ptr<ForwardJob> job_;
  RequestBytes bytes_;
  Input inputs_[3] = {{0, "q", v1::TENSOR_NAME_Q}, {1, "k", v1::TENSOR_NAME_K}, {2, "v", v1::TENSOR_NAME_V}};
  uint64_t bytes_in_ = 0, bytes_out_ = 0;
  // Reply.
  grpc::ByteBuffer out_buf_;
  struct Output {
    std::string_view bytes;
    std::shared_ptr<const void> owner;  // the memory `bytes` points into (a string, or the backend's loan)
    v1::TensorName name = v1::TENSOR_NAME_O;
  };
  Output outputs_[2];  // O, then LSE
  int out_index_ = 0;
  uint64_t out_offset_ = 0;
};

}  // namespace

int AttentionService::MethodIndex(const char* method) {
  const google::protobuf::ServiceDescriptor* service =
      v1::ForwardRequest::descriptor()->file()->FindServiceByName("Attention");
  const google::protobuf::MethodDescriptor* m = service != nullptr ? service->FindMethodByName(method) : nullptr;
  if (m == nullptr) {
    spdlog::critical("attnd.v1.Attention has no method {}", method);
    std::abort();
  }
  return m->index();
}

absl::Status ReceivingSlots::Acquire(const std::string& client) {
  absl::MutexLock lock(&mu_);
  uint32_t& held = held_[client];
  if (per_client_ > 0 && held >= per_client_) {
    if (held == 0) held_.erase(client);
    return absl::ResourceExhaustedError(absl::StrCat(
        "max_uploads_per_client: this client already has ", held,
        " ForwardStream uploads in progress (limit ", per_client_, "); retry when one finishes"));
  }
  ++held;
  total_.fetch_add(1, std::memory_order_relaxed);
  return absl::OkStatus();
}

void ReceivingSlots::Release(const std::string& client) {
  absl::MutexLock lock(&mu_);
  auto it = held_.find(client);
  if (it == held_.end()) return;
  if (--it->second == 0) held_.erase(it);
  total_.fetch_sub(1, std::memory_order_relaxed);
}

AttentionService::AttentionService(const ServerOptions& options, Dispatcher* dispatcher, Sequences* sequences,
                                   BufferRegistry* buffers, CallStats* stats)
    : options_(options),
      dispatcher_(dispatcher),
      sequences_(sequences),
      buffers_(buffers),
      stats_(stats),
      stream_chunk_bytes_(ChunkBytes(options.limits.max_message_bytes)),
      receiving_(UploadsPerClient(options, dispatcher->backend()->max_queue())) {
  using namespace std::placeholders;  // NOLINT(build/namespaces): the handlers' five arguments
  ServeBounded<grpc::ByteBuffer, grpc::ByteBuffer>("Forward", /*raw=*/true, /*refused_while_draining=*/true,
                                                   std::bind(&AttentionService::ServeForward, this, _1, _2, _3, _4, _5));
  ServeBounded<v1::StepRequest, v1::StepResponse>("Step", /*raw=*/false, /*refused_while_draining=*/true,
                                                  std::bind(&AttentionService::ServeStep, this, _1, _2, _3, _4, _5));
  ServeBoundedNow("RegisterCudaBuffer", &AttentionService::ServeRegisterCudaBuffer);
  ServeBoundedNow("UnregisterCudaBuffer", &AttentionService::ServeUnregisterCudaBuffer);
  ServeBoundedNow("ListCudaBuffers", &AttentionService::ServeListCudaBuffers);
  ServeBoundedNow("GetServerInfo", &AttentionService::ServeGetServerInfo);
  ServeBoundedNow("GetStats", &AttentionService::ServeGetStats);
  ServeBoundedNow("OpenSequence", &AttentionService::ServeOpenSequence);
  ServeBoundedNow("ForkSequence", &AttentionService::ServeForkSequence);
  ServeBoundedNow("TruncateSequence", &AttentionService::ServeTruncateSequence);
  ServeBoundedNow("CloseSequence", &AttentionService::ServeCloseSequence);
  ServeBoundedNow("GetSequence", &AttentionService::ServeGetSequence);
}

absl::Duration AttentionService::stream_idle_timeout() const { return options_.timeouts.stream_idle_timeout; }
absl::Duration AttentionService::upload_timeout() const { return options_.timeouts.upload_timeout; }

absl::StatusOr<std::string> AttentionService::UploaderOf(grpc::CallbackServerContext* ctx) const {
  absl::StatusOr<std::string> owner = OwnerOf(ctx);
  if (!owner.ok() || *owner != "local") return owner;
  return ConnectionKey(ctx);
}

CallInfo AttentionService::CallFor(grpc::CallbackServerContext* ctx, absl::Time start) const {
  CallInfo call;
  call.accepted = start;
  call.deadline = absl::FromChrono(ctx->deadline());
  call.cancelled = [ctx] { return ctx->IsCancelled(); };
  call.admit = [this, peers = peer_calls_, connection = ConnectionKey(ctx)]() -> absl::Status {
    if (peers != nullptr) ATTND_RETURN_IF_ERROR(peers->Admit(connection));
    return AdmitToQueue();
  };
  call.message_limit = options_.limits.max_message_bytes;
  return call;
}

absl::Status AttentionService::AdmitToQueue() const {
  const uint32_t cap = backend()->max_queue();
  if (cap == 0) return absl::OkStatus();
  const uint32_t queued = backend()->queue_depth();
  const uint32_t receiving = streams_receiving();
  if (queued + receiving < cap) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat("max_queue: ", queued, " requests queued and ", receiving,
                                                   " streams receiving their inputs (limit ", cap,
                                                   " together); retry when one finishes"));
}

void AttentionService::ServeForward(grpc::CallbackServerContext* ctx, absl::Time start,
                                    const grpc::ByteBuffer* request_bytes, grpc::ByteBuffer* response_bytes,
                                    Done done) {
  // Shared with the job's `done`: the job's inputs point into it, or into `request_bytes`' slices, until the
  // backend has finished. The tensors stay where gRPC received them (ReadForwardRequest), so the backend's
  // staging copy is their only one; protobuf parses whatever that reader leaves to it.
  auto request = std::make_shared<v1::ForwardRequest>();
  // The slices the inputs may point into, held until the backend is done with them.
  auto received = std::make_shared<std::vector<grpc::Slice>>();
  InlineBytes in_message[3];
  const bool by_reference = ReadForwardRequest(*request_bytes, received.get(), request.get(), in_message);
  if (!by_reference) {
    grpc::ByteBuffer copy(*request_bytes);  // shares the slices; parsing consumes the buffer it is given
    if (!grpc::SerializationTraits<v1::ForwardRequest>::Deserialize(&copy, request.get()).ok()) {
      const absl::Status bad = absl::InvalidArgumentError("request: not a ForwardRequest (unparseable)");
      LogOutcome("Forward", "", bad, start);
      return done(bad);
    }
  }
  NameRequest(ctx, *request);
  auto bytes = std::make_shared<RequestBytes>();
  Dispatcher::Reply reply = [this, ctx, request, received, response_bytes, start, bytes, done = std::move(done)](
                                absl::Status status, ForwardJob* job) {
    if (job != nullptr && status.ok()) {
      // O and LSE go out by reference (attnd/transport/zero_copy.h): the slices keep the response alive.
      auto response = std::make_shared<v1::ForwardResponse>();
      FillForwardReply(*job, backend()->name(), response.get());
      response->set_o(std::move(job->o));
      response->set_lse(std::move(job->lse));
      stats_->Annotate(ctx, bytes->q + bytes->k + bytes->v, response->o().size() + response->lse().size());
      absl::StatusOr<grpc::ByteBuffer> out = SerializeByReference(response);
      if (out.ok()) {
        *response_bytes = *std::move(out);
      } else {
        status = out.status();
      }
    }
    LogOutcome("Forward", request->request_id(), status, start);
    done(status);
  };
  ForwardArgs args;
  const absl::Status decoded = ForwardArgsFromProto(*request, by_reference ? in_message : nullptr, &args);
  if (!decoded.ok()) return reply(decoded, nullptr);
  dispatcher_->Dispatch(args, CallFor(ctx, start), bytes.get(), std::move(reply));
}

void AttentionService::NameRequest(grpc::CallbackServerContext* ctx, v1::ForwardRequest& request) {
  if (!request.request_id().empty()) return;  // the client's own: it knows it (and it may be any bytes)
  request.set_request_id(GenerateRequestId());
  // Also on errors, where no reply header carries it; the call observer logs it from here.
  ctx->AddTrailingMetadata(std::string(kRequestIdMetadata), request.request_id());
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* AttentionService::ForwardStream(
    grpc::CallbackServerContext* ctx) {
  return new ForwardStreamReactor(this, ctx);
}

absl::Status AttentionService::NoBuffers(const char* method) const {
  if (!backend()->cuda_ipc()) {
    return absl::FailedPreconditionError(
        absl::StrCat(method, ": CUDA IPC needs the cuda backend; this server runs the ", backend()->name(), " backend"));
  }
  if (absl::string_view(method) == "RegisterCudaBuffer") {
    return absl::FailedPreconditionError(
        "RegisterCudaBuffer: CUDA IPC is disabled on this server (start attnd with --enable_cuda_ipc)");
  }
  return absl::FailedPreconditionError(absl::StrCat(method, ": CUDA IPC is disabled on this server"));
}

absl::Status AttentionService::CheckIpcTransport(grpc::CallbackServerContext* ctx, const char* method) const {
  // A CUDA IPC handle only means something to a process on the same host: by default registration is
  // served over the unix socket only, so a remote peer cannot make the server map memory.
  if (options_.security.ipc_over_tcp || !backend()->cuda_ipc()) return absl::OkStatus();
  if (absl::StartsWith(ctx->peer(), "unix:")) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      method, ": CUDA IPC is served only over the server's unix socket (--unix_socket); this call came from ",
      ctx->peer()));
}

absl::Status AttentionService::ServeRegisterCudaBuffer(grpc::CallbackServerContext* ctx,
                                                      const v1::RegisterCudaBufferRequest& request,
                                                      v1::RegisterCudaBufferResponse* response) {
  absl::Status s = ValidateRegisterCudaBuffer(request);
  if (s.ok()) s = CheckIpcTransport(ctx, "RegisterCudaBuffer");
  if (s.ok()) {
    CudaBufferRegistration reg;
    reg.ipc_handle = request.ipc_handle();
    reg.device = request.device();
    reg.offset = request.offset();
    reg.byte_size = request.byte_size();
    reg.name = request.name();
    absl::StatusOr<std::string> id =
        buffers_ != nullptr ? buffers_->Register(reg) : absl::StatusOr<std::string>(NoBuffers("RegisterCudaBuffer"));
    if (id.ok()) response->set_buffer_id(*id);
    s = id.status();
  }
  return s;
}

absl::Status AttentionService::ServeUnregisterCudaBuffer(grpc::CallbackServerContext* ctx,
                                                        const v1::UnregisterCudaBufferRequest& request,
                                                        v1::UnregisterCudaBufferResponse*) {
  absl::Status s = request.buffer_id().empty() ? absl::InvalidArgumentError("buffer_id: empty")
                                               : CheckIpcTransport(ctx, "UnregisterCudaBuffer");
  if (s.ok()) s = buffers_ != nullptr ? buffers_->Unregister(request.buffer_id()) : NoBuffers("UnregisterCudaBuffer");
  return s;
}

absl::Status AttentionService::ServeListCudaBuffers(grpc::CallbackServerContext*, const v1::ListCudaBuffersRequest&,
                                                   v1::ListCudaBuffersResponse* response) {
  for (const CudaBufferDescription& d : buffers_ != nullptr ? buffers_->List() : std::vector<CudaBufferDescription>()) {
    v1::CudaBufferInfo* b = response->add_buffers();
    b->set_buffer_id(d.buffer_id);
    b->set_name(d.name);
    b->set_device(d.device);
    b->set_offset(d.offset);
    b->set_byte_size(d.byte_size);
    b->set_requests_in_flight(d.requests_in_flight);
  }
  return absl::OkStatus();
}

absl::Status AttentionService::ServeGetServerInfo(grpc::CallbackServerContext*, const v1::GetServerInfoRequest&,
                                                 v1::ServerInfo* info) {
  info->set_version(ATTND_VERSION);
  info->set_backend(backend()->name());
  for (const DeviceDescription& d : backend()->devices()) {
    v1::DeviceInfo* p = info->add_devices();
    p->set_index(d.index);
    p->set_name(d.name);
    p->set_compute_capability_major(d.cc_major);
    p->set_compute_capability_minor(d.cc_minor);
    p->set_total_memory_bytes(d.total_memory_bytes);
    p->set_multiprocessor_count(d.multiprocessor_count);
    p->set_uuid(d.uuid);
  }
  int64_t max_hd = 0;
  for (int64_t hd : dispatcher_->limits().supported_head_dims) {
    info->add_supported_head_dims(hd);
    max_hd = std::max(max_hd, hd);
  }
  for (DType t : dispatcher_->limits().supported_dtypes) info->add_supported_dtypes(proto::DtypeToProto(t));
  v1::Limits* l = info->mutable_limits();
  l->set_max_request_bytes(options_.limits.max_request_bytes);
  l->set_max_message_bytes(options_.limits.max_message_bytes);
  l->set_max_queue(backend()->max_queue());
  l->set_max_head_dim(max_hd);
  l->set_max_batch(dispatcher_->limits().max_batch);
  l->set_max_q_len(dispatcher_->limits().max_q_len);
  l->set_max_kv_len(dispatcher_->limits().max_kv_len);
  l->set_max_heads(dispatcher_->limits().max_heads);
  info->set_cuda_ipc_enabled(buffers_ != nullptr);
  for (const std::string& k : backend()->kernels()) info->add_kernels(k);
  info->set_stream_preferred_from_bytes(backend()->stream_preferred_from_bytes());
  *info->mutable_sequences() = SequenceLimitsToProto(sequences_->options());
  info->set_stream_ordered_steps(info->sequences().enabled() && !options_.shm.socket.empty());
  info->set_device_ordered_steps(info->stream_ordered_steps() && options_.shm.device_order &&
                                 backend()->device_order());
  return absl::OkStatus();
}

absl::Status AttentionService::ServeGetStats(grpc::CallbackServerContext*, const v1::GetStatsRequest&,
                                            v1::ServerStats* out) {
  stats_->Fill(out);
  out->set_queue_depth(backend()->queue_depth());
  out->set_in_flight(backend()->in_flight());
  out->set_streams_receiving(streams_receiving());
  const BackendStats b = backend()->stats();
  out->set_tensor_map_cache_hits(b.tensor_map_cache_hits);
  out->set_tensor_map_cache_misses(b.tensor_map_cache_misses);
  *out->mutable_sequences() = SequenceStatsToProto(sequences_->stats());
  out->set_queue_depth(out->queue_depth() + sequences_->waiting());
  return absl::OkStatus();
}

}  // namespace attnd::server
