// The decode kernel: one block per (sequence, kv head, row block, split). Its rows are the q heads of one GQA
// group times the q_len query positions (row r: position r / group, head r % group), so each K/V tile read
// from memory serves all of them. Composed of the load (load_kv_decode.cuh), compute (mma_decode.cuh) and
// softmax (common/online_softmax.cuh, eager rescale) roles:
//
//   S = Q K^T          Q fragments in registers (shared memory at d=256), K via ldmatrix from a stage
//   P = softmax(S)     online, exp2 domain; masked only on tiles holding the kv_len tail or the causal edge
//   O += P V           P reused in registers as the A operand; V via ldmatrix.trans
//
// Warps: kWarpsM row tiles x kWarpsN key slices; each warp keeps its own softmax state over its slice of every
// stage, and the slices are merged once, in the epilogue, through shared memory.
// Pipeline: kStages cp.async groups; tile j + kStages - 1 is issued into the stage tile j - 1 used, after the
// block barrier that also makes tile j visible. Every iteration commits a group (empty past the last tile),
// so wait_group<kStages - 2> always means "tile j has landed".
// Fused append (a decode step): the sequence's last q_len keys are read from the new rows, which the blocks of
// row block 0 also write into the cache.
// Epilogue: one split writes O (normalised) and LSE; several write O / l and log2(l) + m per split to the
// workspace, and the last of them to finish merges them, or the merge kernel does (merge_decode.cuh).
// Float8 K/V (Tile::kFp8Kv): the mma runs in fp16, Q converted once. Q K^T reads K's codes from the stage, 8 bytes a
// thread and 8-key tile, converted in registers: a thread's 8 consecutive codes serve as its B fragments of two
// k-steps, which places head dims in a permuted order along k (Fp8QWord), and Q's fragments follow the same
// order, so the sum is unchanged. V is converted into one fp16 tile while Q K^T and the softmax run, each key slice's
// rows by the warps that read them (ConvertFp8VSlice), which wait for each other, not for the block, before P V. The K
// descale of the block's kv head folds into the softmax scale and the V descale into O, so neither costs a multiply
// per element.
#pragma once

#include <math_constants.h>

#include <cstdint>
#include <type_traits>

#include "../common/online_softmax.cuh"
#include "decode_params.h"
#include "load_kv_decode.cuh"
#include "merge_decode.cuh"
#include "mma_decode.cuh"
#include "tile_size_decode.h"

