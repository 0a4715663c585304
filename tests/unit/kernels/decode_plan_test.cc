// attnd::kernels::decode's plan on the host: every bad layout is rejected with a status naming its field, and
// the split heuristic's decisions. No GPU: the SM count is given in the options, so no device is queried.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "attnd/kernels/decode.h"
#include "decode/tile_size_decode.h"

namespace attnd::kernels::decode {
namespace {

constexpr int kH200Sms = 132;

BatchLayout Contiguous(int batch, int q_len, int q_heads, int kv_heads, int head_dim, int capacity) {
  BatchLayout l;
  l.batch = batch;
  l.q_len = q_len;
  l.q_heads = q_heads;
  l.kv_heads = kv_heads;
  l.head_dim = head_dim;
  l.scale = DefaultScale(head_dim);
  l.q = l.o = ContiguousStrides(q_len, q_heads, head_dim);
  l.kv_storage = KvStorage::kContiguous;
  l.k = l.v = ContiguousStrides(capacity, kv_heads, head_dim);
  l.kv_capacity = capacity;
  return l;
}

BatchLayout Paged(int batch, int q_len, int q_heads, int kv_heads, int head_dim, int page_size, int num_pages,
                  int max_pages_per_seq) {
  BatchLayout l = Contiguous(batch, q_len, q_heads, kv_heads, head_dim, 1);
  l.kv_storage = KvStorage::kPaged;
  l.kv_capacity = 0;
  l.k = l.v = ContiguousStrides(page_size, kv_heads, head_dim);  // (page, row, head)
  l.paged = PagedKv{page_size, num_pages, max_pages_per_seq};
  return l;
}

DecodeOptions H200() {
  DecodeOptions o;
  o.sm_count = kH200Sms;
  return o;
}

// Plans `l` and expects INVALID_ARGUMENT whose message starts with `field` followed by ": ".
void ExpectRejected(const BatchLayout& l, const std::vector<int32_t>& lens, const std::vector<int32_t>& table,
                    const std::string& field, const DecodeOptions& options = H200()) {
  absl::StatusOr<DecodePlan> plan = MakeDecodePlan(l, lens, table, options);
  ASSERT_FALSE(plan.ok()) << field;
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument) << plan.status();
  EXPECT_TRUE(absl::StartsWith(plan.status().message(), field + ": ")) << "expected " << field << ", got "
                                                                       << plan.status();
}

TEST(DecodePlanValidation, AcceptsGoodLayouts) {
  EXPECT_TRUE(MakeDecodePlan(Contiguous(2, 1, 32, 8, 128, 4096), {4096, 1}, {}, H200()).ok());
  BatchLayout paged = Paged(2, 4, 16, 2, 64, 16, 10, 4);
  EXPECT_TRUE(MakeDecodePlan(paged, {64, 17}, {0, 1, 2, 3, 9, 8, -1, -1}, H200()).ok());
  paged.mask = Mask::kCausalBottomRight;
  EXPECT_TRUE(MakeDecodePlan(paged, {64, 0}, {0, 1, 2, 3, -1, -1, -1, -1}, H200()).ok());
}

TEST(DecodePlanValidation, NamesTheBadLayoutField) {
  const std::vector<int32_t> lens = {100, 200};
  auto base = [] { return Contiguous(2, 1, 8, 2, 128, 256); };
  BatchLayout l = base();
  l.batch = 0;
  ExpectRejected(l, {}, {}, "layout.batch");
  l = base();
  l.q_len = 0;
  ExpectRejected(l, lens, {}, "layout.q_len");
  l.q_len = 17;
  ExpectRejected(l, lens, {}, "layout.q_len");
  l = base();
  l.q_heads = 7;
  ExpectRejected(l, lens, {}, "layout.q_heads");
  l = base();
  l.kv_heads = 0;
  ExpectRejected(l, lens, {}, "layout.kv_heads");
  l = base();
  l.head_dim = 96;
  ExpectRejected(l, lens, {}, "layout.head_dim");
  l = base();
  l.mask = Mask::kCausalTopLeft;
  ExpectRejected(l, lens, {}, "layout.mask");
  l = base();
  l.scale = std::numeric_limits<float>::quiet_NaN();
  ExpectRejected(l, lens, {}, "layout.scale");
  l = base();
  l.k.seq = 260;  // not a multiple of 8
  ExpectRejected(l, lens, {}, "layout.k.seq");
  l = base();
  l.v.head = -8;
  ExpectRejected(l, lens, {}, "layout.v.head");
  l = base();
  l.q.batch = 4;
  ExpectRejected(l, lens, {}, "layout.q.batch");
  l = base();
  l.o.seq = 12;
  ExpectRejected(l, lens, {}, "layout.o.seq");
  l = base();
  l.kv_capacity = 0;
  ExpectRejected(l, lens, {}, "layout.kv_capacity");
}

TEST(DecodePlanValidation, NamesTheBadLengthOrTableEntry) {
  const BatchLayout c = Contiguous(2, 1, 8, 2, 128, 256);
  ExpectRejected(c, {100}, {}, "kv_lens");                // one length for a batch of two
  ExpectRejected(c, {100, -1}, {}, "kv_lens[1]");
  ExpectRejected(c, {100, 257}, {}, "kv_lens[1]");        // over kv_capacity
  ExpectRejected(c, {100, 100}, {0, 1}, "block_table");  // a table for contiguous KV

  // Paged: 3 pages of 16 per sequence, 5 pages in the pool.
  const BatchLayout p = Paged(2, 1, 8, 2, 128, 16, 5, 3);
  ExpectRejected(p, {16, 16}, {0, 1, 2}, "block_table");           // wrong size
  ExpectRejected(p, {16, 49}, {0, 1, 2, 3, 4, 0}, "kv_lens[1]");   // 49 keys > 3 x 16
  ExpectRejected(p, {16, 33}, {0, 1, 2, 3, 4, 5}, "block_table[1][2]");  // page 5 of 5
  ExpectRejected(p, {40, 1}, {0, -1, 2, 3, 4, 4}, "block_table[0][1]");
  // Entries past a sequence's length are not looked at (they may be anything, e.g. -1).
  EXPECT_TRUE(MakeDecodePlan(p, {16, 17}, {4, -1, 99, 3, 2, -7}, H200()).ok());

  BatchLayout bad = p;
  bad.paged.page_size = 48;
  ExpectRejected(bad, {16, 16}, {0, 1, 2, 3, 4, 0}, "layout.paged.page_size");
  bad.paged.page_size = 8;
  ExpectRejected(bad, {16, 16}, {0, 1, 2, 3, 4, 0}, "layout.paged.page_size");
  bad.paged.page_size = 512;
  ExpectRejected(bad, {16, 16}, {0, 1, 2, 3, 4, 0}, "layout.paged.page_size");
  bad = p;
  bad.paged.num_pages = 0;
  ExpectRejected(bad, {16, 16}, {0, 1, 2, 3, 4, 0}, "layout.paged.num_pages");
  bad = p;
  bad.paged.max_pages_per_seq = 0;
  ExpectRejected(bad, {16, 16}, {}, "layout.paged.max_pages_per_seq");
}

TEST(DecodePlanValidation, AFusedAppendNeedsRowStridesAndAtLeastQLenKeys) {
  BatchLayout l = Paged(2, 4, 8, 2, 128, 16, 5, 3);
  l.mask = Mask::kCausalBottomRight;
  l.append = true;
  l.new_k = l.new_v = ContiguousStrides(4, 2, 128);
  const std::vector<int32_t> table = {0, 1, 2, 3, 4, 0};
  EXPECT_TRUE(MakeDecodePlan(l, {4, 40}, table, H200()).ok());
  ExpectRejected(l, {40, 3}, table, "kv_lens[1]");  // 3 keys cannot end in 4 new rows
  BatchLayout bad = l;
  bad.new_k.seq = 100;
  ExpectRejected(bad, {4, 40}, table, "layout.new_k.seq");
  bad = l;
  bad.new_v.head = -8;
  ExpectRejected(bad, {4, 40}, table, "layout.new_v.head");
  // Without append the same lengths are fine: a row that sees no key is 0.
  l.append = false;
  EXPECT_TRUE(MakeDecodePlan(l, {40, 3}, table, H200()).ok());
}

TEST(DecodePlanValidation, NamesTheBadOption) {
  const BatchLayout l = Contiguous(1, 1, 8, 2, 128, 256);
  DecodeOptions o = H200();
  o.num_splits = -1;
  ExpectRejected(l, {10}, {}, "options.num_splits", o);
  o = H200();
  o.sm_count = -2;
  ExpectRejected(l, {10}, {}, "options.sm_count", o);
  o = H200();
  o.min_split_keys = 0;
  ExpectRejected(l, {10}, {}, "options.min_split_keys", o);
  o = H200();
  o.target_blocks_per_sm = -1;
  ExpectRejected(l, {10}, {}, "options.target_blocks_per_sm", o);
}

int64_t Blocks(const DecodePlan& plan, const std::vector<int32_t>& lens) {
  int64_t splits = 0;
  for (int32_t len : lens) {
    const int64_t n = (len + plan.split_keys - 1) / plan.split_keys;
    splits += std::max<int64_t>(1, std::min<int64_t>(n, plan.max_splits));
  }
  return splits * plan.layout.kv_heads * plan.m_blocks;
}

TEST(DecodeSplitHeuristic, SplitsASmallBatchAcrossTheGpu) {
  // 1 x 32k, 32 q heads : 8 kv heads: 8 blocks unsplit; the heuristic fills about the tile's blocks per SM.
  const std::vector<int32_t> lens = {32768};
  absl::StatusOr<DecodePlan> plan = MakeDecodePlan(Contiguous(1, 1, 32, 8, 128, 32768), lens, {}, H200());
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->row_block, 16);
  EXPECT_EQ(plan->m_blocks, 1);
  EXPECT_GT(plan->max_splits, 1);
  EXPECT_EQ(plan->split_keys % plan->block_n, 0);
  EXPECT_GE(plan->split_keys, DecodeOptions{}.min_split_keys);
  const int target = DecodeBlocksPerSm(128, false);
  EXPECT_GE(2 * Blocks(*plan, lens), target * kH200Sms);
  EXPECT_LE(Blocks(*plan, lens), target * kH200Sms);
  EXPECT_GT(plan->workspace_bytes, 0u);
}

