#include "attnd/server/dispatcher.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "attnd/server/status_util.h"

namespace attnd::server {

absl::Status Dispatcher::Prepare(const ForwardArgs& request, const CallInfo& call, ForwardJob* job,
                                 RequestBytes* bytes) const {
  if (shutting_down_.load()) return absl::UnavailableError("the server is shutting down");
  if (call.admit) ATTND_RETURN_IF_ERROR(call.admit());
  job->accepted = call.accepted;
  ATTND_RETURN_IF_ERROR(ValidateForward(request, call, limits_, job, bytes));
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
absl::Status ResolveTensorReferences(const BufferRegistry* buffers, absl::Span<TensorUse> uses, int64_t head_dim,
                                     DType dtype, std::vector<std::shared_ptr<const void>>* holds) {
  std::vector<std::pair<std::string, BufferLease>> held;
  int device = -1;
  for (TensorUse& u : uses) {
    if (buffers == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(u.field, ": CUDA IPC is not enabled (--enable_cuda_ipc)"));
    }
    const BufferLease* lease = nullptr;
    for (const auto& [id, l] : held) {
      if (id == u.src->buffer_id) lease = &l;
    }
    if (lease == nullptr) {
      absl::StatusOr<BufferLease> acquired = buffers->Acquire(u.field, u.src->buffer_id);
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
    absl::StatusOr<uint64_t> span =
        TensorSpanBytes(u.field, u.batch, u.seq, u.heads, head_dim, u.src->strides,
                        DTypeBytes(u.output ? OutputDType(dtype) : dtype));
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
  for (auto& [id, lease] : held) holds->push_back(std::move(lease.hold));
  return absl::OkStatus();
}

absl::Status Dispatcher::ResolveReferences(ForwardJob& job) const {
  const Shape& s = job.problem.shape;
  std::vector<TensorUse> uses;
  if (job.q.is_reference()) uses.push_back({"q.ref", &job.q, s.batch, s.q_len, s.q_heads});
  if (job.k.is_reference()) uses.push_back({"k.ref", &job.k, s.batch, s.kv_len, s.kv_heads});
  if (job.v.is_reference()) uses.push_back({"v.ref", &job.v, s.batch, s.kv_len, s.kv_heads});
  if (job.o_to_buffer) uses.push_back({"o_ref", &job.o_ref, s.batch, s.q_len, s.q_heads, true});
  if (uses.empty()) return absl::OkStatus();
  return ResolveTensorReferences(buffers_, absl::MakeSpan(uses), s.head_dim, job.problem.dtype, &job.buffer_holds);
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

void Dispatcher::Dispatch(const ForwardArgs& request, const CallInfo& call, RequestBytes* bytes, Reply reply) {
  auto job = std::make_unique<ForwardJob>();
  const absl::Status prepared = Prepare(request, call, job.get(), bytes);
  if (!prepared.ok()) return reply(prepared, nullptr);
  Submit(std::move(job), std::move(reply));
}

}  // namespace attnd::server