namespace attnd::kernels::decode {

using common::QuadSum;

constexpr float kLn2 = 0.6931471805599453f;

// Over float8 K: the 16-bit word (pair of head dims) of Q that thread t's A-fragment register `half` (0: a0 and a1,
// 1: a2 and a3) of k-step ks holds. A thread's two k-steps of a 32-dim block cover its dims 8t .. 8t + 7 there.
__device__ __forceinline__ constexpr int Fp8QWord(int ks, int t, int half) {
  return 16 * (ks / 2) + 4 * t + 2 * (ks % 2) + half;
}

template <typename Tile, typename Elem>
__global__ void __launch_bounds__(Tile::kThreads, Tile::kMinBlocksPerSm) DecodeKernel(const DecodeParams p) {
  constexpr int D = Tile::kHeadDim, BN = Tile::kBlockN, S = Tile::kStages, R = Tile::kRowBlock;
  constexpr int KW = Tile::kKeysPerWarp, WN = Tile::kWarpsN;
  constexpr int kKSteps = D / 16;   // k-steps of QK^T
  constexpr int kNTiles = KW / 8;   // 8-key tiles of a warp's S
  constexpr int kDTiles = D / 8;    // 8-column tiles of O
  constexpr int kRowBytes = Tile::kRowBytes;
  constexpr bool kFp8 = Tile::kFp8Kv;
  // The mma's element type: Elem, or fp16 over float8 K/V (Q converted once when Elem is bf16).
  using MmaElem = std::conditional_t<kFp8, __half, Elem>;
  constexpr bool kConvertQ = !std::is_same_v<MmaElem, Elem>;
  using Ops = ElemOps<MmaElem>;
  using OutOps = ElemOps<Elem>;
  using Loader = KvTileLoader<Tile>;

  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* q_s = smem;                          // Tile::kQBytes (none when Q lives in registers)
  uint8_t* k_s = smem + Tile::kQBytes;          // stage st at k_s + st * kKVTileBytes
  uint8_t* v_s = k_s + S * Tile::kKVTileBytes;
  uint8_t* v_c = v_s + S * Tile::kKVTileBytes;  // float8 K/V: the converted V tile (BN rows of kRowBytes)

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int wm = warp / WN, wn = warp % WN;
  const int g = lane >> 2, t = lane & 3;
  const int split = blockIdx.x;
  const int kvh = blockIdx.y / p.m_blocks, mb = blockIdx.y % p.m_blocks;
  const int b = blockIdx.z;

  const int kv_len = p.kv_lens[b];
  const int n_splits = SplitsFor(kv_len, p.split_keys, p.max_splits);
  if (split >= n_splits) return;  // this sequence is shorter than the longest one planned for
  const int key_begin = split * p.split_keys;
  const int key_end = split == n_splits - 1 ? kv_len : key_begin + p.split_keys;
  const int n_tiles = key_end > key_begin ? (key_end - key_begin + BN - 1) / BN : 0;
  // A tile of more keys than the plan's split unit (DecodeBlockN) may reach past a split's end, where its keys are
  // zero-filled: they are masked like keys past kv_len (a zero score would count in the softmax sum).
  constexpr bool kTilePastSplit = BN != DecodeTileFor<D, 16>::type::kBlockN;  // DecodeBlockN(D), host-only
  // Keys below full_end are visible to every row; tiles reaching past it are masked.
  const int causal_end = p.causal ? kv_len - p.q_len + 1 : kv_len;
  const int full_end = kTilePastSplit ? min(causal_end, key_end) : causal_end;

  // This thread's two rows (g and g + 8 of its warp's m16 tile) and the end of their visible keys.
  const int row0 = mb * R + wm * 16 + g, row1 = row0 + 8;
  const int row_end0 = p.causal ? min(kv_len, kv_len - p.q_len + row0 / p.group + 1) : kv_len;
  const int row_end1 = p.causal ? min(kv_len, kv_len - p.q_len + row1 / p.group + 1) : kv_len;
  const int end0 = kTilePastSplit ? min(row_end0, key_end) : row_end0;
  const int end1 = kTilePastSplit ? min(row_end1, key_end) : row_end1;

  const uint16_t* q = static_cast<const uint16_t*>(p.q);
  auto q_row = [&](int r) {
    return q + b * p.q_sb + static_cast<int64_t>(r / p.group) * p.q_ss +
           static_cast<int64_t>(kvh * p.group + r % p.group) * p.q_sh;
  };

  // Q at d=256: the block's rows into shared memory (padding rows zero), in the first cp.async group; over float8
  // K/V through registers, in K's permuted dim order and fp16 (visible after the main loop's first barrier).
  if constexpr (!Tile::kQInRegs) {
    constexpr int kCpr = D / 8;
    for (int c = tid; c < R * kCpr; c += Tile::kThreads) {
      const int r = c / kCpr, chunk = c % kCpr;
      const int gr = mb * R + r;
      const bool valid = gr < p.rows;
      uint8_t* to = q_s + SwizzledOffset<kRowBytes>(r, chunk);
      if constexpr (kFp8) {
        // Chunk c of a 32-dim block holds the block's words c, c + 4, c + 8, c + 12 (Fp8QWord, read by ldmatrix).
        const uint32_t* w = reinterpret_cast<const uint32_t*>(valid ? q_row(gr) : q) + chunk / 4 * 16 + chunk % 4;
        uint32_t x[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          x[e] = valid ? __ldg(w + 4 * e) : 0u;
          if constexpr (kConvertQ) x[e] = Bf16x2ToHalf2(x[e]);
        }
        *reinterpret_cast<uint4*>(to) = make_uint4(x[0], x[1], x[2], x[3]);
      } else {
        CpAsync16(SmemAddr(to), (valid ? q_row(gr) : q) + chunk * 8, valid);
      }
    }
  }
  Loader loader(p, b, kvh, key_begin, key_end, kv_len);
#pragma unroll
  for (int st = 0; st < S - 1; ++st) {
    if (st < n_tiles) loader.Load(key_begin + st * BN, k_s + st * Tile::kKVTileBytes, v_s + st * Tile::kKVTileBytes);
    CpAsyncCommit();
  }

  // Fused append: this split's share of the new rows into the cache, while the first tiles are in flight. One
  // block per key writes it (row block 0); no block of this launch reads those cache rows (the loader takes
  // them from the new rows), so nothing here waits for the writes.
  if (!kFp8 && p.new_k != nullptr && mb == 0) {
    constexpr int kChunks = D / 8;
    const int new_begin = kv_len - p.q_len;
    const int first = max(key_begin, new_begin);
    for (int item = tid; item < (key_end - first) * kChunks; item += Tile::kThreads) {
      const int key = first + item / kChunks, col = item % kChunks * 8, t = key - new_begin;
      int64_t k_at, v_at;
      if (p.block_table != nullptr) {
        const int64_t slot = p.block_table[static_cast<int64_t>(b) * p.max_pages_per_seq + (key >> p.page_shift)];
        const int64_t row = key & ((1 << p.page_shift) - 1);
        k_at = slot * p.k_sb + row * p.k_ss;
        v_at = slot * p.v_sb + row * p.v_ss;
      } else {
        k_at = b * p.k_sb + key * p.k_ss;
        v_at = b * p.v_sb + key * p.v_ss;
      }
      const uint16_t* nk = static_cast<const uint16_t*>(p.new_k) + b * p.nk_sb + t * p.nk_ss + kvh * p.nk_sh + col;
      const uint16_t* nv = static_cast<const uint16_t*>(p.new_v) + b * p.nv_sb + t * p.nv_ss + kvh * p.nv_sh + col;
      uint16_t* k = static_cast<uint16_t*>(p.k_cache) + k_at + kvh * p.k_sh + col;
      uint16_t* v = static_cast<uint16_t*>(p.v_cache) + v_at + kvh * p.v_sh + col;
      *reinterpret_cast<uint4*>(k) = __ldg(reinterpret_cast<const uint4*>(nk));
      *reinterpret_cast<uint4*>(v) = __ldg(reinterpret_cast<const uint4*>(nv));
    }
  }

  // Q at d <= 128: A fragments straight from global memory, once (rows past p.rows are zero padding).
  uint32_t qf[Tile::kQInRegs ? kKSteps : 1][4];
  if constexpr (Tile::kQInRegs) {
    const uint16_t* r0 = row0 < p.rows ? q_row(row0) : nullptr;
    const uint16_t* r1 = row1 < p.rows ? q_row(row1) : nullptr;
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
      // Over float8 K the dims of a thread's fragment words follow K's permuted order (Fp8QWord).
      const int c = kFp8 ? 2 * Fp8QWord(ks, t, 0) : ks * 16 + 2 * t;
      constexpr int kHi = kFp8 ? 2 : 8;  // dims from the a0 / a1 pair to the a2 / a3 pair
      qf[ks][0] = r0 ? __ldg(reinterpret_cast<const uint32_t*>(r0 + c)) : 0u;
      qf[ks][1] = r1 ? __ldg(reinterpret_cast<const uint32_t*>(r1 + c)) : 0u;
      qf[ks][2] = r0 ? __ldg(reinterpret_cast<const uint32_t*>(r0 + c + kHi)) : 0u;
      qf[ks][3] = r1 ? __ldg(reinterpret_cast<const uint32_t*>(r1 + c + kHi)) : 0u;
      if constexpr (kConvertQ) {
#pragma unroll
        for (int e = 0; e < 4; ++e) qf[ks][e] = Bf16x2ToHalf2(qf[ks][e]);
      }
    }
  }
  // Float8 K: its descale multiplies every score of this kv head, so it scales the softmax instead.
  float k_descale = 1.f;
  if constexpr (kFp8) k_descale = __ldg(p.k_descale + kvh);