TEST(DecodeSplitHeuristic, LeavesAFullBatchUnsplit) {
  // 128 x 8k with 8 kv heads: 1024 blocks already cover 132 SMs several times.
  const std::vector<int32_t> lens(128, 8192);
  absl::StatusOr<DecodePlan> plan = MakeDecodePlan(Contiguous(128, 1, 64, 8, 128, 8192), lens, {}, H200());
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->max_splits, 1);
  EXPECT_EQ(plan->workspace_bytes, 0u);
}

TEST(DecodeSplitHeuristic, UniformBatchesFillOneWaveOfResidentBlocks) {
  // Decode rows with 32 : 8 heads, q_len 1: at most the tile's blocks per SM, and at least half of that.
  const int target = DecodeBlocksPerSm(128, false);
  const int rows[][2] = {{64, 4096}, {8, 32768}, {2, 131072}, {1, 32768}, {16, 4096}, {1, 8192}};
  for (const auto& r : rows) {
    const std::vector<int32_t> lens(r[0], r[1]);
    absl::StatusOr<DecodePlan> plan = MakeDecodePlan(Contiguous(r[0], 1, 32, 8, 128, r[1]), lens, {}, H200());
    ASSERT_TRUE(plan.ok()) << plan.status();
    if (r[0] * 8 >= target * kH200Sms) {  // already a full wave unsplit
      EXPECT_EQ(plan->max_splits, 1) << r[0] << " x " << r[1];
      continue;
    }
    EXPECT_LE(Blocks(*plan, lens), target * kH200Sms) << r[0] << " x " << r[1];
    EXPECT_GE(2 * Blocks(*plan, lens), target * kH200Sms) << r[0] << " x " << r[1];
    // Equal splits: the last one is not a short remainder.
    EXPECT_GT(r[1] - (plan->max_splits - 1) * plan->split_keys, plan->split_keys - plan->block_n);
  }
}

