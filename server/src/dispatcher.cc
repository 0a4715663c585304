#include "attnd/server/dispatcher.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "attnd/server/status_util.h"

namespace attnd::server {

absl::Status Dispatcher::Prepare(const v1::ForwardRequest& request, Transport transport, const CallInfo& call,
                                 ForwardJob* job, RequestBytes* bytes) const {
  if (shutting_down_.load()) return absl::UnavailableError("the server is shutting down");
  if (call.admit) ATTND_RETURN_IF_ERROR(call.admit());
  job->accepted = call.accepted;
  ATTND_RETURN_IF_ERROR(ValidateForwardRequest(request, transport, limits_, job, bytes, call.in_message));
  ATTND_RETURN_IF_ERROR(backend_->Accept(job));
  if (buffers_ == nullptr && (job->q.is_reference() || job->k.is_reference() || job->v.is_reference() ||
                              job->o_to_buffer)) {
    return absl::FailedPreconditionError(
        "ref: tensor references need CUDA IPC, which this server does not enable (start attnd with "
        "--enable_cuda_ipc)");
  }
  job->deadline = call.deadline;
  if (absl::Now() >= job->deadline) {
    return absl::DeadlineExceededError("the deadline had expired when the request arrived; nothing was computed");
  }
  if (call.cancelled) {
    if (call.cancelled()) return absl::CancelledError("the call was cancelled before it was queued");
    job->cancelled = call.cancelled;
  }
  return absl::OkStatus();
}

// One lease per distinct buffer, so that requests_in_flight counts requests; every reference of one request
// must be on one device (one request runs on one GPU).
absl::Status Dispatcher::ResolveReferences(ForwardJob& job) const {
  const Shape& s = job.problem.shape;
  struct Use {
    const char* field;
    TensorSource* src;
    int64_t seq, heads;
    bool used;
  } uses[4] = {{"q.ref", &job.q, s.q_len, s.q_heads, job.q.is_reference()},
               {"k.ref", &job.k, s.kv_len, s.kv_heads, job.k.is_reference()},
               {"v.ref", &job.v, s.kv_len, s.kv_heads, job.v.is_reference()},
               {"o_ref", &job.o_ref, s.q_len, s.q_heads, job.o_to_buffer}};
  std::vector<std::pair<std::string, BufferLease>> held;
  int device = -1;
  for (Use& u : uses) {
    if (!u.used) continue;
    if (buffers_ == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(u.field, ": CUDA IPC is not enabled (--enable_cuda_ipc)"));
    }
    const BufferLease* lease = nullptr;
    for (const auto& [id, l] : held) {
      if (id == u.src->buffer_id) lease = &l;
    }
    if (lease == nullptr) {
      absl::StatusOr<BufferLease> acquired = buffers_->Acquire(u.field, u.src->buffer_id);
      if (!acquired.ok()) return acquired.status();
      held.emplace_back(u.src->buffer_id, *std::move(acquired));
      lease = &held.back().second;
    }
    if (device >= 0 && lease->device != device) {
      return absl::InvalidArgumentError(absl::StrCat(u.field, ".buffer_id: on device ", lease->device,
                                                     ", but the request's other buffers are on device ", device,
                                                     " (one request runs on one GPU)"));
    }
    device = lease->device;
    absl::StatusOr<uint64_t> span = TensorSpanBytes(u.field, s.batch, u.seq, u.heads, s.head_dim, u.src->strides,
                                                    DTypeBytes(job.problem.dtype));
    if (!span.ok()) return span.status();
    ATTND_RETURN_IF_ERROR(
        CheckInRegion(absl::StrCat(u.field, ".offset"), u.src->offset, *span, lease->byte_size));
    uint8_t* data = lease->data + u.src->offset;
    if (reinterpret_cast<uintptr_t>(data) % 16 != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          u.field, ".offset: the tensor starts at a device address that is not 16-byte aligned (the "
                   "registration's offset plus this offset must be a multiple of 16)"));
    }
    u.src->device_data = data;
    u.src->device = lease->device;
  }
  for (auto& [id, lease] : held) job.buffer_holds.push_back(std::move(lease.hold));
  return absl::OkStatus();
}

void Dispatcher::Submit(std::unique_ptr<ForwardJob> job, Reply reply) {
  absl::Status status = ResolveReferences(*job);
  if (!status.ok()) return reply(status, nullptr);
  ForwardJob* j = job.get();
  j->done = [j, reply](absl::Status s) {
    j->buffer_holds.clear();
    reply(std::move(s), j);
  };
  // Refused: the backend has dropped the job (and its `done`) without calling it.
  status = backend_->Submit(std::move(job));
  if (!status.ok()) reply(status, nullptr);
}

void Dispatcher::Dispatch(const v1::ForwardRequest& request, Transport transport, const CallInfo& call,
                          RequestBytes* bytes, Reply reply) {
  auto job = std::make_unique<ForwardJob>();
  const absl::Status prepared = Prepare(request, transport, call, job.get(), bytes);
  if (!prepared.ok()) return reply(prepared, nullptr);
  Submit(std::move(job), std::move(reply));
}

void Dispatcher::FillResponseHeader(const ForwardJob& job, v1::ForwardResponse* response) const {
  response->set_request_id(job.request_id);
  v1::Timing* t = response->mutable_timing();
  t->set_queue_us(job.timing.queue_us);
  t->set_h2d_us(job.timing.h2d_us);
  t->set_kernel_us(job.timing.kernel_us);
  t->set_d2h_us(job.timing.d2h_us);
  t->set_total_us(job.timing.total_us);
  response->set_backend(backend_->name());
  response->set_kernel(job.kernel);
  response->set_device(job.device);
}

}  // namespace attnd::server
