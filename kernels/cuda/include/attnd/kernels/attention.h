// attnd::kernels — the host API of the CUDA attention kernels.
//
// Plan, then launch. Planning validates the problem, picks a configuration, encodes the TMA tensor maps and
// decides the launch schedule; launching only enqueues the kernel, so a plan can be launched any number of
// times and captured into a CUDA graph. Planning is split in steps so that a server can cache the encoded
// tensor maps (the expensive driver call) keyed on TensorMapKey:
//   Select()           validates the problem, layout and options and picks a configuration (no pointers);
//   MapKeys()          names the tensor maps the configuration needs for given pointers (Q, K, V, and O for
//                      configurations that store it with TMA);
//   EncodeTensorMap()  encodes one map;
//   MakePlanFromMaps() assembles a Plan from encoded maps and decides its schedule;
//   MakePlan()         does all of the above in one call.
// Launch(plan, workspace, stream) enqueues the kernel. Scratch memory belongs to the caller: the plan says
// how much it needs (Plan::workspace_bytes, 0 for most plans) and the caller passes it to every launch.
//
// Kernel families: "mma_sync" (TMA + ldmatrix + mma.sync; sm_90a and sm_120a) and "hopper" (wgmma,
// warp-specialised, persistent; sm_90a). Family kAuto runs the hopper family on compute capability 9.0 and the
// mma_sync family on 12.0.
// Nothing here links libcuda: the tensor-map encoder is fetched through the runtime's driver entry point, so
// binaries start (and report UNAVAILABLE) on machines without a driver.
#pragma once

#include <cuda.h>  // CUtensorMap (types only; libcuda is never linked)
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attnd/problem.h"

namespace attnd::kernels {

enum class Family { kAuto, kMmaSync, kHopper };
const char* FamilyName(Family f);

// One compiled configuration: a kernel family with one tile shape.
struct ConfigInfo {
  std::string name;        // e.g. "mma_sync_sm90_d128_m64n64s2": family, shared-memory budget, head_dim, tiles
  Family family = Family::kMmaSync;
  int head_dim = 0;
  int block_m = 0;         // query rows per block
  int block_n = 0;         // key rows per pipeline stage
  int stages = 0;          // K/V pipeline depth
  int threads = 0;         // threads per block
  size_t smem_bytes = 0;   // dynamic shared memory per block
  bool sm120 = false;      // fits sm_120's 99 KB and is compiled for sm_120a as well as sm_90a
  bool stores_o_with_tma = false;  // its epilogue stores O through a fourth tensor map (MapKeys().has_o)
  bool split_tail = false;         // hopper: compiled with the split last round (HopperScheduleOptions::split_tail)
  bool fp8 = false;                // runs float8 e4m3 problems (and only those); the others run bf16 and fp16
};

// Every configuration compiled into this library, whatever the device.
const std::vector<ConfigInfo>& Configs();
std::vector<std::string> ConfigNames();
// Configurations the given device (-1: current) can run; FAILED_PRECONDITION for an unsupported device.
absl::StatusOr<std::vector<ConfigInfo>> ConfigsForDevice(int device = -1);
// The configurations family auto can choose on the device (-1: current), float8 ones included where the device runs
// them: what a server warms up and lists.
absl::StatusOr<std::vector<ConfigInfo>> AutoConfigsForDevice(int device = -1);

// OK when this library has code for the device (compute capability 9.0 or 12.0); otherwise
// FAILED_PRECONDITION naming its compute capability, or UNAVAILABLE when there is no usable device/driver.
absl::Status CheckDevice(int device = -1);

// Everything cuTensorMapEncodeTiled takes, so a cache can be keyed on it. Dimensions innermost first:
// (head_dim, heads, seq, batch); strides in bytes for dims 1..3.
struct TensorMapKey {
  uint64_t address = 0;
  DType dtype = DType::kBF16;
  uint64_t dims[4] = {0, 0, 0, 0};
  uint64_t strides_bytes[3] = {0, 0, 0};
  uint32_t box[4] = {0, 0, 0, 0};
  uint32_t swizzle_bytes = 128;

