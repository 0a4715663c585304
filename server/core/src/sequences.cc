#include "attnd/server/sequences.h"

#include <sys/random.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "attnd/server/status_util.h"
#include "attnd/server/validation.h"
#include "sequences_internal.h"

namespace attnd::server {
namespace {

constexpr size_t kMaxIdBytes = 512;
// Why a busy sequence refuses to be forked, truncated or exported now, after "sequence <id>".
std::string BusyText(bool moving, const char* what) {
  return moving ? absl::StrCat(" is being moved (ExportSequence); ", what, " it once the move is over")
                : absl::StrCat(" has a step in flight; ", what, " it after the step's reply");
}
// How long an open waits for pool memory on its way back (Releases). A job is dropped right after its reply on
// the CPU backend and once its batch's GPU work has ended on CUDA, so the wait is that short; the bound only
// matters behind a backend that keeps a job.
constexpr absl::Duration kPoolReleaseWait = absl::Seconds(10);

std::string RandomHex(size_t bytes) {
  std::string raw(bytes, '\0');
  size_t got = 0;
  while (got < bytes) {
    const ssize_t n = ::getrandom(raw.data() + got, bytes - got, 0);
    if (n > 0) got += static_cast<size_t>(n);
  }
  return absl::BytesToHexString(raw);
}

}  // namespace

absl::Status Invalid(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
}

std::string ShapeText(const SequenceShape& s) {
  return absl::StrCat("layers ", s.layers, ", kv_heads ", s.kv_heads, ", head_dim ", s.head_dim, ", ",
                      s.dtype == DType::kFP16 ? "fp16" : "bf16",
                      s.kv_format == KvFormat::kFp8E4M3 ? ", float8 e4m3 K/V" : "");
}

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

Sequences::Sequences(const SequenceOptions& options, const ValidationLimits& limits, Backend* backend,
                     const BufferRegistry* buffers)
    : options_(options),
      limits_(limits),
      backend_(backend),
      buffers_(buffers),
      instance_(RandomHex(4)),
      releases_(std::make_shared<Releases>()) {
  options_.launches_in_flight = std::max<uint32_t>(options_.launches_in_flight, 1);  // 0 would never launch
  reaper_ = std::thread([this] { ReaperLoop(); });
}

Sequences::~Sequences() {
  Shutdown();
  {
    absl::MutexLock lock(&mu_);
    reaper_stop_ = true;
  }
  if (reaper_.joinable()) reaper_.join();
}

std::string Sequences::NewId() {
  std::string id = absl::StrCat(instance_, "-", RandomHex(16));
  if (!options_.advertise_address.empty()) absl::StrAppend(&id, "@", options_.advertise_address);
  return id;
}

absl::StatusOr<Sequences::Seq*> Sequences::Find(const std::string& owner, absl::string_view id,
                                                const std::string& field) {
  if (id.empty()) return Invalid(field, "empty");
  if (id.size() > kMaxIdBytes) return Invalid(field, absl::StrCat("longer than ", kMaxIdBytes, " bytes"));
  auto it = seqs_.find(id);
  const auto gone = [&](absl::string_view reason, absl::string_view moved_to) {
    absl::Status status = absl::NotFoundError(absl::StrCat(field, ": sequence ", id, " is gone: ", reason));
    if (!moved_to.empty()) {
      status.SetPayload(kMovedToPayload, absl::Cord(moved_to));
      expect_follow_.erase(std::string(id));
    }
    return status;
  };
  // A foreign sequence reads exactly like an unknown one: its existence is not the caller's to learn.
  if (it != seqs_.end() && it->second->owner == owner) {
    const Seq& seq = *it->second;
    if (!seq.closing) return it->second.get();
    // Closed while an export or a step still holds it (a mover closes the old copy before it lets the export
    // go): it reads as its tombstone will, so a caller follows a move from the moment of the close.
    return gone(seq.close_reason, seq.moved_to);
  }
  auto tomb = tombstones_.find(id);
  if (tomb != tombstones_.end() && it == seqs_.end()) {
    auto moved = moved_to_.find(id);
    return gone(tomb->second, moved == moved_to_.end() ? absl::string_view() : absl::string_view(moved->second));
  }
  if (!absl::StartsWith(id, absl::StrCat(instance_, "-"))) {
    return absl::NotFoundError(absl::StrCat(
        field, ": sequence ", id,
        " was not opened by this server process (a restarted server has lost its sequences: open and prefill "
        "again; behind a load balancer, calls about a sequence must reach the server named after its '@')"));
  }
  // The caller's identity in the message: a sequence opened over TCP and stepped over the shared-memory channel
  // (two identities) reads as unknown, and this says why.
  return absl::NotFoundError(absl::StrCat(field, ": no open sequence ", id, " of this caller (", owner,
                                          "; a sequence belongs to the identity that opened it: its bearer token, "
                                          "else its host's address over TCP, else 'local' over the unix socket and "
                                          "the shared-memory channel)"));
}

namespace {

// The pages a pool of `shape` holds: its share of --kv_pool_mb over whole pages; none is RESOURCE_EXHAUSTED.
absl::StatusOr<int32_t> PoolPages(const SequenceOptions& options, const SequenceShape& shape) {
  const uint64_t share = options.pool_bytes / static_cast<uint64_t>(std::max(options.max_pools, 1));
  const uint64_t page_bytes = shape.page_bytes(options.page_tokens);
  const uint64_t pages = page_bytes == 0 ? 0 : std::min<uint64_t>(share / page_bytes, INT32_MAX);
  if (pages == 0) {
    return absl::ResourceExhaustedError(absl::StrCat("kv pool: one page of ", ShapeText(shape), " takes ", page_bytes,
                                                     " bytes, more than the pool's ", share,
                                                     " (--kv_pool_mb / --kv_max_pools)"));
  }
  return static_cast<int32_t>(pages);
}

}  // namespace

absl::StatusOr<Sequences::Pool*> Sequences::PoolFor(const SequenceShape& shape) {
  auto it = pools_.find(shape);
  if (it != pools_.end()) return it->second.get();
  if (static_cast<int>(pools_.size()) >= options_.max_pools) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "kv pool: this server holds pools for ", pools_.size(), " other shape(s) (--kv_max_pools=", options_.max_pools,
        "); a pool for ", ShapeText(shape), " is created when they have no open sequences"));
  }
  absl::StatusOr<int32_t> pages = PoolPages(options_, shape);
  if (!pages.ok()) return pages.status();
  absl::StatusOr<std::shared_ptr<KvPool>> memory = backend_->MakeKvPool(shape, options_.page_tokens, *pages);
  if (!memory.ok()) return memory.status();
  auto pool = std::make_unique<Pool>(releases_);
  // Steps hold the pool through this handle too: once its last holder drops it, the backend's memory is given back
  // and the release counted done.
  KvPool* const kv = memory->get();
  pool->memory = std::shared_ptr<KvPool>(kv, [held = *std::move(memory), releases = releases_](KvPool*) mutable {
    held.reset();
    absl::MutexLock lock(&releases->mu);
    --releases->pending;
  });
  pool->refs.assign(static_cast<size_t>(*pages), 0);
  pool->free.reserve(static_cast<size_t>(*pages));
  for (int32_t p = *pages - 1; p >= 0; --p) pool->free.push_back(p);
  Pool* raw = pool.get();
  pools_.emplace(shape, std::move(pool));
  return raw;
}

