// Tile scheduler role: a persistent grid (one block per SM) walks the (q_tile, head, batch) tiles in rounds
// of `grid` tiles, block i taking the i-th tile of even rounds and the i-th from the end of odd ones
// (boustrophedon). With costs falling along the order (causal), plain striding gave block 0 the longest
// tile of every round (d128 16k: the busiest block 6.3% over the mean, 0.3% snaking); measured on the H200,
// snaking took causal d128 16k from 553 to 669 TFLOP/s (more than that imbalance explains; see
// docs/hopper-kernel-notes.md).
// Order: (batch, head) pairs are taken a section at a time; inside a section the q_tile is the slow index,
// highest first. Without a mask every tile costs the same, and a section is as many heads as keep their
// K and V inside about a quarter of L2, so the ~132 blocks in flight share K/V through L2. With a causal mask
// the cost of a tile grows with its q_tile; sections there made the strided assignment hand one block all
// long tiles and another all short ones (v1: d256 causal 16k at 0.5x cuDNN), so a long causal problem is one
// section: each stride-round of `grid` tiles is a run of nearly equal cost, longest first (LPT).
// Short causal problems (at most kMaxPairedQTiles q tiles per head), and longer ones whose K and V exceed
// kPairedKvBytes, are paired instead: a block runs q tiles nq-1-i and i of one head back to back, nq + 1 key
// blocks whatever i, so plain striding over these pairs is balanced, and the pairs go head by head, so the
// blocks in flight share a few heads' K and V through L2. One LPT section there had every round touch ~130
// heads (a round is the same q tile of every head), K and V came from DRAM again for each q tile (d128 1k:
// ~600 MB for a 68 GFLOP problem), and sections of the LPT order could not be balanced by a static snake.
#pragma once

#include <cuda_runtime.h>  // __host__ __device__ (host compilers too: tests/hopper_scheduler_test.cc)

#include <cstdint>