  bool operator==(const TensorMapKey& o) const;
  bool operator!=(const TensorMapKey& o) const { return !(*this == o); }
  size_t Hash() const;
};
struct TensorMapKeyHash {
  size_t operator()(const TensorMapKey& k) const { return k.Hash(); }
};

// Encodes one tensor map (host only, no device work). UNAVAILABLE when the driver has no encoder,
// INVALID_ARGUMENT when the driver rejects the key.
absl::StatusOr<CUtensorMap> EncodeTensorMap(const TensorMapKey& key);

// Device pointers of one call. lse (fp32 [batch, q_heads, q_len], natural log) only when want_lse.
// Float8 problems (DType::kFP8E4M3; docs/kernels.md, "Float8 forward"): Q, K and V hold e4m3 codes, O is bf16, and
// element x of a head is read as Fp8E4M3ToFloat(x) * that head's descale: q_descale has q_heads fp32 values,
// k_descale and v_descale kv_heads each (finite and > 0; a per-tensor scale repeats its value). v_t is the caller's
// scratch of VTransposedBytes(shape) bytes into which every launch first writes V transposed for the P V GEMM.
struct DeviceTensors {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* o = nullptr;
  float* lse = nullptr;
  const float* q_descale = nullptr;
  const float* k_descale = nullptr;
  const float* v_descale = nullptr;
  void* v_t = nullptr;
};

// Bytes of DeviceTensors::v_t a float8 problem of this shape needs (0 for other element types): V as
// [batch, kv_heads, head_dim, kv_len rounded up to 32], keys contiguous.
int64_t VTransposedBytes(const Shape& shape, DType dtype);

// How the hopper family's persistent blocks share out the tiles (docs/kernels.md, "Scheduler"). The defaults
// are the tuned schedule; the other values exist for tests (few blocks, forced split tails) and tuning runs.
enum class SplitTail {
  kOff,     // every tile runs whole
  kAuto,    // the last round's tiles are shared out by key blocks where that pays (long rows, idle blocks)
  kAlways,  // wherever the shape allows it (tests: small problems on a few blocks exercise the split path)
};
enum class CausalOrder {
  kDynamic,  // causal head_dim 64 with enough tiles per block: blocks take tiles from a counter as they free up
  kStatic,   // tiles fixed by block index and round (longest first, or in pairs)
};
struct HopperScheduleOptions {
  int max_blocks = 0;  // cap on the persistent grid; 0: one block per SM
  SplitTail split_tail = SplitTail::kAuto;
  CausalOrder causal_order = CausalOrder::kDynamic;
  int64_t l2_section_bytes = int64_t{12} << 20;  // K + V bytes one section of heads may span; <= 0: one section
  int64_t paired_kv_bytes = int64_t{32} << 20;   // causal problems whose K + V exceed this run in pairs; < 0: never
  int max_paired_q_tiles = 16;           // causal problems with at most this many q tiles per head run in pairs
  int tail_tiles_per_block = 8;          // dynamic order: the last section's length, in longest tiles per block
  int dynamic_min_tiles_per_block = 6;   // the dynamic order needs at least this many tiles per block
};

struct PlanOptions {
  Family family = Family::kAuto;  // kAuto: the fastest family and configuration built for the device
  std::string config;             // a name from ConfigNames(); overrides family
  int device = -1;                // -1: the current device
  HopperScheduleOptions hopper;   // ignored by the mma_sync family
};

// A validated problem with its chosen configuration; cheap to copy, holds no pointers.
struct Selection {
  Problem problem;
  Layout layout;
  int config = -1;  // index into Configs()
  int device = 0;
  HopperScheduleOptions hopper;  // PlanOptions::hopper, validated
  const ConfigInfo& info() const { return Configs()[config]; }
};

struct TensorMapKeys {
  TensorMapKey q, k, v;
  // Configurations that store O with TMA (their epilogue goes through shared memory) need a map of O as well.
  bool has_o = false;
  TensorMapKey o;
};

// The kernel's scalar arguments (shared with the device code, so plain data only).
struct LaunchParams {
  void* o = nullptr;
  float* lse = nullptr;
  int64_t o_stride_b = 0, o_stride_s = 0, o_stride_h = 0;  // elements
  int q_len = 0, kv_len = 0, q_heads = 0, kv_heads = 0, group = 1;
  int causal = 0;         // 1: query row i sees keys <= i + causal_offset
  int causal_offset = 0;  // 0: top-left; kv_len - q_len: bottom-right
  int num_q_tiles = 0;
  float scale_log2 = 0;   // softmax scale * log2(e): the kernel works in the exp2 domain
  int batch = 0;
  int section = 1;        // causal block order: (head, batch) pairs per L2-sized section (mma_sync family)
  // Float8 problems: the descales of DeviceTensors (the kernel scales S by q * k's and O by v's); null otherwise.
  const float* q_descale = nullptr;
  const float* k_descale = nullptr;
  const float* v_descale = nullptr;
};

// Float8 plans: the transpose that runs before the attention kernel, V [batch, kv_len, kv_heads, head_dim] (strides
// in elements) into DeviceTensors::v_t as [batch, kv_heads, head_dim, kv_len_padded], every 32 keys in the order
// the kernel's P fragments hold them (docs/kernels.md, "Float8 forward").
struct VTransposeParams {
  const void* v = nullptr;
  void* v_t = nullptr;
  int64_t v_stride_b = 0, v_stride_s = 0, v_stride_h = 0;
  int kv_len = 0, kv_len_padded = 0, kv_heads = 0, head_dim = 0, batch = 0;
};

// What a launch runs, decided when the plan is made; the family's launcher reads it and nothing else does.
// The mma_sync family launches one block per tile (Plan::grid) and leaves it empty.
struct LaunchSchedule {
  static constexpr size_t kNoOffset = ~size_t{0};
  int blocks = 0;           // hopper: the persistent grid, at most one block per SM (HopperScheduleOptions)
  int order = 0;            // hopper: hopper::ScheduleOrder (static, paired or dynamic)
  bool split_tail = false;  // hopper: the last round's tiles shared out by key blocks
  // hopper: where the launch's scratch lies in the workspace (256-byte aligned), kNoOffset when unused: the
  // dynamic order's tile counters, and the split tail's per-tile counters and partial outputs.
  size_t tile_counters = kNoOffset, split_counters = kNoOffset, split_partials = kNoOffset;
  // hopper: hopper::SchedulerParams (tile_scheduler_sm90.cuh) with null workspace pointers, which the launch fills
  // in. Raw storage so that the scheduler's fields stay the device code's alone.
  alignas(8) unsigned char scheduler[128] = {};
};

// Everything Launch needs; built once, launched any number of times (the pointers are baked in).
struct Plan {
  int config = -1;
  int device = 0;
  DType dtype = DType::kBF16;
  unsigned grid[3] = {1, 1, 1};  // the tile space: (q tiles, q heads, batch)
  CUtensorMap q_map{}, k_map{}, v_map{};
  CUtensorMap o_map{};  // only for configurations whose MapKeys have has_o
  LaunchParams params;
  VTransposeParams v_transpose;  // float8 plans only (v_map then maps DeviceTensors::v_t)
  LaunchSchedule schedule;
  // Device memory each launch needs besides the tensors (0: none). The caller owns it: zeroed once before its
  // first launch (ZeroWorkspace), and every launch leaves it zero again. One workspace serves one launch at a
  // time: launches that may run concurrently (other streams, graph replays in flight) need one each.
  size_t workspace_bytes = 0;
  const ConfigInfo& info() const { return Configs()[config]; }
};

absl::StatusOr<Selection> Select(const Problem& problem, const Layout& layout, const PlanOptions& options = {});
absl::StatusOr<TensorMapKeys> MapKeys(const Selection& selection, const DeviceTensors& tensors);
// o_map: MapKeys().o encoded; required when MapKeys().has_o (INVALID_ARGUMENT naming o without it), else ignored.
absl::StatusOr<Plan> MakePlanFromMaps(const Selection& selection, const DeviceTensors& tensors,
                                      const CUtensorMap& q_map, const CUtensorMap& k_map,
                                      const CUtensorMap& v_map, const CUtensorMap* o_map = nullptr);
absl::StatusOr<Plan> MakePlan(const Problem& problem, const Layout& layout, const DeviceTensors& tensors,
                              const PlanOptions& options = {});

// Zeroes `workspace` (plan.workspace_bytes of device memory) on `stream`; needed once before its first launch.
absl::Status ZeroWorkspace(const Plan& plan, void* workspace, cudaStream_t stream);

// Enqueues the kernel on `stream` (which must belong to plan.device, the current device). `workspace`: at least
// plan.workspace_bytes of device memory, 256-byte aligned and zero (see Plan::workspace_bytes); may be null when
// the plan needs none, else INVALID_ARGUMENT. Checks the launch error; asynchronous execution errors surface at
// the caller's next synchronisation.
absl::Status Launch(const Plan& plan, void* workspace, cudaStream_t stream);

}  // namespace attnd::kernels
