// Tile scheduler role: a persistent grid (one block per SM) walks the (q_tile, head, batch) tiles in rounds
// of `grid` tiles, block i taking the i-th tile of even rounds and the i-th from the end of odd ones
// (boustrophedon). With costs falling along the order (causal), plain striding gives block 0 the longest
// tile of every round; the snake balances them (docs/tuning.md, "tile order").
// Order: (batch, head) pairs are taken a section at a time; inside a section the q_tile is the slow index,
// highest first. Without a mask every tile costs the same, and a section is as many heads as keep their
// K and V inside about a quarter of L2, so the ~132 blocks in flight share K/V through L2. With a causal mask
// the cost of a tile grows with its q_tile; sections there made the strided assignment hand one block all
// long tiles and another all short ones, so a long causal problem is one
// section: each stride-round of `grid` tiles is a run of nearly equal cost, longest first (LPT).
// Short causal problems (at most kMaxPairedQTiles q tiles per head), and longer ones whose K and V exceed
// kPairedKvBytes, are paired instead: a block runs q tiles nq-1-i and i of one head back to back, nq + 1 key
// blocks whatever i, so plain striding over these pairs is balanced, and the pairs go head by head, so the
// blocks in flight share a few heads' K and V through L2. One LPT section there had every round touch ~130
// heads (a round is the same q tile of every head), K and V came from DRAM again for each q tile (d128 1k:
// ~600 MB for a 68 GFLOP problem), and sections of the LPT order could not be balanced by a static snake.
#pragma once

#include <cuda_runtime.h>  // __host__ __device__ (host compilers too: tests/unit/kernels/hopper_scheduler_test.cc)

#include <cstdint>

