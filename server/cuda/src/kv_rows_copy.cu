// A move's runs of rows (kv_rows_copy.h). A run is the rows of one page of one layer's K or V (at most a page, 16
// to 256 rows), contiguous on both sides, so a block of 256 threads striding 16 bytes at a time reads and writes it
// coalesced, and the grid is as wide as the sequence has pages times 2 x layers.
#include "kv_rows_copy.h"

namespace attnd::server::cuda {
namespace {

constexpr int kThreads = 256;
// Loads a thread has in flight before its stores: a run of a 16-token page (32 KiB of bf16 rows at hd128 x 8 heads)
// is then two rounds of memory latency rather than eight.
constexpr int kInFlight = 4;

__global__ void __launch_bounds__(kThreads) CopyRuns(const KvRowRun* __restrict__ runs, const uint8_t* __restrict__ src,
                                                     uint8_t* __restrict__ dst) {
  const KvRowRun run = runs[blockIdx.x];
  const auto* from = reinterpret_cast<const uint4*>(src + run.from);
  auto* to = reinterpret_cast<uint4*>(dst + run.to);
  const uint64_t n = run.bytes / sizeof(uint4);
  uint64_t i = threadIdx.x;
  for (; i + (kInFlight - 1) * kThreads < n; i += kInFlight * kThreads) {
    uint4 v[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) v[u] = from[i + u * kThreads];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) to[i + u * kThreads] = v[u];
  }
  for (; i < n; i += kThreads) to[i] = from[i];
}

}  // namespace

cudaError_t LaunchKvRowRuns(const KvRowRun* runs, int count, const uint8_t* src, uint8_t* dst, cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  CopyRuns<<<count, kThreads, 0, stream>>>(runs, src, dst);
  return cudaGetLastError();
}

}  // namespace attnd::server::cuda
