// Launch role of the Hopper family: one launcher and one attribute setter per (tile shape, element type),
// gathered into registry entries. The plan's grid (q_tiles, heads, batch) is the tile space; the launcher
// turns it into a persistent grid of at most one block per SM.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string_view>
#include <type_traits>

#include "../config_registry.h"
#include "flash_fwd_kernel_sm90.cuh"
#include "split_tail_pool.h"
#include "tile_counter_pool.h"
#include "tile_scheduler_sm90.cuh"
#include "tile_size_sm90.h"

namespace attnd::kernels::hopper {

// Tuning knobs, read from the environment once per process (benchmarks sweep one run per value): a
// non-negative integer below `limit`, or -1 when unset or malformed.
inline int64_t EnvCount(const char* name, int64_t limit) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return -1;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  return (*end == '\0' && n >= 0 && n < limit) ? static_cast<int64_t>(n) : -1;
}

// A knob's value: the environment's, or `fallback` when unset or malformed.
inline int64_t EnvCountOr(const char* name, int64_t limit, int64_t fallback) {
  const int64_t v = EnvCount(name, limit);
  return v >= 0 ? v : fallback;
}

// The non-causal L2 section budget: kDefaultSectionBudgetBytes, or ATTND_HOPPER_L2_SECTION_MB for tuning runs
// (0: no sections).
inline int64_t SectionBudgetBytes() {
  static const int64_t budget = [] {
    const int64_t mb = EnvCount("ATTND_HOPPER_L2_SECTION_MB", int64_t{1} << 20);
    return mb >= 0 ? mb << 20 : kDefaultSectionBudgetBytes;
  }();
  return budget;
}

// ATTND_HOPPER_PAIR_MAX_QTILES: the longest causal problem (q tiles per head) paired for its length alone, for
// tuning runs (unset: kMaxPairedQTiles; 0: none; the K/V-size rule below still applies).
inline int MaxPairedQTiles() {
  static const int n = static_cast<int>(EnvCountOr("ATTND_HOPPER_PAIR_MAX_QTILES", 1 << 20, kMaxPairedQTiles));
  return n;
}

// ATTND_HOPPER_PAIR_KV_MB: longer causal problems are paired when their K and V exceed this many MiB, for
// tuning runs (unset: kPairedKvBytes; a huge value: never).
inline int64_t PairedKvBytes() {
  static const int64_t bytes = [] {
    const int64_t mb = EnvCount("ATTND_HOPPER_PAIR_KV_MB", int64_t{1} << 30);
    return mb >= 0 ? mb << 20 : kPairedKvBytes;
  }();
  return bytes;
}

// ATTND_HOPPER_MAX_BLOCKS caps the persistent grid (unset or 0: one block per SM). For tests: with a few
// blocks, small shapes make every block run several tiles, the path the tile-to-tile handover takes.
inline int MaxBlocksOverride() {
  static const int cap = static_cast<int>(std::max<int64_t>(0, EnvCount("ATTND_HOPPER_MAX_BLOCKS", 1 << 20)));
  return cap;
}

// ATTND_HOPPER_SCHEDULE: how causal head_dim-64 problems find their tiles, for A/B runs: "dynamic" (a tile
// counter; the default) or "static" (the snake of session 5). Problems without a mask always run the static
// order: their tiles cost the same, so taking them dynamically balances nothing.
inline bool DynamicCausalSchedule() {
  static const bool dynamic = [] {
    const char* v = std::getenv("ATTND_HOPPER_SCHEDULE");
    return v == nullptr || std::string_view(v) != "static";
  }();
  return dynamic;
}

// ATTND_HOPPER_TAIL_TILES: the dynamic schedule's last-section length (tile_scheduler_sm90.cuh), for tuning runs.
inline int TailTilesPerBlock() {
  static const int n = static_cast<int>(EnvCountOr("ATTND_HOPPER_TAIL_TILES", 1 << 10, kDefaultTailTilesPerBlock));
  return n;
}

