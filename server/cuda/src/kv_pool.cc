// The KV sequences' page pools on the CUDA backend: one block of the serving device's memory budget per
// sequence shape (layout: step.h, KvPool), and what the steps and tests ask of a pool.
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"
#include "attnd/server/status_util.h"
#include "cuda_device.h"
#include "spdlog/spdlog.h"

namespace attnd::server::cuda {

absl::Status CheckKvShape(const SequenceShape& s) {
  if (s.layers < 1) return absl::InvalidArgumentError(absl::StrCat("shape.layers: ", s.layers, " < 1"));
  if (s.kv_heads < 1) return absl::InvalidArgumentError(absl::StrCat("shape.kv_heads: ", s.kv_heads, " < 1"));
  if (s.head_dim != 64 && s.head_dim != 128 && s.head_dim != 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("shape.head_dim: ", s.head_dim, " is not one of the CUDA backend's 64, 128 and 256"));
  }
  if (s.dtype != DType::kBF16 && s.dtype != DType::kFP16) {
    return absl::InvalidArgumentError("shape.dtype: the CUDA backend runs bf16 and fp16");
  }
  if (s.kv_format == KvFormat::kAsDtype) return absl::OkStatus();
  if (s.kv_format != KvFormat::kFp8E4M3) return absl::InvalidArgumentError("shape.kv_dtype: unknown format");
  // The core spreads the request's descales to one per layer and kv head (sequences.cc); a launch reads one
  // layer's slice of each, so a shorter list would read past it.
  const size_t n = static_cast<size_t>(s.layers) * static_cast<size_t>(s.kv_heads);
  if (s.k_descale.size() != n || s.v_descale.size() != n) {
    return absl::InvalidArgumentError(absl::StrCat("shape.k_descale, v_descale: ", s.k_descale.size(), " and ",
                                                   s.v_descale.size(), " values for ", n, " (layers x kv_heads)"));
  }
  return absl::OkStatus();
}

int KvPoolDevice(const KvPool& pool) {
  const auto* p = dynamic_cast<const CudaKvPool*>(&pool);
  return p != nullptr ? p->device() : -1;
}

uint8_t* KvPoolData(const KvPool& pool) {
  const auto* p = dynamic_cast<const CudaKvPool*>(&pool);
  return p != nullptr ? p->pool(0, 0) : nullptr;
}

namespace {

// One copy per run of rows within a page between the pool and `host`, queued on this thread's stream: the pages are
// the caller's alone while it copies, and the steps that wrote them have finished (a step's reply comes after its
// GPU work).
absl::Status QueueRuns(const CudaKvPool& p, absl::Span<const int32_t> pages, int layer, int kv, int64_t first,
                       int64_t rows, bool to_host, uint8_t* host) {
  uint8_t* const data = p.pool(0, 0);
  absl::Status status;
  ForEachKvRowRun(p, pages, layer, kv, first, rows, [&](uint64_t at, uint64_t bytes, uint64_t host_at) {
    if (!status.ok()) return;
    const cudaError_t err =
        to_host ? cudaMemcpyAsync(host + host_at, data + at, bytes, cudaMemcpyDeviceToHost, cudaStreamPerThread)
                : cudaMemcpyAsync(data + at, host + host_at, bytes, cudaMemcpyHostToDevice, cudaStreamPerThread);
    status = CudaStatus(to_host ? "kv rows to the host" : "kv rows to the device", err);
  });
  const absl::Status synced = CudaStatus("kv rows", cudaStreamSynchronize(cudaStreamPerThread));
  return status.ok() ? synced : status;
}

// A move's rows between the pool and host memory, through a block of the device's pinned staging: every run's copy
// queued at once and waited for once, and one host copy between the block and the caller's memory (`in` fills the
// block before an upload, `out` reads it after a download). A run's copy from or to pageable memory is staged by the
// driver and waited for run by run (a page of 16 tokens: 32 KiB at a time). Without room in the staging budget the
// runs go to and from the pageable memory `pageable` returns (the caller's, or a gathered copy), as `in` and `out`
// see it.
absl::Status CopyStaged(const KvPool& pool, absl::Span<const int32_t> pages, int layer, int kv, int64_t first,
                        int64_t rows, bool to_host, absl::FunctionRef<void(uint8_t*)> in,
                        absl::FunctionRef<void(const uint8_t*)> out, absl::FunctionRef<uint8_t*()> pageable) {
  const auto* p = dynamic_cast<const CudaKvPool*>(&pool);
  if (p == nullptr) return absl::InternalError("kv rows: the pool was not made by this backend");
  ATTND_RETURN_IF_ERROR(CudaStatus("cudaSetDevice", cudaSetDevice(p->device())));
  const uint64_t bytes = static_cast<uint64_t>(rows) * pool.shape().row_bytes();
  absl::StatusOr<Block> staged = p->staging().Acquire(bytes);
  uint8_t* const host = staged.ok() ? static_cast<uint8_t*>(staged->ptr) : pageable();
  if (!to_host) in(host);
  const absl::Status copied = QueueRuns(*p, pages, layer, kv, first, rows, to_host, host);
  if (copied.ok() && to_host) out(host);
  if (staged.ok()) p->staging().Release(*staged);  // the copies are over: QueueRuns waited for them
  return copied;
}

}  // namespace

