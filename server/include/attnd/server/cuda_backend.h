// The CUDA backend and the cuda-ipc buffer registry, built with CUDA (server/cuda/). MakeBackend("auto" |
// "cuda") calls MakeCudaBackend; the server makes the registry when --enable_cuda_ipc is set on the cuda backend.
//
// Per served device (--devices) the backend keeps a warm primary context, every kernel configuration it can
// choose launched once at start, slots (--streams: one stream, timing events and one worker thread each),
// caching allocators for device memory and pinned staging bounded by --memory_budget_mb, and an upload stream
// that copies a ForwardStream's chunks to the device while the rest arrives. Encoded TMA tensor maps are cached
// across devices (--tensor_map_cache). Routing: a request with references runs on the device of its buffers
// (all on one device); an inline one on the device with the fewest jobs queued, running or uploading.
// cuda-ipc callers register buffers with the device index as the server numbers devices, and must finish
// writing Q/K/V (synchronise the stream that wrote them) before calling Forward: the server's kernel does not
// wait on the caller's streams. The reply comes after the kernel has finished writing O.
// KV sequences (MakeKvPool / SubmitSteps) live on the first served device: their page pools come out of its
// memory budget and their steps run there (docs/sequences.md, "On the CUDA backend").
#pragma once

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "attnd/server/backend.h"
#include "attnd/server/buffer_registry.h"

namespace attnd::server {

// Test seams. Production code leaves them at their defaults.
struct CudaBackendHooks {
  // NaN-fill every output buffer (O and LSE, staged or registered) right before its launch, so that a kernel that
  // leaves an element unwritten fails the test instead of passing on a value from an earlier call.
  bool poison_outputs = false;
};

// UNAVAILABLE when no usable GPU is present (MakeBackend("auto") then falls back to the CPU backend);
// any other error is reported as is.
absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(const BackendOptions& options, CudaBackendHooks hooks = {});

// Registered CUDA IPC buffers on `devices` (the ones the cuda backend serves).
std::unique_ptr<BufferRegistry> MakeCudaIpcRegistry(std::vector<int> devices);

}  // namespace attnd::server
