// The Hopper-family forward kernel: warp-role orchestration of the mainloop (TMA producer + wgmma
// consumers), the epilogue and the persistent tile scheduler.
//
//   warpgroup 0       producer: gives its registers away (setmaxnreg 24, or 32 beside 3 consumers); one
//                     thread issues every TMA copy
//   warpgroups 1..n   consumers (setmaxnreg 240 for n = 2, 160 for n = 3): 64 query rows each;
//                       S = Q K^T   wgmma, Q and K from shared memory
//                       P = softmax(S) in registers (online, exp2, lazy rescale)
//                       O += P V    wgmma, P from registers, V from shared memory
//                     taking turns to issue GEMMs (one warpgroup's softmax under another's GEMMs) and,
//                     inside each, the softmax of block j under the P V of block j+1 (tile_size_sm90.h flags).
#pragma once

#include <cuda.h>

#include <cstdint>

#include "attnd/kernels/attention.h"
#include "epilogue_fwd_sm90.cuh"
#include "mainloop_fwd_sm90_tma_wgmma_ws.cuh"
#include "named_barrier_sm90.h"
#include "tile_scheduler_sm90.cuh"
#include "wgmma_desc_sm90.h"

namespace attnd::kernels::hopper {

// A consumer warpgroup's whole persistent loop for the cross-tile variant: while a tile has key blocks and
// the next tile this block runs has some too, the two are joined by one CrossStep (the next tile's first
// S with this tile's last P V), and this tile's epilogue runs right after it, while the next tile's P sits
// in registers. A tile without key blocks (rows before every key, bottom-right causal) breaks the chain: its
// neighbours take the plain first / last steps, and its zero output is written directly.
template <typename Tile, typename Elem, bool kPaired>
__device__ __forceinline__ void ConsumerTilesCrossTile(ConsumerSm90<Tile, Elem>& consumer, const LaunchParams& p,
                                                       const SchedulerParams& sp) {
  using Consumer = ConsumerSm90<Tile, Elem>;
  const int lane = threadIdx.x & 31, warp = (threadIdx.x / 32) & 3;
  const int row_in_tile = consumer.wg * 64 + warp * 16 + (lane >> 2);
  // Only the tile index stays live across the chain; coordinates and key ranges are recomputed where
  // needed (a few integer ops). Meant to leave uniform registers to the mainloop's descriptors; the SASS
  // still builds them in vector registers (docs/hopper-kernel-notes.md, v4).
  const auto range = [&](int t) {
    return KeyRangeFor<Tile::kBlockM, Tile::kBlockN>(p, TileAt<kPaired>(sp, t).q_tile * Tile::kBlockM);
  };
  const auto store = [&](int t, const float(&o)[Consumer::kORegs], const typename Consumer::Softmax& sm) {
    const TileCoord c = TileAt<kPaired>(sp, t);
    StoreOutputSm90<Tile::kHeadDim, Elem, Tile::kBlockN>(p, o, sm, c.q_tile * Tile::kBlockM + row_in_tile, c.head,
                                                          c.batch);
  };
  float o[Consumer::kORegs];
  float s[Consumer::kSRegs];
  uint32_t pf[Consumer::kPSteps][4];
  typename Consumer::Softmax sm, sm_next;
  int round = 0;
  for (int t = TileOfRound<kPaired>(sp, 0, blockIdx.x, gridDim.x); t >= 0;) {
    // A chain starts at tile t.
#pragma unroll
    for (int i = 0; i < Consumer::kORegs; ++i) o[i] = 0.f;
    sm.Init();
    const KeyRange r = range(t);
    if (r.n_blocks == 0) {
      store(t, o, sm);
      t = TileOfRound<kPaired>(sp, ++round, blockIdx.x, gridDim.x);
      continue;
    }
    TileWork w = consumer.Work(p, r, TileAt<kPaired>(sp, t).q_tile * Tile::kBlockM + row_in_tile);
    w.q_slot = consumer.WaitQ();
    consumer.FirstBlock(p, w, s, pf, sm);
    for (;;) {
      consumer.MiddleBlocks(p, w, o, s, pf, sm);
      const int tn = TileOfRound<kPaired>(sp, round + 1, blockIdx.x, gridDim.x);
      const KeyRange rn = tn >= 0 ? range(tn) : KeyRange{0, 0};
      if (rn.n_blocks == 0) {
        consumer.LastPV(o, pf);
        store(t, o, sm);
        t = tn;
        ++round;
        break;
      }
      TileWork wn = consumer.Work(p, rn, TileAt<kPaired>(sp, tn).q_tile * Tile::kBlockM + row_in_tile);
      wn.q_slot = consumer.WaitQ();
      sm_next.Init();
      consumer.CrossStep(p, wn, o, s, pf, sm_next);
      Consumer::ConvertP(s, pf);  // first: S is dead during the epilogue
      store(t, o, sm);
#pragma unroll
      for (int i = 0; i < Consumer::kORegs; ++i) o[i] = 0.f;
      sm = sm_next;
      w = wn;
      t = tn;
      ++round;
    }
  }
}

// kPaired: the paired causal tile order (tile_scheduler_sm90.cuh), a separate instantiation so that the
// plain order's kernel is the one it was before pairing existed: with both orders in one kernel, non-causal
// d128 ran 3-6% below the pre-pairing library in the same H200 call (session 5, call 4), though the pairs'
// arithmetic only runs once per tile; split, the two were level within the run-to-run spread (call 5).
template <typename Tile, typename Elem, bool kPaired>
__global__ void __launch_bounds__(Tile::kThreads, 1)
    HopperFwdKernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
                    const __grid_constant__ CUtensorMap v_map, const LaunchParams p, const SchedulerParams sp) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900
  extern __shared__ uint8_t smem_raw[];
  uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const SharedStorageSm90<Tile> smem(base);
  const int warpgroup = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    seed::PrefetchTensorMap(&q_map);
    seed::PrefetchTensorMap(&k_map);
    seed::PrefetchTensorMap(&v_map);
