// KV-sequence steps whose tensors live in the caller's CUDA memory, ordered on the caller's CUDA stream
// (docs/sequences.md, "Steps from CUDA memory"). What a PyTorch engine does through the Python package, and a C++
// caller through this class:
//
//   auto steps = attnd::client::CudaSteps::Create(client.get());       // once per client, on the caller's context
//   auto batch = attnd::client::StepBatch({ids...}, /*tokens=*/1);    // once per set of sequences
//   batch.request().set_layer(l);                                       // per call: layer and device tensors
//   (*steps)->Step(batch, {q, k, v, o, q_bytes, kv_bytes}, stream);     // no wait for `stream` on the host
//   (*steps)->Submit(batch, {q, k, v, o, q_bytes, kv_bytes}, stream);   // nor for the step itself
//
// Memory: each tensor is named by the CUDA allocation it lies in (cuMemGetAddressRange) and its offset there. An
// allocation is registered with the server (RegisterCudaBuffer) the first time a tensor in it is stepped, and kept
// registered while its address range holds the same allocation (CU_POINTER_ATTRIBUTE_BUFFER_ID); a caching
// allocator such as torch's recycles a few large segments, so steady-state steps register nothing.
//
// Order: over the shared-memory channel (a step's transport kShm), each calling stream has a channel of its
// own, whose wait word (shm::Header::wait_word, host memory) this class registers with CUDA. A step is enqueued on
// the stream as a write of an increasing value into that word after the work already queued there, and sent at
// once with that value (StreamOrder); the server starts the step when the word holds it, so the caller never waits
// for its stream on the host. The reply comes after the step has run: work the caller queues afterwards sees O and
// the appended rows without any wait. Elsewhere (gRPC, or a server without ServerInfo.stream_ordered_steps) the
// stream is synchronised before the step is sent (host order).
//
// Submit returns before the step has run: the caller's stream then waits on a done word. Where the server offers
// it (ServerInfo.device_ordered_steps), the device keeps the order: the server's stream waits for the wait word on
// the GPU and writes the channel's done word (shm::Header::done_word) after the step's kernels, and a stream's steps
// alternate between two channels so that each is admitted and launched while the one before it runs; nothing
// between a step's producers and its consumers passes through a host. Otherwise the done word is in this process's
// memory and its sender thread writes it when the reply comes. Either way this process's sender writes it itself
// (after filling O with NaN) when the step failed or the server died, so a server's death cannot leave the stream
// waiting. Share the GPU through MPS: without it, each step whose caller ran GPU work since the last pays two
// switches between the processes' contexts (about 275 us on the H200).
//
// The driver API is loaded at run time (libcuda.so.1), so the library still builds and runs without CUDA.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "attnd/client/client.h"

namespace attnd::client {

// A batch of sequences stepped together many times: the StepRequest's sequence list is built once and reused across
// layers and steps; a call sets the layer (and q_heads) and the tensors.
class StepBatch {
 public:
  StepBatch(const std::vector<std::string>& sequence_ids, int64_t tokens);
  // Every sequence's rows per step (decode 1, a prefill chunk more): O(sequences), done only when it changes.
  void set_tokens(int64_t tokens);
  int64_t tokens() const { return tokens_; }
  int64_t size() const { return request_.sequences_size(); }
  int64_t rows() const { return tokens_ * size(); }
  v1::StepRequest& request() { return request_; }

 private:
  v1::StepRequest request_;
  int64_t tokens_ = 1;
};

// A step's tensors in the caller's device memory, contiguous, rows of the batch's sequences back to back: q and o
// [rows, q_heads, head_dim], k and v [rows, kv_heads, head_dim]. Null q and o: append only; null k and v: attend only.
struct DeviceStepTensors {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* o = nullptr;
  uint64_t q_bytes = 0;   // of q, and of o
  uint64_t kv_bytes = 0;  // of k, and of v
};

struct CudaStepsOptions {
  // Use host order even where the server offers stream order (for comparisons and tests).
  bool host_order = false;
  // Where the server offers it (ServerInfo.device_ordered_steps), let the device keep the order of submitted steps:
  // the server's stream waits for the caller's word and writes the done word the caller's stream waits on, and a
  // stream's steps alternate between two channels so that the next one is admitted while one runs. Off: the
  // server's host waits for the word and this process's sender writes the done word (for comparisons and tests).
  bool device_order = true;
  // Submitted steps a stream may have unanswered before Submit waits for the oldest: how far the caller's host
  // may run ahead of the server (an engine needs one layer ahead; a few absorb jitter).
  size_t max_steps_ahead = 4;
};

class CudaSteps {
 public:
  // The driver is loaded and the calling thread's current CUDA context taken (none: device 0's primary context,
  // the runtime's and torch's); FAILED_PRECONDITION without a driver. `client` must outlive this object.
  static absl::StatusOr<std::unique_ptr<CudaSteps>> Create(Client* client, const CudaStepsOptions& options = {});
  ~CudaSteps();
  CudaSteps(const CudaSteps&) = delete;
  CudaSteps& operator=(const CudaSteps&) = delete;

  // The registered buffer and offset of [ptr, ptr + bytes), registering its allocation when this is the first use
  // of it (INVALID_ARGUMENT when the range is not device memory of one allocation).
  absl::StatusOr<v1::TensorRef> Ref(const void* ptr, uint64_t bytes);
  // One step of `batch` at its request's layer, ordered on `stream` (a cudaStream_t; null: the legacy default
  // stream); returns after the step has run. The batch's request keeps the references afterwards (and no order).
  // Thread-safe; calls on one stream are sent in the order they are issued.
  absl::StatusOr<StepResult> Step(StepBatch& batch, const DeviceStepTensors& tensors, void* stream,
                                  const CallOptions& call = {});
  // The same step without waiting for it: returns once the step is queued to this stream's sender thread, and
  // work the caller queues on `stream` afterwards waits on the GPU (cuStreamWaitValue64 on a done word in this
  // process's host memory) until the step has been answered. So the caller's host runs ahead and queues its next
  // kernels while the step runs. A step that fails has its O filled with NaN before the stream goes on, steps
  // submitted behind it on the stream are not sent, and the failure is returned by the next Submit, Step or Sync
  // on the stream (which then does nothing else). The tensors must stay allocated until the stream passes the step
  // (stream-ordered reuse, as torch's caching allocator does, is fine). Host order (see StreamOrdered): as Step.
  absl::Status Submit(StepBatch& batch, const DeviceStepTensors& tensors, void* stream, const CallOptions& call = {});
  // Waits on the host until every step submitted on `stream` is answered; returns the first failure not yet
  // reported (OK when there is none).
  absl::Status Sync(void* stream);
  // Whether steps with transport kShm go stream-ordered (the client has a shm_socket, the server offers it, the
  // device can write host memory from a stream, host_order is off); asks the server once.
  absl::StatusOr<bool> StreamOrdered();
  // Registrations held (allocations named so far, live or not).
  size_t registered() const;

  class Impl;

 private:
  explicit CudaSteps(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace attnd::client
