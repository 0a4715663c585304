// Mainloop role: the producer's TMA loads and the consumers' wgmma GEMMs + softmax over one tile's key blocks.
//
// Shared memory: Q (block_m x head_dim, loaded once per tile) and a ring of `stages` K/V stages, all as 128-byte-swizzled 64-element panels written
// by TMA. Barriers (mbarrier):
//   q_full           TMA -> consumers: Q of a tile has landed (transaction count)
//   q_empty          consumers -> producer: all warpgroups' last Q K^T on Q is done, it may be refilled
//   k_full/v_full[s] TMA -> consumers, separately, so Q K^T starts while V is still in flight
//   k_empty[s]       consumers -> producer: every consumer warp's Q K^T on stage s has completed
//   v_empty[s]       consumers -> producer: every consumer warp's P V on stage s has completed
// K and V are two rings with their own empty barriers: with the softmax/PV overlap, V of block b+1 is held
// until the middle of block b's step, but K of block b+1 is free as soon as S of b+1 is; one shared ring
// would delay the next K load by that much and expose the TMA latency on every block (docs/tuning.md).
// The producer accordingly issues K one block ahead of V.
// Key blocks are visited last to first, so the masked ones (diagonal, kv tail) come first and the loop
// body after them runs unmasked. The producer and both consumer warpgroups count blocks with one running
// index across tiles, which gives each load its stage and mbarrier phase in both rings.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "../common/key_range.cuh"
#include "../common/mma_sm80.cuh"
#include "../common/tma_sm90.cuh"
#include "attnd/kernels/attention.h"
#include "fp8_sm90.cuh"
#include "named_barrier_sm90.h"
#include "softmax_sm90.cuh"
#include "tile_scheduler_sm90.cuh"  // TileCoord
#include "trace_sm90.cuh"
#include "wgmma_desc_sm90.h"
#include "wgmma_sm90.h"

namespace attnd::kernels::hopper {

using common::KeyRange;
using common::KeyRangeFor;
using common::MbarArrive;
using common::MbarArriveExpectTx;
using common::MbarWait;
using common::SmemAddr;
using common::TmaLoad4d;

// The first query row of q tile q_tile: q_tile * block_m, or with shifted tiles (`_wrs`, causal) up to two warpgroups
// before that, so that the first tile holds the rows past a multiple of block_m. Its rows before 0 are TMA's zero fill
// (negative coordinates are out of bounds like those past the end); their warpgroups visit no key and store nothing.
// (q_len and causal by value: with a reference to the launch parameters ptxas laid out every kernel's code
// differently, shifted or not.)
template <typename Tile>
__device__ __forceinline__ int TileFirstRow(int q_tile, int q_len, bool causal) {
  if constexpr (Tile::kWgRanges) {
    if (causal) {
      constexpr int kWG = Tile::kConsumerWarpgroups;
      const int groups = (q_len + 63) >> 6;
      return q_tile * Tile::kBlockM - 64 * ((kWG - groups % kWG) % kWG);
    }
  }
  return q_tile * Tile::kBlockM;
}

// The key blocks one consumer warpgroup's 64 rows (from wg_row0) see, within its tile's range: none when the rows
// start past q_len (KeyRangeFor takes the last row as min(.., q_len) - 1) or lie before 0 (shifted tiles). For
// per-warpgroup key ranges, `_wr`.
template <int kBlockN>
__device__ __forceinline__ KeyRange WarpgroupKeyRange(const LaunchParams& p, const KeyRange& tile, int wg_row0) {
  if (wg_row0 >= p.q_len || wg_row0 < 0) return KeyRange{0, 0};
  KeyRange r = KeyRangeFor<64, kBlockN>(p, wg_row0);
  r.n_blocks = min(r.n_blocks, tile.n_blocks);
  r.n_full = min(r.n_full, r.n_blocks);
  return r;
}

// Last key a query row may see (-1: none).
__device__ __forceinline__ int RowLimit(const LaunchParams& p, int row) {
  if (!p.causal) return p.kv_len - 1;
  const int64_t lim = static_cast<int64_t>(row) + p.causal_offset;
  return static_cast<int>(lim < -1 ? -1 : (lim > p.kv_len - 1 ? p.kv_len - 1 : lim));
}

template <typename Tile>
struct SharedStorageSm90 {
  static constexpr int kQPanelBytes = Tile::kBlockM * 128;
  static constexpr int kKVPanelBytes = Tile::kBlockN * 128;
  uint8_t* q;
  uint8_t* k;  // stage s at k + s * kKVTileBytes
  uint8_t* v;
  uint64_t* q_full;
  uint64_t* q_empty;
  uint64_t* k_full;
  uint64_t* v_full;
  uint64_t* k_empty;
  uint64_t* v_empty;