TEST(DecodeSplitHeuristic, EachTileFillsTheBlocksPerSmItStreamsWith) {
  // 1 x 32k at d128: 16-bit blocks one an SM, float8 blocks (conversions between the loads) two; the option
  // overrides the tile's.
  const std::vector<int32_t> lens = {32768};
  const BatchLayout bf16 = Contiguous(1, 1, 32, 8, 128, 32768);
  BatchLayout fp8 = bf16;
  fp8.kv_format = KvFormat::kFp8E4M3;
  absl::StatusOr<DecodePlan> one = MakeDecodePlan(bf16, lens, {}, H200());
  absl::StatusOr<DecodePlan> two = MakeDecodePlan(fp8, lens, {}, H200());
  ASSERT_TRUE(one.ok() && two.ok());
  EXPECT_LE(Blocks(*one, lens), kH200Sms);
  EXPECT_GT(Blocks(*two, lens), kH200Sms);
  EXPECT_LE(Blocks(*two, lens), 2 * kH200Sms);
  DecodeOptions o = H200();
  o.target_blocks_per_sm = 2;
  absl::StatusOr<DecodePlan> forced = MakeDecodePlan(bf16, lens, {}, o);
  ASSERT_TRUE(forced.ok()) << forced.status();
  EXPECT_EQ(forced->max_splits, two->max_splits);
}

