#include "attnd/transport/zero_copy.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "grpcpp/support/proto_buffer_reader.h"
#include "grpcpp/support/slice.h"

namespace attnd {
namespace {

using google::protobuf::MessageLite;

// A length-delimited field's tag (protobuf wire type 2).
uint32_t LengthDelimitedTag(int field) { return static_cast<uint32_t>(field) << 3 | 2; }

// A slice over `n` bytes at `data` that holds a share of their owner until gRPC drops it.
grpc::Slice ReferenceSlice(const char* data, size_t n, std::shared_ptr<const void> owner) {
  auto* share = new std::shared_ptr<const void>(std::move(owner));
  return grpc::Slice(const_cast<char*>(data), n, [](void* p) { delete static_cast<std::shared_ptr<const void>*>(p); },
                     share);
}

// Copied bytes go to a growing buffer that becomes one slice whenever a reference interrupts it; referenced
// bytes become slices of their own.
class SliceWriter final : public google::protobuf::io::ZeroCopyOutputStream {
 public:
  explicit SliceWriter(std::shared_ptr<const void> owner) : owner_(std::move(owner)) {}

  bool Next(void** data, int* size) override {
    const size_t used = pending_.size();
    pending_.resize(used + kBlock);
    *data = pending_.data() + used;
    *size = static_cast<int>(kBlock);
    return true;
  }

  void BackUp(int count) override { pending_.resize(pending_.size() - static_cast<size_t>(count)); }

  int64_t ByteCount() const override { return flushed_ + static_cast<int64_t>(pending_.size()); }

  bool AllowsAliasing() const override { return true; }

  bool WriteAliasedRaw(const void* data, int size) override {
    Flush();
    slices_.push_back(ReferenceSlice(static_cast<const char*>(data), static_cast<size_t>(size), owner_));
    flushed_ += size;
    return true;
  }

  grpc::ByteBuffer Finish() {
    Flush();
    return grpc::ByteBuffer(slices_.data(), slices_.size());
  }

 private:
  static constexpr size_t kBlock = 4096;

  void Flush() {
    if (pending_.empty()) return;
    slices_.emplace_back(pending_.data(), pending_.size());  // copies
    flushed_ += static_cast<int64_t>(pending_.size());
    pending_.clear();
  }

  const std::shared_ptr<const void> owner_;
  std::string pending_;
  std::vector<grpc::Slice> slices_;
  int64_t flushed_ = 0;
};

// A forward-only reader over a message's slices: protobuf varints, and byte runs either copied or noted
// where they lie.
class SliceCursor {
 public:
  explicit SliceCursor(const std::vector<grpc::Slice>& slices) : slices_(&slices) { Settle(); }

  bool AtEnd() const { return index_ == slices_->size(); }
  uint64_t position() const { return position_; }

  bool ReadVarint(uint64_t* v) {
    *v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (AtEnd()) return false;
      const uint8_t b = (*slices_)[index_].begin()[offset_];
      Advance(1);
      *v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if ((b & 0x80) == 0) return true;
    }
    return false;  // more than ten bytes: not a varint
  }

  // The next n bytes as runs inside the slices (appended to `pieces` when given), or appended to `copy`.
  bool Take(uint64_t n, std::vector<absl::Span<const uint8_t>>* pieces, std::string* copy) {
    while (n > 0) {
      if (AtEnd()) return false;
      const grpc::Slice& s = (*slices_)[index_];
      const size_t run = static_cast<size_t>(std::min<uint64_t>(n, s.size() - offset_));
      const uint8_t* at = s.begin() + offset_;
      if (pieces != nullptr) pieces->emplace_back(at, run);
      if (copy != nullptr) copy->append(reinterpret_cast<const char*>(at), run);
      Advance(run);
      n -= run;
    }
    return true;
  }

 private:
  void Advance(size_t n) {
    offset_ += n;
    position_ += n;
    Settle();
  }
  void Settle() {  // skips finished and empty slices
    while (index_ < slices_->size() && offset_ == (*slices_)[index_].size()) {
      ++index_;
      offset_ = 0;
    }
  }

