// Moving tensors through gRPC without extra copies. gRPC's protobuf serialiser copies every byte of a
// message into fresh slices (for a 25 MB request: a 25 MB allocation, its page faults and a memcpy, on every
// call), and its parser copies every byte out of them. Protobuf can hand `bytes` fields to the output stream
// by reference (CodedOutputStream::EnableAliasing + ZeroCopyOutputStream::WriteAliasedRaw): the stream here
// turns each such reference into a gRPC slice over the owner's memory, so the transport writes the tensors
// from where they are. ForwardStream chunks are written and read here field by field, so that their data
// goes from the caller's tensor to the wire, and from the wire to the receiver's tensor, in one copy.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string_view>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/types/span.h"
#include "absl/status/statusor.h"
#include "attnd/v1/attention.pb.h"
#include "google/protobuf/message_lite.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"

namespace attnd {

// `message` in wire format as gRPC slices: its large bytes fields by reference, the rest (tags, lengths,
// small fields) copied. Every referencing slice holds a share of `message`, so the message lives until gRPC
// has let go of the last of them, which may be after the call that sent it has completed.
absl::StatusOr<grpc::ByteBuffer> SerializeByReference(std::shared_ptr<const google::protobuf::MessageLite> message);

// The ForwardStreamRequest {chunk {tensor, offset, data}} in wire format without building the message, so
// that `data` (n bytes inside a tensor the caller holds) is copied once at most: referenced when `owner` is
// set (each slice holding a share of it), copied into gRPC's slice otherwise. The same bytes as protobuf's
// serialisation of that message.
// ForwardStreamRequest and ForwardStreamResponse both carry `TensorChunk chunk = 2`, so this serves either.
grpc::ByteBuffer SerializeStreamChunk(v1::TensorName tensor, uint64_t offset, const char* data, size_t n,
                                      std::shared_ptr<const void> owner);

// A ForwardRequest in wire format: `header` (every field but the inline tensor bytes; its q, k, v must be
// unset or references) followed by q, k, v as TensorInput{data} for each tensor given in `tensors`
// (an empty view is an empty but present tensor). The bytes by reference when `owner` is set (each slice
// holding a share of it), copied otherwise. Parses to the request they describe.
grpc::ByteBuffer SerializeForwardRequest(const v1::ForwardRequest& header,
                                         const std::optional<std::string_view> (&tensors)[3],
                                         std::shared_ptr<const void> owner);

struct ChunkHead {
  int32_t tensor = 0;  // a v1::TensorName value, unchecked
  uint64_t offset = 0;
  uint64_t size = 0;  // bytes of data
};

enum class ChunkRead {
  kDone,   // the data was copied where `place` said
  kOther,  // not a chunk in protobuf's canonical encoding (a header, unknown or repeated fields, ...):
           // parse the message with protobuf instead
};

// Reads a ForwardStream(Request|Response) that holds a chunk written the way protobuf and
// SerializeStreamChunk write one (fields in order, each once, nothing else): the head first, then
// `place(head)` says where its `size` data bytes go and they are copied there straight from gRPC's slices.
// A placement that refuses the chunk (an error) is returned as is, with nothing copied. `message` is left as it
// was, so kOther can fall back to protobuf.
absl::StatusOr<ChunkRead> ReadStreamChunk(grpc::ByteBuffer& message,
                                          absl::FunctionRef<absl::StatusOr<char*>(const ChunkHead&)> place);

// One inline tensor of a ForwardRequest read by ReadForwardRequest: its `data` bytes where they lie in the
// message's slices, in order.
struct InlineBytes {
  bool present = false;  // the request carried this tensor's `data`
  uint64_t size = 0;     // total bytes over `pieces`
  std::vector<absl::Span<const uint8_t>> pieces;
};

// Reads a ForwardRequest without copying its inline tensors: `header` gets every other field (parsed by
// protobuf), and each of q, k, v written as TensorInput{data} alone (as protobuf and SerializeForwardRequest
// write it) is left in the message and described in tensors[0..2]. The pieces point into `slices`, which
// receives the message's slices: gRPC keeps a small slice's bytes inside the slice object itself, so the
// vector must stay alive and unchanged (it may be moved) while the pieces are used. A TensorInput holding
// anything else (a reference) is parsed into `header`. False, with the outputs unspecified, when the bytes are
// not a well-formed message or a tensor field repeats (protobuf would merge the parts): parse the message with
// protobuf instead, which also reports what is wrong with it.
bool ReadForwardRequest(const grpc::ByteBuffer& message, std::vector<grpc::Slice>* slices, v1::ForwardRequest* header,
                        InlineBytes (&tensors)[3]);

// Reads a ForwardResponse with its o and lse bytes copied straight from gRPC's slices into the caller's `o`
// and `lse` (one copy, no string of their own) and every other field parsed by protobuf into `header`.
// *o_size / *lse_size get the bytes each field held. INTERNAL when the bytes are not a well-formed message,
// when o or lse comes twice (protobuf would keep the last) or is longer than its destination (nothing is
// written past a destination's end).
absl::Status ReadForwardResponse(const grpc::ByteBuffer& message, v1::ForwardResponse* header, absl::Span<char> o,
                                 absl::Span<char> lse, uint64_t* o_size, uint64_t* lse_size);

// An ExportSequenceResponse, which is also an ImportSequenceRequest (both hold `SequenceChunk chunk = 1`): `fields`
// (a chunk without data) and `n` bytes of data, in one slice whose data `fill` writes in place, so that a sequence's
// rows go from its pages into the message in one copy. The same bytes as protobuf's serialisation of that message.
// fill's error is returned as is.
absl::StatusOr<grpc::ByteBuffer> SerializeSequenceChunk(const v1::SequenceChunk& fields, size_t n,
                                                        absl::FunctionRef<absl::Status(uint8_t*)> fill);

// Reads an ImportSequenceRequest (or ExportSequenceResponse) without copying the chunk's data: `fields` gets every
// other field of the chunk (parsed by protobuf), and `data` where the data bytes lie in `slices`, which receives the
// message's slices and must stay alive and unchanged while the pieces are used (as ReadForwardRequest's). False,
// with the outputs unspecified, when the bytes are not a well-formed message or the chunk or its data repeats
// (protobuf would merge or keep the last): parse the message with protobuf instead, which also reports what is wrong.
bool ReadSequenceChunk(const grpc::ByteBuffer& message, std::vector<grpc::Slice>* slices, v1::SequenceChunk* fields,
                       InlineBytes* data);

// Parses `message` into `out` leaving out every top-level length-delimited field longer than
// `max_field_bytes` (the tensors), which are skipped, not copied: to look at a request's or reply's
// header fields cheaply. False if the bytes are not a well-formed message.
bool ParseSmallFields(const grpc::ByteBuffer& message, google::protobuf::MessageLite* out,
                      uint32_t max_field_bytes = 4096);

}  // namespace attnd
