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

#include "../config_registry.h"
#include "flash_fwd_kernel_sm90.cuh"
#include "tile_scheduler_sm90.cuh"

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
  static const int n = [] {
    const int64_t v = EnvCount("ATTND_HOPPER_PAIR_MAX_QTILES", 1 << 20);
    return v >= 0 ? static_cast<int>(v) : kMaxPairedQTiles;
  }();
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

template <typename Tile, typename Elem>
cudaError_t LaunchFwd(const Plan& plan, cudaStream_t stream) {
  int sms = 0;
  const cudaError_t err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, plan.device);
  if (err != cudaSuccess) return err;
  const LaunchParams& lp = plan.params;
  const SchedulerParams sp =
      MakeSchedulerParams(static_cast<int>(plan.grid[0]), static_cast<int>(plan.grid[1]),
                          static_cast<int>(plan.grid[2]), lp.kv_len, Tile::kHeadDim, lp.group, lp.causal != 0,
                          SectionBudgetBytes(), MaxPairedQTiles(), PairedKvBytes());
  int blocks = sp.total_tiles < sms ? sp.total_tiles : sms;
  if (const int cap = MaxBlocksOverride(); cap > 0 && blocks > cap) blocks = cap;
  if constexpr (MayPair(Tile::kHeadDim)) {
    if (sp.pairs_per_head > 0) {
      HopperFwdKernel<Tile, Elem, true><<<blocks, Tile::kThreads, Tile::kSmemBytes, stream>>>(
          plan.q_map, plan.k_map, plan.v_map, lp, sp);
      return cudaGetLastError();
    }
  }
  HopperFwdKernel<Tile, Elem, false><<<blocks, Tile::kThreads, Tile::kSmemBytes, stream>>>(plan.q_map, plan.k_map,
                                                                                          plan.v_map, lp, sp);
  return cudaGetLastError();
}

template <typename Tile, typename Elem>
cudaError_t PrepareFwd() {
  const int smem = static_cast<int>(Tile::kSmemBytes);
  if constexpr (MayPair(Tile::kHeadDim)) {
    const cudaError_t err =
        cudaFuncSetAttribute(HopperFwdKernel<Tile, Elem, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return err;
  }
  return cudaFuncSetAttribute(HopperFwdKernel<Tile, Elem, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
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
                     {&PrepareFwd<Tile, __nv_bfloat16>, &PrepareFwd<Tile, __half>}};
}

}  // namespace attnd::kernels::hopper
