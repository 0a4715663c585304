// Host side: device checks, validation, configuration choice, tensor-map keys, plans and the launch.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <mutex>
#include <set>
#include <tuple>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "attnd/kernels/attention.h"
#include "config_registry.h"

namespace attnd::kernels {

const char* FamilyName(Family f) {
  switch (f) {
    case Family::kAuto: return "auto";
    case Family::kMmaSync: return "mma_sync";
    case Family::kHopper: return "hopper";
  }
  return "?";
}

const std::vector<ConfigInfo>& Configs() {
  static const std::vector<ConfigInfo> kConfigs = [] {
    std::vector<ConfigInfo> out;
    for (const KernelEntry& e : AllEntries()) {
      out.push_back(ConfigInfo{e.name, e.family, e.head_dim, e.block_m, e.block_n, e.stages, e.threads,
                               e.smem_bytes, e.sm120, e.o_box_rows > 0, e.split_tail, e.fp8});
    }
    return out;
  }();
  return kConfigs;
}

std::vector<std::string> ConfigNames() {
  std::vector<std::string> names;
  for (const ConfigInfo& c : Configs()) names.push_back(c.name);
  return names;
}

int64_t VTransposedBytes(const Shape& s, DType dtype) {
  if (dtype != DType::kFP8E4M3) return 0;
  return s.batch * s.kv_heads * s.head_dim * ((s.kv_len + 31) / 32 * 32);
}

namespace {

struct DeviceCaps {
  int device = 0;  // the index, resolved
  int major = 0, minor = 0;
  int smem_optin = 0;
  int sms = 0;
};

absl::StatusOr<int> ResolveDevice(int device) {
  if (device >= 0) return device;
  int current = 0;
  const cudaError_t err = cudaGetDevice(&current);
  if (err != cudaSuccess) return absl::UnavailableError(absl::StrCat("no CUDA device: ", cudaGetErrorString(err)));
  return current;
}

absl::StatusOr<DeviceCaps> Caps(int device) {
  DeviceCaps caps;
  caps.device = device;
  cudaError_t err = cudaDeviceGetAttribute(&caps.major, cudaDevAttrComputeCapabilityMajor, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&caps.minor, cudaDevAttrComputeCapabilityMinor, device);
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&caps.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  }
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&caps.sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) {
    return absl::UnavailableError(absl::StrCat("CUDA device ", device, " is not usable: ", cudaGetErrorString(err)));
  }
  return caps;
}

bool Runs(const KernelEntry& e, const DeviceCaps& caps) {
  if (caps.major == 9 && caps.minor == 0) return static_cast<int>(e.smem_bytes) <= caps.smem_optin;
  if (caps.major == 12 && caps.minor == 0) return e.sm120 && static_cast<int>(e.smem_bytes) <= caps.smem_optin;
  return false;
}

// The mma.sync family's tuned choice (docs/tuning.md). On the H200 the 32-rows-a-warp shapes ("w4": half
// the shared-memory reads per mma) win once 128-row blocks fill two per SM; smaller problems run faster on 64-row
// blocks of 16-row warps (twice the blocks). At d=64 the 64-row shape also wins below 2k.
const char* DefaultConfig(const DeviceCaps& caps, const Problem& p) {
  const Shape& s = p.shape;
  if (caps.major == 9) {
    const int64_t blocks128 = (s.q_len + 127) / 128 * s.q_heads * s.batch;
    const bool fills = blocks128 >= 2 * static_cast<int64_t>(caps.sms);
    switch (s.head_dim) {
      case 64:
        return fills && s.q_len >= 2048 ? "mma_sync_sm90_d64_m128n64s2w4" : "mma_sync_sm120_d64_m64n64s2";
      case 128:
        return fills ? "mma_sync_sm90_d128_m128n64s2w4" : "mma_sync_sm90_d128_m64n64s2";
      case 256:  // 96 KB single-stage blocks, two per SM, beat the 2-stage shape (one per SM) on every row
        return "mma_sync_sm120_d256_m64n64s1";
    }
  } else {
    switch (s.head_dim) {
      case 64: return "mma_sync_sm120_d64_m64n64s2";
      case 128: return "mma_sync_sm120_d128_m64n64s1";
      case 256: return "mma_sync_sm120_d256_m64n64s1";
    }
  }
  return nullptr;
}

}  // namespace