TEST(DecodeSplitHeuristic, SplitsOnlyTheLongSequencesOfARaggedBatch) {
  const std::vector<int32_t> lens = {1, 32768, 17, 4096};
  absl::StatusOr<DecodePlan> plan = MakeDecodePlan(Contiguous(4, 1, 32, 8, 128, 32768), lens, {}, H200());
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_GT(plan->max_splits, 1);
  EXPECT_GE(plan->split_keys, 17);  // the short sequences stay in one split
  EXPECT_EQ((32768 + plan->split_keys - 1) / plan->split_keys, plan->max_splits);
}

TEST(DecodeSplitHeuristic, FewerSmsMeanFewerSplits) {
  const std::vector<int32_t> lens = {32768};
  DecodeOptions small = H200();
  small.sm_count = 20;
  absl::StatusOr<DecodePlan> a = MakeDecodePlan(Contiguous(1, 1, 32, 8, 128, 32768), lens, {}, H200());
  absl::StatusOr<DecodePlan> b = MakeDecodePlan(Contiguous(1, 1, 32, 8, 128, 32768), lens, {}, small);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_LT(b->max_splits, a->max_splits);
}

TEST(DecodeSplitHeuristic, TheOptionOverridesIt) {
  const std::vector<int32_t> lens = {1000, 3000};
  DecodeOptions o = H200();
  o.num_splits = 1;
  absl::StatusOr<DecodePlan> one = MakeDecodePlan(Contiguous(2, 4, 8, 2, 64, 4096), lens, {}, o);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->max_splits, 1);
  EXPECT_EQ(one->workspace_bytes, 0u);
  EXPECT_EQ(one->counter_bytes, 0u);
  o.num_splits = 5;
  absl::StatusOr<DecodePlan> five = MakeDecodePlan(Contiguous(2, 4, 8, 2, 64, 4096), lens, {}, o);
  ASSERT_TRUE(five.ok()) << five.status();
  EXPECT_EQ(five->max_splits, 5);
  EXPECT_EQ(five->split_keys % five->block_n, 0);
  // O partials of every (sequence, split, position, q head) in fp32, then one LSE each.
  const size_t rows = 2 * 5 * 4 * 8;
  EXPECT_GE(five->workspace_bytes, rows * 64 * 4 + rows * 4);
  EXPECT_LE(five->workspace_bytes, rows * 64 * 4 + rows * 4 + 256);
  // 16 rows x 5 splits x 64 x 4 bytes = 20 KB of partials per block: merged in the kernel, with one counter per
  // (sequence, kv head, row block): 2 x 2 x 1 (a group of 4 x q_len 4 fills one 16-row block).
  EXPECT_EQ(five->m_blocks, 1);
  EXPECT_TRUE(five->merge_in_kernel);
  EXPECT_EQ(five->counter_bytes, 2u * 2 * 1 * sizeof(int32_t));
  // Above the option's bytes the merge kernel does it, without counters.
  o.max_fused_merge_bytes = 16 * 5 * 64 * 4 - 1;
  absl::StatusOr<DecodePlan> kernel = MakeDecodePlan(Contiguous(2, 4, 8, 2, 64, 4096), lens, {}, o);
  ASSERT_TRUE(kernel.ok()) << kernel.status();
  EXPECT_FALSE(kernel->merge_in_kernel);
  EXPECT_EQ(kernel->counter_bytes, 0u);
  EXPECT_EQ(kernel->workspace_bytes, five->workspace_bytes);
}