  float acc_o[kDTiles][4];
#pragma unroll
  for (int d = 0; d < kDTiles; ++d) acc_o[d][0] = acc_o[d][1] = acc_o[d][2] = acc_o[d][3] = 0.f;
  common::OnlineSoftmax<kNTiles, common::Rescale::kEager> softmax;
  softmax.Init();
  // Float8 V: where this thread's share of its key slice's rows lies in a stage and in the converted tile.
  const std::conditional_t<kFp8, Fp8VSliceMap<Tile>, NoVSliceMap> v_map(wm, wn, lane);

  for (int j = 0; j < n_tiles; ++j) {
    CpAsyncWait<S - 2>();
    __syncthreads();
    const int jn = j + S - 1;
    if (jn < n_tiles) {
      loader.Load(key_begin + jn * BN, k_s + (jn % S) * Tile::kKVTileBytes, v_s + (jn % S) * Tile::kKVTileBytes);
    }
    CpAsyncCommit();

    const uint8_t* k_tile = k_s + (j % S) * Tile::kKVTileBytes;
    const uint8_t* v_tile = v_s + (j % S) * Tile::kKVTileBytes;
    if constexpr (kFp8) {
      // This key slice's V rows of stage j into the fp16 tile, whose previous readers (tile j - 1's P V) are past the
      // barrier above; read after SliceBarrier, before P V. The stage is next written by tile j + S's copies, issued
      // after the next iteration's first barrier.
      ConvertFp8VSlice<Tile>(v_tile, v_c, v_map);
    }
    const int key0 = key_begin + j * BN + wn * KW;  // this warp's first key

    // S = Q K^T over the warp's KW keys; one ldmatrix.x4 of K feeds two k-steps of one 8-key tile.
    float s[kNTiles][4];
#pragma unroll
    for (int i = 0; i < kNTiles; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
    for (int ks2 = 0; ks2 < kKSteps / 2; ++ks2) {
      uint32_t a0[4], a1[4];
      if constexpr (Tile::kQInRegs) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          a0[e] = qf[2 * ks2][e];
          a1[e] = qf[2 * ks2 + 1][e];
        }
      } else {
        const int qr = wm * 16 + (lane & 15);
        LdMatrixX4(a0, SmemAddr(q_s + SwizzledOffset<kRowBytes>(qr, 4 * ks2 + (lane >> 4))));
        LdMatrixX4(a1, SmemAddr(q_s + SwizzledOffset<kRowBytes>(qr, 4 * ks2 + 2 + (lane >> 4))));
      }
#pragma unroll
      for (int i = 0; i < kNTiles; ++i) {
        uint32_t kb[4];
        if constexpr (kFp8) {
          // Key g of the 8-key tile, codes 32 ks2 + 8 t .. + 7: b0, b1 of k-step 2 ks2, then of 2 ks2 + 1.
          const uint2 w = *reinterpret_cast<const uint2*>(
              k_tile + Fp8StageOffset<Tile::kKvRowBytes>(wn * KW + 8 * i + g, 2 * ks2 + (t >> 1)) + (t & 1) * 8);
          kb[0] = Fp8x2ToHalf2(w.x);
          kb[1] = Fp8x2ToHalf2(w.x >> 16);
          kb[2] = Fp8x2ToHalf2(w.y);
          kb[3] = Fp8x2ToHalf2(w.y >> 16);
        } else {
          LdMatrixX4(kb, SmemAddr(k_tile + SwizzledOffset<kRowBytes>(wn * KW + 8 * i + (lane & 7),
                                                                      4 * ks2 + (lane >> 3))));
        }
        Ops::Mma(s[i], a0, kb[0], kb[1]);
        Ops::Mma(s[i], a1, kb[2], kb[3]);
      }
    }

