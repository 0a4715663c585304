// The zero-copy readers of the wire codec (transport/zero_copy.cc) against protobuf's parse of the same bytes:
// whatever ReadForwardRequest / ReadForwardResponse accept must be exactly what protobuf reads, tensor bytes
// included, whatever the slice boundaries; what they refuse falls back to protobuf, which needs no check here.
// Input: a cut count (0-31) and that many cut steps, then the message; the last bytes size ReadForwardResponse's
// destinations.
#include <cstdint>
#include <string>
#include <vector>

#include "attnd/transport/zero_copy.h"
#include "attnd/v1/attention.pb.h"
#include "fuzz_util.h"
#include "google/protobuf/util/field_comparator.h"
#include "google/protobuf/util/message_differencer.h"

using attnd::fuzz::Sliced;
using google::protobuf::util::MessageDifferencer;

namespace {

// Field by field, a NaN softmax_scale equal to itself (both sides read the same bits).
bool Same(const google::protobuf::Message& a, const google::protobuf::Message& b) {
  google::protobuf::util::DefaultFieldComparator comparator;
  comparator.set_treat_nan_as_equal(true);
  MessageDifferencer differencer;
  differencer.set_field_comparator(&comparator);
  return differencer.Compare(a, b);
}

std::string Joined(const attnd::InlineBytes& t) {
  std::string s;
  for (const auto& p : t.pieces) s.append(reinterpret_cast<const char*>(p.data()), p.size());
  return s;
}

void CheckForwardRequest(const grpc::ByteBuffer& message, const std::string& bytes) {
  std::vector<grpc::Slice> slices;
  attnd::v1::ForwardRequest header;
  attnd::InlineBytes tensors[3];
  if (!attnd::ReadForwardRequest(message, &slices, &header, tensors)) return;
  attnd::v1::ForwardRequest expected;
  // The known difference: the reader takes a length as a varint of up to ten bytes (protobuf: five, at most
  // INT_MAX), so it accepts a padded or overlong length that protobuf refuses. Everything protobuf parses must
  // agree.
  if (!expected.ParseFromString(bytes)) return;
  attnd::v1::TensorInput* (attnd::v1::ForwardRequest::*input[3])() = {
      &attnd::v1::ForwardRequest::mutable_q, &attnd::v1::ForwardRequest::mutable_k,
      &attnd::v1::ForwardRequest::mutable_v};
  for (int i = 0; i < 3; ++i) {
    if (!tensors[i].present) continue;
    const std::string data = Joined(tensors[i]);
    ATTND_FUZZ_CHECK(data.size() == tensors[i].size);
    attnd::v1::TensorInput* t = (header.*input[i])();
    ATTND_FUZZ_CHECK(t->source_case() == attnd::v1::TensorInput::SOURCE_NOT_SET);
    t->set_data(data);
  }
  ATTND_FUZZ_CHECK(Same(header, expected));
}

void CheckForwardResponse(const grpc::ByteBuffer& message, const std::string& bytes, size_t o_cap, size_t lse_cap) {
  std::vector<char> o(o_cap), lse(lse_cap);
  attnd::v1::ForwardResponse header;
  uint64_t o_size = 0, lse_size = 0;
  if (!attnd::ReadForwardResponse(message, &header, absl::MakeSpan(o), absl::MakeSpan(lse), &o_size, &lse_size).ok()) {
    return;
  }
  attnd::v1::ForwardResponse expected;
  if (!expected.ParseFromString(bytes)) return;  // as above
  ATTND_FUZZ_CHECK(o_size <= o_cap && lse_size <= lse_cap);
  ATTND_FUZZ_CHECK(expected.o() == std::string(o.data(), o_size));
  ATTND_FUZZ_CHECK(expected.lse() == std::string(lse.data(), lse_size));
  header.set_o(expected.o());
  header.set_lse(expected.lse());
  ATTND_FUZZ_CHECK(Same(header, expected));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  const size_t o_cap = in.ConsumeIntegralInRange<size_t>(0, 4096);
  const size_t lse_cap = in.ConsumeIntegralInRange<size_t>(0, 1024);
  const std::vector<uint8_t> cuts = in.ConsumeBytes<uint8_t>(in.ConsumeIntegralInRange<size_t>(0, 31));
  const std::string bytes = in.ConsumeRemainingBytesAsString();
  const grpc::ByteBuffer message = Sliced(bytes, cuts);

  CheckForwardRequest(message, bytes);
  CheckForwardResponse(message, bytes, o_cap, lse_cap);
  // The header peeks (access log, stats): any bytes, no crash; large fields skipped.
  attnd::v1::ForwardRequest small;
  (void)attnd::ParseSmallFields(message, &small, 64);
  attnd::v1::ForwardResponse small_reply;
  (void)attnd::ParseSmallFields(message, &small_reply);
  return 0;
}
