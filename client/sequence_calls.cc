#include "attnd/client/client.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "attnd/client/shm_channel.h"
#include "client_internal.h"

namespace attnd::client {
namespace {
// Steps of this process waiting for their answers on StepStreams, and how many of them may poll.
std::atomic<int> g_steps_waiting{0};
constexpr int kPollingStepsAtMost = 2;
}  // namespace

Client::StepStreamCall::StepStreamCall(v1::Attention::Stub* stub, const std::string& auth_token,
                                       bool wait_for_ready, absl::Duration poll)
    : poll_(poll) {
  // No deadline on the stream: each step has its own (the wait below, and timeout_us for the server).
  ctx_.set_wait_for_ready(wait_for_ready);
  if (!auth_token.empty()) ctx_.AddMetadata("authorization", "Bearer " + auth_token);
  // Corked: the headers leave with the first step (one write), and StartCall itself completes no operation.
  ctx_.set_initial_metadata_corked(true);
  rw_ = stub->PrepareAsyncStepStream(&ctx_, &cq_);
  rw_->StartCall(nullptr);
}

Client::StepStreamCall::~StepStreamCall() {
  // Cancelling never waits for the server; a step in flight there is still answered (to no one) and
  // committed as it would be for a unary call whose client went away.
  ctx_.TryCancel();
  if (!finish_started_) {
    rw_->Finish(&final_, Tag(kFinish));
    ++outstanding_;
  }
  Drain();
  cq_.Shutdown();
  void* tag;
  bool ok;
  while (cq_.Next(&tag, &ok)) {
  }
}

absl::Status Client::StepStreamCall::Round(const v1::StepStreamRequest& request, v1::StepStreamResponse* response,
                                           absl::Time deadline, bool* sent) {
  *sent = false;
  bool wrote = false, read = false, failed = false, cancel = false;
  if (read_posted_) {
    // Idle until now: anything that completed meanwhile means the stream has ended (a failed read), or that
    // the server sent what nobody asked for (then this client ends it).
    void* tag;
    bool ok;
    while (!failed && cq_.AsyncNext(&tag, &ok, std::chrono::system_clock::time_point()) ==
                          grpc::CompletionQueue::GOT_EVENT) {
      --outstanding_;
      failed = true;
      cancel = ok;
    }
  } else {
    rw_->Read(&response_, Tag(kRead));
    read_posted_ = true;
    ++outstanding_;
  }
  if (!failed) {
    rw_->Write(request, Tag(kWrite));
    ++outstanding_;
  }
  const std::chrono::system_clock::time_point until = absl::ToChronoTime(deadline);
  struct Waiting {
    const bool may_poll = g_steps_waiting.fetch_add(1, std::memory_order_relaxed) < kPollingStepsAtMost;
    ~Waiting() { g_steps_waiting.fetch_sub(1, std::memory_order_relaxed); }
  } waiting;
  const absl::Time poll_end =
      waiting.may_poll && poll_ > absl::ZeroDuration() ? absl::Now() + poll_ : absl::InfinitePast();
  while (!(wrote && read) && !failed) {
    void* tag;
    bool ok;
    const bool polling = poll_end > absl::InfinitePast() && absl::Now() < poll_end;
    const grpc::CompletionQueue::NextStatus next =
        cq_.AsyncNext(&tag, &ok, polling ? std::chrono::system_clock::time_point() : until);
    if (next == grpc::CompletionQueue::TIMEOUT && polling) continue;
    if (next == grpc::CompletionQueue::TIMEOUT) {
      broken_ = true;
      *sent = true;  // it may have reached the server
      return absl::DeadlineExceededError(
          "no answer to the step before its deadline; the stream was cancelled (the step may have run)");
    }
    if (next != grpc::CompletionQueue::GOT_EVENT) break;
    --outstanding_;
    if (!ok) {
      failed = true;
      break;
    }
    if (reinterpret_cast<intptr_t>(tag) == kWrite) wrote = *sent = true;
    if (reinterpret_cast<intptr_t>(tag) == kRead) read = true;
  }
  if (!failed && wrote && read) {
    *response = std::move(response_);
    response_.Clear();
    rw_->Read(&response_, Tag(kRead));
    ++outstanding_;
    return absl::OkStatus();
  }
  // The call is over: its status says why (UNIMPLEMENTED from a server without StepStream, UNAVAILABLE ...).
  broken_ = true;
  if (cancel) ctx_.TryCancel();
  rw_->Finish(&final_, Tag(kFinish));
  finish_started_ = true;
  ++outstanding_;
  Drain(sent);
  absl::Status status = FromGrpcStatus(final_);
  if (status.ok() || status.code() == absl::StatusCode::kCancelled) {
    status = absl::UnavailableError(absl::StrCat("the step stream ended before the step was answered",
                                                 final_.error_message().empty() ? "" : ": ",
                                                 final_.error_message()));
  }
  return status;
}

void Client::StepStreamCall::Drain(bool* sent) {
  while (outstanding_ > 0) {
    void* tag;
    bool ok;
    if (!cq_.Next(&tag, &ok)) break;
    --outstanding_;
    if (sent != nullptr && ok && reinterpret_cast<intptr_t>(tag) == kWrite) *sent = true;
  }
}

std::string SequenceAddress(std::string_view sequence_id) {
  const size_t at = sequence_id.rfind('@');
  return at == std::string_view::npos ? std::string() : std::string(sequence_id.substr(at + 1));
}

namespace {

// UNAVAILABLE from the server sequences are pinned to (gone, or going): the message names that server, so that
// a fleet's caller knows which sequences went with it (the others carry on).
absl::Status NameTheServer(const std::string& address, const std::string& target, absl::Status st) {
  if (st.code() != absl::StatusCode::kUnavailable || address.empty() || address == target) return st;
  return absl::UnavailableError(absl::StrCat("the server holding the sequence (", address, "): ", st.message()));
}

// The server's trailer naming where a sequence went, kept on the status as a payload of the same name.
constexpr char kMovedToMetadata[] = "attnd-moved-to";
// Hops CurrentSequenceId follows (a sequence moved on from where it moved to); more would mean a cycle.
constexpr int kMaxMoveHops = 8;
// The backoff of a step whose sequence is being moved, from 1 ms up to this.
constexpr absl::Duration kMovingBackoffMax = absl::Milliseconds(50);

void KeepMovedTo(const grpc::ClientContext& ctx, absl::Status* st) {
  const auto& trailers = ctx.GetServerTrailingMetadata();
  if (auto it = trailers.find(kMovedToMetadata); it != trailers.end()) {
    st->SetPayload(kMovedToMetadata, absl::Cord(std::string(it->second.data(), it->second.size())));
  }
}

// ABORTED because a sequence of the step is held by an export: retryable, the step changed nothing.
bool BeingMoved(const absl::Status& st) {
  return st.code() == absl::StatusCode::kAborted && absl::StrContains(st.message(), " is being moved");
}

}  // namespace

std::string Client::CurrentSequenceId(const std::string& sequence_id) const {
  absl::MutexLock lock(&moved_mu_);
  std::string id = sequence_id;
  for (int hop = 0; hop < kMaxMoveHops; ++hop) {
    auto it = moved_.find(id);
    if (it == moved_.end()) break;
    id = it->second;
  }
  return id;
}

uint64_t Client::moves_followed() const { return moves_followed_.load(std::memory_order_acquire); }

std::optional<std::string> Client::LearnMove(const absl::Status& st, const std::vector<std::string>& ids) {
  if (st.code() != absl::StatusCode::kNotFound) return std::nullopt;
  std::string to;
  if (auto trailer = st.GetPayload(kMovedToMetadata); trailer.has_value()) {
    to = std::string(*trailer);
  } else {
    // A StepStream's answers carry a code and a message, no metadata: the message names the new id the same way.
    constexpr absl::string_view kMarker = " is gone: moved to ";
    const size_t at = st.message().find(kMarker);
    if (at == absl::string_view::npos) return std::nullopt;
    const absl::string_view rest = st.message().substr(at + kMarker.size());
    to = std::string(rest.substr(0, rest.find(' ')));
  }
  // The message names the sequence that is gone ("sequence <id> is gone"); one id needs no looking.
  const std::string* from = ids.size() == 1 ? &ids[0] : nullptr;
  for (size_t i = 0; from == nullptr && i < ids.size(); ++i) {
    if (absl::StrContains(st.message(), absl::StrCat("sequence ", ids[i], " is gone"))) from = &ids[i];
  }
  if (from == nullptr || to.empty() || to == *from) return std::nullopt;
  absl::MutexLock lock(&moved_mu_);
  if (options_.moved_ids_remembered > 0 && moved_.emplace(*from, to).second) {
    moved_order_.push_back(*from);
    while (moved_order_.size() > options_.moved_ids_remembered) {
      moved_.erase(moved_order_.front());
      moved_order_.pop_front();
    }
  }
  moves_followed_.fetch_add(1, std::memory_order_release);
  return to;
}

absl::StatusOr<std::string> Client::AddressOf(const std::vector<std::string>& ids, const char* field) {
  std::string address;
  for (size_t i = 0; i < ids.size(); ++i) {
    std::string a = SequenceAddress(ids[i]);
    if (i == 0) {
      address = std::move(a);
    } else if (a != address) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, "[", i, "]: lives on '", a, "' but ", field, "[0] on '", address,
          "'; one call reaches one server (send a call per server)"));
    }
  }
  return address;
}

