// ForEachPoolToPoolRun, the copy plan of a move that reads an exporter's pool in place: every row of every layer's
// K and V lands where the importer's page table puts it, whatever the two pools' page sizes, each run stays within
// one page on both sides, and nothing else is written.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include "attnd/server/step.h"
#include "gtest/gtest.h"

namespace attnd::server {
namespace {

// Byte offset of row `t` of layer `layer`'s K (kv 0) or V in `pool`, with `pages` its page table, as KvPool says.
uint64_t RowAt(const KvPool& pool, const std::vector<int32_t>& pages, int layer, int kv, int64_t t) {
  const SequenceShape& s = pool.shape();
  const uint64_t page_bytes = static_cast<uint64_t>(s.page_elems(pool.page_tokens())) * s.kv_bytes();
  return static_cast<uint64_t>(pool.pool_offset(layer, kv)) * s.kv_bytes() +
         static_cast<uint64_t>(pages[t / pool.page_tokens()]) * page_bytes +
         static_cast<uint64_t>(t % pool.page_tokens()) * s.row_bytes();
}

std::vector<int32_t> ShuffledPages(int32_t num_pages, size_t count, uint32_t seed) {
  std::vector<int32_t> all(static_cast<size_t>(num_pages));
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), std::mt19937(seed));
  all.resize(count);
  return all;
}

TEST(PoolToPoolRuns, EveryRowLandsInItsPageWhateverThePageSizes) {
  SequenceShape shape;
  shape.layers = 3;
  shape.kv_heads = 2;
  shape.head_dim = 64;
  shape.dtype = DType::kBF16;
  const std::vector<int64_t> lengths = {100, 0, 257};
  const uint64_t row = shape.row_bytes();
  for (const auto& [sp, dp] : std::vector<std::pair<int, int>>{{16, 64}, {64, 16}, {32, 32}, {256, 16}, {16, 256}}) {
    SCOPED_TRACE(testing::Message() << "source pages of " << sp << " tokens, destination pages of " << dp);
    const KvPool src(shape, sp, 40), dst(shape, dp, 30);
    const std::vector<int32_t> src_pages = ShuffledPages(40, (257 + sp - 1) / sp, 1 + sp);
    const std::vector<int32_t> dst_pages = ShuffledPages(30, (257 + dp - 1) / dp, 2 + dp);
    std::vector<uint8_t> from(2 * 3 * 40 * static_cast<uint64_t>(shape.page_elems(sp)) * 2);
    std::vector<uint8_t> to(2 * 3 * 30 * static_cast<uint64_t>(shape.page_elems(dp)) * 2, 0xee);
    // Each source row holds its own tag: (layer, kv, token) in every 4 bytes.
    for (int layer = 0; layer < 3; ++layer) {
      for (int kv = 0; kv < 2; ++kv) {
        for (int64_t t = 0; t < lengths[layer]; ++t) {
          const uint32_t tag = static_cast<uint32_t>((layer * 2 + kv) << 20 | t) + 1;
          for (uint64_t b = 0; b < row; b += 4) std::memcpy(&from[RowAt(src, src_pages, layer, kv, t) + b], &tag, 4);
        }
      }
    }
    const uint64_t src_page_bytes = static_cast<uint64_t>(shape.page_elems(sp)) * 2;
    const uint64_t dst_page_bytes = static_cast<uint64_t>(shape.page_elems(dp)) * 2;
    uint64_t copied = 0;
    ForEachPoolToPoolRun(40, sp, src_pages, dst, dst_pages, lengths, [&](uint64_t f, uint64_t t, uint64_t bytes) {
      ASSERT_EQ(f / src_page_bytes, (f + bytes - 1) / src_page_bytes) << "a run crosses a source page";
      ASSERT_EQ(t / dst_page_bytes, (t + bytes - 1) / dst_page_bytes) << "a run crosses a destination page";
      ASSERT_LE(f + bytes, from.size());
      ASSERT_LE(t + bytes, to.size());
      std::memcpy(&to[t], &from[f], bytes);
      copied += bytes;
    });
    ASSERT_FALSE(HasFatalFailure());
    EXPECT_EQ(copied, 2 * (100 + 0 + 257) * row);
    // The destination as it must be: the fill, and each row's tag where the importer's page table puts it.
    std::vector<uint8_t> expected(to.size(), 0xee);
    for (int layer = 0; layer < 3; ++layer) {
      for (int kv = 0; kv < 2; ++kv) {
        for (int64_t t = 0; t < lengths[layer]; ++t) {
          const uint32_t tag = static_cast<uint32_t>((layer * 2 + kv) << 20 | t) + 1;
          const uint64_t at = RowAt(dst, dst_pages, layer, kv, t);
          for (uint64_t b = 0; b < row; b += 4) std::memcpy(&expected[at + b], &tag, 4);
        }
      }
    }
    EXPECT_TRUE(to == expected);
  }
}

}  // namespace
}  // namespace attnd::server
