// A move's runs of rows (kv_rows_copy.h). A run is the rows of one page of one layer's K or V (at most a page, 16
// to 256 rows), contiguous on both sides, so a block of 256 threads striding 16 bytes at a time reads and writes it
// coalesced, and the grid is as wide as the sequence has pages times 2 x layers.
#include "kv_rows_copy.h"

namespace attnd::server::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) CopyRuns(const KvRowRun* __restrict__ runs, const uint8_t* __restrict__ src,
                                                     uint8_t* __restrict__ dst) {
  const KvRowRun run = runs[blockIdx.x];
  const auto* from = reinterpret_cast<const uint4*>(src + run.from);
  auto* to = reinterpret_cast<uint4*>(dst + run.to);
  const uint64_t n = run.bytes / sizeof(uint4);
  for (uint64_t i = threadIdx.x; i < n; i += kThreads) to[i] = from[i];
}

}  // namespace

cudaError_t LaunchKvRowRuns(const KvRowRun* runs, int count, const uint8_t* src, uint8_t* dst, cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  CopyRuns<<<count, kThreads, 0, stream>>>(runs, src, dst);
  return cudaGetLastError();
}

}  // namespace attnd::server::cuda