absl::StatusOr<v1::Attention::Stub*> Client::StubFor(const std::string& address) {
  if (address.empty() || address == options_.target) return stub_.get();
  absl::MutexLock lock(&pinned_mu_);
  auto it = pinned_.find(address);
  if (it != pinned_.end()) return it->second.stub.get();
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = MakeChannel(options_, address);
  if (!channel.ok()) {
    return absl::Status(channel.status().code(),
                        absl::StrCat("sequence pinned to '", address, "': ", channel.status().message()));
  }
  std::unique_ptr<v1::Attention::Stub> stub = v1::Attention::NewStub(*channel);
  return pinned_.emplace(address, Pinned{*std::move(channel), std::move(stub)}).first->second.stub.get();
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> Client::ChannelFor(const std::string& address) {
  if (address.empty() || address == options_.target) return channel_;
  absl::StatusOr<v1::Attention::Stub*> stub = StubFor(address);  // makes the pinned channel when there is none
  if (!stub.ok()) return stub.status();
  absl::MutexLock lock(&pinned_mu_);
  return pinned_.at(address).channel;
}

absl::StatusOr<v1::OpenSequenceResponse> Client::PlaceSequences(const v1::OpenSequenceRequest& request,
                                                                const CallOptions& call) {
  // Each attempt is a new call, which the load balancer gives to the next server it has a connection to; a
  // server answering a second time means every one of those has refused. Servers the target lists but the
  // balancer has not connected to yet (a fresh client) get a few short waits to come up first.
  std::vector<std::pair<std::string, absl::Status>> refusals;
  const size_t listed = ListedServers(options_.target);
  absl::Duration backoff = absl::Milliseconds(1);
  for (;;) {
    grpc::ClientContext ctx;
    Prepare(&ctx, call);
    v1::OpenSequenceResponse response;
    absl::Status st = FromGrpcStatus(stub_->OpenSequence(&ctx, request, &response));
    if (st.ok()) return response;
    // No room (RESOURCE_EXHAUSTED) or no new sequences at all (UNAVAILABLE: draining, shutting down).
    const bool elsewhere =
        st.code() == absl::StatusCode::kResourceExhausted || st.code() == absl::StatusCode::kUnavailable;
    if (!elsewhere || !IsFleetTarget(options_.target)) return st;
    const std::string peer = ctx.peer();
    const auto seen = std::find_if(refusals.begin(), refusals.end(), [&](const auto& r) { return r.first == peer; });
    if (seen == refusals.end()) {
      refusals.emplace_back(peer, std::move(st));
      continue;
    }
    if (refusals.size() < listed && backoff <= absl::Milliseconds(32)) {
      absl::SleepFor(backoff);
      backoff *= 2;
      continue;
    }
    if (refusals.size() == 1) return seen->second;
    // RESOURCE_EXHAUSTED when some server is out of room; UNAVAILABLE when all are only going away.
    std::string reasons;
    absl::StatusCode code = absl::StatusCode::kUnavailable;
    for (const auto& [server, status] : refusals) {
      absl::StrAppend(&reasons, "; ", server, ": ", status.message());
      if (status.code() == absl::StatusCode::kResourceExhausted) code = status.code();
    }
    return absl::Status(code, absl::StrCat("every server of ", options_.target, " refused the sequences", reasons));
  }
}

absl::StatusOr<OpenedSequences> Client::OpenSequence(const SequenceShape& shape, int64_t max_tokens, uint32_t count,
                                                     const CallOptions& call) {
  v1::OpenSequenceRequest req;
  *req.mutable_shape() = ToProto(shape);
  req.set_max_tokens(max_tokens);
  req.set_count(count);
  absl::StatusOr<v1::OpenSequenceResponse> opened = PlaceSequences(req, call);
  if (!opened.ok()) return opened.status();
  const v1::OpenSequenceResponse& resp = *opened;
  const uint32_t want = count == 0 ? 1 : count;
  if (resp.sequence_ids_size() != static_cast<int>(want)) {
    return absl::InternalError(absl::StrCat("OpenSequence: the server returned ", resp.sequence_ids_size(),
                                            " ids for ", want, " sequences"));
  }
  OpenedSequences out;
  out.ids.assign(resp.sequence_ids().begin(), resp.sequence_ids().end());
  out.max_tokens = resp.max_tokens();
  out.page_tokens = resp.page_tokens();
  return out;
}

absl::StatusOr<StepResult> Client::Step(const StepSpec& spec, const CallOptions& call) {
  absl::StatusOr<v1::StepRequest> request = MakeStepRequest(spec);
  if (!request.ok()) return request.status();
  return Step(*request, call);
}

// Sequences of one call that name two servers once some have been followed: each is asked about once (a
// GetSequence follows a move of its own), so that a call whose sequences all moved to one server is sent there.
void Client::LearnMovesOf(const std::vector<std::string>& ids, const CallOptions& call) {
  if (AddressOf(ids, "sequences").ok()) return;
  for (const std::string& id : ids) GetSequence(id, call).IgnoreError();
}

// A step that failed changed nothing: the server finds and checks every sequence it names (NOT_FOUND for a moved
// one, ABORTED for one being moved) before it touches any (Sequences::FindStepSequences), so it goes again as is.
absl::StatusOr<StepResult> Client::Step(const v1::StepRequest& request, const CallOptions& call) {
  std::optional<v1::StepRequest> followed;  // a copy naming the new ids, made only when a sequence moved
  auto follow = [&] {
    const v1::StepRequest& now = followed ? *followed : request;
    for (int i = 0; i < now.sequences_size(); ++i) {
      std::string id = CurrentSequenceId(now.sequences(i).sequence_id());
      if (id == now.sequences(i).sequence_id()) continue;
      if (!followed) followed = request;
      followed->mutable_sequences(i)->set_sequence_id(std::move(id));
    }
  };
  follow();
  const absl::Time retry_until = absl::Now() + options_.moving_step_retry;
  absl::Duration backoff = absl::Milliseconds(1);
  for (int follows = 0;;) {
    const v1::StepRequest& sent = followed ? *followed : request;
    absl::StatusOr<StepResult> result = StepOnce(sent, call);
    if (result.ok()) return result;
    std::vector<std::string> ids;
    for (const auto& s : sent.sequences()) ids.push_back(s.sequence_id());
    // Each answer names one moved sequence: a step of several follows each in turn.
    if (follows < sent.sequences_size() && LearnMove(result.status(), ids).has_value()) {
      ++follows;
      follow();
      ids.clear();
      for (const auto& s : (followed ? *followed : request).sequences()) ids.push_back(s.sequence_id());
      LearnMovesOf(ids, call);
      follow();
      continue;
    }
    if (!BeingMoved(result.status()) || absl::Now() + backoff > retry_until) return result;
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, kMovingBackoffMax);
  }
}

