// KV sequences in the core (docs/sequences.md): the sequences a server holds, their page tables over one page
// pool per shape, their owners and expiry, and the Step path — validate a step (StepArgs), admit it against the
// sequences (pages allocated, copy-on-write planned), gather steps of the same layer into batches, hand them to
// the backend and commit the new lengths when they finish. Both frontends (gRPC, the shm channel) call this
// class; the backend only moves bytes where a StepJob says.
//
// Consistency: a sequence has at most one step in flight (a second is ABORTED, retryable); fork and truncate
// of a sequence with a step in flight are ABORTED too, close is deferred until the step ends. A page is
// returned to its pool only when no sequence and no step in flight references it, so a page is never
// rewritten while a launch may still read it.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "attnd/server/backend.h"
#include "attnd/server/buffer_registry.h"
#include "attnd/server/dispatcher.h"
#include "attnd/server/requests.h"
#include "attnd/server/validation.h"

namespace attnd::server {

// The payload (absl::Status::GetPayload) of a NOT_FOUND naming a sequence closed with moved_to: its new id.
inline constexpr char kMovedToPayload[] = "type.attnd.dev/moved_to";

// Whose same-GPU exports read the pool in place (SequenceOptions::device_moves_share_pool): nobody's, the fleet's
// servers' only, or every caller's.
enum class SharePool { kNever, kPeers, kAlways };

struct SequenceOptions {
  bool enabled = true;
  // K/V memory of every pool together. Each shape gets pool_bytes / max_pools when its first sequence opens
  // and gives it back when its last one closes.
  uint64_t pool_bytes = 1ull << 30;
  int max_pools = 1;                 // shapes with a pool at once (a server usually serves one model)
  int page_tokens = 16;              // a power of two from 16 to 256 (the paged kernels' range)
  int64_t max_tokens = 131072;       // per sequence
  absl::Duration ttl = absl::Minutes(10);  // idle sequences are closed after this; infinite: never
  uint32_t max_per_client = 0;       // sequences open per owner (0: no limit)
  uint64_t max_pages_per_client = 0; // pages held per owner, shared pages counted by each holder (0: no limit)
  uint32_t max_open = 256;           // sequences one OpenSequence or ForkSequence may create
  uint32_t max_batch = 256;          // sequences in one launch
  // How long the first step of an idle layer waits for others to join its launch. Zero: it launches at once,
  // and steps that arrive while launches of their layer run join the next one (batches form under load
  // without adding latency to a lone caller).
  absl::Duration batch_wait = absl::ZeroDuration();
  // Launches of one layer (and step parameters) that may run at once. With 2, the host work of one batch
  // (admission, copies in, kernel launches) overlaps the GPU work of the other, as when an engine alternates two
  // micro-batches; 1 serialises them. Their sequences differ (a sequence takes one step at a time).
  uint32_t launches_in_flight = 2;
  uint32_t max_waiting = 256;        // steps waiting for a launch before RESOURCE_EXHAUSTED
  // How long a stream-ordered step waits for its caller's stream (StreamOrder in attention.proto; the shared-memory
  // channel waits, this reports it in SequenceLimits).
  absl::Duration order_timeout = absl::Seconds(30);
  // Same-GPU moves through CUDA IPC (ExportSequenceRequest.device, SequenceChunk.device_rows). False: both are
  // refused FAILED_PRECONDITION, and movers take the bytes path (docs/security-and-metrics.md says why a server
  // whose callers are not trusted turns them off).
  bool device_moves = true;
  // Which device exports hand out the pool's handle and the sequence's pages, read by the importer in place (one
  // copy), instead of a buffer of the sequence's rows alone: whoever opens the pool can read every page of it, so
  // by default only the exports of the fleet's own servers (a drain, acting through the peer secret), which may
  // export any caller's sequence anyway.
  SharePool device_moves_share_pool = SharePool::kPeers;
  std::string advertise_address;     // appended to ids after '@' (the address clients reach this server at)
  size_t tombstones = 4096;          // closed/expired ids remembered for a clear NOT_FOUND reason
};

// A sequence held for a move (Sequences::BeginExport / BeginImport): what its rows are, and where they are. The
// sequence takes no step, fork or truncate while held, so its pages stay as `pages` says.
struct MovingSequence {
  std::string sequence_id;
  SequenceShape shape;
  int64_t max_tokens = 0;
  std::vector<int64_t> lengths;  // per layer
  std::shared_ptr<KvPool> pool;
  std::vector<int32_t> pages;
  uint64_t row_bytes() const { return shape.row_bytes(); }
  // Every row's bytes, K and V of every layer.
  uint64_t total_bytes() const {
    uint64_t rows = 0;
    for (int64_t n : lengths) rows += static_cast<uint64_t>(n);
    return 2 * rows * row_bytes();
  }
};

class Sequences {
 public:
  // `backend` and `buffers` (null: no references) must outlive this object.
  Sequences(const SequenceOptions& options, const ValidationLimits& limits, Backend* backend,
            const BufferRegistry* buffers);
  ~Sequences();

