// A unary method served as a stream of one message each way, so that the server sees the call while its request
// is still arriving and can bound the upload (--upload_timeout_s).
//
// gRPC 1.51 shows a unary call to the application (handler and interceptors alike) only once its whole message is
// in, and keeps no receive deadline of its own: a client that trickles its request, a byte every few seconds,
// would hold the call and the bytes buffered so far for as long as it likes. On the wire a unary call is a stream
// with one message each way, so serving the method as a bidirectional stream changes nothing for clients, and
// the call exists from its headers on. BoundedRequestReactor reads the one request; if it is not in by the
// deadline, the call ends DEADLINE_EXCEEDED "upload_timeout_s: ...". BoundedUnaryReactor then runs `handler` as a
// unary handler would, which calls `done` once (from any thread) with the response filled when OK; a
// server-streaming method (health's Watch) derives from BoundedRequestReactor and writes its own replies.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "attnd/server/status_util.h"
#include "call_observer.h"
#include "grpc_status.h"
#include "grpcpp/alarm.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/support/server_callback.h"

namespace attnd::server {

// Reads a call's one request within the upload bound, then hands it to OnRequest. The reactor is deleted by
// whichever of OnDone and the alarm's callback comes last.
template <typename Request, typename Response>
class BoundedRequestReactor : public grpc::ServerBidiReactor<Request, Response> {
 public:
  void OnReadDone(bool ok) final {
    {
      absl::MutexLock lock(&mu_);
      if (state_ != State::kReading) return;  // ended by the upload bound while the read was pending
      state_ = State::kServing;
    }
    alarm_.Cancel();
    if (!ok) {
      // No message: the call ended on its way in (cancelled, or its deadline passed), or the client half-closed
      // without its one message, which is a protocol error.
      const absl::Time deadline = absl::FromChrono(ctx_->deadline());
      return Base::Finish(ToGrpcStatus(
          ctx_->IsCancelled() || absl::Now() >= deadline
              ? EndedEarly(start_, deadline, "before the request arrived")
              : absl::InvalidArgumentError("request: missing (the call ended without its message)")));
    }
    OnRequest();
  }

  void OnDone() override { Unref(); }

 protected:
  using Base = grpc::ServerBidiReactor<Request, Response>;

  // `upload_timeout` zero or less: no bound. `refusal`, when not OK, answers the call at once, before its request
  // is read: a server shutting down tells a late caller UNAVAILABLE while its request is still on the way, rather
  // than leaving it to be cancelled when the transport closes.
  BoundedRequestReactor(grpc::CallbackServerContext* ctx, absl::Duration upload_timeout, const absl::Status& refusal)
      : ctx_(ctx), start_(absl::Now()), upload_timeout_(upload_timeout) {
    if (!refusal.ok()) {
      {
        absl::MutexLock lock(&mu_);
        state_ = State::kFinished;
      }
      Base::Finish(ToGrpcStatus(refusal));
      return;
    }
    if (upload_timeout_ > absl::ZeroDuration()) {
      refs_.fetch_add(1, std::memory_order_relaxed);  // the alarm's
      alarm_.Set(absl::ToChronoTime(start_ + upload_timeout_), [this](bool fired) { OnUploadDue(fired); });
    }
    Base::StartRead(&request_);
  }

  // The request is in request(): serve it, finishing the call (at once or later, from any thread). Runs once, on
  // the gRPC thread that read it; the upload bound no longer applies.
  virtual void OnRequest() = 0;

  grpc::CallbackServerContext* context() const { return ctx_; }
  absl::Time start() const { return start_; }
  Request& request() { return request_; }

 private:
  enum class State { kReading, kServing, kFinished };

  void OnUploadDue(bool fired) {
    bool end = false;
    if (fired) {
      absl::MutexLock lock(&mu_);
      if (state_ == State::kReading) {
        state_ = State::kFinished;
        end = true;
      }
    }
    if (end) {
      Base::Finish(ToGrpcStatus(absl::DeadlineExceededError(
          absl::StrCat("upload_timeout_s: the request did not arrive within ", absl::FormatDuration(upload_timeout_),
                       " of the call's start; the call is ended"))));
    }
    Unref();
  }

  void Unref() {
    if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }

  grpc::CallbackServerContext* const ctx_;
  const absl::Time start_;
  const absl::Duration upload_timeout_;
  absl::Mutex mu_;
  State state_ ABSL_GUARDED_BY(mu_) = State::kReading;
  grpc::Alarm alarm_;
  std::atomic<int> refs_{1};  // OnDone's, plus the alarm's while it is set
  Request request_;
};

template <typename Request, typename Response>
class BoundedUnaryReactor final : public BoundedRequestReactor<Request, Response> {
 public:
  using Done = std::function<void(const absl::Status&)>;
  using Handler = std::function<void(grpc::CallbackServerContext*, absl::Time start, const Request*, Response*, Done)>;

  // See BoundedRequestReactor for `upload_timeout` and `refusal`.
  BoundedUnaryReactor(grpc::CallbackServerContext* ctx, absl::Duration upload_timeout, const absl::Status& refusal,
                      std::shared_ptr<const Handler> handler)
      : BoundedRequestReactor<Request, Response>(ctx, upload_timeout, refusal), handler_(std::move(handler)) {}

 private:
  void OnRequest() override {
    (*handler_)(this->context(), this->start(), &this->request(), &response_,
                [this](const absl::Status& status) { Finish(status); });
  }

  // After the reply is started this object may go at any moment (OnDone): nothing of it is touched after.
  void Finish(const absl::Status& status) {
    if (status.ok()) {
      this->StartWriteAndFinish(&response_, grpc::WriteOptions(), grpc::Status::OK);
    } else {
      AddStatusTrailers(this->context(), status);
      this->Finish(ToGrpcStatus(status));
    }
  }
  using grpc::ServerBidiReactor<Request, Response>::Finish;

  const std::shared_ptr<const Handler> handler_;
  Response response_;
};

}  // namespace attnd::server
