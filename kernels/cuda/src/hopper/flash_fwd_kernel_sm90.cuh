// The Hopper-family forward kernel, composed of the instantiation's tile scheduler (scheduler_fwd_sm90.cuh), the
// mainloop's producer and consumers (mainloop_fwd_sm90_tma_wgmma_ws.cuh) and its epilogue (epilogue_kinds_sm90.cuh):
// setup, then the producer thread's loop and each consumer warpgroup's loop over the scheduler's tiles.
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
#include <type_traits>

#include "attnd/kernels/attention.h"
#include "epilogue_kinds_sm90.cuh"
#include "mainloop_fwd_sm90_tma_wgmma_ws.cuh"
#include "named_barrier_sm90.h"
#include "scheduler_fwd_sm90.cuh"
#include "split_tail_sm90.cuh"
#include "tile_scheduler_sm90.cuh"
#include "wgmma_desc_sm90.h"

namespace attnd::kernels::hopper {

// kOrder (tile_scheduler_sm90.cuh): each schedule is an instantiation of its own, so that no kernel carries the
// others' arithmetic (docs/tuning.md, "one kernel per order"). kSplitTail: the static and paired orders with their
// last round split by key blocks (sp.tail_*; TailPartAt), also kernels of their own.
// The kernel's body, shared by HopperFwdKernel and HopperFwdKernelO (the maps are the kernels' __grid_constant__
// parameters; o_map is null except for Tile::kSmemEpilogue). p and sp by value: taken by reference, the split-tail
// kernels compile differently, and inlined the copies cost nothing.
template <typename Tile, typename Elem, int kOrder, bool kSplitTail>
__device__ __forceinline__ void HopperFwdBody(const CUtensorMap& q_map, const CUtensorMap& k_map,
                                              const CUtensorMap& v_map, const CUtensorMap* o_map, const LaunchParams p,
                                              const SchedulerParams sp) {
  constexpr bool kDynamicOrder = kOrder == kDynamic;
  static_assert(!kSplitTail || !kDynamicOrder, "the split tail follows a static order");
  static_assert(!Tile::kSmemEpilogue || !kDynamicOrder, "the shared-memory epilogue: static and paired orders");
  extern __shared__ uint8_t smem_raw[];
  uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const SharedStorageSm90<Tile> smem(base);
  using Scheduler = typename SchedulerForSm90<Tile, kOrder, kSplitTail>::type;
  // Float8 inputs leave O as bf16.
  using OutElem = std::conditional_t<Tile::kFp8, __nv_bfloat16, Elem>;
  using Epilogue =
      std::conditional_t<Tile::kSmemEpilogue, EpilogueSmemSm90<Tile, OutElem>, EpilogueRegSm90<Tile, OutElem>>;
  // Through a shuffle from lane 0, so that ptxas knows it is warp-uniform (as CUTLASS's canonical_warp_group_idx):
  // from threadIdx.x alone ptxas keeps each warpgroup's Q descriptors in vector registers and moves them with two
  // R2UR before every S HGMMA. Except in d128 `_osk_p2`'s static-order split-tail kernel, at the edge of its 240
  // registers, where the shuffle makes ptxas spill.
  constexpr bool kPlainIndex = kSplitTail && kOrder == kStatic && Tile::kSmemEpilogue && Tile::kPDouble;
  const int thread_wg = static_cast<int>(threadIdx.x / 128);
  const int warpgroup = kPlainIndex ? thread_wg : __shfl_sync(0xffffffffu, thread_wg, 0);

  if (threadIdx.x == 0) {
    common::PrefetchTensorMap(&q_map);
    common::PrefetchTensorMap(&k_map);
    common::PrefetchTensorMap(&v_map);
    if constexpr (Tile::kSmemEpilogue) common::PrefetchTensorMap(o_map);
    common::MbarInit(smem.q_full, 1);
    common::MbarInit(smem.q_empty, 4 * Tile::kConsumerWarpgroups);  // one arrival per consumer warp
#pragma unroll
    for (int st = 0; st < Tile::kStages; ++st) {
      common::MbarInit(&smem.k_full[st], 1);
      common::MbarInit(&smem.v_full[st], 1);
      common::MbarInit(&smem.k_empty[st], 4 * Tile::kConsumerWarpgroups);  // one arrival per consumer warp
      common::MbarInit(&smem.v_empty[st], 4 * Tile::kConsumerWarpgroups);
    }
    if constexpr (kDynamicOrder) Scheduler::InitSharedStorage();
    common::FenceBarrierInit();
  }
  __syncthreads();

  if (warpgroup == 0) {
    SetMaxRegsDec<kDynamicOrder ? Tile::kProducerRegsDynamic : Tile::kProducerRegs>();
    if constexpr (kDynamicOrder) {
      if (threadIdx.x == 32) Scheduler().RunSchedulerThread(sp);
    }
    if (threadIdx.x == 0) {
      ProducerSm90<Tile> producer{&q_map, &k_map, &v_map, smem};
      Scheduler scheduler;
      TileCoord c;
      // The whole tiles, then the split tail's parts. The end of the whole tiles at sp.tail_round is checked here,
      // where the loops have it, not in Take: there the split-tail kernels compile to other code.
      for (int round = 0, t; (t = scheduler.Take(sp, round, c)) >= 0; ++round) {
        if constexpr (kSplitTail) {
          if (round >= sp.tail_round) break;
        }
        c = scheduler.Coord(sp, t, c);
        ATTND_HOPPER_TRACE_SET_ROUND(producer, round);
        producer.template LoadTile<Scheduler::kPrefetchQ>(p, c.q_tile, c.head, c.batch);
      }
      if constexpr (kSplitTail) {
        TailPart part;
        for (int k = 0; k < kMaxTailPartsPerBlock && Scheduler::PartAt(p, sp, k, &part); ++k) {
          const TileCoord pc = Scheduler::TileAt(sp, part.tile);
          producer.LoadBlocks(p, pc.q_tile, pc.head, pc.batch,
                              Scheduler::PartRange(p, pc.q_tile * Tile::kBlockM, part));
        }
      }
    }
  } else {
    SetMaxRegsInc<kDynamicOrder ? Tile::kConsumerRegsDynamic : Tile::kConsumerRegs>();
    ConsumerSm90<Tile, Elem> consumer{smem, warpgroup - 1};
    // Warpgroup 0 takes the first turn (the last one hands it over up front); the matching extra wait is at
    // the end, so no barrier is left half-arrived when the block exits.
    if (consumer.wg == Tile::kConsumerWarpgroups - 1) PassTurn<Tile::kConsumerWarpgroups>(consumer.wg);
    {
      const int lane = threadIdx.x & 31, warp = (threadIdx.x / 32) & 3;
      Scheduler scheduler;
      // Shared-memory epilogue: the V stage holding this warpgroup's O until its TMA store has read it (-1: none);
      // with split O stages, the index of its empty barrier after k_empty (warpgroup 0: a K stage, 1: a V stage),
      // so that no pointer stays live beside it (a wider tile spilled with one).
      int o_stage = -1;
      uint64_t* const o_empty = smem.k_empty;
      for (int round = 0;; ++round) {
        if constexpr (kSplitTail) {
          if (round >= sp.tail_round) break;
        }
        TileCoord c;
        const int t = scheduler.Take(sp, round, c);
        if (t < 0) break;
        c = scheduler.Coord(sp, t, c);
        ATTND_HOPPER_TRACE_AT(1 + consumer.wg, round, trace::kTileStart);
        ATTND_HOPPER_TRACE_GLOBAL(1 + consumer.wg, round);
        ATTND_HOPPER_TRACE_TILE(1 + consumer.wg, round, c);
        ATTND_HOPPER_TRACE_SET_ROUND(consumer, round);
        const int q0 = TileFirstRow<Tile>(c.q_tile, p.q_len, p.causal);
        const int row0 = q0 + consumer.wg * 64 + warp * 16 + (lane >> 2);
        KeyRange r = KeyRangeFor<Tile::kBlockM, Tile::kBlockN>(p, q0);
        if constexpr (Tile::kWgRanges) r = consumer.SkipUnseen(p, r, q0 + consumer.wg * 64);
        float o[Tile::kHeadDim / 2];
        typename ConsumerSm90<Tile, Elem>::Softmax sm;
        if (r.n_blocks == 0) {
#pragma unroll
          for (int i = 0; i < Tile::kHeadDim / 2; ++i) o[i] = 0.f;
          sm.Init();
          if constexpr (!Epilogue::kOneStoreSite) {
            Epilogue::Store(p, o, sm, row0, q0, c, consumer, smem, o_map, o_stage, false);
          }
        } else {
          if constexpr (Tile::kFp8) {
            // The head's descales: Q's and K's scale S (in the softmax's exponent, so the LSE includes them), V's O.
            LaunchParams pt = p;
            const int kv_head = c.head / p.group;
            pt.scale_log2 = p.scale_log2 * p.q_descale[c.head] * p.k_descale[kv_head];
            consumer.Run(pt, r, row0, o, sm, Epilogue::AfterFirst(o_stage, o_empty));
            const float v_descale = p.v_descale[kv_head];
#pragma unroll
            for (int i = 0; i < Tile::kHeadDim / 2; ++i) o[i] *= v_descale;
          } else {
            consumer.Run(p, r, row0, o, sm, Epilogue::AfterFirst(o_stage, o_empty));
          }
          if constexpr (!Epilogue::kOneStoreSite) {
            Epilogue::Store(p, o, sm, row0, q0, c, consumer, smem, o_map, o_stage, true);
          }
        }
        if constexpr (Epilogue::kOneStoreSite) {
          Epilogue::Store(p, o, sm, row0, q0, c, consumer, smem, o_map, o_stage, r.n_blocks != 0);
        }
        ATTND_HOPPER_TRACE_AT(1 + consumer.wg, round, trace::kStored);
      }
      if constexpr (kSplitTail) {
        TailPart part;
        for (int k = 0; k < kMaxTailPartsPerBlock && Scheduler::PartAt(p, sp, k, &part); ++k) {
          const TileCoord c = Scheduler::TileAt(sp, part.tile);
          ATTND_HOPPER_TRACE_AT(1 + consumer.wg, sp.tail_round + k, trace::kTileStart);
          ATTND_HOPPER_TRACE_GLOBAL(1 + consumer.wg, sp.tail_round + k);
          ATTND_HOPPER_TRACE_VALUE(1 + consumer.wg, sp.tail_round + k, trace::kPartFirst, part.first);
          ATTND_HOPPER_TRACE_TILE(1 + consumer.wg, sp.tail_round + k, c);
          ATTND_HOPPER_TRACE_SET_ROUND(consumer, sp.tail_round + k);
          const int q0 = c.q_tile * Tile::kBlockM;
          const int row0 = q0 + consumer.wg * 64 + warp * 16 + (lane >> 2);
          float o[Tile::kHeadDim / 2];
          typename ConsumerSm90<Tile, Elem>::Softmax sm;
          if (part.end == part.first) {  // a tile without key blocks: its zero output, written once
#pragma unroll
            for (int i = 0; i < Tile::kHeadDim / 2; ++i) o[i] = 0.f;
            sm.Init();
          } else {
            // The first part hands back the stage of the last whole tile's O (shared-memory epilogue).
            consumer.template Run<true>(p, Scheduler::PartRange(p, q0, part), row0, o, sm,
                                        Epilogue::AfterFirst(o_stage, o_empty));
          }
          Epilogue::StorePart(p, sp, part, k, o, sm, row0, c, consumer.wg, warp);
        }
      }
      Epilogue::Finish();
      ATTND_HOPPER_TRACE_GLOBAL(1 + consumer.wg, trace::kRounds - 1);
    }
    if (consumer.wg == 0) WaitTurn<Tile::kConsumerWarpgroups>(0);
  }
}

template <typename Tile, typename Elem, int kOrder, bool kSplitTail = false>
__global__ void __launch_bounds__(Tile::kThreads, 1)
    HopperFwdKernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
                    const __grid_constant__ CUtensorMap v_map, const LaunchParams p, const SchedulerParams sp) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900
  static_assert(!Tile::kSmemEpilogue, "Tile::kSmemEpilogue: HopperFwdKernelO, which takes the O map");
  HopperFwdBody<Tile, Elem, kOrder, kSplitTail>(q_map, k_map, v_map, nullptr, p, sp);
#endif
}

// The shared-memory epilogue's kernel: the same body, with a tensor map of O to store it through.
template <typename Tile, typename Elem, int kOrder, bool kSplitTail = false>
__global__ void __launch_bounds__(Tile::kThreads, 1)
    HopperFwdKernelO(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
                     const __grid_constant__ CUtensorMap v_map, const __grid_constant__ CUtensorMap o_map,
                     const LaunchParams p, const SchedulerParams sp) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900
  static_assert(Tile::kSmemEpilogue, "HopperFwdKernelO is the shared-memory epilogue's kernel");
  HopperFwdBody<Tile, Elem, kOrder, kSplitTail>(q_map, k_map, v_map, &o_map, p, sp);
#endif
}

}  // namespace attnd::kernels::hopper