  // `owner`: who calls (the transport's identity of the caller; docs/sequences.md, "ownership").
  absl::StatusOr<OpenedSequences> Open(const std::string& owner, const OpenArgs& request);
  // The ids of `count` (0 means 1) children sharing the parent's pages.
  absl::StatusOr<std::vector<std::string>> Fork(const std::string& owner, absl::string_view sequence_id,
                                                uint32_t count);
  // Each layer's length after keeping at most `tokens`.
  absl::StatusOr<std::vector<int64_t>> Truncate(const std::string& owner, absl::string_view sequence_id,
                                                int64_t tokens);
  // All or none: every id must be open and the caller's. `moved_to` (one id only): the id it was imported as
  // elsewhere, which later calls naming it are told.
  absl::Status Close(const std::string& owner, absl::Span<const absl::string_view> sequence_ids,
                     absl::string_view moved_to = {});
  absl::StatusOr<SequenceState> Get(const std::string& owner, absl::string_view sequence_id);

  // Moving a sequence to another server (docs/sequences.md, "Moving a sequence"). BeginExport holds the caller's
  // sequence (a step, fork or truncate is ABORTED, a close waits) until EndExport; ReadRows copies rows
  // [first, first + rows) of a layer's K (kv 0) or V (kv 1) out. BeginImport opens a held sequence for `owner`
  // with the header's lengths (its pages taken); WriteRows fills it; EndImport(true) lets it step and answers its
  // id, EndImport(false) frees it. Every Begin is ended exactly once.
  absl::StatusOr<MovingSequence> BeginExport(const std::string& owner, absl::string_view sequence_id);
  absl::Status ReadRows(const MovingSequence& m, int layer, int kv, int64_t first, int64_t rows, uint8_t* dst);
  void EndExport(const MovingSequence& m) ABSL_LOCKS_EXCLUDED(mu_);
  // The export has read every row it sends, from pages or into a buffer of its own (not an exporter's pool read in
  // place): it still holds the sequence against steps, but a close (its mover's, once the import answered) frees
  // the sequence at once rather than at EndExport.
  void ExportSent(const MovingSequence& m) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<MovingSequence> BeginImport(const std::string& owner, const ImportArgs& header);
  absl::Status WriteRows(const MovingSequence& m, int layer, int kv, int64_t first, int64_t rows, const uint8_t* src);
  // The same from bytes in pieces (a received message's slices), which must hold exactly the rows' bytes.
  absl::Status WriteRows(const MovingSequence& m, int layer, int kv, int64_t first, int64_t rows, HostPieces src);
  absl::StatusOr<OpenedSequences> EndImport(const MovingSequence& m, bool ok) ABSL_LOCKS_EXCLUDED(mu_);
  // The same move on one GPU (ExportSequenceRequest.device): every row of an exported sequence gathered into a
  // device buffer of its own, kept by `hold` (drop it after EndExport's caller knows the importer closed it); and
  // every row of an imported one copied from such a buffer, which must hold exactly the header's rows.
  // `peer`: the export is a fleet server's (its call carried the peer secret), for SequenceOptions' SharePool.
  absl::StatusOr<DeviceRows> ExportOnDevice(const MovingSequence& m, bool peer, std::shared_ptr<void>* hold);
  // Whether such an export hands out the pool in place (no copy) rather than a buffer the rows are gathered into.
  bool ExportSharesPool(bool peer) const;
  absl::Status ImportOnDevice(const MovingSequence& m, const DeviceRows& rows);

