// Tensors by reference: buffers a same-host caller registered (CUDA IPC) and requests name by buffer_id. A
// transport concern, not a backend one: the gRPC service registers and lists them, and the Dispatcher resolves
// a request's references to device memory before it reaches the backend, holding a lease on each buffer until
// the reply, so an Unregister during the request drops the name at once but unmaps only after it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attnd/problem.h"

namespace attnd::server {

// A RegisterCudaBuffer request.
struct CudaBufferRegistration {
  std::string ipc_handle;  // 64 bytes
  int device = 0;
  uint64_t offset = 0;
  uint64_t byte_size = 0;
  std::string name;
};

struct CudaBufferDescription {
  std::string buffer_id, name;
  int device = 0;
  uint64_t offset = 0, byte_size = 0;
  uint32_t requests_in_flight = 0;
};

// One registered buffer, held for a request: mapped and counted in requests_in_flight until `hold` is dropped.
struct BufferLease {
  uint8_t* data = nullptr;  // device address of the buffer's first byte
  int device = 0;
  uint64_t byte_size = 0;
  std::shared_ptr<const void> hold;
};

class BufferRegistry {
 public:
  virtual ~BufferRegistry() = default;
  // The new buffer's id; INVALID_ARGUMENT naming the field for a handle, device or size that cannot be used.
  virtual absl::StatusOr<std::string> Register(const CudaBufferRegistration& reg) = 0;
  // NOT_FOUND for an unknown id.
  virtual absl::Status Unregister(const std::string& buffer_id) = 0;
  virtual std::vector<CudaBufferDescription> List() const = 0;
  // INVALID_ARGUMENT naming `field` ("q.ref", ...) for an unknown id.
  virtual absl::StatusOr<BufferLease> Acquire(const std::string& field, const std::string& buffer_id) const = 0;
};

// Bytes spanned by a [batch, seq, heads, head_dim] tensor with element strides `st` (head_dim contiguous):
// from its first element to one past its last. INVALID_ARGUMENT naming `field` when it overflows.
absl::StatusOr<uint64_t> TensorSpanBytes(const std::string& field, int64_t batch, int64_t seq, int64_t heads,
                                         int64_t head_dim, const Strides& st, uint64_t elem_bytes);

// OK when [offset, offset + bytes) lies inside a region of `region_bytes`; INVALID_ARGUMENT naming `field`
// otherwise (overflow included).
absl::Status CheckInRegion(const std::string& field, uint64_t offset, uint64_t bytes, uint64_t region_bytes);

}  // namespace attnd::server
