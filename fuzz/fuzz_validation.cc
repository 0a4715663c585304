// A request's way to the backend on whatever a client's bytes parse to: the frontends' decoding
// (ForwardArgsFromProto, server/frontend/core_messages.cc), then the core's ValidateForward (server/core/src/validation.cc),
// as protobuf parses the bytes for each way a request arrives (a unary message, a stream header, a shm channel),
// and as the zero-copy reader leaves them (unary, tensors in the message's slices). A request it accepts must be one the backends can run without another
// check: every dimension >= 1, sizes that are the shape's (recomputed here in 128 bits), under the limits, and
// inline bytes that are exactly the tensor.
// Input: the limits (from the end), then the message.
#include <cstdint>
#include <string>
#include <vector>

#include "attnd/server/validation.h"
#include "attnd/transport/zero_copy.h"
#include "attnd/v1/attention.pb.h"
#include "core_messages.h"
#include "fuzz_util.h"

namespace {

using attnd::DType;
using attnd::server::ForwardJob;
using attnd::server::RequestBytes;
using attnd::server::ValidationLimits;
using u128 = unsigned __int128;

u128 Product(std::initializer_list<int64_t> dims, u128 elem) {
  u128 n = elem;
  for (int64_t d : dims) n *= static_cast<u128>(d);
  return n;
}

void CheckInline(const attnd::server::TensorSource& t, uint64_t expected) {
  if (t.is_reference()) return;
  if (t.host == nullptr && t.pieces.empty()) return;  // a stream's: the chunks come later
  ATTND_FUZZ_CHECK(t.host_bytes == expected);
  if (t.host == nullptr) {
    uint64_t sum = 0;
    for (const auto& p : t.pieces) sum += p.size();
    ATTND_FUZZ_CHECK(sum == expected);
  }
}

// How a request arrives: in one gRPC message (bounded by max_message_bytes), as a ForwardStream header (its
// inline tensors follow as chunks) or in a shared-memory channel's areas.
enum class Via { kUnary, kStream, kShm };

void Validate(const attnd::v1::ForwardRequest& req, Via via, const ValidationLimits& limits,
              uint64_t max_message_bytes, const attnd::InlineBytes* in_message) {
  ForwardJob job;
  RequestBytes b;
  attnd::server::ForwardArgs args;
  attnd::server::CallInfo call;
  call.inputs_follow = via == Via::kStream;
  call.message_limit = via == Via::kUnary ? max_message_bytes : 0;
  absl::Status s = attnd::server::ForwardArgsFromProto(req, in_message, &args);
  if (s.ok()) s = attnd::server::ValidateForward(args, call, limits, &job, &b);
  if (!s.ok()) {
    ATTND_FUZZ_CHECK(absl::IsInvalidArgument(s) || absl::IsResourceExhausted(s));
    ATTND_FUZZ_CHECK(!s.message().empty());
    return;
  }
  const auto& sh = req.shape();
  for (int64_t d : {sh.batch(), sh.q_len(), sh.kv_len(), sh.q_heads(), sh.kv_heads(), sh.head_dim()}) {
    ATTND_FUZZ_CHECK(d >= 1);
  }
  ATTND_FUZZ_CHECK(sh.q_heads() % sh.kv_heads() == 0);
  const u128 eb = req.dtype() == attnd::v1::DTYPE_FP16 || req.dtype() == attnd::v1::DTYPE_BF16 ? 2 : 0;
  ATTND_FUZZ_CHECK(eb == 2);
  // A mask that passed is a real one: an unset or unknown mask is refused, never read as "none".
  ATTND_FUZZ_CHECK(attnd::v1::MaskType_IsValid(req.mask()) && req.mask() != attnd::v1::MASK_TYPE_UNSPECIFIED);
  ATTND_FUZZ_CHECK(b.q == Product({sh.batch(), sh.q_len(), sh.q_heads(), sh.head_dim()}, eb));
  ATTND_FUZZ_CHECK(b.k == Product({sh.batch(), sh.kv_len(), sh.kv_heads(), sh.head_dim()}, eb));
  ATTND_FUZZ_CHECK(b.v == b.k && b.o == b.q);
  ATTND_FUZZ_CHECK(b.lse == (req.return_lse() ? Product({sh.batch(), sh.q_heads(), sh.q_len()}, 4) : 0));
  const u128 total = u128{b.q} + b.k + b.v + b.o + b.lse;
  ATTND_FUZZ_CHECK(total <= limits.max_request_bytes);
  if (via == Via::kUnary) {
    // Each message holds what it carries inline; a tensor by reference travels as its buffer id.
    const auto carried = [](const attnd::server::TensorSource& t, uint64_t bytes) -> u128 {
      return t.is_reference() ? 0 : bytes;
    };
    const u128 in = carried(job.q, b.q) + carried(job.k, b.k) + carried(job.v, b.v);
    const u128 reply = u128{req.has_o_ref() ? 0 : b.o} + b.lse;
    ATTND_FUZZ_CHECK(in + attnd::server::kMessageOverheadBytes <= max_message_bytes);
    ATTND_FUZZ_CHECK(reply + attnd::server::kMessageOverheadBytes <= max_message_bytes);
  }
  const std::pair<int64_t, int64_t> limited[] = {{limits.max_batch, sh.batch()}, {limits.max_q_len, sh.q_len()},
                                                 {limits.max_kv_len, sh.kv_len()}, {limits.max_heads, sh.q_heads()}};
  for (const auto& [limit, value] : limited) ATTND_FUZZ_CHECK(limit <= 0 || value <= limit);
  CheckInline(job.q, b.q);
  CheckInline(job.k, b.k);
  CheckInline(job.v, b.v);
  if (via != Via::kStream) {
    for (const auto* t : {&job.q, &job.k, &job.v}) {
      ATTND_FUZZ_CHECK(t->is_reference() || t->host != nullptr || !t->pieces.empty() || t->host_bytes == 0);
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  ValidationLimits limits;
  limits.max_request_bytes = in.ConsumeIntegralInRange<uint64_t>(0, uint64_t{1} << 34);
  // The server refuses to start with less than 4096 (a message limit of 0 would mean none).
  const uint64_t max_message_bytes = in.ConsumeIntegralInRange<uint64_t>(4096, uint64_t{1} << 30);
  const uint8_t pick = in.ConsumeIntegral<uint8_t>();
  for (int64_t hd : {64, 128, 256}) {
    if ((pick & (hd >> 6)) != 0 || (pick & 0x80) != 0) limits.supported_head_dims.push_back(hd);
  }
  if ((pick & 0x10) == 0) limits.supported_dtypes.push_back(DType::kBF16);
  if ((pick & 0x20) == 0) limits.supported_dtypes.push_back(DType::kFP16);
  limits.max_batch = in.ConsumeIntegralInRange<int64_t>(0, 64);
  limits.max_q_len = in.ConsumeIntegralInRange<int64_t>(0, 1 << 16);
  limits.max_kv_len = in.ConsumeIntegralInRange<int64_t>(0, 1 << 16);
  limits.max_heads = in.ConsumeIntegralInRange<int64_t>(0, 128);
  const std::string bytes = in.ConsumeRemainingBytesAsString();

  attnd::v1::ForwardRequest req;
  if (req.ParseFromString(bytes)) {
    for (Via via : {Via::kUnary, Via::kStream, Via::kShm}) Validate(req, via, limits, max_message_bytes, nullptr);
  }
  const grpc::Slice slice(bytes.data(), bytes.size());
  const grpc::ByteBuffer message(&slice, 1);
  std::vector<grpc::Slice> slices;
  attnd::v1::ForwardRequest header;
  attnd::InlineBytes tensors[3];
  if (attnd::ReadForwardRequest(message, &slices, &header, tensors)) {
    Validate(header, Via::kUnary, limits, max_message_bytes, tensors);
  }
  return 0;
}
