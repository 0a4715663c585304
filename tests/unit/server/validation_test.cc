// A table of bad requests: each must be refused with the right status code and a message that starts with
// the offending field. Checked on the validation function (unary and stream header) and, for every row,
// through a running server so that the status survives the trip over gRPC.
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "attnd/server/cpu_backend.h"
#include "attnd/server/status_util.h"
#include "attnd/server/validation.h"
#include "core_messages.h"
#include "grpc_status.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "server_test_util.h"

namespace attnd {
namespace {

using server::ValidationLimits;

// The core's limits and the gRPC frontend's message limit, as a server sets them together.
struct TestLimits : ValidationLimits {
  uint64_t max_message_bytes = 16u << 20;
};

// How a request arrives: in one gRPC message (bounded by max_message_bytes), as a ForwardStream header (its
// inline tensors follow as chunks) or in a shared-memory channel's areas (no message bound).
enum class Via { kUnary, kStream, kShm };

// A request's way through a server up to the backend: the frontend's decoding (core_messages.h), then the core's
// validation.
absl::Status Validate(const v1::ForwardRequest& r, Via via, const TestLimits& limits, server::ForwardJob* job,
                      server::RequestBytes* bytes, const InlineBytes* in_message = nullptr) {
  server::ForwardArgs args;
  ATTND_RETURN_IF_ERROR(server::ForwardArgsFromProto(r, in_message, &args));
  server::CallInfo call;
  call.inputs_follow = via == Via::kStream;
  call.message_limit = via == Via::kUnary ? limits.max_message_bytes : 0;
  return server::ValidateForward(args, call, limits, job, bytes);
}

constexpr Shape kShape{2, 17, 33, 4, 2, 64};
// Shape limits of the table's server: well above kShape, and small enough that each is hit before the
// 8 MiB byte limit (a shape at every limit at once would need far more than 8 MiB).
constexpr int64_t kMaxBatch = 16, kMaxQLen = 8192, kMaxKvLen = 8192, kMaxHeads = 64;

struct BadCase {
  std::string name;
  std::function<void(v1::ForwardRequest&)> mutate;
  absl::StatusCode code;
  std::string field;  // the message must start with "<field>:"
};

v1::TensorRef Ref(const std::string& id, uint64_t offset = 0) {
  v1::TensorRef r;
  r.set_buffer_id(id);
  r.set_offset(offset);
  return r;
}

std::vector<BadCase> BadCases() {
  using C = absl::StatusCode;
  const C kInv = C::kInvalidArgument;
  std::vector<BadCase> t = {
      {"no_shape", [](auto& r) { r.clear_shape(); }, kInv, "shape"},
      {"batch_zero", [](auto& r) { r.mutable_shape()->set_batch(0); }, kInv, "shape.batch"},
      {"batch_negative", [](auto& r) { r.mutable_shape()->set_batch(-2); }, kInv, "shape.batch"},
      {"q_len_zero", [](auto& r) { r.mutable_shape()->set_q_len(0); }, kInv, "shape.q_len"},
      {"kv_len_negative", [](auto& r) { r.mutable_shape()->set_kv_len(-1); }, kInv, "shape.kv_len"},
      {"q_heads_zero", [](auto& r) { r.mutable_shape()->set_q_heads(0); }, kInv, "shape.q_heads"},
      {"kv_heads_negative", [](auto& r) { r.mutable_shape()->set_kv_heads(-4); }, kInv, "shape.kv_heads"},
      {"head_dim_zero", [](auto& r) { r.mutable_shape()->set_head_dim(0); }, kInv, "shape.head_dim"},
      {"head_dim_96", [](auto& r) { r.mutable_shape()->set_head_dim(96); }, kInv, "shape.head_dim"},
      {"head_dim_min_int64",
       [](auto& r) { r.mutable_shape()->set_head_dim(std::numeric_limits<int64_t>::min()); }, kInv, "shape.head_dim"},
      {"q_heads_not_multiple", [](auto& r) { r.mutable_shape()->set_q_heads(5); }, kInv, "shape.q_heads"},
      {"kv_heads_above_q_heads", [](auto& r) { r.mutable_shape()->set_kv_heads(8); }, kInv, "shape.q_heads"},
      {"dims_overflow_int64",
       [](auto& r) {
         r.mutable_shape()->set_batch(int64_t{1} << 40);
         r.mutable_shape()->set_q_len(int64_t{1} << 40);
       },
       kInv, "shape"},
      {"dims_overflow_wrap_to_small",
       [](auto& r) {  // 2^62 * 4 * 2 * 64 wraps to 0 in 64-bit arithmetic
         r.mutable_shape()->set_batch(int64_t{1} << 62);
         r.mutable_shape()->set_q_len(1);
         r.mutable_shape()->set_kv_len(1);
       },
       kInv, "shape"},
      {"kv_len_max", [](auto& r) { r.mutable_shape()->set_kv_len(std::numeric_limits<int64_t>::max()); }, kInv,
       "shape"},
      // K+V alone are 8 MiB at kv_len 8192, within --max_kv_len but over the 8 MiB byte limit.
      {"over_max_request_bytes", [](auto& r) { r.mutable_shape()->set_kv_len(kMaxKvLen); }, C::kResourceExhausted,
       "shape"},
      {"batch_over_max_batch", [](auto& r) { r.mutable_shape()->set_batch(kMaxBatch + 1); }, C::kResourceExhausted,
       "shape.batch"},
      {"q_len_over_max_q_len", [](auto& r) { r.mutable_shape()->set_q_len(kMaxQLen + 1); }, C::kResourceExhausted,
       "shape.q_len"},
      {"kv_len_over_max_kv_len", [](auto& r) { r.mutable_shape()->set_kv_len(kMaxKvLen + 1); },
       C::kResourceExhausted, "shape.kv_len"},
      {"q_heads_over_max_heads", [](auto& r) { r.mutable_shape()->set_q_heads(kMaxHeads * 2); },
       C::kResourceExhausted, "shape.q_heads"},
      {"kv_len_huge_over_max_kv_len", [](auto& r) { r.mutable_shape()->set_kv_len(int64_t{1} << 40); },
       C::kResourceExhausted, "shape.kv_len"},
      {"unknown_dtype", [](auto& r) { r.set_dtype(static_cast<v1::Dtype>(7)); }, kInv, "dtype"},
      {"unknown_mask", [](auto& r) { r.set_mask(static_cast<v1::MaskType>(-1)); }, kInv, "mask"},
      // Enums have no default: unset is refused, not read as bf16 or as no mask.
      {"unset_dtype", [](auto& r) { r.clear_dtype(); }, kInv, "dtype"},
      {"unset_mask", [](auto& r) { r.clear_mask(); }, kInv, "mask"},
      {"scale_nan", [](auto& r) { r.set_softmax_scale(std::nanf("")); }, kInv, "softmax_scale"},
      {"scale_inf", [](auto& r) { r.set_softmax_scale(std::numeric_limits<float>::infinity()); }, kInv,
       "softmax_scale"},
      {"scale_minus_inf", [](auto& r) { r.set_softmax_scale(-std::numeric_limits<float>::infinity()); }, kInv,
       "softmax_scale"},
      {"q_missing", [](auto& r) { r.clear_q(); }, kInv, "q"},
      {"k_empty_input", [](auto& r) { r.mutable_k()->Clear(); }, kInv, "k"},
      {"v_missing", [](auto& r) { r.clear_v(); }, kInv, "v"},
      {"q_short",
       [](auto& r) { r.mutable_q()->mutable_data()->pop_back(); }, kInv, "q.data"},
      {"k_long", [](auto& r) { r.mutable_k()->mutable_data()->append("xy"); }, kInv, "k.data"},
      {"v_empty_bytes", [](auto& r) { r.mutable_v()->set_data(""); }, kInv, "v.data"},
      {"v_odd_bytes", [](auto& r) { r.mutable_v()->mutable_data()->append("x"); }, kInv, "v.data"},
      {"request_id_too_long", [](auto& r) { r.set_request_id(std::string(1000, 'x')); }, kInv, "request_id"},
      {"q_ref_no_id", [](auto& r) { *r.mutable_q()->mutable_ref() = Ref(""); }, kInv, "q.ref.buffer_id"},
      {"k_ref_misaligned", [](auto& r) { *r.mutable_k()->mutable_ref() = Ref("b1", 3); }, kInv, "k.ref.offset"},
      {"v_ref_two_strides",
       [](auto& r) {
         *r.mutable_v()->mutable_ref() = Ref("b1");
         r.mutable_v()->mutable_ref()->add_strides(1);
         r.mutable_v()->mutable_ref()->add_strides(1);
       },
       kInv, "v.ref.strides"},
      {"q_ref_zero_stride",
       [](auto& r) {
         *r.mutable_q()->mutable_ref() = Ref("b1");
         for (int64_t s : {4096, 0, 64}) r.mutable_q()->mutable_ref()->add_strides(s);
       },
       kInv, "q.ref.strides[1]"},
      {"o_ref_no_id", [](auto& r) { *r.mutable_o_ref() = Ref(""); }, kInv, "o_ref.buffer_id"},
      // Well-formed references, refused by the CPU backend.
      {"q_ref_on_cpu", [](auto& r) { *r.mutable_q()->mutable_ref() = Ref("b1"); }, C::kFailedPrecondition, "q.ref"},
      {"v_ref_on_cpu", [](auto& r) { *r.mutable_v()->mutable_ref() = Ref("b1", 32); }, C::kFailedPrecondition,
       "v.ref"},
      {"o_ref_on_cpu", [](auto& r) { *r.mutable_o_ref() = Ref("b2"); }, C::kFailedPrecondition, "o_ref"},
      // Descales belong to float8 requests only.
      {"q_descale_on_bf16", [](auto& r) { r.add_q_descale(1.f); }, kInv, "q_descale"},
      {"v_descale_on_fp16",
       [](auto& r) {
         r.set_dtype(v1::DTYPE_FP16);
         r.add_v_descale(0.5f);
       },
       kInv, "v_descale"},
  };
  return t;
}

// Float8 requests (DTYPE_FP8_E4M3, kShape: q_heads 4, kv_heads 2): descales required, 1 or one per head, each
// finite and > 0; one byte per input element.
std::vector<BadCase> Fp8BadCases() {
  const auto kInv = absl::StatusCode::kInvalidArgument;
  const float nan = std::nanf(""), inf = std::numeric_limits<float>::infinity();
  return {
      {"q_descale_missing", [](auto& r) { r.clear_q_descale(); }, kInv, "q_descale"},
      {"k_descale_missing", [](auto& r) { r.clear_k_descale(); }, kInv, "k_descale"},
      {"v_descale_missing", [](auto& r) { r.clear_v_descale(); }, kInv, "v_descale"},
      {"q_descale_kv_heads_values", [](auto& r) { r.mutable_q_descale()->Truncate(2); }, kInv, "q_descale"},
      {"k_descale_q_heads_values",
       [](auto& r) {
         r.add_k_descale(1.f);
         r.add_k_descale(1.f);
       },
       kInv, "k_descale"},
      {"v_descale_three_values", [](auto& r) { r.add_v_descale(1.f); }, kInv, "v_descale"},
      {"q_descale_zero", [](auto& r) { r.set_q_descale(2, 0.f); }, kInv, "q_descale[2]"},
      {"k_descale_negative", [](auto& r) { r.set_k_descale(1, -0.5f); }, kInv, "k_descale[1]"},
      {"v_descale_nan", [nan](auto& r) { r.set_v_descale(0, nan); }, kInv, "v_descale[0]"},
      {"q_descale_inf", [inf](auto& r) { r.set_q_descale(0, inf); }, kInv, "q_descale[0]"},
      {"one_k_descale_negative_zero",
       [](auto& r) {
         r.clear_k_descale();
         r.add_k_descale(-0.f);
       },
       kInv, "k_descale[0]"},
      // Two bytes per element (a bf16 Q sent as float8) is the wrong size.
      {"q_as_bf16_bytes", [](auto& r) { r.mutable_q()->mutable_data()->append(r.q().data()); }, kInv, "q.data"},
      {"k_short", [](auto& r) { r.mutable_k()->mutable_data()->pop_back(); }, kInv, "k.data"},
  };
}

class BadFp8Request : public ::testing::TestWithParam<BadCase> {};

TestLimits Limits() {
  TestLimits l;
  l.max_request_bytes = 8u << 20;
  l.max_batch = kMaxBatch;
  l.max_q_len = kMaxQLen;
  l.max_kv_len = kMaxKvLen;
  l.max_heads = kMaxHeads;
  server::CpuBackend probe({}, {});
  l.supported_head_dims = probe.supported_head_dims();
  l.supported_dtypes = probe.supported_dtypes();
  return l;
}

// Validation plus the backend's own acceptance, as the service runs them.
absl::Status Check(const v1::ForwardRequest& r, Via via, const TestLimits& limits) {
  server::ForwardJob job;
  server::RequestBytes bytes;
  absl::Status s = Validate(r, via, limits, &job, &bytes);
  if (!s.ok()) return s;
  server::BackendOptions o;
  o.threads = 1;
  return server::CpuBackend(o).Accept(&job);
}

class BadRequest : public ::testing::TestWithParam<BadCase> {};

TEST_P(BadRequest, RefusedNamingTheField) {
  const BadCase& c = GetParam();
  v1::ForwardRequest r = testing::MakeRequest(kShape);
  c.mutate(r);
  const absl::Status s = Check(r, Via::kUnary, Limits());
  EXPECT_EQ(s.code(), c.code) << s;
  EXPECT_TRUE(absl::StartsWith(s.message(), c.field + ":")) << "message '" << s.message() << "' should name "
                                                            << c.field;
}

INSTANTIATE_TEST_SUITE_P(Table, BadRequest, ::testing::ValuesIn(BadCases()),
                         [](const ::testing::TestParamInfo<BadCase>& info) { return info.param.name; });

TEST_P(BadFp8Request, RefusedNamingTheField) {
  const BadCase& c = GetParam();
  v1::ForwardRequest r = testing::MakeFp8Request(kShape);
  ASSERT_TRUE(Check(r, Via::kUnary, Limits()).ok());
  c.mutate(r);
  for (Via via : {Via::kUnary, Via::kShm}) {
    const absl::Status s = Check(r, via, Limits());
    EXPECT_EQ(s.code(), c.code) << s;
    EXPECT_TRUE(absl::StartsWith(s.message(), c.field + ":")) << "message '" << s.message() << "' should name "
                                                              << c.field;
  }
}

INSTANTIATE_TEST_SUITE_P(Table, BadFp8Request, ::testing::ValuesIn(Fp8BadCases()),
                         [](const ::testing::TestParamInfo<BadCase>& info) { return info.param.name; });

TEST(Validation, Fp8RequestIsSizedInBytesOfOneAndItsDescalesSpreadPerHead) {
  v1::ForwardRequest r = testing::MakeFp8Request(kShape, v1::MASK_TYPE_NONE, true);
  r.clear_q_descale();
  r.add_q_descale(0.75f);  // one for the whole tensor
  r.set_k_descale(1, 0.125f);
  server::ForwardJob job;
  server::RequestBytes bytes;
  ASSERT_TRUE(Validate(r, Via::kUnary, Limits(), &job, &bytes).ok());
  EXPECT_EQ(job.problem.dtype, DType::kFP8E4M3);
  EXPECT_EQ(bytes.q, 2u * 17 * 4 * 64);
  EXPECT_EQ(bytes.k, 2u * 33 * 2 * 64);
  EXPECT_EQ(bytes.v, bytes.k);
  EXPECT_EQ(bytes.o, 2u * 17 * 4 * 64 * 2);  // bf16
  EXPECT_EQ(job.q_descale, std::vector<float>(4, 0.75f));
  EXPECT_EQ(job.k_descale, (std::vector<float>{r.k_descale(0), 0.125f}));
  EXPECT_EQ(job.v_descale, (std::vector<float>{r.v_descale(0), r.v_descale(1)}));
  // A 16-bit request carries none.
  ASSERT_TRUE(Validate(testing::MakeRequest(kShape), Via::kUnary, Limits(), &job, &bytes).ok());
  EXPECT_TRUE(job.q_descale.empty() && job.k_descale.empty() && job.v_descale.empty());
}

TEST(Validation, Fp8UnsupportedByTheBackendNamesDtypeAndTheSupportedOnes) {
  TestLimits limits = Limits();
  limits.supported_dtypes = {DType::kBF16, DType::kFP16};
  const absl::Status s = Check(testing::MakeFp8Request(kShape), Via::kUnary, limits);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(s.message(), "dtype: fp8_e4m3 is not supported by this backend (supported: bf16, "
                                            "fp16)")) << s;
}

TEST(Validation, ValidRequestPassesAndFillsTheJob) {
  v1::ForwardRequest r = testing::MakeRequest(kShape, v1::MASK_TYPE_CAUSAL_BOTTOM_RIGHT, true);
  r.set_softmax_scale(0.25f);
  server::ForwardJob job;
  server::RequestBytes bytes;
  ASSERT_TRUE(Validate(r, Via::kUnary, Limits(), &job, &bytes).ok());
  EXPECT_EQ(job.problem.shape.kv_len, 33);
  EXPECT_EQ(job.problem.mask, Mask::kCausalBottomRight);
  EXPECT_EQ(job.problem.scale, 0.25f);
  EXPECT_TRUE(job.problem.want_lse);
  EXPECT_EQ(bytes.q, 2u * 17 * 4 * 64 * 2);
  EXPECT_EQ(bytes.k, 2u * 33 * 2 * 64 * 2);
  EXPECT_EQ(bytes.lse, 2u * 4 * 17 * 4);
  EXPECT_EQ(job.q.host, reinterpret_cast<const uint8_t*>(r.q().data().data()));
  EXPECT_EQ(job.request_id, r.request_id());
  r.clear_softmax_scale();
  ASSERT_TRUE(Validate(r, Via::kUnary, Limits(), &job, &bytes).ok());
  EXPECT_FLOAT_EQ(job.problem.scale, 0.125f);  // 1/sqrt(64)
}

TEST(Validation, TensorsLeftInTheMessageAreSizeCheckedAndPassedAsPieces) {
  const v1::ForwardRequest full = testing::MakeRequest(kShape);
  v1::ForwardRequest header = full;
  header.clear_q();
  header.clear_k();
  header.clear_v();
  // Each tensor in two pieces, as ReadForwardRequest describes bytes spread over gRPC slices.
  const std::string* data[3] = {&full.q().data(), &full.k().data(), &full.v().data()};
  InlineBytes in_message[3];
  for (int i = 0; i < 3; ++i) {
    const auto* p = reinterpret_cast<const uint8_t*>(data[i]->data());
    in_message[i].present = true;
    in_message[i].size = data[i]->size();
    in_message[i].pieces = {absl::MakeConstSpan(p, 100), absl::MakeConstSpan(p + 100, data[i]->size() - 100)};
  }
  server::ForwardJob job;
  server::RequestBytes bytes;
  ASSERT_TRUE(Validate(header, Via::kUnary, Limits(), &job, &bytes, in_message).ok());
  EXPECT_EQ(job.q.host, nullptr);
  EXPECT_EQ(job.k.pieces.size(), 2u);
  EXPECT_EQ(job.v.host_bytes, data[2]->size());
  std::string copied(data[1]->size(), '\0');
  server::CopyInline(job.k, reinterpret_cast<uint8_t*>(copied.data()));
  EXPECT_TRUE(copied == *data[1]);
  // A wrong size names the field, as for bytes protobuf parsed.
  in_message[1].size -= 2;
  in_message[1].pieces.back() = in_message[1].pieces.back().subspan(2);
  const absl::Status s = Validate(header, Via::kUnary, Limits(), &job, &bytes, in_message);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(s.message(), "k.data:")) << s;
  // Without them the header alone is missing its tensors.
  EXPECT_TRUE(absl::StartsWith(Check(header, Via::kUnary, Limits()).message(), "q:"));
}