void Sequences::AwaitPoolReleases() const {
  absl::MutexLock lock(&releases_->mu);
  releases_->mu.AwaitWithTimeout(absl::Condition(+[](int* pending) { return *pending == 0; }, &releases_->pending),
                                 kPoolReleaseWait);
}

absl::Status Sequences::PoolFull(const Pool& pool, uint64_t needed, const char* who) {
  const uint64_t total = pool.refs.size(), free = pool.free.size();
  const std::string state = free == 0 ? absl::StrCat("all ", total, " pages are in use")
                                      : absl::StrCat(who, " needs ", needed, " pages, ", free, " of the pool's ",
                                                     total, " are free");
  return absl::ResourceExhaustedError(absl::StrCat(
      "kv pool (", ShapeText(pool.memory->shape()), "): ", state,
      "; close or truncate sequences, or start attnd with a larger --kv_pool_mb (shared equally by --kv_max_pools "
      "shapes)"));
}

absl::StatusOr<int32_t> Sequences::TakePage(Pool& pool, const std::string& owner) {
  ClientUse& use = clients_[owner];
  if (options_.max_pages_per_client > 0 && use.pages >= options_.max_pages_per_client) {
    return absl::ResourceExhaustedError(absl::StrCat("kv pool: this client's sequences hold ", use.pages,
                                                     " pages, the limit (--max_pages_per_client)"));
  }
  if (pool.free.empty()) return PoolFull(pool, 1);
  const int32_t page = pool.free.back();
  pool.free.pop_back();
  pool.refs[page] = 1;
  ++use.pages;
  return page;
}