  // Called exactly once per Step: on a backend thread with the finished job, or inline with a null job when the
  // step was refused before it was queued.
  using StepReply = std::function<void(absl::Status, StepJob*)>;
  // Validates, admits, batches and runs one step. Its inline tensors are read where `request` views them (the
  // message must outlive the reply), as Dispatcher::Dispatch does.
  void Step(const std::string& owner, const StepArgs& request, const CallInfo& call, StepReply reply);

  // From here on new sequences (Open, Fork) are refused UNAVAILABLE; the open ones are served as before.
  void BeginDrain();
  // A sequence a drain may move: its id, its owner and the bytes of its cached K and V.
  struct HeldSequence {
    std::string id, owner;
    uint64_t bytes = 0;
  };
  // The open sequences, those being closed left out.
  std::vector<HeldSequence> OpenSequences() const;
  // A drain's move holds `id` from before its export until its close: steps, forks and truncations are refused
  // ABORTED "is being moved" meanwhile (an export alone holds it only while it streams, and a step between its end
  // and the close would be lost with the old copy). NOT_FOUND when gone, ABORTED while a step is in flight.
  // ReleaseHold: the move failed, the sequence serves again.
  absl::Status HoldForMove(const std::string& owner, const std::string& id);
  void ReleaseHold(const std::string& id);
  // A drain that moves `id` waits until a call names it once more after its close (the caller has been told
  // where it went), or until AwaitFollowed's deadline. Unexpect: the move failed, nobody needs telling.
  void ExpectFollow(const std::string& id);
  void Unexpect(const std::string& id);
  // Waits until every expected id has been named, or `deadline`; the number still unnamed.
  size_t AwaitFollowed(absl::Time deadline) const;
  // Waits until no sequence is open (closed by their callers, or expired) or `deadline`; the number still open.
  size_t AwaitClosed(absl::Time deadline) const;
  // Refuses new steps (UNAVAILABLE) and waits until every admitted step has been answered and every launch has
  // ended; the core may be destroyed once it returns. Idempotent.
  void Shutdown();

  const SequenceOptions& options() const { return options_; }
  SequenceCounts stats() const;
  // Closes sequences idle since before now - ttl (also done by a background thread); the number closed.
  int ExpireIdle(absl::Time now);
  // Steps waiting for a launch (counted in the queue depth the server reports).
  uint32_t waiting() const;

 private:
  struct Pool;
  struct Releases;
  struct Seq;
  struct Lane;
  struct Admitted;
  struct BatchKey {
    const KvPool* pool;
    int layer, q_heads;
    uint32_t scale_bits;
    bool lse, append, attend;
    int tokens;  // every sequence's tokens when uniform; -1: ragged (runs alone)
    uint64_t unique;
    friend bool operator==(const BatchKey& a, const BatchKey& b) {
      return a.pool == b.pool && a.layer == b.layer && a.q_heads == b.q_heads && a.scale_bits == b.scale_bits &&
             a.lse == b.lse && a.append == b.append && a.attend == b.attend && a.tokens == b.tokens &&
             a.unique == b.unique;
    }
    template <typename H>
    friend H AbslHashValue(H h, const BatchKey& k) {
      return H::combine(std::move(h), k.pool, k.layer, k.q_heads, k.scale_bits, k.lse, k.append, k.attend,
                        k.tokens, k.unique);
    }
  };

  // A step waiting for its launch, and how to answer it if the backend refuses the launch (the refused batch
  // is dropped with its jobs).
  struct Pending {
    std::unique_ptr<StepJob> job;
    std::function<void(const absl::Status&)> refuse;
  };

