// MakeBackend: the one place that maps --backend to an implementation.
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "attnd/server/backend.h"
#include "attnd/server/cpu_backend.h"
#include "attnd/server/cuda_backend.h"
#include "spdlog/spdlog.h"

namespace attnd::server {

absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(const std::string& kind, const BackendOptions& options) {
  if (options.max_queue == 0) return absl::InvalidArgumentError("max_queue: must be >= 1");
  if (options.threads < 0) return absl::InvalidArgumentError(absl::StrCat("threads: must be >= 0, got ", options.threads));
  if (kind == "cpu") return std::unique_ptr<Backend>(std::make_unique<CpuBackend>(options));
  if (kind == "cuda" || kind == "auto") {
#if defined(ATTND_HAVE_CUDA_BACKEND)
    absl::StatusOr<std::unique_ptr<Backend>> cuda = MakeCudaBackend(options);
    if (cuda.ok() || kind == "cuda") return cuda;
    if (!absl::IsUnavailable(cuda.status())) return cuda.status();
    spdlog::info("backend auto: no usable GPU ({}), using the cpu backend", std::string(cuda.status().message()));
#else
    if (kind == "cuda") {
      return absl::FailedPreconditionError(
          "backend: cuda is not available in this build (compiled without CUDA); use --backend=cpu or auto");
    }
#endif
    return std::unique_ptr<Backend>(std::make_unique<CpuBackend>(options));
  }
  return absl::InvalidArgumentError(absl::StrCat("backend: unknown value \"", kind, "\" (auto, cpu or cuda)"));
}

}  // namespace attnd::server