void Sequences::Unref(Pool& pool, int32_t page) {
  if (--pool.refs[page] == 0) pool.free.push_back(page);
}

void Sequences::DropPages(Seq* seq, size_t keep) {
  ClientUse& use = clients_[seq->owner];
  while (seq->pages.size() > keep) {
    Unref(*seq->pool, seq->pages.back());
    seq->pages.pop_back();
    --use.pages;
  }
}

void Sequences::TrimPages(Seq* seq) {
  const int32_t longest = *std::max_element(seq->lengths.begin(), seq->lengths.end());
  DropPages(seq, static_cast<size_t>(CeilDiv(longest, options_.page_tokens)));
}

void Sequences::Free(Seq* seq, std::string reason) {
  DropPages(seq, 0);
  ClientUse& use = clients_[seq->owner];
  --use.sequences;
  if (use.sequences == 0 && use.pages == 0) clients_.erase(seq->owner);
  Pool* pool = seq->pool;
  const std::string id = seq->id;
  if (!seq->moved_to.empty()) moved_to_[id] = seq->moved_to;
  seqs_.erase(id);
  tombstones_[id] = std::move(reason);
  tombstone_order_.push_back(id);
  while (tombstone_order_.size() > options_.tombstones) {
    tombstones_.erase(tombstone_order_.front());
    moved_to_.erase(tombstone_order_.front());
    tombstone_order_.pop_front();
  }
  if (--pool->sequences == 0) pools_.erase(pool->memory->shape());
}

absl::StatusOr<uint32_t> Sequences::NewSequences(uint32_t requested) const {
  const uint32_t count = std::max<uint32_t>(requested, 1);
  if (count > options_.max_open) {
    return absl::ResourceExhaustedError(
        absl::StrCat("count: ", count, " exceeds the ", options_.max_open, " sequences one call may open"));
  }
  return count;
}

absl::Status Sequences::CheckClientSequences(const std::string& owner, uint32_t count) const {
  auto it = clients_.find(owner);
  const uint32_t open = it == clients_.end() ? 0 : it->second.sequences;
  if (options_.max_per_client > 0 && open + count > options_.max_per_client) {
    return absl::ResourceExhaustedError(absl::StrCat("count: this client has ", open, " sequences open; ", count,
                                                     " more would pass the limit of ", options_.max_per_client,
                                                     " (--max_sequences_per_client)"));
  }
  return absl::OkStatus();
}

