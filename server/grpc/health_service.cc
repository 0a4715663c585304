#include "health_service.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "bounded_unary.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/wire_format_lite.h"
#include "grpc_status.h"
#include "grpcpp/impl/codegen/server_callback_handlers.h"
#include "grpcpp/impl/rpc_service_method.h"
#include "grpcpp/support/proto_buffer_reader.h"

namespace attnd::server {
namespace {

using google::protobuf::internal::WireFormatLite;
using ServingStatus = HealthService::ServingStatus;
using Reactor = grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>;

constexpr char kCheckPath[] = "/grpc.health.v1.Health/Check";
constexpr char kWatchPath[] = "/grpc.health.v1.Health/Watch";
// As gRPC's default health service: a watch keeps its service's name for as long as it is open.
constexpr uint32_t kMaxServiceNameBytes = 200;
// HealthCheckRequest.service and HealthCheckResponse.status.
constexpr int kServiceField = 1;
constexpr int kStatusField = 1;

// HealthCheckRequest{string service = 1}: the name; other fields are skipped, as protobuf skips unknown fields.
absl::StatusOr<std::string> DecodeRequest(const grpc::ByteBuffer& request) {
  grpc::ByteBuffer view(request);  // shares the slices; the reader needs a mutable buffer
  grpc::ProtoBufferReader reader(&view);
  google::protobuf::io::CodedInputStream in(&reader);
  const absl::Status unparseable = absl::InvalidArgumentError("request: not a grpc.health.v1.HealthCheckRequest");
  std::string service;
  for (uint32_t tag; (tag = in.ReadTag()) != 0;) {
    if (tag != WireFormatLite::MakeTag(kServiceField, WireFormatLite::WIRETYPE_LENGTH_DELIMITED)) {
      if (!WireFormatLite::SkipField(&in, tag)) return unparseable;
      continue;
    }
    uint32_t size = 0;
    if (!in.ReadVarint32(&size)) return unparseable;
    if (size > kMaxServiceNameBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("service: ", size, " bytes; a service name is at most ", kMaxServiceNameBytes));
    }
    if (!in.ReadString(&service, static_cast<int>(size))) return unparseable;
  }
  if (!in.ConsumedEntireMessage() || !reader.status().ok()) return unparseable;
  return service;
}

// HealthCheckResponse{ServingStatus status = 1}.
grpc::ByteBuffer EncodeResponse(ServingStatus status) {
  std::string bytes;
  if (status != ServingStatus::kUnknown) {  // proto3 leaves a zero scalar out
    google::protobuf::io::StringOutputStream sink(&bytes);
    google::protobuf::io::CodedOutputStream out(&sink);
    out.WriteTag(WireFormatLite::MakeTag(kStatusField, WireFormatLite::WIRETYPE_VARINT));
    out.WriteVarint32(static_cast<uint32_t>(status));
  }
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

}  // namespace

// One Watch: its request read within the upload bound (BoundedRequestReactor), then the service's status at once
// and again on each change. At most one write is in flight; a status that changes meanwhile is sent once the write
// is done, and only its latest value. HealthService hands statuses over under its mutex, and the reactor leaves
// the service's set (RemoveWatch) before it goes, so it is never handed one once deleted.
class HealthService::WatchReactor final : public BoundedRequestReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  WatchReactor(HealthService* health, grpc::CallbackServerContext* ctx)
      : BoundedRequestReactor(ctx, health->upload_timeout_, absl::OkStatus()), health_(health) {}

  // Set before the reactor is registered, constant after.
  const std::string& service() const { return service_; }

  // The service's status now; `last`: the server stops, and the watch ends once this is sent.
  void Send(ServingStatus status, bool last) {
    absl::MutexLock lock(&mu_);
    wanted_ = status;
    last_ = last_ || last;
    Advance();
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (!ok) gone_ = true;  // the call is over: its client went away, or the server cancelled it
    Advance();
  }

  // Between two statuses nothing is pending on the call: only this tells the watch that it is over.
  void OnCancel() override {
    absl::MutexLock lock(&mu_);
    gone_ = true;
    Advance();
  }

  void OnDone() override {
    health_->RemoveWatch(this);
    BoundedRequestReactor::OnDone();
  }

 private:
  void OnRequest() override {
    absl::StatusOr<std::string> service = DecodeRequest(request());
    request().Clear();  // a watch may stay open for days: it keeps its service's name, not the request's bytes
    if (!service.ok()) return Finish(ToGrpcStatus(service.status()));  // not yet watching: nothing else ends it
    service_ = *std::move(service);
    {
      absl::MutexLock lock(&mu_);
      watching_ = true;
    }
    health_->AddWatch(this);
  }