namespace attnd::kernels::hopper {

// How a launch's blocks find their tiles. kStatic and kPaired are fixed by block index and round; kDynamic takes
// tiles in the (sectioned, longest-first) order from a global counter as blocks free up.
enum ScheduleOrder : int { kStatic = 0, kPaired = 1, kDynamic = 2 };

struct SchedulerParams {
  int num_q_tiles = 0;
  int q_heads = 0;
  int total_bh = 0;    // batch * q_heads
  int section_bh = 1;  // (batch, head) pairs per L2 section
  int tail_bh = 0;     // where the last section starts (dynamic: made long enough to end the schedule evenly)
  int total_tiles = 0;
  int pairs_per_head = 0;  // > 0: paired causal order (num_q_tiles / 2 pairs per head, then the middle tiles)
  int paired_tiles = 0;    // 2 * pairs_per_head * total_bh: where the middle tiles of an odd num_q_tiles start
  // kDynamic: [0] tiles handed out beyond the first grid, [1] blocks finished; zero at launch, and the last
  // block to finish zeroes them again (the caller gives each launch in flight its own workspace).
  unsigned* counter = nullptr;
  // Split tail (static and paired orders; see TailPartAt). tail_units > 0: the rounds before
  // `tail_round` run whole tiles as usual, and the units (a tile, or a pair in the paired order) from
  // `tail_tile` on are shared out by key blocks among all the blocks. `split_ws` holds the parts' partial
  // outputs and `split_counters` the counters that find each tile's finishing part (both in the plan's workspace).
  int tail_units = 0;
  int tail_round = 0;
  int tail_tile = 0;
  float* split_ws = nullptr;
  unsigned* split_counters = nullptr;
};

struct TileCoord {
  int q_tile, head, batch;
};

// About a quarter of the H200's 50 MiB L2, the best of a sweep at d128 and d256 (docs/tuning.md, "L2 sections").
constexpr int64_t kDefaultSectionBudgetBytes = int64_t{12} << 20;

// Causal problems with at most this many q tiles per head are paired (d128: q_len <= 2048).
constexpr int kMaxPairedQTiles = 16;
// Longer causal problems are paired when all their K and V (batch x kv heads) exceed this: the LPT snake's
// rounds then cycle through more K/V than L2 holds. Pairs leave up to one pair of granularity in the last
// round where the snake balances to a fraction of that, so problems whose K/V fit L2 keep the snake
// (docs/tuning.md, "causal pairs").
constexpr int64_t kPairedKvBytes = int64_t{32} << 20;
// Dynamic causal schedule: the last section's length, in the longest tiles' worth of work per block, and the
// fewest tiles per block a problem needs to run it (flash_fwd_launch_sm90.cuh; docs/tuning.md, "dynamic order").
constexpr int kDefaultTailTilesPerBlock = 8;
constexpr int kDynamicMinTilesPerBlock = 6;

// Only head_dim 64 runs the dynamic schedule, where it replaces the snake: at d128 and d256 the pairs and the
// snake are faster, partly because the dynamic kernel's consumers have 232 registers, not 240
// (tile_size_sm90.h; docs/tuning.md, "dynamic order").
__host__ __device__ constexpr bool MayRunDynamic(int head_dim) { return head_dim == 64; }

// Only head_dim >= 128 pairs: at 64 pairing measured no gain (d64 causal 1k 293 -> 296, 2k 372 -> 365 TFLOP/s),
// and the d64 kernels' paired instantiations spill 4-16 bytes (the producer's 24 registers, m192's 32), so d64
// compiles the plain order only.
__host__ __device__ constexpr bool MayPair(int head_dim) { return head_dim >= 128; }

// `section_budget_bytes`: the K + V bytes a section may span; <= 0: no sections (one). Static causal problems
// are one section, paired with 2..`max_paired_q_tiles` q tiles per head, or more when their K and V exceed
// `paired_kv_bytes` (< 0: never for that reason). `dynamic` (causal only): sections as without a mask, longest
// first inside each, no pairs; blocks take the tiles in that order as they free up.
inline SchedulerParams MakeSchedulerParams(int num_q_tiles, int q_heads, int batch, int kv_len, int head_dim,
                                           int kv_group, bool causal,
                                           int64_t section_budget_bytes = kDefaultSectionBudgetBytes,
                                           int max_paired_q_tiles = kMaxPairedQTiles,
                                           int64_t paired_kv_bytes = kPairedKvBytes, bool dynamic = false,
                                           int grid = 132, int tail_tiles_per_block = kDefaultTailTilesPerBlock) {
  SchedulerParams sp;
  sp.num_q_tiles = num_q_tiles;
  sp.q_heads = q_heads;
  sp.total_bh = q_heads * batch;
  // K + V of one kv head; the q heads of one GQA group share it, so a section counts q heads.
  const int64_t kv_bytes = static_cast<int64_t>(kv_len) * head_dim * 2 * 2;
  int64_t section = kv_bytes > 0 && section_budget_bytes > 0 ? section_budget_bytes / kv_bytes * kv_group
                                                              : sp.total_bh;
  if (section < 1) section = 1;
  if (section > sp.total_bh || (causal && !dynamic)) section = sp.total_bh;
  sp.section_bh = static_cast<int>(section);
  sp.tail_bh = (sp.total_bh - 1) / sp.section_bh * sp.section_bh;
  if (causal && dynamic) {
    // Blocks taking tiles as they free up all end together if the schedule ends on short tiles. Each section
    // runs longest first, so the last one must hold enough work that its longest tiles (num_q_tiles key
    // blocks) end with the rest: `tail_tiles_per_block` of them per block, in heads.
    const int64_t long_tiles = int64_t{tail_tiles_per_block} * grid;
    const int tail = static_cast<int>((long_tiles + num_q_tiles) / (num_q_tiles + 1)) * kv_group;
    sp.tail_bh = sp.total_bh - tail <= 0 ? 0 : (sp.total_bh - tail) / sp.section_bh * sp.section_bh;
  }
  sp.total_tiles = num_q_tiles * sp.total_bh;
  const int64_t all_kv_bytes = kv_bytes * (sp.total_bh / (kv_group > 0 ? kv_group : 1));
  const bool kv_past_l2 = paired_kv_bytes >= 0 && all_kv_bytes > paired_kv_bytes;
  if (causal && !dynamic && MayPair(head_dim) && num_q_tiles >= 2 &&
      (num_q_tiles <= max_paired_q_tiles || kv_past_l2)) {
    sp.pairs_per_head = num_q_tiles / 2;
    sp.paired_tiles = 2 * sp.pairs_per_head * sp.total_bh;
  }
  return sp;
}

// The tile block `block` runs in round `round`, or -1 when it has none (only the last round is partial).
// Paired order: rounds 2r and 2r + 1 are the two tiles of pair r * grid + block.
__host__ __device__ __forceinline__ int PairedTileOfRound(const SchedulerParams& sp, int round, int block, int grid) {
  const int pair = (round >> 1) * grid + block;
  const int t = 2 * pair + (round & 1);
  return t < sp.total_tiles ? t : -1;  // the last pair of an odd tile count has one tile
}

__host__ __device__ __forceinline__ int StaticTileOfRound(const SchedulerParams& sp, int round, int block, int grid) {
  const int base = round * grid;
  const int left = sp.total_tiles - base;
  const int count = grid < left ? grid : left;
  if (block >= count) return -1;
  return base + ((round & 1) ? count - 1 - block : block);
}

// Pairs (nq-1-i, i) head by head; with an odd nq the middle tiles follow, two heads' to a pair (again nq + 1 key
// blocks).
__host__ __device__ __forceinline__ TileCoord PairedTileAt(const SchedulerParams& sp, int t) {
  const int pair = t >> 1;
  const bool middle = t >= sp.paired_tiles;
  const int bh = middle ? t - sp.paired_tiles : pair / sp.pairs_per_head;
  const int i = middle ? sp.pairs_per_head : pair - bh * sp.pairs_per_head;
  const int q_tile = (t & 1) || middle ? i : sp.num_q_tiles - 1 - i;
  return TileCoord{q_tile, bh % sp.q_heads, bh / sp.q_heads};
}

// Sections of section_bh (batch, head) pairs, q tiles longest first inside. kTail: the last section runs from
// tail_bh to the end (the dynamic order lengthens it); without, it is whatever is left after whole sections,
// which is where tail_bh points for the static orders, so both give the same tiles there. The static kernels
// keep the shorter form, without the tail's branch.
template <bool kTail>
__host__ __device__ __forceinline__ TileCoord SectionTileAt(const SchedulerParams& sp, int t) {
  int base_bh, size, idx;
  if (kTail && t >= sp.tail_bh * sp.num_q_tiles) {
    base_bh = sp.tail_bh;
    size = sp.total_bh - sp.tail_bh;
    idx = t - sp.tail_bh * sp.num_q_tiles;
  } else {
    const int per_section = sp.section_bh * sp.num_q_tiles;
    const int section = t / per_section;
    base_bh = section * sp.section_bh;
    const int left = sp.total_bh - base_bh;
    size = sp.section_bh < left ? sp.section_bh : left;
    idx = t - section * per_section;
  }
  const int bh = base_bh + idx % size;
  return TileCoord{sp.num_q_tiles - 1 - idx / size, bh % sp.q_heads, bh / sp.q_heads};
}

// Either order, as the parameters say (host tests). The kernels call the one their instantiation runs: with
// both in the paired kernel its producer spilled 4 bytes (d128).
__host__ __device__ __forceinline__ int TileOfRound(const SchedulerParams& sp, int round, int block, int grid) {
  return sp.pairs_per_head > 0 ? PairedTileOfRound(sp, round, block, grid) : StaticTileOfRound(sp, round, block, grid);
}
__host__ __device__ __forceinline__ TileCoord TileAt(const SchedulerParams& sp, int t) {
  return sp.pairs_per_head > 0 ? PairedTileAt(sp, t) : SectionTileAt<true>(sp, t);
}

// ---------------------------------------------------------------------------------------------------------
// Split tail. The last round of the static orders is partial: 2048 tiles on 132 blocks run as 16 rounds for
// 15.52 rounds of work, and 1024 pairs as 8 for 7.76. Instead, the last round's units are laid end to end by key blocks and cut into `grid` equal
// ranges, one per block: a block runs at most two units' worth of parts (a tile's key blocks [first, end)),
// writes a part that does not cover its tile to the workspace, and whichever part completes a tile's key
// blocks combines them and writes O. A unit's key blocks are cut where a nominal kTailUnitScale-long unit is
// cut, scaled to the unit's real length, so the cuts need no prefix sums and still cover every unit exactly.
constexpr int kTailUnitScale = 4096;
// A tile of the split tail is cut into at most this many parts (the launcher makes sure: MaySplitTail).
constexpr int kMaxTailPartsPerTile = 8;
// Counter words per (split tile, consumer warp): [0] parts registered, [1] key blocks done, [2..] the parts'
// workspace slots. [0] and [1] are zero at launch and the warp that completes the tile zeroes them again; the
// slot words are written before they are read, so they may hold anything.
constexpr int kTailCounterWords = 2 + kMaxTailPartsPerTile;
// The most parts one block runs: two units of up to two tiles.
constexpr int kMaxTailPartsPerBlock = 4;
// The least keys of the tail a block must get for the launcher to split it, as key blocks of `block_n` keys: below
// ~5k keys a block, the split's combine costs more than the balance gains (docs/tuning.md, "split tail").
constexpr int kSplitTailMinKeys = 5120;
__host__ __device__ constexpr int SplitTailMinBlocks(int block_n) { return (kSplitTailMinKeys + block_n - 1) / block_n; }

struct TailPart {
  int tile;         // in the order's tile numbering (TileAt)
  int first, end;   // key blocks [first, end) of the tile
  int tile_blocks;  // the tile's key blocks in all
};

// Part `want` (0, 1, ...) of block `block`'s share of the split tail, in order; false past its last part. At most
// kMaxTailPartsPerBlock. kUnitTiles: 1 (static order) or 2 (paired). blocks_of(t): the key blocks of tile t. The
// kernels ask for one part at a time (recomputing the few steps before it) rather than keep an array of them,
// which would live in local memory.
template <int kUnitTiles, typename BlocksOf>
__host__ __device__ __forceinline__ bool TailPartAt(const SchedulerParams& sp, int block, int grid,
                                                    const BlocksOf& blocks_of, int want, TailPart* out) {
  // 32-bit: PlanTailSplit keeps span * grid below 2^31 (a 64-bit division is a call that spilled the producer's
  // 24 registers).
  const int span = sp.tail_units * kTailUnitScale;
  const int lo = span * block / grid, hi = span * (block + 1) / grid;
  int n = 0;
  for (int u = lo / kTailUnitScale; u < sp.tail_units && u * kTailUnitScale < hi; ++u) {
    const int start = u * kTailUnitScale;
    const int64_t xs = (lo > start ? lo : start) - start;
    const int64_t xe = (hi < start + kTailUnitScale ? hi : start + kTailUnitScale) - start;
    const int t0 = sp.tail_tile + u * kUnitTiles;
    // Scalars, not an array: an array indexed in a loop lived in local memory in the kernels.
    const int nb0 = blocks_of(t0);
    const int nb1 = kUnitTiles == 2 && t0 + 1 < sp.total_tiles ? blocks_of(t0 + 1) : 0;
    const int64_t w = nb0 + nb1;
    const int a0 = static_cast<int>(xs * w / kTailUnitScale), a1 = static_cast<int>(xe * w / kTailUnitScale);
    // Tile t0 + i holds the unit's key blocks [base, base + nbi). A tile without key blocks (rows before every
    // key) still has its zero output to write: by the block whose range starts its unit.
    const auto part_of = [&](int i, int base, int nbi, TailPart* p) {
      const int s = a0 > base ? a0 : base;
      const int e = a1 < base + nbi ? a1 : base + nbi;
      if (e > s) {
        *p = TailPart{t0 + i, s - base, e - base, nbi};
        return true;
      }
      if (nbi == 0 && xs == 0 && t0 + i < sp.total_tiles) {
        *p = TailPart{t0 + i, 0, 0, 0};
        return true;
      }
      return false;
    };
    if (part_of(0, 0, nb0, out) && n++ == want) return true;
    if (kUnitTiles == 2 && part_of(1, nb0, nb1, out) && n++ == want) return true;
  }
  return false;
}

// All of block `block`'s parts (host tests); returns how many.
template <int kUnitTiles, typename BlocksOf>
inline int TailPartsOf(const SchedulerParams& sp, int block, int grid, const BlocksOf& blocks_of,
                       TailPart (&out)[kMaxTailPartsPerBlock + 1]) {
  int n = 0;
  while (n <= kMaxTailPartsPerBlock && TailPartAt<kUnitTiles>(sp, block, grid, blocks_of, n, &out[n])) ++n;
  return n;
}

// Whether a launch of `grid` blocks over `sp` should split its last round, and how: the units the order has
// (tiles, or pairs), `unit_blocks` the key blocks of a typical unit. Only worth it when the last round leaves
// blocks idle (at most ~85% full), each block still gets at least `min_blocks` key blocks of it, and no tile
// is cut into more than kMaxTailPartsPerTile parts (at least grid / 6 units).
struct TailSplit {
  int units = 0, round = 0, tile = 0;
};
__host__ __device__ inline TailSplit PlanTailSplit(const SchedulerParams& sp, int grid, int unit_blocks, int min_blocks,
                                                   bool force) {
  TailSplit ts;
  const bool paired = sp.pairs_per_head > 0;
  const int unit_tiles = paired ? 2 : 1;
  const int units = (sp.total_tiles + unit_tiles - 1) / unit_tiles;
  const int full = units / grid, left = units - full * grid;
  if (grid < 2 || full < 1 || left == 0) return ts;
  if (int64_t{left} * kTailUnitScale * grid >= (int64_t{1} << 31)) return ts;  // TailPartAt's 32-bit arithmetic
  if (int64_t{left} * 6 < grid) return ts;                                    // too many parts per tile
  if (int64_t{left} * unit_blocks < int64_t{min_blocks} * grid) return ts;    // too little work per block
  if (!force && int64_t{left} * 100 > int64_t{grid} * 85) return ts;         // the last round is nearly full
  ts.units = left;
  ts.round = full * unit_tiles;  // rounds of tiles: the paired order's rounds 2r, 2r + 1 are pair r's tiles
  ts.tile = full * grid * unit_tiles;
  return ts;
}

#if defined(__CUDACC__)
// kDynamic: the next tile for this block (-1: none left). Blocks start on tiles 0..grid-1; the counter hands
// out the rest in order. One thread per block (the scheduler) calls it ahead of need, so the atomic's round
// trip to L2 hides under the tiles in hand.
__device__ __forceinline__ int TakeDynamicTile(const SchedulerParams& sp) {
  const int t = static_cast<int>(atomicAdd(sp.counter, 1u)) + static_cast<int>(gridDim.x);
  return t < sp.total_tiles ? t : -1;
}

// kDynamic: called once per block after its last TakeDynamicTile. Every block has then made its final take,
// so the last one to finish can zero both counters for the next launch that is given them.
__device__ __forceinline__ void FinishDynamicTiles(const SchedulerParams& sp) {
  __threadfence();
  if (atomicAdd(sp.counter + 1, 1u) == gridDim.x - 1) {
    atomicExch(sp.counter, 0u);
    atomicExch(sp.counter + 1, 0u);
  }
}
#endif

}  // namespace attnd::kernels::hopper
