#include "attnd/client/client.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "absl/strings/str_cat.h"
#include "attnd/transport/zero_copy.h"
#include "client_internal.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/client_callback.h"

namespace attnd::client {
namespace {

const std::string kForwardStreamMethod = absl::StrCat("/", v1::Attention::service_full_name(), "/ForwardStream");

constexpr uint64_t kDefaultChunkBytes = 1 << 20;

}  // namespace

// Streaming call: header, then Q, K, V chunks in order; the reply is a header then O and LSE chunks.
class Client::StreamCall final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  StreamCall(std::shared_ptr<const Outgoing> sent, ForwardCallback done, uint64_t chunk_bytes,
             std::optional<ForwardOutputs> outputs)
      : sent_(std::move(sent)),
        done_(std::move(done)),
        chunk_bytes_(chunk_bytes),
        start_(absl::Now()),
        outputs_(outputs) {}

  // Takes ownership of itself: deleted in OnDone, or here when nothing could be started.
  void Start(grpc::GenericStub* stub, const Client& client, const CallOptions& call) {
    client.Prepare(&ctx_, call);
    const ReplyBytes want = ExpectedReplyBytes(sent_->header);
    dest_[0].limit = want.o;
    dest_[1].limit = want.lse;
    v1::ForwardStreamRequest header;
    *header.mutable_header() = sent_->header;
    bool own_buffer = false;
    const grpc::Status serialized =
        grpc::SerializationTraits<v1::ForwardStreamRequest>::Serialize(header, &out_, &own_buffer);
    if (!serialized.ok()) {
      ForwardCallback done = std::move(done_);
      delete this;
      done(FromGrpcStatus(serialized));
      return;
    }
    stub->PrepareBidiStreamingCall(&ctx_, kForwardStreamMethod, grpc::StubOptions(), this);
    StartWrite(&out_);
    StartRead(&in_buf_);
    StartCall();
  }

  void OnWriteDone(bool ok) override {
    // !ok: the stream is broken (the server answered early, e.g. with a validation error); OnDone reports.
    if (!ok) return;
    if (NextChunk()) {
      StartWrite(&out_);
    } else {
      StartWritesDone();
    }
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;
    absl::Status st = Receive();
    if (!st.ok()) {
      if (protocol_error_.ok()) protocol_error_ = st;
      ctx_.TryCancel();
      return;
    }
    StartRead(&in_buf_);
  }

  void OnDone(const grpc::Status& s) override {
    absl::StatusOr<ForwardResult> out;
    if (!protocol_error_.ok()) {
      out = protocol_error_;
    } else if (!s.ok()) {
      out = FromGrpcStatus(s);
    } else if (!have_header_) {
      out = absl::InternalError("ForwardStream: the server closed the stream without a header");
    } else {
      if (outputs_) {
        result_.outputs = ForwardOutputs{outputs_->o.first(dest_[0].filled), outputs_->lse.first(dest_[1].filled)};
      }
      out = Completed(*sent_, std::move(result_), Transport::kStream, start_);
    }
    ForwardCallback done = std::move(done_);
    delete this;
    done(std::move(out));
  }

 private:
  // Fills out_ with the next chunk; false when every inline byte has been sent.
  bool NextChunk() {
    static constexpr v1::TensorName kNames[3] = {v1::TENSOR_NAME_Q, v1::TENSOR_NAME_K, v1::TENSOR_NAME_V};
    while (tensor_ < 3) {
      const std::string_view data = sent_->tensors[tensor_].value_or(std::string_view());
      if (offset_ < data.size()) {
        // By reference while the owner lives on in the slices; copied into them when there is none.
        const uint64_t n = std::min<uint64_t>(chunk_bytes_, data.size() - offset_);
        out_ = SerializeStreamChunk(kNames[tensor_], offset_, data.data() + offset_, n, sent_->owner);
        offset_ += n;
        return true;
      }
      ++tensor_;
      offset_ = 0;
    }
    return false;
  }

  // Where one reply tensor goes: the caller's memory (`mem`, CallOptions::outputs) or the result's string.
  struct Dest {
    std::string* str = nullptr;
    char* mem = nullptr;
    uint64_t filled = 0, limit = 0;

    // The next n bytes, to be written by the caller.
    char* Extend(uint64_t n) {
      const uint64_t at = filled;
      filled += n;
      if (mem != nullptr) return mem + at;
      str->resize(filled);  // within the capacity reserved at the header
      return str->data() + at;
    }
    void Truncate(uint64_t n) {
      filled = n;
      if (str != nullptr) str->resize(n);
    }
  };

