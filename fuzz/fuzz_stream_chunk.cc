// ForwardStream chunk reading (ReadStreamChunk, transport/zero_copy.cc), which copies a chunk's data straight
// from gRPC's slices to where the stream's assembly puts it. A chunk it reads must be the one protobuf reads from
// the same bytes (tensor, offset, data), and it must write exactly the `size` bytes it announced to `place`: the
// destination here is a buffer of exactly that size, so one byte more is an ASan report.
// The assembly's own checks (ForwardStreamReactor::Place in server/grpc/service.cc: header first, tensor known,
// offsets in order, no overrun) live inside the gRPC reactor and are exercised by the service tests, not here.
// Input: a refusal threshold, a cut count and cut steps, then the message.
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "attnd/transport/zero_copy.h"
#include "attnd/v1/attention.pb.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  // Chunks announcing more than this are refused (a place that says no: a tensor overrun, say).
  const uint64_t refuse_above = in.ConsumeIntegralInRange<uint64_t>(0, 1 << 16);
  const std::vector<uint8_t> cuts = in.ConsumeBytes<uint8_t>(in.ConsumeIntegralInRange<size_t>(0, 31));
  const std::string bytes = in.ConsumeRemainingBytesAsString();
  grpc::ByteBuffer message = attnd::fuzz::Sliced(bytes, cuts);

  std::unique_ptr<char[]> dest;
  attnd::ChunkHead head;
  int places = 0;
  const absl::StatusOr<attnd::ChunkRead> r =
      attnd::ReadStreamChunk(message, [&](const attnd::ChunkHead& h) -> absl::StatusOr<char*> {
        ++places;
        head = h;
        if (h.size > refuse_above) return absl::OutOfRangeError("refused");
        dest.reset(new char[h.size == 0 ? 1 : h.size]);  // exactly the bytes announced (new[0] is not dereferenceable)
        return dest.get();
      });
  ATTND_FUZZ_CHECK(places <= 1);
  ATTND_FUZZ_CHECK(r.ok() || r.status().message() == "refused");
  if (r.ok() && *r == attnd::ChunkRead::kOther) {
    // Left as it was, so that protobuf can parse it: the same bytes still there.
    grpc::Slice all;
    ATTND_FUZZ_CHECK(message.DumpToSingleSlice(&all).ok() || bytes.empty());
    if (!bytes.empty()) ATTND_FUZZ_CHECK(std::string(reinterpret_cast<const char*>(all.begin()), all.size()) == bytes);
    return 0;
  }
  ATTND_FUZZ_CHECK(places == 1);
  attnd::v1::ForwardStreamRequest expected;
  // The one known difference: lengths are read as 64-bit varints, so a length padded past protobuf's five
  // bytes (0x80 0x80 ... 0x00, the same value) is read here and refused by protobuf. The value read is the same
  // either way; everything protobuf parses must agree.
  if (!expected.ParseFromString(bytes)) return 0;
  ATTND_FUZZ_CHECK(expected.message_case() == attnd::v1::ForwardStreamRequest::kChunk);
  const attnd::v1::TensorChunk& c = expected.chunk();
  ATTND_FUZZ_CHECK(c.tensor() == head.tensor && c.offset() == head.offset && c.data().size() == head.size);
  if (r.ok()) {  // kDone
    ATTND_FUZZ_CHECK(head.size <= refuse_above);
    ATTND_FUZZ_CHECK(std::memcmp(dest.get(), c.data().data(), head.size) == 0);
  } else {
    ATTND_FUZZ_CHECK(head.size > refuse_above);
  }
  return 0;
}