// The hopper family's tuned choice (docs/tuning.md). head_dim 64: the 128-row six-stage `_p2` below 2k queries
// without a mask, else the 192-row `_wrs` (three consumer warpgroups, each skipping the key blocks its rows do not
// see); head_dim 128: the three-stage `_osk_p2` at every length; head_dim 256: 128x64, two stages. Float8: the `_fp8`
// shape of the head dim (128 and 256 only).
const char* DefaultHopperConfig(const Problem& p) {
  if (p.dtype == DType::kFP8E4M3) {
    switch (p.shape.head_dim) {
      case 128: return "hopper_sm90_d128_fp8_m128n128s6_osk_p2";
      case 256: return "hopper_sm90_d256_fp8_m128n128s2";
    }
    return nullptr;
  }
  switch (p.shape.head_dim) {
    case 64:
      return p.mask == Mask::kNone && p.shape.q_len < 2048 ? "hopper_sm90_d64_m128n128s6_p2"
                                                           : "hopper_sm90_d64_m192n128s4_wrs";
    case 128: return "hopper_sm90_d128_m128n128s3_osk_p2";
    case 256: return "hopper_sm90_d256_m128n64s2";
  }
  return nullptr;
}

absl::Status CheckHopperOptions(const HopperScheduleOptions& o) {
  const struct {
    const char* name;
    int64_t value;
  } counts[] = {{"max_blocks", o.max_blocks},
                {"max_paired_q_tiles", o.max_paired_q_tiles},
                {"tail_tiles_per_block", o.tail_tiles_per_block},
                {"dynamic_min_tiles_per_block", o.dynamic_min_tiles_per_block}};
  for (const auto& c : counts) {
    if (c.value < 0) {
      return absl::InvalidArgumentError(absl::StrCat("options.hopper.", c.name, " must be >= 0, got ", c.value));
    }
  }
  // Bounds that keep the scheduler's 32-bit tile arithmetic exact.
  if (o.tail_tiles_per_block > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("options.hopper.tail_tiles_per_block must be <= 1024, got ", o.tail_tiles_per_block));
  }
  if (o.dynamic_min_tiles_per_block > (1 << 20)) {
    return absl::InvalidArgumentError(absl::StrCat("options.hopper.dynamic_min_tiles_per_block must be <= 2^20, got ",
                                                   o.dynamic_min_tiles_per_block));
  }
  if (o.split_tail != SplitTail::kOff && o.split_tail != SplitTail::kAuto && o.split_tail != SplitTail::kAlways) {
    return absl::InvalidArgumentError("options.hopper.split_tail is not a SplitTail value");
  }
  if (o.causal_order != CausalOrder::kDynamic && o.causal_order != CausalOrder::kStatic) {
    return absl::InvalidArgumentError("options.hopper.causal_order is not a CausalOrder value");
  }
  return absl::OkStatus();
}

namespace {

// Raises each kernel's dynamic shared-memory limit once per device (a planning-time cost, not a launch one).
absl::Status Prepare(int entry, DType dtype, int device) {
  static std::mutex mu;
  static std::set<std::tuple<int, int, int>> done;
  const auto key = std::make_tuple(entry, static_cast<int>(dtype), device);
  std::lock_guard<std::mutex> lock(mu);
  if (done.count(key)) return absl::OkStatus();
  const KernelEntry& e = AllEntries()[entry];
  const PrepareFn prepare = e.prepare[static_cast<int>(dtype)];
  if (prepare == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("kernel configuration ", e.name, " does not run ", DTypeName(dtype)));
  }
  const cudaError_t err = prepare();
  if (err != cudaSuccess) {
    return absl::InternalError(
        absl::StrCat("cudaFuncSetAttribute(", e.name, ", ", e.smem_bytes, " bytes): ", cudaGetErrorString(err)));
  }
  done.insert(key);
  return absl::OkStatus();
}

