// The mma.sync family's forward kernel (the seed article's design), composed of the load (TMA), compute (mma.sync), softmax and epilogue
// roles. One block computes block_m query rows of one (batch, head); each warp owns 16 * kMRep of them.
//
//   S = Q K^T          Q from registers (or shared memory at d=256), K from a swizzled stage via ldmatrix
//   P = softmax(S)     online, exp2 domain, lazy rescale (common/online_softmax.cuh); masked only where needed
//   O += P V           P reused in registers as the A operand; V via ldmatrix.trans
//
// Pipeline: thread 0 issues TMA copies; K and V of a stage complete on separate barriers so QK^T starts while
// V is in flight. Tile j + stages - 1 is issued at the start of step j into the stage tile j - 1 used, once
// every thread has arrived on that stage's empty barrier.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <type_traits>

#include "attnd/kernels/attention.h"
#include "epilogue.cuh"
#include "../common/key_range.cuh"
#include "../common/mma_sm80.cuh"
#include "../common/online_softmax.cuh"
#include "../common/tma_sm90.cuh"

namespace attnd::kernels::mma_sync {

template <typename Tile, typename Elem>
__global__ void __launch_bounds__(Tile::kThreads)
    MmaSyncFwdKernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
                  const __grid_constant__ CUtensorMap v_map, const LaunchParams p) {
  constexpr int D = Tile::kHeadDim, BM = Tile::kBlockM, BN = Tile::kBlockN, S = Tile::kStages;
  constexpr int kPanels = Tile::kPanels;
  constexpr int kQPanelBytes = BM * 128, kKVPanelBytes = BN * 128;
  constexpr int kKTiles = D / 16;   // k-steps of QK^T
  constexpr int kNTiles = BN / 8;   // 8-column tiles of S
  constexpr int kDTiles = D / 8;    // 8-column tiles of O
  constexpr int MR = Tile::kMRep;   // 16-row atoms per warp

  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint8_t* q_s = smem;
  uint8_t* k_s = q_s + Tile::kQBytes;             // stage st at k_s + st * kKVTileBytes
  uint8_t* v_s = k_s + S * Tile::kKVTileBytes;
  uint64_t* bars = reinterpret_cast<uint64_t*>(v_s + S * Tile::kKVTileBytes);
  uint64_t* q_full = bars;
  uint64_t* k_full = bars + 1;
  uint64_t* v_full = bars + 1 + S;
  uint64_t* kv_empty = bars + 1 + 2 * S;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  // Block order (blocks start in index order). Causal: (head, batch) pairs are cut into sections whose K/V fit
  // about half the L2 (p.section pairs); inside a section the longest q tiles of all its heads go first (rank
  // slowest, heads fastest), so a section's last wave holds short blocks and no head's long blocks start late,
  // while the section's K/V prefixes stay in L2 for all its blocks.
  // Non-causal: equal blocks, the seed article's q-tile-fastest order (neighbouring blocks read the same K/V tiles).
  const int lin = static_cast<int>(blockIdx.x);
  int q_tile, hb;
  if (p.causal) {
    const int heads_batches = p.q_heads * p.batch;
    const int per_section = p.section * p.num_q_tiles;  // blocks of each full section
    const int sec = lin / per_section;
    const int within = lin - sec * per_section;
    const int sec_hb0 = sec * p.section;
    const int sec_size = min(p.section, heads_batches - sec_hb0);
    q_tile = p.num_q_tiles - 1 - within / sec_size;
    hb = sec_hb0 + within % sec_size;
  } else {
    q_tile = lin % p.num_q_tiles;
    hb = lin / p.num_q_tiles;
  }
  const int head = hb % p.q_heads, batch = hb / p.q_heads;
  const int kv_head = head / p.group;
  const int q0 = q_tile * BM;

  // Key tiles [0, n_full) are visible to every row of the block and need no mask; tiles [n_full, n_tiles) hold the
  // diagonal and/or the kv_len tail and are masked element-wise.
  const common::KeyRange keys = common::KeyRangeFor<BM, BN>(p, q0);
  const int n_tiles = keys.n_blocks, n_full = keys.n_full;

  auto issue_kv = [&](int tile) {
    const int st = tile % S;
    common::MbarArriveExpectTx(&k_full[st], Tile::kKVTileBytes);
#pragma unroll
    for (int pn = 0; pn < kPanels; ++pn)
      common::TmaLoad4d(k_s + st * Tile::kKVTileBytes + pn * kKVPanelBytes, &k_map, &k_full[st], pn * 64, kv_head,
                tile * BN, batch);
    common::MbarArriveExpectTx(&v_full[st], Tile::kKVTileBytes);
#pragma unroll
    for (int pn = 0; pn < kPanels; ++pn)
      common::TmaLoad4d(v_s + st * Tile::kKVTileBytes + pn * kKVPanelBytes, &v_map, &v_full[st], pn * 64, kv_head,
                tile * BN, batch);
  };

  if (tid == 0) {
    common::PrefetchTensorMap(&q_map);
    common::PrefetchTensorMap(&k_map);
    common::PrefetchTensorMap(&v_map);
    common::MbarInit(q_full, 1);
#pragma unroll
    for (int st = 0; st < S; ++st) {
      common::MbarInit(&k_full[st], 1);
      common::MbarInit(&v_full[st], 1);
      common::MbarInit(&kv_empty[st], Tile::kThreads);
    }
    common::FenceBarrierInit();
  }
  __syncthreads();
  if (tid == 0) {
    common::MbarArriveExpectTx(q_full, Tile::kQBytes);
#pragma unroll
    for (int pn = 0; pn < kPanels; ++pn) common::TmaLoad4d(q_s + pn * kQPanelBytes, &q_map, q_full, pn * 64, head, q0, batch);
    for (int tile = 0; tile < S - 1 && tile < n_tiles; ++tile) issue_kv(tile);
  }
  __syncwarp();

  // Per-lane ldmatrix offsets. A 16x16 operand is four 8x8 matrices; lane l supplies one row address.
  // Q (A operand, rows x d): matrices (rows 0-7 | 8-15) x (d 0-7 | 8-15), row = l % 16, d-chunk = l / 16.
  const int warp_row0 = warp * 16 * MR;  // the warp's first row in the block
  const int q_row = warp_row0 + (lane & 15);
  const int q_chunk = lane >> 4;
  // K (B operand of QK^T, non-transposed): key = l % 8 + 8 * (l / 16), d-chunk = (l / 8) % 2.
  const int k_row = (lane & 7) + ((lane >> 4) << 3);
  const int k_chunk = (lane >> 3) & 1;
  // V (B operand of PV, transposed): key = l % 8 + 8 * ((l / 8) % 2), d-chunk = l / 16.
  const int v_row = (lane & 7) + (((lane >> 3) & 1) << 3);
  const int v_chunk = lane >> 4;
  const uint32_t q_base = common::SmemAddr(q_s);

  auto q_frag_addr = [&](int ma, int kk) {
    const int chunk = kk * 2 + q_chunk;
    return q_base + (chunk / 8) * kQPanelBytes + common::Swizzle128(q_row + ma * 16, chunk % 8);
  };

  common::MbarWait(q_full, 0);
  uint32_t q_frag[MR][Tile::kQInRegs ? kKTiles : 1][4];
  if constexpr (Tile::kQInRegs) {
#pragma unroll
    for (int ma = 0; ma < MR; ++ma)
#pragma unroll
      for (int kk = 0; kk < kKTiles; ++kk) common::LdMatrixX4(q_frag[ma][kk], q_frag_addr(ma, kk));
  }

  float acc_o[MR][kDTiles][4];
  common::OnlineSoftmax<kNTiles, common::Rescale::kLazy> softmax[MR];
#pragma unroll
  for (int ma = 0; ma < MR; ++ma) {
#pragma unroll
    for (int d = 0; d < kDTiles; ++d) acc_o[ma][d][0] = acc_o[ma][d][1] = acc_o[ma][d][2] = acc_o[ma][d][3] = 0.f;
    softmax[ma].Init();
  }

  const int g = lane >> 2;
  // One past the last key a row may see.
  auto row_end = [&](int row) {
    if (!p.causal) return p.kv_len;
    const int64_t end = static_cast<int64_t>(row) + p.causal_offset + 1;
    return static_cast<int>(end < 0 ? 0 : (end > p.kv_len ? p.kv_len : end));
  };

  auto step = [&](int j, auto masked) {
    constexpr bool kMasked = decltype(masked)::value;
    const int st = j % S;
    const uint32_t parity = (j / S) & 1;
    if (tid == 0 && j + S - 1 < n_tiles) {
      const int tile = j + S - 1;
      if (tile >= S) common::MbarWait(&kv_empty[tile % S], ((tile / S) - 1) & 1);  // tile - S has left the stage
      issue_kv(tile);
    }
    __syncwarp();

    // S = Q K^T
    float s[MR][kNTiles][4];
#pragma unroll
    for (int ma = 0; ma < MR; ++ma)
#pragma unroll
      for (int i = 0; i < kNTiles; ++i) s[ma][i][0] = s[ma][i][1] = s[ma][i][2] = s[ma][i][3] = 0.f;
    const uint32_t k_base = common::SmemAddr(k_s + st * Tile::kKVTileBytes);
    common::MbarWait(&k_full[st], parity);
#pragma unroll
    for (int kk = 0; kk < kKTiles; ++kk) {
      uint32_t a[MR][4];
#pragma unroll
      for (int ma = 0; ma < MR; ++ma) {
        if constexpr (Tile::kQInRegs) {
          a[ma][0] = q_frag[ma][kk][0], a[ma][1] = q_frag[ma][kk][1];
          a[ma][2] = q_frag[ma][kk][2], a[ma][3] = q_frag[ma][kk][3];
        } else {
          common::LdMatrixX4(a[ma], q_frag_addr(ma, kk));
        }
      }
      const int chunk = kk * 2 + k_chunk;
#pragma unroll
      for (int nn = 0; nn < BN / 16; ++nn) {
        uint32_t b[4];
        common::LdMatrixX4(b, k_base + (chunk / 8) * kKVPanelBytes + common::Swizzle128(nn * 16 + k_row, chunk % 8));
#pragma unroll
        for (int ma = 0; ma < MR; ++ma) {  // one K fragment, MR mma
          common::ElemTraits<Elem>::Mma(s[ma][2 * nn], a[ma], b[0], b[1]);
          common::ElemTraits<Elem>::Mma(s[ma][2 * nn + 1], a[ma], b[2], b[3]);
        }
      }
    }

    // P = exp2(S * scale_log2 - m), O rescaled when m moves
#pragma unroll
    for (int ma = 0; ma < MR; ++ma) {
      // Row ends only matter on masked tiles; recomputing them there keeps registers free on the others.
      const int row = q0 + warp_row0 + ma * 16 + g;
      softmax[ma].template Step<kMasked>(s[ma], acc_o[ma], p.scale_log2, j * BN, kMasked ? row_end(row) : 0,
                                         kMasked ? row_end(row + 8) : 0);
    }

    // The S accumulators of columns 16kk..16kk+15 are, register for register, the A fragment of P. Packing
    // all of P to 16 bits before waiting for V halves the registers S holds across the wait.
    uint32_t p_frag[MR][BN / 16][4];
#pragma unroll
    for (int ma = 0; ma < MR; ++ma)
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        p_frag[ma][kk][0] = common::ElemTraits<Elem>::Pack(s[ma][2 * kk][0], s[ma][2 * kk][1]);
        p_frag[ma][kk][1] = common::ElemTraits<Elem>::Pack(s[ma][2 * kk][2], s[ma][2 * kk][3]);
        p_frag[ma][kk][2] = common::ElemTraits<Elem>::Pack(s[ma][2 * kk + 1][0], s[ma][2 * kk + 1][1]);
        p_frag[ma][kk][3] = common::ElemTraits<Elem>::Pack(s[ma][2 * kk + 1][2], s[ma][2 * kk + 1][3]);
      }

    // O += P V
    const uint32_t v_base = common::SmemAddr(v_s + st * Tile::kKVTileBytes);
    common::MbarWait(&v_full[st], parity);
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
#pragma unroll
      for (int dd = 0; dd < D / 16; ++dd) {
        const int chunk = dd * 2 + v_chunk;
        uint32_t b[4];
        common::LdMatrixX4Trans(b, v_base + (chunk / 8) * kKVPanelBytes + common::Swizzle128(kk * 16 + v_row, chunk % 8));
#pragma unroll
        for (int ma = 0; ma < MR; ++ma) {  // one V fragment, MR mma
          common::ElemTraits<Elem>::Mma(acc_o[ma][2 * dd], p_frag[ma][kk], b[0], b[1]);
          common::ElemTraits<Elem>::Mma(acc_o[ma][2 * dd + 1], p_frag[ma][kk], b[2], b[3]);
        }
      }
    }
    common::MbarArrive(&kv_empty[st]);  // this thread's reads of the stage are done (arrive has release semantics)
  };

  int j = 0;
  for (; j < n_full; ++j) step(j, std::false_type{});
  for (; j < n_tiles; ++j) step(j, std::true_type{});

#pragma unroll
  for (int ma = 0; ma < MR; ++ma) {
    StoreOutput<Tile, Elem>(p, acc_o[ma], softmax[ma], q_s, warp_row0 + ma * 16, lane, q0, batch, head);
  }
}

}  // namespace attnd::kernels::mma_sync
