#include "shm_listener.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/notification.h"
#include "attnd/server/status_util.h"
#include "attnd/server/transports.h"
#include "attnd/transport/shm_channel.h"
#include "auth.h"
#include "call_observer.h"
#include "core_messages.h"
#include "spdlog/spdlog.h"

namespace attnd::server {
namespace {

// While a channel is idle its thread sleeps on the state word; it wakes this often to notice a closed socket
// or a shutdown.
constexpr absl::Duration kIdlePoll = absl::Milliseconds(50);
// Channel threads that poll for their replies at once; the rest sleep until theirs is written.
constexpr int kPollingRepliesAtMost = 2;
// How long a channel's thread polls for the caller's next request: --shm_spin_us, or 1.5x the gap before the
// channel's previous request, up to this, while at most kPollingRepliesAtMost threads poll past the flag. A caller
// whose own work between calls outlasts the flag (a Python step's return and next call, 50-70 us) would otherwise
// find the thread asleep and pay its wake-up on every call.
constexpr absl::Duration kLongRequestPoll = absl::Milliseconds(1);
// Calls on a shm channel are recorded (GetStats, metrics, logs) under this method name.
constexpr const char* kMethod = "ForwardShm";
constexpr const char* kStepMethod = "StepShm";
// A caller that connects and then sends nothing must not hold a thread for ever.
constexpr int kHandshakeTimeoutSeconds = 5;

// True once the caller has closed its end (or sent anything after the hello, which the protocol does not allow).
bool PeerGone(int socket) {
  pollfd p{socket, POLLIN | POLLRDHUP, 0};
  if (::poll(&p, 1, 0) <= 0) return false;
  return (p.revents & (POLLHUP | POLLRDHUP | POLLERR | POLLNVAL | POLLIN)) != 0;
}

void SendHelloReply(int socket, const absl::Status& status) {
  std::string message(status.message().substr(0, shm::kMaxHelloMessageBytes));
  const shm::HelloReply r{static_cast<int32_t>(status.code()), static_cast<uint32_t>(message.size())};
  if (shm::SendAll(socket, &r, sizeof(r)).ok() && !message.empty()) (void)shm::SendAll(socket, message.data(), message.size());
}

// What a reply said: its status and its size in the reply area.
struct Replied {
  absl::StatusCode code;
  uint64_t bytes;
};

// Writes the reply into the channel (or the error if the response does not fit) and hands the word back. The
// mapping is the caller's again after that, so what was written is returned, not read back.
Replied WriteReply(const shm::Mapping& m, absl::Status status, const google::protobuf::MessageLite* response) {
  shm::Header* h = m.header;
  if (status.ok()) {
    const size_t n = response->ByteSizeLong();
    if (n <= m.reply_capacity && response->SerializeToArray(m.reply(), static_cast<int>(n))) {
      h->reply_bytes = n;
      h->status_code = 0;
      shm::Publish(&h->state, shm::kReply, &h->client_sleeping);
      return Replied{absl::StatusCode::kOk, n};
    }
    status = absl::ResourceExhaustedError(absl::StrCat("reply: ", n, " bytes do not fit the channel's reply area of ",
                                                       m.reply_capacity, " bytes (open the channel with a larger one)"));
  }
  const std::string message(status.message().substr(0, m.reply_capacity));
  std::memcpy(m.reply(), message.data(), message.size());
  h->reply_bytes = message.size();
  h->status_code = static_cast<int32_t>(status.code());
  shm::Publish(&h->state, shm::kReply, &h->client_sleeping);
  return Replied{status.code(), message.size()};
}

// One request at a time: the reply is written before this thread looks at the word again. While few channels
// are busy, the thread polls for the reply (up to --shm_reply_spin_us) before it sleeps: the worker writes the
// reply, and a caller answered while this thread slept sends its next request at once and then waits on
// this thread's wake-up (H200, one caller at 1k: 32 us above the kernel, 39 without). So the poll must
// outlast the request: a 4k request spends ~265 us in the server, past the 50 us request poll. With many
// busy channels the pollers take CPU from the callers and workers (16 callers at 1k: 0.82 of the
// kernel-only rate, 0.87 without), hence kPollingRepliesAtMost.
class ReplyWait {
 public:
  // Counts this thread in `awaiting` until Wait returns.
  ReplyWait(std::atomic<int>* awaiting, absl::Duration reply_spin)
      : awaiting_(awaiting), poll_(awaiting->fetch_add(1) < kPollingRepliesAtMost), reply_spin_(reply_spin) {}
  // Called by whoever wrote the reply, last.
  void Replied() {
    done_.store(true, std::memory_order_release);
    replied_.Notify();
  }
  bool replied() const { return done_.load(std::memory_order_acquire); }
  void Wait() {
    for (const absl::Time spin_end = absl::Now() + (poll_ ? reply_spin_ : absl::ZeroDuration());
         !done_.load(std::memory_order_acquire) && absl::Now() < spin_end;) {
      shm::CpuRelax();
    }
    replied_.WaitForNotification();
    awaiting_->fetch_sub(1);
  }

