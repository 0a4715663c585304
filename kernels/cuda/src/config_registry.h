// The table of compiled kernel configurations: what each is (shape, budget) and how to launch it.
// Each fwd_*.cu contributes the entries of its tile shapes; AllEntries() gathers them in a fixed order.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attnd/kernels/attention.h"

namespace attnd::kernels {

// Enqueues the plan's kernel; `workspace` holds plan.workspace_bytes (or is null when that is 0).
using LaunchFn = cudaError_t (*)(const Plan& plan, void* workspace, cudaStream_t stream);
using PrepareFn = cudaError_t (*)();
// Decides plan->schedule and plan->workspace_bytes for a device of `sms` multiprocessors (host arithmetic only).
using PlanScheduleFn = void (*)(const HopperScheduleOptions& options, int sms, Plan* plan);

struct KernelEntry {
  const char* name;
  Family family;
  int head_dim, block_m, block_n, stages, threads;
  size_t smem_bytes;
  bool sm120;
  LaunchFn launch[3];    // by DType: bf16, fp16, fp8 e4m3; null for the element types the configuration does not run
  PrepareFn prepare[3];  // raises the dynamic shared-memory limit; once per device
  PlanScheduleFn plan_schedule = nullptr;  // hopper: the persistent schedule; null: one block per tile, no workspace
  int o_box_rows = 0;    // > 0: O is stored through a tensor map (Plan::o_map) in boxes of this many rows
  bool split_tail = false;  // hopper: compiled with the split last round (MaySplitTail in flash_fwd_launch_sm90.cuh)
  bool fp8 = false;         // runs float8 e4m3 problems only (launch[2]); the others run bf16 and fp16
};

struct EntryList {
  const KernelEntry* entries;
  int count;
};

// The list over an instantiation file's static table.
template <size_t N>
constexpr EntryList ListOf(const KernelEntry (&entries)[N]) {
  return {entries, static_cast<int>(N)};
}

// The fields of an entry that come from its tile shape, with its launch and prepare functions by DType (bf16,
// fp16); the family's Entry<Tile> sets what else it has.
template <typename Tile>
constexpr KernelEntry TileEntry(const char* name, Family family, LaunchFn bf16, LaunchFn fp16,
                                PrepareFn prepare_bf16, PrepareFn prepare_fp16) {
  return KernelEntry{name, family, Tile::kHeadDim, Tile::kBlockM, Tile::kBlockN, Tile::kStages, Tile::kThreads,
                     Tile::kSmemBytes, false, {bf16, fp16, nullptr}, {prepare_bf16, prepare_fp16, nullptr}};
}

namespace mma_sync {
EntryList Sm120D64Entries();
EntryList Sm120D128Entries();
EntryList Sm120D256Entries();
EntryList Sm90D64Entries();
EntryList Sm90D128Entries();
}  // namespace mma_sync

namespace hopper {  // src/hopper/attention_sm90_d*.cu (sm_90a only)
EntryList Sm90D64Entries();
EntryList Sm90D128Entries();
EntryList Sm90D256Entries();
}  // namespace hopper

const std::vector<KernelEntry>& AllEntries();

// The hopper family's tuned configuration for a problem (plan.cc; Select() runs it on compute capability 9.0, for
// family auto or hopper). Declared here so that host tests can check its choices against the entries above.
const char* DefaultHopperConfig(const Problem& p);

// INVALID_ARGUMENT naming the field (options.hopper.*) when a schedule option is out of range.
absl::Status CheckHopperOptions(const HopperScheduleOptions& options);

// What planning reads of the device.
struct DeviceLimits {
  int sms = 0;       // multiprocessors
  int l2_bytes = 0;  // L2 cache size
};

// MakePlanFromMaps without the device: checks the pointers, fills the launch parameters and decides the schedule
// and workspace for a device with `limits`. No CUDA call, so host tests plan for a device they do not have.
absl::StatusOr<Plan> AssemblePlan(const Selection& selection, const DeviceTensors& tensors, const CUtensorMap& q_map,
                                  const CUtensorMap& k_map, const CUtensorMap& v_map, const CUtensorMap* o_map,
                                  const DeviceLimits& limits);

}  // namespace attnd::kernels
