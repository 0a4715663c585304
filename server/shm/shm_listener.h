// The server side of the shm transport (the same-host shared-memory channel, attnd/transport/shm_channel.h,
// --shm_socket): a unix socket where callers hand over their channel's memfd, and one thread per channel that
// waits on the channel's state word, runs each request (a Forward through the Dispatcher, a Step of KV sequences
// through Sequences) and writes the reply back.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "attnd/server/dispatcher.h"
#include "attnd/server/sequences.h"
#include "attnd/transport/shm_channel.h"
#include "call_stats.h"

namespace attnd::server {

struct ShmListenerOptions {
  std::string path;                 // the unix socket
  uint32_t mode = 0660;             // its permission bits
  uint64_t max_area_bytes = 64ull << 20;  // per channel, request and reply area each
  uint32_t max_channels = 64;       // open channels; more are refused with RESOURCE_EXHAUSTED
  absl::Duration spin = absl::Microseconds(50);  // a channel thread polls this long for a request before sleeping
  // ... and this long for the reply to the request it holds (while few channels await theirs): see ReplyWait.
  absl::Duration reply_spin = absl::Microseconds(300);
  std::vector<std::string> tokens;  // non-empty: the hello must carry one of them (--auth_token_file)
  // How long a stream-ordered step waits for its caller's stream to write the channel's wait word.
  absl::Duration order_timeout = absl::Seconds(30);
  bool device_order = true;  // StreamOrder.device accepted where the backend can (ServerOptions::Shm)
  CallStats* stats = nullptr;  // where each call is recorded, as method "ForwardShm"
};

class ShmListener {
 public:
  // `sequences` (null: Step requests are FAILED_PRECONDITION) runs the channel's Step requests.
  static absl::StatusOr<std::unique_ptr<ShmListener>> Start(const ShmListenerOptions& options,
                                                           Dispatcher* dispatcher, Sequences* sequences = nullptr);
  ~ShmListener();
  // Stops accepting channels; each open channel finishes the request it holds (the reply is written), answers
  // one that arrives meanwhile UNAVAILABLE, and closes. Blocks until all have. Idempotent.
  void Stop();
  int open_channels() const { return open_.load(); }

 private:
  ShmListener(const ShmListenerOptions& options, Dispatcher* dispatcher, Sequences* sequences, int fd)
      : options_(options), dispatcher_(dispatcher), sequences_(sequences), listen_fd_(fd) {}
  struct Exchange;  // one request taken off a channel (shm_listener.cc)
  void AcceptLoop();
  // One channel, from the caller's hello to its close: waits for each request on the state word and serves it.
  void Serve(int socket);
  void ServeStep(const Exchange& ex);
  void ServeForward(const Exchange& ex);
  // Writes the reply and records the call (GetStats and metrics; the access log is the gRPC calls').
  void Finish(const Exchange& ex, absl::Status s, const google::protobuf::MessageLite* response,
              const v1::Timing* timing, uint64_t tensor_bytes_in = 0, uint64_t tensor_bytes_out = 0) const;
  // Until the channel's wait word reaches `value` (a stream-ordered step): DEADLINE_EXCEEDED after order_timeout,
  // CANCELLED when the caller has gone.
  // OK also once `stop` (when given) says so.
  absl::Status AwaitWaitWord(const shm::Header* h, uint64_t value, int socket,
                             const std::function<bool()>& stop = nullptr) const;
  struct OrderRelease;
  // A step the device orders (StreamOrder.device): the channel's header mapped for the device (once per channel)
  // and the call's DeviceOrder; *released is where WatchDeviceOrder says why it released the wait, if it did.
  absl::Status OrderOnDevice(const Exchange& ex, uint64_t value, CallInfo* call,
                             std::shared_ptr<OrderRelease>* released);
  // Until the step's reply, or its word reached `value` (AwaitWaitWord): releases the wait (writes the word) once
  // order_timeout has passed or the caller has gone.
  void WatchDeviceOrder(const Exchange& ex, uint64_t value, OrderRelease* released,
                        const std::function<bool()>& replied) const;
  // *owner: the caller's identity for KV sequences ("local", or "token:<index>" when it presented a token).
  absl::Status Handshake(int socket, uid_t* uid, int* memfd, std::string* owner);
  // accept() failed with EMFILE/ENFILE: takes the pending caller off the backlog with a refusal (acceptor only).
  void RefuseAtDescriptorLimit();

  const ShmListenerOptions options_;
  Dispatcher* const dispatcher_;
  Sequences* const sequences_;
  int listen_fd_;
  // Held open so that at the descriptor limit one can be freed to accept and refuse a caller (acceptor only).
  int reserve_fd_ = -1;
  uint64_t refused_at_fd_limit_ = 0;  // acceptor only
  std::atomic<bool> stopping_{false};
  absl::Mutex stop_mu_;  // a second Stop() waits for the first to finish
  std::atomic<int> open_{0};
  std::atomic<int> awaiting_reply_{0};  // channel threads whose request is with the backend
  std::atomic<int> polling_requests_{0};  // channel threads polling for a request past --shm_spin_us
  std::thread acceptor_;
  struct Channel {
    std::thread thread;
    std::atomic<bool> finished{false};
  };
  absl::Mutex mu_;
  // Finished ones are joined by the acceptor as it goes (a thread's stack stays until it is joined).
  std::list<std::unique_ptr<Channel>> channels_ ABSL_GUARDED_BY(mu_);
  void ReapFinished();
};

}  // namespace attnd::server
