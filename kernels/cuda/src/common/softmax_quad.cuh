// Primitives of the online softmax shared by the kernel families, over the m16n8k16 accumulator layout (a thread
// holds rows g and g + 8; a row's four threads form a quad, lanes 4g..4g+3): the quad's row reductions as two
// xor-shuffles, the lazy rescale's threshold, and the rescale of a thread's O accumulator rows.
#pragma once

namespace attnd::kernels::common {

__device__ __forceinline__ float QuadMax(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float QuadSum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Lazy rescale: the reference max m only moves when a tile's max exceeds it by more than 2^8, so P is at
// most 256 (exact enough in bf16, far from fp32 overflow) and the O accumulator is rescaled only on the rare
// tiles that move m, not on every tile.
constexpr float kRescaleThresholdLog2 = 8.0f;

// Scales the O accumulator rows a thread holds: row g by f0, row g + 8 by f1 (kDTiles 8-column tiles of O).
template <int kDTiles>
__device__ __forceinline__ void RescaleRows(float (&acc_o)[kDTiles][4], float f0, float f1) {
#pragma unroll
  for (int d = 0; d < kDTiles; ++d) {
    acc_o[d][0] *= f0;
    acc_o[d][1] *= f0;
    acc_o[d][2] *= f1;
    acc_o[d][3] *= f1;
  }
}

}  // namespace attnd::kernels::common