 private:
  std::atomic<int>* const awaiting_;
  const bool poll_;
  const absl::Duration reply_spin_;
  std::atomic<bool> done_{false};
  absl::Notification replied_;
};

// The reply message of a finished Forward or step, taking its O and LSE; null for one that failed.
template <typename Response, typename Job>
std::unique_ptr<Response> ReplyOf(const absl::Status& s, Job* job, absl::string_view backend) {
  if (job == nullptr || !s.ok()) return nullptr;
  auto response = std::make_unique<Response>();
  if constexpr (std::is_same_v<Job, StepJob>) {
    FillStepReply(*job, backend, response.get());
  } else {
    FillForwardReply(*job, backend, response.get());
  }
  response->set_o(std::move(job->o));
  response->set_lse(std::move(job->lse));
  return response;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ShmListener>> ShmListener::Start(const ShmListenerOptions& options,
                                                                Dispatcher* dispatcher, Sequences* sequences) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (options.path.empty() || options.path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("shm_socket: '", options.path, "' is empty or longer than ",
                                                   sizeof(addr.sun_path) - 1, " bytes"));
  }
  std::memcpy(addr.sun_path, options.path.c_str(), options.path.size() + 1);
  // A socket file left by a server that died would make bind fail; anything else at the path is left alone.
  struct stat st;
  if (::lstat(options.path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode)) ::unlink(options.path.c_str());
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("shm_socket: socket: ", std::strerror(errno)));
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(fd, 64) != 0) {
    const int e = errno;
    ::close(fd);
    return absl::UnavailableError(absl::StrCat("shm_socket: cannot listen on ", options.path, ": ", std::strerror(e)));
  }
  if (::chmod(options.path.c_str(), options.mode) != 0) {
    ::close(fd);
    ::unlink(options.path.c_str());
    return absl::PermissionDeniedError(absl::StrCat("shm_socket: cannot chmod ", options.path));
  }
  std::unique_ptr<ShmListener> l(new ShmListener(options, dispatcher, sequences, fd));
  l->reserve_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  l->acceptor_ = std::thread([p = l.get()] { p->AcceptLoop(); });
  spdlog::info("attnd {} channels on {} (up to {}, {} MiB areas)", kShm, options.path, options.max_channels,
               options.max_area_bytes >> 20);
  return l;
}

ShmListener::~ShmListener() { Stop(); }

void ShmListener::Stop() {
  absl::MutexLock stop_lock(&stop_mu_);
  if (stopping_.exchange(true)) return;
  if (acceptor_.joinable()) acceptor_.join();
  ::close(listen_fd_);
  if (reserve_fd_ >= 0) ::close(reserve_fd_);
  ::unlink(options_.path.c_str());
  absl::MutexLock lock(&mu_);
  for (auto& c : channels_) c->thread.join();
  channels_.clear();
}

void ShmListener::ReapFinished() {
  absl::MutexLock lock(&mu_);
  for (auto it = channels_.begin(); it != channels_.end();) {
    if ((*it)->finished.load()) {
      (*it)->thread.join();
      it = channels_.erase(it);
    } else {
      ++it;
    }
  }
}