absl::StatusOr<StepResult> Client::StepOnce(const v1::StepRequest& request, const CallOptions& call) {
  std::vector<std::string> ids;
  ids.reserve(request.sequences_size());
  for (const auto& s : request.sequences()) ids.push_back(s.sequence_id());
  absl::StatusOr<std::string> address = AddressOf(ids, "sequences");
  if (!address.ok()) return address.status();
  const bool pinned_elsewhere = !address->empty() && *address != options_.target;
  const Transport t = call.transport ? *call.transport : options_.transport;
  if (t == Transport::kShm && !pinned_elsewhere) return StepOverShm(request, call);
  absl::StatusOr<v1::Attention::Stub*> stub = StubFor(*address);
  if (!stub.ok()) return stub.status();
  if (t != Transport::kUnary) {
    std::optional<absl::StatusOr<StepResult>> streamed = StepOverStream(*stub, *address, request, call);
    if (streamed.has_value()) {
      if (!streamed->ok()) return NameTheServer(*address, options_.target, streamed->status());
      return *std::move(streamed);
    }
  }
  grpc::ClientContext ctx;
  Prepare(&ctx, call);
  const absl::Time start = absl::Now();
  v1::StepResponse resp;
  if (absl::Status st = FromGrpcStatus((*stub)->Step(&ctx, request, &resp)); !st.ok()) {
    KeepMovedTo(ctx, &st);
    return NameTheServer(*address, options_.target, std::move(st));
  }
  return StepResultOf(request, std::move(resp), Transport::kUnary, start);
}

