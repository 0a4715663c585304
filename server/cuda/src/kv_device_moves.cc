// Same-host sequence moves on the device (docs/sequences.md, "Moving a sequence"): the exporter gathers a
// sequence's rows into a buffer of their own and hands out its CUDA IPC handle; the importer opens the handle,
// scatters the rows into its pages and closes it. Each side is one kernel launch (kv_rows_copy.cu) over the runs
// of rows ForEachKvRowRun yields, in the byte chunks' order: layer 0 K, layer 0 V, layer 1 K, ... An exporter that
// shares its pool hands out the pool's handle and the sequence's pages instead, and the importer copies the rows
// from the exporter's pages to its own in one launch (ForEachPoolToPoolRun), keeping the pool open (PoolMappings).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "attnd/server/cuda/ipc_registry.h"
#include "attnd/server/status_util.h"
#include "cuda_device.h"
#include "kv_rows_copy.h"

namespace attnd::server::cuda {
namespace {

// A buffer a handle exposes is at least one large page of its own, so the mapping another process opens holds no
// byte of any other allocation; what lies past the rows is zeroed.
constexpr uint64_t kOwnPages = 2ull << 20;

// Every run of the sequence's rows, `pool_is_src`: pool to buffer (an export), else buffer to pool (an import).
std::vector<KvRowRun> MoveRuns(const KvPool& pool, absl::Span<const int32_t> pages, absl::Span<const int64_t> lengths,
                               bool pool_is_src) {
  std::vector<KvRowRun> runs;
  uint64_t buffer_at = 0;
  for (int layer = 0; layer < pool.shape().layers; ++layer) {
    for (int kv = 0; kv < 2; ++kv) {
      ForEachKvRowRun(pool, pages, layer, kv, 0, lengths[layer], [&](uint64_t at, uint64_t bytes, uint64_t in_rows) {
        const uint64_t in_buffer = buffer_at + in_rows;
        runs.push_back(pool_is_src ? KvRowRun{at, in_buffer, bytes} : KvRowRun{in_buffer, at, bytes});
      });
      buffer_at += static_cast<uint64_t>(lengths[layer]) * pool.shape().row_bytes();
    }
  }
  return runs;
}

// The runs copied from `src` to `dst` in one launch on this thread's stream, waited for. The run table goes through a
// block of the device's memory that the handle never exposes.
absl::Status CopyRuns(const CudaKvPool& p, const std::vector<KvRowRun>& runs, const uint8_t* src, uint8_t* dst) {
  if (runs.empty()) return absl::OkStatus();
  const uint64_t table_bytes = runs.size() * sizeof(KvRowRun);
  absl::StatusOr<Block> table = p.memory()->Acquire(table_bytes);
  if (!table.ok()) {
    return absl::ResourceExhaustedError(absl::StrCat("the move's table of ", runs.size(), " runs: ",
                                                     table.status().message()));
  }
  absl::Status status = CudaStatus("the move's runs to the device",
                                   cudaMemcpyAsync(table->ptr, runs.data(), table_bytes, cudaMemcpyHostToDevice,
                                                   cudaStreamPerThread));
  if (status.ok()) {
    status = CudaStatus("the move's copy kernel",
                        LaunchKvRowRuns(static_cast<const KvRowRun*>(table->ptr), static_cast<int>(runs.size()), src,
                                        dst, cudaStreamPerThread));
  }
  const absl::Status synced = CudaStatus("the move's copy", cudaStreamSynchronize(cudaStreamPerThread));
  if (status.ok()) status = synced;
  // After a failed wait the table may still be read: it stays allocated rather than go back to the cache.
  if (synced.ok()) p.memory()->Release(*table);
  return status;
}

const CudaKvPool* PoolOf(const KvPool& pool) { return dynamic_cast<const CudaKvPool*>(&pool); }

// The rows copied from the exporter's pages (Sequences::ImportOnDevice checked the page table against the header)
// once the pool they name is known to fit the allocation the handle opens.
absl::Status ImportFromPool(const CudaKvPool& p, absl::Span<const int32_t> pages, absl::Span<const int64_t> lengths,
                            const DeviceRows& rows, PoolMappings& pools) {
  absl::StatusOr<std::shared_ptr<IpcMapping>> mapping = pools.Open(rows.ipc_handle, p.device());
  if (!mapping.ok()) return mapping.status();
  const SequenceShape& shape = p.shape();
  const uint64_t per_page = 2 * static_cast<uint64_t>(shape.layers) *
                            static_cast<uint64_t>(shape.page_elems(rows.pool_page_tokens)) * shape.kv_bytes();
  if (static_cast<uint64_t>(rows.pool_num_pages) > (*mapping)->allocation_bytes() / per_page) {
    return absl::InvalidArgumentError(absl::StrCat(
        "chunk.device_rows.pool.num_pages: ", rows.pool_num_pages, " pages of ", per_page, " bytes (every layer's K ",
        "and V) do not fit the handle's allocation of ", (*mapping)->allocation_bytes(), " bytes"));
  }
  std::vector<KvRowRun> runs;
  ForEachPoolToPoolRun(rows.pool_num_pages, rows.pool_page_tokens, rows.pool_pages, p, pages, lengths,
                       [&](uint64_t from, uint64_t to, uint64_t bytes) { runs.push_back(KvRowRun{from, to, bytes}); });
  return CopyRuns(p, runs, (*mapping)->base(), p.pool(0, 0));
}

}  // namespace

PoolMappings::PoolMappings(absl::Duration idle) : idle_(idle) {}

PoolMappings::~PoolMappings() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (closer_.joinable()) closer_.join();
  absl::MutexLock lock(&mu_);
  open_.clear();  // each mapping closes when its last user drops it
}