#pragma unroll
    for (int i = 0; i < Tile::kQBuffers; ++i) {
      seed::MbarInit(&smem.q_full[i], 1);
      seed::MbarInit(&smem.q_empty[i], 4 * Tile::kConsumerWarpgroups);  // one arrival per consumer warp
    }
#pragma unroll
    for (int st = 0; st < Tile::kStages; ++st) {
      seed::MbarInit(&smem.k_full[st], 1);
      seed::MbarInit(&smem.v_full[st], 1);
      seed::MbarInit(&smem.k_empty[st], 4 * Tile::kConsumerWarpgroups);  // one arrival per consumer warp
      seed::MbarInit(&smem.v_empty[st], 4 * Tile::kConsumerWarpgroups);
    }
    seed::FenceBarrierInit();
  }
  __syncthreads();

  if (warpgroup == 0) {
    SetMaxRegsDec<Tile::kProducerRegs>();
    if (threadIdx.x == 0) {
      ProducerSm90<Tile> producer{&q_map, &k_map, &v_map, smem};
      for (int round = 0, t; (t = TileOfRound<kPaired>(sp, round, blockIdx.x, gridDim.x)) >= 0; ++round) {
        const TileCoord c = TileAt<kPaired>(sp, t);
        ATTND_HOPPER_TRACE_SET_ROUND(producer, round);
        producer.LoadTile(p, c.q_tile, c.head, c.batch);
      }
    }
  } else {
    SetMaxRegsInc<Tile::kConsumerRegs>();
    ConsumerSm90<Tile, Elem> consumer{smem, warpgroup - 1};
    // Warpgroup 0 takes the first turn (the last one hands it over up front); the matching extra wait is at
    // the end, so no barrier is left half-arrived when the block exits.
    if constexpr (Tile::kPingPong) {
      if (consumer.wg == Tile::kConsumerWarpgroups - 1) PassTurn<Tile::kConsumerWarpgroups>(consumer.wg);
    }
    if constexpr (Tile::kCrossTile) {
      ConsumerTilesCrossTile<Tile, Elem, kPaired>(consumer, p, sp);
    } else {
      const int lane = threadIdx.x & 31, warp = (threadIdx.x / 32) & 3;
      for (int round = 0, t; (t = TileOfRound<kPaired>(sp, round, blockIdx.x, gridDim.x)) >= 0; ++round) {
        const TileCoord c = TileAt<kPaired>(sp, t);
        ATTND_HOPPER_TRACE_AT(1 + consumer.wg, round, trace::kTileStart);
        ATTND_HOPPER_TRACE_SET_ROUND(consumer, round);
        const int q0 = c.q_tile * Tile::kBlockM;
        const int row0 = q0 + consumer.wg * 64 + warp * 16 + (lane >> 2);
        const KeyRange r = KeyRangeFor<Tile::kBlockM, Tile::kBlockN>(p, q0);
        float o[Tile::kHeadDim / 2];
        typename ConsumerSm90<Tile, Elem>::Softmax sm;
        if (r.n_blocks == 0) {
#pragma unroll
          for (int i = 0; i < Tile::kHeadDim / 2; ++i) o[i] = 0.f;
          sm.Init();
        } else {
          consumer.Run(p, r, row0, o, sm);
        }
        StoreOutputSm90<Tile::kHeadDim, Elem, Tile::kBlockN>(p, o, sm, row0, c.head, c.batch);
        ATTND_HOPPER_TRACE_AT(1 + consumer.wg, round, trace::kStored);
      }
    }
    if constexpr (Tile::kPingPong) {
      if (consumer.wg == 0) WaitTurn<Tile::kConsumerWarpgroups>(0);
    }
  }
#endif
}

}  // namespace attnd::kernels::hopper
