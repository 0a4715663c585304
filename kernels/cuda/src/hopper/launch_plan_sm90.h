// The Hopper family's launch schedule, decided on the host when a plan is made (PlanOptions::hopper): how many
// persistent blocks, which tile order (static, paired, dynamic), whether the last round is split, and where the
// launch's scratch lies in the caller's workspace. Plain host code with no device calls, so that host tests check
// the decisions (tests/unit/kernels/hopper_scheduler_test.cc); flash_fwd_launch_sm90.cuh applies them per tile
// shape.
#pragma once

#include <cstddef>
#include <cstdint>

#include "attnd/kernels/attention.h"
#include "tile_scheduler_sm90.cuh"

namespace attnd::kernels::hopper {

// The defaults of HopperScheduleOptions (a public header) are the scheduler's constants.
static_assert(HopperScheduleOptions{}.l2_section_bytes == kDefaultSectionBudgetBytes);
static_assert(HopperScheduleOptions{}.paired_kv_bytes == kPairedKvBytes);
static_assert(HopperScheduleOptions{}.max_paired_q_tiles == kMaxPairedQTiles);
static_assert(HopperScheduleOptions{}.tail_tiles_per_block == kDefaultTailTilesPerBlock);
static_assert(HopperScheduleOptions{}.dynamic_min_tiles_per_block == kDynamicMinTilesPerBlock);

// What the decision reads of the problem, the configuration and the device.
struct ScheduleInputs {
  int num_q_tiles = 0, q_heads = 0, batch = 0;  // the plan's tile space
  int kv_len = 0, group = 1;                    // group: q heads per kv head
  bool causal = false;
  int head_dim = 0, block_n = 0;
  bool may_run_dynamic = false;  // the configuration has the dynamic-order kernel
  bool may_split_tail = false;   // the configuration has the split-tail kernels (MaySplitTail)
  int sms = 0;                   // multiprocessors of the device
};

struct ScheduleDecision {
  SchedulerParams sp;  // with the tail fields set when split_tail; workspace pointers null
  int blocks = 0;
  ScheduleOrder order = kStatic;
  bool split_tail = false;
  int split_tiles = 0;  // tiles of the split tail (each has its counters)
};

inline ScheduleDecision DecideSchedule(const ScheduleInputs& in, const HopperScheduleOptions& o) {
  ScheduleDecision d;
  const int64_t tiles = int64_t{in.num_q_tiles} * in.q_heads * in.batch;
  d.blocks = static_cast<int>(tiles < in.sms ? tiles : in.sms);
  if (o.max_blocks > 0 && d.blocks > o.max_blocks) d.blocks = o.max_blocks;
  // Causal problems with few tiles per block keep the static order: taken longest first, a few tiles per block
  // leave blocks far apart at the end (docs/tuning.md, "dynamic order").
  const bool dynamic = in.may_run_dynamic && in.causal && o.causal_order == CausalOrder::kDynamic &&
                       tiles >= int64_t{o.dynamic_min_tiles_per_block} * d.blocks;
  d.sp = MakeSchedulerParams(in.num_q_tiles, in.q_heads, in.batch, in.kv_len, in.head_dim, in.group, in.causal,
                             o.l2_section_bytes, o.max_paired_q_tiles, o.paired_kv_bytes, dynamic, d.blocks,
                             o.tail_tiles_per_block);
  if (dynamic) {
    d.order = kDynamic;
    return d;
  }
  const bool paired = d.sp.pairs_per_head > 0;
  d.order = paired ? kPaired : kStatic;
  // The split tail follows the static orders: without a mask, and causal in pairs (the causal snake's last round
  // holds its shortest tiles, which splitting would gain little on).
  if (!in.may_split_tail || o.split_tail == SplitTail::kOff || (in.causal && !paired)) return d;
  const int kv_blocks = (in.kv_len + in.block_n - 1) / in.block_n;
  // A pair's two tiles see about one tile's keys plus one block between them.
  const int unit_blocks = paired ? kv_blocks + 1 : kv_blocks;
  const bool force = o.split_tail == SplitTail::kAlways;
  const TailSplit ts = PlanTailSplit(d.sp, d.blocks, unit_blocks, force ? 1 : SplitTailMinBlocks(in.block_n), force);
  if (ts.units == 0) return d;
  d.split_tail = true;
  d.sp.tail_units = ts.units;
  d.sp.tail_round = ts.round;
  d.sp.tail_tile = ts.tile;
  d.split_tiles = ts.units * (paired ? 2 : 1);
  return d;
}

// Where a launch's scratch lies in its workspace: the counters first, each piece 256-byte aligned (cudaMalloc's
// alignment, and no two pieces share a cache line).
constexpr size_t kWorkspaceAlign = 256;
constexpr size_t kTileCounterBytes = 2 * sizeof(unsigned);  // SchedulerParams::counter: [0] tiles taken, [1] done

struct WorkspaceLayout {
  size_t tile_counters = LaunchSchedule::kNoOffset;
  size_t split_counters = LaunchSchedule::kNoOffset;
  size_t split_partials = LaunchSchedule::kNoOffset;
  size_t bytes = 0;  // 0: the launch needs no workspace
};

inline WorkspaceLayout LayOutWorkspace(bool dynamic, size_t split_counter_bytes, size_t split_partial_bytes) {
  WorkspaceLayout w;
  const auto take = [&w](size_t bytes) {
    const size_t at = w.bytes;
    w.bytes = (at + bytes + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign;
    return at;
  };
  if (dynamic) w.tile_counters = take(kTileCounterBytes);
  if (split_counter_bytes > 0) w.split_counters = take(split_counter_bytes);
  if (split_partial_bytes > 0) w.split_partials = take(split_partial_bytes);
  return w;
}

}  // namespace attnd::kernels::hopper