absl::StatusOr<std::shared_ptr<IpcMapping>> PoolMappings::Open(const std::string& handle, int device) {
  absl::MutexLock lock(&mu_);
  if (auto it = open_.find(handle); it != open_.end() && it->second.mapping->device() == device) {
    it->second.used = absl::Now();
    return it->second.mapping;
  }
  // Opened under the lock: two imports from one pool that arrive together open it once.
  absl::StatusOr<std::shared_ptr<IpcMapping>> opened =
      OpenIpcMemHandle(handle, device, "chunk.device_rows.ipc_handle", "chunk.device_rows.device_uuid");
  if (!opened.ok()) return opened.status();
  open_[handle] = Entry{*opened, absl::Now()};
  if (!closer_.joinable()) closer_ = std::thread([this] { CloseIdle(); });
  return *opened;
}

void PoolMappings::CloseIdle() {
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    mu_.AwaitWithTimeout(absl::Condition(&stopping_), idle_ / 2);
    const absl::Time now = absl::Now();
    // An import still copying holds its own reference, so the mapping closes when that import ends.
    absl::erase_if(open_, [&](const auto& e) { return now - e.second.used > idle_; });
  }
}

std::string UuidText(const cudaUUID_t& uuid) {
  std::string out;
  for (char b : uuid.bytes) absl::StrAppendFormat(&out, "%02x", static_cast<uint8_t>(b));
  return out;
}

