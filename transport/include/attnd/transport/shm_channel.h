// The same-host shared-memory channel: Forward without gRPC, for callers on the server's host.
//
// Why: gRPC's own round trip on the unix socket is 76-96 us on the H200 host (docs/benchmarks.md), more than the
// whole budget a CUDA IPC call may add to its kernel (60 us). A caller that already shares GPU memory with the
// server can share a page of host memory too: it writes a serialized ForwardRequest there, flips a state word,
// and the server's thread for that channel, spinning or asleep on a futex on the same word, runs it and writes
// the serialized ForwardResponse back. No sockets, no HTTP/2, no thread hops on the request's path.
//
// Setup (once per channel): the caller creates a sealed memfd of ChannelBytes(request, reply) bytes, connects to
// the server's --shm_socket (a unix socket) and sends a Hello with the memfd attached (SCM_RIGHTS); the server
// checks the peer's uid (SO_PEERCRED), the token when the server has --auth_token_file, the seals and the size,
// maps it, and answers a HelloReply. The socket stays open: its closing ends the channel.
//
// A request is a Forward or a Step (Header::kind); the reply is the response of the same kind.
// One request at a time per channel (a caller wanting N in flight opens N channels, as with connections).
// The state word: kIdle -> kRequest (caller, after writing the request) -> kReply (server, after writing the
// reply) -> kRequest (the caller's next request) ... Each side sleeps on the word with FUTEX_WAIT after a short
// spin and sets its `*_sleeping` flag first, so the other side issues FUTEX_WAKE only when someone sleeps.
// Everything the server reads from the mapping is copied out and bounds-checked first: the caller can write to
// it at any time.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "attnd/v1/attention.pb.h"