// Causal problems with fewer tiles than this many per block keep the static order: with a few tiles per block,
// taking them longest first leaves blocks far apart at the end (host model: 1k, 32 heads, 2 tiles per block:
// 29% over the mean, where pairs are 3%; 4k, 7.8 per block, even). ATTND_HOPPER_DYNAMIC_MIN_TILES for tuning.
inline int DynamicMinTilesPerBlock() {
  static const int n =
      static_cast<int>(EnvCountOr("ATTND_HOPPER_DYNAMIC_MIN_TILES", 1 << 20, kDynamicMinTilesPerBlock));
  return n;
}

// ATTND_HOPPER_SPLIT_TAIL: 0 never splits the last round (A/B runs); 2 splits it whenever the shape allows (tests:
// with ATTND_HOPPER_MAX_BLOCKS a few blocks run split tails on small problems); unset or 1: where it pays
// (PlanTailSplit).
inline int SplitTailMode() {
  static const int mode = static_cast<int>(EnvCountOr("ATTND_HOPPER_SPLIT_TAIL", 3, 1));
  return mode;
}

// The configurations compiled with a split tail: the defaults of head_dim 128 and 256 (kernel_registry_test checks
// auto's choices against the entries' `split_tail`). Each is two more kernels per element type (static and paired);
// the others would add build time for configurations auto does not pick.
// s3 `_osk_p2` became auto's d128 kernel in v21 without joining this list, so d128 ran whole last rounds until v29
// (session 21, six processes, in-process A/B on the rows that split: non-causal 16k +3.5%, GQA +2.7%, causal 16k
// +1.4%, GQA +1.3%, each ahead in 5-6 of 6; causal 8k -0.6%, 0 of 6; rows too short to split, i.e. the same
// kernels, read 0.999 to 1.019).
template <typename Tile, typename Elem>
constexpr bool MaySplitTail() {
  return Tile::kSplitTail;
}

// Whether `stream` is being captured into a CUDA graph: the dynamic schedule's slot events cannot be waited
// on from inside a capture, so captured launches run the static order.
inline bool Capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  return cudaStreamIsCapturing(stream, &status) == cudaSuccess && status != cudaStreamCaptureStatusNone;
}

// What a launch of `plan` runs: the persistent grid (at most one block per SM) and the tile order. The trace
// tool (kernels/cuda/tools/hopper_trace.cu) mirrors launches with it. `may_run_dynamic`: the instantiation has
// the dynamic order and this launch may use it.
struct LaunchSchedule {
  SchedulerParams sp;
  int blocks = 0;
  bool dynamic = false;
};

// The split of the last round a static or paired launch would run (units == 0: none): non-causal problems, and
// causal ones in pairs (the LPT snake's last round holds its shortest tiles, which split would gain little).
inline TailSplit TailSplitFor(const Plan& plan, const LaunchSchedule& ls, int block_n) {
  const LaunchParams& lp = plan.params;
  const int mode = SplitTailMode();
  if (mode == 0 || ls.dynamic || (lp.causal != 0 && ls.sp.pairs_per_head == 0)) return TailSplit{};
  const int kv_blocks = (lp.kv_len + block_n - 1) / block_n;
  // A pair's two tiles see about one tile's keys plus one block between them.
  const int unit_blocks = ls.sp.pairs_per_head > 0 ? kv_blocks + 1 : kv_blocks;
  return PlanTailSplit(ls.sp, ls.blocks, unit_blocks, mode == 2 ? 1 : SplitTailMinBlocks(block_n), mode == 2);
}
inline LaunchSchedule ScheduleFor(const Plan& plan, int head_dim, bool may_run_dynamic, int sms) {
  const LaunchParams& lp = plan.params;
  const int64_t tiles = int64_t{plan.grid[0]} * plan.grid[1] * plan.grid[2];
  LaunchSchedule ls;
  ls.blocks = static_cast<int>(tiles < sms ? tiles : sms);
  if (const int cap = MaxBlocksOverride(); cap > 0 && ls.blocks > cap) ls.blocks = cap;
  ls.dynamic = may_run_dynamic && lp.causal != 0 && DynamicCausalSchedule() &&
               tiles >= int64_t{DynamicMinTilesPerBlock()} * ls.blocks;
  ls.sp = MakeSchedulerParams(static_cast<int>(plan.grid[0]), static_cast<int>(plan.grid[1]),
                              static_cast<int>(plan.grid[2]), lp.kv_len, head_dim, lp.group, lp.causal != 0,
                              SectionBudgetBytes(), MaxPairedQTiles(), PairedKvBytes(), ls.dynamic, ls.blocks,
                              TailTilesPerBlock());
  return ls;
}

