// attnd::kernels — the host API of the CUDA attention kernels.
//
// Two steps, so a server can keep encoded tensor maps in a cache and launch with nothing but the launch on
// the hot path:
//   1. Select()          validates the problem and layout and picks a configuration (no device pointers);
//      MapKeys()         names the TMA tensor maps the configuration needs for given pointers (Q, K, V, and O
//                        for configurations that store it with TMA);
//      EncodeTensorMap() encodes one map (the expensive driver call; cache it keyed on TensorMapKey);
//      MakePlanFromMaps() assembles a Plan from already-encoded maps.
//      MakePlan()        does all of the above in one call.
//   2. Launch(plan, stream) enqueues the kernel; it does no host work beyond the launch itself.
//
// Kernel families: "seed" (TMA + ldmatrix + mma.sync, the design of ../shared/seed) is built now;
// "hopper" (wgmma) plugs in behind the same API later and answers UNIMPLEMENTED until then.
// Nothing here links libcuda: the tensor-map encoder is fetched through the runtime's driver entry point,
// so binaries start (and report UNAVAILABLE) on machines without a driver.
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

enum class Family { kAuto, kSeed, kHopper };
const char* FamilyName(Family f);

// One compiled configuration: a kernel family with one tile shape.
struct ConfigInfo {
  std::string name;        // e.g. "seed_sm90_d128_m64n64s2": family, shared-memory budget, head_dim, tiles
  Family family = Family::kSeed;
  int head_dim = 0;
  int block_m = 0;         // query rows per block
  int block_n = 0;         // key rows per pipeline stage
  int stages = 0;          // K/V pipeline depth
  int threads = 0;         // threads per block
  size_t smem_bytes = 0;   // dynamic shared memory per block
  bool sm120 = false;      // fits sm_120's 99 KB and is compiled for sm_120a as well as sm_90a
  bool stores_o_with_tma = false;  // its epilogue stores O through a fourth tensor map (MapKeys().has_o)
};

// Every configuration compiled into this library, whatever the device.
const std::vector<ConfigInfo>& Configs();
std::vector<std::string> ConfigNames();
// Configurations the given device (-1: current) can run; FAILED_PRECONDITION for an unsupported device.
absl::StatusOr<std::vector<ConfigInfo>> ConfigsForDevice(int device = -1);

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
struct DeviceTensors {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* o = nullptr;
  float* lse = nullptr;
};

struct PlanOptions {
  Family family = Family::kAuto;  // kAuto: the fastest family and configuration built for the device
  std::string config;             // a name from ConfigNames(); overrides family
  int device = -1;                // -1: the current device
};

// A validated problem with its chosen configuration; cheap to copy, holds no pointers.
struct Selection {
  Problem problem;
  Layout layout;
  int config = -1;  // index into Configs()
  int device = 0;
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
  int section = 1;        // causal block order: (head, batch) pairs per L2-sized section (seed family)
};

// Everything Launch needs; built once, launched any number of times (the pointers are baked in).
struct Plan {
  int config = -1;
  int device = 0;
  DType dtype = DType::kBF16;
  unsigned grid[3] = {1, 1, 1};
  CUtensorMap q_map{}, k_map{}, v_map{};
  CUtensorMap o_map{};  // only for configurations whose MapKeys have has_o
  LaunchParams params;
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

// Enqueues the kernel on `stream` (which must belong to plan.device, the current device). Checks the
// launch error; asynchronous execution errors surface at the caller's next synchronisation.
absl::Status Launch(const Plan& plan, cudaStream_t stream);

}  // namespace attnd::kernels
