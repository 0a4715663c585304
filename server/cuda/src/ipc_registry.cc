#include "attnd/server/cuda/ipc_registry.h"

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstring>
#include <iterator>
#include <mutex>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "attnd/server/cuda_backend.h"
#include "spdlog/spdlog.h"

namespace attnd::server::cuda {
namespace {

bool AddU64(uint64_t a, uint64_t b, uint64_t* out) { return !__builtin_add_overflow(a, b, out); }

// cuMemGetAddressRange through the runtime's driver entry point: libcuda is never linked, so the binaries
// still start (and report no GPU) on a machine without a driver.
absl::StatusOr<PFN_cuMemGetAddressRange_v3020> AddressRangeFn() {
  static std::once_flag once;
  static PFN_cuMemGetAddressRange_v3020 fn = nullptr;
  std::call_once(once, [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult result = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &ptr, 12000, cudaEnableDefault, &result) ==
            cudaSuccess &&
        result == cudaDriverEntryPointSuccess) {
      fn = reinterpret_cast<PFN_cuMemGetAddressRange_v3020>(ptr);
    }
  });
  if (fn == nullptr) return absl::UnavailableError("cuMemGetAddressRange is not available from the driver");
  return fn;
}

}  // namespace

IpcMapping::~IpcMapping() {
  const absl::Status closed = Close();
  if (!closed.ok()) spdlog::warn("{}", std::string(closed.message()));
}

absl::Status IpcMapping::Close() {
  if (closed_) return absl::OkStatus();
  closed_ = true;
  int prev = 0;
  cudaGetDevice(&prev);
  cudaError_t err = cudaSetDevice(device_);
  if (err == cudaSuccess) err = cudaIpcCloseMemHandle(base_);
  cudaSetDevice(prev);
  if (err == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();
  return absl::InternalError(absl::StrCat("cudaIpcCloseMemHandle: ", cudaGetErrorString(err)));
}

absl::StatusOr<std::shared_ptr<IpcMapping>> OpenIpcMemHandle(absl::string_view handle_bytes, int device,
                                                             absl::string_view handle_field,
                                                             absl::string_view device_field) {
  if (handle_bytes.size() != sizeof(cudaIpcMemHandle_t)) {
    return absl::InvalidArgumentError(
        absl::StrCat(handle_field, ": ", handle_bytes.size(), " bytes, expected ", sizeof(cudaIpcMemHandle_t)));
  }
  cudaIpcMemHandle_t handle;
  std::memcpy(&handle, handle_bytes.data(), sizeof handle);
  cudaError_t err = cudaSetDevice(device);
  void* base = nullptr;
  if (err == cudaSuccess) err = cudaIpcOpenMemHandle(&base, handle, cudaIpcMemLazyEnablePeerAccess);
  if (err != cudaSuccess) {
    cudaGetLastError();  // IPC open errors are not sticky; clear the per-thread error
    return absl::InvalidArgumentError(absl::StrCat(
        handle_field, ": cannot be opened on device ", device, " (", cudaGetErrorString(err),
        "); it must come from cudaIpcGetMemHandle in another live process on this host"));
  }
  // The handle may name an allocation on a device other than the one claimed; refuse it rather than run
  // the kernel on memory of another GPU.
  cudaPointerAttributes attrs{};
  err = cudaPointerGetAttributes(&attrs, base);
  uint64_t alloc_bytes = 0;
  absl::Status size_status;
  if (err != cudaSuccess || attrs.device != device) {
    size_status = absl::InvalidArgumentError(absl::StrCat(device_field, ": the handle's allocation is on device ",
                                                          err == cudaSuccess ? attrs.device : -1, ", not ",
                                                          device));
  } else {
    absl::StatusOr<PFN_cuMemGetAddressRange_v3020> range = AddressRangeFn();
    CUdeviceptr alloc_base = 0;
    size_t size = 0;
    if (!range.ok()) {
      size_status = range.status();
    } else if ((*range)(&alloc_base, &size, reinterpret_cast<CUdeviceptr>(base)) != CUDA_SUCCESS) {
      size_status = absl::InvalidArgumentError(
          absl::StrCat(handle_field, ": the driver cannot size the opened allocation"));
    } else {
      alloc_bytes = size - (reinterpret_cast<CUdeviceptr>(base) - alloc_base);
    }
  }
  if (!size_status.ok()) {
    cudaIpcCloseMemHandle(base);
    cudaGetLastError();
    return size_status;
  }
  return std::make_shared<IpcMapping>(device, base, alloc_bytes);
}

IpcRegistry::IpcRegistry(std::vector<int> devices) : devices_(std::move(devices)) {}

IpcRegistry::~IpcRegistry() = default;

absl::StatusOr<std::string> IpcRegistry::Register(const CudaBufferRegistration& reg) {
  if (reg.ipc_handle.size() != sizeof(cudaIpcMemHandle_t)) {
    return absl::InvalidArgumentError(
        absl::StrCat("ipc_handle: ", reg.ipc_handle.size(), " bytes, expected ", sizeof(cudaIpcMemHandle_t)));
  }
  if (std::find(devices_.begin(), devices_.end(), reg.device) == devices_.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("device: ", reg.device, " is not a device this server serves (--devices)"));
  }
  uint64_t end;
  if (reg.byte_size == 0 || !AddU64(reg.offset, reg.byte_size, &end)) {
    return absl::InvalidArgumentError("byte_size: must be > 0 and offset + byte_size must not overflow");
  }

  absl::MutexLock lock(&mu_);
  for (auto it = mappings_.begin(); it != mappings_.end();) {  // forget handles whose regions are all gone
    it = it->second.expired() ? mappings_.erase(it) : std::next(it);
  }
  std::shared_ptr<IpcMapping> mapping;
  if (auto it = mappings_.find(reg.ipc_handle); it != mappings_.end()) mapping = it->second.lock();
  if (mapping == nullptr) {
    absl::StatusOr<std::shared_ptr<IpcMapping>> opened = OpenIpcMemHandle(reg.ipc_handle, reg.device, "ipc_handle",
                                                                           "device");
    if (!opened.ok()) return opened.status();
    mapping = *std::move(opened);
    mappings_[reg.ipc_handle] = mapping;
  } else if (mapping->device() != reg.device) {
    return absl::InvalidArgumentError(absl::StrCat("device: this handle is already registered on device ",
                                                   mapping->device(), ", not ", reg.device));
  }
  if (end > mapping->allocation_bytes()) {
    return absl::InvalidArgumentError(absl::StrCat("byte_size: offset ", reg.offset, " + byte_size ", reg.byte_size,
                                                   " runs past the allocation's ", mapping->allocation_bytes(),
                                                   " bytes"));
  }
  // Ids are not guessable, so one same-host client cannot name another's buffer by counting.
  static absl::BitGen* gen = new absl::BitGen();
  auto region = std::make_shared<IpcRegion>();
  region->id = absl::StrFormat("cuda-%d-%016x", next_id_++, absl::Uniform<uint64_t>(*gen));
  region->name = reg.name;
  region->device = reg.device;
  region->offset = reg.offset;
  region->byte_size = reg.byte_size;
  region->mapping = std::move(mapping);
  regions_[region->id] = region;
  spdlog::info("registered CUDA buffer {} '{}' on device {}: {} bytes at offset {}", region->id, region->name,
               region->device, region->byte_size, region->offset);
  return region->id;
}

