#include "hopper/softmax_sm90.cuh"
using S = attnd::kernels::hopper::SoftmaxSm90<128>;
__global__ void k(const float* in, float* out, float sc) {
  float s[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) s[i] = in[threadIdx.x + i * 128];
  S sm; sm.Init(); float f[2];
  sm.Step<false>(s, sc, 0, 1 << 30, 1 << 30, f);
#pragma unroll
  for (int i = 0; i < 64; ++i) out[threadIdx.x + i * 128] = s[i];
  out[0] += sm.l[0] + sm.m[1];
}
