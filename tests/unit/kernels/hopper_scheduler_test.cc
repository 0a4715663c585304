// The Hopper family's persistent tile scheduler (kernels/cuda/src/hopper/tile_scheduler_sm90.cuh), on the
// host: every (q_tile, head, batch) tile is run exactly once whatever the grid, long causal problems whose K
// and V fit L2 come longest-first round by round with the boustrophedon rounds keeping the per-block work
// balanced, and short ones and those with more K and V run as balanced pairs of q tiles, head by head.
// A tile the schedule skipped would leave rows of O unwritten; the GPU suite sees that only for its shapes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <cstdint>
#include <numeric>
#include <deque>
#include <queue>
#include <tuple>
#include <vector>

#include "attnd/kernels/attention.h"
#include "hopper/launch_plan_sm90.h"
#include "hopper/tile_scheduler_sm90.cuh"

namespace attnd::kernels::hopper {
namespace {

struct Shape {
  int q_tiles, heads, batch, kv_len, head_dim, group;
  bool causal;
  int grid;
};

// Runs the schedule as the kernel's blocks do; returns per-tile visit counts and per-block causal work.
void Walk(const Shape& s, std::vector<int>& visits, std::vector<int64_t>& work,
          int64_t section_budget = kDefaultSectionBudgetBytes) {
  const SchedulerParams sp =
      MakeSchedulerParams(s.q_tiles, s.heads, s.batch, s.kv_len, s.head_dim, s.group, s.causal, section_budget);
  ASSERT_EQ(sp.total_tiles, s.q_tiles * s.heads * s.batch);
  visits.assign(sp.total_tiles, 0);
  work.assign(s.grid, 0);
  for (int block = 0; block < s.grid; ++block) {
    for (int round = 0, t; (t = TileOfRound(sp, round, block, s.grid)) >= 0; ++round) {
      ASSERT_LT(t, sp.total_tiles);
      const TileCoord c = TileAt(sp, t);
      ASSERT_TRUE(c.q_tile >= 0 && c.q_tile < s.q_tiles && c.head >= 0 && c.head < s.heads && c.batch >= 0 &&
                  c.batch < s.batch);
      if (sp.pairs_per_head == 0) {  // the static kernels' shorter form of the section order: the same tiles
        const TileCoord k = SectionTileAt<false>(sp, t);
        ASSERT_TRUE(k.q_tile == c.q_tile && k.head == c.head && k.batch == c.batch) << "tile " << t;
      }
      ++visits[(c.batch * s.heads + c.head) * s.q_tiles + c.q_tile];
      work[block] += s.causal ? c.q_tile + 1 : s.q_tiles;  // key blocks of a causal tile grow with q_tile
    }
  }
}

TEST(HopperScheduler, EveryTileExactlyOnce) {
  const Shape shapes[] = {
      {1, 1, 1, 100, 128, 1, false, 1},      {128, 16, 1, 16384, 128, 1, false, 132},
      {128, 16, 1, 16384, 128, 1, true, 132}, {8, 16, 16, 1024, 64, 1, true, 132},
      {4, 8, 32, 512, 256, 1, false, 132},    {86, 16, 2, 16384, 64, 8, true, 132},
      {3, 5, 7, 300, 128, 5, true, 100},      {33, 3, 1, 70000, 256, 1, false, 99},
      {11, 1, 1, 1408, 128, 1, true, 11},     {2, 65535 / 1024, 3, 64, 64, 1, false, 132},
  };
  // Whatever section budget a plan sets (HopperScheduleOptions::l2_section_bytes): none, tiny, default, huge.
  for (const int64_t budget : {int64_t{0}, int64_t{1} << 20, kDefaultSectionBudgetBytes, int64_t{1} << 40}) {
    for (const Shape& s : shapes) {
      std::vector<int> visits;
      std::vector<int64_t> work;
      Walk(s, visits, work, budget);
      for (size_t i = 0; i < visits.size(); ++i) {
        ASSERT_EQ(visits[i], 1) << "tile " << i << " of " << s.q_tiles << "x" << s.heads << "x" << s.batch
                                << " causal=" << s.causal << " grid=" << s.grid << " budget=" << budget;
      }
    }
  }
}

// The split tail: the whole rounds before it and the parts after it cover every key block of every tile exactly
// once; a block runs at most kMaxTailPartsPerBlock parts, a tile is cut into at most kMaxTailPartsPerTile, tiles
// without key blocks are written by exactly one block, and the blocks' shares of the tail are within a key block
// or two of each other (of a pair's length in the paired order, whose pairs differ by a block).
TEST(HopperScheduler, SplitTailCoversEveryKeyBlockOnceAndBalances) {
  struct Case {
    Shape s;
    int block_n;
    bool force;
  };
  const Case cases[] = {
      {{128, 16, 1, 16384, 128, 1, false, 132}, 128, false},  // FA3 d128 non-causal 16k: 2048 tiles
      {{8, 16, 16, 1024, 128, 1, false, 132}, 128, false},    // 1k: 8 key blocks a tile
      {{128, 16, 1, 16384, 128, 1, true, 132}, 176, false},   // causal 16k in pairs, 128x176
      {{64, 16, 2, 8192, 256, 1, true, 132}, 64, false},      // d256 causal 8k, pairs
      {{9, 3, 1, 1100, 128, 1, true, 3}, 128, true},          // odd q tiles: middle tiles pair across heads
      {{8, 1, 1, 1000, 128, 1, false, 3}, 128, true},         // the GPU suite's few-block runs
      {{8, 2, 1, 3000, 128, 1, true, 5}, 128, true},
  };
  for (const Case& c : cases) {
    const Shape& s = c.s;
    SCOPED_TRACE(testing::Message() << s.q_tiles << "x" << s.heads << "x" << s.batch << " kv " << s.kv_len
                                    << " causal " << s.causal << " grid " << s.grid);
    SchedulerParams sp = MakeSchedulerParams(s.q_tiles, s.heads, s.batch, s.kv_len, s.head_dim, s.group, s.causal);
    // Key blocks of each tile as KeyRangeFor counts them (top-left causal, q_len == kv_len, 128-row tiles).
    const auto blocks_of = [&](int t) {
      const TileCoord tc = TileAt(sp, t);
      const int kv_end = s.causal ? std::min(s.kv_len, (tc.q_tile + 1) * 128) : s.kv_len;
      return (kv_end + c.block_n - 1) / c.block_n;
    };
    const int kv_blocks = (s.kv_len + c.block_n - 1) / c.block_n;
    const TailSplit ts =
        PlanTailSplit(sp, s.grid, sp.pairs_per_head > 0 ? kv_blocks + 1 : kv_blocks, c.force ? 1 : 2, c.force);
    ASSERT_GT(ts.units, 0) << "expected a split";
    sp.tail_units = ts.units;
    sp.tail_round = ts.round;
    sp.tail_tile = ts.tile;
    std::vector<std::vector<int>> covered(sp.total_tiles);  // per tile: how often each key block is run
    for (int t = 0; t < sp.total_tiles; ++t) covered[t].assign(std::max(blocks_of(t), 1), 0);
    std::vector<int> parts_of_tile(sp.total_tiles, 0), zero_writes(sp.total_tiles, 0);
    std::vector<int64_t> tail_work(s.grid, 0);
    for (int block = 0; block < s.grid; ++block) {
      for (int round = 0, t; round < sp.tail_round && (t = TileOfRound(sp, round, block, s.grid)) >= 0; ++round) {
        ASSERT_LT(t, sp.tail_tile) << "a whole round reached into the tail";
        for (int b = 0; b < blocks_of(t); ++b) ++covered[t][b];
        if (blocks_of(t) == 0) ++zero_writes[t];
      }
      TailPart parts[kMaxTailPartsPerBlock + 1];  // one more than allowed: a block with too many parts fails below
      const int n = sp.pairs_per_head > 0 ? TailPartsOf<2>(sp, block, s.grid, blocks_of, parts)
                                          : TailPartsOf<1>(sp, block, s.grid, blocks_of, parts);
      ASSERT_LE(n, kMaxTailPartsPerBlock);
      for (int k = 0; k < n; ++k) {
        const TailPart& p = parts[k];
        ASSERT_GE(p.tile, sp.tail_tile);
        ASSERT_LT(p.tile, sp.total_tiles);
        ASSERT_EQ(p.tile_blocks, blocks_of(p.tile));
        ASSERT_TRUE(p.first >= 0 && p.first <= p.end && p.end <= p.tile_blocks);
        if (p.end == p.first) {
          ASSERT_EQ(p.tile_blocks, 0) << "an empty part of a tile with keys";
          ++zero_writes[p.tile];
          continue;
        }
        ++parts_of_tile[p.tile];
        for (int b = p.first; b < p.end; ++b) ++covered[p.tile][b];
        tail_work[block] += p.end - p.first;
      }
    }
    for (int t = 0; t < sp.total_tiles; ++t) {
      if (blocks_of(t) == 0) {
        EXPECT_EQ(zero_writes[t], 1) << "tile " << t;
        continue;
      }
      for (int b = 0; b < blocks_of(t); ++b) ASSERT_EQ(covered[t][b], 1) << "tile " << t << " block " << b;
      EXPECT_LE(parts_of_tile[t], kMaxTailPartsPerTile) << "tile " << t;
    }
    const auto [lo, hi] = std::minmax_element(tail_work.begin(), tail_work.end());
    EXPECT_LE(*hi - *lo, sp.pairs_per_head > 0 ? 3 : 2) << "tail shares " << *lo << ".." << *hi;
  }
}

// The launcher's rule (SplitTailMinBlocks): long rows split their last round, short ones keep whole tiles.
TEST(HopperScheduler, OnlyLongProblemsSplitTheirTailByDefault) {
  struct Case {
    Shape s;
    int block_n, unit_blocks;
    bool split;
  };
  const Case cases[] = {
      {{128, 16, 1, 16384, 128, 1, false, 132}, 176, 94, true},   // d128 non-causal 16k, 128x176: 48 blocks a block
      {{128, 16, 1, 16384, 128, 1, true, 132}, 176, 95, true},    // causal 16k in pairs
      {{64, 16, 2, 8192, 128, 1, false, 132}, 128, 64, false},    // 8k, 128x128: 33 blocks (4.2k keys)
      {{32, 16, 4, 4096, 128, 1, false, 132}, 128, 32, false},    // 4k: 16 blocks
      {{8, 16, 16, 1024, 128, 1, false, 132}, 128, 8, false},     // 1k
      {{64, 8, 2, 8192, 256, 1, false, 132}, 64, 128, true},      // d256 8k, 128x64: 97 blocks (6.2k keys)
      {{32, 8, 4, 4096, 256, 1, false, 132}, 64, 64, false},      // d256 4k: 48 blocks (3k keys)
      {{128, 1, 1, 16384, 128, 1, false, 132}, 176, 94, false},   // fewer tiles than blocks: no round is whole
  };
  for (const Case& c : cases) {
    const SchedulerParams sp = MakeSchedulerParams(c.s.q_tiles, c.s.heads, c.s.batch, c.s.kv_len, c.s.head_dim,
                                                   c.s.group, c.s.causal);
    const TailSplit ts = PlanTailSplit(sp, c.s.grid, c.unit_blocks, SplitTailMinBlocks(c.block_n), false);
    EXPECT_EQ(ts.units > 0, c.split) << c.s.q_tiles << "x" << c.s.heads << "x" << c.s.batch << " causal " << c.s.causal;
  }
}

TEST(HopperScheduler, CausalRoundsAreLongestFirstAndBalanced) {
  // d128, 16k tokens, 16 query heads over 2 kv heads (16 MB of K and V: fits L2, so not paired), 128-row tiles,
  // one block per SM of an H200.
  const Shape s{128, 16, 1, 16384, 128, 8, true, 132};
  const SchedulerParams sp = MakeSchedulerParams(s.q_tiles, s.heads, s.batch, s.kv_len, s.head_dim, s.group, true);
  EXPECT_EQ(sp.section_bh, sp.total_bh) << "causal problems are one LPT section";
  for (int t = 1; t < sp.total_tiles; ++t) {
    EXPECT_LE(TileAt(sp, t).q_tile, TileAt(sp, t - 1).q_tile) << "tile " << t;
  }
  std::vector<int> visits;
  std::vector<int64_t> work;
  Walk(s, visits, work);
  const int64_t total = std::accumulate(work.begin(), work.end(), int64_t{0});
  const int64_t most = *std::max_element(work.begin(), work.end());
  // Plain striding (block i always the i-th tile of a round) gives the busiest block 6.3% more than the mean
  // at this length; the snake 0.3%.
  EXPECT_LE(static_cast<double>(most), 1.01 * static_cast<double>(total) / s.grid);
}

TEST(HopperScheduler, PairedCausalProblemsGoHeadByHead) {
  // Short ones, and long ones whose K and V (here 128 MB) exceed L2.
  for (const Shape& s : {Shape{8, 16, 16, 1024, 128, 1, true, 132}, Shape{11, 32, 8, 1408, 128, 1, true, 132},
                         Shape{16, 8, 8, 2048, 256, 1, true, 132}, Shape{32, 16, 4, 4096, 128, 1, true, 132},
                         Shape{128, 16, 1, 16384, 128, 1, true, 132}, Shape{33, 8, 4, 8448, 256, 1, true, 132}}) {
    const SchedulerParams sp = MakeSchedulerParams(s.q_tiles, s.heads, s.batch, s.kv_len, s.head_dim, s.group, true);
    ASSERT_EQ(sp.pairs_per_head, s.q_tiles / 2);
    for (int block = 0; block < s.grid; ++block) {
      for (int round = 0;; round += 2) {
        const int a = TileOfRound(sp, round, block, s.grid);
        if (a < 0) break;
        const int b = TileOfRound(sp, round + 1, block, s.grid);
        if (b < 0) {
          EXPECT_EQ(a, sp.total_tiles - 1) << "only the last pair of an odd tile count has one tile";
          break;
        }
        const TileCoord x = TileAt(sp, a), y = TileAt(sp, b);
        // Every pair is nq + 1 key blocks: q tiles i and nq-1-i of one head, or two heads' middle tiles.
        EXPECT_EQ(x.q_tile + 1 + y.q_tile + 1, s.q_tiles + 1) << "block " << block << " round " << round;
        if (x.q_tile != y.q_tile) {
          EXPECT_EQ(x.head + x.batch * s.heads, y.head + y.batch * s.heads);
        }
      }
    }
    // The pairs in flight at once cover few heads: K and V stay in L2 across their q tiles.
    for (int round = 0; round < 4; round += 2) {
      std::vector<bool> seen(s.heads * s.batch, false);
      int heads = 0;
      for (int block = 0; block < s.grid; ++block) {
        const int t = TileOfRound(sp, round, block, s.grid);
        if (t < 0) continue;
        const TileCoord c = TileAt(sp, t);
        if (!seen[c.batch * s.heads + c.head]) ++heads;
        seen[c.batch * s.heads + c.head] = true;
      }
      EXPECT_LE(heads, s.grid / sp.pairs_per_head + 2) << "round " << round;
    }
    std::vector<int> visits;
    std::vector<int64_t> work;
    Walk(s, visits, work);
    const int64_t total = std::accumulate(work.begin(), work.end(), int64_t{0});
    const int64_t most = *std::max_element(work.begin(), work.end());
    // Only the last round's granularity: ceil(pairs / grid) of them against the mean.
    const double pairs = static_cast<double>(sp.total_tiles) / 2;
    EXPECT_LE(static_cast<double>(most) / (static_cast<double>(total) / s.grid),
              std::ceil(pairs / s.grid) / (pairs / s.grid) + 1e-9);
  }
  // head_dim 64 does not pair (no gain measured; its kernels compile the plain order only), nor do longer
  // problems whose K and V fit L2 (GQA 16:2 at 4k: 16 MB), nor any when told not to.
  EXPECT_EQ(MakeSchedulerParams(8, 32, 16, 1024, 64, 1, true).pairs_per_head, 0);
  EXPECT_EQ(MakeSchedulerParams(32, 16, 4, 4096, 128, 8, true).pairs_per_head, 0);
  EXPECT_EQ(MakeSchedulerParams(32, 16, 4, 4096, 128, 1, true, kDefaultSectionBudgetBytes, kMaxPairedQTiles, -1)
                .pairs_per_head,
            0);
  EXPECT_EQ(MakeSchedulerParams(8, 16, 16, 1024, 128, 1, true, kDefaultSectionBudgetBytes, 0, -1).pairs_per_head, 0);
  EXPECT_EQ(MakeSchedulerParams(1, 16, 4, 100, 128, 1, true).pairs_per_head, 0);
}

TEST(HopperScheduler, NonCausalSectionsKeepKvInL2) {
  // d128, 16k keys: K + V of one head are 8 MiB, so a section is 1 head (12 MiB budget); at 4k, 6 heads.
  const SchedulerParams sp = MakeSchedulerParams(128, 16, 1, 16384, 128, 1, false);
  EXPECT_EQ(sp.section_bh, 1);
  EXPECT_EQ(MakeSchedulerParams(32, 16, 4, 4096, 128, 1, false).section_bh, 6);
  // GQA: the q heads of one kv head share its K/V, so a section counts group x as many q heads.
  EXPECT_EQ(MakeSchedulerParams(128, 16, 1, 16384, 128, 8, false).section_bh, 8);
  // Never more than the problem has, never less than one.
  EXPECT_EQ(MakeSchedulerParams(4, 2, 1, 64, 64, 1, false).section_bh, 2);
  EXPECT_EQ(MakeSchedulerParams(1, 4, 1, 1 << 24, 256, 1, false).section_bh, 1);
  // A tuning budget: 0 turns sections off, 48 MiB doubles them.
  EXPECT_EQ(MakeSchedulerParams(128, 16, 1, 16384, 128, 1, false, 0).section_bh, 16);
  EXPECT_EQ(MakeSchedulerParams(128, 16, 1, 16384, 128, 1, false, int64_t{48} << 20).section_bh, 6);
}

// The dynamic order as the kernel runs it: blocks start on tiles 0..grid-1, and a block's scheduler thread
// takes the next index from the counter whenever its ring of two has room, i.e. when the block starts a tile
// it takes the one two ahead (the first two at once). Returns the time the last block finishes, each tile
// costing its key blocks plus `overhead`; `visits` counts each tile's runs.
double WalkDynamic(const SchedulerParams& sp, int grid, double overhead, std::vector<int>& visits) {
  visits.assign(sp.total_tiles, 0);
  struct Event {
    double at;
    int block;
    bool operator>(const Event& o) const { return at != o.at ? at > o.at : block > o.block; }
  };
  int counter = 0;
  const auto take = [&] {
    const int t = counter++ + grid;  // TakeDynamicTile
    return t < sp.total_tiles ? t : -1;
  };
  const int blocks = std::min(grid, sp.total_tiles);
  std::vector<std::deque<int>> queued(blocks);  // tiles a block holds, not yet started
  std::priority_queue<Event, std::vector<Event>, std::greater<Event>> starts;  // a block starts its next tile
  for (int b = 0; b < blocks; ++b) queued[b].push_back(b);
  for (int b = 0; b < blocks; ++b) queued[b].push_back(take());
  for (int b = 0; b < blocks; ++b) starts.push({0.0, b});
  double end = 0;
  while (!starts.empty()) {
    const Event e = starts.top();
    starts.pop();
    std::deque<int>& q = queued[e.block];
    const int tile = q.front();
    q.pop_front();
    if (tile < 0) continue;
    if (q.back() >= 0) q.push_back(take());  // its slot is free now
    const TileCoord c = SectionTileAt<true>(sp, tile);
    ++visits[(c.batch * sp.q_heads + c.head) * sp.num_q_tiles + c.q_tile];
    const double done = e.at + c.q_tile + 1 + overhead;
    end = std::max(end, done);
    starts.push({done, e.block});
  }
  return end;
}

TEST(HopperScheduler, DynamicCausalOrderRunsEveryTileOnceAndBalances) {
  // head_dim 64 (the only one run this way; MayRunDynamic): the FA3-convention causal rows (16k tokens, 32 heads;
  // 128-row tiles below 2k, 192 from 2k), the seed table's 8k (1 x 32 heads), GQA, and a tiny grid; all with
  // at least kDynamicMinTilesPerBlock tiles per block, as the launcher requires.
  EXPECT_TRUE(MayRunDynamic(64));
  EXPECT_FALSE(MayRunDynamic(128) || MayRunDynamic(256));
  const Shape shapes[] = {{86, 32, 1, 16384, 64, 1, true, 132}, {43, 32, 2, 8192, 64, 1, true, 132},
                          {22, 32, 4, 4096, 64, 1, true, 132},  {11, 32, 8, 2048, 64, 1, true, 132},
                          {8, 32, 16, 1024, 64, 1, true, 132},  {4, 32, 32, 512, 64, 1, true, 132},
                          {43, 32, 1, 8192, 64, 1, true, 132},  {86, 32, 1, 16384, 64, 8, true, 132},
                          {3, 5, 7, 300, 64, 5, true, 3}};
  for (const Shape& s : shapes) {
    ASSERT_GE(s.q_tiles * s.heads * s.batch, kDynamicMinTilesPerBlock * s.grid);
    const SchedulerParams sp = MakeSchedulerParams(s.q_tiles, s.heads, s.batch, s.kv_len, s.head_dim, s.group,
                                                   true, kDefaultSectionBudgetBytes, kMaxPairedQTiles,
                                                   kPairedKvBytes, /*dynamic=*/true);
    EXPECT_EQ(sp.pairs_per_head, 0);
    // Sections of heads sized to the L2 budget, as without a mask, longest first inside each.
    const int64_t kv_head_bytes = int64_t{s.kv_len} * s.head_dim * 4;
    if (kv_head_bytes * (s.heads * s.batch / s.group) > 2 * kDefaultSectionBudgetBytes) {
      EXPECT_LT(sp.section_bh, sp.total_bh);
    }
    const int per_section = sp.section_bh * sp.num_q_tiles, tail_tile = sp.tail_bh * sp.num_q_tiles;
    for (int t = 1; t < sp.total_tiles; ++t) {
      const bool starts_section = t < tail_tile ? t % per_section == 0 : t == tail_tile;
      if (!starts_section) {
        EXPECT_LE(SectionTileAt<true>(sp, t).q_tile, SectionTileAt<true>(sp, t - 1).q_tile) << "tile " << t;
      }
    }
    std::vector<int> visits;
    const double overhead = 1.4;  // block-steps of a tile beyond its key blocks (docs/kernels.md, the tile scheduler)
    const double end = WalkDynamic(sp, s.grid, overhead, visits);
    for (size_t i = 0; i < visits.size(); ++i) ASSERT_EQ(visits[i], 1) << "tile " << i;
    double total = 0;
    for (int t = 0; t < sp.total_tiles; ++t) total += SectionTileAt<true>(sp, t).q_tile + 1 + overhead;
    // Within 3% of the mean (the paired order's last-round granularity at the FA3 shapes); the model gives
    // 0.4-1.1% for these shapes.
    const double mean = total / std::min(s.grid, sp.total_tiles);
    EXPECT_LE(end, 1.03 * mean) << s.q_tiles << "x" << s.heads << "x" << s.batch;
  }
  // The static order is untouched when the dynamic one is not asked for: causal is one section, paired or not.
  EXPECT_EQ(MakeSchedulerParams(86, 32, 1, 16384, 64, 1, true).section_bh, 32);
  EXPECT_EQ(MakeSchedulerParams(86, 32, 1, 16384, 64, 1, true, kDefaultSectionBudgetBytes, kMaxPairedQTiles,
                                kPairedKvBytes, true)
                .section_bh,
            3);
}

// The plan-time decision (launch_plan_sm90.h): each schedule option reaches the schedule, and the defaults give what
// the scheduler's own defaults give.
ScheduleInputs Inputs(int q_tiles, int heads, int batch, int kv_len, int head_dim, int block_n, bool causal,
                      bool may_run_dynamic, bool may_split_tail) {
  ScheduleInputs in;
  in.num_q_tiles = q_tiles;
  in.q_heads = heads;
  in.batch = batch;
  in.kv_len = kv_len;
  in.group = 1;
  in.causal = causal;
  in.head_dim = head_dim;
  in.block_n = block_n;
  in.may_run_dynamic = may_run_dynamic;
  in.may_split_tail = may_split_tail;
  in.sms = 132;
  return in;
}

TEST(HopperSchedule, DefaultsMatchTheSchedulersDefaults) {
  // d128 non-causal 16k, 16 heads: 2048 tiles on 132 blocks, a last round of 68 tiles, split.
  const ScheduleInputs in = Inputs(128, 16, 1, 16384, 128, 128, false, false, true);
  const ScheduleDecision d = DecideSchedule(in, HopperScheduleOptions{});
  EXPECT_EQ(d.blocks, 132);
  EXPECT_EQ(d.order, kStatic);
  const SchedulerParams sp = MakeSchedulerParams(128, 16, 1, 16384, 128, 1, false);
  EXPECT_EQ(d.sp.section_bh, sp.section_bh);
  EXPECT_EQ(d.sp.total_tiles, sp.total_tiles);
  ASSERT_TRUE(d.split_tail);
  const TailSplit ts = PlanTailSplit(sp, 132, 128, SplitTailMinBlocks(128), false);
  EXPECT_EQ(d.sp.tail_units, ts.units);
  EXPECT_EQ(d.sp.tail_round, ts.round);
  EXPECT_EQ(d.sp.tail_tile, ts.tile);
  EXPECT_EQ(d.split_tiles, ts.units);
  EXPECT_EQ(d.sp.counter, nullptr);
  EXPECT_EQ(d.sp.split_ws, nullptr);
}

TEST(HopperSchedule, MaxBlocksCapsThePersistentGrid) {
  const ScheduleInputs in = Inputs(8, 4, 2, 1000, 128, 128, false, false, true);  // 64 tiles
  EXPECT_EQ(DecideSchedule(in, HopperScheduleOptions{}).blocks, 64);  // fewer tiles than SMs: one block each
  HopperScheduleOptions o;
  o.max_blocks = 3;
  EXPECT_EQ(DecideSchedule(in, o).blocks, 3);
  o.max_blocks = 1000;
  EXPECT_EQ(DecideSchedule(in, o).blocks, 64);
}

TEST(HopperSchedule, SplitTailOption) {
  // Short rows: auto keeps whole tiles; kAlways splits them on a few blocks (the tests' forced split).
  const ScheduleInputs in = Inputs(8, 4, 2, 1000, 128, 128, false, false, true);
  HopperScheduleOptions o;
  o.max_blocks = 3;
  EXPECT_FALSE(DecideSchedule(in, o).split_tail);
  o.split_tail = SplitTail::kAlways;
  const ScheduleDecision forced = DecideSchedule(in, o);
  EXPECT_TRUE(forced.split_tail);
  EXPECT_GT(forced.sp.tail_units, 0);
  // A long row splits by default, never with kOff, and never on a configuration compiled without the split tail.
  const ScheduleInputs long_row = Inputs(128, 16, 1, 16384, 128, 128, false, false, true);
  EXPECT_TRUE(DecideSchedule(long_row, HopperScheduleOptions{}).split_tail);
  HopperScheduleOptions off;
  off.split_tail = SplitTail::kOff;
  const ScheduleDecision d = DecideSchedule(long_row, off);
  EXPECT_FALSE(d.split_tail);
  EXPECT_EQ(d.sp.tail_units, 0);
  ScheduleInputs not_compiled = long_row;
  not_compiled.may_split_tail = false;
  EXPECT_FALSE(DecideSchedule(not_compiled, HopperScheduleOptions{}).split_tail);
}

TEST(HopperSchedule, CausalOrderOption) {
  // d64 causal, 8 x 32 heads x 6 q tiles of 192 rows: 1536 tiles, at least 6 per block on 132 SMs.
  const ScheduleInputs in = Inputs(6, 32, 8, 1024, 64, 128, true, true, false);
  const ScheduleDecision dynamic = DecideSchedule(in, HopperScheduleOptions{});
  EXPECT_EQ(dynamic.order, kDynamic);
  EXPECT_FALSE(dynamic.split_tail);
  HopperScheduleOptions o;
  o.causal_order = CausalOrder::kStatic;
  EXPECT_EQ(DecideSchedule(in, o).order, kStatic);
  // Too few tiles per block for the dynamic order.
  o = HopperScheduleOptions{};
  o.dynamic_min_tiles_per_block = 12;
  EXPECT_EQ(DecideSchedule(in, o).order, kStatic);
  // A configuration without the dynamic kernel, and a problem without a mask, keep the static order.
  ScheduleInputs no_kernel = in;
  no_kernel.may_run_dynamic = false;
  EXPECT_EQ(DecideSchedule(no_kernel, HopperScheduleOptions{}).order, kStatic);
  ScheduleInputs no_mask = in;
  no_mask.causal = false;
  EXPECT_EQ(DecideSchedule(no_mask, HopperScheduleOptions{}).order, kStatic);
  // The last section's length follows tail_tiles_per_block.
  o = HopperScheduleOptions{};
  o.tail_tiles_per_block = 1;
  EXPECT_GT(DecideSchedule(in, o).sp.tail_bh, dynamic.sp.tail_bh);
}

TEST(HopperSchedule, SectionAndPairOptions) {
  // Non-causal d128 8k, 64 heads: the section budget sets the heads per section.
  const ScheduleInputs wide = Inputs(64, 64, 1, 8192, 128, 128, false, false, true);
  HopperScheduleOptions o;
  const int by_default = DecideSchedule(wide, o).sp.section_bh;
  EXPECT_LT(by_default, 64);
  o.l2_section_bytes = 0;
  EXPECT_EQ(DecideSchedule(wide, o).sp.section_bh, 64);
  o.l2_section_bytes = kDefaultSectionBudgetBytes / 2;
  EXPECT_LT(DecideSchedule(wide, o).sp.section_bh, by_default);
  // Causal d128 1k (8 q tiles) pairs by length; not with max_paired_q_tiles below 8 (K/V of 8 MB fit L2).
  const ScheduleInputs short_causal = Inputs(8, 16, 1, 1024, 128, 128, true, false, true);
  EXPECT_EQ(DecideSchedule(short_causal, HopperScheduleOptions{}).order, kPaired);
  o = HopperScheduleOptions{};
  o.max_paired_q_tiles = 4;
  EXPECT_EQ(DecideSchedule(short_causal, o).order, kStatic);
  // ... but does with paired_kv_bytes below its K and V.
  o.paired_kv_bytes = 1 << 20;
  EXPECT_EQ(DecideSchedule(short_causal, o).order, kPaired);
}

TEST(HopperSchedule, WorkspaceLayout) {
  const WorkspaceLayout none = LayOutWorkspace(false, 0, 0);
  EXPECT_EQ(none.bytes, 0u);
  EXPECT_EQ(none.tile_counters, LaunchSchedule::kNoOffset);
  EXPECT_EQ(none.split_counters, LaunchSchedule::kNoOffset);
  EXPECT_EQ(none.split_partials, LaunchSchedule::kNoOffset);
  const WorkspaceLayout dynamic = LayOutWorkspace(true, 0, 0);
  EXPECT_EQ(dynamic.tile_counters, 0u);
  EXPECT_EQ(dynamic.bytes, kWorkspaceAlign);
  const WorkspaceLayout split = LayOutWorkspace(false, 1000, 5000);
  EXPECT_EQ(split.tile_counters, LaunchSchedule::kNoOffset);
  EXPECT_EQ(split.split_counters, 0u);
  EXPECT_EQ(split.split_partials, 1024u);
  EXPECT_EQ(split.bytes, 1024u + 5120u);
  for (size_t off : {split.split_counters, split.split_partials, split.bytes}) EXPECT_EQ(off % kWorkspaceAlign, 0u);
}

}  // namespace
}  // namespace attnd::kernels::hopper
