// What the GPU suites share: whether a GPU they can run on is present, a checked CUDA call, and a device buffer
// that frees itself.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <random>
#include <vector>

namespace attnd::testing {

// A GPU of the compiled targets (sm_90a, sm_120a). A failed query's error is cleared, so later calls do not see it.
inline bool HaveSupportedGpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    cudaGetLastError();
    return false;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return false;
  return prop.major == 9 || prop.major == 12;
}

// A test input: magnitude in [0.05, 1] with a random sign, never zero.
inline float RandomValue(std::mt19937& rng) {
  std::uniform_real_distribution<float> mag(0.05f, 1.0f);
  return (rng() & 1) ? mag(rng) : -mag(rng);
}

// The hard case of outlier channels: every 41st head dim from 7 (3 of 128) of Q and K is made 16 times larger.
inline bool OutlierChannel(int dim) { return dim % 41 == 7; }

template <typename T>
struct DeviceBuffer {
  T* ptr = nullptr;
  size_t count = 0;
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr != nullptr) cudaFree(ptr);
  }
  cudaError_t Alloc(size_t n) {
    count = n;
    return cudaMalloc(reinterpret_cast<void**>(&ptr), std::max<size_t>(n, 1) * sizeof(T));
  }
  cudaError_t Upload(const std::vector<T>& host) {
    return cudaMemcpy(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
  cudaError_t Download(std::vector<T>& host) const {
    host.resize(count);
    return cudaMemcpy(host.data(), ptr, count * sizeof(T), cudaMemcpyDeviceToHost);
  }
};

}  // namespace attnd::testing

// A CUDA call that must succeed, as a fatal gtest failure naming the call and the error.
#define CUDA_OK(expr)                                                          \
  do {                                                                         \
    const cudaError_t err_ = (expr);                                           \
    ASSERT_EQ(err_, cudaSuccess) << #expr << ": " << cudaGetErrorString(err_); \
  } while (0)
