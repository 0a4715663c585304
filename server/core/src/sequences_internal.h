// What the two files of Sequences (attnd/server/sequences.h) share: the records of a pool, a sequence and a lane,
// and the helpers their messages use. sequences.cc: the pools, open, fork, truncate, close, get, expiry and stats;
// sequence_steps.cc: a step's admission, batching, launch and end.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "attnd/server/sequences.h"

namespace attnd::server {

// INVALID_ARGUMENT "<field>: <what>".
absl::Status Invalid(absl::string_view field, absl::string_view what);
// A shape as messages name it: "layers 32, kv_heads 8, head_dim 128, bf16".
std::string ShapeText(const SequenceShape& s);
int64_t CeilDiv(int64_t a, int64_t b);

// Pools the core has let go of (their last sequence closed) whose memory a finishing step still holds: a job
// outlives its reply until the backend drops it, so a caller that closes its last sequence on a reply and opens
// again at once would find the memory not yet given back. Shared with the deleters of the pools' memory, which
// may run after the core is gone.
struct Sequences::Releases {
  absl::Mutex mu;
  int pending ABSL_GUARDED_BY(mu) = 0;
};

struct Sequences::Pool {
  explicit Pool(std::shared_ptr<Releases> r) : releases(std::move(r)) {}
  // The core lets go of the pool: pending until the deleter of `memory` runs (at once, or when the last step that
  // holds it drops it).
  ~Pool() {
    absl::MutexLock lock(&releases->mu);
    ++releases->pending;
  }
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  const std::shared_ptr<Releases> releases;
  std::shared_ptr<KvPool> memory;
  std::vector<uint32_t> refs;   // per page: sequences holding it, plus steps holding it as a copy source
  std::vector<int32_t> free;    // pages with refs == 0
  uint64_t sequences = 0;
};

struct Sequences::Seq {
  std::string id, owner;
  Pool* pool = nullptr;
  int64_t max_tokens = 0;
  std::vector<int32_t> lengths;  // per layer
  std::vector<int32_t> pages;    // shared by every layer
  absl::Time last_used;
  bool busy = false;     // a step in flight, or held for a move
  bool moving = false;   // held by an export or an import (busy too)
  bool closing = false;  // closed while busy: freed when the step ends
  std::string close_reason;  // what its tombstone says then
};

struct Sequences::Lane {
  std::deque<Pending> waiting;
  uint32_t in_flight = 0;  // launches running (at most options_.launches_in_flight)
  absl::Time launch_at = absl::InfiniteFuture();  // with batch_wait: when the waiting steps launch anyway
};

}  // namespace attnd::server
