#include "attnd/kernels/attention_c.h"

#include <cuda_runtime_api.h>

#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "attnd/kernels/attention.h"
#include "c_abi_status.h"

struct attnd_kernels_plan {
  attnd::kernels::Plan plan;
  void* workspace = nullptr;  // owned (cudaFree at destroy); null when the plan needs none or the caller owns it
  void* v_t = nullptr;        // float8 plans: the owned V^T scratch (DeviceTensors::v_t)

  ~attnd_kernels_plan() {
    if (workspace != nullptr) cudaFree(workspace);
    if (v_t != nullptr) cudaFree(v_t);
  }
};

namespace {

int Fail(const absl::Status& st, char* err, size_t err_len) { return attnd::kernels::FailInto(st, err, err_len); }

attnd::kernels::HopperScheduleOptions FromC(const attnd_kernels_hopper_options& c) {
  using attnd::kernels::CausalOrder;
  using attnd::kernels::SplitTail;
  attnd::kernels::HopperScheduleOptions o;
  o.max_blocks = c.max_blocks;
  // Out-of-range values become ones Select() rejects, naming the field.
  o.split_tail = static_cast<SplitTail>(c.split_tail);
  o.causal_order = static_cast<CausalOrder>(c.causal_order);
  o.max_paired_q_tiles = c.max_paired_q_tiles;
  o.l2_section_bytes = c.l2_section_bytes;
  o.paired_kv_bytes = c.paired_kv_bytes;
  o.tail_tiles_per_block = c.tail_tiles_per_block;
  o.dynamic_min_tiles_per_block = c.dynamic_min_tiles_per_block;
  return o;
}

// The plan's own workspace, zeroed before this returns (so that a launch on any stream finds it zero).
absl::Status AllocateWorkspace(attnd_kernels_plan* p) {
  if (p->plan.workspace_bytes == 0) return absl::OkStatus();
  cudaError_t e = cudaMalloc(&p->workspace, p->plan.workspace_bytes);
  if (e != cudaSuccess) {
    cudaGetLastError();
    p->workspace = nullptr;
    return absl::ResourceExhaustedError(absl::StrCat("allocating the plan's workspace (", p->plan.workspace_bytes,
                                                     " bytes): ", cudaGetErrorString(e)));
  }
  if (absl::Status st = attnd::kernels::ZeroWorkspace(p->plan, p->workspace, nullptr); !st.ok()) return st;
  e = cudaStreamSynchronize(nullptr);
  if (e != cudaSuccess) return absl::InternalError(absl::StrCat("zeroing the workspace: ", cudaGetErrorString(e)));
  return absl::OkStatus();
}

}  // namespace

extern "C" {

void attnd_kernels_hopper_options_default(attnd_kernels_hopper_options* out) {
  if (out == nullptr) return;
  const attnd::kernels::HopperScheduleOptions d;
  out->max_blocks = d.max_blocks;
  out->split_tail = static_cast<int32_t>(d.split_tail);
  out->causal_order = static_cast<int32_t>(d.causal_order);
  out->max_paired_q_tiles = d.max_paired_q_tiles;
  out->l2_section_bytes = d.l2_section_bytes;
  out->paired_kv_bytes = d.paired_kv_bytes;
  out->tail_tiles_per_block = d.tail_tiles_per_block;
  out->dynamic_min_tiles_per_block = d.dynamic_min_tiles_per_block;
}

}  // extern "C"

namespace {

// The body of every plan_create: dtype 0 bf16, 1 fp16, 2 float8 e4m3 (then `fp8` holds the descales and the plan
// allocates its V^T scratch).
int CreatePlan(const int64_t shape[6], int dtype, int mask, float scale, const int64_t strides[12], const void* q,
               const void* k, const void* v, void* o, float* lse, const attnd::kernels::DeviceTensors* fp8,
               const char* config, const attnd_kernels_hopper_options* hopper, int own_workspace,
               attnd_kernels_plan** out, char* err, size_t err_len) {
  using namespace attnd;
  if (out == nullptr) return Fail(absl::InvalidArgumentError("out is null"), err, err_len);
  *out = nullptr;
  if (shape == nullptr) return Fail(absl::InvalidArgumentError("shape is null"), err, err_len);
  if (strides == nullptr) return Fail(absl::InvalidArgumentError("strides is null"), err, err_len);
  if (mask < 0 || mask > 2) return Fail(absl::InvalidArgumentError("mask must be 0, 1 or 2"), err, err_len);
  Problem p;
  p.shape = Shape{shape[0], shape[1], shape[2], shape[3], shape[4], shape[5]};
  p.dtype = dtype == 0 ? DType::kBF16 : (dtype == 1 ? DType::kFP16 : DType::kFP8E4M3);
  p.mask = mask == 0 ? Mask::kNone : (mask == 1 ? Mask::kCausalTopLeft : Mask::kCausalBottomRight);
  p.scale = scale;
  p.want_lse = lse != nullptr;
  Layout layout{{strides[0], strides[1], strides[2]},
                {strides[3], strides[4], strides[5]},
                {strides[6], strides[7], strides[8]},
                {strides[9], strides[10], strides[11]}};
  kernels::PlanOptions options;
  const std::string name = config == nullptr ? "" : config;
  if (name == "mma_sync") {
    options.family = kernels::Family::kMmaSync;
  } else if (name == "hopper") {
    options.family = kernels::Family::kHopper;
  } else if (name != "auto") {
    options.config = name;
  }
  if (hopper != nullptr) options.hopper = FromC(*hopper);
  kernels::DeviceTensors tensors{q, k, v, o, lse};
  void* v_t = nullptr;
  if (fp8 != nullptr) {
    tensors.q_descale = fp8->q_descale;
    tensors.k_descale = fp8->k_descale;
    tensors.v_descale = fp8->v_descale;
    if (p.shape.batch > 0 && p.shape.kv_len > 0 && p.shape.kv_heads > 0 && p.shape.head_dim > 0) {
      const int64_t bytes = kernels::VTransposedBytes(p.shape, p.dtype);
      if (cudaMalloc(&v_t, static_cast<size_t>(bytes)) != cudaSuccess) {
        cudaGetLastError();
        return Fail(absl::ResourceExhaustedError(absl::StrCat("allocating V^T (", bytes, " bytes)")), err, err_len);
      }
    }
    tensors.v_t = v_t;
  }
  absl::StatusOr<kernels::Plan> plan = kernels::MakePlan(p, layout, tensors, options);
  if (!plan.ok()) {
    if (v_t != nullptr) cudaFree(v_t);
    return Fail(plan.status(), err, err_len);
  }
  auto* made = new attnd_kernels_plan{*plan};
  made->v_t = v_t;
  if (own_workspace != 0) {
    if (absl::Status st = AllocateWorkspace(made); !st.ok()) {
      delete made;
      return Fail(st, err, err_len);
    }
  }
  *out = made;
  return 0;
}

}  // namespace

