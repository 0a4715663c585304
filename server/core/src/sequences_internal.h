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

// One admitted step as the core remembers it until the step ends (the job itself may be gone by then).
struct Sequences::Admitted {
  struct Part {
    Seq* seq;
    int32_t cached, tokens;
  };
  struct Copy {
    Seq* seq;
    size_t slot;  // index in seq->pages
    int32_t from, to;
  };
  Pool* pool = nullptr;
  int layer = 0;
  bool append = false;
  std::vector<Part> parts;
  std::vector<Copy> copies;
  std::string owner;
  bool chain = false;  // admitted with CallInfo::chain: a step may be admitted behind it
  // The steps in flight it was admitted behind (CallInfo::chain); cleared when it ends.
  std::vector<std::shared_ptr<Admitted>> after;
  bool device = false;   // ordered on the caller's stream by the device (CallInfo::device_order)
  bool enqueued = false; // its GPU work is queued (StepJob::enqueued)
  bool done = false;     // Finish has run
  absl::Status outcome;  // once done
  std::function<absl::Status()> order_outcome;  // CallInfo::DeviceOrder::outcome
};

struct Sequences::Seq {
  std::string id, owner;
  Pool* pool = nullptr;
  int64_t max_tokens = 0;
  std::vector<int32_t> lengths;  // per layer
  std::vector<int32_t> pages;    // shared by every layer
  absl::Time last_used;
  // Steps in flight: one, or two when the second was admitted behind the first (CallInfo::chain).
  int steps = 0;
  std::vector<int32_t> ahead;  // per layer: rows the steps in flight append, not yet in `lengths`
  std::shared_ptr<Admitted> last;  // the newest step in flight, which a chained step follows
  // A step failed while a later one was in flight: its copy-on-write is undone and the pages past the lengths
  // trimmed once the last step in flight has ended (that step still uses them).
  std::vector<Admitted::Copy> reverts;
  bool trim = false;
  bool moving = false;   // held by an export or an import
  // An export has read every row it sends (ExportSent) and holds the sequence only until its mover's close, which
  // then frees it at once instead of at the export's end.
  bool export_sent = false;
  // Held by a drain that moves it (HoldForMove): refused to steps, forks and truncations like `moving`, from before
  // its export until its close, so that no step lands between the export's end and the close.
  bool held_for_move = false;
  bool closing = false;  // closed while busy: freed when the step ends
  std::string close_reason;  // what its tombstone says then
  std::string moved_to;      // closed with moved_to: its new id

  bool busy() const { return steps > 0 || moving; }
  // The tokens a step admitted now finds cached at `layer`: the committed ones and those the steps in flight add.
  int32_t cached(int layer) const { return lengths[layer] + (ahead.empty() ? 0 : ahead[layer]); }
};

struct Sequences::Lane {
  std::deque<Pending> waiting;
  uint32_t in_flight = 0;  // launches running (at most options_.launches_in_flight)
  absl::Time launch_at = absl::InfiniteFuture();  // with batch_wait: when the waiting steps launch anyway
};

}  // namespace attnd::server
