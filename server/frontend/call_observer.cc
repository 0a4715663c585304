#include "call_observer.h"

#include <atomic>
#include <map>
#include <optional>
#include <random>
#include <string>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/strip.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "attnd/v1/attention.pb.h"
#include "attnd/transport/zero_copy.h"
#include "grpc/grpc_security.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/byte_buffer.h"
#include "spdlog/spdlog.h"

namespace attnd::server {

void PeerCalls::Add(const std::string& peer) {
  absl::MutexLock lock(&mu_);
  ++calls_[peer];
}

void PeerCalls::Remove(const std::string& peer) {
  absl::MutexLock lock(&mu_);
  auto it = calls_.find(peer);
  if (it == calls_.end()) return;
  if (--it->second == 0) calls_.erase(it);  // connections come and go: keep only live peers
}

uint32_t PeerCalls::Count(const std::string& peer) const {
  absl::MutexLock lock(&mu_);
  auto it = calls_.find(peer);
  return it == calls_.end() ? 0 : it->second;
}

absl::Status PeerCalls::Admit(const std::string& peer) const {
  if (max_per_peer_ == 0) return absl::OkStatus();
  const uint32_t n = Count(peer);
  if (n <= max_per_peer_) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat("max_calls_per_client: this connection already has ", n - 1,
                                                   " Forward calls in progress (limit ", max_per_peer_,
                                                   "); retry when one finishes"));
}

std::string ConnectionKey(grpc::ServerContextBase* ctx) {
  std::string key = ctx->peer();
  // Every call on a connection shares the auth context its handshake made (insecure credentials make one too);
  // a call holds a reference to it, so its address names the connection for as long as the call is counted.
  if (grpc_auth_context* auth = grpc_call_auth_context(ctx->c_call()); auth != nullptr) {
    absl::StrAppend(&key, "#", absl::Hex(reinterpret_cast<uintptr_t>(auth)));
    grpc_auth_context_release(auth);
  }
  return key;
}

bool DrainTracker::Add() {
  absl::MutexLock lock(&mu_);
  if (draining_) return false;
  ++live_;
  return true;
}

void DrainTracker::Remove() {
  absl::MutexLock lock(&mu_);
  --live_;
}

void DrainTracker::BeginDrain() {
  absl::MutexLock lock(&mu_);
  draining_ = true;
}

bool DrainTracker::AwaitDrained(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto drained = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return live_ == 0; };
  return mu_.AwaitWithDeadline(absl::Condition(&drained), deadline);
}

uint32_t DrainTracker::live() const {
  absl::MutexLock lock(&mu_);
  return live_;
}

std::string GenerateRequestId() {
  static const std::string prefix = [] {
    std::random_device rd;
    return absl::StrFormat("%08x", rd());
  }();
  static std::atomic<uint64_t> next{1};
  return absl::StrCat("attnd-", prefix, "-", next.fetch_add(1, std::memory_order_relaxed));
}

absl::Status EndedEarly(absl::Time start, absl::Time deadline, absl::string_view when) {
  const absl::Duration slack = (deadline - start) / 100 + absl::Milliseconds(5);
  if (absl::Now() >= deadline - slack) return absl::DeadlineExceededError(absl::StrCat("the deadline passed ", when));
  return absl::CancelledError(absl::StrCat("the call was cancelled ", when));
}

void LogOutcome(const char* method, const std::string& request_id, const absl::Status& status, absl::Time start) {
  if (!spdlog::should_log(spdlog::level::debug)) return;
  const double us = absl::ToDoubleMicroseconds(absl::Now() - start);
  const std::string id = absl::CHexEscape(request_id);
  if (status.ok()) {
    spdlog::debug("{} id='{}' ok in {:.0f} us", method, id, us);
  } else {
    spdlog::debug("{} id='{}' {} in {:.0f} us: {}", method, id, absl::StatusCodeToString(status.code()), us,
                  absl::CHexEscape(status.message()));
  }
}