void ShmListener::AcceptLoop() {
  while (!stopping_.load()) {
    ReapFinished();
    pollfd p{listen_fd_, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(kIdlePoll))) <= 0) continue;
    const int s = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (s < 0) {
      if (errno == EMFILE || errno == ENFILE) RefuseAtDescriptorLimit();
      continue;
    }
    if (open_.load() >= static_cast<int>(options_.max_channels)) {
      SendHelloReply(s, absl::ResourceExhaustedError(absl::StrCat("shm channel: ", options_.max_channels,
                                                                  " channels are open (--shm_max_channels)")));
      ::close(s);
      continue;
    }
    open_.fetch_add(1);
    auto c = std::make_unique<Channel>();
    Channel* raw = c.get();
    absl::MutexLock lock(&mu_);
    c->thread = std::thread([this, s, raw] {
      Serve(s);  // gives its place back (open_) itself
      raw->finished.store(true);
    });
    channels_.push_back(std::move(c));
  }
}

void ShmListener::RefuseAtDescriptorLimit() {
  // The pending caller stays in the backlog, so poll() keeps saying readable: without taking it off, this loop
  // would spin. The reserved descriptor makes room to accept it and tell it why. Another thread may take the slot
  // it frees before accept does (the reserve is lost): it is taken again here as soon as a descriptor is free.
  if (reserve_fd_ < 0) reserve_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (reserve_fd_ >= 0) {
    ::close(reserve_fd_);
    reserve_fd_ = -1;
    const int s = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (s >= 0) {
      SendHelloReply(s, absl::ResourceExhaustedError("shm channel: the server is at its open-descriptor limit"));
      ::close(s);
    }
    reserve_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  }
  if (refused_at_fd_limit_++ % 1000 == 0) {
    spdlog::warn("shm channel refused: the server is at its open-descriptor limit ({} such refusals)",
                 refused_at_fd_limit_);
  }
  // Without a reserve (another thread holds the freed slot) the caller stays queued: wait rather than spin.
  if (reserve_fd_ < 0) absl::SleepFor(kIdlePoll);
}

absl::Status ShmListener::Handshake(int socket, uid_t* uid, int* memfd, std::string* owner) {
  timeval tv{kHandshakeTimeoutSeconds, 0};
  ::setsockopt(socket, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (::getsockopt(socket, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return absl::PermissionDeniedError("shm channel: cannot read the caller's credentials");
  }
  *uid = cred.uid;
  // Like the unix socket's file mode: the caller shares memory with the server, so only its own user (or root).
  if (cred.uid != ::geteuid() && cred.uid != 0) {
    return absl::PermissionDeniedError(absl::StrCat("shm channel: uid ", cred.uid, " is not the server's (", ::geteuid(), ")"));
  }
  shm::Hello hello{};
  ATTND_RETURN_IF_ERROR(shm::ReceiveWithFd(socket, &hello, sizeof(hello), memfd));
  if (hello.magic != shm::kMagic) {
    return absl::InvalidArgumentError(absl::StrFormat("shm channel: bad magic 0x%08x in the hello (expected 0x%08x)",
                                                      hello.magic, shm::kMagic));
  }
  if (hello.version != shm::kVersion) {
    return absl::InvalidArgumentError(absl::StrCat("shm channel: hello version ", hello.version, ", this server speaks ",
                                                   shm::kVersion));
  }
  if (hello.token_bytes > shm::kMaxTokenBytes) return absl::InvalidArgumentError("shm channel: token too long");
  std::string token(hello.token_bytes, '\0');
  if (!token.empty()) ATTND_RETURN_IF_ERROR(shm::ReceiveAll(socket, token.data(), token.size()));
  *owner = "local";
  if (!options_.tokens.empty()) {
    // Every token is compared (constant time in which one matches), as the gRPC token check does.
    int index = -1;
    for (size_t i = 0; i < options_.tokens.size(); ++i) {
      if (ConstantTimeEquals(token, options_.tokens[i]) && index < 0) index = static_cast<int>(i);
    }
    if (index < 0) return absl::UnauthenticatedError("shm channel: missing or unknown token");
    *owner = absl::StrCat("token:", index);
  }
  if (*memfd < 0) return absl::InvalidArgumentError("shm channel: the hello carried no memfd");
  return absl::OkStatus();
}

absl::Status ShmListener::AwaitWaitWord(const shm::Header* h, uint64_t value, int socket,
                                        const std::function<bool()>& stop) const {
  // The GPU stores the word, so there is no futex to sleep on: poll, first as the reply is polled (a producer of
  // a decode step's inputs finishes within it), then in naps that stay short next to a step's kernel time.
  const absl::Time start = absl::Now();
  const absl::Time spin_end = start + options_.reply_spin;
  const absl::Time deadline = options_.order_timeout == absl::InfiniteDuration()
                                  ? absl::InfiniteFuture()
                                  : start + options_.order_timeout;
  absl::Duration nap = absl::Microseconds(5);
  for (;;) {
    if (static_cast<int64_t>(h->wait_word.load(std::memory_order_acquire) - value) >= 0) return absl::OkStatus();
    if (stop && stop()) return absl::OkStatus();
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "order.wait_value: the channel's wait word did not reach ", value, " within --step_order_timeout_s=",
          absl::ToDoubleSeconds(options_.order_timeout),
          " (the caller's stream never got there); nothing of the step was kept"));
    }
    if (now < spin_end) {
      shm::CpuRelax();
      continue;
    }
    if (PeerGone(socket)) {
      return absl::CancelledError("the caller closed its channel while its step waited for order.wait_value");
    }
    absl::SleepFor(nap);
    nap = std::min(nap * 2, absl::Microseconds(100));
  }
}