absl::StatusOr<DeviceRows> ExportKvRowsOnDevice(const KvPool& pool, absl::Span<const int32_t> pages,
                                                absl::Span<const int64_t> lengths, bool share_pool,
                                                const std::string& device_uuid, std::shared_ptr<void>* hold) {
  const CudaKvPool* p = PoolOf(pool);
  if (p == nullptr) return absl::InternalError("device rows: the pool was not made by this backend");
  DeviceRows out;
  out.device_uuid = device_uuid;
  for (int64_t n : lengths) out.bytes += 2 * static_cast<uint64_t>(n) * pool.shape().row_bytes();
  if (out.bytes == 0) return out;  // nothing to expose: no buffer, no handle
  ATTND_RETURN_IF_ERROR(CudaStatus("cudaSetDevice", cudaSetDevice(p->device())));
  if (share_pool) {
    // The pool is a block of the device's memory budget, and a block is an allocation of its own, so the pool
    // starts at the first byte of the allocation the handle names. The held export keeps the pages as they are.
    out.from_pool = true;
    out.pool_num_pages = pool.num_pages();
    out.pool_page_tokens = pool.page_tokens();
    const int64_t longest = *std::max_element(lengths.begin(), lengths.end());
    const int64_t used = (longest + pool.page_tokens() - 1) / pool.page_tokens();
    out.pool_pages.assign(pages.begin(), pages.begin() + used);
    cudaIpcMemHandle_t handle;
    ATTND_RETURN_IF_ERROR(CudaStatus("cudaIpcGetMemHandle", cudaIpcGetMemHandle(&handle, p->pool(0, 0))));
    out.ipc_handle.assign(reinterpret_cast<const char*>(&handle), sizeof handle);
    return out;
  }
  std::shared_ptr<BlockCache> memory = p->memory();
  absl::StatusOr<Block> block = memory->AcquireFresh(std::max(out.bytes, kOwnPages));
  if (!block.ok()) {
    return absl::ResourceExhaustedError(absl::StrCat("device: the moved rows' ", out.bytes, " bytes do not fit device ",
                                                     p->device(), "'s memory budget: ", block.status().message()));
  }
  // Freed (never cached for another request) once the export ends; by then the importer has closed its handle.
  auto buffer = std::shared_ptr<void>(block->ptr, [memory, b = *block](void*) { memory->Drop(b); });
  auto* rows = static_cast<uint8_t*>(block->ptr);
  ATTND_RETURN_IF_ERROR(CudaStatus("zeroing the moved rows' buffer past the rows",
                                   cudaMemsetAsync(rows + out.bytes, 0, block->size - out.bytes,
                                                   cudaStreamPerThread)));
  ATTND_RETURN_IF_ERROR(CopyRuns(*p, MoveRuns(pool, pages, lengths, /*pool_is_src=*/true), p->pool(0, 0), rows));
  cudaIpcMemHandle_t handle;
  ATTND_RETURN_IF_ERROR(CudaStatus("cudaIpcGetMemHandle", cudaIpcGetMemHandle(&handle, rows)));
  out.ipc_handle.assign(reinterpret_cast<const char*>(&handle), sizeof handle);
  *hold = std::move(buffer);
  return out;
}

absl::Status ImportKvRowsOnDevice(const KvPool& pool, absl::Span<const int32_t> pages,
                                  absl::Span<const int64_t> lengths, const std::string& device_uuid,
                                  const DeviceRows& rows, PoolMappings& pools) {
  const CudaKvPool* p = PoolOf(pool);
  if (p == nullptr) return absl::InternalError("device rows: the pool was not made by this backend");
  if (rows.device_uuid != device_uuid) {
    return absl::FailedPreconditionError(absl::StrCat("chunk.device_rows.device_uuid: '", rows.device_uuid,
                                                      "' is not this server's GPU (", device_uuid,
                                                      "); move the sequence by bytes"));
  }
  if (rows.bytes == 0) return absl::OkStatus();
  ATTND_RETURN_IF_ERROR(CudaStatus("cudaSetDevice", cudaSetDevice(p->device())));
  if (rows.from_pool) return ImportFromPool(*p, pages, lengths, rows, pools);
  absl::StatusOr<std::shared_ptr<IpcMapping>> mapping =
      OpenIpcMemHandle(rows.ipc_handle, p->device(), "chunk.device_rows.ipc_handle", "chunk.device_rows.device_uuid");
  if (!mapping.ok()) return mapping.status();
  if ((*mapping)->allocation_bytes() < rows.bytes) {
    return absl::InvalidArgumentError(absl::StrCat("chunk.device_rows.bytes: ", rows.bytes, " bytes, but the handle's ",
                                                   "allocation holds ", (*mapping)->allocation_bytes()));
  }
  const absl::Status copied =
      CopyRuns(*p, MoveRuns(pool, pages, lengths, /*pool_is_src=*/false), (*mapping)->base(), p->pool(0, 0));
  // Closed before the import answers: the exporter frees the buffer only after that answer.
  const absl::Status closed = (*mapping)->Close();
  return copied.ok() ? closed : copied;
}

}  // namespace attnd::server::cuda