namespace attnd::shm {

constexpr uint32_t kMagic = 0x4d534e41;  // "ANSM"
constexpr uint32_t kVersion = 1;

enum State : uint32_t { kIdle = 0, kRequest = 1, kReply = 2 };

// What the request area holds (Header::kind). A caller that knows only Forward writes 0.
enum RequestKind : uint32_t {
  kForwardRequest = 0,  // a ForwardRequest; the reply is a ForwardResponse
  kStepRequest = 1,     // a StepRequest (KV sequences); the reply is a StepResponse
};

// At offset 0 of the mapping; the request area follows at kHeaderBytes, the reply area after it.
struct Header {
  uint32_t magic;
  uint32_t version;
  uint64_t request_capacity;
  uint64_t reply_capacity;
  alignas(64) std::atomic<uint32_t> state;
  std::atomic<uint32_t> server_sleeping;
  std::atomic<uint32_t> client_sleeping;
  uint32_t kind;           // a RequestKind, written by the caller before state = kRequest
  uint64_t request_bytes;  // written by the caller before state = kRequest
  // Written by the server before state = kReply: the response of the request's kind, or the error message.
  uint64_t reply_bytes;
  int32_t status_code;     // absl::StatusCode of the reply; not OK: the reply area holds the message
  uint32_t reserved2;
  // Stream-ordered steps (StreamOrder in attention.proto): the caller's CUDA stream stores increasing values here
  // (cuStreamWriteValue64 through the caller's registration of this page) after the work that produces a step's
  // inputs; the server starts a step whose order names wait_value once this word holds at least that. On a line of
  // its own: the GPU writes it while both sides use the words above.
  alignas(64) std::atomic<uint64_t> wait_word;
  // Steps the device orders (StreamOrder.device): the server's stream writes the step's wait_value here once its
  // kernels have run, and the caller's stream waits on it. A caller whose step failed, or whose server left, writes
  // it from its host instead, so its stream never waits on a process that is gone.
  alignas(64) std::atomic<uint64_t> done_word;
  // The wait_value of the last step the server has admitted from this channel (not written for a step refused at
  // admission, whose reply comes at once): a caller that pipelines a stream's steps over two channels sends a step
  // once the one before it is admitted or answered, so that the server admits them in the stream's order.
  alignas(64) std::atomic<uint64_t> admitted_word;
};
static_assert(std::atomic<uint64_t>::is_always_lock_free, "the wait word is shared between processes");
// Where the words are in the mapping (each side registers the header page with CUDA and uses these offsets).
constexpr uint64_t kWaitWordOffset = 128;
constexpr uint64_t kDoneWordOffset = 192;
static_assert(std::atomic<uint32_t>::is_always_lock_free, "the state word is shared between processes");
constexpr uint64_t kHeaderBytes = 4096;
// Largest request or reply area either side accepts: keeps ChannelBytes far from wrapping.
constexpr uint64_t kMaxAreaBytes = uint64_t{1} << 40;
static_assert(sizeof(Header) <= kHeaderBytes, "header page");
static_assert(offsetof(Header, wait_word) == kWaitWordOffset, "the wait word's offset is part of the protocol");
static_assert(offsetof(Header, done_word) == kDoneWordOffset, "the done word's offset is part of the protocol");

// Raises a wait or done word to at least `value` (values compare as a wrapping sequence) from a host: how either side
// releases the wait on a word its own stream depends on when the other side is gone or failed.
inline void RaiseWord(std::atomic<uint64_t>* word, uint64_t value) {
  uint64_t now = word->load();
  while (static_cast<int64_t>(now - value) < 0 && !word->compare_exchange_weak(now, value)) {
  }
}

inline uint64_t ChannelBytes(uint64_t request_capacity, uint64_t reply_capacity) {
  return kHeaderBytes + request_capacity + reply_capacity;
}

// A mapped channel with the capacities as checked at setup: the server never reads them from the mapping again.
struct Mapping {
  Header* header = nullptr;
  uint64_t bytes = 0;
  uint64_t request_capacity = 0, reply_capacity = 0;
  uint8_t* request() const { return reinterpret_cast<uint8_t*>(header) + kHeaderBytes; }
  uint8_t* reply() const { return request() + request_capacity; }
};

// The first message on the socket, with the memfd as SCM_RIGHTS.
struct Hello {
  uint32_t magic;
  uint32_t version;
  uint32_t token_bytes;  // followed on the socket by the token (empty: none)
  uint32_t reserved;
};
constexpr uint32_t kMaxTokenBytes = 4096;
// The server's answer: an absl::StatusCode and a message of message_bytes following it.
struct HelloReply {
  int32_t status_code;
  uint32_t message_bytes;
};
constexpr uint32_t kMaxHelloMessageBytes = 1024;

// Waits until `word` != `current` or `timeout` passes (spurious returns are possible: callers re-check).
void FutexWait(std::atomic<uint32_t>* word, uint32_t current, absl::Duration timeout);
// Wakes every waiter on `word`.
void FutexWakeAll(std::atomic<uint32_t>* word);

// A hint to the core that this is a spin-wait (frees issue slots for a sibling hyperthread, saves power).
inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Waits for `word` to become `want`: spins for `spin`, then sleeps on the futex with `sleeping` raised, waking
// every `poll` to ask `give_up` (may be empty). Returns false when give_up said so or `deadline` passed.
template <typename GiveUp>
bool AwaitState(std::atomic<uint32_t>* word, uint32_t want, std::atomic<uint32_t>* sleeping, absl::Duration spin,
                absl::Time deadline, absl::Duration poll, GiveUp give_up) {
  const absl::Time spin_end = std::min(absl::Now() + spin, deadline);
  while (word->load(std::memory_order_acquire) != want) {
    if (absl::Now() < spin_end) {
      CpuRelax();
      continue;
    }
    const uint32_t seen = word->load(std::memory_order_acquire);
    if (seen == want) break;
    const absl::Time now = absl::Now();
    if (now >= deadline || give_up()) return false;
    // Raised before the last look: the waker stores the word, then reads the flag (both seq_cst), so either it
    // sees the flag and wakes us or FUTEX_WAIT sees the new word and returns at once.
    sleeping->store(1, std::memory_order_seq_cst);
    if (word->load(std::memory_order_seq_cst) == seen) FutexWait(word, seen, std::min(poll, deadline - now));
    sleeping->store(0, std::memory_order_relaxed);
  }
  return true;
}

// Publishes a state the other side waits for, waking it when it sleeps.
inline void Publish(std::atomic<uint32_t>* word, uint32_t value, std::atomic<uint32_t>* other_sleeping) {
  word->store(value, std::memory_order_seq_cst);
  if (other_sleeping->load(std::memory_order_seq_cst) != 0) FutexWakeAll(word);
}

// Caller side: a sealed (no shrink, no grow) memfd of the channel's size with the header written. Returns the fd.
absl::StatusOr<int> CreateChannelMemfd(uint64_t request_capacity, uint64_t reply_capacity);
// Server side: checks that `fd` is a memfd sealed against shrinking and growing, whose size matches its header's
// capacities (each at most `max_area_bytes`), and maps it (munmap(header, bytes) to undo).
absl::StatusOr<Mapping> MapServerSide(int fd, uint64_t max_area_bytes);
// Server side: parses the request in the request area, `request_bytes` long (read from the header once, by the
// caller of this: the peer can rewrite the header at any time). INVALID_ARGUMENT naming request_bytes when it
// exceeds the area, or the request when the bytes are not a ForwardRequest.
absl::Status ReadRequest(const Mapping& m, uint64_t request_bytes, v1::ForwardRequest* request);
// Caller side: maps a memfd from CreateChannelMemfd with the capacities it was created with (never the ones in
// the shared header, which the server could overwrite).
absl::StatusOr<Mapping> MapClientSide(int fd, uint64_t request_capacity, uint64_t reply_capacity);

// Socket helpers for the hello: one message carrying `data` and optionally one fd; and its receiving side
// (*fd = -1 when none came; more than one is INVALID_ARGUMENT, and every descriptor received is closed then).
// Both retry on EINTR and return UNAVAILABLE on a closed or failed socket.
absl::Status SendWithFd(int socket, const void* data, size_t bytes, int fd);
absl::Status ReceiveWithFd(int socket, void* data, size_t bytes, int* fd);
absl::Status SendAll(int socket, const void* data, size_t bytes);
absl::Status ReceiveAll(int socket, void* data, size_t bytes);

}  // namespace attnd::shm
