// Steps ordered on a caller's stream by the device (StepJob::device_order, docs/sequences.md "Ordered by the
// device"): the driver's 64-bit stream memory operations, looked up through the runtime (libcuda is never linked),
// and the mapping of a shared-memory channel's header page for them.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attnd/server/backend.h"

namespace attnd::server::cuda {

// Whether each of `devices` waits on and writes 64-bit words from a stream and maps registered host memory at its
// host address, and the driver has the calls.
bool StreamWordsAvailable(const std::vector<int>& devices);
// Queues on `stream` a wait until the word at device address `addr` holds at least `value`.
absl::Status WaitWord(cudaStream_t stream, uint64_t addr, uint64_t value);
// Queues on `stream` the write of `value` into the word at device address `addr`.
absl::Status WriteWord(cudaStream_t stream, uint64_t addr, uint64_t value);
// Registers `bytes` of host memory at `page` with CUDA, mapped for every device: its device address, and a hold
// that unregisters it when dropped.
absl::StatusOr<Backend::MappedHostMemory> MapHostPage(void* page, size_t bytes);

}  // namespace attnd::server::cuda