std::optional<absl::StatusOr<StepResult>> Client::StepOverStream(v1::Attention::Stub* stub, const std::string& address,
                                                                 const v1::StepRequest& request,
                                                                 const CallOptions& call) {
  std::unique_ptr<StepStreamCall> stream;
  {
    absl::MutexLock lock(&step_streams_mu_);
    if (no_step_stream_.contains(address)) return std::nullopt;
    auto it = step_streams_.find(address);
    if (it != step_streams_.end() && !it->second.empty()) {
      stream = std::move(it->second.back());
      it->second.pop_back();
    }
  }
  const absl::Duration timeout = call.deadline ? *call.deadline : options_.default_deadline;
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + timeout;
  v1::StepStreamRequest message;
  // The request is the caller's: lent to the message for the write, never copied.
  message.unsafe_arena_set_allocated_step(const_cast<v1::StepRequest*>(&request));
  message.set_timeout_us(std::max<int64_t>(1, absl::ToInt64Microseconds(timeout)));
  v1::StepStreamResponse response;
  absl::Status status;
  // A stream kept idle may have ended meanwhile (the server restarted, a connection dropped): its step is then
  // never sent, and goes on a new stream.
  for (int attempt = 0; attempt < 2; ++attempt) {
    const bool fresh = stream == nullptr;
    if (fresh) {
      stream = std::make_unique<StepStreamCall>(stub, options_.auth_token, call.wait_for_ready, options_.step_poll);
    }
    bool sent = false;
    status = stream->Round(message, &response, deadline, &sent);
    // The stream's own status UNIMPLEMENTED comes from a server without the method (a step's errors come in
    // its answer): the step did not run there.
    if (fresh && status.code() == absl::StatusCode::kUnimplemented) {
      stream.reset();
      absl::MutexLock lock(&step_streams_mu_);
      no_step_stream_.insert(address);
      message.unsafe_arena_release_step();
      return std::nullopt;
    }
    if (status.ok() || sent || fresh) break;
    stream.reset();
  }
  message.unsafe_arena_release_step();
  if (stream != nullptr && stream->usable()) {
    absl::MutexLock lock(&step_streams_mu_);
    step_streams_[address].push_back(std::move(stream));
  }
  if (!status.ok()) return status;
  if (response.code() != 0) {
    return absl::Status(static_cast<absl::StatusCode>(response.code()), response.message());
  }
  return StepResultOf(request, std::move(*response.mutable_step()), Transport::kStream, start);
}

