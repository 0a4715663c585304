// Tile shapes of the Hopper (wgmma, warp-specialized) family, chosen in one place.
//
// One block = 1 producer warpgroup (one thread issues every TMA copy) + 2 or 3 consumer warpgroups, each
// owning 64 query rows (wgmma's M), so block_m = 128 or 192. block_n keys per K/V stage is wgmma's N of
// S = Q K^T; the whole head_dim is wgmma's N of O += P V. Per consumer thread: O is head_dim / 2 fp32
// registers, S block_n / 2, P block_n / 4 (float8: block_n / 8) — the budget the setmaxnreg split (producer 24 /
// consumers 240, or 32 / 160 with three consumers) has to hold.
#pragma once

#include <cstddef>

namespace attnd::kernels::hopper {

// A configuration names its shape and the features it turns on; TileShape<Config> derives the rest (register
// split, shared-memory layout) and checks that the pieces fit. Feature flags default to off.
struct HopperTileFeatures {
  // Consumer warpgroups of 64 query rows each: block_m = 64 x this.
  static constexpr int kConsumerWarpgroups = 2;
  // O leaves through shared memory and TMA (`_osk`, epilogue_fwd_sm90.cuh) instead of registers-to-global stores.
  // Warpgroup 0 writes its O into the K stage of the tile's last block and warpgroup 1 into that block's V stage:
  // warpgroup 0's last P V ends half a turn before warpgroup 1's, and the K stage is free once warpgroup 1's last S
  // has completed, which was issued before warpgroup 0's last P V. So neither waits for the other's last GEMM before
  // writing. Both stages go back to the producer once their store has read them, right after the next tile's
  // first S is issued.
  static constexpr bool kSmemEpilogue = false;
  // Two P register buffers in the overlapped loop (`_p2`): P V of block j+1 reads one while block j's
  // probabilities go into the other, so nothing waits for that P V before they are written, and the softmax of an
  // unmasked block takes its exponentials before its row max and checks them after (Softmax::TryStep). The row max
  // and the conversion of P lie on the chain the other warpgroup's GEMMs have to cover (docs/tuning.md). Costs
  // block_n / 4 registers, so only two-consumer 128-key shapes fit.
  static constexpr bool kPDouble = false;
  // Per-warpgroup key ranges and shifted tiles (`_wrs`): each consumer warpgroup visits only the key blocks its own
  // 64 rows may see, and none when its rows lie past q_len; for the blocks it skips it takes empty turns and hands
  // the stages straight back. A 192-row causal tile spans 1.5 key blocks of diagonal, so its first warpgroup's rows
  // see one or two blocks fewer than its last's. Causal tiles also start up to two warpgroups early, so that the
  // rows past a multiple of block_m fill the first tile, which sees the fewest keys, instead of leaving one
  // warpgroup of the last tile to run its blocks with no other to take turns with.
  static constexpr bool kWgRanges = false;
  // The static and paired orders' last round may be split by key blocks (split_tail_sm90.cuh): two more kernels
  // per element type, compiled only where auto's long non-causal and paired problems gain from it.
  static constexpr bool kSplitTail = false;
  // Bytes per element of Q, K and V: 2 (bf16 and fp16 from one configuration) or 1 (float8 e4m3, `_fp8`: k32 wgmma
  // steps, V read transposed from DeviceTensors::v_t, O stored as bf16 from registers).
  static constexpr int kElemBytes = 2;
};

template <typename Config>
struct TileShape : Config {
  using Config::kConsumerWarpgroups;
  using Config::kHeadDim;
  using Config::kBlockN;
  using Config::kStages;
  using Config::kSmemEpilogue;
  using Config::kPDouble;
  using Config::kWgRanges;
  using Config::kElemBytes;
  static constexpr bool kFp8 = kElemBytes == 1;
  static constexpr int kBlockM = 64 * kConsumerWarpgroups;
  static constexpr int kPBuffers = kPDouble ? 2 : 1;
  static constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);
  // setmaxnreg split of the 64K-register file (multiples of 8): producer + consumers <= 512 per thread slot.
  static constexpr int kProducerRegs = kConsumerWarpgroups == 2 ? 24 : 32;
  static constexpr int kConsumerRegs = kConsumerWarpgroups == 2 ? 240 : 160;
  // Under the dynamic schedule (head_dim 64) the producer warpgroup also runs the tile scheduler's thread, which
  // at 24 registers spills; at 32 it does not, so two consumer warpgroups give up 8.
  static constexpr int kProducerRegsDynamic = 32;
  static constexpr int kConsumerRegsDynamic = kConsumerWarpgroups == 2 ? 232 : 160;
  // head_dim is stored as 128-byte panels (64 16-bit or 128 float8 elements): the widest row TMA's 128-byte
  // swizzle allows, and exactly one wgmma K-major swizzle atom row. A float8 V stage is head_dim rows of block_n keys.
  static constexpr int kPanelElems = 128 / kElemBytes;
  static constexpr int kPanels = kHeadDim / kPanelElems;
  static constexpr int kQBytes = kBlockM * kHeadDim * kElemBytes;       // one tile's Q
  static constexpr int kKVTileBytes = kBlockN * kHeadDim * kElemBytes;  // one K or one V stage
  // Q full/empty; per stage K full, V full, K empty, V empty.
  static constexpr int kBarriers = 2 + 4 * kStages;
  // +1024: the dynamic shared-memory base is re-aligned to the 1024 bytes of a 128-byte swizzle atom, which
  // wgmma's descriptors (base offset 0) and TMA both rely on. (The dynamic schedule's tile ring is static
  // shared memory, 64 bytes beside this.)
  static constexpr size_t kSmemBytes = 1024 + kQBytes + 2 * kStages * kKVTileBytes + 8 * kBarriers;

  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "head_dim 64, 128 or 256");
  static_assert(kConsumerWarpgroups == 2 || kConsumerWarpgroups == 3, "2 or 3 consumer warpgroups (named barriers)");
  static_assert(!kSmemEpilogue || kConsumerWarpgroups == 2, "the shared-memory epilogue: two consumer warpgroups");
  static_assert(!kSmemEpilogue || 64 * kHeadDim * 2 <= kKVTileBytes,
                "a warpgroup's O (64 x head_dim, 16-bit) must fit the stage it is written to");
  static_assert(kBlockM <= 256, "one TMA box spans at most 256 rows");
  static_assert(kBlockN % 16 == 0 && kBlockN >= 64 && kBlockN <= 256, "block_n: wgmma N of S and k16 steps of P V");
  static_assert((kBlockN * 128) % 1024 == 0, "each K/V panel must keep the 1024-byte swizzle-atom alignment");
  static_assert(kStages >= 2, "the producer needs at least two stages to run ahead of the consumers");
  // O + S + P plus ~32 for addresses, softmax state and loop counters (ptxas -v must still show no spills).
  static_assert(kHeadDim / 2 + kBlockN / 2 + kPBuffers * kBlockN * kElemBytes / 8 + 32 <= kConsumerRegs,
                "O + S + P must fit the consumer budget");
  static_assert(kProducerRegs + kConsumerWarpgroups * kConsumerRegs <= 65536 / 128, "register file per SM");
  static_assert(kProducerRegsDynamic + kConsumerWarpgroups * kConsumerRegsDynamic <=
                    kProducerRegs + kConsumerWarpgroups * kConsumerRegs,
                "the dynamic split moves registers, it cannot add any");
  // The dynamic order runs at head_dim 64 only (MayRunDynamic).
  static_assert(kHeadDim != 64 ||
                    kHeadDim / 2 + kBlockN / 2 + kPBuffers * kBlockN * kElemBytes / 8 + 32 <= kConsumerRegsDynamic,
                "O + S + P, dynamic split");
  static_assert(!kWgRanges || !kSmemEpilogue, "per-warpgroup key ranges: O from registers");
  static_assert(!kPDouble || kConsumerWarpgroups == 2, "two P buffers: two consumer warpgroups' budget");
  static_assert(kProducerRegs % 8 == 0 && kConsumerRegs % 8 == 0, "setmaxnreg takes multiples of 8");
  static_assert(kSmemBytes + 64 <= 232448, "Hopper allows 227 KB of shared memory per block");
  static_assert(kElemBytes == 1 || kElemBytes == 2, "16-bit or float8 elements");
  // Float8: a 64-element row is 64 bytes, which needs the 64-byte swizzle; one 128-key V^T panel per stage; a
  // warpgroup's bf16 O (64 x head_dim x 2 bytes) is exactly one stage for the shared-memory epilogue.
  static_assert(!kFp8 || kHeadDim >= 128, "float8: head_dim 128 or 256");
  static_assert(!kFp8 || kBlockN == 128, "float8: block_n 128 (one V^T panel)");
  static_assert(!kFp8 || (!kWgRanges && !Config::kSplitTail), "float8: whole key ranges, no split tail");
};

