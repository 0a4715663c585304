// Decode kernels for head_dim 64 (bf16 and fp16, row blocks 16, 32 and 64).
#include "decode_launch.cuh"

namespace attnd::kernels::decode {

cudaError_t LaunchDecodeD64(const DecodeParams& p, DType dtype, int row_block, dim3 grid, cudaStream_t stream) {
  return LaunchDecodeDim<64>(p, dtype, row_block, grid, stream);
}

}  // namespace attnd::kernels::decode