TEST(Validation, HeadDimMessageListsSupportedValues) {
  v1::ForwardRequest r = testing::MakeRequest(kShape);
  r.mutable_shape()->set_head_dim(96);
  EXPECT_EQ(Check(r, Via::kUnary, Limits()).message(),
            "shape.head_dim: 96 is not supported (supported: 64, 128, 256)");
}

TEST(Validation, ShapeLimitMessageNamesFieldAndFlag) {
  v1::ForwardRequest r = testing::MakeRequest(kShape);
  r.mutable_shape()->set_q_len(65536);
  TestLimits l = Limits();
  l.max_q_len = 32768;
  EXPECT_EQ(Check(r, Via::kUnary, l).message(), "shape.q_len: 65536 exceeds the server limit --max_q_len=32768");
  r = testing::MakeRequest(kShape);
  r.mutable_shape()->set_q_heads(kMaxHeads + 2);
  EXPECT_EQ(Check(r, Via::kUnary, Limits()).message(),
            absl::StrCat("shape.q_heads: ", kMaxHeads + 2, " exceeds the server limit --max_heads=", kMaxHeads));
}

// A shape exactly at each limit is accepted (the limit is inclusive), and 0 means no shape limit: the same
// over-limit shape then runs into the byte limit instead.
TEST(Validation, ShapeLimitsAreInclusiveAndZeroMeansNone) {
  TestLimits l = Limits();
  l.max_request_bytes = l.max_message_bytes = 1ull << 40;
  const Shape at{kMaxBatch, 5, 7, kMaxHeads, 2, 64};
  EXPECT_TRUE(Check(testing::MakeRequest(at), Via::kUnary, l).ok());
  v1::ForwardRequest header = testing::MakeRequest(Shape{3, kMaxQLen, kMaxKvLen, 4, 2, 64});
  header.clear_q();
  header.clear_k();
  header.clear_v();
  EXPECT_TRUE(Check(header, Via::kStream, l).ok());
  header.mutable_shape()->set_kv_len(kMaxKvLen + 1);
  EXPECT_EQ(Check(header, Via::kStream, l).code(), absl::StatusCode::kResourceExhausted);  // stream too

  l = Limits();
  l.max_batch = l.max_q_len = l.max_kv_len = l.max_heads = 0;
  header.mutable_shape()->set_kv_len(int64_t{1} << 30);
  const absl::Status s = Check(header, Via::kStream, l);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "--max_request_bytes")) << s;
}

