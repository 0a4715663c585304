// Same-host sequence moves on the device (docs/sequences.md, "Moving a sequence"): the exporter gathers a
// sequence's rows into a buffer of their own and hands out its CUDA IPC handle; the importer opens the handle,
// scatters the rows into its pages and closes it. Each side is one kernel launch (kv_rows_copy.cu), the buffer
// holding the rows in the byte chunks' order: layer 0 K, layer 0 V, layer 1 K, ... An exporter that shares its pool
// hands out the pool's handle and the sequence's pages instead, and the importer copies the rows from the exporter's
// pages to its own in one launch, keeping the pool open (PoolMappings).
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

// One side of a move's copy as the host knows it (kv_rows.h's KvRowsSide before its tables are on the device).
struct Side {
  absl::Span<const int32_t> pages;  // empty: a buffer of the rows in move order
  int32_t page_tokens = 0;
  uint64_t page_bytes = 0, kv_pool_bytes = 0;
};

Side PoolSide(const SequenceShape& shape, int32_t num_pages, int page_tokens, absl::Span<const int32_t> pages) {
  Side s;
  s.pages = pages;
  s.page_tokens = page_tokens;
  s.page_bytes = static_cast<uint64_t>(shape.page_elems(page_tokens)) * shape.kv_bytes();
  s.kv_pool_bytes = static_cast<uint64_t>(num_pages) * s.page_bytes;
  return s;
}

Side PoolSide(const KvPool& pool, absl::Span<const int32_t> pages) {
  return PoolSide(pool.shape(), pool.num_pages(), pool.page_tokens(), pages);
}

template <typename T>
void Append(std::vector<uint8_t>& table, const T* data, size_t count) {
  const auto* bytes = reinterpret_cast<const uint8_t*>(data);
  table.insert(table.end(), bytes, bytes + count * sizeof(T));
}

// Every row of the sequence (`lengths` per layer) from `from` in `src` to `to` in `dst`, in one launch on this
// thread's stream, waited for. The lengths, the pools' page tables and a buffer's layer offsets reach the kernel in
// one block of the device's memory that no handle exposes.
absl::Status CopyRows(const CudaKvPool& p, const Side& from, const Side& to, absl::Span<const int64_t> lengths,
                      const uint8_t* src, uint8_t* dst) {
  const SequenceShape& shape = p.shape();
  const int64_t longest = lengths.empty() ? 0 : *std::max_element(lengths.begin(), lengths.end());
  if (longest == 0) return absl::OkStatus();
  // Laid out 8-byte values first: lengths, a buffer's layer offsets, then each pool's page table.
  std::vector<uint8_t> table;
  Append(table, lengths.data(), lengths.size());
  const size_t layer_at_at = table.size();
  std::vector<uint64_t> layer_at(lengths.size());
  for (size_t l = 0, at = 0; l < lengths.size(); at += 2 * static_cast<uint64_t>(lengths[l]) * shape.row_bytes(), ++l) {
    layer_at[l] = at;
  }
  Append(table, layer_at.data(), layer_at.size());
  size_t pages_at[2] = {0, 0};
  const Side* sides[2] = {&from, &to};
  for (int i = 0; i < 2; ++i) {
    if (sides[i]->pages.empty()) continue;
    const size_t used = static_cast<size_t>((longest + sides[i]->page_tokens - 1) / sides[i]->page_tokens);
    if (used > sides[i]->pages.size()) {
      return absl::InternalError(absl::StrCat("the move's page table holds ", sides[i]->pages.size(), " pages, its ",
                                              longest, " rows need ", used));
    }
    pages_at[i] = table.size();
    Append(table, sides[i]->pages.data(), used);
  }
  absl::StatusOr<Block> block = p.memory()->Acquire(table.size());
  if (!block.ok()) {
    return absl::ResourceExhaustedError(absl::StrCat("the move's table of ", table.size(), " bytes: ",
                                                     block.status().message()));
  }
  auto* on_device = static_cast<uint8_t*>(block->ptr);
  KvRowsCopy copy;
  copy.lengths = reinterpret_cast<const int64_t*>(on_device);
  copy.layers = static_cast<int>(lengths.size());
  copy.longest = longest;
  copy.row_bytes = shape.row_bytes();
  KvRowsSide* on[2] = {&copy.from, &copy.to};
  for (int i = 0; i < 2; ++i) {
    if (sides[i]->pages.empty()) {
      on[i]->layer_at = reinterpret_cast<const uint64_t*>(on_device + layer_at_at);
      continue;
    }
    on[i]->pages = reinterpret_cast<const int32_t*>(on_device + pages_at[i]);
    on[i]->page_tokens = sides[i]->page_tokens;
    on[i]->page_bytes = sides[i]->page_bytes;
    on[i]->kv_pool_bytes = sides[i]->kv_pool_bytes;
  }
  absl::Status status = CudaStatus("the move's table to the device",
                                   cudaMemcpyAsync(block->ptr, table.data(), table.size(), cudaMemcpyHostToDevice,
                                                   cudaStreamPerThread));
  if (status.ok()) {
    status = CudaStatus("the move's copy kernel", LaunchKvRowsCopy(copy, src, dst, cudaStreamPerThread));
  }
  const absl::Status synced = CudaStatus("the move's copy", cudaStreamSynchronize(cudaStreamPerThread));
  if (status.ok()) status = synced;
  // After a failed wait the table may still be read: it stays allocated rather than go back to the cache.
  if (synced.ok()) p.memory()->Release(*block);
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
  return CopyRows(p, PoolSide(shape, rows.pool_num_pages, rows.pool_page_tokens, rows.pool_pages), PoolSide(p, pages),
                  lengths, (*mapping)->base(), p.pool(0, 0));
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
  ATTND_RETURN_IF_ERROR(CopyRows(*p, PoolSide(pool, pages), Side{}, lengths, p->pool(0, 0), rows));
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
      CopyRows(*p, Side{}, PoolSide(pool, pages), lengths, (*mapping)->base(), p->pool(0, 0));
  // Closed before the import answers: the exporter frees the buffer only after that answer.
  const absl::Status closed = (*mapping)->Close();
  return copied.ok() ? closed : copied;
}

}  // namespace attnd::server::cuda