// One channel per call in flight: an idle one is reused when its areas fit, else a new one is opened (areas of
// at least 1 MiB, so that steps of similar size reuse it). A channel a call left unusable is dropped.
absl::StatusOr<StepResult> Client::StepOverShm(const v1::StepRequest& request, const CallOptions& call) {
  if (options_.shm_socket.empty()) {
    return absl::InvalidArgumentError("transport: shm needs ClientOptions::shm_socket (the server's --shm_socket)");
  }
  const uint64_t request_bytes = request.ByteSizeLong();
  const uint64_t reply_bytes = std::min(StepReplyBytes(request), options_.shm_max_area_bytes);
  if (request_bytes > options_.shm_max_area_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("request: ", request_bytes,
                                                     " bytes exceed the shared-memory area limit of ",
                                                     options_.shm_max_area_bytes, " (shm_max_area_bytes)"));
  }
  std::unique_ptr<ShmChannel> channel;
  {
    absl::MutexLock lock(&shm_mu_);
    for (auto it = shm_free_.begin(); it != shm_free_.end(); ++it) {
      if ((*it)->request_capacity() >= request_bytes && (*it)->reply_capacity() >= reply_bytes) {
        channel = std::move(*it);
        shm_free_.erase(it);
        break;
      }
    }
  }
  if (channel == nullptr) {
    ShmChannelOptions o;
    o.socket_path = options_.shm_socket;
    o.auth_token = options_.auth_token;
    o.request_capacity = std::max<uint64_t>(request_bytes, 1 << 20);
    o.reply_capacity = std::max<uint64_t>(reply_bytes, 1 << 20);
    absl::StatusOr<std::unique_ptr<ShmChannel>> opened = ShmChannel::Connect(o);
    if (!opened.ok()) return opened.status();
    channel = *std::move(opened);
  }
  const absl::Duration timeout = call.deadline ? *call.deadline : options_.default_deadline;
  absl::StatusOr<StepResult> r = client::StepOverShm(*channel, request, timeout);
  const bool unusable = !r.ok() && (r.status().code() == absl::StatusCode::kDeadlineExceeded ||
                                    r.status().code() == absl::StatusCode::kUnavailable);
  if (!unusable) {
    absl::MutexLock lock(&shm_mu_);
    shm_free_.push_back(std::move(channel));
  }
  return r;
}

