#include "attnd/server/buffer_registry.h"

#include "absl/strings/str_cat.h"

namespace attnd::server {
namespace {

bool MulU64(uint64_t a, uint64_t b, uint64_t* out) { return !__builtin_mul_overflow(a, b, out); }
bool AddU64(uint64_t a, uint64_t b, uint64_t* out) { return !__builtin_add_overflow(a, b, out); }

}  // namespace

absl::StatusOr<uint64_t> TensorSpanBytes(const std::string& field, int64_t batch, int64_t seq, int64_t heads,
                                         int64_t head_dim, const Strides& st, uint64_t elem_bytes) {
  // Index of the last element: sum over dims of (extent - 1) * stride, all non-negative (validated >= 1).
  const struct {
    int64_t extent, stride;
  } dims[] = {{batch, st.batch}, {seq, st.seq}, {heads, st.head}, {head_dim, 1}};
  uint64_t last = 0;
  for (const auto& d : dims) {
    uint64_t term;
    if (d.extent < 1 || d.stride < 0 || !MulU64(static_cast<uint64_t>(d.extent - 1), static_cast<uint64_t>(d.stride), &term) ||
        !AddU64(last, term, &last)) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": the tensor's extent overflows (shape x strides)"));
    }
  }
  uint64_t bytes;
  if (!AddU64(last, 1, &last) || !MulU64(last, elem_bytes, &bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": the tensor's extent overflows (shape x strides)"));
  }
  return bytes;
}

absl::Status CheckInRegion(const std::string& field, uint64_t offset, uint64_t bytes, uint64_t region_bytes) {
  uint64_t end;
  if (!AddU64(offset, bytes, &end) || end > region_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": bytes [", offset, ", ", offset, "+", bytes,
                                                   ") run past the registered region of ", region_bytes, " bytes"));
  }
  return absl::OkStatus();
}

}  // namespace attnd::server