  const std::vector<grpc::Slice>* slices_;
  size_t index_ = 0, offset_ = 0;
  uint64_t position_ = 0;
};

void AppendVarint(uint64_t v, std::string* out) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>(v | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

// One field whose tag has just been read, copied onto `kept` as it came (the tag, then the value), for protobuf
// to parse. False for malformed bytes and for wire types proto3 does not have (groups, invalid ones).
bool KeepField(SliceCursor& in, uint64_t tag, std::string* kept) {
  AppendVarint(tag, kept);
  uint64_t v = 0;
  switch (tag & 7) {
    case 0:
      if (!in.ReadVarint(&v)) return false;
      AppendVarint(v, kept);
      return true;
    case 1:
      return in.Take(8, nullptr, kept);
    case 5:
      return in.Take(4, nullptr, kept);
    case 2:
      if (!in.ReadVarint(&v)) return false;
      AppendVarint(v, kept);
      return in.Take(v, nullptr, kept);
    default:
      return false;
  }
}

}  // namespace

bool ReadForwardRequest(const grpc::ByteBuffer& message, std::vector<grpc::Slice>* slices, v1::ForwardRequest* header,
                        InlineBytes (&tensors)[3]) {
  static_assert(v1::ForwardRequest::kQFieldNumber + 1 == v1::ForwardRequest::kKFieldNumber &&
                v1::ForwardRequest::kKFieldNumber + 1 == v1::ForwardRequest::kVFieldNumber);
  slices->clear();
  if (!message.Dump(slices).ok()) return false;
  for (InlineBytes& t : tensors) t = InlineBytes();
  SliceCursor in(*slices);
  std::string kept;  // every field but the inline tensors, re-encoded as it came, for protobuf
  bool seen[3] = {false, false, false};
  const uint32_t data_tag = LengthDelimitedTag(v1::TensorInput::kDataFieldNumber);
  while (!in.AtEnd()) {
    uint64_t tag = 0;
    if (!in.ReadVarint(&tag) || tag > UINT32_MAX || (tag >> 3) == 0) return false;
    const int field = static_cast<int>(tag >> 3);
    const int tensor = field - v1::ForwardRequest::kQFieldNumber;
    const bool is_tensor = tensor >= 0 && tensor < 3 && (tag & 7) == 2;
    if (!is_tensor) {
      if (!KeepField(in, tag, &kept)) return false;
      continue;
    }
    if (seen[tensor]) return false;  // repeated: protobuf merges the parts
    seen[tensor] = true;
    // TensorInput{data} alone: its own tag and length, then the bytes to the end of the field. Looked at
    // through a copy of the cursor, so that anything else (empty, a reference) is copied from the field's start
    // for protobuf to parse.
    SliceCursor look = in;
    uint64_t len = 0, inner_tag = 0, n = 0;
    if (!look.ReadVarint(&len)) return false;
    const uint64_t start = look.position();
    if (len > 0 && look.ReadVarint(&inner_tag) && inner_tag == data_tag && look.ReadVarint(&n) && n <= len &&
        look.position() - start + n == len) {
      InlineBytes& t = tensors[tensor];
      t.present = true;
      t.size = n;
      in = look;
      if (!in.Take(n, &t.pieces, nullptr)) return false;
      continue;
    }
    if (!KeepField(in, tag, &kept)) return false;
  }
  header->Clear();
  return header->ParseFromString(kept);
}

absl::Status ReadForwardResponse(const grpc::ByteBuffer& message, v1::ForwardResponse* header, absl::Span<char> o,
                                 absl::Span<char> lse, uint64_t* o_size, uint64_t* lse_size) {
  static_assert(v1::ForwardResponse::kOFieldNumber + 1 == v1::ForwardResponse::kLseFieldNumber);
  const absl::Status unreadable = absl::InternalError("Forward: an unreadable response message");
  std::vector<grpc::Slice> slices;
  if (!message.Dump(&slices).ok()) return unreadable;
  SliceCursor in(slices);
  std::string kept;  // every field but o and lse, re-encoded as it came, for protobuf
  const absl::Span<char> dst[2] = {o, lse};
  uint64_t* sizes[2] = {o_size, lse_size};
  bool seen[2] = {false, false};
  *o_size = *lse_size = 0;
  std::vector<absl::Span<const uint8_t>> pieces;
  while (!in.AtEnd()) {
    uint64_t tag = 0;
    if (!in.ReadVarint(&tag) || tag > UINT32_MAX || (tag >> 3) == 0) return unreadable;
    const int which = static_cast<int>(tag >> 3) - v1::ForwardResponse::kOFieldNumber;
    if (which >= 0 && which < 2 && (tag & 7) == 2) {
      if (seen[which]) return absl::InternalError(absl::StrCat("Forward: the response holds ", which ? "lse" : "o", " twice"));
      seen[which] = true;
      uint64_t len = 0;
      if (!in.ReadVarint(&len)) return unreadable;
      if (len > dst[which].size()) {
        return absl::InternalError(absl::StrCat("Forward: the response's ", which ? "lse" : "o", " holds ", len,
                                                " bytes, more than the ", dst[which].size(), " the request implies"));
      }
      pieces.clear();
      if (!in.Take(len, &pieces, nullptr)) return unreadable;
      char* at = dst[which].data();
      for (const absl::Span<const uint8_t>& p : pieces) {
        std::memcpy(at, p.data(), p.size());
        at += p.size();
      }
      *sizes[which] = len;
      continue;
    }
    if (!KeepField(in, tag, &kept)) return unreadable;
  }
  header->Clear();
  if (!header->ParseFromString(kept)) return unreadable;
  return absl::OkStatus();
}

grpc::ByteBuffer SerializeStreamChunk(v1::TensorName tensor, uint64_t offset, const char* data, size_t n,
                                      std::shared_ptr<const void> owner) {
  v1::TensorChunk fields;  // everything but data: protobuf encodes those
  fields.set_tensor(tensor);
  fields.set_offset(offset);
  const size_t fields_size = fields.ByteSizeLong();
  using google::protobuf::io::CodedOutputStream;
  // TensorChunk = fields, then data (field 3) as tag, length, bytes; an empty data is left out, as protobuf
  // leaves out an empty proto3 scalar.
  const uint32_t data_tag = LengthDelimitedTag(v1::TensorChunk::kDataFieldNumber);
  const size_t data_head = n == 0 ? 0 : CodedOutputStream::VarintSize32(data_tag) + CodedOutputStream::VarintSize64(n);
  const uint64_t chunk_size = fields_size + data_head + n;
  std::string head;
  {
    google::protobuf::io::StringOutputStream sink(&head);
    CodedOutputStream out(&sink);
    out.WriteVarint32(LengthDelimitedTag(v1::ForwardStreamRequest::kChunkFieldNumber));
    out.WriteVarint64(chunk_size);
    fields.SerializeWithCachedSizes(&out);
    if (n > 0) {
      out.WriteVarint32(data_tag);
      out.WriteVarint64(n);
    }
  }
  grpc::Slice slices[2] = {grpc::Slice(head), n == 0      ? grpc::Slice()
                                              : owner     ? ReferenceSlice(data, n, std::move(owner))
                                                          : grpc::Slice(data, n)};
  return grpc::ByteBuffer(slices, n == 0 ? 1 : 2);
}

grpc::ByteBuffer SerializeForwardRequest(const v1::ForwardRequest& header,
                                         const std::optional<std::string_view> (&tensors)[3],
                                         std::shared_ptr<const void> owner) {
  static constexpr int kFields[3] = {v1::ForwardRequest::kQFieldNumber, v1::ForwardRequest::kKFieldNumber,
                                     v1::ForwardRequest::kVFieldNumber};
  using google::protobuf::io::CodedOutputStream;
  std::vector<grpc::Slice> slices;
  slices.emplace_back(header.SerializeAsString());
  // Fields may come in any order and a message field may repeat (its parts merge), so the tensors can
  // follow the header as fields of their own.
  const uint32_t data_tag = LengthDelimitedTag(v1::TensorInput::kDataFieldNumber);
  for (int i = 0; i < 3; ++i) {
    if (!tensors[i]) continue;
    const uint64_t n = tensors[i]->size();
    const uint64_t input_size = CodedOutputStream::VarintSize32(data_tag) + CodedOutputStream::VarintSize64(n) + n;
    std::string prefix;
    {
      google::protobuf::io::StringOutputStream sink(&prefix);
      CodedOutputStream out(&sink);
      out.WriteVarint32(LengthDelimitedTag(kFields[i]));
      out.WriteVarint64(input_size);
      out.WriteVarint32(data_tag);
      out.WriteVarint64(n);
    }
    slices.emplace_back(prefix);
    if (n == 0) continue;
    slices.push_back(owner ? ReferenceSlice(tensors[i]->data(), n, owner) : grpc::Slice(tensors[i]->data(), n));
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

absl::StatusOr<ChunkRead> ReadStreamChunk(grpc::ByteBuffer& message,
                                          absl::FunctionRef<absl::StatusOr<char*>(const ChunkHead&)> place) {
  static_assert(static_cast<int>(v1::ForwardStreamRequest::kChunkFieldNumber) ==
                static_cast<int>(v1::ForwardStreamResponse::kChunkFieldNumber));
  const uint64_t total = message.Length();
  grpc::ProtoBufferReader reader(&message);  // reads the slices; `message` keeps them
  google::protobuf::io::CodedInputStream in(&reader);
  in.SetTotalBytesLimit(INT_MAX);
  uint64_t chunk_size = 0;
  if (in.ReadTag() != LengthDelimitedTag(v1::ForwardStreamRequest::kChunkFieldNumber) ||
      !in.ReadVarint64(&chunk_size)) {
    return ChunkRead::kOther;
  }
  // The chunk must fill the rest of the message: one chunk field, nothing after it.
  if (chunk_size != total - static_cast<uint64_t>(in.CurrentPosition())) return ChunkRead::kOther;
  ChunkHead head;
  int last_field = 0;
  for (;;) {
    const uint64_t at = static_cast<uint64_t>(in.CurrentPosition());
    if (at == total) break;  // no data field: an empty chunk
    const uint32_t tag = in.ReadTag();
    const int field = static_cast<int>(tag >> 3);
    if (field <= last_field) return ChunkRead::kOther;  // out of order or repeated: protobuf's rules apply
    last_field = field;
    uint64_t v = 0;
    if (tag == (v1::TensorChunk::kTensorFieldNumber << 3) && in.ReadVarint64(&v)) {
      head.tensor = static_cast<int32_t>(v);
    } else if (tag == (v1::TensorChunk::kOffsetFieldNumber << 3) && in.ReadVarint64(&v)) {
      head.offset = v;
    } else if (tag == LengthDelimitedTag(v1::TensorChunk::kDataFieldNumber) && in.ReadVarint64(&v)) {
      // The data runs exactly to the end of the message.
      if (v != total - static_cast<uint64_t>(in.CurrentPosition())) return ChunkRead::kOther;
      head.size = v;
      break;
    } else {
      return ChunkRead::kOther;
    }
  }
  const absl::StatusOr<char*> placed = place(head);
  if (!placed.ok()) return placed.status();
  char* dst = *placed;
  // ReadRaw takes an int: copy in pieces (a message is below 2 GiB, but the type says nothing of that).
  for (uint64_t done = 0; done < head.size;) {
    const int n = static_cast<int>(std::min<uint64_t>(head.size - done, 1 << 30));
    if (!in.ReadRaw(dst + done, n)) return ChunkRead::kOther;
    done += static_cast<uint64_t>(n);
  }
  return ChunkRead::kDone;
}

absl::StatusOr<grpc::ByteBuffer> SerializeSequenceChunk(const v1::SequenceChunk& fields, size_t n,
                                                        absl::FunctionRef<absl::Status(uint8_t*)> fill) {
  static_assert(static_cast<int>(v1::ExportSequenceResponse::kChunkFieldNumber) ==
                static_cast<int>(v1::ImportSequenceRequest::kChunkFieldNumber));
  using google::protobuf::io::CodedOutputStream;
  const size_t fields_size = fields.ByteSizeLong();
  // SequenceChunk = its other fields, then data (field 5, the last) as tag, length, bytes; an empty data is left out,
  // as protobuf leaves out an empty proto3 scalar.
  const uint32_t data_tag = LengthDelimitedTag(v1::SequenceChunk::kDataFieldNumber);
  const size_t data_head = n == 0 ? 0 : CodedOutputStream::VarintSize32(data_tag) + CodedOutputStream::VarintSize64(n);
  const uint64_t chunk_size = fields_size + data_head + n;
  const uint32_t chunk_tag = LengthDelimitedTag(v1::ExportSequenceResponse::kChunkFieldNumber);
  const size_t head = CodedOutputStream::VarintSize32(chunk_tag) + CodedOutputStream::VarintSize64(chunk_size) +
                      fields_size + data_head;
  grpc::Slice slice(head + n);  // uninitialised: every byte is written below
  auto* at = const_cast<uint8_t*>(slice.begin());
  at = CodedOutputStream::WriteVarint32ToArray(chunk_tag, at);
  at = CodedOutputStream::WriteVarint64ToArray(chunk_size, at);
  at = fields.SerializeWithCachedSizesToArray(at);
  if (n > 0) {
    at = CodedOutputStream::WriteVarint32ToArray(data_tag, at);
    at = CodedOutputStream::WriteVarint64ToArray(n, at);
    if (absl::Status filled = fill(at); !filled.ok()) return filled;
  }
  return grpc::ByteBuffer(&slice, 1);
}

bool ReadSequenceChunk(const grpc::ByteBuffer& message, std::vector<grpc::Slice>* slices, v1::SequenceChunk* fields,
                       InlineBytes* data) {
  slices->clear();
  if (!message.Dump(slices).ok()) return false;
  *data = InlineBytes();
  SliceCursor in(*slices);
  std::string kept, ignored;  // the chunk's other fields, re-encoded as they came, for protobuf; unknown fields
  bool seen_chunk = false;
  const uint32_t data_tag = LengthDelimitedTag(v1::SequenceChunk::kDataFieldNumber);
  while (!in.AtEnd()) {
    uint64_t tag = 0, len = 0;
    if (!in.ReadVarint(&tag) || tag > UINT32_MAX || (tag >> 3) == 0) return false;
    if (tag != LengthDelimitedTag(v1::ImportSequenceRequest::kChunkFieldNumber)) {
      if (!KeepField(in, tag, &ignored)) return false;  // protobuf would skip it as unknown
      continue;
    }
    if (seen_chunk || !in.ReadVarint(&len)) return false;  // a repeated chunk's parts merge: protobuf's job
    seen_chunk = true;
    const uint64_t end = in.position() + len;
    while (in.position() < end) {
      if (!in.ReadVarint(&tag) || tag > UINT32_MAX || (tag >> 3) == 0) return false;
      if (tag != data_tag) {
        if (!KeepField(in, tag, &kept)) return false;
        continue;
      }
      uint64_t n = 0;
      if (data->present || !in.ReadVarint(&n) || n > end - std::min(end, in.position())) return false;
      data->present = true;
      data->size = n;
      if (!in.Take(n, &data->pieces, nullptr)) return false;
    }
    if (in.position() != end) return false;  // a field ran past the chunk's end
  }
  fields->Clear();
  return fields->ParseFromString(kept);
}

bool ParseSmallFields(const grpc::ByteBuffer& message, MessageLite* out, uint32_t max_field_bytes) {
  grpc::ByteBuffer view(message);  // shares the slices; the reader below needs a mutable buffer
  grpc::ProtoBufferReader reader(&view);
  google::protobuf::io::CodedInputStream in(&reader);
  in.SetTotalBytesLimit(INT_MAX);
  std::string kept;  // the small fields, re-encoded exactly as they came
  google::protobuf::io::StringOutputStream sink(&kept);
  {
    google::protobuf::io::CodedOutputStream copy(&sink);
    for (uint32_t tag; (tag = in.ReadTag()) != 0;) {
      uint64_t v = 0;
      uint32_t len = 0;
      std::string bytes;
      switch (tag & 7) {
        case 0:  // varint
          if (!in.ReadVarint64(&v)) return false;
          copy.WriteVarint32(tag);
          copy.WriteVarint64(v);
          break;
        case 1:  // 64-bit
          if (!in.ReadLittleEndian64(&v)) return false;
          copy.WriteVarint32(tag);
          copy.WriteLittleEndian64(v);
          break;
        case 2:  // length-delimited
          if (!in.ReadVarint32(&len)) return false;
          if (len > max_field_bytes) {
            if (!in.Skip(static_cast<int>(len))) return false;
            break;
          }
          if (!in.ReadString(&bytes, static_cast<int>(len))) return false;
          copy.WriteVarint32(tag);
          copy.WriteVarint32(len);
          copy.WriteString(bytes);
          break;
        case 5: {  // 32-bit
          uint32_t w = 0;
          if (!in.ReadLittleEndian32(&w)) return false;
          copy.WriteVarint32(tag);
          copy.WriteLittleEndian32(w);
          break;
        }
        default:  // groups (not in proto3) and invalid wire types
          return false;
      }
    }
    if (!in.ConsumedEntireMessage() || copy.HadError()) return false;
  }
  return out->ParseFromString(kept);
}

absl::StatusOr<grpc::ByteBuffer> SerializeByReference(std::shared_ptr<const MessageLite> message) {
  const size_t size = message->ByteSizeLong();
  if (size > static_cast<size_t>(INT32_MAX)) {
    return absl::InvalidArgumentError(absl::StrCat("request: ", size, " bytes in one message is more than protobuf "
                                                   "allows (2 GiB); use the streaming transport"));
  }
  SliceWriter writer(message);
  {
    google::protobuf::io::CodedOutputStream out(&writer);
    out.EnableAliasing(true);
    message->SerializeWithCachedSizes(&out);
    if (out.HadError()) return absl::InternalError("request: serialisation failed");
  }  // the stream's destructor returns what it did not use
  if (writer.ByteCount() != static_cast<int64_t>(size)) {
    return absl::InternalError(absl::StrCat("request: serialised ", writer.ByteCount(), " bytes, expected ", size));
  }
  return writer.Finish();
}

}  // namespace attnd
