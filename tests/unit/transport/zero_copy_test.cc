// attnd/transport/zero_copy.h: the bytes gRPC sends are exactly protobuf's serialisation, the tensors are not copied,
// a message is kept alive by its slices and released with them, and a chunk (of a ForwardStream, of a sequence's
// rows) or a Forward request read straight from the slices matches what protobuf parses (or is left to protobuf).
#include "attnd/transport/zero_copy.h"

#include <algorithm>
#include <memory>
#include <optional>
#include <random>
#include <string_view>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "attnd/client/client.h"
#include "attnd/client/tensors.h"
#include "gtest/gtest.h"
#include "grpcpp/support/slice.h"

namespace attnd::client {
namespace {

std::string Flatten(grpc::ByteBuffer& buf, std::vector<grpc::Slice>* slices) {
  EXPECT_TRUE(buf.Dump(slices).ok());
  std::string out;
  for (const grpc::Slice& s : *slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

std::shared_ptr<const v1::ForwardRequest> Request(const Shape& shape, bool lse) {
  RequestSpec spec;
  spec.shape = shape;
  spec.want_lse = lse;
  spec.request_id = "zero-copy";
  spec.scale = 0.125f;
  return std::make_shared<const v1::ForwardRequest>(MakeForwardRequest(
      spec, RandomTensor(DType::kBF16, QElems(shape), 1), RandomTensor(DType::kBF16, KVElems(shape), 2),
      RandomTensor(DType::kBF16, KVElems(shape), 3)));
}

TEST(SerializeByReference, SameBytesAsProtobufAndTheTensorsAreReferencedNotCopied) {
  auto request = Request(Shape{2, 64, 96, 8, 2, 128}, true);
  absl::StatusOr<grpc::ByteBuffer> buf = SerializeByReference(request);
  ASSERT_TRUE(buf.ok()) << buf.status();
  std::vector<grpc::Slice> slices;
  EXPECT_EQ(Flatten(*buf, &slices), request->SerializeAsString());
  for (const std::string* data : {&request->q().data(), &request->k().data(), &request->v().data()}) {
    bool referenced = false;
    for (const grpc::Slice& s : slices) {
      referenced |= reinterpret_cast<const char*>(s.begin()) == data->data() && s.size() == data->size();
    }
    EXPECT_TRUE(referenced) << "a tensor of " << data->size() << " bytes was copied";
  }
  // The header fields round-trip.
  v1::ForwardRequest back;
  ASSERT_TRUE(back.ParseFromString(request->SerializeAsString()));
  EXPECT_EQ(back.request_id(), "zero-copy");
}

TEST(SerializeByReference, SmallMessagesAreCopiedWhole) {
  auto request = Request(Shape{1, 1, 1, 1, 1, 64}, false);  // 128-byte tensors: below protobuf's aliasing cut
  absl::StatusOr<grpc::ByteBuffer> buf = SerializeByReference(request);
  ASSERT_TRUE(buf.ok()) << buf.status();
  std::vector<grpc::Slice> slices;
  EXPECT_EQ(Flatten(*buf, &slices), request->SerializeAsString());
  auto empty = std::make_shared<const v1::ForwardRequest>();
  absl::StatusOr<grpc::ByteBuffer> none = SerializeByReference(empty);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(none->Length(), 0u);
}

TEST(SerializeByReference, TheSlicesKeepTheMessageAliveUntilTheyGo) {
  auto request = Request(Shape{1, 128, 128, 4, 4, 64}, false);
  std::weak_ptr<const v1::ForwardRequest> watch = request;
  const std::string expected = request->SerializeAsString();
  auto buf = std::make_unique<grpc::ByteBuffer>(*SerializeByReference(request));
  EXPECT_GT(request.use_count(), 1);
  request.reset();
  ASSERT_FALSE(watch.expired()) << "the message went while slices still point into it";
  std::vector<grpc::Slice> slices;
  EXPECT_EQ(Flatten(*buf, &slices), expected);
  slices.clear();
  buf.reset();
  EXPECT_TRUE(watch.expired()) << "the slices did not release the message";
}

TEST(SerializeStreamChunk, SameBytesAsTheMessageForEverySizeAndOffset) {
  const std::string tensor = RandomTensor(DType::kBF16, 1 << 19, 4);  // 1 MiB
  for (size_t n : {size_t{0}, size_t{1}, size_t{127}, size_t{128}, size_t{300}, size_t{16384}, tensor.size()}) {
    for (uint64_t offset : {uint64_t{0}, uint64_t{5}, uint64_t{1} << 40}) {
      for (v1::TensorName name : {v1::TENSOR_NAME_Q, v1::TENSOR_NAME_V}) {
        v1::ForwardStreamRequest m;
        m.mutable_chunk()->set_tensor(name);
        m.mutable_chunk()->set_offset(offset);
        m.mutable_chunk()->set_data(tensor.data(), n);
        for (bool by_reference : {false, true}) {
          SCOPED_TRACE(testing::Message() << "n=" << n << " offset=" << offset << " ref=" << by_reference);
          auto owner = by_reference ? std::make_shared<const std::string>(tensor) : nullptr;
          const char* data = by_reference ? owner->data() : tensor.data();
          grpc::ByteBuffer buf = SerializeStreamChunk(name, offset, data, n, owner);
          std::vector<grpc::Slice> slices;
          EXPECT_EQ(Flatten(buf, &slices), m.SerializeAsString());
          bool referenced = false;
          for (const grpc::Slice& s : slices) referenced |= reinterpret_cast<const char*>(s.begin()) == data;
          EXPECT_EQ(referenced, by_reference && n > 0);
        }
      }
    }
  }
}

TEST(SerializeStreamChunk, AReferencedChunkKeepsItsOwnerUntilReleased) {
  auto owner = std::make_shared<const std::string>(RandomTensor(DType::kBF16, 4096, 5));
  std::weak_ptr<const std::string> watch = owner;
  auto buf = std::make_unique<grpc::ByteBuffer>(SerializeStreamChunk(v1::TENSOR_NAME_K, 0, owner->data(), 8192, owner));
  owner.reset();
  EXPECT_FALSE(watch.expired());
  buf.reset();
  EXPECT_TRUE(watch.expired());
}

// `bytes` as a ByteBuffer cut into slices of `piece` bytes, as gRPC may deliver it.
grpc::ByteBuffer Sliced(const std::string& bytes, size_t piece) {
  std::vector<grpc::Slice> slices;
  for (size_t at = 0; at < bytes.size(); at += piece) {
    slices.emplace_back(bytes.data() + at, std::min(piece, bytes.size() - at));
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

TEST(ReadStreamChunk, ReadsWhatProtobufAndTheWriterWriteAcrossSlices) {
  const std::string tensor = RandomTensor(DType::kBF16, 40000, 6);
  for (size_t n : {size_t{0}, size_t{1}, size_t{200}, tensor.size()}) {
    for (uint64_t offset : {uint64_t{0}, uint64_t{77}, uint64_t{1} << 40}) {
      v1::ForwardStreamResponse reply;  // the server's direction; requests are encoded the same
      reply.mutable_chunk()->set_tensor(v1::TENSOR_NAME_O);
      reply.mutable_chunk()->set_offset(offset);
      reply.mutable_chunk()->set_data(tensor.data(), n);
      v1::ForwardStreamRequest request;
      request.mutable_chunk()->set_tensor(v1::TENSOR_NAME_K);
      request.mutable_chunk()->set_offset(offset);
      request.mutable_chunk()->set_data(tensor.data(), n);
      grpc::ByteBuffer written = SerializeStreamChunk(v1::TENSOR_NAME_K, offset, tensor.data(), n, nullptr);
      grpc::ByteBuffer inputs[] = {Sliced(reply.SerializeAsString(), 7), Sliced(request.SerializeAsString(), 4096),
                                   written};
      const int32_t names[] = {v1::TENSOR_NAME_O, v1::TENSOR_NAME_K, v1::TENSOR_NAME_K};
      for (int i = 0; i < 3; ++i) {
        SCOPED_TRACE(testing::Message() << "n=" << n << " offset=" << offset << " input " << i);
        std::string out(n, '\x5a');
        ChunkHead seen;
        const absl::StatusOr<ChunkRead> r = ReadStreamChunk(inputs[i], [&](const ChunkHead& h) -> absl::StatusOr<char*> {
          seen = h;
          return out.data();
        });
        ASSERT_TRUE(r.ok()) << r.status();
        ASSERT_EQ(*r, ChunkRead::kDone);
        EXPECT_EQ(seen.tensor, names[i]);
        EXPECT_EQ(seen.offset, offset);
        EXPECT_EQ(seen.size, n);
        EXPECT_TRUE(out == tensor.substr(0, n));
      }
    }
  }
}

TEST(ReadStreamChunk, AnythingElseIsLeftToProtobufAndARefusalCopiesNothing) {
  v1::ForwardStreamRequest header;
  header.mutable_header()->set_request_id("h");
  v1::ForwardStreamRequest chunk;
  chunk.mutable_chunk()->set_tensor(v1::TENSOR_NAME_V);
  chunk.mutable_chunk()->set_offset(3);
  chunk.mutable_chunk()->set_data("abcdef");
  const std::string good = chunk.SerializeAsString();
  // Wire variants protobuf accepts but the fast path does not take: its fields twice, out of order, an
  // unknown field, a second chunk field (protobuf merges them), a truncated message.
  v1::ForwardStreamRequest second;
  second.mutable_chunk()->set_offset(9);
  const std::string out_of_order = std::string("\x12\x0a\x10\x03\x08\x03\x1a\x04wxyz", 12);
  const std::string unknown = std::string("\x12\x0a\x08\x03\x10\x03\x1a\x02xy\x20\x01", 12);
  const std::string cases[] = {header.SerializeAsString(), "", good + second.SerializeAsString(), out_of_order,
                               unknown, good.substr(0, good.size() - 2)};
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); ++i) {
    grpc::ByteBuffer b = Sliced(cases[i], 3);
    bool placed = false;
    const absl::StatusOr<ChunkRead> r = ReadStreamChunk(b, [&](const ChunkHead&) -> absl::StatusOr<char*> {
      placed = true;
      return absl::OutOfRangeError("no room");
    });
    ASSERT_TRUE(r.ok()) << "case " << i << ": " << r.status();
    EXPECT_EQ(*r, ChunkRead::kOther) << "case " << i;
    EXPECT_FALSE(placed) << "case " << i;
    // What was left to protobuf is still there for it.
    if (i != 5) {
      v1::ForwardStreamRequest parsed;
      std::vector<grpc::Slice> slices;
      EXPECT_TRUE(parsed.ParseFromString(Flatten(b, &slices))) << "case " << i;
    }
  }
  grpc::ByteBuffer b = Sliced(good, 5);
  std::string out(6, '-');
  const absl::StatusOr<ChunkRead> refused = ReadStreamChunk(b, [&](const ChunkHead& h) -> absl::StatusOr<char*> {
    EXPECT_EQ(h.size, 6u);
    return absl::OutOfRangeError("v: past the tensor's end");
  });
  EXPECT_EQ(refused.status(), absl::OutOfRangeError("v: past the tensor's end"));  // the placement's own status
  EXPECT_EQ(out, "------");
}

// `request` without its tensors: what a reader of the header fields should see.
v1::ForwardRequest WithoutTensors(const v1::ForwardRequest& request) {
  v1::ForwardRequest header = request;
  header.clear_q();
  header.clear_k();
  header.clear_v();
  return header;
}

TEST(SerializeForwardRequest, ParsesToTheRequestItDescribes) {
  auto full = Request(Shape{1, 32, 48, 4, 2, 64}, true);
  const v1::ForwardRequest header = WithoutTensors(*full);
  const std::optional<std::string_view> tensors[3] = {full->q().data(), full->k().data(), full->v().data()};
  for (bool by_reference : {false, true}) {
    auto owner = by_reference ? std::shared_ptr<const void>(full) : nullptr;
    grpc::ByteBuffer buf = SerializeForwardRequest(header, tensors, owner);
    std::vector<grpc::Slice> slices;
    v1::ForwardRequest parsed;
    ASSERT_TRUE(parsed.ParseFromString(Flatten(buf, &slices)));
    EXPECT_EQ(parsed.SerializeAsString(), full->SerializeAsString()) << "by_reference=" << by_reference;
    bool referenced = false;
    for (const grpc::Slice& sl : slices) referenced |= reinterpret_cast<const char*>(sl.begin()) == full->k().data().data();
    EXPECT_EQ(referenced, by_reference);
  }
  // A reference stays in the header, an empty tensor is present but empty, a missing one stays missing.
  v1::ForwardRequest mixed = header;
  mixed.mutable_q()->mutable_ref()->set_buffer_id("buf-1");
  const std::optional<std::string_view> partial[3] = {std::nullopt, std::string_view(), std::nullopt};
  grpc::ByteBuffer buf = SerializeForwardRequest(mixed, partial, nullptr);
  std::vector<grpc::Slice> slices;
  v1::ForwardRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(Flatten(buf, &slices)));
  EXPECT_EQ(parsed.q().ref().buffer_id(), "buf-1");
  EXPECT_EQ(parsed.k().source_case(), v1::TensorInput::kData);
  EXPECT_TRUE(parsed.k().data().empty());
  EXPECT_FALSE(parsed.has_v());
}

std::string Joined(const InlineBytes& t) {
  std::string out;
  for (const absl::Span<const uint8_t>& p : t.pieces) out.append(reinterpret_cast<const char*>(p.data()), p.size());
  return out;
}

// Whether every piece lies inside one of the slices: read in place, not copied.
bool InSlices(const InlineBytes& t, const std::vector<grpc::Slice>& slices) {
  for (const absl::Span<const uint8_t>& p : t.pieces) {
    bool inside = false;
    for (const grpc::Slice& s : slices) inside |= p.data() >= s.begin() && p.data() + p.size() <= s.end();
    if (!inside) return false;
  }
  return true;
}

TEST(ReadForwardRequest, LeavesTheTensorsInTheSlicesAndParsesTheRest) {
  auto full = Request(Shape{2, 33, 47, 4, 2, 64}, true);
  const v1::ForwardRequest header = WithoutTensors(*full);
  const std::string* want[3] = {&full->q().data(), &full->k().data(), &full->v().data()};
  const std::optional<std::string_view> tensors[3] = {*want[0], *want[1], *want[2]};
  // Protobuf's own bytes cut into slices of several sizes (1 byte: every varint straddles a boundary), and the
  // client's header + tensors form with the tensors by reference.
  std::vector<grpc::ByteBuffer> inputs;
  for (size_t cut : {size_t{1}, size_t{3}, size_t{1000}, size_t{1} << 20}) inputs.push_back(Sliced(full->SerializeAsString(), cut));
  inputs.push_back(SerializeForwardRequest(header, tensors, full));
  for (size_t i = 0; i < inputs.size(); ++i) {
    SCOPED_TRACE(testing::Message() << "input " << i);
    v1::ForwardRequest got;
    InlineBytes t[3];
    auto slices = std::make_unique<std::vector<grpc::Slice>>();
    ASSERT_TRUE(ReadForwardRequest(inputs[i], slices.get(), &got, t));
    EXPECT_EQ(got.SerializeAsString(), header.SerializeAsString());
    // The pieces stay valid as long as the slices are kept, whatever happens to the message: 1-byte slices
    // keep their bytes inside the slice objects.
    inputs[i].Clear();
    auto moved = std::move(slices);
    for (int j = 0; j < 3; ++j) {
      EXPECT_TRUE(t[j].present);
      EXPECT_EQ(t[j].size, want[j]->size());
      EXPECT_TRUE(Joined(t[j]) == *want[j]) << "tensor " << j;
      EXPECT_TRUE(InSlices(t[j], *moved)) << "tensor " << j;
    }
  }
}

TEST(ReadForwardRequest, ReferencesAndEmptyTensorsGoToProtobufAndOddEncodingsAreLeftToIt) {
  v1::ForwardRequest header;
  header.set_request_id("odd");
  header.mutable_shape()->set_q_len(5);
  v1::ForwardRequest mixed = header;
  mixed.mutable_q()->mutable_ref()->set_buffer_id("buf-1");
  mixed.mutable_k();  // present, no source: validation answers "missing"
  mixed.mutable_v()->set_data("vvvv");
  {
    grpc::ByteBuffer b = Sliced(mixed.SerializeAsString(), 2);
    v1::ForwardRequest got;
    InlineBytes t[3];
    std::vector<grpc::Slice> slices;
    ASSERT_TRUE(ReadForwardRequest(b, &slices, &got, t));
    EXPECT_EQ(got.q().ref().buffer_id(), "buf-1");
    EXPECT_FALSE(t[0].present);
    EXPECT_TRUE(got.has_k());
    EXPECT_EQ(got.k().source_case(), v1::TensorInput::SOURCE_NOT_SET);
    EXPECT_FALSE(t[1].present);
    EXPECT_FALSE(got.has_v());
    EXPECT_EQ(Joined(t[2]), "vvvv");
  }
  // A TensorInput with data and more after it (an unknown field 7): protobuf parses it, data included.
  {
    const std::string q_field = std::string("\x3a\x08\x0a\x04qqqq\x38\x01", 10);
    grpc::ByteBuffer b = Sliced(header.SerializeAsString() + q_field, 4);
    v1::ForwardRequest got;
    InlineBytes t[3];
    std::vector<grpc::Slice> slices;
    ASSERT_TRUE(ReadForwardRequest(b, &slices, &got, t));
    EXPECT_FALSE(t[0].present);
    EXPECT_EQ(got.q().data(), "qqqq");
    EXPECT_EQ(got.request_id(), "odd");
  }
  // Left to protobuf: a tensor field twice (protobuf merges the parts), a length past the end, a bad wire type,
  // a truncated varint.
  v1::ForwardRequest k_only;
  k_only.mutable_k()->set_data("kk");
  const std::string good = mixed.SerializeAsString();
  for (const std::string& bad : {good + k_only.SerializeAsString(), good.substr(0, good.size() - 1),
                                 std::string("\x0f\x01", 2), std::string("\x08\x80", 2)}) {
    grpc::ByteBuffer b = Sliced(bad, 3);
    v1::ForwardRequest got;
    InlineBytes t[3];
    std::vector<grpc::Slice> slices;
    EXPECT_FALSE(ReadForwardRequest(b, &slices, &got, t));
  }
}

// Requests written field by field in a random order, some fields twice, some tensors as references or absent, cut
// into random slices: whenever ReadForwardRequest takes a request, it must describe what protobuf parses from the
// same bytes; when it declines, protobuf gets the bytes as they were.
TEST(ReadForwardRequest, AgreesWithProtobufOnShuffledAndRepeatedFields) {
  std::mt19937 rng(7);
  const std::string tensor_bytes = RandomTensor(DType::kBF16, 3000, 9);
  int taken = 0, declined = 0;
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<std::string> fields;  // each a serialised ForwardRequest with one field set
    const auto add = [&fields](const v1::ForwardRequest& one) { fields.push_back(one.SerializeAsString()); };
    v1::ForwardRequest f;
    f.set_request_id("r" + std::to_string(trial));
    add(f);
    f.Clear();
    f.mutable_shape()->set_q_len(static_cast<int64_t>(rng() % 100));
    add(f);
    f.Clear();
    f.set_softmax_scale(0.5f);
    add(f);
    for (int t = 0; t < 3; ++t) {
      for (int copies = static_cast<int>(rng() % 3) - (rng() % 4 == 0 ? 0 : 1); copies > 0; --copies) {
        f.Clear();
        v1::TensorInput* in = t == 0 ? f.mutable_q() : t == 1 ? f.mutable_k() : f.mutable_v();
        if (rng() % 5 == 0) {
          in->mutable_ref()->set_buffer_id("buf");
        } else {
          in->set_data(tensor_bytes.substr(rng() % 100, 1 + rng() % 2000));
        }
        add(f);
      }
    }
    std::shuffle(fields.begin(), fields.end(), rng);
    std::string bytes;
    for (const std::string& one : fields) bytes += one;
    v1::ForwardRequest want;
    ASSERT_TRUE(want.ParseFromString(bytes));
    grpc::ByteBuffer buf = Sliced(bytes, 1 + rng() % 700);
    v1::ForwardRequest got;
    InlineBytes t[3];
    std::vector<grpc::Slice> slices;
    if (!ReadForwardRequest(buf, &slices, &got, t)) {
      ++declined;
      std::vector<grpc::Slice> unchanged;
      EXPECT_EQ(Flatten(buf, &unchanged), bytes) << "trial " << trial;
      continue;
    }
    ++taken;
    v1::ForwardRequest merged = got;  // the header, with the tensors read in place put back
    for (int j = 0; j < 3; ++j) {
      if (!t[j].present) continue;
      v1::TensorInput* in = j == 0 ? merged.mutable_q() : j == 1 ? merged.mutable_k() : merged.mutable_v();
      EXPECT_EQ(in->source_case(), v1::TensorInput::SOURCE_NOT_SET) << "trial " << trial << " tensor " << j;
      in->set_data(Joined(t[j]));
      EXPECT_TRUE(InSlices(t[j], slices));
    }
    EXPECT_EQ(merged.SerializeAsString(), want.SerializeAsString()) << "trial " << trial;
  }
  // Both paths ran.
  EXPECT_GT(taken, 50);
  EXPECT_GT(declined, 20);
}

TEST(ParseSmallFields, HeaderFieldsWithoutTheTensors) {
  auto request = Request(Shape{1, 64, 64, 4, 4, 64}, true);  // 32 KiB tensors
  grpc::ByteBuffer buf = *SerializeByReference(request);
  v1::ForwardRequest header;
  ASSERT_TRUE(ParseSmallFields(buf, &header));
  EXPECT_EQ(header.request_id(), "zero-copy");
  EXPECT_EQ(header.shape().q_len(), 64);
  EXPECT_EQ(header.softmax_scale(), 0.125f);  // a fixed32 field
  EXPECT_TRUE(header.return_lse());
  EXPECT_FALSE(header.has_q());  // skipped, not copied
  EXPECT_FALSE(header.has_v());
  // Under the threshold a tensor is kept; the buffer itself is untouched.
  v1::ForwardRequest whole;
  ASSERT_TRUE(ParseSmallFields(buf, &whole, 1 << 20));
  EXPECT_EQ(whole.q().data(), request->q().data());
  std::vector<grpc::Slice> slices;
  EXPECT_EQ(Flatten(buf, &slices), request->SerializeAsString());
  // Malformed bytes: a length past the end, a bad wire type.
  for (const std::string& bad : {std::string("\x0a\x05" "ab", 4), std::string("\x0f\x01", 2)}) {
    v1::ForwardRequest m;
    EXPECT_FALSE(ParseSmallFields(Sliced(bad, 1), &m));
  }
}

TEST(ReadForwardResponse, OAndLseGoIntoTheCallersMemoryAndTheRestToProtobuf) {
  v1::ForwardResponse full;
  full.set_request_id("reply");
  full.set_o(RandomTensor(DType::kBF16, 3000, 7));
  std::string lse(4 * 97, '\0');
  for (size_t i = 0; i < lse.size(); ++i) lse[i] = static_cast<char>(i * 31 + 5);
  full.set_lse(lse);
  full.mutable_timing()->set_kernel_us(12.5);
  full.set_backend("cuda");
  full.set_kernel("hopper");
  full.set_device(3);
  v1::ForwardResponse header = full;
  header.clear_o();
  header.clear_lse();
  const uint64_t o_n = full.o().size(), lse_n = lse.size();
  // Cut into slices of several sizes (1 byte: every varint and every byte of O straddles a boundary).
  for (size_t cut : {size_t{1}, size_t{7}, size_t{1000}, size_t{1} << 20}) {
    SCOPED_TRACE(cut);
    std::string memory(o_n + lse_n + 2, '\x5a');  // one guard byte after each destination
    const absl::Span<char> o(memory.data(), o_n), l(memory.data() + o_n + 1, lse_n);
    v1::ForwardResponse got;
    uint64_t got_o = 1, got_lse = 1;
    const absl::Status s = ReadForwardResponse(Sliced(full.SerializeAsString(), cut), &got, o, l, &got_o, &got_lse);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(got.SerializeAsString(), header.SerializeAsString());
    EXPECT_EQ(got_o, o_n);
    EXPECT_EQ(got_lse, lse_n);
    EXPECT_TRUE(std::string_view(o.data(), o.size()) == full.o());
    EXPECT_TRUE(std::string_view(l.data(), l.size()) == lse);
    EXPECT_EQ(memory[o_n], '\x5a');
    EXPECT_EQ(memory.back(), '\x5a');
  }
  // No LSE in the reply (not asked for): its size is 0 and its destination untouched.
  {
    v1::ForwardResponse no_lse = full;
    no_lse.clear_lse();
    std::string memory(o_n + 4, '\x5a');
    v1::ForwardResponse got;
    uint64_t got_o = 0, got_lse = 9;
    ASSERT_TRUE(ReadForwardResponse(Sliced(no_lse.SerializeAsString(), 5), &got,
                                    absl::Span<char>(memory.data(), o_n), absl::Span<char>(memory.data() + o_n, 4),
                                    &got_o, &got_lse)
                    .ok());
    EXPECT_EQ(got_o, o_n);
    EXPECT_EQ(got_lse, 0u);
    EXPECT_EQ(memory.substr(o_n), std::string(4, '\x5a'));
  }
  // What cannot be honoured: O longer than its destination (nothing written), O twice, malformed bytes.
  struct Bad {
    std::string name, bytes, error;
  };
  const std::string twice = full.SerializeAsString() + v1::ForwardResponse(full).SerializeAsString();
  for (const Bad& bad : {Bad{"o too long", full.SerializeAsString(), "more than the"},
                         Bad{"o twice", twice, "twice"},
                         Bad{"cut short", full.SerializeAsString().substr(0, 100), "unreadable"},
                         Bad{"bad wire type", std::string("\x0f\x01", 2), "unreadable"}}) {
    SCOPED_TRACE(bad.name);
    const uint64_t room = bad.name == "o too long" ? o_n - 2 : o_n;
    std::string memory(room + lse_n + 1, '\x5a');
    v1::ForwardResponse got;
    uint64_t got_o = 0, got_lse = 0;
    const absl::Status s =
        ReadForwardResponse(Sliced(bad.bytes, 64), &got, absl::Span<char>(memory.data(), room),
                            absl::Span<char>(memory.data() + room, lse_n), &got_o, &got_lse);
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
    EXPECT_TRUE(absl::StrContains(s.message(), bad.error)) << s;
    if (bad.name == "o too long") {
      EXPECT_EQ(memory.substr(0, room), std::string(room, '\x5a'));
    }
    EXPECT_EQ(memory.back(), '\x5a');
  }
}


// A chunk of rows as the exporter sends it, for the sequence-chunk tests.
v1::ExportSequenceResponse RowsChunk(int64_t layer, int32_t kv, int64_t first, const std::string& data) {
  v1::ExportSequenceResponse m;
  m.mutable_chunk()->set_layer(layer);
  m.mutable_chunk()->set_kv(kv);
  m.mutable_chunk()->set_first_token(first);
  m.mutable_chunk()->set_data(data);
  return m;
}

TEST(SerializeSequenceChunk, SameBytesAsProtobufInOneSliceWithTheDataWrittenInPlace) {
  const std::string rows = RandomTensor(DType::kBF16, 3 * 1024, 8);
  v1::ExportSequenceResponse header;
  header.mutable_chunk()->mutable_sequence()->set_max_tokens(4096);
  header.mutable_chunk()->mutable_sequence()->add_lengths(40);
  for (const v1::ExportSequenceResponse& want :
       {header, RowsChunk(0, 0, 0, rows), RowsChunk(3, 1, 1 << 20, rows), RowsChunk(1, 0, 5, rows.substr(0, 2))}) {
    v1::SequenceChunk fields = want.chunk();
    const std::string data = fields.data();
    fields.clear_data();
    absl::StatusOr<grpc::ByteBuffer> buf = SerializeSequenceChunk(fields, data.size(), [&](uint8_t* at) {
      std::copy(data.begin(), data.end(), at);
      return absl::OkStatus();
    });
    ASSERT_TRUE(buf.ok()) << buf.status();
    std::vector<grpc::Slice> slices;
    EXPECT_EQ(Flatten(*buf, &slices), want.SerializeAsString());
    EXPECT_EQ(slices.size(), 1u);
  }
  // The fill's refusal is the answer.
  absl::StatusOr<grpc::ByteBuffer> refused =
      SerializeSequenceChunk(v1::SequenceChunk(), 8, [](uint8_t*) { return absl::DataLossError("no rows"); });
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kDataLoss);
}

// `chunk` (SequenceChunk bytes) as the chunk field of an ExportSequenceResponse / ImportSequenceRequest.
std::string WrapChunk(const std::string& chunk) {
  std::string out("\x0a", 1);
  for (uint64_t v = chunk.size();; v >>= 7) {
    out.push_back(static_cast<char>((v & 0x7f) | (v >= 0x80 ? 0x80 : 0)));
    if (v < 0x80) break;
  }
  return out + chunk;
}

TEST(ReadSequenceChunk, LeavesTheRowsInTheSlicesAndParsesTheRest) {
  const std::string rows = RandomTensor(DType::kBF16, 5000, 9);
  const v1::ExportSequenceResponse sent = RowsChunk(2, 1, 300, rows);
  v1::SequenceChunk want = sent.chunk();
  want.clear_data();
  v1::SequenceChunk data_only;
  data_only.set_data(rows);
  // Protobuf's bytes cut into slices of several sizes (1 byte: every varint straddles a boundary); and the data
  // before the other fields, after an unknown top-level field (field 7, varint 7), which protobuf skips.
  std::vector<grpc::ByteBuffer> inputs;
  for (size_t cut : {size_t{1}, size_t{3}, size_t{4096}, size_t{1} << 20}) {
    inputs.push_back(Sliced(sent.SerializeAsString(), cut));
  }
  inputs.push_back(
      Sliced(std::string("\x38\x07", 2) + WrapChunk(data_only.SerializeAsString() + want.SerializeAsString()), 5));
  for (size_t i = 0; i < inputs.size(); ++i) {
    SCOPED_TRACE(testing::Message() << "input " << i);
    v1::SequenceChunk got;
    InlineBytes data;
    std::vector<grpc::Slice> slices;
    ASSERT_TRUE(ReadSequenceChunk(inputs[i], &slices, &got, &data));
    EXPECT_EQ(got.SerializeAsString(), want.SerializeAsString());
    EXPECT_TRUE(data.present);
    EXPECT_EQ(data.size, rows.size());
    EXPECT_TRUE(Joined(data) == rows);
    EXPECT_TRUE(InSlices(data, slices));
  }
}

TEST(ReadSequenceChunk, RepeatedPartsAndBrokenBytesAreLeftToProtobuf) {
  const std::string one = RowsChunk(0, 0, 0, "abcd").SerializeAsString();
  v1::SequenceChunk a, b;
  a.set_data("abcd");
  b.set_data("efgh");
  const std::string inputs[] = {
      one + one,                                                 // the chunk twice: protobuf merges them
      WrapChunk(a.SerializeAsString() + b.SerializeAsString()),  // its data twice: protobuf keeps the last
      one.substr(0, one.size() - 1),                             // cut short
      std::string("\x0a\x05\x2a\x09", 4) + "abcdefghi",          // data running past the chunk's end
  };
  for (const std::string& bytes : inputs) {
    grpc::ByteBuffer buf = Sliced(bytes, 3);
    v1::SequenceChunk got;
    InlineBytes data;
    std::vector<grpc::Slice> slices;
    EXPECT_FALSE(ReadSequenceChunk(buf, &slices, &got, &data)) << testing::PrintToString(bytes);
  }
}

}  // namespace
}  // namespace attnd::client
