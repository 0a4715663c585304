// The caller's side of the same-host shared-memory channel (attnd/transport/shm_channel.h; the server's --shm_socket):
// Forward without gRPC for a process on the server's host, typically with CUDA IPC buffer references, whose
// request and reply are a few hundred bytes. Buffers are registered over gRPC (Client::RegisterCudaBuffer) first.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "attnd/client/client.h"
#include "attnd/transport/shm_channel.h"
#include "attnd/v1/attention.pb.h"

namespace attnd::client {

struct ShmChannelOptions {
  std::string socket_path;                 // the server's --shm_socket
  uint64_t request_capacity = 1ull << 20;  // largest serialized ForwardRequest this channel can carry
  uint64_t reply_capacity = 1ull << 20;    // largest serialized ForwardResponse (inline O travels here)
  std::string auth_token;                  // the server's --auth_token_file token, if it has one
  // Polling for the reply before sleeping on the futex: an IPC call's reply comes about a kernel's time later,
  // and a wake-up from sleep costs more than that poll.
  absl::Duration spin = absl::Microseconds(300);
  // While at most two calls of this process wait for replies, a call polls up to 1.5x as long as its channel's previous call
  // took, up to this: a poll of a fixed 300 us was straddled by 4k-token calls (~270-290 us), and the calls that
  // slept paid ~20-30 us for the server to wake them (H200). Not for every caller: with 16 callers at 1k
  // polling up to 1 ms, the spinning callers took the host's cores from the server (a third of the GPU's
  // throughput lost).
  absl::Duration long_spin = absl::Milliseconds(1);
};

// One request at a time (not thread-safe: open one channel per caller thread, as with connections).
class ShmChannel {
 public:
  // Creates the memfd, hands it to the server and waits for its answer (UNAVAILABLE, PERMISSION_DENIED,
  // UNAUTHENTICATED, RESOURCE_EXHAUSTED, INVALID_ARGUMENT as the server says).
  static absl::StatusOr<std::unique_ptr<ShmChannel>> Connect(const ShmChannelOptions& options);
  ~ShmChannel();
  ShmChannel(const ShmChannel&) = delete;
  ShmChannel& operator=(const ShmChannel&) = delete;

  // Sends the request and waits for the reply: the server's status as the error, else the ForwardResponse.
  // After a DEADLINE_EXCEEDED or UNAVAILABLE the channel is unusable (a late reply may still land): open another.
  absl::StatusOr<v1::ForwardResponse> Forward(const v1::ForwardRequest& request,
                                              absl::Duration timeout = absl::InfiniteDuration());
  // The same for a Step of KV sequences (shm::kStepRequest).
  absl::StatusOr<v1::StepResponse> Step(const v1::StepRequest& request,
                                        absl::Duration timeout = absl::InfiniteDuration());

  // The channel's header page, and in it the wait word of stream-ordered steps (StreamOrder in attention.proto):
  // a caller registers the page with CUDA so that its stream can write the word (attnd/client/cuda_steps.h).
  void* header_page() const { return map_.header; }
  std::atomic<uint64_t>* wait_word() const { return &map_.header->wait_word; }
  std::atomic<uint64_t>* done_word() const { return &map_.header->done_word; }
  const std::atomic<uint64_t>* admitted_word() const { return &map_.header->admitted_word; }

  uint64_t request_capacity() const { return map_.request_capacity; }
  uint64_t reply_capacity() const { return map_.reply_capacity; }

 private:
  ShmChannel(const ShmChannelOptions& options, int socket, shm::Mapping mapping)
      : options_(options), socket_(socket), map_(mapping) {}
  // Writes `request` as `kind`, waits for the reply and parses it into `response`.
  absl::Status Call(shm::RequestKind kind, const google::protobuf::MessageLite& request,
                    google::protobuf::MessageLite* response, absl::Duration timeout);
  const ShmChannelOptions options_;
  const int socket_;
  const shm::Mapping map_;
  bool broken_ = false;
  absl::Duration last_call_ = absl::ZeroDuration();  // how long the previous call waited for its reply
};

// ShmChannel::Forward with the reply as the gRPC client's ForwardResult: transport kShm, the client-side
// latency, the inline tensor bytes each way, and the reply's sizes checked as Client checks them (CheckReplySizes).
// What `attn call` and `attn bench` use with --transport=shm.
absl::StatusOr<ForwardResult> ForwardOverShm(ShmChannel& channel, const v1::ForwardRequest& request,
                                             absl::Duration timeout = absl::InfiniteDuration());
// ShmChannel::Step with the reply as the gRPC client's StepResult (transport kShm), sizes checked as
// Client::Step checks them.
absl::StatusOr<StepResult> StepOverShm(ShmChannel& channel, const v1::StepRequest& request,
                                       absl::Duration timeout = absl::InfiniteDuration());
// Bytes of the serialized StepResponse a channel's reply area must hold for `request` (O, LSE, lengths and
// the other fields); what Client sizes its channels by.
uint64_t StepReplyBytes(const v1::StepRequest& request);

}  // namespace attnd::client