namespace {

using grpc::experimental::InterceptionHookPoints;

constexpr absl::string_view kAttentionPrefix = "/attnd.v1.Attention/";

enum class Kind { kForward, kForwardStream, kStep, kStepStream, kHealth, kOther };

std::string ShapeText(const v1::ForwardRequest& r) {
  const v1::AttentionShape& s = r.shape();
  return absl::StrCat(s.batch(), "x", s.q_len(), "x", s.kv_len(), "x", s.q_heads(), "x", s.kv_heads(), "x",
                      s.head_dim(), "/", v1::Dtype_Name(r.dtype()), "/", v1::MaskType_Name(r.mask()));
}

class CallObserver final : public grpc::experimental::Interceptor {
 public:
  CallObserver(grpc::experimental::ServerRpcInfo* info, CallStats* stats, PeerCalls* peers, DrainTracker* drain)
      : info_(info), stats_(stats), peers_(peers), drain_(drain), start_(absl::Now()) {
    const absl::string_view path = info->method() != nullptr ? info->method() : "";
    if (absl::StartsWith(path, kAttentionPrefix)) {
      in_service_ = true;
      method_ = std::string(path.substr(kAttentionPrefix.size()));
      if (method_ == "Forward") kind_ = Kind::kForward;
      if (method_ == "ForwardStream") kind_ = Kind::kForwardStream;
      if (method_ == "Step") kind_ = Kind::kStep;
      if (method_ == "StepStream") kind_ = Kind::kStepStream;
    } else {
      method_ = std::string(absl::StripPrefix(path, "/"));
      if (absl::StartsWith(path, "/grpc.health.v1.Health/")) kind_ = Kind::kHealth;
    }
  }

  ~CallObserver() override {
    // A call torn down without a status (the server stopped under it) still leaves the books balanced, as does
    // one whose close never came (its answer is booked as sent).
    if (deferred_) Finish(*deferred_);
    if (!finished_) Finish(AsSeen(grpc::Status(grpc::StatusCode::CANCELLED, "the call ended without a status")));
    // gRPC destroys interceptors with the call, after its last operation (the status) completed.
    if (draining_counted_) drain_->Remove();
  }

