#include "sequence_drain.h"

#include <algorithm>
#include <deque>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "attnd/client/client.h"
#include "auth.h"
#include "spdlog/spdlog.h"

namespace attnd::server {
namespace {

// Progress is logged this often while the moves go on.
constexpr absl::Duration kProgressPeriod = absl::Seconds(1);

struct Pending {
  Sequences::HeldSequence seq;
  absl::Time not_before = absl::InfinitePast();
  bool bytes_only = false;  // the device path failed once: the rows go by bytes
};

double MiB(uint64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

class DrainMoves {
 public:
  DrainMoves(Sequences& sequences, const DrainMovesOptions& options, client::Client* mover, absl::Time until)
      : sequences_(sequences), options_(options), mover_(mover), until_(until) {}

  size_t Run(std::vector<Sequences::HeldSequence> open) {
    const absl::Time start = absl::Now();
    uint64_t total_bytes = 0;
    for (Sequences::HeldSequence& seq : open) {
      total_bytes += seq.bytes;
      queue_.push_back(Pending{std::move(seq)});
    }
    const size_t total = queue_.size();
    const uint32_t workers = std::max<uint32_t>(1, std::min<uint32_t>(options_.in_flight, total));
    spdlog::info("attnd drain: moving {} KV sequences ({:.1f} MiB) to {}, {} at a time", total, MiB(total_bytes),
                 options_.to, workers);
    std::vector<std::thread> threads;
    for (uint32_t i = 0; i < workers; ++i) threads.emplace_back([this] { Work(); });
    {
      absl::MutexLock lock(&mu_);
      const auto all_done = [this, workers]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopped_ == workers; };
      while (!mu_.AwaitWithTimeout(absl::Condition(&all_done), kProgressPeriod)) {
        spdlog::info("attnd drain: {} of {} KV sequences moved ({:.1f} MiB) in {}", moved_, total, MiB(bytes_),
                     absl::FormatDuration(absl::Trunc(absl::Now() - start, absl::Milliseconds(1))));
      }
    }
    for (std::thread& t : threads) t.join();
    absl::MutexLock lock(&mu_);
    spdlog::info("attnd drain: {} KV sequences moved ({:.1f} MiB) in {}; {} closed by their callers meanwhile, {} "
                 "not moved",
                 moved_, MiB(bytes_), absl::FormatDuration(absl::Trunc(absl::Now() - start, absl::Milliseconds(1))),
                 gone_, queue_.size());
    return queue_.size();
  }

 private:
  // A caller's sequences go where its first one went: a step names sequences of one server, and the fleet's shared
  // target alone would spread them. Until that first move has answered, the caller's other sequences wait.
  void Work() {
    for (;;) {
      Pending p;
      std::string to;
      {
        absl::MutexLock lock(&mu_);
        auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return queue_.empty() || absl::Now() >= until_ ||
                 std::any_of(queue_.begin(), queue_.end(), [this](const Pending& q) { return !Placing(q); });
        };
        while (!ready()) mu_.AwaitWithTimeout(absl::Condition(&ready), absl::Milliseconds(5));
        if (queue_.empty() || absl::Now() >= until_) {
          ++stopped_;
          return;
        }
        auto it = std::find_if(queue_.begin(), queue_.end(), [this](const Pending& q) { return !Placing(q); });
        p = std::move(*it);
        queue_.erase(it);
        if (auto placed = placed_.find(p.seq.owner); placed != placed_.end()) {
          to = placed->second;
        } else {
          placing_.insert(p.seq.owner);
          to = options_.to;
        }
      }
      if (const absl::Time now = absl::Now(); p.not_before > now) absl::SleepFor(std::min(p.not_before, until_) - now);
      const bool done = Move(p, to);
      absl::MutexLock lock(&mu_);
      placing_.erase(p.seq.owner);
      if (!done) queue_.push_back(std::move(p));
    }
  }

  // The caller's first sequence is being moved: where the rest go is not known yet.
  bool Placing(const Pending& p) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !placed_.contains(p.seq.owner) && placing_.contains(p.seq.owner);
  }

