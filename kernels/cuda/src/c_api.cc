#include "attnd/kernels/attention_c.h"

#include <cstring>
#include <string>

#include "attnd/kernels/attention.h"

struct attnd_kernels_plan {
  attnd::kernels::Plan plan;
};

namespace {

int Fail(const absl::Status& st, char* err, size_t err_len) {
  if (err != nullptr && err_len > 0) {
    const std::string msg = st.ToString();
    std::strncpy(err, msg.c_str(), err_len - 1);
    err[err_len - 1] = '\0';
  }
  return static_cast<int>(st.code());
}

}  // namespace

extern "C" {

int attnd_kernels_plan_create(const int64_t shape[6], int dtype, int mask, float scale, const int64_t strides[12],
                              const void* q, const void* k, const void* v, void* o, float* lse, const char* config,
                              attnd_kernels_plan** out, char* err, size_t err_len) {
  using namespace attnd;
  if (out == nullptr) return Fail(absl::InvalidArgumentError("out is null"), err, err_len);
  *out = nullptr;
  if (dtype < 0 || dtype > 1) return Fail(absl::InvalidArgumentError("dtype must be 0 (bf16) or 1 (fp16)"), err, err_len);
  if (mask < 0 || mask > 2) return Fail(absl::InvalidArgumentError("mask must be 0, 1 or 2"), err, err_len);
  Problem p;
  p.shape = Shape{shape[0], shape[1], shape[2], shape[3], shape[4], shape[5]};
  p.dtype = dtype == 0 ? DType::kBF16 : DType::kFP16;
  p.mask = mask == 0 ? Mask::kNone : (mask == 1 ? Mask::kCausalTopLeft : Mask::kCausalBottomRight);
  p.scale = scale;
  p.want_lse = lse != nullptr;
  Layout layout{{strides[0], strides[1], strides[2]},
                {strides[3], strides[4], strides[5]},
                {strides[6], strides[7], strides[8]},
                {strides[9], strides[10], strides[11]}};
  kernels::PlanOptions options;
  const std::string name = config == nullptr ? "" : config;
  if (name == "seed") {
    options.family = kernels::Family::kSeed;
  } else if (name == "hopper") {
    options.family = kernels::Family::kHopper;
  } else if (name != "auto") {
    options.config = name;
  }
  absl::StatusOr<kernels::Plan> plan = kernels::MakePlan(p, layout, kernels::DeviceTensors{q, k, v, o, lse}, options);
  if (!plan.ok()) return Fail(plan.status(), err, err_len);
  *out = new attnd_kernels_plan{*plan};
  return 0;
}

int attnd_kernels_plan_launch(const attnd_kernels_plan* plan, void* stream, char* err, size_t err_len) {
  if (plan == nullptr) return Fail(absl::InvalidArgumentError("plan is null"), err, err_len);
  absl::Status st = attnd::kernels::Launch(plan->plan, static_cast<cudaStream_t>(stream));
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
