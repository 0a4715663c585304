#include "hopper/split_tail_pool.h"

#include <array>
#include <atomic>
#include <mutex>

#include "hopper/launch_slot.h"

namespace attnd::kernels::hopper {
namespace {

// Four launches in flight with split tails before one waits for another: the server's request slots run
// their kernels on separate streams, and each slot's memory is large.
constexpr int kSlots = 4;
constexpr int kMaxDevices = 64;

struct Slot {
  std::mutex mu;  // held from Begin to Finish
  LaunchSlotEvent event;
  float* workspace = nullptr;
  size_t workspace_bytes = 0;
  unsigned* counters = nullptr;
  size_t counter_bytes = 0;
};

struct Pool {
  std::array<Slot, kSlots> slots;
  std::atomic<unsigned> next{0};
};

std::array<std::atomic<Pool*>, kMaxDevices> g_pools{};
std::mutex g_create_mu;

cudaError_t GetPool(int device, Pool** out) {
  if (device < 0 || device >= kMaxDevices) return cudaErrorInvalidDevice;
  Pool* pool = g_pools[device].load(std::memory_order_acquire);
  if (pool == nullptr) {
    std::lock_guard<std::mutex> lock(g_create_mu);
    pool = g_pools[device].load(std::memory_order_acquire);
    if (pool == nullptr) {
      pool = new Pool;  // lives as long as the process, like the CUDA context
      g_pools[device].store(pool, std::memory_order_release);
    }
  }
  *out = pool;
  return cudaSuccess;
}

// Replaces the slot's memory with `bytes` of it. The slot's last launch must be over first: cudaFree of memory
// a kernel still uses is undefined.
template <typename T>
cudaError_t Grow(Slot& slot, T** ptr, size_t* have, size_t bytes) {
  if (*have >= bytes) return cudaSuccess;
  if (slot.event.recorded) {
    if (const cudaError_t err = cudaEventSynchronize(slot.event.last); err != cudaSuccess) return err;
  }
  if (*ptr != nullptr) {
    if (const cudaError_t err = cudaFree(*ptr); err != cudaSuccess) return err;
    *ptr = nullptr;
    *have = 0;
  }
  if (const cudaError_t err = cudaMalloc(reinterpret_cast<void**>(ptr), bytes); err != cudaSuccess) return err;
  *have = bytes;
  return cudaSuccess;
}

// The slot's event, and its memory grown to the sizes asked for. Fresh counters are zeroed on `stream` (before the
// launch enqueued there next), or at once when it is null.
cudaError_t Provision(Slot& slot, size_t workspace_bytes, size_t counter_bytes, cudaStream_t stream) {
  if (const cudaError_t err = slot.event.Ensure(); err != cudaSuccess) return err;
  if (const cudaError_t err = Grow(slot, &slot.workspace, &slot.workspace_bytes, workspace_bytes); err != cudaSuccess) {
    return err;
  }
  const size_t had = slot.counter_bytes;
  if (const cudaError_t err = Grow(slot, &slot.counters, &slot.counter_bytes, counter_bytes); err != cudaSuccess) {
    return err;
  }
  if (slot.counter_bytes == had) return cudaSuccess;
  return stream != nullptr ? cudaMemsetAsync(slot.counters, 0, slot.counter_bytes, stream)
                           : cudaMemset(slot.counters, 0, slot.counter_bytes);
}

// Memory and events belong to the current device: it must be the one asked for.
cudaError_t CheckDevice(int device) {
  int current = -1;
  if (const cudaError_t err = cudaGetDevice(&current); err != cudaSuccess) return err;
  return current == device ? cudaSuccess : cudaErrorInvalidDevice;
}

}  // namespace

cudaError_t ReserveSplitTailPool(int device, size_t workspace_bytes, size_t counter_bytes) {
  Pool* pool = nullptr;
  if (const cudaError_t err = GetPool(device, &pool); err != cudaSuccess) return err;
  if (const cudaError_t err = CheckDevice(device); err != cudaSuccess) return err;
  for (Slot& slot : pool->slots) {
    std::lock_guard<std::mutex> lock(slot.mu);
    if (const cudaError_t err = Provision(slot, workspace_bytes, counter_bytes, nullptr); err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

cudaError_t SplitTailLease::Begin(int device, cudaStream_t stream, size_t workspace_bytes, size_t counter_bytes) {
  Pool* pool = nullptr;
  if (const cudaError_t err = GetPool(device, &pool); err != cudaSuccess) return err;
  Slot& slot = pool->slots[pool->next.fetch_add(1, std::memory_order_relaxed) % kSlots];
  slot.mu.lock();
  slot_ = &slot;
  if (slot.event.last == nullptr) {
    if (const cudaError_t err = CheckDevice(device); err != cudaSuccess) return err;
  }
  if (const cudaError_t err = Provision(slot, workspace_bytes, counter_bytes, stream); err != cudaSuccess) return err;
  if (const cudaError_t err = slot.event.WaitOn(stream); err != cudaSuccess) return err;
  workspace_ = slot.workspace;
  counters_ = slot.counters;
  return cudaSuccess;
}

cudaError_t SplitTailLease::Finish(cudaStream_t stream) {
  if (slot_ == nullptr) return cudaSuccess;
  Slot& slot = *static_cast<Slot*>(slot_);
  const cudaError_t err = slot.event.Record(stream);
  slot_ = nullptr;
  workspace_ = nullptr;
  counters_ = nullptr;
  slot.mu.unlock();
  return err;
}

SplitTailLease::~SplitTailLease() {
  if (slot_ != nullptr) static_cast<Slot*>(slot_)->mu.unlock();
}

}  // namespace attnd::kernels::hopper