TEST(Validation, UnaryMessageLimitIsResourceExhausted) {
  TestLimits l = Limits();
  l.max_message_bytes = 64 * 1024;  // below the tensors plus framing allowance
  const absl::Status s = Check(testing::MakeRequest(kShape), Via::kUnary, l);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "ForwardStream")) << s;
  // The same shape is fine as a stream, and inline in a shared-memory channel (no gRPC message there).
  v1::ForwardRequest header = testing::MakeRequest(kShape);
  header.clear_q();
  header.clear_k();
  header.clear_v();
  EXPECT_TRUE(Check(header, Via::kStream, l).ok());
  EXPECT_TRUE(Check(testing::MakeRequest(kShape), Via::kShm, l).ok());
  // The request limit still holds there.
  l.max_request_bytes = 1024;
  const absl::Status local = Check(testing::MakeRequest(kShape), Via::kShm, l);
  EXPECT_EQ(local.code(), absl::StatusCode::kResourceExhausted) << local;
  EXPECT_TRUE(absl::StrContains(local.message(), "--max_request_bytes")) << local;
}

TEST(Validation, TensorsByReferenceDoNotCountTowardTheUnaryMessages) {
  // Q, K, V and O by reference: the request and the reply carry ids, so tensors far above the message limit fit.
  TestLimits l = Limits();
  l.max_message_bytes = 128 * 1024;  // the 64 KiB framing allowance and 64 KiB of tensors
  constexpr Shape big{1, 256, 256, 4, 4, 64};  // Q, K and V of 128 KiB each
  v1::ForwardRequest r = testing::MakeRequest(big, v1::MASK_TYPE_NONE, false, 7);
  *r.mutable_q()->mutable_ref() = Ref("bq");
  *r.mutable_k()->mutable_ref() = Ref("bk");
  *r.mutable_v()->mutable_ref() = Ref("bv");
  *r.mutable_o_ref() = Ref("bo");
  server::ForwardJob job;
  server::RequestBytes bytes;
  const absl::Status by_reference = Validate(r, Via::kUnary, l, &job, &bytes);
  EXPECT_TRUE(by_reference.ok()) << by_reference;
  EXPECT_GT(bytes.q + bytes.k + bytes.v, l.max_message_bytes);
  // One tensor inline brings the request back over the limit.
  *r.mutable_q() = testing::MakeRequest(big, v1::MASK_TYPE_NONE, false, 7).q();
  server::ForwardJob job2;
  const absl::Status inline_q = Validate(r, Via::kUnary, l, &job2, &bytes);
  EXPECT_EQ(inline_q.code(), absl::StatusCode::kResourceExhausted) << inline_q;
  EXPECT_TRUE(absl::StrContains(inline_q.message(), "--max_message_bytes")) << inline_q;
}

