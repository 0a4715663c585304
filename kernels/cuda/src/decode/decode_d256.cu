// Decode kernels for head_dim 256 (bf16 and fp16 Q/O over 16-bit or float8 K/V, row blocks 16, 32 and 64).
#include "decode_launch.cuh"

namespace attnd::kernels::decode {

cudaError_t LaunchDecodeD256(const DecodeParams& p, DType dtype, bool fp8_kv, int row_block, dim3 grid,
                             cudaStream_t stream) {
  return LaunchDecodeDim<256>(p, dtype, fp8_kv, row_block, grid, stream);
}

}  // namespace attnd::kernels::decode