// One request taken off a channel: where its reply goes, and what the record of the call needs.
struct ShmListener::Exchange {
  const shm::Mapping& m;
  int socket;
  const std::string& owner;
  uint32_t kind;
  uint64_t n;  // the request's bytes
  absl::Time start;
  // The header page as the device sees it, mapped by the channel's first step the device orders; unmapped when the
  // channel closes (no step is in flight then).
  std::optional<Backend::MappedHostMemory>* device_header;
};

void ShmListener::Serve(int socket) {
  uid_t uid = 0;
  int memfd = -1;
  std::string owner;
  absl::Status status = Handshake(socket, &uid, &memfd, &owner);
  absl::StatusOr<shm::Mapping> mapped = status.ok() ? shm::MapServerSide(memfd, options_.max_area_bytes) : status;
  if (memfd >= 0) ::close(memfd);  // the mapping keeps the memory
  if (!mapped.ok()) {
    // The place is free before the caller hears the refusal, so that a caller retrying at once is not counted
    // against --shm_max_channels by a channel that never opened.
    open_.fetch_sub(1);
    SendHelloReply(socket, mapped.status());
    spdlog::warn("shm channel refused (uid {}): {}", uid, std::string(mapped.status().message()));
    ::close(socket);
    return;
  }
  SendHelloReply(socket, absl::OkStatus());
  const shm::Mapping m = *mapped;
  shm::Header* h = m.header;
  spdlog::info("shm channel opened (uid {}, {} + {} bytes)", uid, m.request_capacity, m.reply_capacity);
  absl::Duration last_gap = absl::ZeroDuration();  // from a reply to the next request
  std::optional<Backend::MappedHostMemory> device_header;
  for (;;) {
    const absl::Time replied_at = absl::Now();
    const absl::Duration want = std::min(last_gap * 3 / 2, kLongRequestPoll);
    const bool long_poll = want > options_.spin && polling_requests_.fetch_add(1) < kPollingRepliesAtMost;
    const bool got = shm::AwaitState(&h->state, shm::kRequest, &h->server_sleeping,
                                     long_poll ? want : options_.spin, absl::InfiniteFuture(), kIdlePoll,
                                     [&] { return stopping_.load() || PeerGone(socket); });
    if (want > options_.spin) polling_requests_.fetch_sub(1);
    if (!got) break;
    const absl::Time start = absl::Now();
    last_gap = start - replied_at;
    // Copied out before anything reads it: the caller can write to the mapping at any time.
    const uint64_t n = h->request_bytes;
    const uint32_t kind = h->kind;
    const Exchange ex{m, socket, owner, kind, n, start, &device_header};
    if (n > m.request_capacity) {
      Finish(ex, absl::InvalidArgumentError(absl::StrCat("request_bytes: ", n, " exceeds the channel's request area (",
                                                         m.request_capacity, " bytes)")), nullptr, nullptr);
      continue;
    }
    if (kind == shm::kStepRequest) {
      ServeStep(ex);
      continue;
    }
    if (kind != shm::kForwardRequest) {
      Finish(ex, absl::InvalidArgumentError(absl::StrCat("kind: ", kind, " is not a request kind this server knows (0: "
                                                         "Forward, 1: Step)")), nullptr, nullptr);
      continue;
    }
    ServeForward(ex);
  }
  // A request published after the last look, during a shutdown, is answered rather than dropped.
  if (stopping_.load() && h->state.load(std::memory_order_acquire) == shm::kRequest) {
    WriteReply(m, absl::UnavailableError("the server is shutting down"), nullptr);
  }
  device_header.reset();  // unregistered before the pages go
  ::munmap(h, m.bytes);
  open_.fetch_sub(1);
  ::close(socket);
  spdlog::info("shm channel closed (uid {})", uid);
}

