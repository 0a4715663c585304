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

enum class Kind { kForward, kForwardStream, kStep, kHealth, kOther };

std::string ShapeText(const v1::ForwardRequest& r) {
  const v1::AttentionShape& s = r.shape();
  return absl::StrCat(s.batch(), "x", s.q_len(), "x", s.kv_len(), "x", s.q_heads(), "x", s.kv_heads(), "x",
                      s.head_dim(), "/", v1::DType_Name(r.dtype()), "/", v1::MaskType_Name(r.mask()));
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
    } else {
      method_ = std::string(absl::StripPrefix(path, "/"));
      if (absl::StartsWith(path, "/grpc.health.v1.Health/")) kind_ = Kind::kHealth;
    }
  }

  ~CallObserver() override {
    // A call torn down without a status (the server stopped under it) still leaves the books balanced.
    if (!finished_) Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the call ended without a status"));
    // gRPC destroys interceptors with the call, after its last operation (the status) completed.
    if (draining_counted_) drain_->Remove();
  }

  void Intercept(grpc::experimental::InterceptorBatchMethods* m) override {
    if (m->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_INITIAL_METADATA)) {
      peer_ = info_->server_context()->peer();
      if (peers_ != nullptr && (kind_ == Kind::kForward || kind_ == Kind::kForwardStream)) {
        peers_->Add(peer_);
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
      // A reply finished after the call was cancelled (deadline, client gone, shutdown grace spent) never
      // reaches the client: the books say what the client saw.
      const grpc::Status sent = m->GetSendStatus();
      Finish(sent.ok() && info_->server_context()->IsCancelled()
                 ? grpc::Status(grpc::StatusCode::CANCELLED, "the call was cancelled before its reply was sent")
                 : sent);
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

  void Finish(const grpc::Status& status) {
    if (finished_) return;
    finished_ = true;
    // Before the status leaves: a client that starts its next call on seeing this one end must find the slot free.
    if (counted_) peers_->Remove(peer_);
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
  std::string method_, peer_, request_id_, shape_;
  bool counted_ = false, draining_counted_ = false, finished_ = false;
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
