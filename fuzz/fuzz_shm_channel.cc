// The server side of a shared-memory channel (transport/shm_channel.cc): MapServerSide's checks of the memfd a
// caller hands over (seals, size, the header's magic, version and capacities), then ReadRequest on the request
// area with the request_bytes the caller wrote. A mapping it accepts must match its memfd byte for byte and
// stay within --shm_max_bytes; nothing may read past the mapping (ASan does not see a mapping, so the memfd is
// sized to end on a page boundary followed by nothing the process owns: a read past it faults); no descriptor
// or mapping may outlive the input.
// Input: seals, a size choice, max_area_bytes and request_bytes (from the end), then the memfd's bytes.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "attnd/transport/shm_channel.h"
#include "fuzz_util.h"

namespace shm = attnd::shm;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  const uint8_t flags = in.ConsumeIntegral<uint8_t>();
  const uint64_t max_area = in.ConsumeIntegralInRange<uint64_t>(0, 1 << 16);
  const uint64_t request_bytes = in.ConsumeIntegral<uint64_t>();
  const uint64_t size_pick = in.ConsumeIntegralInRange<uint64_t>(0, 3 * 4096);
  std::string contents = in.ConsumeRemainingBytesAsString();
  // Mostly a well-formed header (the checks after the magic are the interesting ones), sometimes the bytes as
  // they came.
  if ((flags & 0x80) == 0 && contents.size() >= 24) {
    std::memcpy(&contents[0], &shm::kMagic, 4);
    if ((flags & 0x40) == 0) std::memcpy(&contents[4], &shm::kVersion, 4);
  }
  uint64_t req_cap = 0, reply_cap = 0;
  if (contents.size() >= 24) {
    std::memcpy(&req_cap, &contents[8], 8);
    std::memcpy(&reply_cap, &contents[16], 8);
  }
  // The size the header asks for when it is small enough to make, else one of the caller's choosing.
  uint64_t file_bytes = shm::kHeaderBytes + size_pick;
  if ((flags & 0x20) == 0 && req_cap <= (1 << 16) && reply_cap <= (1 << 16)) {
    file_bytes = shm::ChannelBytes(req_cap, reply_cap);
  }

  const int before = attnd::fuzz::OpenDescriptors();
  const int fd = ::memfd_create("fuzz-shm", MFD_CLOEXEC | ((flags & 0x08) == 0 ? MFD_ALLOW_SEALING : 0));
  ATTND_FUZZ_CHECK(fd >= 0);
  ATTND_FUZZ_CHECK(::ftruncate(fd, static_cast<off_t>(file_bytes)) == 0);
  if (!contents.empty()) {
    const size_t n = std::min<uint64_t>(contents.size(), file_bytes);
    ATTND_FUZZ_CHECK(::pwrite(fd, contents.data(), n, 0) == static_cast<ssize_t>(n));
  }
  int seals = 0;
  if ((flags & 0x01) == 0) seals |= F_SEAL_SHRINK;
  if ((flags & 0x02) == 0) seals |= F_SEAL_GROW;
  if ((flags & 0x04) != 0) seals |= F_SEAL_WRITE;
  if (seals != 0) (void)::fcntl(fd, F_ADD_SEALS, seals);

  absl::StatusOr<shm::Mapping> m = shm::MapServerSide(fd, max_area);
  ::close(fd);
  if (m.ok()) {
    ATTND_FUZZ_CHECK(m->bytes == file_bytes);
    ATTND_FUZZ_CHECK(m->request_capacity <= max_area && m->reply_capacity <= max_area);
    ATTND_FUZZ_CHECK(shm::ChannelBytes(m->request_capacity, m->reply_capacity) == m->bytes);
    ATTND_FUZZ_CHECK(m->header->magic == shm::kMagic && m->header->version == shm::kVersion);
    attnd::v1::ForwardRequest request;
    const absl::Status read = shm::ReadRequest(*m, request_bytes, &request);
    if (request_bytes > m->request_capacity) ATTND_FUZZ_CHECK(absl::IsInvalidArgument(read));
    if (read.ok()) {
      // What was parsed is what the area holds.
      attnd::v1::ForwardRequest again;
      ATTND_FUZZ_CHECK(again.ParseFromArray(m->request(), static_cast<int>(request_bytes)));
    }
    ATTND_FUZZ_CHECK(::munmap(m->header, m->bytes) == 0);
  } else {
    ATTND_FUZZ_CHECK(!m.status().message().empty());
  }
  ATTND_FUZZ_CHECK(attnd::fuzz::OpenDescriptors() == before);
  return 0;
}
