// Launch role: the runtime -> compile-time switchboard of one head_dim (element type x row block), each
// decode_d*.cu instantiating it once.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "decode_kernel.cuh"
#include "decode_launch.h"
#include "tile_size_decode.h"

namespace attnd::kernels::decode {

template <typename Tile, typename Elem>
cudaError_t LaunchDecodeTile(const DecodeParams& p, dim3 grid, cudaStream_t stream) {
  auto* kernel = &DecodeKernel<Tile, Elem>;
  // Above 48 KB a block's dynamic shared memory must be opted into per kernel; the call is host-only (no
  // device work, no synchronisation) and cheap enough to make at every launch.
  if constexpr (Tile::kSmemBytes > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(Tile::kSmemBytes));
    if (err != cudaSuccess) return err;
  }
  kernel<<<grid, Tile::kThreads, Tile::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

template <int D, typename Elem>
cudaError_t LaunchDecodeElem(const DecodeParams& p, int row_block, dim3 grid, cudaStream_t stream) {
  switch (row_block) {
    case 16:
      return LaunchDecodeTile<typename DecodeTileFor<D, 16>::type, Elem>(p, grid, stream);
    case 32:
      return LaunchDecodeTile<typename DecodeTileFor<D, 32>::type, Elem>(p, grid, stream);
    case 64:
      return LaunchDecodeTile<typename DecodeTileFor<D, 64>::type, Elem>(p, grid, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

template <int D>
cudaError_t LaunchDecodeDim(const DecodeParams& p, DType dtype, int row_block, dim3 grid, cudaStream_t stream) {
  return dtype == DType::kBF16 ? LaunchDecodeElem<D, __nv_bfloat16>(p, row_block, grid, stream)
                               : LaunchDecodeElem<D, __half>(p, row_block, grid, stream);
}

}  // namespace attnd::kernels::decode