    if (key_begin + (j + 1) * BN > full_end) {
      softmax.template Step<true>(s, acc_o, kFp8 ? p.scale_log2 * k_descale : p.scale_log2, key0, end0, end1);
    } else {
      softmax.template Step<false>(s, acc_o, kFp8 ? p.scale_log2 * k_descale : p.scale_log2, key0, end0, end1);
    }

    if constexpr (kFp8) {
      SliceBarrier<Tile>(wn);  // this slice's converted V rows are complete
      v_tile = v_c;
    }

    // O += P V: the S accumulators of two 8-key tiles are the A fragment of one k16 step.
#pragma unroll
    for (int kk = 0; kk < KW / 16; ++kk) {
      uint32_t pa[4];
      pa[0] = Ops::Pack(s[2 * kk][0], s[2 * kk][1]);
      pa[1] = Ops::Pack(s[2 * kk][2], s[2 * kk][3]);
      pa[2] = Ops::Pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      pa[3] = Ops::Pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
      const int vr = wn * KW + 16 * kk + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
      for (int d2 = 0; d2 < D / 16; ++d2) {
        uint32_t vb[4];
        LdMatrixX4Trans(vb, SmemAddr(v_tile + SwizzledOffset<kRowBytes>(vr, 2 * d2 + (lane >> 4))));
        Ops::Mma(acc_o[2 * d2], pa, vb[0], vb[1]);
        Ops::Mma(acc_o[2 * d2 + 1], pa, vb[2], vb[3]);
      }
    }
  }

  // Epilogue. The stages are free once every thread is past its last tile; they become the scratch of
  // (max, sum) and O of each (warp column, row). O rows are padded by 4 floats so the quads' stores spread
  // over the banks.
  CpAsyncWait<0>();
  __syncthreads();
  if constexpr (kFp8) {
    const float v_descale = __ldg(p.v_descale + kvh);
#pragma unroll
    for (int d = 0; d < kDTiles; ++d) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[d][e] *= v_descale;
    }
  }
  constexpr int kOStride = D + 4;
  float* ml = reinterpret_cast<float*>(smem);  // [WN][R][2]
  float* os = ml + WN * R * 2;                 // [WN][R][kOStride]
  const float l0 = QuadSum(softmax.l[0]), l1 = QuadSum(softmax.l[1]);
  const int lr0 = wm * 16 + g, lr1 = lr0 + 8;
  if (t == 0) {
    ml[(wn * R + lr0) * 2] = softmax.m[0];
    ml[(wn * R + lr0) * 2 + 1] = l0;
    ml[(wn * R + lr1) * 2] = softmax.m[1];
    ml[(wn * R + lr1) * 2 + 1] = l1;
  }