absl::Status IpcRegistry::Unregister(const std::string& id) {
  std::shared_ptr<IpcRegion> region;
  {
    absl::MutexLock lock(&mu_);
    auto it = regions_.find(id);
    if (it == regions_.end()) return absl::NotFoundError(absl::StrCat("buffer_id: '", id, "' is not registered"));
    region = std::move(it->second);
    regions_.erase(it);
  }
  // `region` may be the last owner of the mapping: it closes the handle here, outside the lock. Requests
  // holding a Lease keep it open until they finish.
  return absl::OkStatus();
}

std::vector<CudaBufferDescription> IpcRegistry::List() const {
  absl::MutexLock lock(&mu_);
  std::vector<CudaBufferDescription> out;
  for (const auto& [id, r] : regions_) {
    out.push_back(CudaBufferDescription{r->id, r->name, r->device, r->offset, r->byte_size, r->in_flight.load()});
  }
  return out;
}

absl::StatusOr<BufferLease> IpcRegistry::Acquire(const std::string& field, const std::string& id) const {
  std::shared_ptr<IpcRegion> region;
  {
    absl::MutexLock lock(&mu_);
    auto it = regions_.find(id);
    if (it == regions_.end()) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".buffer_id: '", id, "' is not registered"));
    }
    region = it->second;
  }
  BufferLease lease;
  lease.data = region->data();
  lease.device = region->device;
  lease.byte_size = region->byte_size;
  lease.hold = std::make_shared<const Lease>(std::move(region));
  return lease;
}

}  // namespace attnd::server::cuda

namespace attnd::server {

std::unique_ptr<BufferRegistry> MakeCudaIpcRegistry(std::vector<int> devices) {
  return std::make_unique<cuda::IpcRegistry>(std::move(devices));
}

}  // namespace attnd::server
