#include "attnd/client/zero_copy.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream.h"
#include "grpcpp/support/slice.h"

namespace attnd::client {
namespace {

using google::protobuf::MessageLite;

// Copied bytes go to a growing buffer that becomes one slice whenever a reference interrupts it; referenced
// bytes become slices of their own.
class SliceWriter final : public google::protobuf::io::ZeroCopyOutputStream {
 public:
  explicit SliceWriter(std::shared_ptr<const MessageLite> owner) : owner_(std::move(owner)) {}

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
    // The slice's destructor callback drops this share of the message.
    auto* share = new std::shared_ptr<const MessageLite>(owner_);
    slices_.emplace_back(const_cast<void*>(data), static_cast<size_t>(size),
                         [](void* p) { delete static_cast<std::shared_ptr<const MessageLite>*>(p); }, share);
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

  const std::shared_ptr<const MessageLite> owner_;
  std::string pending_;
  std::vector<grpc::Slice> slices_;
  int64_t flushed_ = 0;
};

}  // namespace

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

}  // namespace attnd::client