namespace attnd::kernels::hopper {

struct SchedulerParams {
  int num_q_tiles = 0;
  int q_heads = 0;
  int total_bh = 0;    // batch * q_heads
  int section_bh = 1;  // (batch, head) pairs per L2 section
  int total_tiles = 0;
  int pairs_per_head = 0;  // > 0: paired causal order (num_q_tiles / 2 pairs per head, then the middle tiles)
  int paired_tiles = 0;    // 2 * pairs_per_head * total_bh: where the middle tiles of an odd num_q_tiles start
};

struct TileCoord {
  int q_tile, head, batch;
};

// About a quarter of the H200's 50 MiB L2: swept 0/8/12/16/24/48 MiB on the H200 (docs/hopper-kernel-notes.md,
// v4), 12 was best or level at d128 and d256 (24, half of L2, from v1 to v3).
constexpr int64_t kDefaultSectionBudgetBytes = int64_t{12} << 20;

// Causal problems with at most this many q tiles per head are paired (d128: q_len <= 2048).
constexpr int kMaxPairedQTiles = 16;
// Longer causal problems are paired when all their K and V (batch x kv heads) exceed this: the LPT snake's
// rounds then cycle through more K/V than L2 holds. Pairs leave up to one pair of granularity in the last
// round (~3% at 1024 pairs on 132 SMs) where the snake balances to ~0.5%, so problems whose K/V fit L2 keep
// the snake. H200, call 1 of session 5 (d128 causal, pairs vs snake): 16 heads 4k +14%, 8k +6%, 16k +2%
// (128 MB of K/V each); d256 4k +17%; GQA 16:2 (16 MB) 16k -3%, 4k level.
constexpr int64_t kPairedKvBytes = int64_t{32} << 20;
// Only head_dim >= 128 pairs: at 64 pairing measured no gain (d64 causal 1k 293 -> 296, 2k 372 -> 365 TFLOP/s),
// and the d64 kernels' paired instantiations spill 4-16 bytes (the producer's 24 registers, m192's 32), so d64
// compiles the plain order only.
__host__ __device__ constexpr bool MayPair(int head_dim) { return head_dim >= 128; }

// `section_budget_bytes`: the K + V bytes a non-causal section may span; <= 0: no sections (one, as causal).
// Causal problems are paired with 2..`max_paired_q_tiles` q tiles per head, or more when their K and V
// exceed `paired_kv_bytes` (< 0: never for that reason).
inline SchedulerParams MakeSchedulerParams(int num_q_tiles, int q_heads, int batch, int kv_len, int head_dim,
                                           int kv_group, bool causal,
                                           int64_t section_budget_bytes = kDefaultSectionBudgetBytes,
                                           int max_paired_q_tiles = kMaxPairedQTiles,
                                           int64_t paired_kv_bytes = kPairedKvBytes) {
  SchedulerParams sp;
  sp.num_q_tiles = num_q_tiles;
  sp.q_heads = q_heads;
  sp.total_bh = q_heads * batch;
  // K + V of one kv head; the q heads of one GQA group share it, so a section counts q heads.
  const int64_t kv_bytes = static_cast<int64_t>(kv_len) * head_dim * 2 * 2;
  int64_t section = kv_bytes > 0 && section_budget_bytes > 0 ? section_budget_bytes / kv_bytes * kv_group
                                                              : sp.total_bh;
  if (section < 1) section = 1;
  if (section > sp.total_bh || causal) section = sp.total_bh;
  sp.section_bh = static_cast<int>(section);
  sp.total_tiles = num_q_tiles * sp.total_bh;
  const int64_t all_kv_bytes = kv_bytes * (sp.total_bh / (kv_group > 0 ? kv_group : 1));
  const bool kv_past_l2 = paired_kv_bytes >= 0 && all_kv_bytes > paired_kv_bytes;
  if (causal && MayPair(head_dim) && num_q_tiles >= 2 && (num_q_tiles <= max_paired_q_tiles || kv_past_l2)) {
    sp.pairs_per_head = num_q_tiles / 2;
    sp.paired_tiles = 2 * sp.pairs_per_head * sp.total_bh;
  }
  return sp;
}

// The tile block `block` runs in round `round`, or -1 when it has none (only the last round is partial).
// Paired order: rounds 2r and 2r + 1 are the two tiles of pair r * grid + block.
template <bool kMayPair = true>
__host__ __device__ __forceinline__ int TileOfRound(const SchedulerParams& sp, int round, int block, int grid) {
  if (kMayPair && sp.pairs_per_head > 0) {
    const int pair = (round >> 1) * grid + block;
    const int t = 2 * pair + (round & 1);
    return t < sp.total_tiles ? t : -1;  // the last pair of an odd tile count has one tile
  }
  const int base = round * grid;
  const int left = sp.total_tiles - base;
  const int count = grid < left ? grid : left;
  if (block >= count) return -1;
  return base + ((round & 1) ? count - 1 - block : block);
}

template <bool kMayPair = true>
__host__ __device__ __forceinline__ TileCoord TileAt(const SchedulerParams& sp, int t) {
  if (kMayPair && sp.pairs_per_head > 0) {
    // Pairs (nq-1-i, i) head by head; with an odd nq the middle tiles follow, two heads' to a pair (again
    // nq + 1 key blocks).
    const int pair = t >> 1;
    const bool middle = t >= sp.paired_tiles;
    const int bh = middle ? t - sp.paired_tiles : pair / sp.pairs_per_head;
    const int i = middle ? sp.pairs_per_head : pair - bh * sp.pairs_per_head;
    const int q_tile = (t & 1) || middle ? i : sp.num_q_tiles - 1 - i;
    return TileCoord{q_tile, bh % sp.q_heads, bh / sp.q_heads};
  }
  const int per_section = sp.section_bh * sp.num_q_tiles;
  const int section = t / per_section;
  const int base_bh = section * sp.section_bh;
  const int left = sp.total_bh - base_bh;
  const int size = sp.section_bh < left ? sp.section_bh : left;
  const int idx = t - section * per_section;
  const int bh = base_bh + idx % size;
  return TileCoord{sp.num_q_tiles - 1 - idx / size, bh % sp.q_heads, bh / sp.q_heads};
}

}  // namespace attnd::kernels::hopper
