// The copy kernel of same-host sequence moves (docs/sequences.md, "Moving a sequence"): runs of whole rows between
// a KV pool's pages and a move's device buffer, every run of the move in one launch.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace attnd::server::cuda {

// `bytes` from byte `from` of the source to byte `to` of the destination; all three multiples of 16.
struct KvRowRun {
  uint64_t from = 0, to = 0, bytes = 0;
};

// One block per run of `runs` (a device array of `count`), 16-byte loads and stores; queued on `stream`.
cudaError_t LaunchKvRowRuns(const KvRowRun* runs, int count, const uint8_t* src, uint8_t* dst, cudaStream_t stream);

}  // namespace attnd::server::cuda