// One launch of the instantiation for (kOrder, kSplitTail): with the shared-memory epilogue, the kernel that takes
// the O map (plan.o_map: Entry's o_box_rows makes MapKeys ask for it).
template <typename Tile, typename Elem, int kOrder, bool kSplitTail = false>
cudaError_t LaunchKernel(const Plan& plan, int blocks, cudaStream_t stream, const SchedulerParams& sp) {
  if constexpr (Tile::kSmemEpilogue) {
    HopperFwdKernelO<Tile, Elem, kOrder, kSplitTail><<<blocks, Tile::kThreads, Tile::kSmemBytes, stream>>>(
        plan.q_map, plan.k_map, plan.v_map, plan.o_map, plan.params, sp);
  } else {
    HopperFwdKernel<Tile, Elem, kOrder, kSplitTail><<<blocks, Tile::kThreads, Tile::kSmemBytes, stream>>>(
        plan.q_map, plan.k_map, plan.v_map, plan.params, sp);
  }
  return cudaGetLastError();
}

// The same instantiation's dynamic shared-memory limit raised to the tile's.
template <typename Tile, typename Elem, int kOrder, bool kSplitTail = false>
cudaError_t RaiseSmemLimit() {
  constexpr int kSmem = static_cast<int>(Tile::kSmemBytes);
  if constexpr (Tile::kSmemEpilogue) {
    return cudaFuncSetAttribute(HopperFwdKernelO<Tile, Elem, kOrder, kSplitTail>,
                                cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  } else {
    return cudaFuncSetAttribute(HopperFwdKernel<Tile, Elem, kOrder, kSplitTail>,
                                cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  }
}

template <typename Tile, typename Elem>
cudaError_t LaunchFwd(const Plan& plan, cudaStream_t stream) {
  int sms = 0;
  const cudaError_t err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, plan.device);
  if (err != cudaSuccess) return err;
  constexpr bool kMayRunDynamic = MayRunDynamic(Tile::kHeadDim);
  // Capturing is asked last: only launches that would run the dynamic order pay for the call.
  LaunchSchedule ls = ScheduleFor(plan, Tile::kHeadDim, kMayRunDynamic, sms);
  if (ls.dynamic && Capturing(stream)) ls = ScheduleFor(plan, Tile::kHeadDim, false, sms);
  SchedulerParams& sp = ls.sp;
  const int blocks = ls.blocks;
  if constexpr (kMayRunDynamic) {
    if (ls.dynamic) {
      TileCounterLease lease;
      if (const cudaError_t e = lease.Begin(plan.device, stream); e != cudaSuccess) return e;
      sp.counter = lease.counter();
      const cudaError_t launched = LaunchKernel<Tile, Elem, kDynamic>(plan, blocks, stream, sp);
      const cudaError_t finished = lease.Finish(stream);
      return launched != cudaSuccess ? launched : finished;
    }
  }
  if constexpr (MaySplitTail<Tile, Elem>()) {
    const TailSplit ts = TailSplitFor(plan, ls, Tile::kBlockN);
    // Like the dynamic order's slots, the workspace's events cannot be waited on inside a graph capture.
    if (ts.units > 0 && !Capturing(stream)) {
      constexpr int kWarps = 4 * Tile::kConsumerWarpgroups;
      const int split_tiles = ts.units * (sp.pairs_per_head > 0 ? 2 : 1);
      SplitTailLease lease;
      if (const cudaError_t e = lease.Begin(plan.device, stream, TailWorkspaceBytes<Tile::kHeadDim, kWarps>(blocks),
                                            TailCounterBytes<kWarps>(split_tiles));
          e != cudaSuccess) {
        return e;
      }
      sp.tail_units = ts.units;
      sp.tail_round = ts.round;
      sp.tail_tile = ts.tile;
      sp.split_ws = lease.workspace();
      sp.split_counters = lease.counters();
      const cudaError_t launched = sp.pairs_per_head > 0
                                       ? LaunchKernel<Tile, Elem, kPaired, true>(plan, blocks, stream, sp)
                                       : LaunchKernel<Tile, Elem, kStatic, true>(plan, blocks, stream, sp);
      const cudaError_t finished = lease.Finish(stream);
      return launched != cudaSuccess ? launched : finished;
    }
  }
  if constexpr (MayPair(Tile::kHeadDim)) {
    if (sp.pairs_per_head > 0) return LaunchKernel<Tile, Elem, kPaired>(plan, blocks, stream, sp);
  }
  return LaunchKernel<Tile, Elem, kStatic>(plan, blocks, stream, sp);
}

// The split tail's workspace for the largest launch this device runs (a block per SM; the paired order's last
// round at most 2 tiles a block), so that no launch allocates.
template <typename Tile>
cudaError_t ReserveSplitTailPoolFor() {
  int device = 0, sms = 0;
  if (const cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  const cudaError_t err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  constexpr int kWarps = 4 * Tile::kConsumerWarpgroups;
  return ReserveSplitTailPool(device, TailWorkspaceBytes<Tile::kHeadDim, kWarps>(sms),
                              TailCounterBytes<kWarps>(2 * sms));
}

// Once per (configuration, element type, device): the shared-memory limit of every instantiation the launcher
// may pick, and the device's tile-counter pool.
template <typename Tile, typename Elem>
cudaError_t PrepareFwd() {
  if constexpr (MayRunDynamic(Tile::kHeadDim)) {
    if (const cudaError_t err = RaiseSmemLimit<Tile, Elem, kDynamic>(); err != cudaSuccess) return err;
    int device = 0;
    if (const cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
    if (const cudaError_t err = EnsureTileCounterPool(device); err != cudaSuccess) return err;
  }
  if constexpr (MayPair(Tile::kHeadDim)) {
    if (const cudaError_t err = RaiseSmemLimit<Tile, Elem, kPaired>(); err != cudaSuccess) return err;
  }
  if constexpr (MaySplitTail<Tile, Elem>()) {
    if (const cudaError_t err = RaiseSmemLimit<Tile, Elem, kPaired, true>(); err != cudaSuccess) return err;
    if (const cudaError_t err = RaiseSmemLimit<Tile, Elem, kStatic, true>(); err != cudaSuccess) return err;
    if (const cudaError_t err = ReserveSplitTailPoolFor<Tile>(); err != cudaSuccess) return err;
  }
  return RaiseSmemLimit<Tile, Elem, kStatic>();
}

template <typename Tile>
constexpr KernelEntry Entry(const char* name) {
  return KernelEntry{name,
                     Family::kHopper,
                     Tile::kHeadDim,
                     Tile::kBlockM,
                     Tile::kBlockN,
                     Tile::kStages,
                     Tile::kThreads,
                     Tile::kSmemBytes,
                     false,
                     {&LaunchFwd<Tile, __nv_bfloat16>, &LaunchFwd<Tile, __half>},
                     {&PrepareFwd<Tile, __nv_bfloat16>, &PrepareFwd<Tile, __half>},
                     Tile::kSmemEpilogue ? 64 : 0,  // the epilogue's TMA boxes: one warpgroup's 64 rows
                     MaySplitTail<Tile, __nv_bfloat16>()};
}

}  // namespace attnd::kernels::hopper