  __device__ __forceinline__ explicit SharedStorageSm90(uint8_t* base) {
    q = base;
    k = q + Tile::kQBytes;
    v = k + Tile::kStages * Tile::kKVTileBytes;
    uint64_t* bars = reinterpret_cast<uint64_t*>(v + Tile::kStages * Tile::kKVTileBytes);
    q_full = bars;
    q_empty = bars + 1;
    k_full = bars + 2;
    v_full = k_full + Tile::kStages;
    k_empty = v_full + Tile::kStages;
    v_empty = k_empty + Tile::kStages;  // right after k_empty: split O stages index both as one array
  }
};

// The dynamic schedule's hand-off of tiles to the producer thread and the consumer threads: a small ring,
// since the Q barrier cannot carry it (a tile without key blocks loads no Q) and everyone must learn the end
// (-1) too. A thread of its own (the producer warpgroup's second warp) takes tiles from the global counter,
// decodes each into its coordinates and fills the ring. The decode is three integer divisions (sections, heads,
// batch): in the readers they sat on every tile change, between a warpgroup's epilogue and its next tile's first
// S, where the scheduler thread, up to two tiles ahead, has time for them. The ring lives in static shared memory,
// so its addresses are constants rather than pointers held in registers across the tile.
struct TileRingSm90 {
  static constexpr int kSlots = 2;  // the scheduler runs up to two tiles ahead of the consumers
  uint64_t full[kSlots];            // scheduler -> readers: the slot holds the next tile
  uint64_t empty[kSlots];           // readers -> scheduler: the producer thread and every consumer thread read it
  int4 tile[kSlots];                // {tile index (-1: the end), q_tile, head, batch}: one 16-byte load
};

template <int kConsumerWarpgroups>
struct TileSlotsSm90 {
  static constexpr int kReaders = 128 * kConsumerWarpgroups + 1;  // consumer threads + the producer thread
  int n = 0;  // tiles passed so far

  __device__ __forceinline__ static void Init(TileRingSm90& ring) {
#pragma unroll
    for (int i = 0; i < TileRingSm90::kSlots; ++i) {
      common::MbarInit(&ring.full[i], 1);
      common::MbarInit(&ring.empty[i], kReaders);
    }
  }

  // Scheduler: waits until the next slot is free, then fills it with the tile `take` returns (called only then,
  // so a tile is claimed as late as the ring allows) and its coordinates, decode(tile).
  template <typename Take, typename Decode>
  __device__ __forceinline__ int Put(TileRingSm90& ring, Take take, Decode decode) {
    constexpr int kS = TileRingSm90::kSlots;
    const int slot = n % kS;
    if (n >= kS) MbarWait(&ring.empty[slot], ((n / kS) + 1) & 1);
    const int t = take();
    TileCoord c{0, 0, 0};
    if (t >= 0) c = decode(t);
    ring.tile[slot] = make_int4(t, c.q_tile, c.head, c.batch);
    MbarArrive(&ring.full[slot]);  // release: the store above is seen by whoever waits on the phase
    ++n;
    return t;
  }

  // Readers: the producer thread and every consumer thread, each arriving once. Returns the tile index, -1 at the
  // end. One arrival per consumer warp after a __syncwarp makes d64 m192's consumers spill and takes s6 `_p2`'s S
  // descriptors out of the uniform registers, with the arrive predicated too.
  __device__ __forceinline__ int Take(TileRingSm90& ring, TileCoord& c) {
    constexpr int kS = TileRingSm90::kSlots;
    const int slot = n % kS;
    MbarWait(&ring.full[slot], (n / kS) & 1);
    const int4 v = ring.tile[slot];
    MbarArrive(&ring.empty[slot]);
    ++n;
    c = TileCoord{v.y, v.z, v.w};
    return v.x;
  }
};

// Producer: one thread. Issues the K/V blocks of a tile (last to first) into the ring and Q once per tile.
template <typename Tile>
struct ProducerSm90 {
  const CUtensorMap* q_map;
  const CUtensorMap* k_map;
  const CUtensorMap* v_map;
  SharedStorageSm90<Tile> smem;
  int k_load = 0;  // K blocks issued so far (all tiles)
  int v_load = 0;  // V blocks issued so far (all tiles)
  int q_tiles = 0;  // Q loads issued so far
  ATTND_HOPPER_TRACE_ROUND_MEMBER  // the round being loaded (timeline probes only)

