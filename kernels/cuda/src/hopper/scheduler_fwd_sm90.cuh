// The dynamic order's tile scheduler as a type (tile_scheduler_sm90.cuh has the orders' arithmetic): its shared tile
// ring, its scheduler thread, and the tiles the producer thread and the consumer threads take from the ring. The
// static orders' tiles follow from the block index and the round (TileOfRoundFor in flash_fwd_kernel_sm90.cuh).
#pragma once

#include "mainloop_fwd_sm90_tma_wgmma_ws.cuh"  // TileRingSm90, TileSlotsSm90
#include "tile_scheduler_sm90.cuh"

namespace attnd::kernels::hopper {

// The dynamic order's tile ring, declared only in the kernels that use it (static shared memory, whose addresses are
// constants). Only DynamicSchedulerSm90 asks for it, with true.
template <bool kDynamicOrder>
__device__ __forceinline__ TileRingSm90* TileRingStorage() {
  if constexpr (kDynamicOrder) {
    __shared__ TileRingSm90 ring;
    return &ring;
  } else {
    return nullptr;
  }
}

// The dynamic order (kDynamic): a scheduler thread of its own (the producer warpgroup's second warp) takes tiles from
// the global counter and hands them to the producer and consumer threads through the tile ring (TileRingSm90).
template <typename Tile>
struct DynamicSchedulerSm90 {
  // Q's L2 prefetch pays in this order only (ProducerSm90::LoadTile).
  static constexpr bool kPrefetchQ = true;
  using TileSlots = TileSlotsSm90<Tile::kConsumerWarpgroups>;

  // Its only member, the tiles this thread has passed: with the parameters or the ring's address beside it, the
  // counter's registers came out in another order and the dynamic kernels' code changed.
  TileSlots slots;

  // The ring: static shared memory, a constant address.
  __device__ __forceinline__ static TileRingSm90& Ring() { return *TileRingStorage<true>(); }

  // Before the block's __syncthreads (one thread).
  __device__ __forceinline__ static void InitSharedStorage() { TileSlots::Init(Ring()); }

  // The scheduler thread: blocks start on tiles 0..grid-1 and the counter hands out the rest, each taken when the
  // ring has room (up to two tiles ahead of the consumers).
  __device__ __forceinline__ void RunSchedulerThread(const SchedulerParams& sp) {
    const auto decode = [&](int t) { return SectionTileAt<true>(sp, t); };
    if (slots.Put(Ring(), [] { return static_cast<int>(blockIdx.x); }, decode) >= 0) {
      while (slots.Put(Ring(), [&] { return TakeDynamicTile(sp); }, decode) >= 0) {
      }
    }
    FinishDynamicTiles(sp);
  }

  // The next tile for the producer thread or a consumer thread: its index in the order (-1: the end) and its
  // coordinates in c. Every reader takes every tile, in the same order.
  __device__ __forceinline__ int Take(TileCoord& c) { return slots.Take(Ring(), c); }
};

}  // namespace attnd::kernels::hopper