template <typename Request, typename Response>
absl::StatusOr<Response> Client::CallOn(const std::string& address,
                                        grpc::Status (v1::Attention::Stub::*rpc)(grpc::ClientContext*,
                                                                                 const Request&, Response*),
                                        const Request& request, const CallOptions& call) {
  absl::StatusOr<v1::Attention::Stub*> stub = StubFor(address);
  if (!stub.ok()) return stub.status();
  grpc::ClientContext ctx;
  Prepare(&ctx, call);
  Response response;
  if (absl::Status st = FromGrpcStatus(((*stub)->*rpc)(&ctx, request, &response)); !st.ok()) {
    KeepMovedTo(ctx, &st);
    return NameTheServer(address, options_.target, std::move(st));
  }
  return response;
}

template <typename Request, typename Response>
absl::StatusOr<Response> Client::CallAbout(const std::string& sequence_id,
                                           grpc::Status (v1::Attention::Stub::*rpc)(grpc::ClientContext*,
                                                                                    const Request&, Response*),
                                           Request request, const CallOptions& call) {
  const std::string id = CurrentSequenceId(sequence_id);
  request.set_sequence_id(id);
  absl::StatusOr<Response> response = CallOn(SequenceAddress(id), rpc, request, call);
  if (response.ok()) return response;
  const std::optional<std::string> moved = LearnMove(response.status(), {id});
  if (!moved.has_value()) return response;
  request.set_sequence_id(*moved);
  return CallOn(SequenceAddress(*moved), rpc, request, call);
}

absl::StatusOr<std::vector<std::string>> Client::ForkSequence(const std::string& sequence_id, uint32_t count,
                                                              const CallOptions& call) {
  v1::ForkSequenceRequest fork;
  fork.set_count(count);
  absl::StatusOr<v1::ForkSequenceResponse> forked =
      CallAbout(sequence_id, &v1::Attention::Stub::ForkSequence, std::move(fork), call);
  if (!forked.ok()) return forked.status();
  return std::vector<std::string>(forked->sequence_ids().begin(), forked->sequence_ids().end());
}

absl::StatusOr<std::vector<int64_t>> Client::TruncateSequence(const std::string& sequence_id, int64_t tokens,
                                                              const CallOptions& call) {
  v1::TruncateSequenceRequest truncate;
  truncate.set_tokens(tokens);
  absl::StatusOr<v1::TruncateSequenceResponse> truncated =
      CallAbout(sequence_id, &v1::Attention::Stub::TruncateSequence, std::move(truncate), call);
  if (!truncated.ok()) return truncated.status();
  return std::vector<int64_t>(truncated->lengths().begin(), truncated->lengths().end());
}

absl::Status Client::CloseSequence(const std::vector<std::string>& sequence_ids, const CallOptions& call) {
  std::vector<std::string> ids;
  for (const std::string& id : sequence_ids) ids.push_back(CurrentSequenceId(id));
  // A close is all or none, so one refused for a moved sequence closed nothing and goes again to the new ids.
  for (size_t follows = 0;; ++follows) {
    LearnMovesOf(ids, call);
    for (std::string& id : ids) id = CurrentSequenceId(id);
    absl::StatusOr<std::string> address = AddressOf(ids, "sequence_ids");
    if (!address.ok()) return address.status();
    v1::CloseSequenceRequest req;
    for (const std::string& id : ids) req.add_sequence_ids(id);
    absl::Status st = CallOn(*address, &v1::Attention::Stub::CloseSequence, req, call).status();
    if (st.ok() || follows >= ids.size() || !LearnMove(st, ids).has_value()) return st;
  }
}