  // One block of K or V into its ring. Load n must wait for load n - stages to leave the stage: that
  // release completed phase n / stages - 1 of the stage's empty barrier. kTransposed (float8 V): the block is one box
  // of V^T, head_dim rows of block_n keys ([batch, kv_heads, head_dim, keys] innermost first).
  template <bool kTransposed = false>
  __device__ __forceinline__ void LoadBlock(int& n, uint8_t* ring, const CUtensorMap* map, uint64_t* full,
                                            uint64_t* empty, int block, int kv_head, int batch) {
    const int st = n % Tile::kStages;
    if (n >= Tile::kStages) MbarWait(&empty[st], ((n / Tile::kStages) + 1) & 1);
    MbarArriveExpectTx(&full[st], Tile::kKVTileBytes);
    if constexpr (kTransposed) {
      TmaLoad4d(ring + st * Tile::kKVTileBytes, map, &full[st], block * Tile::kBlockN, 0, kv_head, batch);
    } else {
#pragma unroll
      for (int pn = 0; pn < Tile::kPanels; ++pn) {
        TmaLoad4d(ring + st * Tile::kKVTileBytes + pn * SharedStorageSm90<Tile>::kKVPanelBytes, map, &full[st],
                  pn * Tile::kPanelElems, kv_head, block * Tile::kBlockN, batch);
      }
    }
    ++n;
  }
  __device__ __forceinline__ void LoadK(int block, int kv_head, int batch) {
    LoadBlock(k_load, smem.k, k_map, smem.k_full, smem.k_empty, block, kv_head, batch);
  }
  __device__ __forceinline__ void LoadV(int block, int kv_head, int batch) {
    LoadBlock<Tile::kFp8>(v_load, smem.v, v_map, smem.v_full, smem.v_empty, block, kv_head, batch);
  }

  __device__ __forceinline__ void LoadQ(int q0, int head, int batch) {
    // The previous tile's consumers must be done with Q (every warpgroup's last Q K^T).
    if (q_tiles >= 1) MbarWait(smem.q_empty, (q_tiles + 1) & 1);
    MbarArriveExpectTx(smem.q_full, Tile::kQBytes);
#pragma unroll
    for (int pn = 0; pn < Tile::kPanels; ++pn) {
      TmaLoad4d(smem.q + pn * SharedStorageSm90<Tile>::kQPanelBytes, q_map, smem.q_full, pn * Tile::kPanelElems, head,
                q0, batch);
    }
    ++q_tiles;
  }

  // Q and the key blocks [r.first, r.n_blocks) of a part of a split tile, last to first, as LoadTile. (A copy of
  // its own: with LoadTile written over it, every kernel's code changed, not just the split ones'.)
  __device__ __forceinline__ void LoadBlocks(const LaunchParams& p, int q_tile, int head, int batch, const KeyRange& r) {
    if (r.n_blocks <= r.first) return;
    const int kv_head = head / p.group;
    LoadK(r.n_blocks - 1, kv_head, batch);
    LoadQ(q_tile * Tile::kBlockM, head, batch);
    for (int b = r.n_blocks - 2; b >= r.first; --b) {
      LoadK(b, kv_head, batch);
      LoadV(b + 1, kv_head, batch);
    }
    LoadV(r.first, kv_head, batch);
  }

