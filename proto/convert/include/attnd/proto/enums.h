// The API's enums and the types the server and client compute with (attnd/problem.h), converted one way in both.
// From the proto, an enum's _UNSPECIFIED zero is refused like an unknown number (INVALID_ARGUMENT naming the field
// the value came from, "shape.dtype", "mask"), never read as a default: it is what a field left unset, or an enum
// name a JSON client misspelled, arrives as.
#pragma once

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "attnd/problem.h"
#include "attnd/v1/attention.pb.h"

namespace attnd::proto {

// Which element types a dtype field takes: every one (ForwardRequest.dtype, whose float8 inputs give a bf16 O), or
// the 16-bit ones (a sequence's SequenceShape.dtype, the type of its Q, O and rows; its float8 is kv_dtype).
enum class DtypeField { kAny, kSixteenBit };

v1::Dtype DtypeToProto(DType dtype);
v1::MaskType MaskToProto(Mask mask);
absl::StatusOr<DType> DtypeFromProto(v1::Dtype value, absl::string_view field,
                                     DtypeField takes = DtypeField::kSixteenBit);
absl::StatusOr<Mask> MaskFromProto(v1::MaskType value, absl::string_view field);

}  // namespace attnd::proto
