// Named barriers of the Hopper family (bar.sync / bar.arrive with an id and a thread count). Id 0 is
// __syncthreads'; the scheduler barriers let consumer warpgroup w wait for its turn to issue GEMMs
// (bar.sync on its own id, 256 threads) while the one before it signals it (bar.arrive on that id).
#pragma once

namespace attnd::kernels::hopper {

enum class FwdNamedBarrier : int {
  kWarpSchedulerWG1 = 1,  // consumer warpgroup 0 may issue its next GEMMs
  kWarpSchedulerWG2 = 2,  // consumer warpgroup 1 may issue its next GEMMs
  kWarpSchedulerWG3 = 3,  // consumer warpgroup 2 may issue its next GEMMs (3-warpgroup tiles)
  kLastPVDone = 4,        // shared-memory epilogue: both consumer warpgroups' last P V of the tile has completed
                          // (split O stages: warpgroup 0's, which warpgroup 1 waits for)
  kOWrittenWG1 = 5,       // shared-memory epilogue: warpgroup 0's O is in shared memory and fenced
  kOWrittenWG2 = 6,       // the same for warpgroup 1
  kLastQKDone = 7,        // split O stages: warpgroup 1's last Q K^T of the tile has completed (warpgroup 0 waits)
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

template <bool kSync, FwdNamedBarrier kId, int kThreads>
__device__ __forceinline__ void NamedBarrierOp() {
  if constexpr (kSync) {
    NamedBarrierSync<kId, kThreads>();
  } else {
    NamedBarrierArrive<kId, kThreads>();
  }
}

// Warpgroup wg's barrier of kCount (2 or 3) with consecutive ids from kFirst: kFirst for warpgroup 0, the next for
// warpgroup 1, the third for any other. bar.sync when kSync, else bar.arrive. A branch per warpgroup keeps every id
// an immediate.
template <bool kSync, FwdNamedBarrier kFirst, int kThreads, int kCount>
__device__ __forceinline__ void WarpgroupBarrier(int wg) {
  static_assert(kCount == 2 || kCount == 3);
  if (wg == 0) {
    NamedBarrierOp<kSync, kFirst, kThreads>();
  } else if (kCount == 2 || wg == 1) {
    NamedBarrierOp<kSync, static_cast<FwdNamedBarrier>(static_cast<int>(kFirst) + 1), kThreads>();
  } else if constexpr (kCount == 3) {
    NamedBarrierOp<kSync, static_cast<FwdNamedBarrier>(static_cast<int>(kFirst) + 2), kThreads>();
  }
}

// Turns go round the consumer warpgroups 0, 1, .., n-1, 0, ...: warpgroup wg waits on its own barrier
// (its 128 threads plus the 128 of the one handing over) and hands over on the next one's.
__device__ __forceinline__ void SyncSchedulerBarrier(int wg) {
  WarpgroupBarrier<true, FwdNamedBarrier::kWarpSchedulerWG1, 256, 3>(wg);
}

__device__ __forceinline__ void ArriveSchedulerBarrier(int wg) {
  WarpgroupBarrier<false, FwdNamedBarrier::kWarpSchedulerWG1, 256, 3>(wg);
}

// Shared-memory epilogue: warpgroup wg's 128 threads have written and fenced their part of O.
__device__ __forceinline__ void OWrittenBarrier(int wg) {
  WarpgroupBarrier<true, FwdNamedBarrier::kOWrittenWG1, 128, 2>(wg);
}

template <int kConsumerWGs>
__device__ __forceinline__ void WaitTurn(int wg) {
  SyncSchedulerBarrier(wg);
}

template <int kConsumerWGs>
__device__ __forceinline__ void PassTurn(int wg) {
  ArriveSchedulerBarrier(wg + 1 == kConsumerWGs ? 0 : wg + 1);
}

}  // namespace attnd::kernels::hopper
