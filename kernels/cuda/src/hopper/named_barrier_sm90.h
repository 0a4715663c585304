// Named barriers of the Hopper family (bar.sync / bar.arrive with an id and a thread count). Id 0 is
// __syncthreads'; the ping-pong pair lets consumer warpgroup w wait for its turn to issue GEMMs
// (bar.sync on its own id, 256 threads) while the other signals it (bar.arrive on that id).
#pragma once

namespace attnd::kernels::hopper {

enum class FwdNamedBarrier : int {
  kWarpSchedulerWG1 = 1,  // consumer warpgroup 0 may issue its next GEMMs
  kWarpSchedulerWG2 = 2,  // consumer warpgroup 1 may issue its next GEMMs
};

// Ids are immediates, so ptxas reserves only the barriers named here (a register id reserves all 16).
template <FwdNamedBarrier kId, int kThreads>
__device__ __forceinline__ void NamedBarrierSync() {
  asm volatile("bar.sync %0, %1;" ::"n"(static_cast<int>(kId)), "n"(kThreads) : "memory");
}

template <FwdNamedBarrier kId, int kThreads>
__device__ __forceinline__ void NamedBarrierArrive() {
  asm volatile("bar.arrive %0, %1;" ::"n"(static_cast<int>(kId)), "n"(kThreads) : "memory");
}

// Consumer warpgroup `wg` waits for its turn to issue GEMMs / hands the turn to the other one.
__device__ __forceinline__ void WaitTurn(int wg) {
  if (wg == 0) {
    NamedBarrierSync<FwdNamedBarrier::kWarpSchedulerWG1, 256>();
  } else {
    NamedBarrierSync<FwdNamedBarrier::kWarpSchedulerWG2, 256>();
  }
}

__device__ __forceinline__ void PassTurn(int wg) {
  if (wg == 0) {
    NamedBarrierArrive<FwdNamedBarrier::kWarpSchedulerWG2, 256>();
  } else {
    NamedBarrierArrive<FwdNamedBarrier::kWarpSchedulerWG1, 256>();
  }
}

}  // namespace attnd::kernels::hopper