absl::Status CopyKvRows(const KvPool& pool, absl::Span<const int32_t> pages, int layer, int kv, int64_t first,
                        int64_t rows, bool to_host, uint8_t* host) {
  const uint64_t bytes = static_cast<uint64_t>(rows) * pool.shape().row_bytes();
  return CopyStaged(
      pool, pages, layer, kv, first, rows, to_host,
      [&](uint8_t* dst) {
        if (dst != host) std::memcpy(dst, host, bytes);
      },
      [&](const uint8_t* src) {
        if (src != host) std::memcpy(host, src, bytes);
      },
      [&] { return host; });
}

absl::Status WriteKvRows(const KvPool& pool, absl::Span<const int32_t> pages, int layer, int kv, int64_t first,
                         int64_t rows, HostPieces src) {
  const uint64_t bytes = static_cast<uint64_t>(rows) * pool.shape().row_bytes();
  std::string gathered;  // only without room in the staging budget
  bool whole = true;
  const absl::Status copied = CopyStaged(
      pool, pages, layer, kv, first, rows, /*to_host=*/false,
      [&](uint8_t* dst) { whole = PieceReader(src).Read(dst, bytes); }, [](const uint8_t*) {},
      [&] {
        gathered.resize(bytes);
        return reinterpret_cast<uint8_t*>(gathered.data());
      });
  if (!whole) return absl::InternalError("kv rows: fewer bytes than rows");
  return copied;
}

absl::StatusOr<std::shared_ptr<KvPool>> CudaDevice::MakeKvPool(const SequenceShape& shape, int page_tokens,
                                                              int32_t num_pages) {
  ATTND_RETURN_IF_ERROR(CheckKvShape(shape));
  if (page_tokens < 16 || page_tokens > 256 || (page_tokens & (page_tokens - 1)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_tokens: ", page_tokens, " is not a power of two from 16 to 256"));
  }
  if (num_pages < 1) return absl::InvalidArgumentError(absl::StrCat("num_pages: ", num_pages, " < 1"));
  // layers x 2 x num_pages x page_elems elements, computed where it cannot wrap.
  const long double bytes_ld = static_cast<long double>(shape.page_bytes(page_tokens)) * num_pages;
  const bool fp8 = shape.kv_format == KvFormat::kFp8E4M3;
  const std::string what = absl::StrCat("the KV page pool (", num_pages, " pages of ", page_tokens, " tokens, ",
                                        shape.layers, " layers x ", shape.kv_heads, " kv heads x ", shape.head_dim,
                                        " ", fp8 ? "float8 e4m3" : DTypeName(shape.dtype), ")");
  if (bytes_ld > static_cast<long double>(uint64_t{1} << 62)) {
    return absl::ResourceExhaustedError(absl::StrCat(what, " is too large to allocate"));
  }
  const uint64_t pages_bytes = static_cast<uint64_t>(shape.page_bytes(page_tokens)) * static_cast<uint64_t>(num_pages);
  // A float8 pool's descales follow its pages in the same block (CudaKvPool), so they go back with it.
  const uint64_t descales_at = Align(pages_bytes);
  const uint64_t descale_bytes = fp8 ? (shape.k_descale.size() + shape.v_descale.size()) * sizeof(float) : 0;
  const uint64_t bytes = fp8 ? descales_at + descale_bytes : pages_bytes;
  absl::StatusOr<Block> block = device_mem_->Acquire(bytes);
  if (!block.ok()) {
    return absl::ResourceExhaustedError(absl::StrCat(what, ": ", bytes, " bytes do not fit device ", index_,
                                                     "'s memory: ", block.status().message()));
  }
  auto pool = std::make_shared<CudaKvPool>(shape, page_tokens, num_pages, index_, *block, descales_at, device_mem_,
                                           pinned_mem_);
  if (fp8) {
    // Copied once, here: every launch on the pool reads them in place. The pool gives its block back on an error.
    std::vector<float> descales(shape.k_descale);
    descales.insert(descales.end(), shape.v_descale.begin(), shape.v_descale.end());
    ATTND_RETURN_IF_ERROR(CudaStatus("cudaSetDevice", cudaSetDevice(index_)));
    ATTND_RETURN_IF_ERROR(CudaStatus(
        "the KV pool's descales to the device",
        cudaMemcpyAsync(static_cast<uint8_t*>(block->ptr) + descales_at, descales.data(), descale_bytes,
                        cudaMemcpyHostToDevice, cudaStreamPerThread)));
    ATTND_RETURN_IF_ERROR(CudaStatus("the KV pool's descales", cudaStreamSynchronize(cudaStreamPerThread)));
  }
  spdlog::info("device {}: {} allocated, {} MiB", index_, what, bytes >> 20);
  return std::shared_ptr<KvPool>(std::move(pool));
}

}  // namespace attnd::server::cuda
