// The vocabulary of KV sequences that a backend sees (docs/sequences.md): the page pool of one sequence shape
// (KvPool, memory the backend owns) and one Step request resolved against the sequences' page tables (StepJob).
// The bookkeeping itself — which pages a sequence holds, its lengths, forks, ownership, expiry — is the core's
// (sequences.h); a backend only reads and writes pages where a job tells it to.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/hash/hash.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "attnd/problem.h"

namespace attnd::server {

// What a sequence caches; fixed for its life.
struct SequenceShape {
  int layers = 0;
  int kv_heads = 0;
  int head_dim = 0;
  DType dtype = DType::kBF16;  // of Q, O and the rows a step appends
  KvFormat kv_format = KvFormat::kAsDtype;
  // Float8 only: [layers * kv_heads] fp32 descales of K and of V, layer-major (empty otherwise). Part of the shape, so
  // that the sequences of one pool share them: a batched launch takes one descale per kv head.
  std::vector<float> k_descale, v_descale;

  // Bytes of one cached element of K or V.
  uint64_t kv_bytes() const { return kv_format == KvFormat::kFp8E4M3 ? 1 : static_cast<uint64_t>(DTypeBytes(dtype)); }
  // Elements of one page of one layer's K (or V): [page_tokens, kv_heads, head_dim].
  int64_t page_elems(int page_tokens) const { return int64_t{page_tokens} * kv_heads * head_dim; }
  // Bytes one page holds over every layer, K and V.
  uint64_t page_bytes(int page_tokens) const {
    return static_cast<uint64_t>(page_elems(page_tokens)) * kv_bytes() * 2 * static_cast<uint64_t>(layers);
  }
  // Bytes of one cached row (one token of one layer's K or V).
  uint64_t row_bytes() const { return static_cast<uint64_t>(kv_heads) * static_cast<uint64_t>(head_dim) * kv_bytes(); }
  friend bool operator==(const SequenceShape& a, const SequenceShape& b) {
    return a.layers == b.layers && a.kv_heads == b.kv_heads && a.head_dim == b.head_dim && a.dtype == b.dtype &&
           a.kv_format == b.kv_format && a.k_descale == b.k_descale && a.v_descale == b.v_descale;
  }
  template <typename H>
  friend H AbslHashValue(H h, const SequenceShape& s) {
    return H::combine(std::move(h), s.layers, s.kv_heads, s.head_dim, static_cast<int>(s.dtype),
                      static_cast<int>(s.kv_format), s.k_descale, s.v_descale);
  }
};

// The pages of one shape, in the backend's memory (device memory on CUDA, host memory on the CPU backend).
// One allocation, laid out so that every layer's K (and V) is a page pool the paged decode kernels read
// directly (attnd/kernels/decode.h, KvStorage::kPaged): layer l's K pages start at element (2 l) * num_pages *
// page_elems, its V pages at (2 l + 1) * num_pages * page_elems; page p of a pool holds [page_tokens, kv_heads,
// head_dim]. A page index means the same page at every layer, so a sequence has one page table for all layers.
class KvPool {
 public:
  KvPool(const SequenceShape& shape, int page_tokens, int32_t num_pages)
      : shape_(shape), page_tokens_(page_tokens), num_pages_(num_pages) {}
  virtual ~KvPool() = default;
  KvPool(const KvPool&) = delete;
  KvPool& operator=(const KvPool&) = delete;

  const SequenceShape& shape() const { return shape_; }
  int page_tokens() const { return page_tokens_; }
  int32_t num_pages() const { return num_pages_; }
  // Element offset of layer `layer`'s K (kv = 0) or V (kv = 1) pool from the allocation's start.
  int64_t pool_offset(int layer, int kv) const {
    return (int64_t{2} * layer + kv) * num_pages_ * shape_.page_elems(page_tokens_);
  }

 private:
  const SequenceShape shape_;
  const int page_tokens_;
  const int32_t num_pages_;
};

// Rows [first, first + rows) of one layer's K (kv 0) or V (kv 1) of a sequence whose page table is `pages`, as the
// runs of consecutive rows within one page: fn(byte offset from the pool's start, bytes, byte offset in the rows).
// What moving a sequence copies (Backend::CopyKvRows); the pages must cover the rows.
template <typename Fn>
void ForEachKvRowRun(const KvPool& pool, absl::Span<const int32_t> pages, int layer, int kv, int64_t first,
                     int64_t rows, Fn fn) {
  const SequenceShape& shape = pool.shape();
  const int64_t page = pool.page_tokens();
  const uint64_t elem = shape.kv_bytes();
  const uint64_t row_bytes = shape.row_bytes();
  const uint64_t base = static_cast<uint64_t>(pool.pool_offset(layer, kv)) * elem;
  for (int64_t t = first; t < first + rows;) {
    const int64_t in_page = t % page, run = std::min(page - in_page, first + rows - t);
    const uint64_t at = base + static_cast<uint64_t>(pages[t / page]) * shape.page_elems(pool.page_tokens()) * elem +
                        static_cast<uint64_t>(in_page) * row_bytes;
    fn(at, static_cast<uint64_t>(run) * row_bytes, static_cast<uint64_t>(t - first) * row_bytes);
    t += run;
  }
}

// Host bytes in pieces, in order: an imported chunk's rows where they lie in the message's slices.
using HostPieces = absl::Span<const absl::Span<const uint8_t>>;

// Copies bytes out of pieces front to back: each Read continues where the last one ended.
class PieceReader {
 public:
  explicit PieceReader(HostPieces pieces) : pieces_(pieces) {}
  // The next n bytes into dst; false (with what there was copied) when the pieces hold fewer.
  bool Read(uint8_t* dst, uint64_t n) {
    while (n > 0) {
      if (index_ == pieces_.size()) return false;
      const absl::Span<const uint8_t> p = pieces_[index_];
      const uint64_t run = std::min<uint64_t>(n, p.size() - offset_);
      std::memcpy(dst, p.data() + offset_, run);
      dst += run;
      n -= run;
      offset_ += run;
      if (offset_ == p.size()) ++index_, offset_ = 0;
    }
    return true;
  }

 private:
  const HostPieces pieces_;
  size_t index_ = 0;
  uint64_t offset_ = 0;
};

// Copy-on-write: page `from`, every layer's K and V, into page `to`, before the step writes anything.
struct PageCopy {
  int32_t from = 0, to = 0;
};

// One sequence's part of a step, as the core resolved it when it admitted the step.
struct StepSequence {
  int32_t cached = 0;  // keys cached at the step's layer before the step
  int32_t tokens = 0;  // rows of this sequence in the step's tensors
  // The sequence's page table: covers cached + tokens keys when the step appends, cached keys otherwise. A view of
  // the core's own table, which stays as it is while the step is in flight (a sequence with a step in flight is
  // neither forked, truncated nor freed), so a step copies no table; or, for a step that another may be admitted
  // behind (CallInfo::chain), of the job's copy (StepJob::tables).
  absl::Span<const int32_t> pages;
  // Keys the attention reads: cached + tokens when appending, else cached. Query row r sits at position
  // keys - tokens + r and sees keys [0, that position].
  int32_t keys(bool append) const { return append ? cached + tokens : cached; }
};

}  // namespace attnd::server
