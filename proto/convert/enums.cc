#include "attnd/proto/enums.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace attnd::proto {
namespace {

absl::Status Invalid(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
}

// Each mask and its wire value, for both directions.
constexpr std::pair<Mask, v1::MaskType> kMasks[] = {
    {Mask::kNone, v1::MASK_TYPE_NONE},
    {Mask::kCausalTopLeft, v1::MASK_TYPE_CAUSAL_TOP_LEFT},
    {Mask::kCausalBottomRight, v1::MASK_TYPE_CAUSAL_BOTTOM_RIGHT},
};

}  // namespace

v1::Dtype DtypeToProto(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return v1::DTYPE_BF16;
    case DType::kFP16:
      return v1::DTYPE_FP16;
    case DType::kFP8E4M3:
      return v1::DTYPE_FP8_E4M3;
  }
  return v1::DTYPE_UNSPECIFIED;
}

v1::MaskType MaskToProto(Mask mask) {
  for (const auto& [m, value] : kMasks) {
    if (m == mask) return value;
  }
  return v1::MASK_TYPE_NONE;
}

absl::StatusOr<DType> DtypeFromProto(v1::Dtype value, absl::string_view field, DtypeField takes) {
  const bool any = takes == DtypeField::kAny;
  switch (value) {
    case v1::DTYPE_BF16:
      return DType::kBF16;
    case v1::DTYPE_FP16:
      return DType::kFP16;
    case v1::DTYPE_UNSPECIFIED:
      return Invalid(field, any ? "DTYPE_UNSPECIFIED (set DTYPE_BF16, DTYPE_FP16 or DTYPE_FP8_E4M3)"
                                : "DTYPE_UNSPECIFIED (set DTYPE_BF16 or DTYPE_FP16)");
    case v1::DTYPE_FP8_E4M3:
      if (any) return DType::kFP8E4M3;
      return Invalid(field, "DTYPE_FP8_E4M3 is served as a sequence's shape.kv_dtype and as a Forward's dtype, not "
                            "here (set DTYPE_BF16 or DTYPE_FP16)");
    default:
      return Invalid(field, absl::StrCat("unknown value ", static_cast<int>(value)));
  }
}

absl::StatusOr<Mask> MaskFromProto(v1::MaskType value, absl::string_view field) {
  for (const auto& [mask, v] : kMasks) {
    if (v == value) return mask;
  }
  if (value == v1::MASK_TYPE_UNSPECIFIED) {
    return Invalid(field, "MASK_TYPE_UNSPECIFIED (set MASK_TYPE_NONE, MASK_TYPE_CAUSAL_TOP_LEFT or "
                          "MASK_TYPE_CAUSAL_BOTTOM_RIGHT)");
  }
  return Invalid(field, absl::StrCat("unknown value ", static_cast<int>(value)));
}

}  // namespace attnd::proto
