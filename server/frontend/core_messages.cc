#include "core_messages.h"

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "attnd/proto/enums.h"

namespace attnd::server {
namespace {

constexpr size_t kCudaIpcHandleBytes = 64;

TensorRefArg RefFromProto(const v1::TensorRef& ref) {
  return TensorRefArg{ref.buffer_id(), ref.offset(), absl::MakeConstSpan(ref.strides().data(), ref.strides_size())};
}

TensorArg TensorFromProto(bool present, const v1::TensorInput& in, const InlineBytes* left_in_message) {
  TensorArg t;
  if (left_in_message != nullptr && left_in_message->present) {
    t.source = TensorArg::Source::kPieces;
    t.pieces = left_in_message->pieces;
    t.pieces_bytes = left_in_message->size;
    return t;
  }
  if (!present) return t;
  switch (in.source_case()) {
    case v1::TensorInput::kData:
      t.source = TensorArg::Source::kData;
      t.data = in.data();
      break;
    case v1::TensorInput::kRef:
      t.source = TensorArg::Source::kRef;
      t.ref = RefFromProto(in.ref());
      break;
    default:
      t.source = TensorArg::Source::kUnset;
  }
  return t;
}

void FillTiming(const Timing& from, v1::Timing* t) {
  t->set_queue_us(from.queue_us);
  t->set_h2d_us(from.h2d_us);
  t->set_kernel_us(from.kernel_us);
  t->set_d2h_us(from.d2h_us);
  t->set_total_us(from.total_us);
}

double SecondsOrZero(absl::Duration d) { return d == absl::InfiniteDuration() ? 0 : absl::ToDoubleSeconds(d); }

void ShapeToProto(const SequenceShape& s, v1::SequenceShape* shape) {
  shape->set_layers(s.layers);
  shape->set_kv_heads(s.kv_heads);
  shape->set_head_dim(s.head_dim);
  shape->set_dtype(proto::DtypeToProto(s.dtype));
  if (s.kv_format == KvFormat::kFp8E4M3) {
    shape->set_kv_dtype(v1::DTYPE_FP8_E4M3);
    shape->mutable_k_descale()->Add(s.k_descale.begin(), s.k_descale.end());
    shape->mutable_v_descale()->Add(s.v_descale.begin(), s.v_descale.end());
  }
}

}  // namespace

absl::Status ForwardArgsFromProto(const v1::ForwardRequest& request, const InlineBytes* in_message,
                                  ForwardArgs* args) {
  const absl::StatusOr<DType> dtype = proto::DtypeFromProto(request.dtype(), "dtype", proto::DtypeField::kAny);
  if (!dtype.ok()) return dtype.status();
  const absl::StatusOr<Mask> mask = proto::MaskFromProto(request.mask(), "mask");
  if (!mask.ok()) return mask.status();
  args->request_id = request.request_id();
  if (request.has_shape()) {
    const v1::AttentionShape& s = request.shape();
    args->shape = Shape{s.batch(), s.q_len(), s.kv_len(), s.q_heads(), s.kv_heads(), s.head_dim()};
  }
  args->dtype = *dtype;
  args->mask = *mask;
  if (request.has_softmax_scale()) args->softmax_scale = request.softmax_scale();
  args->return_lse = request.return_lse();
  const auto left = [in_message](int i) { return in_message == nullptr ? nullptr : &in_message[i]; };
  args->q = TensorFromProto(request.has_q(), request.q(), left(0));
  args->k = TensorFromProto(request.has_k(), request.k(), left(1));
  args->v = TensorFromProto(request.has_v(), request.v(), left(2));
  if (request.has_o_ref()) args->o_ref = RefFromProto(request.o_ref());
  const auto floats = [](const google::protobuf::RepeatedField<float>& f) {
    return absl::MakeConstSpan(f.data(), f.size());
  };
  args->q_descale = floats(request.q_descale());
  args->k_descale = floats(request.k_descale());
  args->v_descale = floats(request.v_descale());
  return absl::OkStatus();
}

StepArgs StepArgsFromProto(const v1::StepRequest& request) {
  StepArgs args;
  args.request_id = request.request_id();
  args.layer = request.layer();
  args.q_heads = request.q_heads();
  if (request.has_softmax_scale()) args.softmax_scale = request.softmax_scale();
  args.return_lse = request.return_lse();
  args.sequences.reserve(request.sequences_size());
  for (const v1::SequenceTokens& s : request.sequences()) args.sequences.push_back({s.sequence_id(), s.tokens()});
  args.q = TensorFromProto(request.has_q(), request.q(), nullptr);
  args.k = TensorFromProto(request.has_k(), request.k(), nullptr);
  args.v = TensorFromProto(request.has_v(), request.v(), nullptr);
  if (request.has_o_ref()) args.o_ref = RefFromProto(request.o_ref());
  args.stream_ordered = request.has_order();
  return args;
}

absl::StatusOr<OpenArgs> OpenArgsFromProto(const v1::OpenSequenceRequest& request) {
  const v1::SequenceShape& s = request.shape();
  const absl::StatusOr<DType> dtype = proto::DtypeFromProto(s.dtype(), "shape.dtype");
  if (!dtype.ok()) return dtype.status();
  OpenArgs args;
  args.layers = s.layers(), args.kv_heads = s.kv_heads(), args.head_dim = s.head_dim();
  args.dtype = *dtype;
  if (s.has_kv_dtype() && s.kv_dtype() == v1::DTYPE_FP8_E4M3) {
    args.kv_format = KvFormat::kFp8E4M3;
  } else if (s.has_kv_dtype()) {
    const absl::StatusOr<DType> kv_dtype = proto::DtypeFromProto(s.kv_dtype(), "shape.kv_dtype");
    if (!kv_dtype.ok()) return kv_dtype.status();
    if (*kv_dtype != *dtype) {
      return absl::InvalidArgumentError(absl::StrCat("shape.kv_dtype: ", v1::Dtype_Name(s.kv_dtype()),
                                                     " is neither shape.dtype nor DTYPE_FP8_E4M3"));
    }
  }
  args.k_descale.assign(s.k_descale().begin(), s.k_descale().end());
  args.v_descale.assign(s.v_descale().begin(), s.v_descale().end());
  args.max_tokens = request.max_tokens();
  args.count = request.count();
  return args;
}

absl::StatusOr<ImportArgs> ImportArgsFromProto(const v1::SequenceHeader& header) {
  v1::OpenSequenceRequest open;
  *open.mutable_shape() = header.shape();
  open.set_max_tokens(header.max_tokens());
  absl::StatusOr<OpenArgs> args = OpenArgsFromProto(open);
  if (!args.ok()) return absl::Status(args.status().code(), absl::StrCat("sequence.", args.status().message()));
  return ImportArgs{*args, {header.lengths().begin(), header.lengths().end()}};
}

v1::SequenceHeader SequenceHeaderToProto(const MovingSequence& m) {
  v1::SequenceHeader header;
  ShapeToProto(m.shape, header.mutable_shape());
  header.set_max_tokens(m.max_tokens);
  for (int64_t len : m.lengths) header.add_lengths(len);
  return header;
}

void FillForwardReply(const ForwardJob& job, absl::string_view backend, v1::ForwardResponse* response) {
  response->set_request_id(job.request_id);
  FillTiming(job.timing, response->mutable_timing());
  response->set_backend(std::string(backend));
  response->set_kernel(job.kernel);
  response->set_device(job.device);
}

void FillStepReply(const StepJob& job, absl::string_view backend, v1::StepResponse* response) {
  response->set_request_id(job.request_id);
  v1::StepTiming* st = response->mutable_timing();
  FillTiming(job.timing, st->mutable_timing());
  st->set_batch_sequences(job.batch_sequences);
  st->set_batch_requests(job.batch_requests);
  for (const StepSequence& s : job.sequences) response->add_lengths(s.keys(job.append));
  response->set_backend(std::string(backend));
  response->set_kernel(job.kernel);
  response->set_device(job.device);
}

v1::SequenceInfo SequenceInfoToProto(const SequenceState& state) {
  v1::SequenceInfo info;
  info.set_sequence_id(state.sequence_id);
  ShapeToProto(state.shape, info.mutable_shape());
  info.set_max_tokens(state.max_tokens);
  for (int64_t len : state.lengths) info.add_lengths(len);
  info.set_pages(state.pages);
  info.set_shared_pages(state.shared_pages);
  info.set_idle_s(state.idle_s);
  info.set_step_in_flight(state.step_in_flight);
  return info;
}

v1::SequenceLimits SequenceLimitsToProto(const SequenceOptions& o) {
  v1::SequenceLimits l;
  l.set_enabled(o.enabled);
  l.set_pool_bytes(o.pool_bytes);
  l.set_page_tokens(o.page_tokens);
  l.set_max_tokens(o.max_tokens);
  l.set_ttl_s(SecondsOrZero(o.ttl));
  l.set_max_per_client(o.max_per_client);
  l.set_max_pages_per_client(o.max_pages_per_client);
  l.set_max_open(o.max_open);
  l.set_max_batch(o.max_batch);
  l.set_batch_wait_us(absl::ToDoubleMicroseconds(o.batch_wait));
  l.set_launches_in_flight(o.launches_in_flight);
  l.set_order_timeout_s(SecondsOrZero(o.order_timeout));
  return l;
}

v1::SequenceStats SequenceStatsToProto(const SequenceCounts& c) {
  v1::SequenceStats s;
  s.set_open(c.open);
  s.set_pages_used(c.pages_used);
  s.set_pages_free(c.pages_free);
  s.set_pools(c.pools);
  s.set_steps(c.steps);
  s.set_launches(c.launches);
  s.set_expired(c.expired);
  return s;
}

absl::Status ValidateRegisterCudaBuffer(const v1::RegisterCudaBufferRequest& req) {
  const auto invalid = [](absl::string_view field, absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
  };
  if (req.ipc_handle().size() != kCudaIpcHandleBytes) {
    return invalid("ipc_handle", absl::StrCat(req.ipc_handle().size(), " bytes, expected ", kCudaIpcHandleBytes));
  }
  if (req.device() < 0) return invalid("device", absl::StrCat("must be >= 0, got ", req.device()));
  if (req.byte_size() == 0) return invalid("byte_size", "must be > 0");
  uint64_t end;
  if (__builtin_add_overflow(req.offset(), req.byte_size(), &end)) {
    return invalid("offset", "offset + byte_size overflows");
  }
  return absl::OkStatus();
}

}  // namespace attnd::server
