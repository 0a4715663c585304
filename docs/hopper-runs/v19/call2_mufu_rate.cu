// Throughput of exp2 forms on one SM: elements per clock per SM, f32 vs packed f16x2 vs packed bf16x2.
#include <cstdio>
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define CK(x) do { cudaError_t ce_ = (x); if (ce_ != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(ce_)); return 1; } } while (0)
constexpr int kIters = 4096, kChains = 8;
template <int Mode>
__global__ void Bench(uint32_t seed, uint32_t* out, long long* cycles) {
  uint32_t r[kChains];
  for (int c = 0; c < kChains; ++c) r[c] = seed + threadIdx.x * 7 + c;
  __syncthreads();
  long long t0 = clock64();
  for (int i = 0; i < kIters; ++i) {
#pragma unroll
    for (int c = 0; c < kChains; ++c) {
      if (Mode == 0) { float f = __uint_as_float((r[c] & 0x007fffffu) | 0xbf800000u); asm volatile("ex2.approx.ftz.f32 %0, %0;" : "+f"(f)); r[c] = __float_as_uint(f) ^ r[c]; }
      if (Mode == 1) { uint32_t v = (r[c] & 0x03ff03ffu) | 0xbc00bc00u; asm volatile("ex2.approx.f16x2 %0, %0;" : "+r"(v)); r[c] = v ^ r[c]; }
      if (Mode == 2) { uint32_t v = (r[c] & 0x007f007fu) | 0xbf80bf80u; asm volatile("ex2.approx.ftz.bf16x2 %0, %0;" : "+r"(v)); r[c] = v ^ r[c]; }
    }
  }
  __syncthreads();
  long long t1 = clock64();
  uint32_t acc = 0;
  for (int c = 0; c < kChains; ++c) acc ^= r[c];
  out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}
// Accuracy of the packed forms against f32 exp2 over x in [-20, 0].
__global__ void Acc(float* err) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  float x = -20.0f * (i + 0.5f) / (gridDim.x * blockDim.x);
  float ref = exp2f(x);
  __half2 h = __floats2half2_rn(x, x); uint32_t hv = *reinterpret_cast<uint32_t*>(&h);
  asm("ex2.approx.f16x2 %0, %0;" : "+r"(hv));
  __nv_bfloat162 b = __floats2bfloat162_rn(x, x); uint32_t bv = *reinterpret_cast<uint32_t*>(&b);
  asm("ex2.approx.ftz.bf16x2 %0, %0;" : "+r"(bv));
  float fh = __half2float(*reinterpret_cast<__half*>(&hv));
  float fb = __bfloat162float(*reinterpret_cast<__nv_bfloat16*>(&bv));
  float fbr = __bfloat162float(__float2bfloat16_rn(ref));
  err[4 * i + 0] = fabsf(fh - ref) / ref; err[4 * i + 1] = fabsf(fb - ref) / ref; err[4 * i + 2] = fabsf(fbr - ref) / ref;
  err[4 * i + 3] = x;
}
template <int Mode> int Run(const char* name, int threads) {
  uint32_t* out; long long* cyc; int blocks = 132;
  CK(cudaMalloc(&out, blocks * threads * 4)); CK(cudaMalloc(&cyc, blocks * 8));
  Bench<Mode><<<blocks, threads>>>(1, out, cyc); CK(cudaGetLastError()); CK(cudaDeviceSynchronize());
  Bench<Mode><<<blocks, threads>>>(2, out, cyc); CK(cudaGetLastError()); CK(cudaDeviceSynchronize());
  long long h[132]; CK(cudaMemcpy(h, cyc, sizeof(h), cudaMemcpyDeviceToHost));
  double mean = 0; for (int i = 0; i < blocks; ++i) mean += h[i]; mean /= blocks;
  double elems = double(threads) * kIters * kChains * (Mode == 0 ? 1 : 2);
  printf("%-8s threads %4d: %.2f elements/clk/SM (%.0f cycles)\n", name, threads, elems / mean, mean);
  CK(cudaFree(out)); CK(cudaFree(cyc));
  return 0;
}
int main() {
  for (int t : {256, 512, 1024}) { Run<0>("f32", t); Run<1>("f16x2", t); Run<2>("bf16x2", t); }
  const int n = 1 << 16; float* e; CK(cudaMalloc(&e, n * 16));
  Acc<<<n / 256, 256>>>(e); CK(cudaGetLastError()); CK(cudaDeviceSynchronize());
  static float h[4 << 16]; CK(cudaMemcpy(h, e, n * 16, cudaMemcpyDeviceToHost));
  for (int band = 0; band < 5; ++band) {
    double mh = 0, mb = 0, mr = 0, sh = 0, sb = 0, sr = 0; int cnt = 0;
    for (int i = 0; i < n; ++i) { float x = h[4 * i + 3]; if (x < -4.0f * (band + 1) || x >= -4.0f * band) continue;
      mh = fmax(mh, h[4*i]); mb = fmax(mb, h[4*i+1]); mr = fmax(mr, h[4*i+2]); sh += h[4*i]; sb += h[4*i+1]; sr += h[4*i+2]; ++cnt; }
    printf("x in [%d,%d): rel err max/mean f16x2 %.2e/%.2e  bf16x2 %.2e/%.2e  bf16(exact exp2) %.2e/%.2e\n", -4 * (band + 1), -4 * band,
           mh, sh / cnt, mb, sb / cnt, mr, sr / cnt);
  }
  return 0;
}