TEST(Validation, StreamHeaderRefusesInlineBytes) {
  v1::ForwardRequest header = testing::MakeRequest(kShape);
  header.clear_q();
  header.clear_v();
  const absl::Status s = Check(header, Via::kStream, Limits());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(s.message(), "k.data:")) << s;
}

TEST(Validation, UnsetEnumsAreRefusedNamingTheFieldAndTheChoices) {
  v1::ForwardRequest r = testing::MakeRequest(kShape);
  r.clear_dtype();
  EXPECT_EQ(Check(r, Via::kUnary, Limits()).message(),
            "dtype: DTYPE_UNSPECIFIED (set DTYPE_BF16, DTYPE_FP16 or DTYPE_FP8_E4M3)");
  r = testing::MakeRequest(kShape);
  r.set_mask(v1::MASK_TYPE_UNSPECIFIED);
  EXPECT_EQ(Check(r, Via::kUnary, Limits()).message(),
            "mask: MASK_TYPE_UNSPECIFIED (set MASK_TYPE_NONE, MASK_TYPE_CAUSAL_TOP_LEFT or MASK_TYPE_CAUSAL_BOTTOM_RIGHT)");
}

// A JSON request read as gateways read it: protobuf's JSON parser with ignore_unknown_fields drops an enum name it
// does not know, so a misspelled mask arrives as the zero value. That must be refused rather than run unmasked.
TEST(Validation, AMisspelledEnumInJsonIsRefusedNotReadAsADefault) {
  const v1::ForwardRequest ref = testing::MakeRequest(kShape);
  const std::string json = absl::StrCat(
      R"({"shape": {"batch": 2, "qLen": 17, "kvLen": 33, "qHeads": 4, "kvHeads": 2, "headDim": 64},)",
      R"( "dtype": "DTYPE_BF16", "mask": "MASK_TYPE_CAUSAL",)", R"( "q": {"data": ")",
      absl::Base64Escape(ref.q().data()), R"("}, "k": {"data": ")", absl::Base64Escape(ref.k().data()),
      R"("}, "v": {"data": ")", absl::Base64Escape(ref.v().data()), R"("}})");
  auto parse = [](const std::string& text) {
    google::protobuf::util::JsonParseOptions options;
    options.ignore_unknown_fields = true;
    v1::ForwardRequest r;
    EXPECT_TRUE(google::protobuf::util::JsonStringToMessage(text, &r, options).ok());
    return r;
  };
  v1::ForwardRequest r = parse(json);
  EXPECT_EQ(r.dtype(), v1::DTYPE_BF16);
  EXPECT_EQ(r.mask(), v1::MASK_TYPE_UNSPECIFIED);
  const absl::Status s = Check(r, Via::kUnary, Limits());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(absl::StartsWith(s.message(), "mask: MASK_TYPE_UNSPECIFIED")) << s;
  // Spelled right, the same request passes.
  r = parse(absl::StrReplaceAll(json, {{"MASK_TYPE_CAUSAL\"", "MASK_TYPE_CAUSAL_TOP_LEFT\""}}));
  EXPECT_EQ(r.mask(), v1::MASK_TYPE_CAUSAL_TOP_LEFT);
  EXPECT_TRUE(Check(r, Via::kUnary, Limits()).ok());
}

