// The one request path every transport calls (the gRPC service's Forward and ForwardStream, the shm listener):
// validate the request into a ForwardJob, let the backend accept it, resolve its buffer references, submit it,
// and reply exactly once with the finished job or the reason it was refused. A transport only decodes its
// messages, says what it knows about the call (CallInfo) and encodes the reply.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "attnd/server/backend.h"
#include "attnd/server/buffer_registry.h"
#include "attnd/server/requests.h"
#include "attnd/server/validation.h"

namespace attnd::server {

// A tensor of a request given by reference, and the [batch, seq, heads, head_dim] extent it must have.
struct TensorUse {
  const char* field;  // "q.ref", ... for the error messages
  TensorSource* src;
  int64_t batch, seq, heads;
  bool output = false;  // O, whose elements are OutputDType(dtype) (bf16 for float8 inputs)
};

// Resolves references to device memory: each buffer acquired once (its lease appended to *holds, kept until the
// reply), every tensor inside its region and 16-byte aligned, all on one device. `buffers` null: none enabled.
absl::Status ResolveTensorReferences(const BufferRegistry* buffers, absl::Span<TensorUse> uses, int64_t head_dim,
                                     DType dtype, std::vector<std::shared_ptr<const void>>* holds);

class Dispatcher {
 public:
  // Called exactly once per submitted job: on a backend thread with the finished job, or inline with a null job
  // when the request was refused before the backend took it.
  using Reply = std::function<void(absl::Status, ForwardJob*)>;

  // `buffers` may be null: requests naming registered buffers are then refused FAILED_PRECONDITION.
  Dispatcher(const ValidationLimits& limits, Backend* backend, const BufferRegistry* buffers)
      : limits_(limits), backend_(backend), buffers_(buffers) {}

  // Validation, the backend's acceptance and the deadline/cancel check of a request about to be submitted;
  // fills *job (but its inputs' InputSink) and *bytes.
  absl::Status Prepare(const ForwardArgs& request, const CallInfo& call, ForwardJob* job, RequestBytes* bytes) const;
  // Where a stream's inline inputs go as they arrive (Backend::OpenInputs), after Prepare.
  absl::StatusOr<std::unique_ptr<InputSink>> OpenInputs(const ForwardJob& job,
                                                        const uint64_t (&sizes)[InputSink::kTensors]) const {
    return backend_->OpenInputs(job, sizes);
  }
  // Resolves the job's buffer references (holding them until the reply) and hands it to the backend.
  void Submit(std::unique_ptr<ForwardJob> job, Reply reply);
  // Prepare and Submit for a request that arrived whole; *bytes gets its sizes (when it passes validation).
  void Dispatch(const ForwardArgs& request, const CallInfo& call, RequestBytes* bytes, Reply reply);

  // From here on new requests are answered UNAVAILABLE (those already accepted still complete).
  void BeginShutdown() { shutting_down_.store(true); }
  bool shutting_down() const { return shutting_down_.load(); }

  Backend* backend() const { return backend_; }
  const BufferRegistry* buffers() const { return buffers_; }
  const ValidationLimits& limits() const { return limits_; }

 private:
  absl::Status ResolveReferences(ForwardJob& job) const;

  const ValidationLimits limits_;
  Backend* const backend_;
  const BufferRegistry* const buffers_;
  std::atomic<bool> shutting_down_{false};
};

}  // namespace attnd::server
