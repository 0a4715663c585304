// Host entry points of the compiled decode kernels (one translation unit per head_dim, decode_d*.cu, plus
// decode_merge_append.cu), called by decode_plan.cc's LaunchDecode / LaunchAppend /
// LaunchGather. Plain C++: no CUDA
// device code or absl in the interface, so the .cu files stay independent of the host library.
#pragma once

#include <cuda_runtime_api.h>

#include "attnd/problem.h"
#include "decode_params.h"

namespace attnd::kernels::decode {

// The decode kernel for a head_dim, element type, K/V format (fp8_kv: float8 e4m3 K/V with p's descales) and row
// block (16, 32 or 64), on grid (splits, kv_heads * m_blocks, batch).
cudaError_t LaunchDecodeD64(const DecodeParams& p, DType dtype, bool fp8_kv, int row_block, dim3 grid,
                            cudaStream_t stream);
cudaError_t LaunchDecodeD128(const DecodeParams& p, DType dtype, bool fp8_kv, int row_block, dim3 grid,
                             cudaStream_t stream);
cudaError_t LaunchDecodeD256(const DecodeParams& p, DType dtype, bool fp8_kv, int row_block, dim3 grid,
                             cudaStream_t stream);

cudaError_t LaunchMergeSplits(const DecodeParams& p, DType dtype, int head_dim, cudaStream_t stream);
cudaError_t LaunchAppendKv(const AppendParams& p, cudaStream_t stream);
cudaError_t LaunchGatherKv(const GatherParams& p, cudaStream_t stream);

}  // namespace attnd::kernels::decode
