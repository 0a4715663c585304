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
  static_assert(PingPong && IntraOverlap && PolyExpEvery == 0 && !CrossTile, "only the kept variants compile");
  static_assert(SmemEpilogue == 0 || SmemEpilogue == 2, "O from registers or through split K / V stages");
  static_assert(WgRanges == 0 || WgRanges == 2, "per-warpgroup key ranges come with shifted tiles");
  static constexpr int kHeadDim = HeadDim;
  static constexpr int kBlockM = 64 * ConsumerWarpgroups;
  static constexpr int kBlockN = BlockN;
  static constexpr int kStages = Stages;
  // Three consumer warpgroups (FA3's choice at head_dim 64, where the softmax outlasts the GEMMs): two can
  // be in softmax while the third runs its GEMMs.
  static constexpr int kConsumerWarpgroups = ConsumerWarpgroups;
  // SmemEpilogue (`_osk`): O leaves through shared memory and TMA (epilogue_fwd_sm90.cuh) instead of
  // registers-to-global stores. Warpgroup 0 writes its O into the K stage of the tile's last block and
  // warpgroup 1 into that block's V stage: warpgroup 0's last P V ends half a turn before warpgroup 1's, and the
  // K stage is free once warpgroup 1's last S has completed, which was issued before warpgroup 0's last P V. So
  // neither waits for the other's last GEMM before writing. Both stages go back to the producer once their
  // store has read them, right after the next tile's first S is issued.
  static constexpr bool kSmemEpilogue = SmemEpilogue != 0;
  // PDouble (`_p2`): two P register buffers in the overlapped loop. P V of block j+1 reads one while block j's
  // probabilities go into the other, so nothing waits for that P V before they are written, and the softmax of
  // an unmasked block takes its exponentials before its row max and checks them after (Softmax::TryStep). The
  // row max and the conversion of P lie on the chain the other warpgroup's GEMMs have to cover (docs/tuning.md).
  // Costs block_n / 4 registers, so only two-consumer 128-key shapes fit.
  static constexpr bool kPDouble = PDouble;
  static constexpr int kPBuffers = PDouble ? 2 : 1;
  // WgRanges (`_wrs`): each consumer warpgroup visits only the key blocks its own 64 rows may see, and none when
  // its rows lie past q_len; for the blocks it skips it takes empty turns and hands the stages straight back. A
  // 192-row causal tile spans 1.5 key blocks of diagonal, so its first warpgroup's rows see one or two blocks
  // fewer than its last's. Causal tiles also start up to two warpgroups early, so that the rows past a multiple
  // of block_m fill the first tile, which sees the fewest keys, instead of leaving one warpgroup of the last
  // tile to run its blocks with no other to take turns with.
  static constexpr bool kWgRanges = WgRanges != 0;
  static constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);
  // setmaxnreg split of the 64K-register file (multiples of 8): producer + consumers <= 512 per thread slot.
  static constexpr int kProducerRegs = ConsumerWarpgroups == 2 ? 24 : 32;
  static constexpr int kConsumerRegs = ConsumerWarpgroups == 2 ? 240 : 160;
  // Under the dynamic schedule (head_dim 64) the producer warpgroup also runs the tile scheduler's thread, which
  // at 24 registers spills; at 32 it does not, so two consumer warpgroups give up 8.
  static constexpr int kProducerRegsDynamic = 32;
  static constexpr int kConsumerRegsDynamic = ConsumerWarpgroups == 2 ? 232 : 160;
  // head_dim is stored as 64-element (128-byte) panels: the widest row TMA's 128-byte swizzle allows, and
  // exactly one wgmma K-major swizzle atom row.
  static constexpr int kPanels = HeadDim / 64;
  static constexpr int kQBytes = kBlockM * HeadDim * 2;       // one tile's Q
  static constexpr int kKVTileBytes = BlockN * HeadDim * 2;  // one K or one V stage
  // Q full/empty; per stage K full, V full, K empty, V empty.
  static constexpr int kBarriers = 2 + 4 * Stages;
  // +1024: the dynamic shared-memory base is re-aligned to the 1024 bytes of a 128-byte swizzle atom, which
  // wgmma's descriptors (base offset 0) and TMA both rely on. (The dynamic schedule's tile ring is static
  // shared memory, 64 bytes beside this.)
  static constexpr size_t kSmemBytes = 1024 + kQBytes + 2 * Stages * kKVTileBytes + 8 * kBarriers;

  static_assert(HeadDim == 64 || HeadDim == 128 || HeadDim == 256, "head_dim 64, 128 or 256");
  static_assert(ConsumerWarpgroups == 2 || ConsumerWarpgroups == 3, "2 or 3 consumer warpgroups (named barriers)");
  static_assert(!SmemEpilogue || ConsumerWarpgroups == 2, "the shared-memory epilogue: two consumer warpgroups");
  static_assert(!SmemEpilogue || BlockN * HeadDim * 2 >= 64 * HeadDim * 2,
                "a warpgroup's O (64 x head_dim) must fit the stage it is written to");
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
  static_assert(!WgRanges || !SmemEpilogue, "per-warpgroup key ranges: O from registers");
  static_assert(kProducerRegs % 8 == 0 && kConsumerRegs % 8 == 0, "setmaxnreg takes multiples of 8");
  static_assert(kSmemBytes + 64 <= 232448, "Hopper allows 227 KB of shared memory per block");
};

// The configurations that are compiled. Names: hopper_sm90_d<head_dim>_m<block_m>n<block_n>s<stages>[_variant]
// (_osk: O through shared memory and TMA, warpgroup 0's O in the last K stage, warpgroup 1's in the last V stage;
// _p2: two P buffers and the exponentials before the row max; _wrs: per-warpgroup key ranges and shifted tiles).
using HopperD64N128S6P2 = TileShape<64, 128, 6, true, true, 2, 0, false, 0, true>;
using HopperD64M192N128S4Wrs = TileShape<64, 128, 4, true, true, 3, 0, false, 0, false, 2>;
using HopperD128N128S3OskP2 = TileShape<128, 128, 3, true, true, 2, 0, false, 2, true>;
using HopperD256N64S2 = TileShape<256, 64, 2>;

}  // namespace attnd::kernels::hopper