extern "C" {

int attnd_kernels_plan_create_with_options(const int64_t shape[6], int dtype, int mask, float scale,
                                           const int64_t strides[12], const void* q, const void* k, const void* v,
                                           void* o, float* lse, const char* config,
                                           const attnd_kernels_hopper_options* hopper, int own_workspace,
                                           attnd_kernels_plan** out, char* err, size_t err_len) {
  if (dtype < 0 || dtype > 1) {
    if (out != nullptr) *out = nullptr;
    return Fail(absl::InvalidArgumentError("dtype must be 0 (bf16) or 1 (fp16)"), err, err_len);
  }
  return CreatePlan(shape, dtype, mask, scale, strides, q, k, v, o, lse, nullptr, config, hopper, own_workspace, out,
                    err, err_len);
}

int attnd_kernels_plan_create_fp8(const int64_t shape[6], int mask, float scale, const int64_t strides[12],
                                  const void* q, const void* k, const void* v, void* o, float* lse,
                                  const float* q_descale, const float* k_descale, const float* v_descale,
                                  const char* config, const attnd_kernels_hopper_options* hopper,
                                  attnd_kernels_plan** out, char* err, size_t err_len) {
  attnd::kernels::DeviceTensors fp8;
  fp8.q_descale = q_descale;
  fp8.k_descale = k_descale;
  fp8.v_descale = v_descale;
  return CreatePlan(shape, 2, mask, scale, strides, q, k, v, o, lse, &fp8, config, hopper, 1, out, err, err_len);
}

int attnd_kernels_plan_create(const int64_t shape[6], int dtype, int mask, float scale, const int64_t strides[12],
                              const void* q, const void* k, const void* v, void* o, float* lse, const char* config,
                              attnd_kernels_plan** out, char* err, size_t err_len) {
  return attnd_kernels_plan_create_with_options(shape, dtype, mask, scale, strides, q, k, v, o, lse, config, nullptr,
                                                1, out, err, err_len);
}

int attnd_kernels_plan_launch(const attnd_kernels_plan* plan, void* stream, char* err, size_t err_len) {
  if (plan == nullptr) return Fail(absl::InvalidArgumentError("plan is null"), err, err_len);
  return attnd_kernels_plan_launch_with_workspace(plan, plan->workspace, stream, err, err_len);
}

size_t attnd_kernels_plan_workspace_bytes(const attnd_kernels_plan* plan) {
  return plan == nullptr ? 0 : plan->plan.workspace_bytes;
}

int attnd_kernels_plan_launch_with_workspace(const attnd_kernels_plan* plan, void* workspace, void* stream, char* err,
                                             size_t err_len) {
  if (plan == nullptr) return Fail(absl::InvalidArgumentError("plan is null"), err, err_len);
  absl::Status st = attnd::kernels::Launch(plan->plan, workspace, static_cast<cudaStream_t>(stream));
  return st.ok() ? 0 : Fail(st, err, err_len);
}

const char* attnd_kernels_plan_config(const attnd_kernels_plan* plan) {
  return plan == nullptr ? "" : attnd::kernels::Configs()[plan->plan.config].name.c_str();
}

void attnd_kernels_plan_destroy(attnd_kernels_plan* plan) { delete plan; }

int attnd_kernels_config_count(void) { return static_cast<int>(attnd::kernels::Configs().size()); }

const char* attnd_kernels_config_name(int index) {
  const auto& configs = attnd::kernels::Configs();
  return index >= 0 && index < static_cast<int>(configs.size()) ? configs[index].name.c_str() : nullptr;
}

int attnd_kernels_check_device(char* err, size_t err_len) {
  absl::Status st = attnd::kernels::CheckDevice(-1);
  return st.ok() ? 0 : Fail(st, err, err_len);
}

}  // extern "C"
