// What the per-device pools of launch state share (tile_counter_pool.h, split_tail_pool.h): a slot's memory may be
// given to one launch at a time, so each slot remembers the last launch given it (an event), and the next launch,
// on whatever stream, waits for that one first. The wait almost never happens: it takes as many launches in flight
// as the pool has slots.
#pragma once

#include <cuda_runtime_api.h>

namespace attnd::kernels::hopper {

struct LaunchSlotEvent {
  cudaEvent_t last = nullptr;
  bool recorded = false;

  // Creates the event on first use (the current device's).
  cudaError_t Ensure() {
    return last != nullptr ? cudaSuccess : cudaEventCreateWithFlags(&last, cudaEventDisableTiming);
  }
  // Makes `stream` wait for the slot's previous launch, when there was one and it has not finished.
  cudaError_t WaitOn(cudaStream_t stream) const {
    if (!recorded) return cudaSuccess;
    const cudaError_t q = cudaEventQuery(last);
    if (q == cudaErrorNotReady) return cudaStreamWaitEvent(stream, last, 0);
    return q;
  }
  // The launch just enqueued on `stream` is the slot's last one.
  cudaError_t Record(cudaStream_t stream) {
    const cudaError_t err = cudaEventRecord(last, stream);
    recorded = recorded || err == cudaSuccess;
    return err;
  }
};

}  // namespace attnd::kernels::hopper
