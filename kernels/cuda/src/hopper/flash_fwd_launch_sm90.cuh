// Launch role of the Hopper family, gathered into registry entries: per tile shape the plan-time schedule (the
// plan's grid (q_tiles, heads, batch) is the tile space, run by a persistent grid of at most one block per SM), and
// per (tile shape, element type) a launcher and an attribute setter.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstring>
#include <type_traits>

#include "../config_registry.h"
#include "flash_fwd_kernel_sm90.cuh"
#include "fp8_sm90.cuh"
#include "launch_plan_sm90.h"
#include "split_tail_sm90.cuh"
#include "tile_scheduler_sm90.cuh"
#include "tile_size_sm90.h"

namespace attnd::kernels::hopper {

// Whether the configuration is compiled with a split last round (its trait's kSplitTail: auto's at head_dim 128 and
// 256; kernel_registry_test checks auto's choices against the entries' `split_tail`). Each is two more kernels per
// element type (static and paired).
template <typename Tile>
constexpr bool MaySplitTail() {
  return Tile::kSplitTail;
}

// Whether the configuration has the dynamic-order kernel: head_dim 64 (MayRunDynamic).
template <typename Tile>
constexpr bool MayRunDynamicTile() {
  return MayRunDynamic(Tile::kHeadDim);
}

// Plan time: the schedule of `plan` (its params and grid filled in) on a device of `sms` multiprocessors, and the
// workspace it needs.
template <typename Tile>
void PlanScheduleFwd(const HopperScheduleOptions& options, int sms, Plan* plan) {
  const LaunchParams& lp = plan->params;
  ScheduleInputs in;
  in.num_q_tiles = static_cast<int>(plan->grid[0]);
  in.q_heads = static_cast<int>(plan->grid[1]);
  in.batch = static_cast<int>(plan->grid[2]);
  in.kv_len = lp.kv_len;
  in.group = lp.group;
  in.causal = lp.causal != 0;
  in.head_dim = Tile::kHeadDim;
  in.block_n = Tile::kBlockN;
  in.may_run_dynamic = MayRunDynamicTile<Tile>();
  in.may_split_tail = MaySplitTail<Tile>();
  in.sms = sms;
  const ScheduleDecision d = DecideSchedule(in, options);
  constexpr int kWarps = 4 * Tile::kConsumerWarpgroups;
  const WorkspaceLayout w =
      LayOutWorkspace(d.order == kDynamic, d.split_tail ? TailCounterBytes<kWarps>(d.split_tiles) : 0,
                      d.split_tail ? TailWorkspaceBytes<Tile::kHeadDim, kWarps>(d.blocks) : 0);
  LaunchSchedule& s = plan->schedule;
  s.blocks = d.blocks;
  s.order = d.order;
  s.split_tail = d.split_tail;
  s.tile_counters = w.tile_counters;
  s.split_counters = w.split_counters;
  s.split_partials = w.split_partials;
  static_assert(std::is_trivially_copyable_v<SchedulerParams> && sizeof(SchedulerParams) <= sizeof(s.scheduler),
                "LaunchSchedule::scheduler holds a SchedulerParams");
  std::memcpy(s.scheduler, &d.sp, sizeof(SchedulerParams));
  plan->workspace_bytes = w.bytes;
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

// The plan's SchedulerParams with the workspace pointers its schedule uses (the dynamic order's tile counters, the
// split tail's counters and partials) pointing into `workspace`; the others stay null. The tail fields were set at
// plan time. Shared by LaunchFwd and tools that launch their own instantiations on a plan's schedule.
inline SchedulerParams BoundScheduler(const Plan& plan, void* workspace) {
  const LaunchSchedule& s = plan.schedule;
  SchedulerParams sp;
  std::memcpy(&sp, s.scheduler, sizeof(SchedulerParams));
  unsigned char* const ws = static_cast<unsigned char*>(workspace);
  if (s.order == kDynamic) sp.counter = reinterpret_cast<unsigned*>(ws + s.tile_counters);
  if (s.split_tail) {
    sp.split_ws = reinterpret_cast<float*>(ws + s.split_partials);
    sp.split_counters = reinterpret_cast<unsigned*>(ws + s.split_counters);
  }
  return sp;
}

// Launch time: the plan's schedule as it was decided, with the caller's workspace (Launch checked that it is there
// when the plan needs it). Its counters are zero, as every launch leaves them: the dynamic order's last block zeroes
// the tile counters (FinishDynamicTiles), and the warp that finishes a split tile zeroes that tile's counters
// (StoreTailPartSm90; a tile run whole never touches its own). Nothing here allocates or waits on an event, so a
// captured launch runs the same schedule as a direct one, and its graph replays correctly one at a time per
// workspace.
// Float8: V^T first (fp8_sm90.cuh), on the same stream.
template <typename Tile, typename Elem>
cudaError_t LaunchFwd(const Plan& plan, void* workspace, cudaStream_t stream) {
  const LaunchSchedule& s = plan.schedule;
  const SchedulerParams sp = BoundScheduler(plan, workspace);
  if constexpr (Tile::kFp8) {
    if (const cudaError_t err = LaunchVTransposeFp8(plan.v_transpose, stream); err != cudaSuccess) return err;
  }
  if constexpr (MayRunDynamicTile<Tile>()) {
    if (s.order == kDynamic) return LaunchKernel<Tile, Elem, kDynamic>(plan, s.blocks, stream, sp);
  }
  if constexpr (MaySplitTail<Tile>()) {
    if (s.split_tail) {
      return s.order == kPaired ? LaunchKernel<Tile, Elem, kPaired, true>(plan, s.blocks, stream, sp)
                                : LaunchKernel<Tile, Elem, kStatic, true>(plan, s.blocks, stream, sp);
    }
  }
  if constexpr (MayPair(Tile::kHeadDim)) {
    if (s.order == kPaired) return LaunchKernel<Tile, Elem, kPaired>(plan, s.blocks, stream, sp);
  }
  return LaunchKernel<Tile, Elem, kStatic>(plan, s.blocks, stream, sp);
}

// Once per (configuration, element type, device): the shared-memory limit of every instantiation the launcher
// may pick.
template <typename Tile, typename Elem>
cudaError_t PrepareFwd() {
  if constexpr (MayRunDynamicTile<Tile>()) {
    if (const cudaError_t err = RaiseSmemLimit<Tile, Elem, kDynamic>(); err != cudaSuccess) return err;
  }
  if constexpr (MayPair(Tile::kHeadDim)) {
    if (const cudaError_t err = RaiseSmemLimit<Tile, Elem, kPaired>(); err != cudaSuccess) return err;
  }
  if constexpr (MaySplitTail<Tile>()) {
    if (const cudaError_t err = RaiseSmemLimit<Tile, Elem, kPaired, true>(); err != cudaSuccess) return err;
    if (const cudaError_t err = RaiseSmemLimit<Tile, Elem, kStatic, true>(); err != cudaSuccess) return err;
  }
  return RaiseSmemLimit<Tile, Elem, kStatic>();
}

template <typename Tile>
constexpr KernelEntry Entry(const char* name) {
  KernelEntry e{};
  if constexpr (Tile::kFp8) {
    e = TileEntry<Tile>(name, Family::kHopper, nullptr, nullptr, nullptr, nullptr);
    e.launch[static_cast<int>(DType::kFP8E4M3)] = &LaunchFwd<Tile, __nv_fp8_e4m3>;
    e.prepare[static_cast<int>(DType::kFP8E4M3)] = &PrepareFwd<Tile, __nv_fp8_e4m3>;
    e.fp8 = true;
  } else {
    e = TileEntry<Tile>(name, Family::kHopper, &LaunchFwd<Tile, __nv_bfloat16>, &LaunchFwd<Tile, __half>,
                        &PrepareFwd<Tile, __nv_bfloat16>, &PrepareFwd<Tile, __half>);
  }
  e.plan_schedule = &PlanScheduleFwd<Tile>;
  e.o_box_rows = Tile::kSmemEpilogue ? 64 : 0;  // the epilogue's TMA boxes: one warpgroup's 64 rows
  e.split_tail = MaySplitTail<Tile>();
  return e;
}

}  // namespace attnd::kernels::hopper
