// Tile shapes of the Hopper (wgmma, warp-specialized) family, chosen in one place.
//
// One block = 1 producer warpgroup (one thread issues every TMA copy) + 2 or 3 consumer warpgroups, each
// owning 64 query rows (wgmma's M), so block_m = 128 or 192. block_n keys per K/V stage is wgmma's N of
// S = Q K^T; the whole head_dim is wgmma's N of O += P V. Per consumer thread: O is head_dim / 2 fp32
// registers, S block_n / 2, P block_n / 4 — the budget the setmaxnreg split (producer 24 / consumers 240, or
// 32 / 160 with three consumers) has to hold.
#pragma once

#include <cstddef>

namespace attnd::kernels::hopper {

template <int HeadDim, int BlockN, int Stages, bool PingPong = true, bool IntraOverlap = true,
          int ConsumerWarpgroups = 2, int PolyExpEvery = 0, bool CrossTile = false, int SmemEpilogue = 0,
          bool PDouble = false, int WgRanges = 0>
struct TileShape {
  static constexpr int kHeadDim = HeadDim;
  static constexpr int kBlockM = 64 * ConsumerWarpgroups;
  static constexpr int kBlockN = BlockN;
  static constexpr int kStages = Stages;
  // PingPong: the consumer warpgroups take turns issuing GEMMs (named barriers), so one's softmax runs
  // under another's GEMMs. IntraOverlap: inside a warpgroup, softmax of block j runs under P V of block j+1.
  static constexpr bool kPingPong = PingPong;
  static constexpr bool kIntraOverlap = IntraOverlap;
  // Three consumer warpgroups (FA3's choice at head_dim 64, where the softmax outlasts the GEMMs): two can
  // be in softmax while the third runs its GEMMs.
  static constexpr int kConsumerWarpgroups = ConsumerWarpgroups;
  // Every kPolyExpEvery-th 8-column group of S is exponentiated on the FMA pipe (softmax_sm90.cuh); 0: none.
  static constexpr int kPolyExpEvery = PolyExpEvery;
  // CrossTile: a tile's last P V is issued together with the next tile's first Q K^T (one GEMM turn instead
  // of two at every tile change), and its epilogue runs while that P V completes. The next tile's Q must be
  // resident by then, so Q is double-buffered. Pays where tiles are short (few key blocks per tile).
  static constexpr bool kCrossTile = CrossTile;
  static constexpr int kQBuffers = CrossTile ? 2 : 1;
  // SmemEpilogue: O leaves through the V stage the tile's last P V has read (stmatrix, then a TMA store per
  // warpgroup; epilogue_fwd_sm90.cuh) instead of registers-to-global stores. The stage goes back to the producer
  // once the store has read it, which the storing thread checks at its next tile's first block.
  static constexpr bool kSmemEpilogue = SmemEpilogue != 0;
  // SmemEpilogue 2 (kOSplitStages): warpgroup 0 writes its O into the K stage of the tile's last block and
  // warpgroup 1 into that block's V stage. Warpgroup 0's last P V ends half a turn before warpgroup 1's; with one
  // V stage for both, warpgroup 0 waited for the other's last P V before writing, and its epilogue (which the next
  // tile's first S then waits for) ran with the tensor cores idle. The K stage is free once warpgroup 1's last
  // S has completed, and that S was issued before warpgroup 0's last P V. Both stages go back to the producer
  // once their store has read them, right after the next tile's first S is issued.
  static constexpr bool kOSplitStages = SmemEpilogue == 2;
  // PDouble (`_p2`): two P register buffers in the overlapped loop. P V of block j+1 reads one while block j's
  // probabilities go into the other, so nothing waits for that P V before they are written, and the softmax of an
  // unmasked block takes its exponentials before its row max and checks them after (Softmax::TryStep; the raw scores
  // stay in S for the full step when the check fails). The row max and the conversion of P were ~25% of a
  // warpgroup's steady step (hopper_trace's step parts, v19), on the chain the other warpgroup's GEMMs have to
  // cover. Costs block_n / 4 registers, so only two-consumer 128-key shapes fit.
  static constexpr bool kPDouble = PDouble;
  static constexpr int kPBuffers = PDouble ? 2 : 1;
  // WgRanges (`_wr`): each consumer warpgroup visits only the key blocks its own 64 rows may see, and none when its
  // rows lie past q_len; for the blocks it skips it takes empty turns and hands the stages straight back. A 192-row
  // causal tile spans 1.5 key blocks of diagonal, so its first warpgroup's rows see one or two blocks fewer than its
  // last's: at 1k a third of m192's warpgroup-blocks (96 a head against m128's 72) fall there or past the sequence.
  static constexpr bool kWgRanges = WgRanges != 0;
  // WgRanges 2 (`_wrs`): causal tiles also start up to two warpgroups early, so that the rows past a multiple of
  // block_m fill the first tile, which sees the fewest keys, instead of the last: with rows in one warpgroup of the
  // last tile (1k: rows 960..1023) that warpgroup ran the tile's eight blocks with no other to take turns with.
  static constexpr bool kShiftTiles = WgRanges == 2;
  static constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);
  // setmaxnreg split of the 64K-register file (multiples of 8): producer + consumers <= 512 per thread slot.
  static constexpr int kProducerRegs = ConsumerWarpgroups == 2 ? 24 : 32;
  static constexpr int kConsumerRegs = ConsumerWarpgroups == 2 ? 240 : 160;
  // Under the dynamic schedule (head_dim 64) the producer warpgroup also runs the tile scheduler's thread; at 24
  // registers that warpgroup spilled 16 bytes (d64 m128; d128 and d256 4-8), at 32 none, so two consumer
  // warpgroups give up 8 (three had 32 / 160 already).
  static constexpr int kProducerRegsDynamic = 32;
  static constexpr int kConsumerRegsDynamic = ConsumerWarpgroups == 2 ? 232 : 160;
  // head_dim is stored as 64-element (128-byte) panels: the widest row TMA's 128-byte swizzle allows, and
  // exactly one wgmma K-major swizzle atom row.
  static constexpr int kPanels = HeadDim / 64;
  static constexpr int kQBytes = kBlockM * HeadDim * 2;       // one tile's Q (one buffer)
  static constexpr int kKVTileBytes = BlockN * HeadDim * 2;  // one K or one V stage
  // Per Q buffer full/empty; per stage K full, V full, K empty, V empty.
  static constexpr int kBarriers = 2 * kQBuffers + 4 * Stages;
  // +1024: the dynamic shared-memory base is re-aligned to the 1024 bytes of a 128-byte swizzle atom, which
  // wgmma's descriptors (base offset 0) and TMA both rely on. (The dynamic schedule's tile ring is static
  // shared memory, 64 bytes beside this.)
  static constexpr size_t kSmemBytes = 1024 + kQBuffers * kQBytes + 2 * Stages * kKVTileBytes + 8 * kBarriers;