namespace {

// Servers whose GPU GpuOf remembers at most.
constexpr size_t kGpusRemembered = 1024;

// A move's failure, naming the server and the side that failed.
absl::Status Side(const char* side, const std::string& server, const absl::Status& s) {
  return absl::Status(s.code(), absl::StrCat(side, " ", server, " failed (the sequence stays where it was): ",
                                             s.message()));
}

}  // namespace

std::string Client::GpuOf(const std::string& address, const CallOptions& call) {
  {
    absl::MutexLock lock(&gpus_mu_);
    if (auto it = gpus_.find(address); it != gpus_.end()) return it->second;
  }
  absl::StatusOr<v1::ServerInfo> info =
      CallOn(address, &v1::Attention::Stub::GetServerInfo, v1::GetServerInfoRequest(), call);
  if (!info.ok()) return std::string();  // not remembered: the next move asks again
  std::string gpu = info->devices().empty() ? std::string() : info->devices(0).uuid();
  absl::MutexLock lock(&gpus_mu_);
  // A fleet's addresses come and go (pods): what is remembered stays bounded.
  if (gpus_.size() >= kGpusRemembered) gpus_.clear();
  gpus_[address] = gpu;
  return gpu;
}

void Client::ForgetGpuOf(const std::string& address) {
  absl::MutexLock lock(&gpus_mu_);
  gpus_.erase(address);
}

const char* MovePathName(MovePath path) {
  switch (path) {
    case MovePath::kAuto: return "auto";
    case MovePath::kBytes: return "bytes";
    case MovePath::kDevice: return "device";
  }
  return "unknown";
}

absl::StatusOr<std::string> Client::MoveSequence(const std::string& sequence_id, const std::string& to,
                                                 const CallOptions& call) {
  absl::StatusOr<MovedSequence> moved = MoveSequence(sequence_id, to, MoveOptions(), call);
  if (!moved.ok()) return moved.status();
  return std::move(moved->sequence_id);
}

