// Tile shapes of the mma.sync family, chosen in one place. Each shape is one configuration; the *_sm120 ones fit
// the 99 KB of shared memory a block may have on sm_120 and are compiled for sm_120a as well as sm_90a, the
// *_sm90 ones use Hopper's 227 KB and are compiled for sm_90a only.
#pragma once

#include <cstddef>

namespace attnd::kernels::mma_sync {

// kHeadDim: the whole head_dim is one tile (online softmax needs full dot products).
// kBlockM: query rows per block; each warp owns 16 rows, so kBlockM / 16 warps.
// kBlockN: key rows per K/V stage. kStages: K/V pipeline depth (1 = the seed article's single buffer).
// kMRep: 16-row mma atoms per warp. 2 gives each warp 32 rows, so every K/V fragment read from shared memory
//   feeds two mma instead of one (shared-memory bandwidth, not the tensor cores, limits 16-row warps on H200),
//   at the price of twice the accumulator registers.
// kQInRegs: Q fragments live in registers for the whole KV loop when they fit (not at d=256 or with kMRep=2
//   at d=128); otherwise they are re-read from shared memory at each k-step.
template <int HeadDim, int BlockM, int BlockN, int Stages, bool Sm120, int MRep = 1>
struct TileShape {
  static constexpr int kHeadDim = HeadDim;
  static constexpr int kBlockM = BlockM;
  static constexpr int kBlockN = BlockN;
  static constexpr int kStages = Stages;
  static constexpr bool kSm120 = Sm120;
  static constexpr int kMRep = MRep;
  static constexpr bool kQInRegs = HeadDim * MRep <= 128;
  static constexpr int kWarps = BlockM / (16 * MRep);
  static constexpr int kThreads = kWarps * 32;
  // head_dim is split into 64-element (128-byte) panels: the widest row TMA's 128-byte swizzle allows.
  static constexpr int kPanels = HeadDim / 64;
  static constexpr int kQBytes = BlockM * HeadDim * 2;
  static constexpr int kKVTileBytes = BlockN * HeadDim * 2;  // one K or one V stage
  static constexpr int kBarriers = 1 + 3 * Stages;           // Q full; K full, V full, K/V empty per stage
  // +1024: the dynamic shared-memory base is re-aligned to the 1024 bytes the 128-byte swizzle pattern needs.
  static constexpr size_t kSmemBytes = 1024 + kQBytes + 2 * Stages * kKVTileBytes + 8 * kBarriers;

  static_assert(HeadDim % 64 == 0, "head_dim must be a multiple of the 64-element panel");
  static_assert(BlockM % (16 * MRep) == 0 && BlockN % 16 == 0, "tiles are made of 16x16 mma steps");
  static_assert(BlockM <= 256 && BlockN <= 256, "one TMA box spans at most 256 rows");
  static_assert(!Sm120 || kSmemBytes <= 101376, "an sm_120 configuration must fit 99 KB per block");
  static_assert(kSmemBytes <= 232448, "Hopper allows 227 KB per block");
};

// The configurations that are compiled: DefaultConfig's choices (plan.cc). Names:
// mma_sync_<budget>_d<head_dim>_m<BlockM>n<BlockN>s<Stages>[w4 for kMRep 2].
// Sm120 budget (sm_120's choices at every head_dim, and the H200's at d64 below 2k and at d256):
using MmaSyncSm120D64 = TileShape<64, 64, 64, 2, true>;
using MmaSyncSm120D128 = TileShape<128, 64, 64, 1, true>;  // the seed article's own 48 KB shape
using MmaSyncSm120D256 = TileShape<256, 64, 64, 1, true>;
// Hopper budget: two blocks of up to ~113 KB share an SM's 228 KB. The 32-rows-a-warp shapes (w4) once 128-row
// blocks fill two per SM, 64-row blocks below (twice the blocks).
using MmaSyncSm90D64M128S2R2 = TileShape<64, 128, 64, 2, false, 2>;
using MmaSyncSm90D128M64S2 = TileShape<128, 64, 64, 2, false>;
using MmaSyncSm90D128M128S2R2 = TileShape<128, 128, 64, 2, false, 2>;

}  // namespace attnd::kernels::mma_sync