  // True when the sequence is done with: moved, or closed meanwhile.
  bool Move(Pending& p, const std::string& to) {
    client::CallOptions call;
    call.deadline = std::max(until_ - absl::Now(), absl::Milliseconds(1));
    call.metadata = {{kPeerSecretMetadata, options_.peer_secret}, {kPeerOwnerMetadata, p.seq.owner}};
    client::MoveOptions how;
    how.path = p.bytes_only ? client::MovePath::kBytes : client::MovePath::kAuto;
    absl::StatusOr<client::MovedSequence> moved;
    if (absl::Status held = sequences_.HoldForMove(p.seq.owner, p.seq.id); !held.ok()) {
      moved = std::move(held);
    } else {
      // Expected before the close that ends the move: a caller may name the old id the moment it is closed.
      sequences_.ExpectFollow(p.seq.id);
      moved = mover_->MoveSequence(p.seq.id, to, how, call);
    }
    if (moved.ok()) {
      spdlog::debug("attnd drain: {} moved to {} ({})", p.seq.id, moved->sequence_id, MovePathName(moved->path));
      absl::MutexLock lock(&mu_);
      ++moved_;
      bytes_ += p.seq.bytes;
      placed_.try_emplace(p.seq.owner, client::SequenceAddress(moved->sequence_id));
      return true;
    }
    sequences_.Unexpect(p.seq.id);
    sequences_.ReleaseHold(p.seq.id);
    const absl::Status& why = moved.status();
    if (why.code() == absl::StatusCode::kNotFound) {  // its caller closed it, or it expired
      absl::MutexLock lock(&mu_);
      ++gone_;
      return true;
    }
    // A step was in flight (the export refuses to wait for it): soon again.
    const bool busy = why.code() == absl::StatusCode::kAborted;
    if (busy) {
      spdlog::debug("attnd drain: {} not moved yet: {}", p.seq.id, std::string(why.message()));
    } else {
      spdlog::warn("attnd drain: moving {} to {} failed, it stays here and is tried again: {}", p.seq.id, to,
                   std::string(why.message()));
    }
    if (why.code() == absl::StatusCode::kFailedPrecondition) p.bytes_only = true;
    if (why.code() == absl::StatusCode::kResourceExhausted && to != options_.to) {
      // The server that took the caller's first sequences has no room for this one: the fleet chooses again.
      absl::MutexLock lock(&mu_);
      placed_.erase(p.seq.owner);
    }
    p.not_before = absl::Now() + (busy ? options_.retry / 10 : options_.retry);
    return false;
  }

  Sequences& sequences_;
  const DrainMovesOptions& options_;
  client::Client* const mover_;
  const absl::Time until_;
  absl::Mutex mu_;
  std::deque<Pending> queue_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::string> placed_ ABSL_GUARDED_BY(mu_);  // owner -> the server its first went to
  absl::flat_hash_set<std::string> placing_ ABSL_GUARDED_BY(mu_);  // owners whose first move is under way
  uint64_t moved_ ABSL_GUARDED_BY(mu_) = 0, bytes_ ABSL_GUARDED_BY(mu_) = 0, gone_ ABSL_GUARDED_BY(mu_) = 0;
  uint32_t stopped_ ABSL_GUARDED_BY(mu_) = 0;  // workers that found nothing more to do
};

}  // namespace

size_t MoveSequencesAway(Sequences& sequences, const DrainMovesOptions& options, absl::Time until) {
  std::vector<Sequences::HeldSequence> open = sequences.OpenSequences();
  if (open.empty()) return 0;
  client::ClientOptions co;
  co.target = options.self;
  co.grpc_args = options.grpc_args;
  co.tls_ca_file = options.tls_ca_file;
  co.tls_cert_file = options.tls_cert_file;
  co.tls_key_file = options.tls_key_file;
  co.tls_server_name = options.tls_server_name;
  absl::StatusOr<std::unique_ptr<client::Client>> mover = client::Client::Create(co);
  if (!mover.ok()) {
    spdlog::warn("attnd drain: cannot reach this server at {} to move its sequences: {}", options.self,
                 std::string(mover.status().message()));
    return open.size();
  }
  return DrainMoves(sequences, options, mover->get(), until).Run(std::move(open));
}

}  // namespace attnd::server