  static_assert(HeadDim == 64 || HeadDim == 128 || HeadDim == 256, "head_dim 64, 128 or 256");
  static_assert(ConsumerWarpgroups == 2 || ConsumerWarpgroups == 3, "2 or 3 consumer warpgroups (named barriers)");
  static_assert(PingPong || ConsumerWarpgroups == 2, "3 consumer warpgroups only make sense taking turns");
  static_assert(!CrossTile || IntraOverlap, "the cross-tile step is the overlapped step spanning two tiles");
  static_assert(!SmemEpilogue || (IntraOverlap && !CrossTile && ConsumerWarpgroups == 2),
                "the shared-memory epilogue follows the overlapped loop's last P V, two consumer warpgroups");
  static_assert(SmemEpilogue >= 0 && SmemEpilogue <= 2, "SmemEpilogue: 0 none, 1 the V stage, 2 split K / V");
  static_assert(!SmemEpilogue || BlockN * HeadDim * 2 >= 64 * ConsumerWarpgroups * HeadDim * 2,
                "O (block_m x head_dim) must fit the V stage it is written to");
  static_assert(kBlockM <= 256, "one TMA box spans at most 256 rows");
  static_assert(BlockN % 16 == 0 && BlockN >= 64 && BlockN <= 256, "block_n: wgmma N of S and k16 steps of P V");
  static_assert((BlockN * 128) % 1024 == 0, "each K/V panel must keep the 1024-byte swizzle-atom alignment");
  static_assert(Stages >= 2, "the producer needs at least two stages to run ahead of the consumers");
  // O + S + P plus ~32 for addresses, softmax state and loop counters (ptxas -v must still show no spills).
  static_assert(HeadDim / 2 + BlockN / 2 + kPBuffers * BlockN / 4 + 32 <= kConsumerRegs,
                "O + S + P must fit the consumer budget");
  static_assert(kProducerRegs + kConsumerWarpgroups * kConsumerRegs <= 65536 / 128, "register file per SM");
  static_assert(kProducerRegsDynamic + kConsumerWarpgroups * kConsumerRegsDynamic <=
                    kProducerRegs + kConsumerWarpgroups * kConsumerRegs,
                "the dynamic split moves registers, it cannot add any");
  static_assert(HeadDim / 2 + BlockN / 2 + kPBuffers * BlockN / 4 + 32 <= kConsumerRegsDynamic,
                "O + S + P, dynamic split");
  static_assert(!PDouble || (IntraOverlap && !CrossTile), "two P buffers: the overlapped loop, one tile at a time");
  static_assert(!PDouble || PolyExpEvery == 0, "the speculative exponentials are MUFU's");
  static_assert(WgRanges >= 0 && WgRanges <= 2, "WgRanges: 0 none, 1 per-warpgroup key ranges, 2 and shifted tiles");
  static_assert(!WgRanges || (PingPong && IntraOverlap && !CrossTile && !SmemEpilogue),
                "per-warpgroup key ranges: the overlapped loop with turns, O from registers");
  static_assert(kProducerRegs % 8 == 0 && kConsumerRegs % 8 == 0, "setmaxnreg takes multiples of 8");
  static_assert(kSmemBytes + 64 <= 232448, "Hopper allows 227 KB of shared memory per block");
};