TEST(Validation, RegisterCudaBuffer) {
  v1::RegisterCudaBufferRequest r;
  r.set_ipc_handle(std::string(64, 'h'));
  r.set_byte_size(1024);
  EXPECT_TRUE(server::ValidateRegisterCudaBuffer(r).ok());
  auto expect = [](const v1::RegisterCudaBufferRequest& bad, const std::string& field) {
    const absl::Status s = server::ValidateRegisterCudaBuffer(bad);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StartsWith(s.message(), field + ":")) << s;
  };
  v1::RegisterCudaBufferRequest bad = r;
  bad.set_ipc_handle("short");
  expect(bad, "ipc_handle");
  bad = r;
  bad.set_byte_size(0);
  expect(bad, "byte_size");
  bad = r;
  bad.set_device(-1);
  expect(bad, "device");
  bad = r;
  bad.set_offset(~uint64_t{0});
  expect(bad, "offset");
}

TEST(StatusMapping, EveryCanonicalCodeKeepsItsNumberAndMessage) {
  for (int c = 1; c <= 16; ++c) {
    const grpc::Status g = server::ToGrpcStatus(absl::Status(static_cast<absl::StatusCode>(c), "why"));
    EXPECT_EQ(static_cast<int>(g.error_code()), c);
    EXPECT_EQ(g.error_message(), "why");
  }
  EXPECT_TRUE(server::ToGrpcStatus(absl::OkStatus()).ok());
  EXPECT_EQ(server::ToGrpcStatus(absl::Status(static_cast<absl::StatusCode>(99), "x")).error_code(),
            grpc::StatusCode::UNKNOWN);
}

