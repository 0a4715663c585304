#include "hopper/tile_counter_pool.h"

#include <array>
#include <atomic>
#include <memory>
#include <mutex>

#include "hopper/launch_slot.h"

namespace attnd::kernels::hopper {
namespace {

// Enough that a wait needs this many launches in flight on one device; 128 bytes apart so concurrent
// kernels' atomics do not share a cache line.
constexpr int kSlots = 64;
constexpr int kSlotBytes = 128;
constexpr int kMaxDevices = 64;

struct Slot {
  std::mutex mu;  // held from Begin to Finish: one launch at a time is being enqueued on a slot
  LaunchSlotEvent event;
  unsigned* counter = nullptr;
};

struct Pool {
  unsigned char* base = nullptr;
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
      // cudaMalloc and the events belong to the current device: it must be the one asked for.
      int current = -1;
      if (const cudaError_t err = cudaGetDevice(&current); err != cudaSuccess) return err;
      if (current != device) return cudaErrorInvalidDevice;
      auto fresh = std::make_unique<Pool>();
      cudaError_t err = cudaMalloc(reinterpret_cast<void**>(&fresh->base), kSlots * kSlotBytes);
      if (err != cudaSuccess) return err;
      // The zeroes must be in place before any stream's first launch reads them, non-blocking streams
      // included; a stream of its own waits for the memset alone, not for the work of the device's other streams.
      cudaStream_t zero = nullptr;
      err = cudaStreamCreateWithFlags(&zero, cudaStreamNonBlocking);
      if (err == cudaSuccess) err = cudaMemsetAsync(fresh->base, 0, kSlots * kSlotBytes, zero);
      if (err == cudaSuccess) err = cudaStreamSynchronize(zero);
      if (zero != nullptr) cudaStreamDestroy(zero);
      for (int i = 0; i < kSlots && err == cudaSuccess; ++i) {
        fresh->slots[i].counter = reinterpret_cast<unsigned*>(fresh->base + i * kSlotBytes);
        err = fresh->slots[i].event.Ensure();
      }
      if (err != cudaSuccess) {
        for (Slot& s : fresh->slots) {
          if (s.event.last != nullptr) cudaEventDestroy(s.event.last);
        }
        cudaFree(fresh->base);
        return err;
      }
      pool = fresh.release();  // lives as long as the process, like the CUDA context
      g_pools[device].store(pool, std::memory_order_release);
    }
  }
  *out = pool;
  return cudaSuccess;
}

}  // namespace

cudaError_t EnsureTileCounterPool(int device) {
  Pool* pool = nullptr;
  return GetPool(device, &pool);
}

cudaError_t TileCounterLease::Begin(int device, cudaStream_t stream) {
  Pool* pool = nullptr;
  if (const cudaError_t err = GetPool(device, &pool); err != cudaSuccess) return err;
  Slot& slot = pool->slots[pool->next.fetch_add(1, std::memory_order_relaxed) % kSlots];
  slot.mu.lock();
  slot_ = &slot;
  if (const cudaError_t err = slot.event.WaitOn(stream); err != cudaSuccess) return err;
  counter_ = slot.counter;
  return cudaSuccess;
}

cudaError_t TileCounterLease::Finish(cudaStream_t stream) {
  if (slot_ == nullptr) return cudaSuccess;
  Slot& slot = *static_cast<Slot*>(slot_);
  const cudaError_t err = slot.event.Record(stream);
  slot_ = nullptr;
  counter_ = nullptr;
  slot.mu.unlock();
  return err;
}

TileCounterLease::~TileCounterLease() {
  if (slot_ != nullptr) static_cast<Slot*>(slot_)->mu.unlock();
}

}  // namespace attnd::kernels::hopper
