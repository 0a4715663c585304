// Pipe throughput probe: EX2, F2FP (cvt.rn.bf16x2.f32), PRMT, alone and mixed. Cycles per iteration, per SM.
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)

__device__ __forceinline__ float ex2(float x) { float y; asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
__device__ __forceinline__ uint32_t f2fp(float a, float b) { uint32_t y; asm volatile("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(y) : "f"(a), "f"(b)); return y; }
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b) { uint32_t y; asm volatile("prmt.b32 %0, %1, %2, 0x7632;" : "=r"(y) : "r"(a), "r"(b)); return y; }
__device__ __forceinline__ float fadd(float a, float b) { float y; asm volatile("add.f32 %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b)); return y; }
__device__ __forceinline__ float ffma(float a, float b, float c) { float y; asm volatile("fma.rn.f32 %0, %1, %2, %3;" : "=f"(y) : "f"(a), "f"(b), "f"(c)); return y; }

template <int kEx2, int kF2fp, int kPrmt, int kFadd, int kFfma>
__global__ void probe(float* out, long long* cycles, int iters, float seed) {
  float a[8], b[8], c[8], d[8];
  uint32_t u[8], v[8];
  for (int i = 0; i < 8; ++i) { a[i] = seed * (i + 1); b[i] = seed + i; c[i] = seed - i; d[i] = seed * i; u[i] = threadIdx.x + i; v[i] = i * 77u; }
  __syncthreads();
  long long t0 = clock64();
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (kEx2) a[i] = ex2(a[i]);
      if (kF2fp) u[i] = f2fp(__uint_as_float(u[i]), b[i]);
      if (kPrmt) v[i] = prmt(v[i], u[i] + i);
      if (kFadd) c[i] = fadd(c[i], b[i]);
      if (kFfma) d[i] = ffma(d[i], b[i], c[i]);
    }
  }
  long long t1 = clock64();
  __syncthreads();
  float acc = 0.f;
  for (int i = 0; i < 8; ++i) acc += a[i] + __uint_as_float(u[i]) + __uint_as_float(v[i]) + c[i] + d[i];
  out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}

template <int E, int F, int P, int A, int M>
int run(const char* name, int sms, int threads) {
  const int iters = 2048;
  float* out; long long* cyc;
  CK(cudaMalloc(&out, sizeof(float) * sms * threads));
  CK(cudaMalloc(&cyc, sizeof(long long) * sms));
  probe<E, F, P, A, M><<<sms, threads>>>(out, cyc, iters, 0.5f);
  CK(cudaGetLastError());
  probe<E, F, P, A, M><<<sms, threads>>>(out, cyc, iters, 0.5f);
  CK(cudaDeviceSynchronize());
  long long h[1024];
  CK(cudaMemcpy(h, cyc, sizeof(long long) * sms, cudaMemcpyDeviceToHost));
  double mean = 0; for (int i = 0; i < sms; ++i) mean += h[i]; mean /= sms;
  const double warps = threads / 32.0;
  const double per_iter = mean / iters;  // cycles per loop iteration (8 of each op per warp)
  printf("%-22s threads %4d: %8.1f cycles/iter; per SMSP: %.2f cycles per warp-instr group (ex2 %d f2fp %d prmt %d fadd %d ffma %d)\n",
         name, threads, per_iter, per_iter / (8.0 * warps / 4.0), E, F, P, A, M);
  CK(cudaFree(out)); CK(cudaFree(cyc));
  return 0;
}

int main() {
  int sms = 0; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  for (int threads : {256, 512}) {
    run<1, 0, 0, 0, 0>("ex2", sms, threads);
    run<0, 1, 0, 0, 0>("f2fp", sms, threads);
    run<0, 0, 1, 0, 0>("prmt", sms, threads);
    run<0, 0, 0, 1, 0>("fadd", sms, threads);
    run<0, 0, 0, 0, 1>("ffma", sms, threads);
    run<1, 1, 0, 0, 0>("ex2+f2fp", sms, threads);
    run<1, 0, 1, 0, 0>("ex2+prmt", sms, threads);
    run<1, 0, 0, 1, 0>("ex2+fadd", sms, threads);
    run<1, 1, 0, 1, 1>("ex2+f2fp+fadd+ffma", sms, threads);
    run<1, 0, 1, 1, 1>("ex2+prmt+fadd+ffma", sms, threads);
    run<0, 1, 1, 0, 0>("f2fp+prmt", sms, threads);
  }
  return 0;
}
