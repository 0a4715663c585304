// Which key blocks a tile of query rows visits under the launch's mask, shared by the prefill families: the causal
// diagonal (with the bottom-right offset) and the kv_len tail decide it; GQA and the scheduler do not.
#pragma once

#include "attnd/kernels/attention.h"

namespace attnd::kernels::common {

// Key blocks [0, n_blocks) are visited, of which [n_full, n_blocks) hold the diagonal and/or the kv_len tail and
// need the element-wise mask; [0, n_full) are visible to every row of the tile.
struct KeyRange {
  int n_blocks, n_full;
  int first = 0;  // the lowest key block visited: > 0 for a part of a split tile (blocks [first, n_blocks))
};

// The key range of the kBlockM query rows from q0 (rows past q_len do not count), in blocks of kBlockN keys.
template <int kBlockM, int kBlockN>
__device__ __forceinline__ KeyRange KeyRangeFor(const LaunchParams& p, int q0) {
  int kv_end = p.kv_len;
  int n_full = p.kv_len / kBlockN;
  if (p.causal) {
    const int last_row = min(q0 + kBlockM, p.q_len) - 1;
    const int64_t end = static_cast<int64_t>(last_row) + p.causal_offset + 1;
    kv_end = static_cast<int>(end < 0 ? 0 : (end > p.kv_len ? p.kv_len : end));
    const int64_t first = static_cast<int64_t>(q0) + p.causal_offset + 1;  // keys < first: every row sees them
    n_full = min(n_full, static_cast<int>(first < 0 ? 0 : (first > p.kv_len ? p.kv_len : first)) / kBlockN);
  }
  const int n_blocks = (kv_end + kBlockN - 1) / kBlockN;
  return KeyRange{n_blocks, min(n_full, n_blocks)};
}

}  // namespace attnd::kernels::common
