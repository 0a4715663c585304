#include "attnd/server/validation.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "attnd/proto/enums.h"
#include "attnd/server/status_util.h"

namespace attnd::server {
namespace {

constexpr size_t kMaxRequestIdBytes = 256;
constexpr size_t kCudaIpcHandleBytes = 64;
constexpr uint64_t kTensorRefAlignment = 16;

absl::Status Invalid(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
}

// a*b in uint64, or false on overflow.
bool MulU64(uint64_t a, uint64_t b, uint64_t* out) { return !__builtin_mul_overflow(a, b, out); }

// Product of the dims (all already >= 1) times `elem_bytes`, or false on overflow past int64 range: the
// kernels index with int64, so a tensor must stay addressable as one.
bool TensorBytes(std::initializer_list<int64_t> dims, uint64_t elem_bytes, uint64_t* out) {
  uint64_t n = elem_bytes;
  for (int64_t d : dims) {
    if (!MulU64(n, static_cast<uint64_t>(d), &n)) return false;
  }
  if (n > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
  *out = n;
  return true;
}

absl::Status CheckDim(absl::string_view name, int64_t value) {
  if (value < 1) return Invalid(absl::StrCat("shape.", name), absl::StrCat("must be >= 1, got ", value));
  return absl::OkStatus();
}

// RESOURCE_EXHAUSTED rather than INVALID_ARGUMENT: the shape is well-formed and another server (or this one
// with other flags) would run it; the refusal is this server's policy, as with --max_request_bytes.
absl::Status CheckLimit(absl::string_view name, int64_t value, int64_t limit, absl::string_view flag) {
  if (limit <= 0 || value <= limit) return absl::OkStatus();
  return absl::ResourceExhaustedError(
      absl::StrCat("shape.", name, ": ", value, " exceeds the server limit --", flag, "=", limit));
}

absl::Status CheckRef(absl::string_view field, const v1::TensorRef& ref) {
  if (ref.buffer_id().empty()) return Invalid(absl::StrCat(field, ".buffer_id"), "empty");
  if (ref.offset() % kTensorRefAlignment != 0) {
    return Invalid(absl::StrCat(field, ".offset"),
                   absl::StrCat(ref.offset(), " is not a multiple of ", kTensorRefAlignment, " bytes"));
  }
  if (ref.strides_size() != 0 && ref.strides_size() != 3) {
    return Invalid(absl::StrCat(field, ".strides"),
                   absl::StrCat("expected 0 or 3 entries (batch, seq, head), got ", ref.strides_size()));
  }
  for (int i = 0; i < ref.strides_size(); ++i) {
    if (ref.strides(i) < 1) {
      return Invalid(absl::StrCat(field, ".strides[", i, "]"), absl::StrCat("must be >= 1, got ", ref.strides(i)));
    }
  }
  return absl::OkStatus();
}

Strides RefStrides(const v1::TensorRef& ref, const Strides& contiguous) {
  if (ref.strides_size() != 3) return contiguous;
  return Strides{ref.strides(0), ref.strides(1), ref.strides(2)};
}

// One input tensor (q, k or v): present, inline of the right size or a well-formed reference.
absl::Status CheckInput(absl::string_view name, bool present, const v1::TensorInput& in, uint64_t expected,
                        absl::string_view dims, Transport transport, const Strides& contiguous,
                        const InlineBytes* in_message, TensorSource* source) {
  source->strides = contiguous;
  if (in_message != nullptr && in_message->present) {  // `data`, left in the message's slices
    if (in_message->size != expected) {
      return Invalid(absl::StrCat(name, ".data"),
                     absl::StrCat(in_message->size, " bytes, expected ", expected, " (", dims, ")"));
    }
    source->pieces = in_message->pieces;
    source->host_bytes = expected;
    return absl::OkStatus();
  }
  const bool has_source = present && in.source_case() != v1::TensorInput::SOURCE_NOT_SET;
  if (transport == Transport::kStream) {
    // Inline bytes of a stream arrive as chunks; the header may only carry references.
    if (has_source && in.source_case() == v1::TensorInput::kData) {
      return Invalid(absl::StrCat(name, ".data"),
                     "inline bytes are not allowed in a ForwardStream header; send them as chunks");
    }
  } else if (!has_source) {
    return Invalid(name, "missing (set data or ref)");
  }
  if (!has_source) return absl::OkStatus();
  if (in.source_case() == v1::TensorInput::kRef) {
    ATTND_RETURN_IF_ERROR(CheckRef(absl::StrCat(name, ".ref"), in.ref()));
    source->buffer_id = in.ref().buffer_id();
    source->offset = in.ref().offset();
    source->strides = RefStrides(in.ref(), contiguous);
    return absl::OkStatus();
  }
  if (in.data().size() != expected) {
    return Invalid(absl::StrCat(name, ".data"),
                   absl::StrCat(in.data().size(), " bytes, expected ", expected, " (", dims, ")"));
  }
  source->host = reinterpret_cast<const uint8_t*>(in.data().data());
  source->host_bytes = expected;
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateForwardRequest(const v1::ForwardRequest& req, Transport transport,
                                    const ValidationLimits& limits, ForwardJob* job, RequestBytes* bytes,
                                    const InlineBytes* in_message) {
  if (req.request_id().size() > kMaxRequestIdBytes) {
    return Invalid("request_id", absl::StrCat(req.request_id().size(), " bytes, at most ", kMaxRequestIdBytes));
  }
  job->request_id = req.request_id();

  if (!req.has_shape()) return Invalid("shape", "missing");
  const v1::AttentionShape& sh = req.shape();
  ATTND_RETURN_IF_ERROR(CheckDim("batch", sh.batch()));
  ATTND_RETURN_IF_ERROR(CheckDim("q_len", sh.q_len()));
  ATTND_RETURN_IF_ERROR(CheckDim("kv_len", sh.kv_len()));
  ATTND_RETURN_IF_ERROR(CheckDim("q_heads", sh.q_heads()));
  ATTND_RETURN_IF_ERROR(CheckDim("kv_heads", sh.kv_heads()));
  ATTND_RETURN_IF_ERROR(CheckDim("head_dim", sh.head_dim()));
  if (sh.q_heads() % sh.kv_heads() != 0) {
    return Invalid("shape.q_heads",
                   absl::StrCat(sh.q_heads(), " is not a multiple of shape.kv_heads (", sh.kv_heads(), ")"));
  }
  const auto& hds = limits.supported_head_dims;
  if (std::find(hds.begin(), hds.end(), sh.head_dim()) == hds.end()) {
    return Invalid("shape.head_dim",
                   absl::StrCat(sh.head_dim(), " is not supported (supported: ", absl::StrJoin(hds, ", "), ")"));
  }

  const absl::StatusOr<DType> dtype_or = proto::DtypeFromProto(req.dtype(), "dtype");
  if (!dtype_or.ok()) return dtype_or.status();
  const DType dtype = *dtype_or;
  const auto& dts = limits.supported_dtypes;
  if (std::find(dts.begin(), dts.end(), dtype) == dts.end()) {
    return Invalid("dtype", absl::StrCat(v1::Dtype_Name(req.dtype()), " is not supported by this backend"));
  }
  const absl::StatusOr<Mask> mask_or = proto::MaskFromProto(req.mask(), "mask");
  if (!mask_or.ok()) return mask_or.status();
  const Mask mask = *mask_or;

  float scale = DefaultScale(sh.head_dim());
  if (req.has_softmax_scale()) {
    scale = req.softmax_scale();
    if (!std::isfinite(scale)) return Invalid("softmax_scale", absl::StrCat(scale, " is not finite"));
  }

  // Sizes: each tensor and then their sum, all overflow-checked.
  const uint64_t eb = static_cast<uint64_t>(DTypeBytes(dtype));
  RequestBytes b;
  if (!TensorBytes({sh.batch(), sh.q_len(), sh.q_heads(), sh.head_dim()}, eb, &b.q)) {
    return Invalid("shape", "Q size overflows (batch * q_len * q_heads * head_dim is too large)");
  }
  if (!TensorBytes({sh.batch(), sh.kv_len(), sh.kv_heads(), sh.head_dim()}, eb, &b.k)) {
    return Invalid("shape", "K/V size overflows (batch * kv_len * kv_heads * head_dim is too large)");
  }
  b.v = b.k;
  b.o = b.q;
  if (req.return_lse() && !TensorBytes({sh.batch(), sh.q_heads(), sh.q_len()}, sizeof(float), &b.lse)) {
    return Invalid("shape", "LSE size overflows");
  }
  uint64_t total = 0;
  for (uint64_t part : {b.q, b.k, b.v, b.o, b.lse}) {
    if (__builtin_add_overflow(total, part, &total)) return Invalid("shape", "request size overflows");
  }
  // After the overflow checks (a shape no server could address is INVALID_ARGUMENT, whatever the flags) and
  // before the byte limit, whose message cannot say which dimension to shrink.
  ATTND_RETURN_IF_ERROR(CheckLimit("batch", sh.batch(), limits.max_batch, "max_batch"));
  ATTND_RETURN_IF_ERROR(CheckLimit("q_len", sh.q_len(), limits.max_q_len, "max_q_len"));
  ATTND_RETURN_IF_ERROR(CheckLimit("kv_len", sh.kv_len(), limits.max_kv_len, "max_kv_len"));
  ATTND_RETURN_IF_ERROR(CheckLimit("q_heads", sh.q_heads(), limits.max_heads, "max_heads"));
  if (total > limits.max_request_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("shape: the request needs ", total,
                                                     " bytes (Q+K+V+O+LSE), over the server's limit of ",
                                                     limits.max_request_bytes, " (--max_request_bytes)"));
  }
  if (transport == Transport::kUnary) {
    // What the two messages carry: a tensor given by reference travels as its buffer id, not as its bytes.
    const auto inline_bytes = [](bool present, const v1::TensorInput& t, uint64_t bytes) -> uint64_t {
      return present && t.source_case() == v1::TensorInput::kRef ? 0 : bytes;
    };
    const uint64_t reply = (req.has_o_ref() ? 0 : b.o) + b.lse;
    const uint64_t in = inline_bytes(req.has_q(), req.q(), b.q) + inline_bytes(req.has_k(), req.k(), b.k) +
                        inline_bytes(req.has_v(), req.v(), b.v);
    if (in + kMessageOverheadBytes > limits.max_message_bytes ||
        reply + kMessageOverheadBytes > limits.max_message_bytes) {
      return absl::ResourceExhaustedError(
          absl::StrCat("shape: tensors of ", std::max(in, reply), " bytes do not fit one message of ",
                       limits.max_message_bytes, " bytes (--max_message_bytes); use ForwardStream"));
    }
  }

  Problem& p = job->problem;
  p.shape = Shape{sh.batch(), sh.q_len(), sh.kv_len(), sh.q_heads(), sh.kv_heads(), sh.head_dim()};
  p.dtype = dtype;
  p.mask = mask;
  p.scale = scale;
  p.want_lse = req.return_lse();
  const Layout contiguous = ContiguousLayout(p.shape);
  const char* dt = DTypeName(dtype);
  const auto message_part = [in_message](int i) { return in_message == nullptr ? nullptr : &in_message[i]; };
  ATTND_RETURN_IF_ERROR(CheckInput("q", req.has_q(), req.q(), b.q,
                                   absl::StrCat("batch*q_len*q_heads*head_dim ", dt), transport, contiguous.q,
                                   message_part(0), &job->q));
  ATTND_RETURN_IF_ERROR(CheckInput("k", req.has_k(), req.k(), b.k,
                                   absl::StrCat("batch*kv_len*kv_heads*head_dim ", dt), transport, contiguous.k,
                                   message_part(1), &job->k));
  ATTND_RETURN_IF_ERROR(CheckInput("v", req.has_v(), req.v(), b.v,
                                   absl::StrCat("batch*kv_len*kv_heads*head_dim ", dt), transport, contiguous.v,
                                   message_part(2), &job->v));
  job->o_to_buffer = req.has_o_ref();
  job->o_ref.strides = contiguous.o;
  if (job->o_to_buffer) {
    ATTND_RETURN_IF_ERROR(CheckRef("o_ref", req.o_ref()));
    job->o_ref.buffer_id = req.o_ref().buffer_id();
    job->o_ref.offset = req.o_ref().offset();
    job->o_ref.strides = RefStrides(req.o_ref(), contiguous.o);
  }
  *bytes = b;
  return absl::OkStatus();
}

absl::Status ValidateRegisterCudaBuffer(const v1::RegisterCudaBufferRequest& req) {
  if (req.ipc_handle().size() != kCudaIpcHandleBytes) {
    return Invalid("ipc_handle", absl::StrCat(req.ipc_handle().size(), " bytes, expected ", kCudaIpcHandleBytes));
  }
  if (req.device() < 0) return Invalid("device", absl::StrCat("must be >= 0, got ", req.device()));
  if (req.byte_size() == 0) return Invalid("byte_size", "must be > 0");
  uint64_t end;
  if (__builtin_add_overflow(req.offset(), req.byte_size(), &end)) {
    return Invalid("offset", "offset + byte_size overflows");
  }
  return absl::OkStatus();
}

}  // namespace attnd::server