namespace {

// A float8 cache's descales as the request gives them (one for all, one per layer, or one per layer and kv head),
// checked and spread to one per layer and kv head.
absl::Status ExpandDescales(absl::string_view field, const std::vector<float>& given, const SequenceShape& shape,
                            std::vector<float>* out) {
  const size_t layers = static_cast<size_t>(shape.layers), heads = static_cast<size_t>(shape.kv_heads);
  const size_t n = given.size();
  if (n != 1 && n != layers && n != layers * heads) {
    return Invalid(field, absl::StrCat(n, " values: a float8 cache takes 1, ", layers, " (layers) or ", layers * heads,
                                       " (layers x kv_heads)"));
  }
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(given[i]) || given[i] <= 0) {
      return Invalid(absl::StrCat(field, "[", i, "]"), absl::StrCat(given[i], " is not finite and > 0"));
    }
  }
  out->resize(layers * heads);
  for (size_t i = 0; i < out->size(); ++i) (*out)[i] = given[n == 1 ? 0 : n == layers ? i / heads : i];
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::pair<SequenceShape, int64_t>> Sequences::CheckOpen(const OpenArgs& request) const {
  if (!options_.enabled) return absl::FailedPreconditionError("KV sequences are disabled on this server");
  if (request.layers < 1 || request.layers > 4096) {
    return Invalid("shape.layers", absl::StrCat("must be 1..4096, got ", request.layers));
  }
  if (request.kv_heads < 1 || request.kv_heads > 4096) {
    return Invalid("shape.kv_heads", absl::StrCat("must be 1..4096, got ", request.kv_heads));
  }
  if (std::find(limits_.supported_head_dims.begin(), limits_.supported_head_dims.end(), request.head_dim) ==
      limits_.supported_head_dims.end()) {
    return Invalid("shape.head_dim", absl::StrCat(request.head_dim, " is not supported"));
  }
  SequenceShape shape;
  shape.layers = static_cast<int>(request.layers);
  shape.kv_heads = static_cast<int>(request.kv_heads);
  shape.head_dim = static_cast<int>(request.head_dim);
  shape.dtype = request.dtype;
  shape.kv_format = request.kv_format;
  if (request.kv_format == KvFormat::kFp8E4M3) {
    // The descales spread to layers x kv_heads values (8 bytes for 2 x page_tokens x head_dim bytes of a page):
    // only for a shape whose page fits a pool, so that a one-value request cannot make the server size them by
    // the shape's limits.
    ATTND_RETURN_IF_ERROR(PoolPages(options_, shape).status());
    ATTND_RETURN_IF_ERROR(ExpandDescales("shape.k_descale", request.k_descale, shape, &shape.k_descale));
    ATTND_RETURN_IF_ERROR(ExpandDescales("shape.v_descale", request.v_descale, shape, &shape.v_descale));
  } else if (!request.k_descale.empty() || !request.v_descale.empty()) {
    return Invalid(request.k_descale.empty() ? "shape.v_descale" : "shape.k_descale",
                   "given for a 16-bit cache (descales go with kv_dtype DTYPE_FP8_E4M3)");
  }
  if (request.max_tokens < 0) return Invalid("max_tokens", absl::StrCat("must be >= 0, got ", request.max_tokens));
  if (request.max_tokens > options_.max_tokens) {
    return absl::ResourceExhaustedError(absl::StrCat("max_tokens: ", request.max_tokens,
                                                     " exceeds the server limit --max_sequence_tokens=",
                                                     options_.max_tokens));
  }
  return std::make_pair(shape, request.max_tokens == 0 ? options_.max_tokens : request.max_tokens);
}

void Sequences::AwaitPoolFor(const SequenceShape& shape) {
  if (pools_.contains(shape)) return;
  // The new pool may need memory that a pool whose last sequence just closed still holds through the last step that
  // ran on it: wait for it rather than refuse for memory on its way back. Without mu_, which that step's end takes.
  mu_.Unlock();
  AwaitPoolReleases();
  mu_.Lock();
}

Sequences::Seq* Sequences::AddSequence(const std::string& owner, Pool* pool, int64_t max_tokens, absl::Time now) {
  auto seq = std::make_unique<Seq>();
  seq->id = NewId();
  seq->owner = owner;
  seq->pool = pool;
  seq->max_tokens = max_tokens;
  seq->lengths.assign(pool->memory->shape().layers, 0);
  seq->last_used = now;
  ++pool->sequences;
  ++clients_[owner].sequences;
  Seq* raw = seq.get();
  seqs_.emplace(raw->id, std::move(seq));
  return raw;
}

