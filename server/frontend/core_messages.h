// The frontends' one translation between the API's messages (attnd.v1) and the core's types (requests.h): the
// gRPC service and the shared-memory listener decode a request into the core's arguments here and encode the
// core's answers here, so the core never sees protobuf. The arguments view the message (its ids, its inline
// bytes): the message must outlive them.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "attnd/server/backend.h"
#include "attnd/server/requests.h"
#include "attnd/server/sequences.h"
#include "attnd/transport/zero_copy.h"
#include "attnd/v1/attention.pb.h"

namespace attnd::server {

// INVALID_ARGUMENT naming "dtype" or "mask" for a value the core has no type for. `in_message`: q, k and v as
// ReadForwardRequest left them in the message's slices (an array of three; null: none).
absl::Status ForwardArgsFromProto(const v1::ForwardRequest& request, const InlineBytes* in_message,
                                  ForwardArgs* args);
StepArgs StepArgsFromProto(const v1::StepRequest& request);
absl::StatusOr<OpenArgs> OpenArgsFromProto(const v1::OpenSequenceRequest& request);
// An import's header (its fields named "sequence.*" in errors), and an export's.
absl::StatusOr<ImportArgs> ImportArgsFromProto(const v1::SequenceHeader& header);
v1::SequenceHeader SequenceHeaderToProto(const MovingSequence& m);

// The reply's header fields (request_id, timing, backend, kernel, device) from a finished job.
void FillForwardReply(const ForwardJob& job, absl::string_view backend, v1::ForwardResponse* response);
// request_id, timing, backend, kernel, device and the new lengths of a finished step (not o/lse).
void FillStepReply(const StepJob& job, absl::string_view backend, v1::StepResponse* response);

v1::SequenceInfo SequenceInfoToProto(const SequenceState& state);
v1::SequenceLimits SequenceLimitsToProto(const SequenceOptions& options);
v1::SequenceStats SequenceStatsToProto(const SequenceCounts& counts);

// RegisterCudaBuffer's field checks, before the registry sees the handle.
absl::Status ValidateRegisterCudaBuffer(const v1::RegisterCudaBufferRequest& request);

}  // namespace attnd::server
