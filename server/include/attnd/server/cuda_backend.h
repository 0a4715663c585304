// The plug-in point of the CUDA backend (issue 4). MakeBackend calls MakeCudaBackend when the build defines
// ATTND_HAVE_CUDA_BACKEND, which server/CMakeLists.txt does when server/cuda/ exists and nvcc was found.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "attnd/server/backend.h"

namespace attnd::server {

// UNAVAILABLE when no usable GPU is present (MakeBackend("auto") then falls back to the CPU backend);
// any other error is reported as is.
absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(const BackendOptions& options);

}  // namespace attnd::server
