// Serialising a large request without copying its tensors. gRPC's protobuf serialiser copies every byte
// of a message into fresh slices (for a 25 MB request: a 25 MB allocation, its page faults and a memcpy,
// on every call). Protobuf can instead hand `bytes` fields to the output stream by reference
// (CodedOutputStream::EnableAliasing + ZeroCopyOutputStream::WriteAliasedRaw); the stream here turns each
// such reference into a gRPC slice over the caller's memory, so the transport writes the tensors straight
// from where they are.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "attnd/v1/attention.pb.h"
#include "google/protobuf/message_lite.h"
#include "grpcpp/support/byte_buffer.h"

namespace attnd::client {

// `message` in wire format as gRPC slices: its large bytes fields by reference, the rest (tags, lengths,
// small fields) copied. Every referencing slice holds a share of `message`, so the message lives until gRPC
// has let go of the last of them, which may be after the call that sent it has completed.
absl::StatusOr<grpc::ByteBuffer> SerializeByReference(std::shared_ptr<const google::protobuf::MessageLite> message);

// The ForwardStreamRequest {chunk {tensor, offset, data}} in wire format without building the message, so
// that `data` (n bytes inside a tensor the caller holds) is copied once at most: referenced when `owner` is
// set (each slice holding a share of it), copied into gRPC's slice otherwise. The same bytes as protobuf's
// serialisation of that message.
grpc::ByteBuffer SerializeStreamChunk(v1::TensorName tensor, uint64_t offset, const char* data, size_t n,
                                      std::shared_ptr<const void> owner);

}  // namespace attnd::client