#pragma unroll
  for (int d = 0; d < kDTiles; ++d) {
    *reinterpret_cast<float2*>(os + (wn * R + lr0) * kOStride + 8 * d + 2 * t) = make_float2(acc_o[d][0], acc_o[d][1]);
    *reinterpret_cast<float2*>(os + (wn * R + lr1) * kOStride + 8 * d + 2 * t) = make_float2(acc_o[d][2], acc_o[d][3]);
  }
  __syncthreads();

  // Each thread finishes 4 columns of a row at a time: consecutive threads write consecutive columns.
  constexpr int kQuads = D / 4;
  uint16_t* o = static_cast<uint16_t*>(p.o);
  for (int item = tid; item < R * kQuads; item += Tile::kThreads) {
    const int lr = item / kQuads, c = (item % kQuads) * 4;
    const int r = mb * R + lr;
    if (r >= p.rows) continue;
    float mx = -CUDART_INF_F;
#pragma unroll
    for (int w = 0; w < WN; ++w) mx = fmaxf(mx, ml[(w * R + lr) * 2]);
    float sum = 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    if (mx != -CUDART_INF_F) {
#pragma unroll
      for (int w = 0; w < WN; ++w) {
        const float f = exp2f(ml[(w * R + lr) * 2] - mx);
        sum += f * ml[(w * R + lr) * 2 + 1];
        const float4 x = *reinterpret_cast<const float4*>(os + (w * R + lr) * kOStride + c);
        acc.x += f * x.x;
        acc.y += f * x.y;
        acc.z += f * x.z;
        acc.w += f * x.w;
      }
    }
    // A row with no visible key (bottom-right causal with kv_len < q_len, or kv_len 0) has sum 0: O = 0 and
    // LSE = -inf, as in the reference.
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    const float lse2 = sum > 0.f ? mx + log2f(sum) : -CUDART_INF_F;
    const int pos = r / p.group, qh = kvh * p.group + r % p.group;
    if (n_splits == 1) {
      uint2 packed;
      packed.x = OutOps::Pack(acc.x * inv, acc.y * inv);
      packed.y = OutOps::Pack(acc.z * inv, acc.w * inv);
      *reinterpret_cast<uint2*>(o + b * p.o_sb + pos * p.o_ss + qh * p.o_sh + c) = packed;
      if (p.lse != nullptr && c == 0) {
        p.lse[(static_cast<int64_t>(b) * p.q_heads + qh) * p.q_len + pos] = lse2 * kLn2;
      }
    } else {
      const int64_t part = ((static_cast<int64_t>(b) * p.max_splits + split) * p.q_len + pos) * p.q_heads + qh;
      *reinterpret_cast<float4*>(p.o_part + part * D + c) =
          make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
      if (c == 0) p.lse_part[part] = lse2;
    }
  }
  if (n_splits == 1 || !p.merge_in_kernel) return;

  // The last split of this (sequence, kv head, row block) to finish merges them all, so no second launch waits
  // for the grid: every thread fences its partials before the block counts itself done, and the counter is
  // left at zero for the next launch once all n_splits have counted.
  __shared__ int merges_here;
  __threadfence();
  __syncthreads();
  if (tid == 0) {
    int32_t* counter = p.split_counters + static_cast<int64_t>(b) * gridDim.y + blockIdx.y;
    merges_here = atomicAdd(counter, 1) == n_splits - 1;
    if (merges_here) *counter = 0;
  }
  __syncthreads();
  if (!merges_here) return;
  __threadfence();
  for (int item = tid; item < R * kQuads; item += Tile::kThreads) {
    const int r = mb * R + item / kQuads, c = (item % kQuads) * 4;
    if (r >= p.rows) continue;
    MergeSplitsRow<D, Elem>(p, b, r / p.group, kvh * p.group + r % p.group, c, n_splits);
  }
}

}  // namespace attnd::kernels::decode
