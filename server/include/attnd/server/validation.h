// Turns a ForwardRequest (unary, or the header of a ForwardStream) into a ForwardJob, or an error whose
// message starts with the offending field: "shape.head_dim: 96 is not supported (supported: 64, 128, 256)".
// Sizes are uint64 and every product is overflow-checked, so no request can wrap an allocation size.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "attnd/server/backend.h"
#include "attnd/v1/attention.pb.h"
#include "attnd/transport/zero_copy.h"

namespace attnd::server {

// Byte sizes of one request's tensors.
struct RequestBytes {
  uint64_t q = 0, k = 0, v = 0, o = 0, lse = 0;
  uint64_t total() const { return q + k + v + o + lse; }  // cannot wrap: checked by ValidateForwardRequest
};

// How the tensors travel: inline in one gRPC message, as chunks after a stream header, or inline in a shm
// channel (the same-host shared-memory channel), whose areas the caller sized: bounded by --max_request_bytes
// (and the channel's --shm_max_bytes), not by gRPC's message limit.
enum class Transport { kUnary, kStream, kShm };

struct ValidationLimits {
  uint64_t max_request_bytes = 1ull << 32;    // Q+K+V+O(+LSE) -> RESOURCE_EXHAUSTED beyond
  uint64_t max_message_bytes = 256ull << 20;  // a unary request or reply must fit one message
  std::vector<int64_t> supported_head_dims;   // from the backend
  std::vector<DType> supported_dtypes;        // from the backend
  // Shape limits (--max_batch, --max_q_len, --max_kv_len, --max_heads); 0: none beyond what the byte limits
  // imply. The byte limits alone let one client send, say, q_len 2M with one head, which costs quadratic
  // time and work buffers sized by the sequence; these bound each dimension on its own.
  int64_t max_batch = 0;
  int64_t max_q_len = 0;
  int64_t max_kv_len = 0;
  int64_t max_heads = 0;  // of shape.q_heads (kv_heads <= q_heads follows)
};

// Bytes of gRPC/protobuf framing allowed for next to the tensor bytes when checking the message limit.
inline constexpr uint64_t kMessageOverheadBytes = 64 * 1024;

// Validates `request` and fills job->{request_id, problem, q, k, v, o_to_buffer, o_ref}. For kUnary inline
// tensors point into `request` (which must outlive the job), or, for those ReadForwardRequest left in the
// message (`in_message`, q/k/v; null: none), into the message's slices (which must outlive the job); for
// kStream inline tensors are left empty (their chunks come later) and inline bytes in the header are an
// error. INVALID_ARGUMENT naming the field for bad input; RESOURCE_EXHAUSTED when the request exceeds a limit.
absl::Status ValidateForwardRequest(const v1::ForwardRequest& request, Transport transport,
                                    const ValidationLimits& limits, ForwardJob* job, RequestBytes* bytes,
                                    const InlineBytes* in_message = nullptr);

// Field-level checks shared with RegisterCudaBuffer.
absl::Status ValidateRegisterCudaBuffer(const v1::RegisterCudaBufferRequest& request);

}  // namespace attnd::server
