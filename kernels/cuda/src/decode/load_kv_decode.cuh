// Load role: K/V tiles of kBlockN keys gathered into shared memory with 16-byte cp.async, for contiguous and
// paged KV alike. A thread copies one 16-byte chunk column of kRowsPerThread consecutive keys; the 16 (d128)
// threads of a row cover it whole, so each warp reads whole head rows (coalesced).
// Paged KV: kRowsPerThread (at most 8) divides the smallest page (16 keys), so a thread's keys of a tile lie
// in one page and it reads one block-table slot per tile. That slot is read one tile ahead, so the table's
// latency passes under a tile of compute instead of stalling the copies it addresses.
// Fused append: a sequence's last q_len keys come from the new rows instead of the cache (which this launch is
// writing), on the few tiles that reach them (16-bit K/V only).
// Float8 K/V: a row is half the bytes, so a 16-byte chunk holds 16 elements; it lands at Fp8StageOffset.
#pragma once

#include <cstdint>
#include <type_traits>

#include "decode_params.h"
#include "mma_decode.cuh"

namespace attnd::kernels::decode {

template <typename Tile>
class KvTileLoader {
 public:
  using KvT = std::conditional_t<Tile::kFp8Kv, uint8_t, uint16_t>;  // a stored element's bits
  static constexpr int kChunkElems = 16 / sizeof(KvT);
  static constexpr int kChunksPerRow = Tile::kKvRowBytes / 16;
  static constexpr int kRowGroups = Tile::kThreads / kChunksPerRow;  // threads along the keys
  static constexpr int kRowsPerThread = Tile::kBlockN / kRowGroups;
  static_assert(Tile::kThreads % kChunksPerRow == 0, "a thread keeps its chunk column across a tile");
  static_assert(Tile::kBlockN % kRowGroups == 0, "every thread copies the same number of rows");
  static_assert(16 % kRowsPerThread == 0, "a thread's rows of a tile lie in one page of the smallest size");

  // Tiles are then loaded in order from key_begin, one Load per tile.
  __device__ __forceinline__ KvTileLoader(const DecodeParams& p, int b, int kvh, int key_begin, int key_end,
                                          int kv_len)
      : chunk_(threadIdx.x % kChunksPerRow),
        row0_(threadIdx.x / kChunksPerRow * kRowsPerThread),
        key_end_(key_end),
        k_ss_(p.k_ss),
        v_ss_(p.v_ss),
        k_(static_cast<const KvT*>(p.k) + kvh * p.k_sh + chunk_ * kChunkElems),
        v_(static_cast<const KvT*>(p.v) + kvh * p.v_sh + chunk_ * kChunkElems) {
    if (p.block_table != nullptr) {
      table_ = p.block_table + static_cast<int64_t>(b) * p.max_pages_per_seq;
      page_shift_ = p.page_shift;
      k_sb_ = p.k_sb;
      v_sb_ = p.v_sb;
      next_slot_ = SlotOf(key_begin + row0_);
    } else {
      k_ += b * p.k_sb;
      v_ += b * p.v_sb;
    }
    if (!Tile::kFp8Kv && p.new_k != nullptr) {
      new_begin_ = kv_len - p.q_len;
      nk_ss_ = p.nk_ss;
      nv_ss_ = p.nv_ss;
      nk_ = static_cast<const uint16_t*>(p.new_k) + b * p.nk_sb + kvh * p.nk_sh + chunk_ * 8;
      nv_ = static_cast<const uint16_t*>(p.new_v) + b * p.nv_sb + kvh * p.nv_sh + chunk_ * 8;
    }
  }

  // Issues the copies of keys [key0, key0 + kBlockN) into one K and one V stage; keys at or past key_end are
  // zero-filled without touching global memory.
  __device__ __forceinline__ void Load(int key0, uint8_t* k_stage, uint8_t* v_stage) {
    const int key = key0 + row0_;
    int64_t k_off, v_off;
    if (table_ != nullptr) {
      const int64_t slot = next_slot_;
      next_slot_ = SlotOf(key + Tile::kBlockN);
      const int64_t row = key & ((1 << page_shift_) - 1);
      k_off = slot * k_sb_ + row * k_ss_;
      v_off = slot * v_sb_ + row * v_ss_;
    } else {
      k_off = key * k_ss_;
      v_off = key * v_ss_;
    }
    if (Tile::kFp8Kv || key + kRowsPerThread <= new_begin_) {  // rows before the new ones: no per-row select
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) {
        const bool valid = key + i < key_end_;
        const uint32_t s = StageOffset(row0_ + i, chunk_);
        CpAsync16(SmemAddr(k_stage + s), k_ + k_off + i * k_ss_, valid);
        CpAsync16(SmemAddr(v_stage + s), v_ + v_off + i * v_ss_, valid);
      }
    } else if constexpr (!Tile::kFp8Kv) {
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) {
        const bool valid = key + i < key_end_;
        const bool fresh = key + i >= new_begin_;
        const int64_t t = key + i - new_begin_;
        const uint32_t s = SwizzledOffset<Tile::kRowBytes>(row0_ + i, chunk_);
        CpAsync16(SmemAddr(k_stage + s), fresh ? nk_ + t * nk_ss_ : k_ + k_off + i * k_ss_, valid);
        CpAsync16(SmemAddr(v_stage + s), fresh ? nv_ + t * nv_ss_ : v_ + v_off + i * v_ss_, valid);
      }
    }
  }

  // Byte offset of chunk `chunk` of row `row` in a stage: swizzled for the mma's ldmatrix (16-bit K/V), or for the
  // K fragments' 8-byte reads and the V conversion (float8 K/V).
  __device__ __forceinline__ static uint32_t StageOffset(int row, int chunk) {
    if constexpr (Tile::kFp8Kv) {
      return Fp8StageOffset<Tile::kKvRowBytes>(row, chunk);
    } else {
      return SwizzledOffset<Tile::kRowBytes>(row, chunk);
    }
  }

 private:
  // The page slot of `key`; 0 (never dereferenced: its rows are zero-filled) past the split's keys.
  __device__ __forceinline__ int64_t SlotOf(int key) const {
    return key < key_end_ ? __ldg(table_ + (key >> page_shift_)) : 0;
  }

  int chunk_, row0_, key_end_;
  int64_t k_ss_, v_ss_;
  const KvT* k_;
  const KvT* v_;
  const int32_t* table_ = nullptr;
  int page_shift_ = 0;
  int64_t k_sb_ = 0, v_sb_ = 0;
  int64_t next_slot_ = 0;
  int new_begin_ = 0x7fffffff;  // the first key read from the new rows; none without a fused append
  int64_t nk_ss_ = 0, nv_ss_ = 0;
  const uint16_t* nk_ = nullptr;
  const uint16_t* nv_ = nullptr;
};

}  // namespace attnd::kernels::decode
