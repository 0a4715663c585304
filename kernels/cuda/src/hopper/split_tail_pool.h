// Workspace for the Hopper family's split tail (tile_scheduler_sm90.cuh, TailPartAt): the partial outputs of
// tiles whose key blocks are shared out among several blocks, and the per-tile counters that find the part
// finishing each tile. The counters must be zero when a launch starts; the finishing parts zero them again.
//
// Like tile_counter_pool.h, a per-device pool of slots handed out round-robin, each remembering (an event) the
// last launch given it, so that launches in flight never share one. A slot's memory is allocated when a launch
// first needs it (or more of it) and kept for the process's lifetime: tens of MiB per slot at head_dim 128-256
// (SplitTailBytes), outside any budget the caller keeps.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

namespace attnd::kernels::hopper {

class SplitTailLease {
 public:
  // Takes a slot of `device`'s pool with at least `workspace_bytes` of workspace and `counter_bytes` of zeroed
  // counters (allocated, or grown, here: the first such launch pays a cudaMalloc), and makes `stream` wait for
  // the slot's previous launch. Finish must follow with the same stream once the launch is enqueued (or not).
  cudaError_t Begin(int device, cudaStream_t stream, size_t workspace_bytes, size_t counter_bytes);
  cudaError_t Finish(cudaStream_t stream);
  ~SplitTailLease();

  float* workspace() const { return workspace_; }
  unsigned* counters() const { return counters_; }

 private:
  float* workspace_ = nullptr;
  unsigned* counters_ = nullptr;
  void* slot_ = nullptr;  // the pool's slot (its lock is held between Begin and Finish)
};

// Allocates every slot of `device`'s pool to at least these sizes now (counters zeroed), so that launches
// afterwards allocate nothing: called when a configuration with a split tail is prepared, with the largest
// sizes its launches on this device can ask for.
cudaError_t ReserveSplitTailPool(int device, size_t workspace_bytes, size_t counter_bytes);

}  // namespace attnd::kernels::hopper