// The configurations that are compiled (auto's choices, plan.cc). Registry names:
// hopper_sm90_d<head_dim>_m<block_m>n<block_n>s<stages>[_variant].

// hopper_sm90_d64_m128n128s6_p2: six stages (209 KB of shared memory) let the producer run further into the next
// tiles (docs/tuning.md).
struct HopperD64M128N128S6P2 : HopperTileFeatures {
  static constexpr int kHeadDim = 64, kBlockN = 128, kStages = 6;
  static constexpr bool kPDouble = true;
};
// hopper_sm90_d64_m192n128s4_wrs: three consumer warpgroups (FA3's choice at head_dim 64, where the softmax outlasts
// the GEMMs: two can be in softmax while the third runs its GEMMs).
struct HopperD64M192N128S4Wrs : HopperTileFeatures {
  static constexpr int kHeadDim = 64, kBlockN = 128, kStages = 4;
  static constexpr int kConsumerWarpgroups = 3;
  static constexpr bool kWgRanges = true;
};
// hopper_sm90_d128_m128n128s3_osk_p2.
struct HopperD128M128N128S3OskP2 : HopperTileFeatures {
  static constexpr int kHeadDim = 128, kBlockN = 128, kStages = 3;
  static constexpr bool kSmemEpilogue = true, kPDouble = true, kSplitTail = true;
};
// hopper_sm90_d256_m128n64s2.
struct HopperD256M128N64S2 : HopperTileFeatures {
  static constexpr int kHeadDim = 256, kBlockN = 64, kStages = 2;
  static constexpr bool kSplitTail = true;
};

// hopper_sm90_d128_fp8_m128n128s6_osk_p2: float8 e4m3 Q, K and V^T with bf16 O. Float8 halves the stages, so six fit
// (208 KiB); the shared-memory epilogue and two P buffers pay as they do in 16 bits (docs/tuning.md, "Float8").
struct HopperD128Fp8M128N128S6OskP2 : HopperTileFeatures {
  static constexpr int kHeadDim = 128, kBlockN = 128, kStages = 6;
  static constexpr int kElemBytes = 1;
  static constexpr bool kSmemEpilogue = true, kPDouble = true;
};
// hopper_sm90_d256_fp8_m128n128s2: O (128 registers) leaves no room for a second P buffer.
struct HopperD256Fp8M128N128S2 : HopperTileFeatures {
  static constexpr int kHeadDim = 256, kBlockN = 128, kStages = 2;
  static constexpr int kElemBytes = 1;
};

}  // namespace attnd::kernels::hopper
