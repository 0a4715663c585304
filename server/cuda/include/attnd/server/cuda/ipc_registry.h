// The cuda-ipc BufferRegistry (attnd/server/buffer_registry.h), in the manner of Triton's shared-memory
// manager: a non-copyable, mutex-guarded map of shared_ptr regions. A caller's cudaIpcMemHandle is opened once
// per handle (several regions of one allocation share the mapping) and the region is checked against the real
// allocation size. A request holds a Lease on each region it touches, so an Unregister during the request drops
// the name at once but unmaps only after the request has finished.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "attnd/server/buffer_registry.h"

namespace attnd::server::cuda {

// One opened cudaIpcMemHandle; closed when the last region using it is gone.
class IpcMapping {
 public:
  IpcMapping(int device, void* base, uint64_t allocation_bytes) : device_(device), base_(base), bytes_(allocation_bytes) {}
  ~IpcMapping();
  IpcMapping(const IpcMapping&) = delete;
  IpcMapping& operator=(const IpcMapping&) = delete;
  int device() const { return device_; }
  uint8_t* base() const { return static_cast<uint8_t*>(base_); }
  uint64_t allocation_bytes() const { return bytes_; }
  // Closes the handle now (at most once; the destructor closes it otherwise), for a caller that must know it is
  // closed before it answers.
  absl::Status Close();

 private:
  const int device_;
  void* const base_;
  const uint64_t bytes_;
  bool closed_ = false;
};

// Opens `handle_bytes` (a cudaIpcMemHandle_t of another process's allocation) on `device`: INVALID_ARGUMENT naming
// `handle_field` when it is not one or does not open, `device_field` when its allocation is on another device.
absl::StatusOr<std::shared_ptr<IpcMapping>> OpenIpcMemHandle(absl::string_view handle_bytes, int device,
                                                             absl::string_view handle_field,
                                                             absl::string_view device_field);

struct IpcRegion {
  std::string id, name;
  int device = 0;
  uint64_t offset = 0, byte_size = 0;  // within the allocation
  std::shared_ptr<IpcMapping> mapping;
  std::atomic<uint32_t> in_flight{0};
  uint8_t* data() const { return mapping->base() + offset; }
};

// Keeps a region mapped (and counted in requests_in_flight) while a request uses it.
class Lease {
 public:
  Lease() = default;
  explicit Lease(std::shared_ptr<IpcRegion> r) : region_(std::move(r)) { region_->in_flight.fetch_add(1); }
  ~Lease() { Reset(); }
  Lease(Lease&& o) noexcept : region_(std::move(o.region_)) {}
  Lease& operator=(Lease&& o) noexcept {
    if (this != &o) {
      Reset();
      region_ = std::move(o.region_);
    }
    return *this;
  }
  Lease(const Lease&) = delete;
  Lease& operator=(const Lease&) = delete;
  const IpcRegion* operator->() const { return region_.get(); }
  explicit operator bool() const { return region_ != nullptr; }

 private:
  void Reset() {
    if (region_) region_->in_flight.fetch_sub(1);
    region_.reset();
  }
  std::shared_ptr<IpcRegion> region_;
};

class IpcRegistry final : public BufferRegistry {
 public:
  // `devices`: the CUDA devices this server serves (a registration on another one is INVALID_ARGUMENT).
  explicit IpcRegistry(std::vector<int> devices);
  ~IpcRegistry() override;
  IpcRegistry(const IpcRegistry&) = delete;
  IpcRegistry& operator=(const IpcRegistry&) = delete;

  absl::StatusOr<std::string> Register(const CudaBufferRegistration& reg) override;
  absl::Status Unregister(const std::string& id) override;
  std::vector<CudaBufferDescription> List() const override;
  absl::StatusOr<BufferLease> Acquire(const std::string& field, const std::string& id) const override;

 private:
  const std::vector<int> devices_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<IpcRegion>> regions_ ABSL_GUARDED_BY(mu_);
  // The 64 handle bytes -> the open mapping, so one handle is opened once however many regions use it.
  std::map<std::string, std::weak_ptr<IpcMapping>> mappings_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace attnd::server::cuda