  // O and LSE chunks are copied from gRPC's slices straight to their destination (ReadStreamChunk); the
  // header and anything unusual go through protobuf.
  absl::Status Receive() {
    if (have_header_) {
      Dest* grown = nullptr;
      uint64_t before = 0;
      const absl::StatusOr<ChunkRead> r = ReadStreamChunk(in_buf_, [&](const ChunkHead& h) -> absl::StatusOr<char*> {
        const absl::StatusOr<Dest*> placed = Place(h);
        if (!placed.ok()) return placed.status();
        grown = *placed;
        before = grown->filled;
        return grown->Extend(h.size);
      });
      if (!r.ok()) return r.status();
      if (*r == ChunkRead::kDone) return absl::OkStatus();
      if (grown != nullptr) grown->Truncate(before);
    }
    const grpc::Status parsed = grpc::SerializationTraits<v1::ForwardStreamResponse>::Deserialize(&in_buf_, &in_);
    if (!parsed.ok()) {
      return absl::InternalError(absl::StrCat("ForwardStream: an unreadable response message: ", parsed.error_message()));
    }
    if (in_.has_header()) {
      if (have_header_) return absl::InternalError("ForwardStream: a second response header");
      have_header_ = true;
      FillResultHeader(*in_.mutable_header(), result_);
      if (outputs_) {
        dest_[0].mem = outputs_->o.data();
        dest_[1].mem = outputs_->lse.data();
      } else {
        dest_[0].str = &result_.o;
        dest_[1].str = &result_.lse;
        result_.o.reserve(dest_[0].limit);
        result_.lse.reserve(dest_[1].limit);
      }
      return absl::OkStatus();
    }
    if (!in_.has_chunk()) return absl::InternalError("ForwardStream: an empty response message");
    const v1::TensorChunk& c = in_.chunk();
    absl::StatusOr<Dest*> dst = Place({c.tensor(), c.offset(), c.data().size()});
    if (!dst.ok()) return dst.status();
    if (!c.data().empty()) std::memcpy((*dst)->Extend(c.data().size()), c.data().data(), c.data().size());
    return absl::OkStatus();
  }

  // The result tensor a reply chunk extends, after checking it follows on and fits the shape.
  absl::StatusOr<Dest*> Place(const ChunkHead& c) {
    if (!have_header_) return absl::InternalError("ForwardStream: a chunk before the response header");
    Dest* dst;
    if (c.tensor == v1::TENSOR_NAME_O) {
      dst = &dest_[0];
    } else if (c.tensor == v1::TENSOR_NAME_LSE) {
      dst = &dest_[1];
    } else {
      return absl::InternalError(absl::StrCat("ForwardStream: a response chunk of tensor ", c.tensor));
    }
    if (c.offset != dst->filled) {
      return absl::InternalError(absl::StrCat("ForwardStream: ", v1::TensorName_Name(c.tensor), " chunk at offset ",
                                              c.offset, ", expected ", dst->filled));
    }
    if (c.size > dst->limit - dst->filled) {
      return absl::InternalError(absl::StrCat("ForwardStream: ", v1::TensorName_Name(c.tensor),
                                              " longer than the ", dst->limit, " bytes its shape implies"));
    }
    return dst;
  }

  grpc::ClientContext ctx_;
  std::shared_ptr<const Outgoing> sent_;
  ForwardCallback done_;
  const uint64_t chunk_bytes_;
  const absl::Time start_;
  grpc::ByteBuffer out_, in_buf_;
  v1::ForwardStreamResponse in_;
  int tensor_ = 0;       // 0..2: Q, K, V being sent
  uint64_t offset_ = 0;  // bytes of that tensor sent
  bool have_header_ = false;
  ForwardResult result_;
  const std::optional<ForwardOutputs> outputs_;
  Dest dest_[2];  // O, LSE; their limits are the sizes the request implies
  absl::Status protocol_error_;  // written only from OnReadDone, read in OnDone (which follows every reaction)
};

uint64_t Client::ChunkBytes(uint64_t max_message_bytes) const {
  uint64_t c = options_.stream_chunk_bytes ? options_.stream_chunk_bytes : kDefaultChunkBytes;
  if (max_message_bytes > 0) {
    const uint64_t fit = max_message_bytes > 2 * kMessageOverhead ? max_message_bytes - kMessageOverhead
                                                                  : std::max<uint64_t>(1, max_message_bytes / 2);
    c = std::min(c, fit);
  }
  return c;
}

void Client::StartStream(std::shared_ptr<const Outgoing> sent, ForwardCallback done, const CallOptions& call,
                         uint64_t max_message_bytes) {
  auto* s = new StreamCall(std::move(sent), std::move(done), ChunkBytes(max_message_bytes), call.outputs);
  s->Start(generic_.get(), *this, call);
}

}  // namespace attnd::client
