// The copy kernel of same-host sequence moves (docs/sequences.md, "Moving a sequence"): every cached row of a
// sequence from one side (a page pool or a move's buffer, attnd/server/kv_rows.h) to the other, in one launch that
// finds each row's place itself, so that the host sends the page tables and lengths (a few KB) rather than a list of
// runs of rows.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "attnd/server/kv_rows.h"

namespace attnd::server::cuda {

// The rows of `layers` layers, `lengths` (a device array) rows each, `row_bytes` a multiple of 16, from `src` to
// `dst`; the sides' tables are device arrays. `longest`: the largest of the lengths.
struct KvRowsCopy {
  KvRowsSide from, to;
  const int64_t* lengths = nullptr;
  int layers = 0;
  int64_t longest = 0;
  uint64_t row_bytes = 0;
};

// Queued on `stream`: a block per 16 rows of one layer's K or V, 16-byte loads and stores.
cudaError_t LaunchKvRowsCopy(const KvRowsCopy& copy, const uint8_t* src, uint8_t* dst, cudaStream_t stream);

}  // namespace attnd::server::cuda
