#include "attnd/server/validation.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "attnd/server/status_util.h"

namespace attnd::server {
namespace {

constexpr size_t kMaxRequestIdBytes = 256;
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

absl::Status CheckRef(absl::string_view field, const TensorRefArg& ref) {
  if (ref.buffer_id.empty()) return Invalid(absl::StrCat(field, ".buffer_id"), "empty");
  if (ref.offset % kTensorRefAlignment != 0) {
    return Invalid(absl::StrCat(field, ".offset"),
                   absl::StrCat(ref.offset, " is not a multiple of ", kTensorRefAlignment, " bytes"));
  }
  if (!ref.strides.empty() && ref.strides.size() != 3) {
    return Invalid(absl::StrCat(field, ".strides"),
                   absl::StrCat("expected 0 or 3 entries (batch, seq, head), got ", ref.strides.size()));
  }
  for (size_t i = 0; i < ref.strides.size(); ++i) {
    if (ref.strides[i] < 1) {
      return Invalid(absl::StrCat(field, ".strides[", i, "]"), absl::StrCat("must be >= 1, got ", ref.strides[i]));
    }
  }
  return absl::OkStatus();
}

// A checked reference into `source`.
void BindRef(const TensorRefArg& ref, const Strides& contiguous, TensorSource* source) {
  source->buffer_id = std::string(ref.buffer_id);
  source->offset = ref.offset;
  source->strides = ref.strides.size() == 3 ? Strides{ref.strides[0], ref.strides[1], ref.strides[2]} : contiguous;
}

// One input tensor (q, k or v): present, inline of the right size or a well-formed reference.
absl::Status CheckInput(absl::string_view name, const TensorArg& in, uint64_t expected, absl::string_view dims,
                        bool inputs_follow, const Strides& contiguous, TensorSource* source) {
  source->strides = contiguous;
  const bool has_source = in.is_ref() || in.is_inline();
  if (inputs_follow) {
    // Inline bytes of a stream arrive as chunks; the header may only carry references.
    if (in.is_inline()) {
      return Invalid(absl::StrCat(name, ".data"),
                     "inline bytes are not allowed in a ForwardStream header; send them as chunks");
    }
  } else if (!has_source) {
    return Invalid(name, "missing (set data or ref)");
  }
  if (!has_source) return absl::OkStatus();
  if (in.is_ref()) {
    ATTND_RETURN_IF_ERROR(CheckRef(absl::StrCat(name, ".ref"), in.ref));
    BindRef(in.ref, contiguous, source);
    return absl::OkStatus();
  }
  if (in.inline_bytes() != expected) {
    return Invalid(absl::StrCat(name, ".data"),
                   absl::StrCat(in.inline_bytes(), " bytes, expected ", expected, " (", dims, ")"));
  }
  BindInline(in, source);
  return absl::OkStatus();
}

// The shape's dimensions, their ratio and the head_dim the backend runs.
absl::Status CheckShape(const std::optional<Shape>& shape, const ValidationLimits& limits) {
  if (!shape.has_value()) return Invalid("shape", "missing");
  const Shape& sh = *shape;
  ATTND_RETURN_IF_ERROR(CheckDim("batch", sh.batch));
  ATTND_RETURN_IF_ERROR(CheckDim("q_len", sh.q_len));
  ATTND_RETURN_IF_ERROR(CheckDim("kv_len", sh.kv_len));
  ATTND_RETURN_IF_ERROR(CheckDim("q_heads", sh.q_heads));
  ATTND_RETURN_IF_ERROR(CheckDim("kv_heads", sh.kv_heads));
  ATTND_RETURN_IF_ERROR(CheckDim("head_dim", sh.head_dim));
  if (sh.q_heads % sh.kv_heads != 0) {
    return Invalid("shape.q_heads",
                   absl::StrCat(sh.q_heads, " is not a multiple of shape.kv_heads (", sh.kv_heads, ")"));
  }
  const auto& hds = limits.supported_head_dims;
  if (std::find(hds.begin(), hds.end(), sh.head_dim) == hds.end()) {
    return Invalid("shape.head_dim",
                   absl::StrCat(sh.head_dim, " is not supported (supported: ", absl::StrJoin(hds, ", "), ")"));
  }
  return absl::OkStatus();
}

// Each tensor's bytes and their sum, all overflow-checked, then the server's shape and byte limits.
absl::Status SizeForward(const Shape& sh, DType dtype, bool lse, const ValidationLimits& limits, RequestBytes* out) {
  const uint64_t eb = static_cast<uint64_t>(DTypeBytes(dtype));
  RequestBytes b;
  if (!TensorBytes({sh.batch, sh.q_len, sh.q_heads, sh.head_dim}, eb, &b.q)) {
    return Invalid("shape", "Q size overflows (batch * q_len * q_heads * head_dim is too large)");
  }
  if (!TensorBytes({sh.batch, sh.kv_len, sh.kv_heads, sh.head_dim}, eb, &b.k)) {
    return Invalid("shape", "K/V size overflows (batch * kv_len * kv_heads * head_dim is too large)");
  }
  b.v = b.k;
  // O is Q's shape in OutputDType: twice Q's bytes for float8 inputs, so overflow-checked on its own.
  if (!TensorBytes({sh.batch, sh.q_len, sh.q_heads, sh.head_dim}, DTypeBytes(OutputDType(dtype)), &b.o)) {
    return Invalid("shape", "O size overflows (batch * q_len * q_heads * head_dim is too large)");
  }
  if (lse && !TensorBytes({sh.batch, sh.q_heads, sh.q_len}, sizeof(float), &b.lse)) {
    return Invalid("shape", "LSE size overflows");
  }
  uint64_t total = 0;
  for (uint64_t part : {b.q, b.k, b.v, b.o, b.lse}) {
    if (__builtin_add_overflow(total, part, &total)) return Invalid("shape", "request size overflows");
  }
  // After the overflow checks (a shape no server could address is INVALID_ARGUMENT, whatever the flags) and
  // before the byte limit, whose message cannot say which dimension to shrink.
  ATTND_RETURN_IF_ERROR(CheckLimit("batch", sh.batch, limits.max_batch, "max_batch"));
  ATTND_RETURN_IF_ERROR(CheckLimit("q_len", sh.q_len, limits.max_q_len, "max_q_len"));
  ATTND_RETURN_IF_ERROR(CheckLimit("kv_len", sh.kv_len, limits.max_kv_len, "max_kv_len"));
  ATTND_RETURN_IF_ERROR(CheckLimit("q_heads", sh.q_heads, limits.max_heads, "max_heads"));
  if (total > limits.max_request_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("shape: the request needs ", total,
                                                     " bytes (Q+K+V+O+LSE), over the server's limit of ",
                                                     limits.max_request_bytes, " (--max_request_bytes)"));
  }
  *out = b;
  return absl::OkStatus();
}

// What the request and reply messages carry, against call.message_limit: a tensor given by reference travels
// as its buffer id, not as its bytes.
absl::Status CheckMessages(const ForwardArgs& args, const RequestBytes& b, uint64_t message_limit) {
  if (message_limit == 0) return absl::OkStatus();
  const auto carried = [](const TensorArg& t, uint64_t bytes) -> uint64_t { return t.is_ref() ? 0 : bytes; };
  const uint64_t reply = (args.o_ref.has_value() ? 0 : b.o) + b.lse;
  const uint64_t in = carried(args.q, b.q) + carried(args.k, b.k) + carried(args.v, b.v);
  if (in + kMessageOverheadBytes > message_limit || reply + kMessageOverheadBytes > message_limit) {
    return absl::ResourceExhaustedError(absl::StrCat("shape: tensors of ", std::max(in, reply),
                                                     " bytes do not fit one message of ", message_limit,
                                                     " bytes (--max_message_bytes); use ForwardStream"));
  }
  return absl::OkStatus();
}

// A float8 request's descales of one tensor: 1 value (the whole tensor) or one per head, each finite and > 0, spread
// to one per head in `out`; none for a 16-bit request. Spread only once the shape's bytes passed the limits, which
// bound `heads` by the request's size.
absl::Status ExpandDescales(absl::string_view field, absl::Span<const float> given, DType dtype, int64_t heads,
                            absl::string_view heads_field, std::vector<float>* out) {
  out->clear();
  if (dtype != DType::kFP8E4M3) {
    if (given.empty()) return absl::OkStatus();
    return Invalid(field, absl::StrCat("given for a ", DTypeName(dtype),
                                       " request (descales go with dtype DTYPE_FP8_E4M3)"));
  }
  const uint64_t n = given.size(), h = static_cast<uint64_t>(heads);
  if (n == 0) {
    return Invalid(field, absl::StrCat("missing: a float8 request needs 1 value or ", h, " (", heads_field, ")"));
  }
  if (n != 1 && n != h) {
    return Invalid(field, absl::StrCat(n, " values: a float8 request takes 1 or ", h, " (", heads_field, ")"));
  }
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(given[i]) || given[i] <= 0) {
      return Invalid(absl::StrCat(field, "[", i, "]"), absl::StrCat(given[i], " is not finite and > 0"));
    }
  }
  if (n == 1) {
    out->assign(h, given[0]);
  } else {
    out->assign(given.begin(), given.end());
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateForward(const ForwardArgs& args, const CallInfo& call, const ValidationLimits& limits,
                             ForwardJob* job, RequestBytes* bytes) {
  if (args.request_id.size() > kMaxRequestIdBytes) {
    return Invalid("request_id", absl::StrCat(args.request_id.size(), " bytes, at most ", kMaxRequestIdBytes));
  }
  job->request_id = std::string(args.request_id);
  ATTND_RETURN_IF_ERROR(CheckShape(args.shape, limits));
  const Shape& sh = *args.shape;
  const auto& dts = limits.supported_dtypes;
  if (std::find(dts.begin(), dts.end(), args.dtype) == dts.end()) {
    std::vector<const char*> names;
    for (DType t : dts) names.push_back(DTypeName(t));
    return Invalid("dtype", absl::StrCat(DTypeName(args.dtype), " is not supported by this backend (supported: ",
                                         absl::StrJoin(names, ", "), ")"));
  }
  float scale = DefaultScale(sh.head_dim);
  if (args.softmax_scale.has_value()) {
    scale = *args.softmax_scale;
    if (!std::isfinite(scale)) return Invalid("softmax_scale", absl::StrCat(scale, " is not finite"));
  }
  RequestBytes b;
  ATTND_RETURN_IF_ERROR(SizeForward(sh, args.dtype, args.return_lse, limits, &b));
  ATTND_RETURN_IF_ERROR(CheckMessages(args, b, call.message_limit));
  ATTND_RETURN_IF_ERROR(
      ExpandDescales("q_descale", args.q_descale, args.dtype, sh.q_heads, "shape.q_heads", &job->q_descale));
  ATTND_RETURN_IF_ERROR(
      ExpandDescales("k_descale", args.k_descale, args.dtype, sh.kv_heads, "shape.kv_heads", &job->k_descale));
  ATTND_RETURN_IF_ERROR(
      ExpandDescales("v_descale", args.v_descale, args.dtype, sh.kv_heads, "shape.kv_heads", &job->v_descale));

  Problem& p = job->problem;
  p.shape = sh;
  p.dtype = args.dtype;
  p.mask = args.mask;
  p.scale = scale;
  p.want_lse = args.return_lse;
  const Layout contiguous = ContiguousLayout(p.shape);
  const char* dt = DTypeName(args.dtype);
  const std::string q_dims = absl::StrCat("batch*q_len*q_heads*head_dim ", dt);
  const std::string kv_dims = absl::StrCat("batch*kv_len*kv_heads*head_dim ", dt);
  ATTND_RETURN_IF_ERROR(CheckInput("q", args.q, b.q, q_dims, call.inputs_follow, contiguous.q, &job->q));
  ATTND_RETURN_IF_ERROR(CheckInput("k", args.k, b.k, kv_dims, call.inputs_follow, contiguous.k, &job->k));
  ATTND_RETURN_IF_ERROR(CheckInput("v", args.v, b.v, kv_dims, call.inputs_follow, contiguous.v, &job->v));
  job->o_to_buffer = args.o_ref.has_value();
  job->o_ref.strides = contiguous.o;
  if (job->o_to_buffer) {
    ATTND_RETURN_IF_ERROR(CheckRef("o_ref", *args.o_ref));
    BindRef(*args.o_ref, contiguous.o, &job->o_ref);
  }
  *bytes = b;
  return absl::OkStatus();
}

void BindInline(const TensorArg& in, TensorSource* source) {
  if (in.source == TensorArg::Source::kPieces) {
    source->pieces.assign(in.pieces.begin(), in.pieces.end());
  } else {
    source->host = reinterpret_cast<const uint8_t*>(in.data.data());
  }
  source->host_bytes = in.inline_bytes();
}

}  // namespace attnd::server
