// Tile counters for the Hopper family's dynamic schedule (tile_scheduler_sm90.cuh, kDynamic).
//
// A dynamically scheduled launch needs two device counters that are zero when it starts and that no other
// launch touches while it runs; the kernel's last block zeroes them on the way out. The pool hands them out
// round-robin from a per-device array of slots, and each slot remembers (an event) the last launch given it:
// a new launch on another stream first waits for that one, so slots are never shared by launches in flight
// whatever the streams, their number, or a stream destroyed and its handle reused. The wait almost never
// happens (it takes kSlots launches in flight); its cost is one event query and one record per launch.
#pragma once

#include <cuda_runtime_api.h>

namespace attnd::kernels::hopper {

class TileCounterLease {
 public:
  // Takes the next slot of the current device's pool (created on first use: one cudaMalloc, a memset and
  // the events) and makes `stream` wait for the slot's previous launch. On success counter() is valid and
  // Finish must be called with the same stream right after the launch is enqueued (or was not).
  cudaError_t Begin(int device, cudaStream_t stream);
  // Records the slot's event on `stream` and gives the slot back.
  cudaError_t Finish(cudaStream_t stream);
  ~TileCounterLease();

  unsigned* counter() const { return counter_; }

 private:
  unsigned* counter_ = nullptr;
  void* slot_ = nullptr;  // the pool's slot (its lock is held between Begin and Finish)
};

// Creates the pool of `device` if it does not exist yet (so that the first dynamic launch allocates nothing).
cudaError_t EnsureTileCounterPool(int device);

}  // namespace attnd::kernels::hopper