absl::StatusOr<MovedSequence> Client::MoveSequence(const std::string& sequence_id, const std::string& to,
                                                   const MoveOptions& options, const CallOptions& call) {
  const std::string from = SequenceAddress(sequence_id);
  if (to.empty()) return absl::InvalidArgumentError("to: empty (the address of the server to move the sequence to)");
  const std::string& from_server = from.empty() ? options_.target : from;
  if (to == from_server) return absl::InvalidArgumentError(absl::StrCat("to: the sequence is on ", to, " already"));
  absl::StatusOr<v1::Attention::Stub*> source = StubFor(from);
  if (!source.ok()) return source.status();
  absl::StatusOr<v1::Attention::Stub*> target = StubFor(to);
  if (!target.ok()) return target.status();
  bool device = options.path == MovePath::kDevice;
  if (options.path == MovePath::kAuto) {
    const std::string gpu = GpuOf(from, call);
    device = !gpu.empty() && gpu == GpuOf(to, call);
  }
  // Calls naming the new id must find it: one without an address goes to this client's target.
  const auto reachable = [&](const std::string& id) { return !SequenceAddress(id).empty() || to == options_.target; };
  // The sequence is on both servers once the import answered: the old copy closes, telling later callers where it
  // went, while the exporter still holds it (both relays call this before they let the export end): a step another
  // caller sends meanwhile is refused "being moved", retried, and follows the move, instead of landing on the old
  // copy after its rows were read. Should the close fail, the old copy stays until its TTL; the move has happened.
  bool old_closed = false;
  const auto close_old = [&](const v1::ImportSequenceResponse& imported) {
    if (!reachable(imported.sequence_id())) return;
    v1::CloseSequenceRequest close;
    close.add_sequence_ids(sequence_id);
    close.set_moved_to(imported.sequence_id());
    grpc::ClientContext close_ctx;
    Prepare(&close_ctx, call);
    v1::CloseSequenceResponse closed;
    (*source)->CloseSequence(&close_ctx, close, &closed).ok();
    old_closed = true;
  };
  // An export refused ABORTED has sent nothing, so the move goes again: while a step of the sequence is in flight,
  // for up to moving_step_retry (backing off as a step does), and after a device attempt until the exporter has let
  // the sequence go (a moment after the cancel).
  const absl::Time step_until = absl::Now() + options_.moving_step_retry;
  const absl::Time release_until = absl::Now() + std::max(options_.moving_step_retry, absl::Seconds(2));
  absl::Duration backoff = absl::Milliseconds(1);
  const auto again = [&](const RelayOutcome& r, bool after_device) {
    if (r.import_failed_first || r.exported.code() != absl::StatusCode::kAborted) return false;
    const bool stepping = absl::StrContains(r.exported.message(), " in flight");
    if (!stepping && !(after_device && absl::StrContains(r.exported.message(), "being moved already"))) return false;
    if (absl::Now() + backoff > (stepping ? step_until : release_until)) return false;
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, kMovingBackoffMax);
    return true;
  };
  RelayOutcome relayed;
  const bool tried_device = device;
  if (device) {
    do {
      grpc::ClientContext export_ctx, import_ctx;
      Prepare(&export_ctx, call);
      Prepare(&import_ctx, call);
      v1::ExportSequenceRequest request;
      request.set_sequence_id(sequence_id);
      request.set_device(true);
      relayed = RelaySequenceOnDevice(*source, *target, &export_ctx, &import_ctx, request, close_old);
    } while (again(relayed, false));
    // The exporter cannot keep the rows on a GPU (it has sent nothing), or the importer refused them (its
    // --sequence_device_moves; it kept nothing): the bytes carry them instead.
    const bool exporter_refused = relayed.exported.code() == absl::StatusCode::kFailedPrecondition;
    const bool importer_refused =
        relayed.import_failed_first && relayed.imported.code() == absl::StatusCode::kFailedPrecondition;
    if (options.path == MovePath::kAuto && (exporter_refused || importer_refused)) {
      device = false;
      // What either server said of its GPU may be stale (another server at the address): the next move asks again.
      ForgetGpuOf(from);
      ForgetGpuOf(to);
    }
  }
  if (!device) {
    absl::StatusOr<MoveChannel> source_channel = TakeMoveChannel(from);
    if (!source_channel.ok()) return source_channel.status();
    absl::Cleanup give_source = [&] { ReturnMoveChannel(from, *source_channel); };
    absl::StatusOr<MoveChannel> target_channel = TakeMoveChannel(to);
    if (!target_channel.ok()) return target_channel.status();
    absl::Cleanup give_target = [&] { ReturnMoveChannel(to, *target_channel); };
    v1::ExportSequenceRequest request;
    request.set_sequence_id(sequence_id);
    request.set_chunk_bytes(ChunkBytes(0));  // the stream chunk size ClientOptions sets for uploads
    request.set_hold(true);
    do {
      grpc::ClientContext export_ctx, import_ctx;
      Prepare(&export_ctx, call);
      Prepare(&import_ctx, call);
      relayed = RelaySequence(source_channel->channel, target_channel->channel, &export_ctx, &import_ctx, request,
                              close_old);
    } while (again(relayed, tried_device));
  }
  if (!relayed.exported.ok() && !relayed.import_failed_first) {
    return Side("the export from", from_server, relayed.exported);
  }
  if (!relayed.imported.ok()) return Side("the import on", to, relayed.imported);
  const v1::ImportSequenceResponse& imported = relayed.response;
  MovedSequence moved{imported.sequence_id(), device ? MovePath::kDevice : MovePath::kBytes};
  if (!reachable(moved.sequence_id)) {
    // Calls naming the new id would go to this client's target, not to `to`: undo the import.
    CloseSequence({moved.sequence_id}, call).IgnoreError();
    return absl::FailedPreconditionError(absl::StrCat(
        "to: ", to, " answers ids without an address (start it with --advertise_address), so calls about the moved "
        "sequence could not find it; the sequence stays where it was"));
  }
  if (!old_closed) close_old(imported);
  return moved;
}

absl::StatusOr<v1::SequenceInfo> Client::GetSequence(const std::string& sequence_id, const CallOptions& call) {
  return CallAbout(sequence_id, &v1::Attention::Stub::GetSequence, v1::GetSequenceRequest(), call);
}

}  // namespace attnd::client