  void Intercept(grpc::experimental::InterceptorBatchMethods* m) override {
    if (m->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_INITIAL_METADATA)) {
      peer_ = info_->server_context()->peer();
      deadline_ = Deadline();
      if (peers_ != nullptr && (kind_ == Kind::kForward || kind_ == Kind::kForwardStream)) {
        connection_ = ConnectionKey(info_->server_context());
        peers_->Add(connection_);
        counted_ = true;
      }
      if (drain_ != nullptr && (kind_ == Kind::kForward || kind_ == Kind::kForwardStream)) {
        draining_counted_ = drain_->Add();
      }
    }
    if (m->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_MESSAGE)) {
      if (void* msg = m->GetRecvMessage(); msg != nullptr) OnRequest(msg);
    }
    if (m->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_MESSAGE)) {
      if (const void* msg = m->GetSendMessage(); msg != nullptr) OnReply(msg);
    }
    if (m->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      if (request_id_.empty()) {  // a request that came without one: the service named it (service.h)
        const std::multimap<std::string, std::string>* trailing = m->GetSendTrailingMetadata();
        const auto it = trailing->find(std::string(kRequestIdMetadata));
        if (it != trailing->end()) request_id_ = it->second;
      }
      // Before the status leaves: a client that starts its next call on seeing this one end must find the slot free.
      ReleaseSlot();
      const grpc::Status sent = m->GetSendStatus();
      if (info_->server_context()->IsCancelled()) {
        Finish(AsSeen(sent));
      } else if (absl::Now() >= deadline_) {
        // The client's deadline, which runs ahead of the server's, has passed: the answer came too late.
        Finish(AsSeen(sent));
      } else if ((kind_ == Kind::kForward || kind_ == Kind::kForwardStream) && !request_seen_) {
        // No request ever arrived: the call was cancelled, or timed out, on the way in (the answer reached no
        // one), or the client half-closed without its message (the answer stands). Only its close tells which.
        deferred_ = sent;
      } else {
        Finish(sent);
      }
    }
    if (m->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_CLOSE) && deferred_) {
      const grpc::Status sent = *std::move(deferred_);
      deferred_.reset();
      Finish(info_->server_context()->IsCancelled() ? AsSeen(sent) : sent);
    }
    m->Proceed();
  }

 private:
  // Forward and ForwardStream run on the raw API (service.h): their messages are the serialised
  // ByteBuffers. Only their small fields are parsed here (ParseSmallFields skips the tensors), and for a
  // stream only the first message each way (the headers).
  void OnRequest(void* msg) {
    if (kind_ == Kind::kStep) {  // a typed method: the message is the parsed request
      const auto* step = static_cast<const v1::StepRequest*>(msg);
      if (request_id_.empty()) request_id_ = step->request_id();
      shape_ = absl::StrCat("layer ", step->layer(), ", ", step->sequences_size(), " sequences");
      return;
    }
    if (kind_ != Kind::kForward && kind_ != Kind::kForwardStream) return;
    const auto* b = static_cast<const grpc::ByteBuffer*>(msg);
    if (!b->Valid()) return;  // a unary call that ended before its message came
    request_seen_ = true;
    bytes_in_ += b->Length();
    if (messages_in_++ > 0) return;
    const std::optional<v1::ForwardRequest> header = HeaderOf<v1::ForwardRequest, v1::ForwardStreamRequest>(*b);
    if (!header) return;
    if (request_id_.empty()) request_id_ = header->request_id();
    shape_ = ShapeText(*header);
  }

  void OnReply(const void* msg) {
    if (kind_ == Kind::kStep) {
      const auto* step = static_cast<const v1::StepResponse*>(msg);
      queue_ = absl::Microseconds(step->timing().timing().queue_us());
      kernel_ = absl::Microseconds(step->timing().timing().kernel_us());
      return;
    }
    if (kind_ != Kind::kForward && kind_ != Kind::kForwardStream) return;
    const auto* b = static_cast<const grpc::ByteBuffer*>(msg);
    bytes_out_ += b->Length();
    if (messages_out_++ > 0) return;
    const std::optional<v1::ForwardResponse> header = HeaderOf<v1::ForwardResponse, v1::ForwardStreamResponse>(*b);
    if (!header || !header->has_timing()) return;
    queue_ = absl::Microseconds(header->timing().queue_us());
    kernel_ = absl::Microseconds(header->timing().kernel_us());
  }

  // A Forward message is its own header; a stream's first message holds one (or is a protocol error).
  template <typename Header, typename StreamMessage>
  std::optional<Header> HeaderOf(const grpc::ByteBuffer& b) const {
    if (kind_ == Kind::kForward) {
      Header h;
      if (ParseSmallFields(b, &h)) return h;
      return std::nullopt;
    }
    StreamMessage m;
    if (ParseSmallFields(b, &m) && m.has_header()) return std::move(*m.mutable_header());
    return std::nullopt;
  }

  absl::Time Deadline() const { return absl::FromChrono(info_->server_context()->deadline()); }

  void ReleaseSlot() {
    if (counted_) peers_->Remove(connection_);
    counted_ = false;
  }

  // A status sent after the call ended (deadline, client gone, shutdown grace spent) never reaches the client:
  // the books say what the client saw (EndedEarly), keeping the server's own message when it says the same.
  grpc::Status AsSeen(const grpc::Status& sent) const {
    const absl::Status seen = EndedEarly(start_, deadline_, "before the reply was sent");
    if (static_cast<int>(sent.error_code()) == static_cast<int>(seen.code())) return sent;
    return grpc::Status(static_cast<grpc::StatusCode>(seen.code()), std::string(seen.message()));
  }

  void Finish(const grpc::Status& status) {
    if (finished_) return;
    finished_ = true;
    ReleaseSlot();
    // A StepStream's steps are recorded one by one by its reactor, as the calls they stand for.
    if (kind_ == Kind::kStepStream) return;
    CallRecord r;
    r.method = method_;
    r.code = static_cast<absl::StatusCode>(status.error_code());
    if (!status.ok()) r.error = status.error_message();
    r.total = absl::Now() - start_;
    if (status.ok()) {
      r.queue = queue_;
      r.kernel = kernel_;
    }
    r.bytes_in = bytes_in_;
    r.bytes_out = bytes_out_;
    r.in_stats = in_service_;
    // Health probes come every few seconds from orchestrators: logging them would bury the requests.
    r.access_log = kind_ != Kind::kHealth;
    r.data_plane = kind_ == Kind::kForward || kind_ == Kind::kForwardStream;
    r.peer = peer_;
    r.request_id = request_id_;
    r.shape = shape_;
    stats_->TakeAnnotation(info_->server_context(), &r);
    stats_->Record(r);
  }

  grpc::experimental::ServerRpcInfo* const info_;
  CallStats* const stats_;
  PeerCalls* const peers_;
  DrainTracker* const drain_;
  const absl::Time start_;
  Kind kind_ = Kind::kOther;
  bool in_service_ = false;  // a method of attnd.v1.Attention
  std::string method_, peer_, connection_, request_id_, shape_;
  bool counted_ = false, draining_counted_ = false, finished_ = false;
  bool request_seen_ = false;                // a Forward's request (a stream's first message) arrived
  absl::Time deadline_ = absl::InfiniteFuture();
  std::optional<grpc::Status> deferred_;     // sent, booked once the call's close says whether it was delivered
  uint64_t bytes_in_ = 0, bytes_out_ = 0;
  uint64_t messages_in_ = 0, messages_out_ = 0;
  std::optional<absl::Duration> queue_, kernel_;
};

}  // namespace

grpc::experimental::Interceptor* CallObserverFactory::CreateServerInterceptor(
    grpc::experimental::ServerRpcInfo* info) {
  return new CallObserver(info, stats_, peers_, drain_);
}

}  // namespace attnd::server