absl::StatusOr<OpenedSequences> Sequences::Open(const std::string& owner, const OpenArgs& request) {
  absl::StatusOr<std::pair<SequenceShape, int64_t>> checked = CheckOpen(request);
  if (!checked.ok()) return checked.status();
  const auto& [shape, max_tokens] = *checked;
  absl::StatusOr<uint32_t> count = NewSequences(request.count);
  if (!count.ok()) return count.status();
  absl::MutexLock lock(&mu_);
  AwaitPoolFor(shape);
  ATTND_RETURN_IF_ERROR(TakesNewSequences());
  ATTND_RETURN_IF_ERROR(CheckClientSequences(owner, *count));
  absl::StatusOr<Pool*> pool = PoolFor(shape);
  if (!pool.ok()) return pool.status();
  OpenedSequences response;
  const absl::Time now = absl::Now();
  for (uint32_t i = 0; i < *count; ++i) response.sequence_ids.push_back(AddSequence(owner, *pool, max_tokens, now)->id);
  response.max_tokens = max_tokens;
  response.page_tokens = options_.page_tokens;
  return response;
}

absl::StatusOr<std::vector<std::string>> Sequences::Fork(const std::string& owner, absl::string_view sequence_id,
                                                         uint32_t children) {
  absl::StatusOr<uint32_t> count = NewSequences(children);
  if (!count.ok()) return count.status();
  absl::MutexLock lock(&mu_);
  ATTND_RETURN_IF_ERROR(TakesNewSequences());
  absl::StatusOr<Seq*> found = Find(owner, sequence_id, "sequence_id");
  if (!found.ok()) return found.status();
  Seq* parent = *found;
  if (parent->busy() || parent->held_for_move) {
    return absl::AbortedError(absl::StrCat("sequence_id: sequence ", parent->id,
                                           BusyText(parent->moving || parent->held_for_move, "fork")));
  }
  ATTND_RETURN_IF_ERROR(CheckClientSequences(owner, *count));
  const ClientUse before = clients_[owner];
  if (options_.max_pages_per_client > 0 &&
      before.pages + uint64_t{*count} * parent->pages.size() > options_.max_pages_per_client) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "count: each child holds the parent's ", parent->pages.size(), " pages; this client holds ", before.pages,
        " and may hold ", options_.max_pages_per_client, " (--max_pages_per_client)"));
  }
  std::vector<std::string> ids;
  const absl::Time now = absl::Now();
  parent->last_used = now;
  for (uint32_t i = 0; i < *count; ++i) {
    Seq* child = AddSequence(owner, parent->pool, parent->max_tokens, now);
    child->lengths = parent->lengths;
    child->pages = parent->pages;
    for (int32_t p : child->pages) ++parent->pool->refs[p];
    clients_[owner].pages += child->pages.size();
    ids.push_back(child->id);
  }
  return ids;
}

absl::StatusOr<std::vector<int64_t>> Sequences::Truncate(const std::string& owner, absl::string_view sequence_id,
                                                         int64_t tokens) {
  if (tokens < 0) return Invalid("tokens", absl::StrCat("must be >= 0, got ", tokens));
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Seq*> found = Find(owner, sequence_id, "sequence_id");
  if (!found.ok()) return found.status();
  Seq* seq = *found;
  if (seq->busy() || seq->held_for_move) {
    return absl::AbortedError(
        absl::StrCat("sequence_id: sequence ", seq->id, BusyText(seq->moving || seq->held_for_move, "truncate")));
  }
  std::vector<int64_t> lengths;
  for (int32_t& len : seq->lengths) {
    len = static_cast<int32_t>(std::min<int64_t>(len, tokens));
    lengths.push_back(len);
  }
  TrimPages(seq);
  seq->last_used = absl::Now();
  return lengths;
}