void ShmListener::Finish(const Exchange& ex, absl::Status s, const google::protobuf::MessageLite* response,
                         const v1::Timing* timing, uint64_t tensor_bytes_in, uint64_t tensor_bytes_out) const {
  const Replied sent = WriteReply(ex.m, s, response);
  if (options_.stats == nullptr) return;
  CallRecord r;
  r.method = ex.kind == shm::kStepRequest ? kStepMethod : kMethod;
  r.code = sent.code;
  if (!s.ok()) r.error = std::string(s.message());
  r.total = absl::Now() - ex.start;
  if (sent.code == absl::StatusCode::kOk) {
    r.queue = absl::Microseconds(timing->queue_us());
    r.kernel = absl::Microseconds(timing->kernel_us());
    r.bytes_out = sent.bytes;
    r.tensor_bytes_in = tensor_bytes_in;
    r.tensor_bytes_out = tensor_bytes_out;
  }
  r.bytes_in = ex.n <= ex.m.request_capacity ? ex.n : 0;
  r.in_stats = true;
  options_.stats->Record(r);
}

void ShmListener::ServeStep(const Exchange& ex) {
  v1::StepRequest step;
  {
    std::string bytes(reinterpret_cast<const char*>(ex.m.request()), ex.n);
    if (!step.ParseFromString(bytes)) {
      Finish(ex, absl::InvalidArgumentError("request: not a StepRequest (unparseable)"), nullptr, nullptr);
      return;
    }
  }
  if (sequences_ == nullptr) {
    Finish(ex, absl::FailedPreconditionError("KV sequences are not enabled on this server"), nullptr, nullptr);
    return;
  }
  if (step.request_id().empty()) step.set_request_id(GenerateRequestId());
  if (step.has_order() && step.order().wait_value() == 0) {
    absl::Status bad = absl::InvalidArgumentError("order.wait_value: must be >= 1");
    LogOutcome(kStepMethod, step.request_id(), bad, ex.start);
    Finish(ex, std::move(bad), nullptr, nullptr);
    return;
  }
  CallInfo call;
  call.accepted = absl::Now();
  std::shared_ptr<OrderRelease> released;  // a device-ordered step's wait, if this thread released it: why
  if (step.has_order()) {
    // A stream-ordered caller pipelines: it may send a sequence's next step on another channel before this one's
    // reply (the core admits it behind this one).
    call.chain = true;
    if (step.order().device()) {
      absl::Status mapped = OrderOnDevice(ex, step.order().wait_value(), &call, &released);
      if (!mapped.ok()) {
        LogOutcome(kStepMethod, step.request_id(), mapped, ex.start);
        Finish(ex, std::move(mapped), nullptr, nullptr);
        return;
      }
    } else {
      // The step's inputs may be read once the caller's stream has written the wait word: the core admits the
      // step meanwhile and calls this before the launch.
      call.ready = [this, h = ex.m.header, socket = ex.socket, want = step.order().wait_value()] {
        return AwaitWaitWord(h, want, socket);
      };
    }
  }
  uint64_t in = 0;
  for (const v1::TensorInput* t : {&step.q(), &step.k(), &step.v()}) {
    if (t->source_case() == v1::TensorInput::kData) in += t->data().size();
  }
  ReplyWait wait(&awaiting_reply_, options_.reply_spin);
  std::atomic<bool> failed{false};
  sequences_->Step(ex.owner, StepArgsFromProto(step), call, [&](absl::Status s, StepJob* job) {
    failed.store(!s.ok());
    std::unique_ptr<v1::StepResponse> response = ReplyOf<v1::StepResponse>(s, job, dispatcher_->backend()->name());
    LogOutcome(kStepMethod, step.request_id(), s, call.accepted);
    const uint64_t out = response != nullptr ? response->o().size() + response->lse().size() : 0;
    Finish(ex, std::move(s), response.get(), response != nullptr ? &response->timing().timing() : nullptr, in, out);
    wait.Replied();
  });
  // Admitted unless refused already: a step refused at admission is not, and its caller learns that from the
  // reply (a step that fails later was admitted, and one admitted behind it fails with it).
  if (step.has_order() && !failed.load()) {
    ex.m.header->admitted_word.store(step.order().wait_value(), std::memory_order_release);
  }
  if (released != nullptr) {
    WatchDeviceOrder(ex, step.order().wait_value(), released.get(), [&wait] { return wait.replied(); });
  }
  wait.Wait();
}

