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
// KvBytes: bytes of a stored K/V element. 2: bf16/fp16 rows land in the stages and the mma reads them there. 1:
// float8 e4m3 rows land in the stages; Q K^T reads K's codes there (converted in registers), and each tile's V is
// converted into one tile of fp16 rows (kConvBytes) that P V reads through ldmatrix.trans.
// MinBlocksPerSm: the blocks per SM the register allocation must leave room for: as many as shared memory lets
// reside on sm_90 at d64 (three), two above; with no floor ptxas caps some shapes below what they need and spills.
template <int HeadDim, int RowBlock, int BlockN, int Stages, int KvBytes = 2,
          int MinBlocksPerSm = (HeadDim == 64 ? 3 : 2)>
struct DecodeTile {
  static constexpr int kHeadDim = HeadDim;
  static constexpr bool kFp8Kv = KvBytes == 1;
  static constexpr int kRowBlock = RowBlock;
  static constexpr int kBlockN = BlockN;
  static constexpr int kStages = Stages;
  static constexpr int kWarpsM = RowBlock / 16;
  static constexpr int kWarpsN = (BlockN / 16 < 4 / kWarpsM) ? BlockN / 16 : 4 / kWarpsM;
  static constexpr int kWarps = kWarpsM * kWarpsN;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kKeysPerWarp = BlockN / kWarpsN;
  static constexpr bool kQInRegs = HeadDim <= 128;
  static constexpr int kRowBytes = HeadDim * 2;    // a 16-bit row as the mma reads it
  static constexpr int kKvRowBytes = HeadDim * KvBytes;  // a stored row as it lands in a stage
  static constexpr int kQBytes = kQInRegs ? 0 : RowBlock * kRowBytes;
  static constexpr int kKVTileBytes = BlockN * kKvRowBytes;  // one K or one V stage
  static constexpr int kConvBytes = kFp8Kv ? BlockN * kRowBytes : 0;
  static constexpr int kMinBlocksPerSm = MinBlocksPerSm;
  static constexpr int kStageBytes = 2 * Stages * kKVTileBytes + kConvBytes;
  // The epilogue reuses the whole buffer: per (warp column, row) the running max and sum, then its O in fp32
  // (rows padded by 4 floats against bank conflicts).
  static constexpr int kScratchBytes = kWarpsN * RowBlock * (2 + HeadDim + 4) * 4;
  static constexpr size_t kSmemBytes =
      static_cast<size_t>(kQBytes + kStageBytes > kScratchBytes ? kQBytes + kStageBytes : kScratchBytes);

  static_assert(HeadDim % 64 == 0, "the 16-byte chunk swizzle needs 8 chunks per row");
  static_assert(KvBytes == 1 || KvBytes == 2, "16-bit or float8 K/V");
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

// Float8 K/V: the same keys per stage as 16-bit K/V (so a plan's split sizes hold for both) in half the bytes, so
// more stages are in flight in the same shared memory, next to the converted V tile. d64: 5 stages (40 KB) + 8 KB.
// d256: 3 stages (48 KB) + 16 KB plus Q. d128, by row block: a float8 block issues more instructions per byte than a
// 16-bit one (the conversions), and with two blocks an SM it waits on its own latencies, so 32 rows take 3 stages
// (48 KB) + 16 KB with registers capped for three blocks an SM; 16 rows keep two blocks (three leave a partial
// wave on batches that fill the GPU once) with 4 stages (64 KB) + 16 KB; 64 rows (capped, they would spill) 5.
template <int HeadDim, int RowBlock>
struct DecodeFp8TileFor;
// d64 float8, 16 and 32 rows: 128 keys a stage (a key costs half the bytes of d128's, so per tile the fixed work -- the
// copies' addressing, the barrier, the softmax's reductions and rescale -- is spread over twice the keys), 2 stages
// (32 KB) + 16 KB, registers capped for four blocks an SM (49 KB each with the reserved 1 KB: four fit sm_90's 228 KB).
// A plan's splits come in 64-key units, so such a tile may reach past its split's end: the kernel masks those keys
// (kTilePastSplit). 64 rows (whose 128-key slice would not fit 128 registers) keep 64 keys, 5 stages (40 KB) + 8 KB.
template <int RowBlock>
struct DecodeFp8TileFor<64, RowBlock> {
  using type = DecodeTile<64, RowBlock, RowBlock == 64 ? 64 : 128, RowBlock == 64 ? 5 : 2, 1, 4>;
};
template <int RowBlock>
struct DecodeFp8TileFor<128, RowBlock> {
  using type = DecodeTile<128, RowBlock, 64, RowBlock == 16 ? 4 : RowBlock == 32 ? 3 : 5, 1, RowBlock == 32 ? 3 : 2>;
};
template <int RowBlock>
struct DecodeFp8TileFor<256, RowBlock> {
  using type = DecodeTile<256, RowBlock, 32, 3, 1>;
};

// Keys per stage for a head_dim (the plan rounds split sizes to it); the same for every row block and K/V format.
constexpr int DecodeBlockN(int head_dim) {
  return head_dim == 64 ? DecodeTileFor<64, 16>::type::kBlockN
         : head_dim == 128 ? DecodeTileFor<128, 16>::type::kBlockN
                           : DecodeTileFor<256, 16>::type::kBlockN;
}
static_assert(DecodeFp8TileFor<64, 16>::type::kBlockN % DecodeBlockN(64) == 0 &&
                  DecodeFp8TileFor<64, 32>::type::kBlockN % DecodeBlockN(64) == 0 &&
                  DecodeFp8TileFor<64, 64>::type::kBlockN % DecodeBlockN(64) == 0 &&
                  DecodeFp8TileFor<128, 16>::type::kBlockN == DecodeBlockN(128) &&
                  DecodeFp8TileFor<256, 16>::type::kBlockN == DecodeBlockN(256),
              "a plan's split size serves both K/V formats (d64 float8: tiles of whole split units, masked past a "
              "split's end)");

// The blocks per SM the split heuristic aims for (DecodeOptions::target_blocks_per_sm 0): as many as a tile needs to
// stream at the bandwidth. A 16-bit d128 block keeps 96 KB of K/V in flight, so one an SM does, and half the splits
// start, merge and read their partials sooner. Float8 blocks spend instructions on conversions, d64 pages take
// twice the table reads per byte and d256 holds 64 KB: two (docs/tuning.md, "Decode family").
constexpr int DecodeBlocksPerSm(int head_dim, bool fp8_kv) { return head_dim == 128 && !fp8_kv ? 1 : 2; }

// Smallest row block holding `rows` (group * q_len), 64 at most: more rows take several blocks.
constexpr int DecodeRowBlock(int rows) { return rows <= 16 ? 16 : rows <= 32 ? 32 : 64; }

}  // namespace attnd::kernels::decode
