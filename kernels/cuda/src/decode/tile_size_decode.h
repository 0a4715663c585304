// Tile shapes of the decode kernels, chosen in one place, per head_dim and per row block (the q heads of a
// GQA group times q_len, padded to a multiple of 16). One set of shapes runs on sm_90a and sm_120a, so every
// block fits sm_120's 99 KB of shared memory; on the H200 two or three blocks share an SM.
#pragma once

#include <cstddef>

namespace attnd::kernels::decode {

// kBlockN: keys per pipeline stage. kStages: K/V stages in flight (cp.async groups).
// kWarpsM x kWarpsN warps: kWarpsM own 16 rows each, kWarpsN split each stage's keys between them (16 keys
// at least, the k of one P.V mma) and merge their softmax states at the end.
// kQInRegs: Q's mma fragments are read from global memory into registers once (head_dim <= 128); at 256 they
// would take 64 registers next to a 128-register O accumulator, so Q is staged in shared memory instead.
template <int HeadDim, int RowBlock, int BlockN, int Stages>
struct DecodeTile {
  static constexpr int kHeadDim = HeadDim;
  static constexpr int kRowBlock = RowBlock;
  static constexpr int kBlockN = BlockN;
  static constexpr int kStages = Stages;
  static constexpr int kWarpsM = RowBlock / 16;
  static constexpr int kWarpsN = (BlockN / 16 < 4 / kWarpsM) ? BlockN / 16 : 4 / kWarpsM;
  static constexpr int kWarps = kWarpsM * kWarpsN;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kKeysPerWarp = BlockN / kWarpsN;
  static constexpr bool kQInRegs = HeadDim <= 128;
  static constexpr int kRowBytes = HeadDim * 2;
  static constexpr int kQBytes = kQInRegs ? 0 : RowBlock * kRowBytes;
  static constexpr int kKVTileBytes = BlockN * kRowBytes;  // one K or one V stage
  // Blocks per SM the register allocation must leave room for: as many as shared memory lets reside on sm_90
  // at d64 (three), two above; with no floor ptxas caps some shapes below what they need and spills.
  static constexpr int kMinBlocksPerSm = HeadDim == 64 ? 3 : 2;
  static constexpr int kStageBytes = 2 * Stages * kKVTileBytes;
  // The epilogue reuses the whole buffer: per (warp column, row) the running max and sum, then its O in fp32
  // (rows padded by 4 floats against bank conflicts).
  static constexpr int kScratchBytes = kWarpsN * RowBlock * (2 + HeadDim + 4) * 4;
  static constexpr size_t kSmemBytes =
      static_cast<size_t>(kQBytes + kStageBytes > kScratchBytes ? kQBytes + kStageBytes : kScratchBytes);

  static_assert(HeadDim % 64 == 0, "the 16-byte chunk swizzle needs 8 chunks per row");
  static_assert(RowBlock % 16 == 0 && RowBlock <= 64, "rows come in m16 tiles, four warps at most");
  static_assert(kKeysPerWarp % 16 == 0, "each warp's keys feed whole k16 steps of P.V");
  static_assert(kSmemBytes <= 101376, "a block must fit sm_120's 99 KB");
};

// d64: 4 stages of 64 keys (64 KB). d128: 3 stages of 64 keys (96 KB; Q lives in registers). d256: 2 stages of
// 32 keys (64 KB) plus Q.
template <int HeadDim, int RowBlock>
struct DecodeTileFor;
template <int RowBlock>
struct DecodeTileFor<64, RowBlock> {
  using type = DecodeTile<64, RowBlock, 64, 4>;
};
template <int RowBlock>
struct DecodeTileFor<128, RowBlock> {
  using type = DecodeTile<128, RowBlock, 64, 3>;
};
template <int RowBlock>
struct DecodeTileFor<256, RowBlock> {
  using type = DecodeTile<256, RowBlock, 32, 2>;
};

// Keys per stage for a head_dim (the plan rounds split sizes to it); the same for every row block.
constexpr int DecodeBlockN(int head_dim) {
  return head_dim == 64 ? DecodeTileFor<64, 16>::type::kBlockN
         : head_dim == 128 ? DecodeTileFor<128, 16>::type::kBlockN
                           : DecodeTileFor<256, 16>::type::kBlockN;
}

// Smallest row block holding `rows` (group * q_len), 64 at most: more rows take several blocks.
constexpr int DecodeRowBlock(int rows) { return rows <= 16 ? 16 : rows <= 32 ? 32 : 64; }

}  // namespace attnd::kernels::decode