  // kPrefetchQ: Q is read once, from DRAM, and its load waits for the previous tile's last S (one Q buffer); its L2
  // prefetch goes out when the producer takes the tile, typically most of a tile before that load. It pays in the
  // dynamic order only (docs/tuning.md, "Q prefetch"), so the static and paired orders do without it.
  template <bool kPrefetchQ = false>
  __device__ __forceinline__ void LoadTile(const LaunchParams& p, int q_tile, int head, int batch) {
    const KeyRange r = KeyRangeFor<Tile::kBlockM, Tile::kBlockN>(p, TileFirstRow<Tile>(q_tile, p.q_len, p.causal));
    if (r.n_blocks == 0) return;
    const int kv_head = head / p.group;
    if constexpr (kPrefetchQ) {
#pragma unroll
      for (int pn = 0; pn < Tile::kPanels; ++pn) {
        common::TmaPrefetchL2_4d(q_map, pn * Tile::kPanelElems, head, TileFirstRow<Tile>(q_tile, p.q_len, p.causal),
                                 batch);
      }
    }
    // The first K block before Q: it waits only on the ring, so the ring keeps filling while the
    // consumers finish the previous tile and release Q. Then K runs one block ahead of V, the order in
    // which the consumers need them (S of block b is computed together with P V of block b+1).
    ATTND_HOPPER_TRACE_AT(0, trace_round, trace::kPTileStart);
    LoadK(r.n_blocks - 1, kv_head, batch);
    ATTND_HOPPER_TRACE_AT(0, trace_round, trace::kPFirstKIssued);
    LoadQ(TileFirstRow<Tile>(q_tile, p.q_len, p.causal), head, batch);
    ATTND_HOPPER_TRACE_AT(0, trace_round, trace::kPQIssued);
    for (int b = r.n_blocks - 2; b >= 0; --b) {
      LoadK(b, kv_head, batch);
      LoadV(b + 1, kv_head, batch);
    }
    LoadV(0, kv_head, batch);
    ATTND_HOPPER_TRACE_AT(0, trace_round, trace::kPTileIssued);
  }
};

// One tile as a consumer warpgroup sees it: its key blocks and its rows' last visible keys.
struct TileWork {
  KeyRange r;
  int limit0, limit1;  // RowLimit of this thread's two rows
  // Keeps the struct at 16 bytes: at 12, ptxas gave the split-tail kernels' part loop other registers.
  int unused = 0;
};

// Consumer warpgroup: 64 query rows of the tile.
template <typename Tile, typename Elem>
struct ConsumerSm90 {
  static constexpr int D = Tile::kHeadDim, BM = Tile::kBlockM, BN = Tile::kBlockN, S = Tile::kStages;
  // kPSteps: P V's k steps, k16 (16-bit) or k32 (float8), each four registers of P.
  static constexpr int kSRegs = BN / 2, kORegs = D / 2, kPSteps = BN * Tile::kElemBytes / 32;
  static constexpr int kKSteps = D * Tile::kElemBytes / 32;  // Q K^T's k steps over head_dim
  using Softmax = SoftmaxSm90<BN>;

  SharedStorageSm90<Tile> smem;
  int wg;        // which 64 rows of the tile
  int load = 0;  // K/V loads consumed so far (all tiles), mirrors the producer's count
  int q_tiles = 0;
  // The block whose P V is still to be issued (overlapped variant): its V stage and that stage's phase.
  int prev_st = 0;
  uint32_t prev_phase = 0;
  ATTND_HOPPER_TRACE_ROUND_MEMBER  // the tile's round (timeline probes only)
  ATTND_HOPPER_STEP_MEMBER         // the last step-part mark (probes only)

  // Waits for the next tile's Q (the producer loads one per tile with key blocks, in tile order).
  __device__ __forceinline__ void WaitQ() {
    MbarWait(smem.q_full, q_tiles & 1);
    ++q_tiles;
  }

  __device__ __forceinline__ TileWork Work(const LaunchParams& p, const KeyRange& r, int row0) const {
    return TileWork{r, RowLimit(p, row0), RowLimit(p, row0 + 8)};
  }

  // S = Q K^T over head_dim in k16 (float8: k32) steps. A step inside a 128-byte swizzled row moves the
  // descriptors' start by 32 bytes; the next 128 bytes of head_dim are the next panel.
  __device__ __forceinline__ void IssueQK(float (&s)[kSRegs], int st) const {
    // Offsets are added after the conversion to a shared-window address: 32-bit arithmetic the compiler keeps
    // in uniform registers, instead of redoing the generic-to-shared conversion per dynamic index.
    const uint32_t q_base = SmemAddr(smem.q) + wg * 64 * 128;
    const uint32_t k_base = SmemAddr(smem.k) + st * Tile::kKVTileBytes;
    const uint32_t q_lo = SmemDescLo(q_base, 16), k_lo = SmemDescLo(k_base, 16);
    constexpr uint32_t kHi = SmemDescHi(1024);
    WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
      const uint32_t off = (kk % 4) * 32;
      const uint64_t da = DescAt<kHi>(q_lo, (kk / 4) * SharedStorageSm90<Tile>::kQPanelBytes + off);
      const uint64_t db = DescAt<kHi>(k_lo, (kk / 4) * SharedStorageSm90<Tile>::kKVPanelBytes + off);
      Wgmma<BN, Elem>::SS(s, da, db, kk > 0 ? 1 : 0);
    }
    WgmmaCommit();
  }