// The configurations that are compiled. Names: hopper_sm90_d<head_dim>_m<block_m>n<block_n>s<stages>[_variant]
// (_x: cross-tile; _os: O through shared memory and TMA, in the last V stage; _osk: the same with split O stages,
// warpgroup 0's O in the last K stage; _p2: two P buffers and the exponentials before the row max).
using HopperD64N128S4 = TileShape<64, 128, 4>;
using HopperD64M192N128S4 = TileShape<64, 128, 4, true, true, 3>;
using HopperD64N128S4X = TileShape<64, 128, 4, true, true, 2, 0, true>;
// Auto's on the d64 short rows from v21 until v27.
using HopperD64N128S4P2 = TileShape<64, 128, 4, true, true, 2, 0, false, 0, true>;
// v27: six K/V stages (209 KB of shared memory): the producer runs further into the next tiles. Auto's on the d64
// short rows from session 21 (plan.cc; over s4: causal 1k +1%, the other short rows level).
using HopperD64N128S6P2 = TileShape<64, 128, 6, true, true, 2, 0, false, 0, true>;
// v47: m192 with per-warpgroup key ranges (`_wr`).
using HopperD64M192N128S4Wr = TileShape<64, 128, 4, true, true, 3, 0, false, 0, false, 1>;
using HopperD64M192N128S4Wrs = TileShape<64, 128, 4, true, true, 3, 0, false, 0, false, 2>;
// Not compiled: d64 m192 cross-tile (92 bytes of spills under the 160-register consumer budget).
using HopperD64M192N128S4Poly = TileShape<64, 128, 4, true, true, 3, 4>;
using HopperD64N128S4Poly = TileShape<64, 128, 4, true, true, 2, 4>;
using HopperD128N128S2 = TileShape<128, 128, 2>;
using HopperD128N128S2Plain = TileShape<128, 128, 2, false, false>;  // no ping-pong, no overlap: baseline
using HopperD128N128S3 = TileShape<128, 128, 3>;
using HopperD128N128S2X = TileShape<128, 128, 2, true, true, 2, 0, true>;  // 2 Q buffers: s3 would not fit
using HopperD128N160S2 = TileShape<128, 160, 2>;
using HopperD128N176S2 = TileShape<128, 176, 2>;  // FA3's non-causal d128 shape
using HopperD128N128S3Osk = TileShape<128, 128, 3, true, true, 2, 0, false, 2>;  // auto's below 16k keys until v21
using HopperD128N128S3OskP2 = TileShape<128, 128, 3, true, true, 2, 0, false, 2, true>;  // auto's (v21)
// 128x176 keeps one V stage for both warpgroups' O: with two stages, split O stages hold back the next tile's second
// K block, which its first step needs (non-causal 16k 1.4-3.5% behind, causal level; session 12, call 1). s3's
// _os (both warpgroups' O in the V stage) was behind _osk on every row below 16k keys; it is no longer compiled.
using HopperD128N176S2Os = TileShape<128, 176, 2, true, true, 2, 0, false, 1>;  // auto's from 8-16k keys until v21
using HopperD256N64S2 = TileShape<256, 64, 2>;
using HopperD256N80S2 = TileShape<256, 80, 2>;
// Not compiled: d256 cross-tile (two 64 KB Q buffers + two 64 KB K/V stages exceed 227 KB).

}  // namespace attnd::kernels::hopper
