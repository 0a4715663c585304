// The consumer loop's two epilogues as types with one interface (the store primitives are in epilogue_fwd_sm90.cuh
// and split_tail_sm90.cuh):
//
//   consumer.Run(p, r, row0, o, sm, Epilogue::AfterFirst(o_stage, o_empty));  // the mainloop's hook
//   Epilogue::Store(...);      // a whole tile's O and LSE, once per tile, after the mainloop (or none: zero O);
//                              // at one site after both cases, or in each (kOneStoreSite)
//   Epilogue::StorePart(...);  // a split-tail part's, through the split tail's combine
//   Epilogue::Finish();        // once per block, before it exits
//
// The state they share across tiles (the shared-memory epilogue's stage still being stored from) stays a local of
// the kernel body, passed in: a member of an epilogue object would change the order of the loop's registers, and
// with it the kernels' code.
#pragma once

#include <cstdint>

#include "attnd/kernels/attention.h"
#include "epilogue_fwd_sm90.cuh"
#include "mainloop_fwd_sm90_tma_wgmma_ws.cuh"
#include "named_barrier_sm90.h"
#include "softmax_sm90.cuh"
#include "split_tail_sm90.cuh"
#include "tile_scheduler_sm90.cuh"

namespace attnd::kernels::hopper {

// Shared-memory epilogue: hands the stage that held this warpgroup's O (o_stage; -1: none) back to the producer
// once the TMA store has read it (`empty`: the V ring's barriers; with split O stages the K ring's, followed by the
// V ring's, o_stage indexing both). The storing thread waits for that and arrives for the warpgroup's four warps.
__device__ __forceinline__ void ReleaseOStage(int& o_stage, uint64_t* empty) {
  if (o_stage < 0) return;
  if ((threadIdx.x & 127) == 0) {
    BulkWaitRead();
    common::MbarArriveCount(&empty[o_stage], 4);
  }
  o_stage = -1;
}

// A split-tail part's output: a part that covers its whole tile stores it as a tile would, any other goes through the
// workspace and the combine (StoreTailPartSm90). k: the part's index among the block's; wg, warp: the consumer
// warpgroup and its warp. The workspace slot and warp index are computed where they are used (computed before the
// branch, they made other code).
template <typename Tile, typename Elem, bool kVectorStores>
__device__ __forceinline__ void StorePartSm90(const LaunchParams& p, const SchedulerParams& sp, const TailPart& part,
                                              int k, float (&o)[Tile::kHeadDim / 2],
                                              SoftmaxSm90<Tile::kBlockN>& sm, int row0, const TileCoord& c, int wg,
                                              int warp) {
  if (part.first == 0 && part.end == part.tile_blocks) {
    StoreOutputSm90<Tile::kHeadDim, Elem, Tile::kBlockN, kVectorStores>(p, o, sm, row0, c.head, c.batch);
  } else {
    StoreTailPartSm90<Tile::kHeadDim, Elem, Tile::kBlockN, 4 * Tile::kConsumerWarpgroups, kVectorStores>(
        p, sp, part, blockIdx.x * kMaxTailPartsPerBlock + k, o, sm, row0, c.head, c.batch, wg * 4 + warp);
  }
}

// Registers to global memory (StoreOutputSm90). No state, no hook in the mainloop.
template <typename Tile, typename Elem>
struct EpilogueRegSm90 {
  // The same store with or without key blocks: one call site, after both (a call in each branch put its code in the
  // kernel twice).
  static constexpr bool kOneStoreSite = true;
  __device__ __forceinline__ static NoOp AfterFirst(int&, uint64_t*) { return NoOp{}; }

  // ran: false for a tile without key blocks (o is zero); the same store either way.
  template <typename Consumer>
  __device__ __forceinline__ static void Store(const LaunchParams& p, const float (&o)[Tile::kHeadDim / 2],
                                               const SoftmaxSm90<Tile::kBlockN>& sm, int row0, int q0,
                                               const TileCoord& c, const Consumer& consumer,
                                               const SharedStorageSm90<Tile>&, const CUtensorMap*, int&, bool) {
    // Shifted tiles: a warpgroup whose rows lie before 0 has nothing to store (the epilogue checks only the end).
    if (!Tile::kWgRanges || q0 + consumer.wg * 64 >= 0) {
      StoreOutputSm90<Tile::kHeadDim, Elem, Tile::kBlockN>(p, o, sm, row0, c.head, c.batch);
    }
  }

