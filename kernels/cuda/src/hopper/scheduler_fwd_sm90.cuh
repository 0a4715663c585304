// The kernel's tile schedulers, one type per order (tile_scheduler_sm90.cuh has the orders' arithmetic), with one
// interface that the producer thread and every consumer thread use alike, round by round:
//
//   const int t = scheduler.Take(sp, round, c);   // the round's tile (-1: the end)
//   c = scheduler.Coord(sp, t, c);                // its coordinates
//
// StaticSchedulerSm90 (kStatic, kPaired) computes both from the block index and the round, and walks the split tail's
// parts (PartAt); DynamicSchedulerSm90 (kDynamic) reads the tile and its coordinates from a ring that its scheduler
// thread fills. SchedulerForSm90 picks the instantiation's.
#pragma once

#include "attnd/kernels/attention.h"
#include "mainloop_fwd_sm90_tma_wgmma_ws.cuh"  // KeyRangeFor, TileRingSm90, TileSlotsSm90
#include "tile_scheduler_sm90.cuh"

namespace attnd::kernels::hopper {

// The dynamic order's tile ring, declared only in the kernels that use it (static shared memory, whose addresses are
// constants). DynamicSchedulerSm90 asks for it, with true.
template <bool kDynamicOrder>
__device__ __forceinline__ TileRingSm90* TileRingStorage() {
  if constexpr (kDynamicOrder) {
    __shared__ TileRingSm90 ring;
    return &ring;
  } else {
    return nullptr;
  }
}

// The static orders (kStatic, kPaired): a block's tile of each round follows from its index and the round. kSplitTail:
// the rounds from sp.tail_round on are shared out by key blocks instead (TailPartAt), as the parts PartAt walks.
template <typename Tile, bool kPairedOrder, bool kSplitTail>
struct StaticSchedulerSm90 {
  static constexpr bool kPrefetchQ = false;  // ProducerSm90::LoadTile

  __device__ __forceinline__ static TileCoord TileAt(const SchedulerParams& sp, int t) {
    return kPairedOrder ? PairedTileAt(sp, t) : SectionTileAt<false>(sp, t);
  }

  // The tile of round `round`: its index in the order (-1: none left). c is left as it is: Coord computes the
  // coordinates once the caller has checked the index (computed before that check, they make other code).
  __device__ __forceinline__ int Take(const SchedulerParams& sp, int round, TileCoord&) const {
    return kPairedOrder ? PairedTileOfRound(sp, round, blockIdx.x, gridDim.x)
                        : StaticTileOfRound(sp, round, blockIdx.x, gridDim.x);
  }
  __device__ __forceinline__ static TileCoord Coord(const SchedulerParams& sp, int t, const TileCoord&) {
    return TileAt(sp, t);
  }

  // Part k of this block's share of the split tail, as producer and consumers both walk them; false past the last.
  __device__ __forceinline__ static bool PartAt(const LaunchParams& p, const SchedulerParams& sp, int k, TailPart* part) {
    const auto blocks_of = [&](int t) {
      return KeyRangeFor<Tile::kBlockM, Tile::kBlockN>(p, TileAt(sp, t).q_tile * Tile::kBlockM).n_blocks;
    };
    return TailPartAt<kPairedOrder ? 2 : 1>(sp, blockIdx.x, gridDim.x, blocks_of, k, part);
  }

  // The key blocks a part covers, in its tile's own range (masking stays that of the whole tile).
  __device__ __forceinline__ static KeyRange PartRange(const LaunchParams& p, int q0, const TailPart& part) {
    KeyRange r = KeyRangeFor<Tile::kBlockM, Tile::kBlockN>(p, q0);
    r.first = part.first;
    r.n_blocks = part.end;
    return r;
  }
};

// The dynamic order (kDynamic): a scheduler thread of its own (the producer warpgroup's second warp) takes tiles from
// the global counter and hands them to the producer and consumer threads through the tile ring (TileRingSm90).
template <typename Tile>
struct DynamicSchedulerSm90 {
  // Q's L2 prefetch pays in this order only (ProducerSm90::LoadTile).
  static constexpr bool kPrefetchQ = true;
  using TileSlots = TileSlotsSm90<Tile::kConsumerWarpgroups>;

  // Its only member, the tiles this thread has passed. With more (the parameters, the ring's address) the counter
  // gets other registers and the dynamic kernels other code, so those are arguments and a constant.
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

  // The tile of round `round` for the producer thread or a consumer thread: its index in the order (-1: the end),
  // its coordinates in c. Every reader takes every tile, in the same order (the ring's, so round is not needed).
  __device__ __forceinline__ int Take(const SchedulerParams&, int, TileCoord& c) { return slots.Take(Ring(), c); }
  __device__ __forceinline__ static TileCoord Coord(const SchedulerParams&, int, const TileCoord& c) { return c; }
};

// The scheduler of the instantiation's order (ScheduleOrder). Each order is a kernel of its own (docs/tuning.md,
// "one kernel per order"); the split tail follows a static order.
template <typename Tile, int kOrder, bool kSplitTail>
struct SchedulerForSm90 {
  static_assert(!kSplitTail || kOrder != kDynamic, "the split tail follows a static order");
  using type = StaticSchedulerSm90<Tile, kOrder == kPaired, kSplitTail>;
};
template <typename Tile>
struct SchedulerForSm90<Tile, kDynamic, false> {
  using type = DynamicSchedulerSm90<Tile>;
};

}  // namespace attnd::kernels::hopper
