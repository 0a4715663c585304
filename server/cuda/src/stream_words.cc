#include "stream_words.h"

#include <cuda.h>
#include <cudaTypedefs.h>

#include <memory>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "attnd/server/status_util.h"
#include "cuda_device.h"

namespace attnd::server::cuda {
namespace {

struct Driver {
  PFN_cuStreamWaitValue64_v11070 wait = nullptr;
  PFN_cuStreamWriteValue64_v11070 write = nullptr;
  PFN_cuDeviceGetAttribute_v2000 attribute = nullptr;
};

const Driver& GetDriver() {
  static std::once_flag once;
  static Driver d;
  std::call_once(once, [] {
    const auto find = [](const char* name, void** fn) {
      cudaDriverEntryPointQueryResult result = cudaDriverEntryPointSymbolNotFound;
      if (cudaGetDriverEntryPointByVersion(name, fn, 12000, cudaEnableDefault, &result) != cudaSuccess ||
          result != cudaDriverEntryPointSuccess) {
        *fn = nullptr;
      }
    };
    void* wait = nullptr;
    void* write = nullptr;
    void* attribute = nullptr;
    find("cuStreamWaitValue64", &wait);
    find("cuStreamWriteValue64", &write);
    find("cuDeviceGetAttribute", &attribute);
    d.wait = reinterpret_cast<PFN_cuStreamWaitValue64_v11070>(wait);
    d.write = reinterpret_cast<PFN_cuStreamWriteValue64_v11070>(write);
    d.attribute = reinterpret_cast<PFN_cuDeviceGetAttribute_v2000>(attribute);
  });
  return d;
}

absl::Status DriverStatus(const char* what, CUresult r) {
  if (r == CUDA_SUCCESS) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": CUDA driver error ", static_cast<int>(r)));
}

}  // namespace

bool StreamWordsAvailable(const std::vector<int>& devices) {
  const Driver& d = GetDriver();
  if (d.wait == nullptr || d.write == nullptr || d.attribute == nullptr) return false;
  for (int i : devices) {
    int memops = 0, host_pointer = 0;
    if (d.attribute(&memops, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, i) != CUDA_SUCCESS ||
        d.attribute(&host_pointer, CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM, i) != CUDA_SUCCESS ||
        memops == 0 || host_pointer == 0) {
      return false;
    }
  }
  return true;
}

absl::Status WaitWord(cudaStream_t stream, uint64_t addr, uint64_t value) {
  return DriverStatus("cuStreamWaitValue64 (the caller's wait word)",
                      GetDriver().wait(stream, addr, value, CU_STREAM_WAIT_VALUE_GEQ));
}

absl::Status WriteWord(cudaStream_t stream, uint64_t addr, uint64_t value) {
  return DriverStatus("cuStreamWriteValue64 (the channel's done word)",
                      GetDriver().write(stream, addr, value, CU_STREAM_WRITE_VALUE_DEFAULT));
}

absl::StatusOr<Backend::MappedHostMemory> MapHostPage(void* page, size_t bytes) {
  ATTND_RETURN_IF_ERROR(CudaStatus("cudaHostRegister (a channel's header page)",
                                   cudaHostRegister(page, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped)));
  void* device = nullptr;
  const cudaError_t err = cudaHostGetDevicePointer(&device, page, 0);
  if (err != cudaSuccess) {
    cudaHostUnregister(page);
    return CudaStatus("cudaHostGetDevicePointer (a channel's header page)", err);
  }
  Backend::MappedHostMemory m;
  m.device_address = reinterpret_cast<uint64_t>(device);
  m.hold = std::shared_ptr<void>(page, [](void* p) { cudaHostUnregister(p); });
  return m;
}

}  // namespace attnd::server::cuda
