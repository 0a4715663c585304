// The requests the core serves, in its own types. A frontend (the gRPC service, the shared-memory listener)
// decodes its message into one of these and encodes the reply from what the core returns; the core never sees a
// protobuf message. The arguments view the decoded message's bytes (inline tensors, ids) without copying them:
// the message must outlive the call, as long as the job that reads its tensors (until the reply).
//
// Field names in the core's error messages are the API's ("shape.head_dim", "q.ref.strides[1]"), since the
// caller reads them against the message it sent.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "attnd/problem.h"
#include "attnd/server/step.h"

namespace attnd::server {

// A registered buffer region named by a request (the buffer registry resolves it to device memory).
struct TensorRefArg {
  absl::string_view buffer_id;
  uint64_t offset = 0;                // bytes into the registered region
  absl::Span<const int64_t> strides;  // element strides (batch, seq, head) when given; empty: contiguous
};

// One tensor of a request as the caller sent it.
struct TensorArg {
  enum class Source {
    kAbsent,  // the request does not name the tensor
    kUnset,   // named, with neither bytes nor a reference
    kData,    // inline bytes, contiguous in `data`
    kPieces,  // inline bytes left where the frontend received them, `pieces` in order, `pieces_bytes` in all
    kRef,     // a registered buffer, `ref`
  };
  Source source = Source::kAbsent;
  absl::string_view data;
  absl::Span<const absl::Span<const uint8_t>> pieces;
  uint64_t pieces_bytes = 0;
  TensorRefArg ref;

  bool present() const { return source != Source::kAbsent; }
  bool is_ref() const { return source == Source::kRef; }
  bool is_inline() const { return source == Source::kData || source == Source::kPieces; }
  uint64_t inline_bytes() const { return source == Source::kPieces ? pieces_bytes : data.size(); }
};

// One attention forward (Forward, ForwardStream's header, a shared-memory Forward).
struct ForwardArgs {
  absl::string_view request_id;
  std::optional<Shape> shape;
  DType dtype = DType::kBF16;
  Mask mask = Mask::kNone;
  std::optional<float> softmax_scale;  // unset: 1/sqrt(head_dim)
  bool return_lse = false;
  TensorArg q, k, v;
  std::optional<TensorRefArg> o_ref;   // O into this buffer instead of the reply
  // Float8 only (dtype kFP8E4M3), as sent: 1 value or one per head (q_heads, kv_heads, kv_heads).
  absl::Span<const float> q_descale, k_descale, v_descale;
};

// One sequence of a step and the tokens it brings.
struct SequenceTokensArg {
  absl::string_view sequence_id;
  int64_t tokens = 0;
};

// One step over KV sequences (docs/sequences.md).
struct StepArgs {
  absl::string_view request_id;
  int64_t layer = 0;
  int64_t q_heads = 0;
  std::optional<float> softmax_scale;
  bool return_lse = false;
  std::vector<SequenceTokensArg> sequences;
  TensorArg q, k, v;
  std::optional<TensorRefArg> o_ref;
  bool stream_ordered = false;  // the caller's stream gates the step (CallInfo::ready waits for it)
};

// OpenSequence: `count` sequences of one shape. Dimensions stay int64 as sent, so that range checks see them.
struct OpenArgs {
  int64_t layers = 0, kv_heads = 0, head_dim = 0;
  DType dtype = DType::kBF16;
  int64_t max_tokens = 0;  // 0: the server's limit
  uint32_t count = 0;      // 0 means 1
  KvFormat kv_format = KvFormat::kAsDtype;
  // Float8 only: layers x kv_heads descales (layer-major), layers (one per layer) or one for all; each finite, > 0.
  std::vector<float> k_descale, v_descale;
};

// ImportSequence's header: the shape and limit as an open's, and the tokens cached per layer.
struct ImportArgs {
  OpenArgs open;
  std::vector<int64_t> lengths;
};

struct OpenedSequences {
  std::vector<std::string> sequence_ids;
  int64_t max_tokens = 0;  // the limit that applies
  int page_tokens = 0;
};

// GetSequence's answer.
struct SequenceState {
  std::string sequence_id;
  SequenceShape shape;
  int64_t max_tokens = 0;
  std::vector<int64_t> lengths;  // cached tokens per layer
  int64_t pages = 0, shared_pages = 0;
  double idle_s = 0;
  bool step_in_flight = false;
};

// What the sequences hold and have done (GetStats).
struct SequenceCounts {
  uint64_t open = 0, pages_used = 0, pages_free = 0, pools = 0, steps = 0, launches = 0, expired = 0;
};

// What a frontend knows about one call besides its arguments.
struct CallInfo {
  absl::Time accepted;                            // when the frontend took the request (queue time starts here)
  absl::Time deadline = absl::InfiniteFuture();   // the shm channel carries none: the caller's wait bounds it
  std::function<bool()> cancelled;                // true once the caller went away; may be empty
  std::function<absl::Status()> admit;            // the frontend's own admission check (gRPC: calls per connection)
  // Steps: called once the step is admitted and its references resolved, before it joins a launch; blocks until
  // its inputs may be read (the shm channel: a stream-ordered step's wait word). Not OK: refused, nothing done.
  std::function<absl::Status()> ready;
  // Steps: the caller may send a sequence's next step before the last one's reply (the shm channel's stream-ordered
  // steps, two channels a stream). Such a step is admitted behind the step in flight (against the lengths that
  // step leaves, at most one waiting behind another) and launched once that step has ended; it fails if that
  // step fails. Without it, a step for a sequence with a step in flight is ABORTED.
  bool chain = false;
  // Steps whose order on the caller's stream the device keeps (the shm channel's StreamOrder.device; instead of
  // `ready`): the step runs alone, its stream waits for the caller's word and writes the value to the channel's
  // done word (StepJob::device_order, device addresses from Backend::MapHostMemory). A step admitted behind
  // another launches once that one's GPU work is queued. `outcome`, asked when the step ends: not OK when the
  // frontend had to release the wait itself (the caller's stream never got there, or the caller left); the step
  // then fails with it.
  struct DeviceOrder {
    uint64_t wait_word = 0, done_word = 0, value = 0;
    std::function<absl::Status()> outcome;
  };
  std::optional<DeviceOrder> device_order;
  // How the tensors travel. Inline tensors follow the request (a stream's chunks): it may carry references only.
  bool inputs_follow = false;
  // The request and its reply each travel as one message of at most this many bytes, framing included (gRPC's
  // unary calls); 0: no such bound (a stream's chunks, caller-sized shared-memory areas).
  uint64_t message_limit = 0;
};

// Bytes of gRPC/protobuf framing allowed for next to the tensor bytes when checking CallInfo::message_limit.
inline constexpr uint64_t kMessageOverheadBytes = 64 * 1024;

}  // namespace attnd::server
