// The KV-sequence RPCs of attnd.v1.Attention: each decodes its message, names the caller (OwnerOf) and calls
// the Sequences core; Step's reply comes from a backend thread, as Forward's does.
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "attnd/server/status_util.h"
#include "auth.h"
#include "call_observer.h"
#include "metrics.h"
#include "service.h"

namespace attnd::server {

std::string AttentionService::OwnerOf(grpc::CallbackServerContext* ctx) {
  const std::shared_ptr<const grpc::AuthContext> auth = ctx->auth_context();
  if (auth != nullptr) {
    const std::vector<grpc::string_ref> token = auth->FindPropertyValues(kTokenProperty);
    if (!token.empty()) return absl::StrCat("token:", absl::string_view(token[0].data(), token[0].size()));
  }
  // "ipv4:10.0.0.7:51234" -> "ipv4:10.0.0.7": a client keeps its sequences across reconnects (a new port).
  const std::string peer = ctx->peer();
  if (absl::StartsWith(peer, "unix:")) return "local";
  const size_t colon = peer.rfind(':');
  const size_t scheme = peer.find(':');
  if (colon != std::string::npos && colon != scheme) return peer.substr(0, colon);
  return peer;
}

grpc::ServerUnaryReactor* AttentionService::OpenSequence(grpc::CallbackServerContext* ctx,
                                                         const v1::OpenSequenceRequest* request,
                                                         v1::OpenSequenceResponse* response) {
  const absl::Time start = absl::Now();
  absl::StatusOr<v1::OpenSequenceResponse> opened = sequences_->Open(OwnerOf(ctx), *request);
  if (opened.ok()) *response = *std::move(opened);
  return FinishNow(ctx, "OpenSequence", start, opened.status());
}

grpc::ServerUnaryReactor* AttentionService::ForkSequence(grpc::CallbackServerContext* ctx,
                                                         const v1::ForkSequenceRequest* request,
                                                         v1::ForkSequenceResponse* response) {
  const absl::Time start = absl::Now();
  absl::StatusOr<v1::ForkSequenceResponse> forked = sequences_->Fork(OwnerOf(ctx), *request);
  if (forked.ok()) *response = *std::move(forked);
  return FinishNow(ctx, "ForkSequence", start, forked.status());
}

grpc::ServerUnaryReactor* AttentionService::TruncateSequence(grpc::CallbackServerContext* ctx,
                                                             const v1::TruncateSequenceRequest* request,
                                                             v1::TruncateSequenceResponse* response) {
  const absl::Time start = absl::Now();
  absl::StatusOr<v1::TruncateSequenceResponse> truncated = sequences_->Truncate(OwnerOf(ctx), *request);
  if (truncated.ok()) *response = *std::move(truncated);
  return FinishNow(ctx, "TruncateSequence", start, truncated.status());
}

grpc::ServerUnaryReactor* AttentionService::CloseSequence(grpc::CallbackServerContext* ctx,
                                                          const v1::CloseSequenceRequest* request,
                                                          v1::CloseSequenceResponse*) {
  const absl::Time start = absl::Now();
  return FinishNow(ctx, "CloseSequence", start, sequences_->Close(OwnerOf(ctx), *request));
}

grpc::ServerUnaryReactor* AttentionService::GetSequence(grpc::CallbackServerContext* ctx,
                                                        const v1::GetSequenceRequest* request,
                                                        v1::SequenceInfo* response) {
  const absl::Time start = absl::Now();
  absl::StatusOr<v1::SequenceInfo> info = sequences_->Get(OwnerOf(ctx), *request);
  if (info.ok()) *response = *std::move(info);
  return FinishNow(ctx, "GetSequence", start, info.status());
}

grpc::ServerUnaryReactor* AttentionService::Step(grpc::CallbackServerContext* ctx, const v1::StepRequest* request,
                                                 v1::StepResponse* response) {
  const absl::Time start = absl::Now();
  std::string request_id = request->request_id();
  if (request_id.empty()) {
    request_id = GenerateRequestId();
    ctx->AddTrailingMetadata(std::string(kRequestIdMetadata), request_id);
  }
  CallInfo call = CallFor(ctx, start);
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  // The request message stays alive until the reactor finishes: the job's inline tensors point into it.
  sequences_->Step(OwnerOf(ctx), *request, Transport::kUnary, call,
                   [this, ctx, reactor, request, response, request_id, start](absl::Status status, StepJob* job) {
                     if (job != nullptr && status.ok()) {
                       sequences_->FillStepResponse(*job, response);
                       response->set_request_id(request_id);
                       const uint64_t in = job->q.host_bytes + job->k.host_bytes + job->v.host_bytes;
                       response->set_o(std::move(job->o));
                       response->set_lse(std::move(job->lse));
                       stats_->Annotate(ctx, in, response->o().size() + response->lse().size());
                       if (stats_->metrics() != nullptr) stats_->metrics()->RecordStep(job->batch_sequences);
                     }
                     LogOutcome("Step", request_id, status, start);
                     reactor->Finish(ToGrpcStatus(status));
                   });
  return reactor;
}

}  // namespace attnd::server
