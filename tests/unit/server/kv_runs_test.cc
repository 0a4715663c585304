// KvRowAt (attnd/server/kv_rows.h), where a same-host move's copy kernel finds each row, run here on the host as the
// kernel runs it: pool to pool, every row of every layer's K and V lands where the importer's page table puts it
// whatever the two pools' page sizes, and nothing else is written; pool to buffer gathers the rows in the byte
// chunks' order (ForEachKvRowRun's, layer 0 K, layer 0 V, ...), and buffer to pool puts them back.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include "attnd/server/kv_rows.h"
#include "attnd/server/step.h"
#include "gtest/gtest.h"

namespace attnd::server {
namespace {

SequenceShape Shape() {
  SequenceShape shape;
  shape.layers = 3;
  shape.kv_heads = 2;
  shape.head_dim = 64;
  shape.dtype = DType::kBF16;
  return shape;
}

const std::vector<int64_t> kLengths = {100, 0, 257};

// Byte offset of row `t` of layer `layer`'s K (kv 0) or V in `pool`, with `pages` its page table, as KvPool says.
uint64_t RowAt(const KvPool& pool, const std::vector<int32_t>& pages, int layer, int kv, int64_t t) {
  const SequenceShape& s = pool.shape();
  const uint64_t page_bytes = static_cast<uint64_t>(s.page_elems(pool.page_tokens())) * s.kv_bytes();
  return static_cast<uint64_t>(pool.pool_offset(layer, kv)) * s.kv_bytes() +
         static_cast<uint64_t>(pages[t / pool.page_tokens()]) * page_bytes +
         static_cast<uint64_t>(t % pool.page_tokens()) * s.row_bytes();
}

KvRowsSide PoolSide(const KvPool& pool, const std::vector<int32_t>& pages) {
  KvRowsSide side;
  side.pages = pages.data();
  side.page_tokens = pool.page_tokens();
  side.page_bytes = static_cast<uint64_t>(pool.shape().page_elems(pool.page_tokens())) * pool.shape().kv_bytes();
  side.kv_pool_bytes = static_cast<uint64_t>(pool.num_pages()) * side.page_bytes;
  return side;
}

std::vector<int32_t> ShuffledPages(int32_t num_pages, size_t count, uint32_t seed) {
  std::vector<int32_t> all(static_cast<size_t>(num_pages));
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), std::mt19937(seed));
  all.resize(count);
  return all;
}

uint32_t Tag(int layer, int kv, int64_t t) { return static_cast<uint32_t>((layer * 2 + kv) << 20 | t) + 1; }

// What the kernel does, one row at a time.
void CopyRows(const KvRowsSide& from, const KvRowsSide& to, const std::vector<uint8_t>& src, std::vector<uint8_t>& dst,
              uint64_t row) {
  for (int layer = 0; layer < static_cast<int>(kLengths.size()); ++layer) {
    for (int kv = 0; kv < 2; ++kv) {
      for (int64_t t = 0; t < kLengths[layer]; ++t) {
        const uint64_t f = KvRowAt(from, layer, kv, kLengths[layer], t, row);
        const uint64_t d = KvRowAt(to, layer, kv, kLengths[layer], t, row);
        ASSERT_LE(f + row, src.size());
        ASSERT_LE(d + row, dst.size());
        std::memcpy(&dst[d], &src[f], row);
      }
    }
  }
}

