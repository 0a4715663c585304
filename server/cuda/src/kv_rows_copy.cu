// A move's rows (kv_rows_copy.h). Each block takes 16 consecutive rows of one layer's K or V: it finds their places on
// both sides once (kv_rows.h), then its 256 threads stream the rows' 16-byte chunks, several loads in flight before
// their stores. At hd128 x 8 kv heads in bf16 a row is 2 KB, so a block moves 32 KB, and the grid is the longest
// layer's rows / 16 wide and 2 x layers tall.
#include "kv_rows_copy.h"

namespace attnd::server::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kRowsPerBlock = 16;
// Loads a thread has in flight before its stores: a block's 32 KB is then two rounds of memory latency, not eight.
constexpr int kInFlight = 4;

__global__ void __launch_bounds__(kThreads) CopyRows(KvRowsCopy c, const uint8_t* __restrict__ src,
                                                     uint8_t* __restrict__ dst) {
  __shared__ uint64_t from_at[kRowsPerBlock], to_at[kRowsPerBlock];
  const int layer = static_cast<int>(blockIdx.y) / 2, kv = static_cast<int>(blockIdx.y) % 2;
  const int64_t len = c.lengths[layer];
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock;
  if (first >= len) return;
  const int rows = len - first < kRowsPerBlock ? static_cast<int>(len - first) : kRowsPerBlock;
  if (threadIdx.x < rows) {
    from_at[threadIdx.x] = KvRowAt(c.from, layer, kv, len, first + threadIdx.x, c.row_bytes);
  } else if (threadIdx.x >= 32 && threadIdx.x < 32 + rows) {
    to_at[threadIdx.x - 32] = KvRowAt(c.to, layer, kv, len, first + threadIdx.x - 32, c.row_bytes);
  }
  __syncthreads();
  const uint32_t chunks = static_cast<uint32_t>(c.row_bytes / 16);  // per row
  const uint32_t n = static_cast<uint32_t>(rows) * chunks;
  uint32_t i = threadIdx.x;
  for (; i + (kInFlight - 1) * kThreads < n; i += kInFlight * kThreads) {
    uint4 v[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const uint32_t e = i + u * kThreads, r = e / chunks;
      v[u] = reinterpret_cast<const uint4*>(src + from_at[r])[e - r * chunks];
    }
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const uint32_t e = i + u * kThreads, r = e / chunks;
      reinterpret_cast<uint4*>(dst + to_at[r])[e - r * chunks] = v[u];
    }
  }
  for (; i < n; i += kThreads) {
    const uint32_t r = i / chunks;
    reinterpret_cast<uint4*>(dst + to_at[r])[i - r * chunks] =
        reinterpret_cast<const uint4*>(src + from_at[r])[i - r * chunks];
  }
}

}  // namespace

cudaError_t LaunchKvRowsCopy(const KvRowsCopy& copy, const uint8_t* src, uint8_t* dst, cudaStream_t stream) {
  if (copy.layers <= 0 || copy.longest <= 0) return cudaSuccess;
  const int64_t blocks = (copy.longest + kRowsPerBlock - 1) / kRowsPerBlock;
  if (blocks > 0x7fffffff || 2 * copy.layers > 65535 || copy.row_bytes % 16 != 0) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(2 * copy.layers));
  CopyRows<<<grid, kThreads, 0, stream>>>(copy, src, dst);
  return cudaGetLastError();
}

}  // namespace attnd::server::cuda