  // O += P V over the block's keys in k16 steps: 16 keys are 2048 bytes of every V panel. Float8: V^T is K-major
  // (keys along its 128-byte rows, one head_dim row each), so a k32 step moves the start by 32 bytes as in Q K^T.
  __device__ __forceinline__ void IssuePV(float (&o)[kORegs], const uint32_t (&pf)[kPSteps][4], int st) const {
    const uint32_t v_base = SmemAddr(smem.v) + st * Tile::kKVTileBytes;
    if constexpr (Tile::kFp8) {
      const uint32_t v_lo = SmemDescLo(v_base, 16);
      WgmmaFence();
#pragma unroll
      for (int kk = 0; kk < kPSteps; ++kk) {
        Wgmma<D, Elem>::RS(o, pf[kk], DescAt<SmemDescHi(1024)>(v_lo, kk * 32));
      }
      WgmmaCommit();
    } else {
      const uint32_t v_lo = SmemDescLo(v_base, SharedStorageSm90<Tile>::kKVPanelBytes);
      WgmmaFence();
#pragma unroll
      for (int kk = 0; kk < kPSteps; ++kk) {
        const uint64_t db = DescAt<SmemDescHi(1024)>(v_lo, kk * 16 * 128);
        Wgmma<D, Elem>::RS(o, pf[kk], db);
      }
      WgmmaCommit();
    }
  }