TEST(DecodeSplitHeuristic, RowBlocksCoverTheGroupTimesQLen) {
  struct Want {
    int q_heads, kv_heads, q_len, row_block, m_blocks;
  };
  for (const Want& w : {Want{8, 8, 1, 16, 1}, Want{32, 8, 4, 16, 1}, Want{64, 8, 4, 32, 1}, Want{32, 8, 16, 64, 1},
                        Want{128, 8, 16, 64, 4}, Want{16, 1, 16, 64, 4}, Want{16, 1, 3, 64, 1}}) {
    absl::StatusOr<DecodePlan> plan =
        MakeDecodePlan(Contiguous(1, w.q_len, w.q_heads, w.kv_heads, 128, 64), {64}, {}, H200());
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(plan->rows, w.q_heads / w.kv_heads * w.q_len);
    EXPECT_EQ(plan->row_block, w.row_block) << w.q_heads << ":" << w.kv_heads << " q_len " << w.q_len;
    EXPECT_EQ(plan->m_blocks, w.m_blocks) << w.q_heads << ":" << w.kv_heads << " q_len " << w.q_len;
  }
}

TEST(AppendPlanValidation, ChecksTheRowsLandInsideTheCache) {
  const Strides rows = ContiguousStrides(2, 2, 64);
  const BatchLayout c = Contiguous(2, 1, 4, 2, 64, 100);
  EXPECT_TRUE(MakeAppendPlan(c, 2, rows, rows, {0, 98}).ok());
  absl::StatusOr<AppendPlan> over = MakeAppendPlan(c, 2, rows, rows, {0, 99});
  ASSERT_FALSE(over.ok());
  EXPECT_TRUE(absl::StartsWith(over.status().message(), "kv_lens[1]: ")) << over.status();
  absl::StatusOr<AppendPlan> none = MakeAppendPlan(c, 0, rows, rows, {0, 0});
  ASSERT_FALSE(none.ok());
  EXPECT_TRUE(absl::StartsWith(none.status().message(), "new_len: ")) << none.status();
  Strides odd = rows;
  odd.seq = 3;
  absl::StatusOr<AppendPlan> bad_stride = MakeAppendPlan(c, 1, odd, rows, {0, 0});
  ASSERT_FALSE(bad_stride.ok());
  EXPECT_TRUE(absl::StartsWith(bad_stride.status().message(), "new_k.seq: ")) << bad_stride.status();

  // Paged: only the pages the new rows land in are checked.
  const BatchLayout p = Paged(2, 1, 4, 2, 64, 16, 4, 2);
  EXPECT_TRUE(MakeAppendPlan(p, 2, rows, rows, {16, 0}, {-1, 3, 2, -1}).ok());  // rows 16, 17: page 1
  absl::StatusOr<AppendPlan> bad_page = MakeAppendPlan(p, 2, rows, rows, {14, 0}, {7, 3, 2, -1});
  ASSERT_FALSE(bad_page.ok());
  EXPECT_TRUE(absl::StartsWith(bad_page.status().message(), "block_table[0][0]: ")) << bad_page.status();
}

