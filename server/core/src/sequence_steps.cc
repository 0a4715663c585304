#include "attnd/server/sequences.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "attnd/server/status_util.h"
#include "attnd/server/validation.h"
#include "sequences_internal.h"

namespace attnd::server {
namespace {

constexpr size_t kMaxRequestIdBytes = 256;

// Bytes of a [rows, heads, head_dim] tensor, or false past int64.
bool RowsBytes(int64_t rows, int64_t heads, int64_t head_dim, uint64_t elem, uint64_t* out) {
  uint64_t n = elem;
  for (int64_t d : {rows, heads, head_dim}) {
    if (__builtin_mul_overflow(n, static_cast<uint64_t>(d), &n)) return false;
  }
  if (n > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
  *out = n;
  return true;
}

}  // namespace

absl::Status Sequences::Admit(const std::string& owner, const StepArgs& request, const CallInfo& call, StepJob* job,
                              const std::shared_ptr<Admitted>& admitted) {
  const bool append = request.k.present() || request.v.present();
  const bool attend = request.q.present();
  ATTND_RETURN_IF_ERROR(CheckStepRequest(request, call, append, attend));
  if (call.admit) ATTND_RETURN_IF_ERROR(call.admit());

  absl::MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("the server is shutting down");
  if (waiting_ >= options_.max_waiting) {
    return absl::ResourceExhaustedError(absl::StrCat("queue full: ", waiting_,
                                                     " steps waiting for a launch (--max_queue)"));
  }
  std::vector<Seq*> seqs;
  int64_t rows = 0;
  ATTND_RETURN_IF_ERROR(FindStepSequences(owner, request, call, &seqs, &rows));
  ATTND_RETURN_IF_ERROR(CheckStepCounts(request, seqs, append, attend));
  const SequenceShape& shape = seqs[0]->pool->memory->shape();
  absl::StatusOr<StepBytes> bytes = SizeStep(request, call, shape, rows, append, attend);
  if (!bytes.ok()) return bytes.status();
  ATTND_RETURN_IF_ERROR(BindStepTensors(request, *bytes, append, attend, job));
  DescribeStep(request, call, seqs, rows, append, attend, job);
  ATTND_RETURN_IF_ERROR(backend_->AcceptStep(*job));
  ATTND_RETURN_IF_ERROR(TakeStepPages(owner, seqs, job, admitted.get()));
  admitted->chain = call.chain;
  admitted->device = call.device_order.has_value();
  if (admitted->device) admitted->order_outcome = call.device_order->outcome;
  if (call.chain) {
    // A step admitted behind this one may grow the tables (and move them) while this one runs.
    size_t entries = 0;
    for (const Seq* seq : seqs) entries += seq->pages.size();
    job->tables.reserve(entries);
  }
  const absl::Time now = absl::Now();
  for (size_t i = 0; i < seqs.size(); ++i) {
    Seq* seq = seqs[i];
    if (seq->last != nullptr &&
        std::find(admitted->after.begin(), admitted->after.end(), seq->last) == admitted->after.end()) {
      admitted->after.push_back(seq->last);
    }
    ++seq->steps;
    seq->last = admitted;
    if (seq->ahead.empty()) seq->ahead.assign(seq->lengths.size(), 0);
    if (append) seq->ahead[job->layer] += job->sequences[i].tokens;
    seq->last_used = now;
    if (call.chain) {
      const size_t at = job->tables.size();
      job->tables.insert(job->tables.end(), seq->pages.begin(), seq->pages.end());
      job->sequences[i].pages = absl::MakeConstSpan(job->tables).subspan(at);
    } else {
      job->sequences[i].pages = seq->pages;
    }
    admitted->parts.push_back({seq, job->sequences[i].cached, job->sequences[i].tokens});
  }
  ++admitted_;
  return absl::OkStatus();
}

absl::Status Sequences::CheckStepRequest(const StepArgs& request, const CallInfo& call, bool append,
                                         bool attend) const {
  if (!options_.enabled) return absl::FailedPreconditionError("KV sequences are disabled on this server");
  if (request.request_id.size() > kMaxRequestIdBytes) {
    return Invalid("request_id", absl::StrCat("longer than ", kMaxRequestIdBytes, " bytes"));
  }
  if (request.sequences.empty()) return Invalid("sequences", "empty: a step names at least one sequence");
  if (request.sequences.size() > options_.max_batch) {
    return absl::ResourceExhaustedError(absl::StrCat("sequences: ", request.sequences.size(),
                                                     " exceeds the server limit --max_step_batch=",
                                                     options_.max_batch));
  }
  if (append && !(request.k.present() && request.v.present())) {
    return Invalid(request.k.present() ? "v" : "k", "k and v are both set (append) or both unset");
  }
  if (!append && !attend) return Invalid("q", "a step needs q (attend), k and v (append), or all three");
  if (!attend && request.o_ref.has_value()) return Invalid("o_ref", "given without q: a step without q has no O");
  if (!attend && request.return_lse) return Invalid("return_lse", "set without q: a step without q has no LSE");
  if (request.softmax_scale.has_value() && !std::isfinite(*request.softmax_scale)) {
    return Invalid("softmax_scale", "must be finite");
  }
  for (const auto& [field, input] : {std::pair<const char*, const TensorArg*>{"q", &request.q},
                                     {"k", &request.k}, {"v", &request.v}}) {
    if (input->is_ref() && !input->ref.strides.empty()) {
      return Invalid(absl::StrCat(field, ".ref.strides"), "a step's tensors are contiguous: leave strides empty");
    }
  }
  if (request.o_ref.has_value() && !request.o_ref->strides.empty()) {
    return Invalid("o_ref.strides", "a step's tensors are contiguous: leave strides empty");
  }
  if (request.stream_ordered && !call.ready && !call.device_order.has_value()) {
    // The shared-memory channel waits for the order (CallInfo::ready); no other transport can.
    return absl::FailedPreconditionError(
        "order: a step waits for the caller's stream only over the shared-memory channel (--shm_socket), whose "
        "wait word the stream writes; over gRPC wait for the stream on the host and send the step without order");
  }
  return absl::OkStatus();
}

absl::Status Sequences::FindStepSequences(const std::string& owner, const StepArgs& request, const CallInfo& call,
                                          std::vector<Seq*>* seqs_out, int64_t* rows_out) {
  std::vector<Seq*>& seqs = *seqs_out;
  int64_t& rows = *rows_out;
  for (size_t i = 0; i < request.sequences.size(); ++i) {
    const SequenceTokensArg& st = request.sequences[i];
    const auto field = [i] { return absl::StrCat("sequences[", i, "]"); };  // for messages only: a step names many
    Seq* seq = nullptr;
    auto it = seqs_.find(st.sequence_id);
    if (it != seqs_.end() && it->second->owner == owner && !it->second->closing) {
      seq = it->second.get();  // what Find answers for an open sequence of the caller's
    } else {
      absl::StatusOr<Seq*> found = Find(owner, st.sequence_id, absl::StrCat(field(), ".sequence_id"));
      if (!found.ok()) return found.status();
      seq = *found;
    }
    if (std::find(seqs.begin(), seqs.end(), seq) != seqs.end()) {
      return Invalid(absl::StrCat(field(), ".sequence_id"), "appears twice in one step");
    }
    // A step in flight: only a caller that pipelines its steps (CallInfo::chain) may queue one more behind it.
    const char* why = seq->moving || seq->held_for_move
                          ? " is being moved (ExportSequence); step it once the move is over"
                      : seq->steps == 0 ? nullptr
                      : !call.chain || !seq->last->chain
                          ? " has a step in flight (a sequence takes one step at a time)"
                      : seq->steps > 1  ? " has two steps in flight (one step may wait behind another, no more)"
                                        : nullptr;
    if (why != nullptr) return absl::AbortedError(absl::StrCat(field(), ".sequence_id: sequence ", seq->id, why));
    if (!seqs.empty() && seq->pool != seqs[0]->pool) {
      return Invalid(absl::StrCat(field(), ".sequence_id"),
                     absl::StrCat("its shape (", ShapeText(seq->pool->memory->shape()), ") differs from sequences[0]'s (",
                                  ShapeText(seqs[0]->pool->memory->shape()), "): one step runs on one shape"));
    }
    if (st.tokens < 1 || st.tokens > seq->max_tokens) {
      return Invalid(absl::StrCat(field(), ".tokens"),
                     absl::StrCat("must be 1..", seq->max_tokens, " (the sequence's max_tokens), got ", st.tokens));
    }
    seqs.push_back(seq);
    rows += st.tokens;
  }
  return absl::OkStatus();
}

absl::Status Sequences::CheckStepCounts(const StepArgs& request, const std::vector<Seq*>& seqs, bool append,
                                        bool attend) const {
  const SequenceShape& shape = seqs[0]->pool->memory->shape();
  if (request.layer < 0 || request.layer >= shape.layers) {
    return Invalid("layer", absl::StrCat("must be 0..", shape.layers - 1, " (the sequences have ", shape.layers,
                                         " layers), got ", request.layer));
  }
  const int layer = static_cast<int>(request.layer);
  if (attend) {
    if (request.q_heads < 1 || request.q_heads % shape.kv_heads != 0) {
      return Invalid("q_heads", absl::StrCat("must be a positive multiple of the sequences' kv_heads (",
                                             shape.kv_heads, "), got ", request.q_heads));
    }
    if (limits_.max_heads > 0 && request.q_heads > limits_.max_heads) {
      return absl::ResourceExhaustedError(
          absl::StrCat("q_heads: ", request.q_heads, " exceeds the server limit --max_heads=", limits_.max_heads));
    }
  }
  for (size_t i = 0; i < request.sequences.size(); ++i) {
    const int64_t tokens = request.sequences[i].tokens;
    const int64_t cached = seqs[i]->cached(layer);
    if (append && cached + tokens > seqs[i]->max_tokens) {
      return absl::ResourceExhaustedError(absl::StrCat("sequences[", i, "].tokens: ", cached, " cached + ", tokens,
                                                       " new would pass the sequence's max_tokens (",
                                                       seqs[i]->max_tokens, ")"));
    }
    if (!append && tokens > cached) {
      return Invalid(absl::StrCat("sequences[", i, "].tokens"),
                     absl::StrCat(tokens, " query rows, but layer ", layer, " caches only ", cached,
                                  " tokens (without k and v, q's rows are the last cached positions)"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Sequences::StepBytes> Sequences::SizeStep(const StepArgs& request, const CallInfo& call,
                                                         const SequenceShape& shape, int64_t rows, bool append,
                                                         bool attend) const {
  // Sizes: each inline tensor exactly its shape. --max_request_bytes bounds all of a step's tensors together (the
  // memory the step takes); over gRPC the request and the reply are two messages, each held to --max_message_bytes
  // on its own, with what it carries: Q, K and V inline, O unless it goes to o_ref, and LSE.
  const uint64_t elem = DTypeBytes(shape.dtype);
  const int64_t q_heads = attend ? request.q_heads : 0;
  uint64_t q_bytes = 0, kv_bytes = 0, lse_bytes = 0;
  if (!RowsBytes(rows, std::max<int64_t>(q_heads, 1), shape.head_dim, elem, &q_bytes) ||
      !RowsBytes(rows, shape.kv_heads, shape.head_dim, elem, &kv_bytes) ||
      !RowsBytes(rows, std::max<int64_t>(q_heads, 1), 1, sizeof(float), &lse_bytes)) {
    return Invalid("sequences", "the step's tensors are too large to address");
  }
  if (!attend) q_bytes = lse_bytes = 0;
  if (!request.return_lse) lse_bytes = 0;
  if (!append) kv_bytes = 0;
  const uint64_t total = 2 * q_bytes + 2 * kv_bytes + lse_bytes;  // q, o, k, v, lse
  if (total > limits_.max_request_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("sequences: the step's tensors (Q+K+V+O+LSE) take ", total,
                                                     " bytes, over the server limit --max_request_bytes=",
                                                     limits_.max_request_bytes, "; send fewer tokens per step"));
  }
  if (call.message_limit != 0) {
    const uint64_t limit = call.message_limit;
    const uint64_t in = (request.q.is_ref() ? 0 : q_bytes) + (request.k.is_ref() ? 0 : kv_bytes) +
                        (request.v.is_ref() ? 0 : kv_bytes);
    const uint64_t out = (request.o_ref.has_value() ? 0 : q_bytes) + lse_bytes;
    for (const auto& [what, bytes] : {std::pair<const char*, uint64_t>{"request (inline Q, K and V)", in},
                                      {"reply (O and LSE)", out}}) {
      if (bytes + kMessageOverheadBytes > limit) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "sequences: the step's ", what, " takes ", bytes, " bytes, more than one message holds (",
            limit > kMessageOverheadBytes ? limit - kMessageOverheadBytes : 0, ": --max_message_bytes=", limit,
            " less ", kMessageOverheadBytes,
            " for framing); send fewer tokens per step"));
      }
    }
  }
  return StepBytes{q_bytes, kv_bytes};
}

absl::Status Sequences::BindStepTensors(const StepArgs& request, const StepBytes& sizes, bool append, bool attend,
                                        StepJob* job) const {
  const auto bind = [&](const char* field, const TensorArg& in, uint64_t bytes, TensorSource* src) {
    if (in.is_ref()) {
      if (buffers_ == nullptr) {
        return absl::FailedPreconditionError(absl::StrCat(field, ".ref: CUDA IPC is not enabled (--enable_cuda_ipc)"));
      }
      src->buffer_id = std::string(in.ref.buffer_id);
      src->offset = in.ref.offset;
      return absl::OkStatus();
    }
    if (in.inline_bytes() != bytes) {
      return Invalid(absl::StrCat(field, ".data"), absl::StrCat(in.inline_bytes(), " bytes, expected ", bytes));
    }
    BindInline(in, src);
    return absl::OkStatus();
  };
  if (attend) ATTND_RETURN_IF_ERROR(bind("q", request.q, sizes.q, &job->q));
  if (append) {
    ATTND_RETURN_IF_ERROR(bind("k", request.k, sizes.kv, &job->k));
    ATTND_RETURN_IF_ERROR(bind("v", request.v, sizes.kv, &job->v));
  }
  if (request.o_ref.has_value()) {
    if (buffers_ == nullptr) {
      return absl::FailedPreconditionError("o_ref: CUDA IPC is not enabled (--enable_cuda_ipc)");
    }
    job->o_to_buffer = true;
    job->o_ref.buffer_id = std::string(request.o_ref->buffer_id);
    job->o_ref.offset = request.o_ref->offset;
  }
  return absl::OkStatus();
}

void Sequences::DescribeStep(const StepArgs& request, const CallInfo& call, const std::vector<Seq*>& seqs,
                             int64_t rows, bool append, bool attend, StepJob* job) const {
  const SequenceShape& shape = seqs[0]->pool->memory->shape();
  const int layer = static_cast<int>(request.layer);
  const int64_t q_heads = attend ? request.q_heads : 0;
  job->request_id = std::string(request.request_id);
  job->pool = seqs[0]->pool->memory;
  job->layer = layer;
  job->q_heads = static_cast<int>(q_heads);
  job->scale = request.softmax_scale.value_or(DefaultScale(shape.head_dim));
  job->want_lse = request.return_lse;
  job->append = append;
  job->attend = attend;
  job->rows = rows;
  job->accepted = call.accepted;
  job->deadline = call.deadline;
  job->cancelled = call.cancelled;
  for (size_t i = 0; i < request.sequences.size(); ++i) {
    StepSequence part;
    part.cached = seqs[i]->cached(layer);
    part.tokens = static_cast<int32_t>(request.sequences[i].tokens);
    job->sequences.push_back(std::move(part));
  }
}

absl::Status Sequences::TakeStepPages(const std::string& owner, const std::vector<Seq*>& seqs, StepJob* job,
                                      Admitted* admitted) {
  const int layer = job->layer;
  const bool append = job->append;
  // Pages: grow each table to cover the new rows, and give each sequence its own copy of every shared page the
  // new rows land in. Counted first, so that a step the pool cannot hold is refused before it takes any and says
  // what it needs; undone in full when the client's page limit stops it part way.
  Pool& pool = *seqs[0]->pool;
  const int page = options_.page_tokens;
  uint64_t needed = 0;
  for (size_t i = 0; i < seqs.size() && append; ++i) {
    const Seq* seq = seqs[i];
    const int64_t cached = job->sequences[i].cached, end = cached + job->sequences[i].tokens;
    const int64_t held = static_cast<int64_t>(seq->pages.size());
    for (int64_t slot = cached / page; slot < std::min(CeilDiv(end, page), held); ++slot) {
      if (pool.refs[seq->pages[slot]] > 1) ++needed;  // a shared page the rows land in: copied
    }
    needed += static_cast<uint64_t>(std::max<int64_t>(CeilDiv(end, page) - held, 0));
  }
  if (needed > pool.free.size()) return PoolFull(pool, needed);
  admitted->pool = &pool;
  admitted->layer = layer;
  admitted->append = append;
  admitted->owner = owner;
  std::vector<size_t> table_sizes;
  absl::Status status;
  for (size_t i = 0; i < seqs.size() && status.ok() && append; ++i) {
    Seq* seq = seqs[i];
    table_sizes.push_back(seq->pages.size());
    const int64_t cached = job->sequences[i].cached, end = cached + job->sequences[i].tokens;
    const size_t old_size = seq->pages.size();
    for (int64_t slot = cached / page; slot < CeilDiv(end, page) && slot < static_cast<int64_t>(old_size); ++slot) {
      const int32_t from = seq->pages[slot];
      if (pool.refs[from] <= 1) continue;
      absl::StatusOr<int32_t> to = TakePage(pool, owner);
      if (!to.ok()) {
        status = to.status();
        break;
      }
      // The table's reference to `from` passes to the step, which drops it once the copy has run.
      seq->pages[slot] = *to;
      --clients_[owner].pages;
      admitted->copies.push_back({seq, static_cast<size_t>(slot), from, *to});
      job->copies.push_back({from, *to});
    }
    while (status.ok() && static_cast<int64_t>(seq->pages.size()) < CeilDiv(end, page)) {
      absl::StatusOr<int32_t> p = TakePage(pool, owner);
      if (!p.ok()) {
        status = p.status();
        break;
      }
      seq->pages.push_back(*p);
    }
  }
  if (!status.ok()) {
    UndoStepPages(owner, seqs, table_sizes, job, admitted);
    return status;
  }
  return absl::OkStatus();
}

void Sequences::UndoStepPages(const std::string& owner, const std::vector<Seq*>& seqs,
                              const std::vector<size_t>& table_sizes, StepJob* job, Admitted* admitted) {
  Pool& pool = *admitted->pool;
  for (auto it = admitted->copies.rbegin(); it != admitted->copies.rend(); ++it) {
    it->seq->pages[it->slot] = it->from;
    ++clients_[owner].pages;
    Unref(pool, it->to);
    --clients_[owner].pages;
  }
  for (size_t i = 0; i < table_sizes.size(); ++i) DropPages(seqs[i], table_sizes[i]);
  admitted->copies.clear();
  job->copies.clear();
}

absl::Status Sequences::Finish(Admitted& admitted, absl::Status status) {
  absl::MutexLock lock(&mu_);
  // Steps end in the order they were admitted; one admitted behind a step that failed fails too, since it ran on
  // rows that are not committed.
  mu_.Await(absl::Condition(+[](Admitted* a) { return AllDone(a->after); }, &admitted));
  if (status.ok()) status = PredecessorFailure(admitted);
  if (status.ok() && admitted.order_outcome) status = admitted.order_outcome();
  admitted.after.clear();
  const bool ok = status.ok();
  Pool& pool = *admitted.pool;
  const auto revert = [this, &pool](const Admitted::Copy& c) {
    // The copy may not have run: the sequence goes back to the shared page it had.
    c.seq->pages[c.slot] = c.from;
    Unref(pool, c.to);
  };
  for (const Admitted::Copy& c : admitted.copies) {
    if (ok) {
      Unref(pool, c.from);
    } else if (c.seq->steps > 1) {
      c.seq->reverts.push_back(c);  // the step behind this one reads and writes the copy: undone after it
    } else {
      revert(c);
    }
  }
  const absl::Time now = absl::Now();
  for (const Admitted::Part& part : admitted.parts) {
    Seq* seq = part.seq;
    --seq->steps;
    if (admitted.append) seq->ahead[admitted.layer] -= part.tokens;
    seq->last_used = now;
    if (ok && admitted.append) seq->lengths[admitted.layer] = part.cached + part.tokens;
    seq->trim = seq->trim || !ok;
    if (seq->steps > 0) continue;
    for (auto it = seq->reverts.rbegin(); it != seq->reverts.rend(); ++it) revert(*it);
    seq->reverts.clear();
    if (seq->trim) TrimPages(seq);
    seq->trim = false;
    seq->last = nullptr;
    if (seq->closing) Free(seq, seq->close_reason);
  }
  admitted.outcome = status;
  admitted.done = true;
  if (ok) ++steps_;
  return status;
}

bool Sequences::AllDone(const std::vector<std::shared_ptr<Admitted>>& steps) {
  return std::all_of(steps.begin(), steps.end(), [](const std::shared_ptr<Admitted>& a) { return a->done; });
}

absl::Status Sequences::PredecessorFailure(const Admitted& admitted) {
  for (const std::shared_ptr<Admitted>& before : admitted.after) {
    if (before->done && !before->outcome.ok()) {
      return absl::AbortedError(absl::StrCat("the step before it on the same sequences failed, so nothing of this "
                                             "one was kept: ", before->outcome.message()));
    }
  }
  return absl::OkStatus();
}

bool Sequences::MayLaunch(const Admitted& admitted) {
  // Ordered by the host, a step reads what the one before it wrote once that one has ended; ordered by the device,
  // once that one's GPU work is queued ahead of it (the caller's stream writes this step's word after the other's
  // done word).
  return std::all_of(admitted.after.begin(), admitted.after.end(), [&](const std::shared_ptr<Admitted>& a) {
    return a->done || (admitted.device && a->enqueued);
  });
}

absl::Status Sequences::AwaitPredecessors(Admitted& admitted, const CallInfo& call) {
  absl::MutexLock lock(&mu_);
  const absl::Condition ready(+[](Admitted* a) { return MayLaunch(*a); }, &admitted);
  while (!MayLaunch(admitted)) {
    // In slices, to see a cancelled call.
    const absl::Time now = absl::Now();
    if (now >= call.deadline) {
      return absl::DeadlineExceededError(
          "the deadline expired while the step waited for the one before it on its sequences; nothing was done");
    }
    if (call.cancelled && call.cancelled()) {
      return absl::CancelledError("the call was cancelled while it waited for the step before it; nothing was done");
    }
    mu_.AwaitWithDeadline(ready, std::min(call.deadline, now + absl::Milliseconds(20)));
  }
  return PredecessorFailure(admitted);
}

void Sequences::Answered() {
  absl::MutexLock lock(&mu_);
  --admitted_;
}

void Sequences::Step(const std::string& owner, const StepArgs& request, const CallInfo& call, StepReply reply) {
  auto job = std::make_unique<StepJob>();
  auto admitted = std::make_shared<Admitted>();
  if (absl::Now() >= call.deadline) {
    return reply(absl::DeadlineExceededError("the deadline had expired when the step arrived; nothing was done"),
                 nullptr);
  }
  if (call.cancelled && call.cancelled()) {
    return reply(absl::CancelledError("the call was cancelled before it was queued"), nullptr);
  }
  absl::Status status = Admit(owner, request, call, job.get(), admitted);
  if (!status.ok()) return reply(status, nullptr);
  const auto fail = [&](absl::Status s) {
    reply(Finish(*admitted, std::move(s)), nullptr);
    Answered();
  };
  // References: resolved against the buffer registry, as a Forward's.
  const SequenceShape& shape = job->pool->shape();
  std::vector<TensorUse> uses;
  if (job->q.is_reference()) uses.push_back({"q.ref", &job->q, 1, job->rows, job->q_heads});
  if (job->k.is_reference()) uses.push_back({"k.ref", &job->k, 1, job->rows, shape.kv_heads});
  if (job->v.is_reference()) uses.push_back({"v.ref", &job->v, 1, job->rows, shape.kv_heads});
  if (job->o_to_buffer) uses.push_back({"o_ref", &job->o_ref, 1, job->rows, job->q_heads, true});
  if (!uses.empty()) {
    status = ResolveTensorReferences(buffers_, absl::MakeSpan(uses), shape.head_dim, shape.dtype, &job->buffer_holds);
    if (!status.ok()) return fail(std::move(status));
  }
  // A step admitted behind another launches once that one has ended: it reads the rows that one appends.
  if (!admitted->after.empty()) {
    status = AwaitPredecessors(*admitted, call);
    if (!status.ok()) return fail(std::move(status));
  }
  if (call.ready) {
    // Admission above overlapped the caller's producers; the launch must not.
    status = call.ready();
    if (!status.ok()) return fail(std::move(status));
  }
  StepJob* j = job.get();
  if (call.device_order.has_value()) {
    j->device_order = StepJob::DeviceOrder{call.device_order->wait_word, call.device_order->done_word,
                                           call.device_order->value};
    j->enqueued = [this, admitted] {
      absl::MutexLock lock(&mu_);
      admitted->enqueued = true;
    };
  }
  j->done = [this, j, admitted, reply](absl::Status s) {
    j->buffer_holds.clear();
    s = Finish(*admitted, std::move(s));
    reply(std::move(s), j);
    Answered();
  };
  bool uniform = true;
  for (const StepSequence& s : j->sequences) uniform = uniform && s.tokens == j->sequences[0].tokens;
  // A step the device orders runs alone: a launch waits on the GPU for its caller's stream.
  BatchKey key{j->pool.get(), j->layer, j->q_heads, 0, j->want_lse, j->append, j->attend,
               uniform && !j->device_order.has_value() ? j->sequences[0].tokens : -1, 0};
  std::memcpy(&key.scale_bits, &j->scale, sizeof(float));
  // A batch the backend refuses is dropped with its jobs: this answers such a job without touching it.
  auto refuse = [this, admitted, reply](const absl::Status& s) {
    reply(Finish(*admitted, s), nullptr);
    Answered();
  };
  Enqueue(key, Pending{std::move(job), std::move(refuse)});
}

void Sequences::Enqueue(BatchKey key, Pending pending) {
  bool launch_now = false;
  {
    absl::MutexLock lock(&mu_);
    if (key.tokens < 0) key.unique = ++next_unique_;  // ragged steps run alone
    std::unique_ptr<Lane>& lane = lanes_[key];
    if (lane == nullptr) lane = std::make_unique<Lane>();
    lane->waiting.push_back(std::move(pending));
    ++waiting_;
    if (lane->in_flight < options_.launches_in_flight) {
      if (options_.batch_wait <= absl::ZeroDuration() || key.unique != 0) {
        launch_now = true;
      } else if (lane->launch_at == absl::InfiniteFuture()) {
        lane->launch_at = absl::Now() + options_.batch_wait;
        reaper_wake_ = true;
      }
    }
  }
  if (launch_now) Launch(key);
}

void Sequences::Launch(const BatchKey& key) {
  auto batch = std::make_unique<StepBatch>();
  std::vector<std::function<void(const absl::Status&)>> refusals;
  std::vector<std::pair<std::unique_ptr<StepJob>, absl::Status>> dropped;
  {
    absl::MutexLock lock(&mu_);
    auto it = lanes_.find(key);
    if (it == lanes_.end()) return;
    Lane& lane = *it->second;
    if (lane.in_flight >= options_.launches_in_flight) return;
    lane.launch_at = absl::InfiniteFuture();
    const absl::Time now = absl::Now();
    uint32_t sequences = 0;
    while (!lane.waiting.empty()) {
      const uint32_t n = static_cast<uint32_t>(lane.waiting.front().job->sequences.size());
      if (!batch->jobs.empty() && sequences + n > options_.max_batch) break;
      Pending pending = std::move(lane.waiting.front());
      lane.waiting.pop_front();
      --waiting_;
      std::unique_ptr<StepJob>& job = pending.job;
      if (now >= job->deadline) {
        dropped.emplace_back(std::move(job), absl::DeadlineExceededError(absl::StrCat(
                                                 "the deadline expired after ",
                                                 absl::ToDoubleMicroseconds(now - job->accepted),
                                                 " us waiting for a launch; nothing was done")));
        continue;
      }
      if (job->cancelled && job->cancelled()) {
        dropped.emplace_back(std::move(job), absl::CancelledError("the call was cancelled while waiting for a launch"));
        continue;
      }
      sequences += n;
      refusals.push_back(std::move(pending.refuse));
      batch->jobs.push_back(std::move(job));
    }
    if (batch->jobs.empty()) {
      if (lane.waiting.empty() && lane.in_flight == 0) lanes_.erase(it);
    } else {
      ++lane.in_flight;
      ++launches_;
      ++launches_running_;
    }
  }
  for (auto& [job, status] : dropped) job->done(status);
  if (batch->jobs.empty()) return;

  // The lane launches its next batch once every job of this one has been answered.
  auto remaining = std::make_shared<std::atomic<size_t>>(batch->jobs.size());
  for (std::unique_ptr<StepJob>& job : batch->jobs) {
    job->done = [this, key, remaining, done = std::move(job->done)](absl::Status s) {
      done(std::move(s));
      if (remaining->fetch_sub(1) == 1) {
        LaunchDone(key);
        LaunchEnded();
      }
    };
  }
  const absl::Status status = backend_->SubmitSteps(std::move(batch));
  if (!status.ok()) {
    for (auto& refuse : refusals) refuse(status);
    FailLane(key, status);
    LaunchEnded();
  }
}

void Sequences::LaunchEnded() {
  absl::MutexLock lock(&mu_);
  --launches_running_;
}

void Sequences::LaunchDone(const BatchKey& key) {
  {
    absl::MutexLock lock(&mu_);
    auto it = lanes_.find(key);
    if (it == lanes_.end()) return;
    Lane& lane = *it->second;
    --lane.in_flight;
    if (lane.waiting.empty()) {
      if (lane.in_flight == 0) lanes_.erase(it);
      return;
    }
  }
  Launch(key);
}

void Sequences::FailLane(const BatchKey& key, const absl::Status& status) {
  std::deque<Pending> waiting;
  {
    absl::MutexLock lock(&mu_);
    auto it = lanes_.find(key);
    if (it == lanes_.end()) return;
    // The refused launch no longer runs; launches of this lane still running keep it.
    Lane& lane = *it->second;
    --lane.in_flight;
    waiting.swap(lane.waiting);
    waiting_ -= static_cast<uint32_t>(waiting.size());
    if (lane.in_flight == 0) lanes_.erase(it);
  }
  for (Pending& p : waiting) p.job->done(status);
}

}  // namespace attnd::server
