#include "attnd/client/client.h"

#include <algorithm>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "attnd/proto/enums.h"

namespace attnd::client {

v1::Dtype ToProto(DType t) { return proto::DtypeToProto(t); }
v1::MaskType ToProto(Mask m) { return proto::MaskToProto(m); }
absl::StatusOr<DType> FromProto(v1::Dtype t) { return proto::DtypeFromProto(t, "dtype", proto::DtypeField::kAny); }
absl::StatusOr<Mask> FromProto(v1::MaskType m) { return proto::MaskFromProto(m, "mask"); }

float SequenceShape::DescaleAt(const std::vector<float>& descale, int64_t layer, int64_t head) const {
  const size_t n = descale.size();
  if (n == 0) return 1.f;
  if (n == 1) return descale[0];
  if (n == static_cast<size_t>(layers)) return descale[static_cast<size_t>(layer)];
  // Any other count is one the server refuses at open, so no cache of this shape exists to read.
  const size_t i = static_cast<size_t>(layer * kv_heads + head);
  return i < n ? descale[i] : 1.f;
}

std::string KvDtypeName(const SequenceShape& s) {
  return s.kv_format == KvFormat::kFp8E4M3 ? "fp8_e4m3" : DTypeName(s.dtype);
}

v1::SequenceShape ToProto(const SequenceShape& s) {
  v1::SequenceShape p;
  p.set_layers(s.layers);
  p.set_kv_heads(s.kv_heads);
  p.set_head_dim(s.head_dim);
  p.set_dtype(ToProto(s.dtype));
  if (s.kv_format == KvFormat::kFp8E4M3) p.set_kv_dtype(v1::DTYPE_FP8_E4M3);
  // Sent as given, also for a 16-bit cache: the server is the one that refuses them there, naming the field.
  p.mutable_k_descale()->Add(s.k_descale.begin(), s.k_descale.end());
  p.mutable_v_descale()->Add(s.v_descale.begin(), s.v_descale.end());
  return p;
}

absl::StatusOr<SequenceShape> FromProto(const v1::SequenceShape& p) {
  SequenceShape s;
  s.layers = p.layers();
  s.kv_heads = p.kv_heads();
  s.head_dim = p.head_dim();
  absl::StatusOr<DType> dtype = proto::DtypeFromProto(p.dtype(), "shape.dtype");
  if (!dtype.ok()) return dtype.status();
  s.dtype = *dtype;
  if (p.has_kv_dtype() && p.kv_dtype() == v1::DTYPE_FP8_E4M3) {
    s.kv_format = KvFormat::kFp8E4M3;
  } else if (p.has_kv_dtype() && p.kv_dtype() != p.dtype()) {
    return absl::InvalidArgumentError(absl::StrCat("shape.kv_dtype: ", v1::Dtype_Name(p.kv_dtype()),
                                                   " is neither shape.dtype nor DTYPE_FP8_E4M3"));
  }
  s.k_descale.assign(p.k_descale().begin(), p.k_descale().end());
  s.v_descale.assign(p.v_descale().begin(), p.v_descale().end());
  return s;
}

v1::ForwardRequest MakeForwardRequest(const RequestSpec& spec, std::string q, std::string k, std::string v) {
  v1::ForwardRequest r;
  r.set_request_id(spec.request_id);
  auto* s = r.mutable_shape();
  s->set_batch(spec.shape.batch);
  s->set_q_len(spec.shape.q_len);
  s->set_kv_len(spec.shape.kv_len);
  s->set_q_heads(spec.shape.q_heads);
  s->set_kv_heads(spec.shape.kv_heads);
  s->set_head_dim(spec.shape.head_dim);
  r.set_dtype(ToProto(spec.dtype));
  r.set_mask(ToProto(spec.mask));
  if (spec.scale) r.set_softmax_scale(*spec.scale);
  r.set_return_lse(spec.want_lse);
  *r.mutable_q()->mutable_data() = std::move(q);
  *r.mutable_k()->mutable_data() = std::move(k);
  *r.mutable_v()->mutable_data() = std::move(v);
  r.mutable_q_descale()->Add(spec.q_descale.begin(), spec.q_descale.end());
  r.mutable_k_descale()->Add(spec.k_descale.begin(), spec.k_descale.end());
  r.mutable_v_descale()->Add(spec.v_descale.begin(), spec.v_descale.end());
  return r;
}

absl::StatusOr<v1::StepRequest> MakeStepRequest(const StepSpec& spec) {
  if (spec.sequences.empty()) return absl::InvalidArgumentError("sequences: empty (a step needs at least one)");
  if (spec.k.present() != spec.v.present()) {
    return absl::InvalidArgumentError("k, v: both or neither (a step appends keys and values together)");
  }
  v1::StepRequest r;
  r.set_request_id(spec.request_id);
  r.set_layer(spec.layer);
  r.set_q_heads(spec.q_heads);
  if (spec.scale) r.set_softmax_scale(*spec.scale);
  r.set_return_lse(spec.want_lse);
  for (const StepSpec::Entry& e : spec.sequences) {
    v1::SequenceTokens* t = r.add_sequences();
    t->set_sequence_id(e.sequence_id);
    t->set_tokens(e.tokens);
  }
  const std::pair<const StepTensor*, v1::TensorInput* (v1::StepRequest::*)()> tensors[] = {
      {&spec.q, &v1::StepRequest::mutable_q},
      {&spec.k, &v1::StepRequest::mutable_k},
      {&spec.v, &v1::StepRequest::mutable_v}};
  for (const auto& [t, field] : tensors) {
    if (t->ref) {
      *(r.*field)()->mutable_ref() = *t->ref;
    } else if (!t->data.empty()) {
      (r.*field)()->set_data(t->data.data(), t->data.size());
    }
  }
  if (spec.o_ref) *r.mutable_o_ref() = *spec.o_ref;
  return r;
}

absl::StatusOr<StepResult> StepResultOf(const v1::StepRequest& request, v1::StepResponse response, Transport t,
                                        absl::Time start) {
  StepResult res;
  res.request_id = std::move(*response.mutable_request_id());
  res.o = std::move(*response.mutable_o());
  res.lse = std::move(*response.mutable_lse());
  res.timing = response.timing();
  res.lengths.assign(response.lengths().begin(), response.lengths().end());
  res.backend = std::move(*response.mutable_backend());
  res.kernel = std::move(*response.mutable_kernel());
  res.device = response.device();
  res.transport = t;
  res.latency = absl::Now() - start;
  for (const v1::TensorInput* in : {&request.q(), &request.k(), &request.v()}) {
    if (in->source_case() == v1::TensorInput::kData) res.bytes_sent += in->data().size();
  }
  res.bytes_received = res.o.size() + res.lse.size();
  // O has Q's shape and dtype; LSE is fp32 [q_heads, tokens] per sequence.
  const bool attend = request.q().source_case() != v1::TensorInput::SOURCE_NOT_SET;
  uint64_t rows = 0;
  for (const auto& s : request.sequences()) rows += static_cast<uint64_t>(std::max<int64_t>(s.tokens(), 0));
  if (request.q().source_case() == v1::TensorInput::kData && !request.has_o_ref() &&
      res.o.size() != request.q().data().size()) {
    return absl::InternalError(
        absl::StrCat("server returned ", res.o.size(), " bytes of O, expected ", request.q().data().size()));
  }
  if ((!attend || request.has_o_ref()) && !res.o.empty()) {
    return absl::InternalError(
        absl::StrCat("server returned ", res.o.size(), " bytes of O to a step that asked for none"));
  }
  const uint64_t want_lse =
      attend && request.return_lse() ? rows * static_cast<uint64_t>(std::max<int64_t>(request.q_heads(), 0)) * 4 : 0;
  if (res.lse.size() != want_lse) {
    return absl::InternalError(absl::StrCat("server returned ", res.lse.size(), " bytes of LSE, expected ", want_lse));
  }
  if (res.lengths.size() != static_cast<size_t>(request.sequences_size())) {
    return absl::InternalError(absl::StrCat("server returned ", res.lengths.size(), " lengths for ",
                                            request.sequences_size(), " sequences"));
  }
  return res;
}

}  // namespace attnd::client