// A pool of `num_pages` pages of `page_tokens` with each of the sequence's rows holding its tag in every 4 bytes (the
// rest `fill`), or only the fill.
std::vector<uint8_t> PoolBytes(const KvPool& pool, const std::vector<int32_t>& pages, bool tagged, uint8_t fill) {
  const SequenceShape& s = pool.shape();
  std::vector<uint8_t> bytes(2 * static_cast<uint64_t>(s.layers) * static_cast<uint64_t>(pool.num_pages()) *
                                 static_cast<uint64_t>(s.page_elems(pool.page_tokens())) * s.kv_bytes(),
                             fill);
  if (!tagged) return bytes;
  for (int layer = 0; layer < s.layers; ++layer) {
    for (int kv = 0; kv < 2; ++kv) {
      for (int64_t t = 0; t < kLengths[layer]; ++t) {
        const uint32_t tag = Tag(layer, kv, t);
        const uint64_t at = RowAt(pool, pages, layer, kv, t);
        for (uint64_t b = 0; b < s.row_bytes(); b += 4) std::memcpy(&bytes[at + b], &tag, 4);
      }
    }
  }
  return bytes;
}

TEST(KvRowAt, PoolToPoolEveryRowLandsInItsPageWhateverThePageSizes) {
  const SequenceShape shape = Shape();
  for (const auto& [sp, dp] : std::vector<std::pair<int, int>>{{16, 64}, {64, 16}, {32, 32}, {256, 16}, {16, 256}}) {
    SCOPED_TRACE(testing::Message() << "source pages of " << sp << " tokens, destination pages of " << dp);
    const KvPool src(shape, sp, 40), dst(shape, dp, 30);
    const std::vector<int32_t> src_pages = ShuffledPages(40, (257 + sp - 1) / sp, 1 + sp);
    const std::vector<int32_t> dst_pages = ShuffledPages(30, (257 + dp - 1) / dp, 2 + dp);
    const std::vector<uint8_t> from = PoolBytes(src, src_pages, true, 0x11);
    std::vector<uint8_t> to = PoolBytes(dst, dst_pages, false, 0xee);
    CopyRows(PoolSide(src, src_pages), PoolSide(dst, dst_pages), from, to, shape.row_bytes());
    ASSERT_FALSE(HasFatalFailure());
    EXPECT_TRUE(to == PoolBytes(dst, dst_pages, true, 0xee));
  }
}

TEST(KvRowAt, ABufferHoldsTheRowsInTheByteChunksOrderAndGoesBack) {
  const SequenceShape shape = Shape();
  const uint64_t row = shape.row_bytes();
  const KvPool pool(shape, 16, 40);
  const std::vector<int32_t> pages = ShuffledPages(40, 17, 5);
  const std::vector<uint8_t> from = PoolBytes(pool, pages, true, 0x11);
  // The byte chunks' order, as ForEachKvRowRun gathers it for a move by bytes.
  std::vector<uint8_t> chunks;
  for (int layer = 0; layer < shape.layers; ++layer) {
    for (int kv = 0; kv < 2; ++kv) {
      ForEachKvRowRun(pool, pages, layer, kv, 0, kLengths[layer], [&](uint64_t at, uint64_t bytes, uint64_t) {
        const auto begin = from.begin() + static_cast<int64_t>(at);
        chunks.insert(chunks.end(), begin, begin + static_cast<int64_t>(bytes));
      });
    }
  }
  ASSERT_EQ(chunks.size(), 2 * (100 + 0 + 257) * row);
  std::vector<uint64_t> layer_at = {0, 2 * 100 * row, 2 * 100 * row};
  KvRowsSide buffer;
  buffer.layer_at = layer_at.data();
  std::vector<uint8_t> gathered(chunks.size(), 0xee);
  CopyRows(PoolSide(pool, pages), buffer, from, gathered, row);
  ASSERT_FALSE(HasFatalFailure());
  EXPECT_TRUE(gathered == chunks);
  // And into another pool's pages of another size.
  const KvPool dst(shape, 64, 30);
  const std::vector<int32_t> dst_pages = ShuffledPages(30, 5, 9);
  std::vector<uint8_t> to = PoolBytes(dst, dst_pages, false, 0xee);
  CopyRows(buffer, PoolSide(dst, dst_pages), gathered, to, row);
  ASSERT_FALSE(HasFatalFailure());
  EXPECT_TRUE(to == PoolBytes(dst, dst_pages, true, 0xee));
}

}  // namespace
}  // namespace attnd::server