  absl::StatusOr<Seq*> Find(const std::string& owner, absl::string_view id, const std::string& field)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string NewId();
  // An open's shape and limit checked: the shape and the max_tokens that applies.
  absl::StatusOr<std::pair<SequenceShape, int64_t>> CheckOpen(const OpenArgs& request) const;
  // Waits (without mu_) for pool memory on its way back when `shape` has no pool yet.
  void AwaitPoolFor(const SequenceShape& shape) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A new sequence of `owner` in `pool`, counted; the caller fills its lengths and pages.
  Seq* AddSequence(const std::string& owner, Pool* pool, int64_t max_tokens, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The rows' range checked against a held sequence.
  static absl::Status CheckRows(const MovingSequence& m, int layer, int kv, int64_t first, int64_t rows);
  // The number of sequences an Open or Fork with `requested` (0 means 1) creates; RESOURCE_EXHAUSTED past max_open.
  absl::StatusOr<uint32_t> NewSequences(uint32_t requested) const;
  // UNAVAILABLE once shutting down or draining: no sequence may be created.
  absl::Status TakesNewSequences() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // RESOURCE_EXHAUSTED when `count` more sequences would pass the owner's limit.
  absl::Status CheckClientSequences(const std::string& owner, uint32_t count) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<Pool*> PoolFor(const SequenceShape& shape) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits (bounded) until the memory of every pool the core has dropped is back in the backend.
  void AwaitPoolReleases() const ABSL_LOCKS_EXCLUDED(mu_);
  // RESOURCE_EXHAUSTED naming the pool: `who` (a step, an import) needs `needed` pages more than it has free.
  static absl::Status PoolFull(const Pool& pool, uint64_t needed, const char* who = "the step");
  absl::StatusOr<int32_t> TakePage(Pool& pool, const std::string& owner) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Unref(Pool& pool, int32_t page) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops the sequence's pages past the first `keep`.
  void DropPages(Seq* seq, size_t keep) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops the pages past those its longest layer needs.
  void TrimPages(Seq* seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // By value: the reason may be the sequence's own close_reason, which freeing it destroys.
  void Free(Seq* seq, std::string reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Admits one step: its request checked, its sequences found and made busy, its tensors bound to the job, its
  // pages taken and copy-on-write planned. The steps below run in this order, so a request with several faults
  // is refused for the first.
  absl::Status Admit(const std::string& owner, const StepArgs& request, const CallInfo& call, StepJob* job,
                     const std::shared_ptr<Admitted>& admitted) ABSL_LOCKS_EXCLUDED(mu_);
  // What the request alone decides: the id's length, the number of sequences, which tensors go together,
  // strides, the stream order.
  absl::Status CheckStepRequest(const StepArgs& request, const CallInfo& call, bool append, bool attend) const;
  // The step's sequences: the caller's, idle, of one shape, each with 1..max_tokens new tokens; `rows`: the new
  // tokens of all of them.
  absl::Status FindStepSequences(const std::string& owner, const StepArgs& request, const CallInfo& call,
                                 std::vector<Seq*>* seqs, int64_t* rows) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The layer, q_heads and each sequence's tokens against what the sequences hold.
  absl::Status CheckStepCounts(const StepArgs& request, const std::vector<Seq*>& seqs, bool append,
                               bool attend) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Bytes of the step's Q (and O) and of each of K and V; 0 for a tensor the step has none of.
  struct StepBytes {
    uint64_t q = 0, kv = 0;
  };
  absl::StatusOr<StepBytes> SizeStep(const StepArgs& request, const CallInfo& call, const SequenceShape& shape,
                                     int64_t rows, bool append, bool attend) const;
  // Points the job's tensors at the request's inline bytes or at registered buffers.
  absl::Status BindStepTensors(const StepArgs& request, const StepBytes& sizes, bool append, bool attend,
                               StepJob* job) const;
  // The job's layer, heads, scale, modes, deadline and each sequence's cached and new tokens.
  void DescribeStep(const StepArgs& request, const CallInfo& call, const std::vector<Seq*>& seqs,
                    int64_t rows, bool append, bool attend, StepJob* job) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status TakeStepPages(const std::string& owner, const std::vector<Seq*>& seqs, StepJob* job,
                             Admitted* admitted) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Gives back what TakeStepPages took before it was stopped: the copies, then the pages past `table_sizes`.
  void UndoStepPages(const std::string& owner, const std::vector<Seq*>& seqs, const std::vector<size_t>& table_sizes,
                     StepJob* job, Admitted* admitted) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends an admitted step once the steps it was admitted behind have ended: commits the lengths (ok) or undoes its
  // copy-on-write (not ok; deferred while a step behind it runs), frees deferred closes. Returns the step's
  // outcome: `status`, or ABORTED when a step before it failed.
  absl::Status Finish(Admitted& admitted, absl::Status status) ABSL_LOCKS_EXCLUDED(mu_);
  // Waits until the steps `admitted` follows have ended (bounded by the call's deadline and cancellation); not OK
  // when one of them failed.
  absl::Status AwaitPredecessors(Admitted& admitted, const CallInfo& call) ABSL_LOCKS_EXCLUDED(mu_);
  static bool AllDone(const std::vector<std::shared_ptr<Admitted>>& steps);
  // Whether the steps `admitted` follows let it launch now.
  static bool MayLaunch(const Admitted& admitted);
  static absl::Status PredecessorFailure(const Admitted& admitted);
  // After the step's reply: Shutdown waits for every admitted step to get here.
  void Answered() ABSL_LOCKS_EXCLUDED(mu_);
  void Enqueue(BatchKey key, Pending pending) ABSL_LOCKS_EXCLUDED(mu_);
  void Launch(const BatchKey& key) ABSL_LOCKS_EXCLUDED(mu_);
  void LaunchDone(const BatchKey& key) ABSL_LOCKS_EXCLUDED(mu_);
  void FailLane(const BatchKey& key, const absl::Status& status) ABSL_LOCKS_EXCLUDED(mu_);
  // The last thing a launched batch's end does (see launches_running_).
  void LaunchEnded() ABSL_LOCKS_EXCLUDED(mu_);
  void ReaperLoop();

  SequenceOptions options_;  // fixed after construction
  const ValidationLimits limits_;
  Backend* const backend_;
  const BufferRegistry* const buffers_;
  const std::string instance_;  // random per process: ids of an earlier process are recognised as such
  const std::shared_ptr<Releases> releases_;

  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::unique_ptr<Seq>> seqs_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<SequenceShape, std::unique_ptr<Pool>> pools_ ABSL_GUARDED_BY(mu_);
  struct ClientUse {
    uint32_t sequences = 0;
    uint64_t pages = 0;
  };
  absl::flat_hash_map<std::string, ClientUse> clients_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::string> tombstones_ ABSL_GUARDED_BY(mu_);
  // Of the tombstones, those closed with moved_to: their new id, for the NOT_FOUND's kMovedToPayload.
  absl::flat_hash_map<std::string, std::string> moved_to_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<std::string> expect_follow_ ABSL_GUARDED_BY(mu_);  // ExpectFollow, not yet named
  std::deque<std::string> tombstone_order_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<BatchKey, std::unique_ptr<Lane>> lanes_ ABSL_GUARDED_BY(mu_);
  uint32_t waiting_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t admitted_ ABSL_GUARDED_BY(mu_) = 0;  // admitted steps whose reply has not returned yet
  // Launched batches whose end (LaunchDone, or FailLane for a refused one) has not returned yet. It runs after
  // its steps' replies and still reads the lanes, so Shutdown waits for it as well as for admitted_.
  uint64_t launches_running_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_unique_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;  // new sequences refused (BeginDrain)
  bool reaper_stop_ ABSL_GUARDED_BY(mu_) = false;
  bool reaper_wake_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t steps_ ABSL_GUARDED_BY(mu_) = 0, launches_ ABSL_GUARDED_BY(mu_) = 0, expired_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread reaper_;
};

}  // namespace attnd::server
