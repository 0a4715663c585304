// Launch role: one launcher and one attribute setter per (tile shape, element type), gathered into the
// registry entries that fwd_*.cu instantiate.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "config_registry.h"
#include "fwd_kernel.cuh"

namespace attnd::kernels::mma_sync {

// The mma.sync kernel needs no workspace (its plans have workspace_bytes 0).
template <typename Tile, typename Elem>
cudaError_t LaunchFwd(const Plan& plan, void* /*workspace*/, cudaStream_t stream) {
  // plan.grid is (q tiles, heads, batch); the kernel takes it flattened and orders blocks itself.
  const dim3 grid(plan.grid[0] * plan.grid[1] * plan.grid[2]);
  MmaSyncFwdKernel<Tile, Elem><<<grid, Tile::kThreads, Tile::kSmemBytes, stream>>>(plan.q_map, plan.k_map,
                                                                                plan.v_map, plan.params);
  return cudaGetLastError();
}

template <typename Tile, typename Elem>
cudaError_t PrepareFwd() {
  return cudaFuncSetAttribute(MmaSyncFwdKernel<Tile, Elem>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(Tile::kSmemBytes));
}

// One block per tile: nothing to schedule and no workspace; O is written from registers: no O tensor map.
template <typename Tile>
constexpr KernelEntry Entry(const char* name) {
  KernelEntry e = TileEntry<Tile>(name, Family::kMmaSync, &LaunchFwd<Tile, __nv_bfloat16>, &LaunchFwd<Tile, __half>,
                                  &PrepareFwd<Tile, __nv_bfloat16>, &PrepareFwd<Tile, __half>);
  e.sm120 = Tile::kSm120;
  return e;
}

}  // namespace attnd::kernels::mma_sync
