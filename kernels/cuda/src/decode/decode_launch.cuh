// Launch role: the runtime -> compile-time switchboard of one head_dim (K/V format x element type x row block), each
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
  // Above 48 KB a block's shared memory must be opted into per kernel, the kernel's few static bytes counted (a 48 KB
  // dynamic buffer is over); the call is host-only (no device work, no synchronisation) and cheap enough to make at
  // every launch.
  if constexpr (Tile::kSmemBytes >= 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(Tile::kSmemBytes));
    if (err != cudaSuccess) return err;
  }
  kernel<<<grid, Tile::kThreads, Tile::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

// TileFor: DecodeTileFor (16-bit K/V) or DecodeFp8TileFor (float8 K/V).
template <int D, typename Elem, template <int, int> class TileFor>
cudaError_t LaunchDecodeElem(const DecodeParams& p, int row_block, dim3 grid, cudaStream_t stream) {
  switch (row_block) {
    case 16:
      return LaunchDecodeTile<typename TileFor<D, 16>::type, Elem>(p, grid, stream);
    case 32:
      return LaunchDecodeTile<typename TileFor<D, 32>::type, Elem>(p, grid, stream);
    case 64:
      return LaunchDecodeTile<typename TileFor<D, 64>::type, Elem>(p, grid, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

template <int D>
cudaError_t LaunchDecodeDim(const DecodeParams& p, DType dtype, bool fp8_kv, int row_block, dim3 grid,
                            cudaStream_t stream) {
  if (fp8_kv) {
    return dtype == DType::kBF16 ? LaunchDecodeElem<D, __nv_bfloat16, DecodeFp8TileFor>(p, row_block, grid, stream)
                                 : LaunchDecodeElem<D, __half, DecodeFp8TileFor>(p, row_block, grid, stream);
  }
  return dtype == DType::kBF16 ? LaunchDecodeElem<D, __nv_bfloat16, DecodeTileFor>(p, row_block, grid, stream)
                               : LaunchDecodeElem<D, __half, DecodeTileFor>(p, row_block, grid, stream);
}

}  // namespace attnd::kernels::decode