// The whole table once more through a running server: the code and the field survive the trip.
TEST(ValidationOverGrpc, EveryBadRequestGetsItsStatus) {
  server::ServerOptions options;
  options.limits.max_request_bytes = 8u << 20;
  options.limits.max_batch = kMaxBatch;
  options.limits.max_q_len = kMaxQLen;
  options.limits.max_kv_len = kMaxKvLen;
  options.limits.max_heads = kMaxHeads;
  testing::TestServer ts(options);
  ASSERT_NE(ts.server, nullptr);
  auto stub = ts.Stub();
  {  // The limits a client can plan with are the ones enforced below.
    grpc::ClientContext ctx;
    v1::ServerInfo info;
    ASSERT_TRUE(stub->GetServerInfo(&ctx, v1::GetServerInfoRequest(), &info).ok());
    EXPECT_EQ(info.limits().max_batch(), kMaxBatch);
    EXPECT_EQ(info.limits().max_q_len(), kMaxQLen);
    EXPECT_EQ(info.limits().max_kv_len(), kMaxKvLen);
    EXPECT_EQ(info.limits().max_heads(), kMaxHeads);
  }
  for (const BadCase& c : BadCases()) {
    SCOPED_TRACE(c.name);
    v1::ForwardRequest r = testing::MakeRequest(kShape);
    c.mutate(r);
    grpc::ClientContext ctx;
    v1::ForwardResponse resp;
    const grpc::Status s = stub->Forward(&ctx, r, &resp);
    EXPECT_EQ(static_cast<int>(s.error_code()), static_cast<int>(c.code)) << s.error_message();
    EXPECT_TRUE(absl::StartsWith(s.error_message(), c.field + ":")) << s.error_message();
  }
  EXPECT_EQ(ts.cpu->jobs_computed(), 0u);
  ts.server->Shutdown();
}

TEST(ValidationOverGrpc, ShapeLimitsDefaultToNone) {
  testing::TestServer ts(server::ServerOptions{});
  ASSERT_NE(ts.server, nullptr);
  auto stub = ts.Stub();
  grpc::ClientContext ctx;
  v1::ServerInfo info;
  ASSERT_TRUE(stub->GetServerInfo(&ctx, v1::GetServerInfoRequest(), &info).ok());
  EXPECT_EQ(info.limits().max_batch(), 0);
  EXPECT_EQ(info.limits().max_q_len(), 0);
  EXPECT_EQ(info.limits().max_kv_len(), 0);
  EXPECT_EQ(info.limits().max_heads(), 0);
  ts.server->Shutdown();
}

}  // namespace
}  // namespace attnd