  // The S accumulators of keys 16kk..16kk+15 are, register for register, the A fragment of P. Float8: the k32 A
  // fragment wants four consecutive keys per register where the accumulators hold pairs (keys 8i + 2t, +1), so each
  // register packs two pairs, and V^T holds its keys in that order (Fp8PKey, fp8_sm90.cuh): nothing to shuffle.
  __device__ __forceinline__ static void ConvertP(const float (&s)[kSRegs], uint32_t (&pf)[kPSteps][4]) {
    if constexpr (Tile::kFp8) {
#pragma unroll
      for (int kk = 0; kk < kPSteps; ++kk) {
        const float* x = s + 16 * kk;
        pf[kk][0] = PackFp8x4(x[0], x[1], x[4], x[5]);      // row g, keys 2t, 2t+1, 8+2t, 9+2t
        pf[kk][1] = PackFp8x4(x[2], x[3], x[6], x[7]);      // row g+8
        pf[kk][2] = PackFp8x4(x[8], x[9], x[12], x[13]);    // row g, keys 16 on
        pf[kk][3] = PackFp8x4(x[10], x[11], x[14], x[15]);  // row g+8
      }
    } else {
#pragma unroll
      for (int kk = 0; kk < kPSteps; ++kk) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          pf[kk][e] = common::ElemTraits<Elem>::Pack(s[8 * kk + 2 * e], s[8 * kk + 2 * e + 1]);
        }
      }
    }
  }

  // This warp's last Q K^T of the tile has completed: the producer may refill Q while this warpgroup
  // finishes P V and the epilogue.
  __device__ __forceinline__ void ReleaseQ() const {
    __syncwarp();
    if ((threadIdx.x & 31) == 0) MbarArrive(smem.q_empty);
  }

  // This warp's reads of a stage are done (its wgmma group has completed): one arrival per warp.
  __device__ __forceinline__ static void Release(uint64_t* empty, int st) {
    __syncwarp();
    if ((threadIdx.x & 31) == 0) MbarArrive(&empty[st]);
  }

  __device__ __forceinline__ void TurnBegin() const {
    WaitTurn<Tile::kConsumerWarpgroups>(wg);
  }
  __device__ __forceinline__ void TurnEnd() const {
    PassTurn<Tile::kConsumerWarpgroups>(wg);
  }

  // kToRowMax: the step after a failed TryStep (Softmax::TryStep says why); masked blocks never have one.
  template <bool kToRowMax = false>
  __device__ __forceinline__ bool SoftmaxStep(Softmax& sm, float (&s)[kSRegs], const LaunchParams& p, int block,
                                              const TileWork& w, float (&f)[2]) const {
#if defined(ATTND_HOPPER_TRACE)
    const auto after_max = [&] { ATTND_HOPPER_STEP_MARK(kSpMax); };
#else
    const NoOp after_max;
#endif
    if (block >= w.r.n_full) {
      return sm.template Step<true>(s, p.scale_log2, block * BN, w.limit0, w.limit1, f, after_max);
    }
    return sm.template Step<false, kToRowMax>(s, p.scale_log2, block * BN, w.limit0, w.limit1, f, after_max);
  }

  // After S of a block has completed: its K stage goes back to the producer. kHoldLast (split O stages, whole
  // tiles): the tile's last block's stage is warpgroup 0's O region, so warpgroup 0 keeps it and warpgroup 1,
  // having released it, tells warpgroup 0 it is done reading it.
  template <bool kHoldLast>
  __device__ __forceinline__ void ReleaseK(int st, bool last) const {
    if constexpr (kHoldLast) {
      // A predicated arrive rather than a branch around it, which costs registers at the consumers' limit.
      __syncwarp();
      const uint32_t arrive = (threadIdx.x & 31) == 0 && !(last && wg == 0);
      asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %1, 0;\n @p mbarrier.arrive.shared::cta.b64 _, [%0];\n}"
                   ::"r"(SmemAddr(&smem.k_empty[st])), "r"(arrive) : "memory");
      if (last && wg == 1) NamedBarrierArrive<FwdNamedBarrier::kLastQKDone, 256>();
    } else {
      Release(smem.k_empty, st);
    }
  }

  // S alone (its own turn), on K stage st once that stage's load of phase `phase` has landed. after_issue runs
  // while the GEMM does.
  template <bool kHoldLast = false, typename AfterIssue = NoOp>
  __device__ __forceinline__ void SAlone(float (&s)[kSRegs], int st, uint32_t phase, bool last = false,
                                         AfterIssue after_issue = {}) {
    MbarWait(&smem.k_full[st], phase);
    TurnBegin();
    IssueQK(s, st);
    TurnEnd();
    after_issue();
    WgmmaWait<0>();
    FenceOperand(s);
    ReleaseK<kHoldLast>(st, last);
  }

  // A key block this warpgroup's rows do not see (per-warpgroup key ranges): its GEMM turn is taken empty, so the
  // turns stay in step, and both of its stages go back once they have landed (an arrival before that would count
  // towards the stage's previous phase).
  __device__ __forceinline__ void EmptyStep() {
    const int st = load % S;
    const uint32_t phase = (load / S) & 1;
    TurnBegin();
    TurnEnd();
    MbarWait(&smem.k_full[st], phase);
    Release(smem.k_empty, st);
    MbarWait(&smem.v_full[st], phase);
    Release(smem.v_empty, st);
    ++load;
  }

  // Per-warpgroup key ranges (`_wr`), before Run: the tile's blocks are visited last to first, so the ones this
  // warpgroup's rows (from wg_row0, warp-uniform) do not see come first; they are passed by empty steps. Returns the
  // blocks left for Run, none when the rows see no key of the tile (then its Q is released unread, the last P V's turn
  // taken empty, and the caller stores the zero output as for a tile without key blocks).
  __device__ __forceinline__ KeyRange SkipUnseen(const LaunchParams& p, const KeyRange& tile, int wg_row0) {
    const KeyRange r = WarpgroupKeyRange<BN>(p, tile, wg_row0);
#pragma unroll 1
    for (int b = tile.n_blocks - 1; b >= r.n_blocks; --b) EmptyStep();
    if (r.n_blocks == 0 && tile.n_blocks > 0) {
      WaitQ();
      ReleaseQ();
      TurnBegin();
      TurnEnd();
    }
    return r;
  }

  // The overlapped loop, in three parts a tile's blocks run through.
  // First: the tile's first block (the last in key order), S alone; O is still zero, so no rescale.
  // kPart: the blocks [w.r.first, w.r.n_blocks) of a split tile; without, all of them (the same code as before
  // parts existed: reading `first` there changed every kernel's code).
  template <bool kPart = false, typename AfterIssue = NoOp>
  __device__ __forceinline__ void FirstBlock(const LaunchParams& p, const TileWork& w, float (&s)[kSRegs],
                                             uint32_t (&pf)[kPSteps][4], Softmax& sm, AfterIssue after_issue = {}) {
    float f[2];
    const int st = load % S;
    const bool last = w.r.n_blocks - 1 == (kPart ? w.r.first : 0);
    SAlone<Tile::kSmemEpilogue && !kPart>(s, st, (load / S) & 1, last, after_issue);
    if (last) ReleaseQ();
    SoftmaxStep(sm, s, p, w.r.n_blocks - 1, w, f);
    ConvertP(s, pf);
    prev_st = st;
    prev_phase = (load / S) & 1;
    ++load;
  }

  // The overlapped step, first half: S of the block in K stage `st` and P V of the previous block in one
  // turn. Returns once S has completed; the P V may still run.
  template <bool kHoldLast = false>
  __device__ __forceinline__ void IssueSWithPrevPV(float (&s)[kSRegs], float (&o)[kORegs],
                                                   const uint32_t (&pf)[kPSteps][4], int st, bool last = false) {
    MbarWait(&smem.k_full[st], (load / S) & 1);
    ATTND_HOPPER_STEP_MARK(kSpKWait);
    TurnBegin();
    ATTND_HOPPER_STEP_MARK(kSpTurn);
    IssueQK(s, st);
    ATTND_HOPPER_STEP_MARK(kSpIssueS);
    MbarWait(&smem.v_full[prev_st], prev_phase);
    ATTND_HOPPER_STEP_MARK(kSpVWait);
    IssuePV(o, pf, prev_st);
    TurnEnd();
    ATTND_HOPPER_STEP_MARK(kSpIssuePV);
    WgmmaWait<1>();  // groups complete in order: S is done, the P V may still run
    FenceOperand(s);
    ReleaseK<kHoldLast>(st, last);
    ATTND_HOPPER_STEP_MARK(kSpSWait);
  }

  // Second half, after the softmax: the previous block's P V has completed and its V stage is free; the
  // block in `st` becomes the previous one.
  __device__ __forceinline__ void FinishPrevPV(float (&o)[kORegs], uint32_t (&pf)[kPSteps][4], int st) {
    WgmmaWait<0>();
    FenceOperand(o);
    FenceOperand(pf);
    Release(smem.v_empty, prev_st);
    prev_st = st;
    prev_phase = (load / S) & 1;
    ++load;
  }

  // One overlapped step with two P buffers: P V reads `pv` while block b's probabilities go into `next`.
  template <bool kPart>
  __device__ __forceinline__ void StepTwoP(const LaunchParams& p, const TileWork& w, float (&o)[kORegs],
                                           float (&s)[kSRegs], uint32_t (&pv)[kPSteps][4],
                                           uint32_t (&next)[kPSteps][4], Softmax& sm, int b, int first) {
    float f[2];
    const int st = load % S;
    IssueSWithPrevPV<Tile::kSmemEpilogue && !kPart>(s, o, pv, st, b == first);
    if (b == first) ReleaseQ();
    // No GEMM reads `next`: the P V that last read it completed in the previous step. So an unmasked block can
    // take its exponentials before its row max (Softmax::TryStep) and keep the raw scores for the full step.
    bool accepted = false;
    if (b < w.r.n_full) {
      ATTND_HOPPER_STEP_MARK(kSpMax);  // no row max taken: the step parts count the check under exp
      if constexpr (Tile::kFp8) {
        accepted = sm.TryStepFp8(s, p.scale_log2, next);
      } else {
        accepted = sm.TryStep(s, p.scale_log2, next, common::ElemTraits<Elem>::Pack);
      }
    }
    bool rescale = false;
    if (!accepted) {
      rescale = SoftmaxStep<true>(sm, s, p, b, w, f);
      ConvertP(s, next);
    }
    ATTND_HOPPER_STEP_MARK(kSpSoftmax);
    FinishPrevPV(o, pv, st);
    ATTND_HOPPER_STEP_MARK(kSpPVWait);
    if (rescale) Softmax::Rescale(o, f);
    ATTND_HOPPER_STEP_MARK(kSpConvert);  // P was converted beside the exponentials: this part is the rescale
  }

  // Blocks n-2 .. 0: S of block b and P V of block b+1 in flight together; softmax of b runs under P V.
  template <bool kPart = false>
  __device__ __forceinline__ void MiddleBlocks(const LaunchParams& p, const TileWork& w, float (&o)[kORegs],
                                               float (&s)[kSRegs], uint32_t (&pf)[kPSteps][4], Softmax& sm) {
    const int first = kPart ? w.r.first : 0;
    if constexpr (Tile::kPDouble) {
      // Two steps per iteration so that each buffer is a register array of its own; the tile's last P ends in pf.
      uint32_t pg[kPSteps][4];
      int b = w.r.n_blocks - 2;
      ATTND_HOPPER_STEP_RESET();
      for (; b > first; b -= 2) {
        StepTwoP<kPart>(p, w, o, s, pf, pg, sm, b, first);
        StepTwoP<kPart>(p, w, o, s, pg, pf, sm, b - 1, first);
      }
      if (b == first) {
        StepTwoP<kPart>(p, w, o, s, pf, pg, sm, b, first);
#pragma unroll
        for (int kk = 0; kk < kPSteps; ++kk) {
#pragma unroll
          for (int e = 0; e < 4; ++e) pf[kk][e] = pg[kk][e];
        }
      }
      return;
    }
    float f[2];
    ATTND_HOPPER_STEP_RESET();
    for (int b = w.r.n_blocks - 2; b >= first; --b) {
      const int st = load % S;
      IssueSWithPrevPV<Tile::kSmemEpilogue && !kPart>(s, o, pf, st, b == first);
      if (b == first) ReleaseQ();
      const bool rescale = SoftmaxStep(sm, s, p, b, w, f);
      ATTND_HOPPER_STEP_MARK(kSpSoftmax);
      FinishPrevPV(o, pf, st);
      ATTND_HOPPER_STEP_MARK(kSpPVWait);
      if (rescale) Softmax::Rescale(o, f);
      ConvertP(s, pf);
      ATTND_HOPPER_STEP_MARK(kSpConvert);
    }
  }

  // One P V alone (its own turn), on V stage st once that stage's load of phase `phase` has landed. kRelease false:
  // the stage is kept (the shared-memory epilogue writes O into it and releases it later).
  template <bool kRelease = true>
  __device__ __forceinline__ void PVAlone(float (&o)[kORegs], uint32_t (&pf)[kPSteps][4], int st, uint32_t phase) {
    MbarWait(&smem.v_full[st], phase);
    TurnBegin();
    IssuePV(o, pf, st);
    TurnEnd();
    WgmmaWait<0>();
    FenceOperand(o);
    FenceOperand(pf);
    if constexpr (kRelease) Release(smem.v_empty, st);
  }

  // The tile's last P V, alone; its V stage stays in prev_st.
  template <bool kRelease = true>
  __device__ __forceinline__ void LastPV(float (&o)[kORegs], uint32_t (&pf)[kPSteps][4]) {
    PVAlone<kRelease>(o, pf, prev_st, prev_phase);
  }

  // Runs one tile's key blocks (kPart: those of [r.first, r.n_blocks)); on return o holds the unnormalised output
  // and sm the row max / sums. after_first runs once the first block's S has completed (the shared-memory
  // epilogue hands the previous tile's V stage back there); with split O stages, once it has been issued.
  // Split O stages, whole tiles: warpgroup 0 gives its last V stage back and signals warpgroup 1; warpgroup 1
  // keeps it for its O.
  template <bool kPart = false, typename AfterFirst = NoOp>
  __device__ __forceinline__ void Run(const LaunchParams& p, const KeyRange& r, int row0, float (&o)[kORegs],
                                      Softmax& sm, AfterFirst after_first = {}) {
    TileWork w = Work(p, r, row0);
#pragma unroll
    for (int i = 0; i < kORegs; ++i) o[i] = 0.f;
    sm.Init();
    WaitQ();
    ATTND_HOPPER_TRACE_AT(1 + wg, trace_round, trace::kQReady);
    ATTND_HOPPER_TRACE_VALUE(1 + wg, trace_round, trace::kBlocks, r.n_blocks);

    float s[kSRegs];
    uint32_t pf[kPSteps][4];

    if constexpr (Tile::kSmemEpilogue) {
      FirstBlock<kPart>(p, w, s, pf, sm, after_first);
    } else {
      FirstBlock<kPart>(p, w, s, pf, sm);
      after_first();
    }
    ATTND_HOPPER_TRACE_AT(1 + wg, trace_round, trace::kFirstDone);
    MiddleBlocks<kPart>(p, w, o, s, pf, sm);
    ATTND_HOPPER_TRACE_AT(1 + wg, trace_round, trace::kMiddleDone);
    ATTND_HOPPER_STEP_PUT();
    if constexpr (Tile::kSmemEpilogue && !kPart) {
      LastPV<false>(o, pf);
      if (wg == 0) {
        Release(smem.v_empty, prev_st);
        NamedBarrierArrive<FwdNamedBarrier::kLastPVDone, 256>();
      }
    } else {
      LastPV(o, pf);  // a split part's O leaves from registers
    }
    ATTND_HOPPER_TRACE_AT(1 + wg, trace_round, trace::kLastPVDone);
  }
};

}  // namespace attnd::kernels::hopper
