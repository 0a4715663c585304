// Moving a sequence between servers (docs/sequences.md, "Moving a sequence"): a sequence held while its rows are
// read out (export) or written in (import). The frontends stream the rows; this file keeps the sequence's state
// consistent meanwhile: an exported sequence stays open and unchanged until the mover closes it, an imported one is
// invisible to steps until every row has arrived.
#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "attnd/server/sequences.h"
#include "attnd/server/status_util.h"
#include "sequences_internal.h"

namespace attnd::server {

absl::StatusOr<MovingSequence> Sequences::BeginExport(const std::string& owner, absl::string_view sequence_id) {
  if (!options_.enabled) return absl::FailedPreconditionError("KV sequences are disabled on this server");
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Seq*> found = Find(owner, sequence_id, "sequence_id");
  if (!found.ok()) return found.status();
  Seq* seq = *found;
  if (seq->busy()) {
    return absl::AbortedError(absl::StrCat("sequence_id: sequence ", seq->id,
                                           seq->moving ? " is being moved already"
                                                       : " has a step in flight; export it after the step's reply"));
  }
  seq->moving = true;
  MovingSequence m;
  m.sequence_id = seq->id;
  m.shape = seq->pool->memory->shape();
  m.max_tokens = seq->max_tokens;
  m.lengths.assign(seq->lengths.begin(), seq->lengths.end());
  m.pool = seq->pool->memory;
  m.pages = seq->pages;
  return m;
}

void Sequences::ExportSent(const MovingSequence& m) {
  absl::MutexLock lock(&mu_);
  if (auto it = seqs_.find(m.sequence_id); it != seqs_.end()) it->second->export_sent = true;
}

void Sequences::EndExport(const MovingSequence& m) {
  absl::MutexLock lock(&mu_);
  auto it = seqs_.find(m.sequence_id);
  if (it == seqs_.end()) return;
  Seq* seq = it->second.get();
  seq->moving = false;
  seq->export_sent = false;
  seq->last_used = absl::Now();
  if (seq->closing) Free(seq, seq->close_reason);
}

absl::Status Sequences::CheckRows(const MovingSequence& m, int layer, int kv, int64_t first, int64_t rows) {
  if (layer < 0 || layer >= m.shape.layers) {
    return Invalid("layer", absl::StrCat("must be 0..", m.shape.layers - 1, ", got ", layer));
  }
  if (kv != 0 && kv != 1) return Invalid("kv", absl::StrCat("must be 0 (K) or 1 (V), got ", kv));
  if (first < 0 || rows < 0 || first + rows > m.lengths[layer]) {
    return Invalid("first_token", absl::StrCat("rows [", first, ", ", first + rows, ") are not within layer ", layer,
                                               "'s ", m.lengths[layer], " tokens"));
  }
  return absl::OkStatus();
}

absl::Status Sequences::ReadRows(const MovingSequence& m, int layer, int kv, int64_t first, int64_t rows,
                                 uint8_t* dst) {
  ATTND_RETURN_IF_ERROR(CheckRows(m, layer, kv, first, rows));
  if (rows == 0) return absl::OkStatus();
  return backend_->CopyKvRows(*m.pool, m.pages, layer, kv, first, rows, /*to_host=*/true, dst);
}

absl::Status Sequences::WriteRows(const MovingSequence& m, int layer, int kv, int64_t first, int64_t rows,
                                  const uint8_t* src) {
  const absl::Span<const uint8_t> whole(src, static_cast<size_t>(std::max<int64_t>(rows, 0)) * m.row_bytes());
  return WriteRows(m, layer, kv, first, rows, HostPieces(&whole, 1));
}

absl::Status Sequences::WriteRows(const MovingSequence& m, int layer, int kv, int64_t first, int64_t rows,
                                  HostPieces src) {
  ATTND_RETURN_IF_ERROR(CheckRows(m, layer, kv, first, rows));
  if (rows == 0) return absl::OkStatus();
  uint64_t bytes = 0;
  for (const absl::Span<const uint8_t>& p : src) bytes += p.size();
  if (bytes != static_cast<uint64_t>(rows) * m.row_bytes()) {
    return Invalid("data", absl::StrCat(bytes, " bytes for ", rows, " rows of ", m.row_bytes(), " bytes"));
  }
  return backend_->WriteKvRows(*m.pool, m.pages, layer, kv, first, rows, src);
}

namespace {

// What the importer can check of an exporter's pool without opening it (the backend checks the pool's size against
// the allocation it opens): a page size a pool may have, and a page of the pool for every page of the rows.
absl::Status CheckPoolPages(const MovingSequence& m, const DeviceRows& rows) {
  const int tokens = rows.pool_page_tokens;
  if (tokens < 16 || tokens > 256 || (tokens & (tokens - 1)) != 0) {
    return Invalid("chunk.device_rows.pool.page_tokens", absl::StrCat("must be a power of two from 16 to 256, got ",
                                                                      tokens));
  }
  if (rows.pool_num_pages < 1) {
    return Invalid("chunk.device_rows.pool.num_pages", absl::StrCat("must be >= 1, got ", rows.pool_num_pages));
  }
  const int64_t longest = *std::max_element(m.lengths.begin(), m.lengths.end());
  const int64_t needed = (longest + tokens - 1) / tokens;
  if (static_cast<int64_t>(rows.pool_pages.size()) != needed) {
    return Invalid("chunk.device_rows.pool.pages",
                   absl::StrCat(rows.pool_pages.size(), " pages, the header's longest layer (", longest,
                                " tokens) takes ", needed, " of ", tokens, " tokens"));
  }
  for (size_t i = 0; i < rows.pool_pages.size(); ++i) {
    if (rows.pool_pages[i] < 0 || rows.pool_pages[i] >= rows.pool_num_pages) {
      return Invalid(absl::StrCat("chunk.device_rows.pool.pages[", i, "]"),
                     absl::StrCat("must be 0..", rows.pool_num_pages - 1, " (pool.num_pages), got ",
                                  rows.pool_pages[i]));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<DeviceRows> Sequences::ExportOnDevice(const MovingSequence& m, bool peer,
                                                     std::shared_ptr<void>* hold) {
  if (!options_.device_moves) {
    return absl::FailedPreconditionError(
        "device: this server moves sequences by bytes only (--sequence_device_moves=false)");
  }
  return backend_->ExportKvRowsOnDevice(*m.pool, m.pages, m.lengths, ExportSharesPool(peer), hold);
}

bool Sequences::ExportSharesPool(bool peer) const {
  const SharePool share = options_.device_moves_share_pool;
  return share == SharePool::kAlways || (share == SharePool::kPeers && peer);
}

absl::Status Sequences::ImportOnDevice(const MovingSequence& m, const DeviceRows& rows) {
  if (!options_.device_moves) {
    return absl::FailedPreconditionError(
        "chunk.device_rows: this server moves sequences by bytes only (--sequence_device_moves=false)");
  }
  if (rows.bytes != m.total_bytes()) {
    return Invalid("chunk.device_rows.bytes", absl::StrCat(rows.bytes, " bytes, the header's lengths need ",
                                                            m.total_bytes(), " (2 x their sum x ", m.row_bytes(),
                                                            " bytes a row)"));
  }
  if (rows.from_pool) ATTND_RETURN_IF_ERROR(CheckPoolPages(m, rows));
  return backend_->ImportKvRowsOnDevice(*m.pool, m.pages, m.lengths, rows);
}

absl::StatusOr<MovingSequence> Sequences::BeginImport(const std::string& owner, const ImportArgs& header) {
  if (header.open.count > 1) return Invalid("sequence.count", "an import opens one sequence");
  absl::StatusOr<std::pair<SequenceShape, int64_t>> checked = CheckOpen(header.open);
  if (!checked.ok()) return checked.status();
  const auto& [shape, max_tokens] = *checked;
  if (header.lengths.size() != static_cast<size_t>(shape.layers)) {
    return Invalid("sequence.lengths", absl::StrCat(header.lengths.size(), " lengths for ", shape.layers, " layers"));
  }
  int64_t longest = 0;
  for (size_t l = 0; l < header.lengths.size(); ++l) {
    if (header.lengths[l] < 0 || header.lengths[l] > max_tokens) {
      return Invalid(absl::StrCat("sequence.lengths[", l, "]"),
                     absl::StrCat("must be 0..", max_tokens, " (the sequence's max_tokens), got ", header.lengths[l]));
    }
    longest = std::max(longest, header.lengths[l]);
  }
  absl::MutexLock lock(&mu_);
  AwaitPoolFor(shape);
  ATTND_RETURN_IF_ERROR(TakesNewSequences());
  ATTND_RETURN_IF_ERROR(CheckClientSequences(owner, 1));
  absl::StatusOr<Pool*> pool = PoolFor(shape);
  if (!pool.ok()) return pool.status();
  const uint64_t needed = static_cast<uint64_t>(CeilDiv(longest, options_.page_tokens));
  if (needed > (*pool)->free.size()) {
    absl::Status full = PoolFull(**pool, needed, "the import");
    if ((*pool)->sequences == 0) pools_.erase(shape);  // a pool made for this import alone goes again
    return full;
  }
  Seq* seq = AddSequence(owner, *pool, max_tokens, absl::Now());
  seq->moving = true;
  for (uint64_t i = 0; i < needed; ++i) {
    absl::StatusOr<int32_t> page = TakePage(**pool, owner);
    if (!page.ok()) {
      Free(seq, "its import was refused");
      return page.status();
    }
    seq->pages.push_back(*page);
  }
  seq->lengths.assign(header.lengths.begin(), header.lengths.end());
  MovingSequence m;
  m.sequence_id = seq->id;
  m.shape = shape;
  m.max_tokens = max_tokens;
  m.lengths = header.lengths;
  m.pool = (*pool)->memory;
  m.pages = seq->pages;
  return m;
}

absl::StatusOr<OpenedSequences> Sequences::EndImport(const MovingSequence& m, bool ok) {
  absl::MutexLock lock(&mu_);
  auto it = seqs_.find(m.sequence_id);
  if (it == seqs_.end()) return absl::InternalError("import: the held sequence is gone");
  Seq* seq = it->second.get();
  if (!ok || seq->closing || stopping_) {
    // Its id was never answered, so nobody else can have named it: it goes without a tombstone's reason to show.
    Free(seq, "its import did not complete");
    return absl::AbortedError("import: the sequence was not completed and is freed");
  }
  seq->moving = false;
  seq->last_used = absl::Now();
  OpenedSequences opened;
  opened.sequence_ids.push_back(seq->id);
  opened.max_tokens = seq->max_tokens;
  opened.page_tokens = options_.page_tokens;
  return opened;
}

}  // namespace attnd::server
