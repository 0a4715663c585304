// TMA tensor-map encoding through the runtime's driver entry point: libcuda is never linked, so binaries
// built here start on machines without a driver and report UNAVAILABLE instead of failing to load.
#include <cudaTypedefs.h>

#include <cstring>
#include <mutex>

#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "attnd/kernels/attention.h"

namespace attnd::kernels {

bool TensorMapKey::operator==(const TensorMapKey& o) const {
  return address == o.address && dtype == o.dtype && std::memcmp(dims, o.dims, sizeof dims) == 0 &&
         std::memcmp(strides_bytes, o.strides_bytes, sizeof strides_bytes) == 0 &&
         std::memcmp(box, o.box, sizeof box) == 0 && swizzle_bytes == o.swizzle_bytes;
}

size_t TensorMapKey::Hash() const {
  return absl::HashOf(address, static_cast<int>(dtype), dims[0], dims[1], dims[2], dims[3], strides_bytes[0],
                      strides_bytes[1], strides_bytes[2], box[0], box[1], box[2], box[3], swizzle_bytes);
}

namespace {

absl::StatusOr<PFN_cuTensorMapEncodeTiled_v12000> Encoder() {
  static std::once_flag once;
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static absl::Status status;
  std::call_once(once, [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult result = cudaDriverEntryPointSymbolNotFound;
    const cudaError_t err =
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &result);
    if (err != cudaSuccess || result != cudaDriverEntryPointSuccess || ptr == nullptr) {
      status = absl::UnavailableError(absl::StrCat("cuTensorMapEncodeTiled is not available from the driver (",
                                                   cudaGetErrorString(err), ", query result ",
                                                   static_cast<int>(result), ")"));
      return;
    }
    fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  });
  if (fn == nullptr) return status;
  return fn;
}

}  // namespace

namespace {

CUtensorMapDataType DataType(DType t) {
  switch (t) {
    case DType::kBF16: return CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    case DType::kFP16: return CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
    case DType::kFP8E4M3: return CU_TENSOR_MAP_DATA_TYPE_UINT8;  // TMA moves bytes; the wgmma reads them as e4m3
  }
  return CU_TENSOR_MAP_DATA_TYPE_UINT8;
}

}  // namespace

absl::StatusOr<CUtensorMap> EncodeTensorMap(const TensorMapKey& key) {
  absl::StatusOr<PFN_cuTensorMapEncodeTiled_v12000> encode = Encoder();
  if (!encode.ok()) return encode.status();
  CUtensorMapSwizzle swizzle;
  switch (key.swizzle_bytes) {
    case 0: swizzle = CU_TENSOR_MAP_SWIZZLE_NONE; break;
    case 32: swizzle = CU_TENSOR_MAP_SWIZZLE_32B; break;
    case 64: swizzle = CU_TENSOR_MAP_SWIZZLE_64B; break;
    case 128: swizzle = CU_TENSOR_MAP_SWIZZLE_128B; break;
    default: return absl::InvalidArgumentError(absl::StrCat("tensor map swizzle ", key.swizzle_bytes, " bytes"));
  }
  CUtensorMap map;
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUresult res = (*encode)(
      &map, DataType(key.dtype), 4,
      reinterpret_cast<void*>(key.address), key.dims, key.strides_bytes, key.box, element_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (res != CUDA_SUCCESS) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuTensorMapEncodeTiled rejected the tensor (CUresult ", static_cast<int>(res), "; address 0x",
        absl::Hex(key.address), ", dims ", key.dims[0], "x", key.dims[1], "x", key.dims[2], "x", key.dims[3],
        ", byte strides ", key.strides_bytes[0], "/", key.strides_bytes[1], "/", key.strides_bytes[2], ")"));
  }
  return map;
}

}  // namespace attnd::kernels
