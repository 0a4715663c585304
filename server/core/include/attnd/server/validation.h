// Turns a forward's arguments (a Forward, the header of a ForwardStream, a shared-memory Forward) into a
// ForwardJob, or an error whose message starts with the offending field: "shape.head_dim: 96 is not supported
// (supported: 64, 128, 256)".
// Sizes are uint64 and every product is overflow-checked, so no request can wrap an allocation size.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "attnd/server/backend.h"
#include "attnd/server/requests.h"

namespace attnd::server {

// Byte sizes of one request's tensors.
struct RequestBytes {
  uint64_t q = 0, k = 0, v = 0, o = 0, lse = 0;
  uint64_t total() const { return q + k + v + o + lse; }  // cannot wrap: checked by ValidateForward
};

struct ValidationLimits {
  uint64_t max_request_bytes = 1ull << 32;    // Q+K+V+O(+LSE) -> RESOURCE_EXHAUSTED beyond
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

// Validates `args` and fills job->{request_id, problem, q, k, v, o_to_buffer, o_ref}. Inline tensors point
// where the arguments' do (the message must outlive the job); with call.inputs_follow they are left empty
// (their chunks come later) and inline bytes in the request are an error; call.message_limit bounds the inline
// tensors and the reply. INVALID_ARGUMENT naming the field for bad input; RESOURCE_EXHAUSTED when the request
// exceeds a limit.
absl::Status ValidateForward(const ForwardArgs& args, const CallInfo& call, const ValidationLimits& limits,
                             ForwardJob* job, RequestBytes* bytes);

// Points `source` at an inline tensor's bytes, contiguous or in pieces (their size already checked).
void BindInline(const TensorArg& in, TensorSource* source);

}  // namespace attnd::server
