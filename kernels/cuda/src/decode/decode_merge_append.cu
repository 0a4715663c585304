// The split merge (per head_dim and element type), the K/V append and the K/V gather kernels.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "copy_kv_decode.cuh"
#include "decode_launch.h"
#include "merge_decode.cuh"

namespace attnd::kernels::decode {
namespace {

template <int D, typename Elem>
cudaError_t LaunchMerge(const DecodeParams& p, cudaStream_t stream) {
  constexpr int kRowsPerBlock = kMergeThreads / (D / 4);
  const int64_t rows = static_cast<int64_t>(p.batch) * p.q_len * p.q_heads;
  const dim3 grid(static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock));
  MergeSplitsKernel<D, Elem><<<grid, kMergeThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

template <typename Elem>
cudaError_t LaunchMergeElem(const DecodeParams& p, int head_dim, cudaStream_t stream) {
  switch (head_dim) {
    case 64:
      return LaunchMerge<64, Elem>(p, stream);
    case 128:
      return LaunchMerge<128, Elem>(p, stream);
    case 256:
      return LaunchMerge<256, Elem>(p, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t LaunchMergeSplits(const DecodeParams& p, DType dtype, int head_dim, cudaStream_t stream) {
  return dtype == DType::kBF16 ? LaunchMergeElem<__nv_bfloat16>(p, head_dim, stream)
                               : LaunchMergeElem<__half>(p, head_dim, stream);
}

// Grids: y is the sequence; x covers the longest sequence's chunks (as planned), at most kMaxBlocksX blocks: past
// that, or for a sequence grown since the plan, threads loop.
constexpr int64_t kMaxBlocksX = 1024;

namespace {

// The grid of a copy kernel over `chunks` 16-byte chunks a sequence.
dim3 CopyGrid(int64_t chunks, int batch) {
  const int64_t blocks = std::min<int64_t>((chunks + kCopyThreads - 1) / kCopyThreads, kMaxBlocksX);
  return dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(batch));
}

}  // namespace

cudaError_t LaunchAppendKv(const AppendParams& p, cudaStream_t stream) {
  const int64_t chunks = static_cast<int64_t>(p.new_len) * p.kv_heads * (p.head_dim / 8);
  if (chunks == 0 || p.batch == 0) return cudaSuccess;
  if (p.k_descale == nullptr) {
    AppendKvKernel<<<CopyGrid(chunks, p.batch), kCopyThreads, 0, stream>>>(p);
  } else if (p.new_bf16) {
    AppendKvFp8Kernel<__nv_bfloat16><<<CopyGrid(chunks / 2, p.batch), kCopyThreads, 0, stream>>>(p);
  } else {
    AppendKvFp8Kernel<__half><<<CopyGrid(chunks / 2, p.batch), kCopyThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

cudaError_t LaunchGatherKv(const GatherParams& p, cudaStream_t stream) {
  const int64_t chunks = static_cast<int64_t>(std::max(p.max_kv_len, 1)) * p.kv_heads * (p.head_dim / 8);
  if (p.batch == 0) return cudaSuccess;
  if (p.k_descale == nullptr) {
    GatherKvKernel<<<CopyGrid(chunks, p.batch), kCopyThreads, 0, stream>>>(p);
  } else if (p.out_bf16) {
    GatherKvFp8Kernel<__nv_bfloat16><<<CopyGrid(chunks / 2, p.batch), kCopyThreads, 0, stream>>>(p);
  } else {
    GatherKvFp8Kernel<__half><<<CopyGrid(chunks / 2, p.batch), kCopyThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace attnd::kernels::decode