  // The next step, if none is under way: the call's end once it is over, else the status if it changed since it
  // was last sent, else the end the server's stop asks for.
  void Advance() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!watching_ || writing_ || finished_) return;
    if (gone_) return End(grpc::Status(grpc::StatusCode::CANCELLED, "health: the watch was cancelled"));
    if (wanted_ != sent_) {
      sent_ = wanted_;
      reply_ = EncodeResponse(wanted_);
      writing_ = true;
      return StartWrite(&reply_);
    }
    if (last_) End(grpc::Status(grpc::StatusCode::CANCELLED, "health: the server is shutting down"));
  }

  void End(const grpc::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    finished_ = true;
    Finish(status);
  }

  HealthService* const health_;
  std::string service_;
  absl::Mutex mu_;
  bool watching_ ABSL_GUARDED_BY(mu_) = false;  // the request is in and the reactor registered
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool gone_ ABSL_GUARDED_BY(mu_) = false;  // cancelled, or a write failed
  bool last_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  ServingStatus wanted_ ABSL_GUARDED_BY(mu_) = ServingStatus::kUnknown;
  ServingStatus sent_ ABSL_GUARDED_BY(mu_) = ServingStatus::kUnknown;
  grpc::ByteBuffer reply_ ABSL_GUARDED_BY(mu_);
};

HealthService::HealthService(absl::Duration upload_timeout) : upload_timeout_(upload_timeout) {
  // Raw callback streams, as AttentionService serves its unary methods (service.h): the call is the service's
  // from its headers on, and its request is read, and bounded, by the reactor.
  auto add = [this](const char* path, std::function<Reactor*(grpc::CallbackServerContext*)> make) {
    auto* method = new grpc::internal::RpcServiceMethod(
        path, grpc::internal::RpcMethod::BIDI_STREAMING,
        new grpc::internal::CallbackBidiHandler<grpc::ByteBuffer, grpc::ByteBuffer>(std::move(make)));
    method->SetServerApiType(grpc::internal::RpcServiceMethod::ApiType::RAW_CALL_BACK);
    AddMethod(method);
  };
  using CheckReactor = BoundedUnaryReactor<grpc::ByteBuffer, grpc::ByteBuffer>;
  auto check = std::make_shared<const CheckReactor::Handler>(
      [this](grpc::CallbackServerContext*, absl::Time, const grpc::ByteBuffer* request, grpc::ByteBuffer* response,
             const CheckReactor::Done& done) { done(Check(*request, response)); });
  add(kCheckPath, [this, check](grpc::CallbackServerContext* ctx) -> Reactor* {
    return new CheckReactor(ctx, upload_timeout_, absl::OkStatus(), check);
  });
  add(kWatchPath, [this](grpc::CallbackServerContext* ctx) -> Reactor* { return new WatchReactor(this, ctx); });
}

void HealthService::SetServingStatus(const std::string& service, bool serving) {
  absl::MutexLock lock(&mu_);
  if (shut_down_) return;
  const ServingStatus status = serving ? ServingStatus::kServing : ServingStatus::kNotServing;
  statuses_[service] = status;
  for (WatchReactor* watch : watches_) {
    if (watch->service() == service) watch->Send(status, /*last=*/false);
  }
}

void HealthService::Shutdown() {
  absl::MutexLock lock(&mu_);
  shut_down_ = true;
  for (auto& [service, status] : statuses_) status = ServingStatus::kNotServing;
  for (WatchReactor* watch : watches_) watch->Send(StatusOf(watch->service()), /*last=*/true);
}

absl::Status HealthService::Check(const grpc::ByteBuffer& request, grpc::ByteBuffer* response) {
  const absl::StatusOr<std::string> service = DecodeRequest(request);
  if (!service.ok()) return service.status();
  ServingStatus status;
  {
    absl::ReaderMutexLock lock(&mu_);
    status = StatusOf(*service);
  }
  // gRPC's default health service answers an unknown service so; SERVICE_UNKNOWN is Watch's answer.
  if (status == ServingStatus::kServiceUnknown) {
    return absl::NotFoundError(absl::StrCat("service: '", absl::CHexEscape(*service), "' is unknown to this server"));
  }
  *response = EncodeResponse(status);
  return absl::OkStatus();
}

void HealthService::AddWatch(WatchReactor* watch) {
  absl::MutexLock lock(&mu_);
  watches_.insert(watch);
  watch->Send(StatusOf(watch->service()), /*last=*/shut_down_);
}

void HealthService::RemoveWatch(WatchReactor* watch) {
  absl::MutexLock lock(&mu_);
  watches_.erase(watch);
}

HealthService::ServingStatus HealthService::StatusOf(const std::string& service) const {
  const auto it = statuses_.find(service);
  return it != statuses_.end() ? it->second : ServingStatus::kServiceUnknown;
}

}  // namespace attnd::server
