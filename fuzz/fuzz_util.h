// Helpers shared by the fuzz targets.
#pragma once

#include <dirent.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "fuzzer/FuzzedDataProvider.h"
#include "google/protobuf/stubs/logging.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"

namespace attnd::fuzz {

// A failed property: printed, then abort() so that libFuzzer keeps the input as a crash.
#define ATTND_FUZZ_CHECK(cond)                                                         \
  do {                                                                                 \
    if (!(cond)) {                                                                     \
      std::fprintf(stderr, "%s:%d: property failed: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                    \
    }                                                                                  \
  } while (0)

// `bytes` as a ByteBuffer cut into slices where `cuts` says (one byte per cut, as an offset step), as gRPC
// hands a message over: its slice boundaries fall anywhere, inside a tag, a length or a tensor.
inline grpc::ByteBuffer Sliced(const std::string& bytes, const std::vector<uint8_t>& cuts) {
  std::vector<grpc::Slice> slices;
  size_t at = 0;
  for (uint8_t step : cuts) {
    if (at >= bytes.size()) break;
    const size_t n = std::min<size_t>(bytes.size() - at, 1 + step);
    slices.emplace_back(bytes.data() + at, n);
    at += n;
  }
  if (at < bytes.size() || slices.empty()) slices.emplace_back(bytes.data() + at, bytes.size() - at);
  return grpc::ByteBuffer(slices.data(), slices.size());
}

// Descriptors open in this process (a leak check around each input).
inline int OpenDescriptors() {
  DIR* d = ::opendir("/proc/self/fd");
  if (d == nullptr) std::abort();
  int n = 0;
  while (::readdir(d) != nullptr) ++n;
  ::closedir(d);
  return n;
}

// Protobuf logs every refused string field's bad UTF-8; at thousands of inputs a second that is all the log
// would show. Installed once per target by a static initialiser.
struct QuietProtobuf {
  QuietProtobuf() { google::protobuf::SetLogHandler(nullptr); }
};
inline const QuietProtobuf quiet_protobuf;

}  // namespace attnd::fuzz