TEST(GatherPlanValidation, ChecksPagedStorageCapacityAndEveryPageRead) {
  const Strides out = ContiguousStrides(40, 2, 64);
  const BatchLayout p = Paged(2, 1, 4, 2, 64, 16, 4, 3);
  EXPECT_TRUE(MakeGatherPlan(p, 40, out, out, {40, 0}, {0, 3, 2, -1, -1, -1}).ok());
  // Unlike an append, a gather reads every page from the first: all of them must exist.
  absl::StatusOr<GatherPlan> bad_page = MakeGatherPlan(p, 40, out, out, {40, 0}, {0, 4, 2, -1, -1, -1});
  ASSERT_FALSE(bad_page.ok());
  EXPECT_TRUE(absl::StartsWith(bad_page.status().message(), "block_table[0][1]: ")) << bad_page.status();
  absl::StatusOr<GatherPlan> over = MakeGatherPlan(p, 32, out, out, {0, 33}, {0, 0, 0, 1, 2, 3});
  ASSERT_FALSE(over.ok());
  EXPECT_TRUE(absl::StartsWith(over.status().message(), "kv_lens[1]: ")) << over.status();
  absl::StatusOr<GatherPlan> no_capacity = MakeGatherPlan(p, 0, out, out, {0, 0}, {0, 0, 0, 0, 0, 0});
  ASSERT_FALSE(no_capacity.ok());
  EXPECT_TRUE(absl::StartsWith(no_capacity.status().message(), "capacity: ")) << no_capacity.status();
  // The kernel indexes a sequence's 16-byte chunks in 32 bits: 2 kv heads x 8 chunks = 16 a row, 2^27 rows.
  absl::StatusOr<GatherPlan> huge = MakeGatherPlan(p, (1 << 27) + 1, out, out, {0, 0}, {0, 0, 0, 0, 0, 0});
  ASSERT_FALSE(huge.ok());
  EXPECT_TRUE(absl::StartsWith(huge.status().message(), "capacity: ")) << huge.status();
  absl::StatusOr<GatherPlan> longest = MakeGatherPlan(p, 40, out, out, {17, 33}, {0, 3, 0, 1, 2, 0});
  ASSERT_TRUE(longest.ok()) << longest.status();
  EXPECT_EQ(longest->max_kv_len, 33);
  Strides odd = out;
  odd.head = 60;
  absl::StatusOr<GatherPlan> bad_stride = MakeGatherPlan(p, 40, out, odd, {1, 1}, {0, 0, 0, 0, 0, 0});
  ASSERT_FALSE(bad_stride.ok());
  EXPECT_TRUE(absl::StartsWith(bad_stride.status().message(), "out_v.head: ")) << bad_stride.status();
  absl::StatusOr<GatherPlan> contiguous = MakeGatherPlan(Contiguous(2, 1, 4, 2, 64, 40), 40, out, out, {1, 1}, {});
  ASSERT_FALSE(contiguous.ok());
  EXPECT_TRUE(absl::StartsWith(contiguous.status().message(), "cache.kv_storage: ")) << contiguous.status();
}

}  // namespace
}  // namespace attnd::kernels::decode
