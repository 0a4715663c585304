// SerializeByReference (client/zero_copy.h): the bytes gRPC sends are exactly protobuf's serialisation, the
// tensors are not copied, and the message is kept alive by the slices and released with them.
#include "attnd/client/zero_copy.h"

#include <memory>
#include <string>
#include <vector>

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

}  // namespace
}  // namespace attnd::client