  __device__ __forceinline__ static void StorePart(const LaunchParams& p, const SchedulerParams& sp,
                                                   const TailPart& part, int k, float (&o)[Tile::kHeadDim / 2],
                                                   SoftmaxSm90<Tile::kBlockN>& sm, int row0, const TileCoord& c,
                                                   int wg, int warp) {
    StorePartSm90<Tile, Elem, true>(p, sp, part, k, o, sm, row0, c, wg, warp);
  }

  __device__ __forceinline__ static void Finish() {}
};

// Shared memory and TMA (`_osk`, HopperTileFeatures::kSmemEpilogue): each warpgroup writes its O with stmatrix into a
// stage of the tile's last key block and one thread stores it with TMA; the stage goes back to the producer from the
// next tile's mainloop (AfterFirst), once the store has read it. Tiles without key blocks, and split-tail parts, store
// from registers (plain stores: vector stores there made d128 `_osk_p2`'s paired split-tail kernel spill).
template <typename Tile, typename Elem>
struct EpilogueSmemSm90 {
  // Two different stores (registers for a tile without key blocks, shared memory otherwise): called in each branch,
  // with `ran` a constant (one site with `ran` a variable gave other code, and spills).
  static constexpr bool kOneStoreSite = false;
  // o_stage: the stage this warpgroup's previous O is stored from (-1: none); o_empty: the K ring's empty barriers,
  // followed by the V ring's (split O stages: warpgroup 0 stores from a K stage, warpgroup 1 from a V stage).
  __device__ __forceinline__ static auto AfterFirst(int& o_stage, uint64_t* o_empty) {
    return [&o_stage, o_empty] { ReleaseOStage(o_stage, o_empty); };
  }

  template <typename Consumer>
  __device__ __forceinline__ static void Store(const LaunchParams& p, const float (&o)[Tile::kHeadDim / 2],
                                               const SoftmaxSm90<Tile::kBlockN>& sm, int row0, int q0,
                                               const TileCoord& c, const Consumer& consumer,
                                               const SharedStorageSm90<Tile>& smem, const CUtensorMap* o_map,
                                               int& o_stage, bool ran) {
    if (!ran) {
      StoreOutputSm90<Tile::kHeadDim, Elem, Tile::kBlockN, false>(p, o, sm, row0, c.head, c.batch);
      return;
    }
    uint32_t o_smem;
    // Warpgroup 0 into the last block's K stage once warpgroup 1's last S has read it; warpgroup 1 into the
    // V stage once warpgroup 0's last P V has (Run signals both).
    if (consumer.wg == 0) {
      NamedBarrierSync<FwdNamedBarrier::kLastQKDone, 256>();
      o_smem = common::SmemAddr(smem.k) + consumer.prev_st * Tile::kKVTileBytes;
    } else {
      NamedBarrierSync<FwdNamedBarrier::kLastPVDone, 256>();
      o_smem = common::SmemAddr(smem.v) + consumer.prev_st * Tile::kKVTileBytes;
    }
    WriteOutputSmemSm90<Tile::kHeadDim, Elem, Tile::kBlockN>(p, o, sm, row0, c.head, c.batch, o_smem);
    FenceProxyAsyncShared();
    OWrittenBarrier(consumer.wg);
    if ((threadIdx.x & 127) == 0) {
#pragma unroll
      for (int pn = 0; pn < Tile::kHeadDim / 64; ++pn) {  // O is 16-bit: 64-column boxes
        TmaStore4d(o_map, o_smem + pn * 64 * 128, pn * 64, c.head, q0 + consumer.wg * 64, c.batch);
      }
      BulkCommit();
    }
    o_stage = consumer.wg == 1 ? Tile::kStages + consumer.prev_st : consumer.prev_st;
  }

  __device__ __forceinline__ static void StorePart(const LaunchParams& p, const SchedulerParams& sp,
                                                   const TailPart& part, int k, float (&o)[Tile::kHeadDim / 2],
                                                   SoftmaxSm90<Tile::kBlockN>& sm, int row0, const TileCoord& c,
                                                   int wg, int warp) {
    StorePartSm90<Tile, Elem, false>(p, sp, part, k, o, sm, row0, c, wg, warp);
  }

  // The last TMA stores must have read their shared memory (and written O) before the block exits.
  __device__ __forceinline__ static void Finish() {
    if ((threadIdx.x & 127) == 0) BulkWaitAll();
  }
};

}  // namespace attnd::kernels::hopper
