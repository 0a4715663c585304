// Timeline probes of the Hopper family, for kernels/cuda/tools/hopper_trace.cu only.
//
// The throughput tables say how much a tile costs beyond its key blocks, not where the cycles go; one clock64 stamp per phase and tile, taken by the first thread of each warp
// role, does. In the library build (ATTND_HOPPER_TRACE undefined) every probe expands to nothing, so the
// kernels it ships are the ones without probes.
#pragma once

#include <cstdint>

#if defined(ATTND_HOPPER_TRACE)

namespace attnd::kernels::hopper::trace {

// Stamps per block: [role][round][event]. Role 0 is the producer, role 1 + w consumer warpgroup w.
constexpr int kRoles = 4, kRounds = 64, kEvents = 21;

// Consumer events, in the order a tile passes them; kBlocks stores the tile's key-block count, not a time.
enum ConsumerEvent : int { kTileStart, kQReady, kFirstDone, kMiddleDone, kLastPVDone, kStored, kBlocks };
// Timeline events (hopper_trace --timeline): %globaltimer (ns, one clock for all SMs, unlike clock64) at a tile's or
// split-tail part's start, a part's first key block (0 for whole tiles), the SM it ran on and its tile (PackTile).
// Round kRounds - 1 of kGlobalStart holds the block's end.
enum TimelineEvent : int { kGlobalStart = 7, kPartFirst = 8, kSmId = 9, kTile = 20 };

// A tile's coordinates in one stamp (kTile), 20 bits each for the q tile and head, the batch above them.
__host__ __device__ constexpr uint64_t PackTile(int q_tile, int head, int batch) {
  return static_cast<uint64_t>(q_tile) | static_cast<uint64_t>(head) << 20 | static_cast<uint64_t>(batch) << 40;
}
// Where an overlapped middle step's cycles go (hopper_trace's step table): per tile, the sum over its middle steps of
// the cycles between consecutive marks, stored as values in events kStepEvent0 + part. Taken by the first thread of
// each consumer warpgroup, i.e. its warp 0.
enum StepPart : int { kSpKWait, kSpTurn, kSpIssueS, kSpVWait, kSpIssuePV, kSpSWait, kSpMax, kSpSoftmax, kSpPVWait,
                      kSpConvert, kStepParts };
constexpr int kStepEvent0 = 10;
// Producer events.
enum ProducerEvent : int { kPTileStart, kPFirstKIssued, kPQIssued, kPTileIssued };

// Set by the tool (cudaMemcpyToSymbol); null: probes are off. In constant memory: a global load here would
// queue behind the epilogue's stores and charge their drain to the next phase.
__constant__ uint64_t* g_buffer = nullptr;

__device__ __forceinline__ uint64_t Clock() {
  uint64_t c;
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(c)::"memory");
  return c;
}

__device__ __forceinline__ uint64_t GlobalTime() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)::"memory");
  return t;
}

__device__ __forceinline__ void Put(int role, int round, int event, uint64_t value) {
  if (g_buffer != nullptr && (threadIdx.x & 127) == 0 && round < kRounds) {
    g_buffer[((static_cast<int64_t>(blockIdx.x) * kRoles + role) * kRounds + round) * kEvents + event] = value;
  }
}

__device__ __forceinline__ uint32_t SmId() {
  uint32_t id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}

__device__ __forceinline__ uint32_t Clock32() {
  uint32_t c;
  asm volatile("mov.u32 %0, %%clock;" : "=r"(c)::"memory");
  return c;
}

// The step parts' sums of the running tile, per consumer warpgroup (static shared memory: registers would change the
// probed kernels' allocation more).
__device__ __forceinline__ uint32_t* StepSums() {
  __shared__ uint32_t sums[kRoles - 1][kStepParts];
  return &sums[0][0];
}

__device__ __forceinline__ void StepReset(int wg, uint32_t& prev) {
  if ((threadIdx.x & 127) == 0) {
    for (int i = 0; i < kStepParts; ++i) StepSums()[wg * kStepParts + i] = 0;
  }
  prev = Clock32();
}

__device__ __forceinline__ void StepMark(int wg, uint32_t& prev, int part) {
  const uint32_t now = Clock32();
  if ((threadIdx.x & 127) == 0) StepSums()[wg * kStepParts + part] += now - prev;
  prev = now;
}

__device__ __forceinline__ void StepPut(int wg, int round) {
  for (int i = 0; i < kStepParts; ++i) Put(1 + wg, round, kStepEvent0 + i, StepSums()[wg * kStepParts + i]);
}

}  // namespace attnd::kernels::hopper::trace

#define ATTND_HOPPER_TRACE_AT(role, round, event) \
  ::attnd::kernels::hopper::trace::Put((role), (round), (event), ::attnd::kernels::hopper::trace::Clock())
#define ATTND_HOPPER_TRACE_GLOBAL(role, round)                                                              \
  (::attnd::kernels::hopper::trace::Put((role), (round), ::attnd::kernels::hopper::trace::kGlobalStart,    \
                                        ::attnd::kernels::hopper::trace::GlobalTime()),                   \
   ::attnd::kernels::hopper::trace::Put((role), (round), ::attnd::kernels::hopper::trace::kSmId,           \
                                        ::attnd::kernels::hopper::trace::SmId()))
#define ATTND_HOPPER_TRACE_VALUE(role, round, event, value) \
  ::attnd::kernels::hopper::trace::Put((role), (round), (event), static_cast<uint64_t>(value))
#define ATTND_HOPPER_TRACE_TILE(role, round, coord)                                                \
  ::attnd::kernels::hopper::trace::Put(                                                          \
      (role), (round), ::attnd::kernels::hopper::trace::kTile,                                   \
      ::attnd::kernels::hopper::trace::PackTile((coord).q_tile, (coord).head, (coord).batch))
// The producer and consumers learn their tile's round through a member that exists only in probed builds: an
// extra member, even unused, changed the order of two instructions in the shipped kernels.
#define ATTND_HOPPER_TRACE_ROUND_MEMBER int trace_round = 0;
#define ATTND_HOPPER_TRACE_SET_ROUND(role_object, round) ((role_object).trace_round = (round))
// Step parts (consumer warpgroup members step_prev, wg and trace_round).
#define ATTND_HOPPER_STEP_MEMBER mutable uint32_t step_prev = 0;
#define ATTND_HOPPER_STEP_RESET() ::attnd::kernels::hopper::trace::StepReset(wg, step_prev)
#define ATTND_HOPPER_STEP_MARK(part) \
  ::attnd::kernels::hopper::trace::StepMark(wg, step_prev, ::attnd::kernels::hopper::trace::part)
#define ATTND_HOPPER_STEP_PUT() ::attnd::kernels::hopper::trace::StepPut(wg, trace_round)

#else

#define ATTND_HOPPER_TRACE_AT(role, round, event) ((void)0)
#define ATTND_HOPPER_TRACE_GLOBAL(role, round) ((void)0)
#define ATTND_HOPPER_TRACE_VALUE(role, round, event, value) ((void)0)
#define ATTND_HOPPER_TRACE_TILE(role, round, coord) ((void)0)
#define ATTND_HOPPER_TRACE_ROUND_MEMBER
#define ATTND_HOPPER_TRACE_SET_ROUND(role_object, round) ((void)0)
#define ATTND_HOPPER_STEP_MEMBER
#define ATTND_HOPPER_STEP_RESET() ((void)0)
#define ATTND_HOPPER_STEP_MARK(part) ((void)0)
#define ATTND_HOPPER_STEP_PUT() ((void)0)

#endif
