// Where a sequence's cached rows lie, as a same-host move's copy kernel finds them (server/cuda/src/kv_rows_copy.cu):
// on each side of the copy either a page pool laid out as KvPool says (step.h) or a buffer of the rows in the byte
// chunks' order (layer 0 K, layer 0 V, layer 1 K, ...). Plain C++ that nvcc also compiles for the device, so the
// kernel and the host's tests share one formula.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define ATTND_KV_ROWS_FN __host__ __device__ inline
#else
#define ATTND_KV_ROWS_FN inline
#endif

namespace attnd::server {

// One side of a move's copy. A pool: token t of a layer's K (kv 0) or V (kv 1) is in page pages[t / page_tokens]
// of that layer's pool, which starts (2 layer + kv) * kv_pool_bytes into the allocation. A buffer (pages null): the
// layer's K rows start at layer_at[layer] and its V rows follow them.
struct KvRowsSide {
  const int32_t* pages = nullptr;
  int32_t page_tokens = 0;
  uint64_t page_bytes = 0;     // one page of one layer's K (or V)
  uint64_t kv_pool_bytes = 0;  // one layer's K (or V) pool: its num_pages pages
  const uint64_t* layer_at = nullptr;
};

// Byte offset of row `t` of layer `layer`'s K or V (`len` rows in that layer) from the side's start.
ATTND_KV_ROWS_FN uint64_t KvRowAt(const KvRowsSide& side, int layer, int kv, int64_t len, int64_t t,
                                  uint64_t row_bytes) {
  if (side.pages == nullptr) {
    return side.layer_at[layer] + static_cast<uint64_t>(kv != 0 ? len + t : t) * row_bytes;
  }
  return static_cast<uint64_t>(2 * layer + kv) * side.kv_pool_bytes +
         static_cast<uint64_t>(side.pages[t / side.page_tokens]) * side.page_bytes +
         static_cast<uint64_t>(t % side.page_tokens) * row_bytes;
}

}  // namespace attnd::server