// Why a channel thread released a device-ordered step's wait itself (WatchDeviceOrder), read when the step ends.
struct ShmListener::OrderRelease {
  absl::Mutex mu;
  absl::Status why ABSL_GUARDED_BY(mu);
};

absl::Status ShmListener::OrderOnDevice(const Exchange& ex, uint64_t value, CallInfo* call,
                                        std::shared_ptr<OrderRelease>* released) {
  Backend* backend = dispatcher_->backend();
  if (!options_.device_order || !backend->device_order()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "order.device: this server does not order steps on the device (",
        options_.device_order ? absl::StrCat("the ", backend->name(), " backend cannot") : "--shm_device_order=false",
        "; ServerInfo.device_ordered_steps); send the step without it"));
  }
  if (!ex.device_header->has_value()) {
    absl::StatusOr<Backend::MappedHostMemory> mapped = backend->MapHostMemory(ex.m.header, shm::kHeaderBytes);
    if (!mapped.ok()) return mapped.status();
    *ex.device_header = *std::move(mapped);
  }
  const uint64_t base = (*ex.device_header)->device_address;
  auto release = std::make_shared<OrderRelease>();
  *released = release;
  call->device_order = CallInfo::DeviceOrder{base + shm::kWaitWordOffset, base + shm::kDoneWordOffset, value,
                                             [release]() -> absl::Status {
                                               absl::MutexLock lock(&release->mu);
                                               return release->why;
                                             }};
  return absl::OkStatus();
}

void ShmListener::WatchDeviceOrder(const Exchange& ex, uint64_t value, OrderRelease* released,
                                   const std::function<bool()>& replied) const {
  // The step's stream waits for the caller's word on the GPU. Should it never come (a producer that hangs, a caller
  // that died), this thread writes the word itself, so the server's stream goes on; the step then fails.
  absl::Status waited = AwaitWaitWord(ex.m.header, value, ex.socket, replied);
  if (waited.ok()) return;
  {
    absl::MutexLock lock(&released->mu);
    released->why = std::move(waited);
  }
  shm::RaiseWord(&ex.m.header->wait_word, value);
}

void ShmListener::ServeForward(const Exchange& ex) {
  auto request = std::make_shared<v1::ForwardRequest>();
  if (absl::Status read = shm::ReadRequest(ex.m, ex.n, request.get()); !read.ok()) {
    Finish(ex, std::move(read), nullptr, nullptr);
    return;
  }
  if (request->request_id().empty()) request->set_request_id(GenerateRequestId());
  CallInfo call;
  call.accepted = absl::Now();
  ForwardArgs args;
  if (absl::Status decoded = ForwardArgsFromProto(*request, nullptr, &args); !decoded.ok()) {
    LogOutcome(kMethod, request->request_id(), decoded, call.accepted);
    Finish(ex, std::move(decoded), nullptr, nullptr);
    return;
  }
  ReplyWait wait(&awaiting_reply_, options_.reply_spin);
  RequestBytes bytes;  // the reply runs before this thread goes on (it waits for the reply below)
  dispatcher_->Dispatch(args, call, &bytes, [&](absl::Status s, ForwardJob* job) {
    std::unique_ptr<v1::ForwardResponse> response =
        ReplyOf<v1::ForwardResponse>(s, job, dispatcher_->backend()->name());
    LogOutcome(kMethod, request->request_id(), s, call.accepted);
    const uint64_t out = response != nullptr ? response->o().size() + response->lse().size() : 0;
    Finish(ex, std::move(s), response.get(), response != nullptr ? &response->timing() : nullptr,
           bytes.q + bytes.k + bytes.v, out);
    wait.Replied();
  });
  wait.Wait();
}

}  // namespace attnd::server