absl::Status Sequences::Close(const std::string& owner, absl::Span<const absl::string_view> sequence_ids,
                              absl::string_view moved_to) {
  if (sequence_ids.empty()) return Invalid("sequence_ids", "empty");
  if (!moved_to.empty() && sequence_ids.size() != 1) {
    return Invalid("moved_to", absl::StrCat("names where one sequence went; ", sequence_ids.size(), " are closed"));
  }
  if (moved_to.size() > kMaxIdBytes) return Invalid("moved_to", absl::StrCat("longer than ", kMaxIdBytes, " bytes"));
  const std::string reason =
      moved_to.empty() ? std::string("closed by its owner")
                       : absl::StrCat("moved to ", moved_to, " (ImportSequence there; the client library follows it)");
  absl::MutexLock lock(&mu_);
  std::vector<Seq*> found;
  for (size_t i = 0; i < sequence_ids.size(); ++i) {
    absl::StatusOr<Seq*> seq = Find(owner, sequence_ids[i], absl::StrCat("sequence_ids[", i, "]"));
    if (!seq.ok()) return seq.status();
    if (std::find(found.begin(), found.end(), *seq) != found.end()) {
      return Invalid(absl::StrCat("sequence_ids[", i, "]"), "appears twice");
    }
    found.push_back(*seq);
  }
  for (Seq* seq : found) {
    seq->moved_to = std::string(moved_to);
    // An export that has read every row it sends needs the pages no more: only its hold against steps remains.
    if (seq->steps > 0 || (seq->moving && !seq->export_sent)) {
      seq->closing = true;  // Finish (or EndExport) frees it
      seq->close_reason = reason;
    } else {
      Free(seq, reason);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<SequenceState> Sequences::Get(const std::string& owner, absl::string_view sequence_id) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Seq*> found = Find(owner, sequence_id, "sequence_id");
  if (!found.ok()) return found.status();
  const Seq& seq = **found;
  SequenceState info;
  info.sequence_id = seq.id;
  info.shape = seq.pool->memory->shape();
  info.max_tokens = seq.max_tokens;
  info.lengths.assign(seq.lengths.begin(), seq.lengths.end());
  info.pages = static_cast<int64_t>(seq.pages.size());
  for (int32_t p : seq.pages) info.shared_pages += seq.pool->refs[p] > 1 ? 1 : 0;
  info.idle_s = absl::ToDoubleSeconds(absl::Now() - seq.last_used);
  info.step_in_flight = seq.steps > 0;
  return info;
}

int Sequences::ExpireIdle(absl::Time now) {
  if (options_.ttl == absl::InfiniteDuration()) return 0;
  absl::MutexLock lock(&mu_);
  std::vector<Seq*> idle;
  for (auto& [id, seq] : seqs_) {
    if (!seq->busy() && !seq->closing && now - seq->last_used > options_.ttl) idle.push_back(seq.get());
  }
  for (Seq* seq : idle) {
    Free(seq, absl::StrCat("closed after ", absl::FormatDuration(options_.ttl),
                           " idle (--sequence_ttl_s); open and prefill it again"));
  }
  expired_ += idle.size();
  return static_cast<int>(idle.size());
}

void Sequences::ReaperLoop() {
  const absl::Duration sweep =
      options_.ttl == absl::InfiniteDuration() ? absl::Seconds(1) : std::min(absl::Seconds(1), options_.ttl / 4);
  absl::Time next_sweep = absl::Now() + sweep;
  for (;;) {
    std::vector<BatchKey> due;
    {
      absl::MutexLock lock(&mu_);
      absl::Time wake = next_sweep;
      for (const auto& [key, lane] : lanes_) wake = std::min(wake, lane->launch_at);
      const auto woken = +[](Sequences* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) {
        return self->reaper_stop_ || self->reaper_wake_;
      };
      mu_.AwaitWithDeadline(absl::Condition(woken, this), wake);
      if (reaper_stop_) return;
      reaper_wake_ = false;
      const absl::Time now = absl::Now();
      for (const auto& [key, lane] : lanes_) {
        if (lane->in_flight < options_.launches_in_flight && lane->launch_at <= now) due.push_back(key);
      }
    }
    for (const BatchKey& key : due) Launch(key);
    if (absl::Now() >= next_sweep) {
      ExpireIdle(absl::Now());
      next_sweep = absl::Now() + sweep;
    }
  }
}

absl::Status Sequences::TakesNewSequences() const {
  if (stopping_) return absl::UnavailableError("the server is shutting down");
  if (draining_) {
    return absl::UnavailableError(
        "the server is draining before it shuts down: it serves its open sequences but takes no new ones; open "
        "them on another server");
  }
  return absl::OkStatus();
}

void Sequences::BeginDrain() {
  absl::MutexLock lock(&mu_);
  draining_ = true;
}

std::vector<Sequences::HeldSequence> Sequences::OpenSequences() const {
  absl::MutexLock lock(&mu_);
  std::vector<HeldSequence> open;
  open.reserve(seqs_.size());
  for (const auto& [id, seq] : seqs_) {
    if (seq->closing) continue;
    uint64_t rows = 0;
    for (int32_t len : seq->lengths) rows += static_cast<uint64_t>(len);
    const SequenceShape& shape = seq->pool->memory->shape();
    open.push_back(HeldSequence{id, seq->owner, rows * 2 * static_cast<uint64_t>(shape.kv_heads * shape.head_dim) *
                                            shape.kv_bytes()});
  }
  return open;
}

absl::Status Sequences::HoldForMove(const std::string& owner, const std::string& id) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Seq*> found = Find(owner, id, "sequence_id");
  if (!found.ok()) return found.status();
  Seq* seq = *found;
  if (seq->busy()) {
    return absl::AbortedError(absl::StrCat("sequence_id: sequence ", seq->id, BusyText(seq->moving, "move")));
  }
  seq->held_for_move = true;
  return absl::OkStatus();
}

void Sequences::ReleaseHold(const std::string& id) {
  absl::MutexLock lock(&mu_);
  if (auto it = seqs_.find(id); it != seqs_.end()) it->second->held_for_move = false;
}

void Sequences::ExpectFollow(const std::string& id) {
  absl::MutexLock lock(&mu_);
  expect_follow_.insert(id);
}

void Sequences::Unexpect(const std::string& id) {
  absl::MutexLock lock(&mu_);
  expect_follow_.erase(id);
}

size_t Sequences::AwaitFollowed(absl::Time deadline) const {
  absl::MutexLock lock(&mu_);
  const auto none = +[](const Sequences* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) {
    return self->expect_follow_.empty();
  };
  mu_.AwaitWithDeadline(absl::Condition(none, this), deadline);
  return expect_follow_.size();
}

size_t Sequences::AwaitClosed(absl::Time deadline) const {
  absl::MutexLock lock(&mu_);
  const auto none = +[](const Sequences* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) { return self->seqs_.empty(); };
  mu_.AwaitWithDeadline(absl::Condition(none, this), deadline);
  return seqs_.size();
}

void Sequences::Shutdown() {
  absl::MutexLock lock(&mu_);
  stopping_ = true;
  // Steps waiting for a batch_wait launch go now rather than at their time.
  for (auto& [key, lane] : lanes_) {
    if (!lane->waiting.empty()) lane->launch_at = absl::InfinitePast();
  }
  reaper_wake_ = true;
  const auto drained = +[](Sequences* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) {
    return self->admitted_ == 0 && self->launches_running_ == 0;
  };
  mu_.Await(absl::Condition(drained, this));
}

uint32_t Sequences::waiting() const {
  absl::MutexLock lock(&mu_);
  return waiting_;
}

SequenceCounts Sequences::stats() const {
  absl::MutexLock lock(&mu_);
  SequenceCounts s;
  s.open = seqs_.size();
  for (const auto& [shape, pool] : pools_) {
    s.pages_free += pool->free.size();
    s.pages_used += pool->refs.size() - pool->free.size();
  }
  s.pools = pools_.size();
  s.steps = steps_;
  s.launches = launches_;
  s.expired = expired_;
  return s;
}

}  // namespace attnd::server