// Strides in elements of `elem_bytes` each; TMA and the 16-byte stores want them multiples of 16 bytes.
absl::Status CheckStrides(const char* tensor, const Strides& st, int64_t seq_len, int64_t heads, bool output,
                          int64_t elem_bytes) {
  const struct {
    const char* name;
    int64_t stride, extent;
  } dims[] = {{"batch", st.batch, 2}, {"seq", st.seq, seq_len}, {"head", st.head, heads}};
  for (const auto& d : dims) {
    if (d.extent <= 1 && std::string(d.name) != "batch") continue;  // a size-1 dim's stride is never used
    if (d.stride < 0 || (output && d.stride == 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("layout.", tensor, ".", d.name, " stride ", d.stride, " must be positive"));
    }
    if ((d.stride * elem_bytes) % 16 != 0) {
      return absl::InvalidArgumentError(absl::StrCat("layout.", tensor, ".", d.name, " stride ", d.stride,
                                                     " is not a multiple of ", 16 / elem_bytes,
                                                     " elements (16 bytes), which the kernel's TMA loads and "
                                                     "16-byte stores require"));
    }
    if (d.stride >= (int64_t{1} << 39)) {
      return absl::InvalidArgumentError(absl::StrCat("layout.", tensor, ".", d.name, " stride ", d.stride, " is too large"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateProblem(const Problem& p, const Layout& layout) {
  const Shape& s = p.shape;
  const struct {
    const char* name;
    int64_t value, max;
  } fields[] = {{"batch", s.batch, 65535},
                {"q_len", s.q_len, std::numeric_limits<int32_t>::max() / 2},
                {"kv_len", s.kv_len, std::numeric_limits<int32_t>::max() / 2},
                {"q_heads", s.q_heads, 65535},
                {"kv_heads", s.kv_heads, 65535},
                {"head_dim", s.head_dim, 256}};
  for (const auto& f : fields) {
    if (f.value <= 0) return absl::InvalidArgumentError(absl::StrCat("shape.", f.name, " must be > 0, got ", f.value));
    if (f.value > f.max) {
      return absl::InvalidArgumentError(absl::StrCat("shape.", f.name, " ", f.value, " exceeds the limit ", f.max));
    }
  }
  if (!IsSupportedHeadDim(s.head_dim)) {
    return absl::InvalidArgumentError(absl::StrCat("shape.head_dim ", s.head_dim, " is not supported (supported: ",
                                                   absl::StrJoin(kHeadDims, ", "), ")"));
  }
  if (s.q_heads % s.kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("shape.q_heads (", s.q_heads,
                                                   ") must be a multiple of shape.kv_heads (", s.kv_heads, ")"));
  }
  if (!std::isfinite(p.scale)) return absl::InvalidArgumentError("scale must be finite");
  if (p.dtype != DType::kBF16 && p.dtype != DType::kFP16 && p.dtype != DType::kFP8E4M3) {
    return absl::InvalidArgumentError("dtype is not supported");
  }
  const int64_t eb = DTypeBytes(p.dtype), out_eb = DTypeBytes(OutputDType(p.dtype));
  if (auto st = CheckStrides("q", layout.q, s.q_len, s.q_heads, false, eb); !st.ok()) return st;
  if (auto st = CheckStrides("k", layout.k, s.kv_len, s.kv_heads, false, eb); !st.ok()) return st;
  if (auto st = CheckStrides("v", layout.v, s.kv_len, s.kv_heads, false, eb); !st.ok()) return st;
  if (auto st = CheckStrides("o", layout.o, s.q_len, s.q_heads, true, out_eb); !st.ok()) return st;
  return absl::OkStatus();
}

// A size-1 dimension's stride is never stepped over, but TMA still wants it a multiple of 16 bytes.
uint64_t StrideBytes(int64_t stride, int64_t extent, uint64_t fallback_bytes, int64_t elem_bytes) {
  return extent <= 1 ? fallback_bytes : static_cast<uint64_t>(stride * elem_bytes);
}

TensorMapKey KeyFor(const void* ptr, DType dtype, const Strides& st, int64_t seq_len, int64_t heads, int64_t batch,
                    int64_t head_dim, int box_rows) {
  const int64_t eb = DTypeBytes(dtype);
  TensorMapKey key;
  key.address = reinterpret_cast<uint64_t>(ptr);
  key.dtype = dtype;
  key.dims[0] = static_cast<uint64_t>(head_dim);
  key.dims[1] = static_cast<uint64_t>(heads);
  key.dims[2] = static_cast<uint64_t>(seq_len);
  key.dims[3] = static_cast<uint64_t>(batch);
  const uint64_t row_bytes = static_cast<uint64_t>(head_dim * eb);
  key.strides_bytes[0] = StrideBytes(st.head, heads, row_bytes, eb);
  key.strides_bytes[1] = StrideBytes(st.seq, seq_len, row_bytes * heads, eb);
  key.strides_bytes[2] = StrideBytes(st.batch, batch, row_bytes * heads * seq_len, eb);
  // One box is a 128-byte panel (64 16-bit or 128 float8 elements) of box_rows rows of one head of one sequence.
  key.box[0] = static_cast<uint32_t>(128 / eb);
  key.box[1] = 1;
  key.box[2] = static_cast<uint32_t>(box_rows);
  key.box[3] = 1;
  key.swizzle_bytes = 128;
  return key;
}

// The float8 V^T of DeviceTensors::v_t: [batch, kv_heads, head_dim, kv_len rounded up to 32] bytes, one box a
// head_dim x 128-key stage (fp8_sm90.cuh).
TensorMapKey TransposedVKey(const void* v_t, const Shape& s) {
  const uint64_t keys = static_cast<uint64_t>((s.kv_len + 31) / 32 * 32);
  TensorMapKey key;
  key.address = reinterpret_cast<uint64_t>(v_t);
  key.dtype = DType::kFP8E4M3;
  key.dims[0] = keys;
  key.dims[1] = static_cast<uint64_t>(s.head_dim);
  key.dims[2] = static_cast<uint64_t>(s.kv_heads);
  key.dims[3] = static_cast<uint64_t>(s.batch);
  key.strides_bytes[0] = keys;
  key.strides_bytes[1] = keys * static_cast<uint64_t>(s.head_dim);
  key.strides_bytes[2] = keys * static_cast<uint64_t>(s.head_dim * s.kv_heads);
  key.box[0] = 128;
  key.box[1] = static_cast<uint32_t>(s.head_dim);
  key.box[2] = 1;
  key.box[3] = 1;
  key.swizzle_bytes = 128;
  return key;
}

absl::Status CheckPointer(const char* name, const void* ptr, uintptr_t alignment = 16) {
  if (ptr == nullptr) return absl::InvalidArgumentError(absl::StrCat(name, " pointer is null"));
  if (reinterpret_cast<uintptr_t>(ptr) % alignment != 0) {
    return absl::InvalidArgumentError(absl::StrCat(name, " pointer is not ", alignment, "-byte aligned"));
  }
  return absl::OkStatus();
}

// Float8 problems' extra tensors: the descales (fp32) and V^T's scratch.
absl::Status CheckFp8Pointers(const DeviceTensors& t) {
  if (absl::Status st = CheckPointer("q_descale", t.q_descale, 4); !st.ok()) return st;
  if (absl::Status st = CheckPointer("k_descale", t.k_descale, 4); !st.ok()) return st;
  if (absl::Status st = CheckPointer("v_descale", t.v_descale, 4); !st.ok()) return st;
  return CheckPointer("v_t", t.v_t);
}

// The capabilities of `device` (-1: the current one), or why attnd's kernels cannot run on it.
absl::StatusOr<DeviceCaps> SupportedDevice(int device) {
  absl::StatusOr<int> dev = ResolveDevice(device);
  if (!dev.ok()) return dev.status();
  absl::StatusOr<DeviceCaps> caps = Caps(*dev);
  if (!caps.ok()) return caps.status();
  const bool ok = (caps->major == 9 && caps->minor == 0) || (caps->major == 12 && caps->minor == 0);
  if (!ok) {
    return absl::FailedPreconditionError(absl::StrCat("CUDA device ", *dev, " has compute capability ", caps->major,
                                                      ".", caps->minor,
                                                      "; attnd's kernels are built for sm_90a (9.0) and sm_120a "
                                                      "(12.0) only"));
  }
  return caps;
}

}  // namespace

absl::Status CheckDevice(int device) { return SupportedDevice(device).status(); }

absl::StatusOr<std::vector<ConfigInfo>> ConfigsForDevice(int device) {
  absl::StatusOr<DeviceCaps> caps = SupportedDevice(device);
  if (!caps.ok()) return caps.status();
  std::vector<ConfigInfo> out;
  for (size_t i = 0; i < AllEntries().size(); ++i) {
    if (Runs(AllEntries()[i], *caps)) out.push_back(Configs()[i]);
  }
  return out;
}

namespace {

// Family auto's choice: the wgmma family on Hopper (ahead of the mma.sync family on every measured row,
// docs/benchmarks.md), the mma.sync family's tuned choice elsewhere.
const char* AutoConfig(const DeviceCaps& caps, const Problem& p) {
  return caps.major == 9 && caps.minor == 0 ? DefaultHopperConfig(p) : DefaultConfig(caps, p);
}

}  // namespace

absl::StatusOr<std::vector<ConfigInfo>> AutoConfigsForDevice(int device) {
  absl::StatusOr<DeviceCaps> caps = SupportedDevice(device);
  if (!caps.ok()) return caps.status();
  // The rules branch on head_dim, the mask, q_len and how many blocks a problem fills: the extremes of each
  // reach every branch.
  // Float8 problems too, where the device runs them (the hopper family).
  std::vector<DType> dtypes = {DType::kBF16};
  if (caps->major == 9 && caps->minor == 0) dtypes.push_back(DType::kFP8E4M3);
  std::set<std::string> names;
  for (DType dtype : dtypes) {
    for (int64_t head_dim : kHeadDims) {
      for (Mask mask : {Mask::kNone, Mask::kCausalTopLeft, Mask::kCausalBottomRight}) {
        for (int64_t q_len : {int64_t{1}, int64_t{1} << 20}) {
          for (int64_t batch : {int64_t{1}, int64_t{1} << 12}) {
            Problem p;
            p.shape = Shape{batch, q_len, q_len, 1, 1, head_dim};
            p.dtype = dtype;
            p.mask = mask;
            if (const char* name = AutoConfig(*caps, p)) names.insert(name);
          }
        }
      }
    }
  }
  std::vector<ConfigInfo> out;
  for (const ConfigInfo& c : Configs()) {
    if (names.count(c.name)) out.push_back(c);
  }
  return out;
}

absl::StatusOr<Selection> Select(const Problem& problem, const Layout& layout, const PlanOptions& options) {
  if (absl::Status st = ValidateProblem(problem, layout); !st.ok()) return st;
  if (absl::Status st = CheckHopperOptions(options.hopper); !st.ok()) return st;
  absl::StatusOr<DeviceCaps> caps = SupportedDevice(options.device);
  if (!caps.ok()) return caps.status();

  const std::vector<KernelEntry>& entries = AllEntries();
  int chosen = -1;
  if (!options.config.empty()) {
    for (size_t i = 0; i < entries.size(); ++i) {
      if (options.config == entries[i].name) chosen = static_cast<int>(i);
    }
    if (chosen < 0) {
      return absl::InvalidArgumentError(absl::StrCat("kernel configuration '", options.config,
                                                     "' is unknown; known: ", absl::StrJoin(ConfigNames(), ", ")));
    }
    if (entries[chosen].head_dim != problem.shape.head_dim) {
      return absl::InvalidArgumentError(absl::StrCat("kernel configuration ", options.config, " is for head_dim ",
                                                     entries[chosen].head_dim, ", the problem has shape.head_dim ",
                                                     problem.shape.head_dim));
    }
    if (entries[chosen].fp8 != (problem.dtype == DType::kFP8E4M3)) {
      return absl::InvalidArgumentError(absl::StrCat("kernel configuration ", options.config, " does not run ",
                                                     DTypeName(problem.dtype), " problems"));
    }
    if (!Runs(entries[chosen], *caps)) {
      return absl::FailedPreconditionError(absl::StrCat("kernel configuration ", options.config,
                                                        " cannot run on device ", caps->device, " (compute capability ",
                                                        caps->major, ".", caps->minor, ")"));
    }
  } else {
    if (problem.dtype == DType::kFP8E4M3) {
      if (options.family == Family::kMmaSync || caps->major != 9 || caps->minor != 0) {
        const char* family = options.family == Family::kMmaSync ? ", family mma_sync" : "";
        return absl::FailedPreconditionError(absl::StrCat("float8 e4m3 runs on the hopper (wgmma) family, compute "
                                                          "capability 9.0; device ", caps->device, " has ",
                                                          caps->major, ".", caps->minor, family));
      }
      if (DefaultHopperConfig(problem) == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat("shape.head_dim ", problem.shape.head_dim,
                                                       " is not supported for float8 e4m3 (supported: 128, 256)"));
      }
    }
    const char* name = DefaultConfig(*caps, problem);
    if (options.family == Family::kHopper) {
      if (caps->major != 9 || caps->minor != 0) {
        return absl::FailedPreconditionError(absl::StrCat("the hopper (wgmma) kernel family needs compute capability "
                                                          "9.0; device ", caps->device, " has ", caps->major, ".",
                                                          caps->minor));
      }
      name = DefaultHopperConfig(problem);
    } else if (options.family == Family::kAuto) {
      name = AutoConfig(*caps, problem);
    }
    for (size_t i = 0; name != nullptr && i < entries.size(); ++i) {
      if (std::string(name) == entries[i].name) chosen = static_cast<int>(i);
    }
    if (chosen < 0) return absl::InternalError("no default kernel configuration for this head_dim");
  }
  Selection sel;
  sel.problem = problem;
  sel.layout = layout;
  sel.config = chosen;
  sel.device = caps->device;
  sel.hopper = options.hopper;
  return sel;
}

absl::StatusOr<TensorMapKeys> MapKeys(const Selection& sel, const DeviceTensors& t) {
  if (absl::Status st = CheckPointer("q", t.q); !st.ok()) return st;
  if (absl::Status st = CheckPointer("k", t.k); !st.ok()) return st;
  if (absl::Status st = CheckPointer("v", t.v); !st.ok()) return st;
  const Shape& s = sel.problem.shape;
  const KernelEntry& e = AllEntries()[sel.config];
  TensorMapKeys keys;
  keys.q = KeyFor(t.q, sel.problem.dtype, sel.layout.q, s.q_len, s.q_heads, s.batch, s.head_dim, e.block_m);
  keys.k = KeyFor(t.k, sel.problem.dtype, sel.layout.k, s.kv_len, s.kv_heads, s.batch, s.head_dim, e.block_n);
  if (e.fp8) {
    if (absl::Status st = CheckFp8Pointers(t); !st.ok()) return st;
    keys.v = TransposedVKey(t.v_t, s);
  } else {
    keys.v = KeyFor(t.v, sel.problem.dtype, sel.layout.v, s.kv_len, s.kv_heads, s.batch, s.head_dim, e.block_n);
  }
  if (e.o_box_rows > 0) {
    if (absl::Status st = CheckPointer("o", t.o); !st.ok()) return st;
    keys.has_o = true;
    keys.o = KeyFor(t.o, OutputDType(sel.problem.dtype), sel.layout.o, s.q_len, s.q_heads, s.batch, s.head_dim,
                    e.o_box_rows);
  }
  return keys;
}

absl::StatusOr<Plan> AssemblePlan(const Selection& sel, const DeviceTensors& t, const CUtensorMap& q_map,
                                  const CUtensorMap& k_map, const CUtensorMap& v_map, const CUtensorMap* o_map,
                                  const DeviceLimits& limits) {
  if (sel.config < 0 || sel.config >= static_cast<int>(AllEntries().size())) {
    return absl::InvalidArgumentError("selection: not made by Select()");
  }
  if (absl::Status st = CheckPointer("o", t.o); !st.ok()) return st;
  const KernelEntry& e = AllEntries()[sel.config];
  if (e.o_box_rows > 0 && o_map == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("o: ", e.name, " stores O through a tensor map; pass MapKeys().o encoded"));
  }
  const Problem& p = sel.problem;
  const Shape& s = p.shape;
  if (p.want_lse && t.lse == nullptr) return absl::InvalidArgumentError("want_lse is set but the lse pointer is null");
  if (absl::Status st = CheckHopperOptions(sel.hopper); !st.ok()) return st;
  Plan plan;
  plan.config = sel.config;
  plan.device = sel.device;
  plan.dtype = p.dtype;
  plan.q_map = q_map;
  plan.k_map = k_map;
  plan.v_map = v_map;
  if (o_map != nullptr && e.o_box_rows > 0) plan.o_map = *o_map;
  LaunchParams& lp = plan.params;
  lp.o = t.o;
  lp.lse = p.want_lse ? t.lse : nullptr;
  lp.o_stride_b = sel.layout.o.batch;
  lp.o_stride_s = sel.layout.o.seq;
  lp.o_stride_h = sel.layout.o.head;
  lp.q_len = static_cast<int>(s.q_len);
  lp.kv_len = static_cast<int>(s.kv_len);
  lp.q_heads = static_cast<int>(s.q_heads);
  lp.kv_heads = static_cast<int>(s.kv_heads);
  lp.group = static_cast<int>(s.q_heads / s.kv_heads);
  lp.causal = p.mask == Mask::kNone ? 0 : 1;
  lp.causal_offset = p.mask == Mask::kCausalBottomRight ? static_cast<int>(s.kv_len - s.q_len) : 0;
  lp.num_q_tiles = static_cast<int>((s.q_len + e.block_m - 1) / e.block_m);
  lp.scale_log2 = static_cast<float>(static_cast<double>(p.scale) * 1.4426950408889634);
  lp.batch = static_cast<int>(s.batch);
  if (e.fp8) {
    if (absl::Status st = CheckFp8Pointers(t); !st.ok()) return st;
    if (absl::Status st = CheckPointer("v", t.v); !st.ok()) return st;
    lp.q_descale = t.q_descale;
    lp.k_descale = t.k_descale;
    lp.v_descale = t.v_descale;
    VTransposeParams& vt = plan.v_transpose;
    vt.v = t.v;
    vt.v_t = t.v_t;
    vt.v_stride_b = sel.layout.v.batch;
    vt.v_stride_s = sel.layout.v.seq;
    vt.v_stride_h = sel.layout.v.head;
    vt.kv_len = static_cast<int>(s.kv_len);
    vt.kv_len_padded = static_cast<int>((s.kv_len + 31) / 32 * 32);
    vt.kv_heads = static_cast<int>(s.kv_heads);
    vt.head_dim = static_cast<int>(s.head_dim);
    vt.batch = static_cast<int>(s.batch);
  }
  {
    // Causal block sections: (head, batch) pairs whose K/V (shared by a GQA group) fit half the L2, balanced.
    const int64_t l2 = limits.l2_bytes > 0 ? limits.l2_bytes : int64_t{50} << 20;
    const int64_t kv_bytes_per_q_head = std::max<int64_t>(1, s.kv_len * s.head_dim * 4 / lp.group);
    const int64_t pairs = s.q_heads * s.batch;
    const int64_t max_section = std::max<int64_t>(1, (l2 / 2) / kv_bytes_per_q_head);
    const int64_t sections = (pairs + max_section - 1) / max_section;
    lp.section = static_cast<int>((pairs + sections - 1) / sections);
  }
  if (static_cast<int64_t>(lp.num_q_tiles) * s.q_heads * s.batch > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError("shape: batch * q_heads * query tiles exceeds the grid limit");
  }
  plan.grid[0] = static_cast<unsigned>(lp.num_q_tiles);
  plan.grid[1] = static_cast<unsigned>(s.q_heads);
  plan.grid[2] = static_cast<unsigned>(s.batch);
  if (e.plan_schedule != nullptr) {
    if (limits.sms <= 0) return absl::InvalidArgumentError("limits.sms must be > 0");
    e.plan_schedule(sel.hopper, limits.sms, &plan);
  }
  return plan;
}

absl::StatusOr<Plan> MakePlanFromMaps(const Selection& sel, const DeviceTensors& t, const CUtensorMap& q_map,
                                      const CUtensorMap& k_map, const CUtensorMap& v_map, const CUtensorMap* o_map) {
  if (sel.config < 0 || sel.config >= static_cast<int>(AllEntries().size())) {
    return absl::InvalidArgumentError("selection: not made by Select()");
  }
  if (absl::Status st = Prepare(sel.config, sel.problem.dtype, sel.device); !st.ok()) return st;
  DeviceLimits limits;
  const cudaError_t err = cudaDeviceGetAttribute(&limits.sms, cudaDevAttrMultiProcessorCount, sel.device);
  if (err != cudaSuccess) {
    return absl::UnavailableError(
        absl::StrCat("CUDA device ", sel.device, " is not usable: ", cudaGetErrorString(err)));
  }
  // Without the L2 size the sections assume the H200's 50 MiB (AssemblePlan).
  if (cudaDeviceGetAttribute(&limits.l2_bytes, cudaDevAttrL2CacheSize, sel.device) != cudaSuccess) {
    cudaGetLastError();
    limits.l2_bytes = 0;
  }
  return AssemblePlan(sel, t, q_map, k_map, v_map, o_map, limits);
}

absl::StatusOr<Plan> MakePlan(const Problem& problem, const Layout& layout, const DeviceTensors& tensors,
                              const PlanOptions& options) {
  absl::StatusOr<Selection> sel = Select(problem, layout, options);
  if (!sel.ok()) return sel.status();
  absl::StatusOr<TensorMapKeys> keys = MapKeys(*sel, tensors);
  if (!keys.ok()) return keys.status();
  absl::StatusOr<CUtensorMap> q = EncodeTensorMap(keys->q);
  if (!q.ok()) return absl::Status(q.status().code(), absl::StrCat("q: ", q.status().message()));
  absl::StatusOr<CUtensorMap> k = EncodeTensorMap(keys->k);
  if (!k.ok()) return absl::Status(k.status().code(), absl::StrCat("k: ", k.status().message()));
  absl::StatusOr<CUtensorMap> v = EncodeTensorMap(keys->v);
  if (!v.ok()) return absl::Status(v.status().code(), absl::StrCat("v: ", v.status().message()));
  absl::StatusOr<CUtensorMap> o;
  if (keys->has_o) {
    o = EncodeTensorMap(keys->o);
    if (!o.ok()) return absl::Status(o.status().code(), absl::StrCat("o: ", o.status().message()));
  }
  return MakePlanFromMaps(*sel, tensors, *q, *k, *v, keys->has_o ? &*o : nullptr);
}

namespace {

absl::Status CheckPlan(const Plan& plan) {
  if (plan.config < 0 || plan.config >= static_cast<int>(AllEntries().size())) {
    return absl::InvalidArgumentError("plan: not made by MakePlan() or MakePlanFromMaps()");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ZeroWorkspace(const Plan& plan, void* workspace, cudaStream_t stream) {
  if (absl::Status st = CheckPlan(plan); !st.ok()) return st;
  if (plan.workspace_bytes == 0) return absl::OkStatus();
  if (workspace == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("workspace is null; the plan needs workspace_bytes = ", plan.workspace_bytes));
  }
  const cudaError_t err = cudaMemsetAsync(workspace, 0, plan.workspace_bytes, stream);
  if (err != cudaSuccess) {
    return absl::InternalError(absl::StrCat("zeroing the workspace (cudaMemsetAsync): ", cudaGetErrorString(err)));
  }
  return absl::OkStatus();
}

absl::Status Launch(const Plan& plan, void* workspace, cudaStream_t stream) {
  if (absl::Status st = CheckPlan(plan); !st.ok()) return st;
  if (plan.workspace_bytes > 0) {
    if (workspace == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("workspace is null; the plan needs workspace_bytes = ",
                                                     plan.workspace_bytes, " of zeroed device memory"));
    }
    if (reinterpret_cast<uintptr_t>(workspace) % 256 != 0) {
      return absl::InvalidArgumentError("workspace is not 256-byte aligned");
    }
  }
  const KernelEntry& e = AllEntries()[plan.config];
  const LaunchFn launch = e.launch[static_cast<int>(plan.dtype)];
  if (launch == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("plan: ", e.name, " does not run ", DTypeName(plan.dtype)));
  }
  const cudaError_t err = launch(plan, workspace, stream);
  if (err != cudaSuccess) {
    return absl::InternalError(absl::StrCat("launch of ", e.name, ": ", cudaGetErrorString(err)));
  }
  return absl::OkStatus();
}

}  // namespace attnd::kernels
