#include "attnd/kernels/decode_c.h"

#include <cstring>
#include <string>
#include <type_traits>

#include "attnd/kernels/decode.h"
#include "../c_abi_status.h"

struct attnd_decode_plan {
  attnd::kernels::decode::DecodePlan plan;
};

namespace {

using attnd::kernels::decode::AppendPlan;
using attnd::kernels::decode::BatchLayout;
using attnd::kernels::decode::GatherPlan;

int Fail(const absl::Status& st, char* err, size_t err_len) { return attnd::kernels::FailInto(st, err, err_len); }

absl::StatusOr<BatchLayout> ToLayout(const attnd_decode_layout* c) {
  using namespace attnd;
  if (c == nullptr) return absl::InvalidArgumentError("layout: null");
  if (c->dtype < 0 || c->dtype > 1) return absl::InvalidArgumentError("layout.dtype: must be 0 (bf16) or 1 (fp16)");
  if (c->kv_format < 0 || c->kv_format > 1) {
    return absl::InvalidArgumentError("layout.kv_format: must be 0 (the dtype) or 1 (float8 e4m3)");
  }
  BatchLayout l;
  l.batch = c->batch;
  l.q_len = c->q_len;
  l.q_heads = c->q_heads;
  l.kv_heads = c->kv_heads;
  l.head_dim = c->head_dim;
  l.dtype = c->dtype == 0 ? DType::kBF16 : DType::kFP16;
  l.mask = c->causal ? Mask::kCausalBottomRight : Mask::kNone;
  l.scale = c->scale;
  l.want_lse = c->want_lse != 0;
  auto strides = [](const int64_t s[3]) { return Strides{s[0], s[1], s[2]}; };
  l.q = strides(c->q_strides);
  l.o = strides(c->o_strides);
  l.k = strides(c->k_strides);
  l.v = strides(c->v_strides);
  l.kv_storage = c->paged ? kernels::decode::KvStorage::kPaged : kernels::decode::KvStorage::kContiguous;
  l.kv_capacity = c->kv_capacity;
  l.paged = kernels::decode::PagedKv{c->page_size, c->num_pages, c->max_pages_per_seq};
  l.kv_format = c->kv_format == 1 ? kernels::decode::KvFormat::kFp8E4M3 : kernels::decode::KvFormat::kAsQuery;
  return l;
}

absl::Span<const int32_t> TableSpan(const BatchLayout& l, const int32_t* table) {
  if (table == nullptr || l.kv_storage != attnd::kernels::decode::KvStorage::kPaged || l.batch < 1 ||
      l.paged.max_pages_per_seq < 1) {
    return {};
  }
  return absl::Span<const int32_t>(table, static_cast<size_t>(l.batch) * l.paged.max_pages_per_seq);
}

// An append (Plan = AppendPlan) or a gather (GatherPlan): the layout and the host lengths checked, the plan made for
// `rows` contiguous rows a sequence on the caller's side (the new rows, or the gathered ones) and handed to `launch`.
template <typename Plan, typename LaunchFn>
absl::Status CopyKvStatus(const attnd_decode_layout* layout, int rows, const int32_t* host_kv_lens,
                          const int32_t* host_block_table, LaunchFn launch) {
  absl::StatusOr<BatchLayout> l = ToLayout(layout);
  if (!l.ok()) return l.status();
  if (host_kv_lens == nullptr || l->batch < 1) return absl::InvalidArgumentError("host_kv_lens: null or empty batch");
  const attnd::Strides contiguous = attnd::ContiguousStrides(rows, l->kv_heads, l->head_dim);
  const absl::Span<const int32_t> lens(host_kv_lens, static_cast<size_t>(l->batch));
  const absl::Span<const int32_t> table = TableSpan(*l, host_block_table);
  absl::StatusOr<Plan> plan;
  if constexpr (std::is_same_v<Plan, AppendPlan>) {
    plan = attnd::kernels::decode::MakeAppendPlan(*l, rows, contiguous, contiguous, lens, table);
  } else {
    plan = attnd::kernels::decode::MakeGatherPlan(*l, rows, contiguous, contiguous, lens, table);
  }
  if (!plan.ok()) return plan.status();
  return launch(*plan);
}

// CopyKvStatus through the C ABI: 0, or -1 with `err` filled.
template <typename Plan, typename LaunchFn>
int CopyKv(char* err, size_t err_len, const attnd_decode_layout* layout, int rows, const int32_t* host_kv_lens,
           const int32_t* host_block_table, LaunchFn launch) {
  const absl::Status st = CopyKvStatus<Plan>(layout, rows, host_kv_lens, host_block_table, launch);
  return st.ok() ? 0 : Fail(st, err, err_len);
}

}  // namespace

extern "C" {

int attnd_decode_plan_create(const attnd_decode_layout* layout, const int32_t* kv_lens, const int32_t* block_table,
                             int num_splits, int sm_count, attnd_decode_plan** out, char* err, size_t err_len) {
  if (out == nullptr) return Fail(absl::InvalidArgumentError("out: null"), err, err_len);
  *out = nullptr;
  absl::StatusOr<BatchLayout> l = ToLayout(layout);
  if (!l.ok()) return Fail(l.status(), err, err_len);
  if (kv_lens == nullptr || l->batch < 1) {
    return Fail(absl::InvalidArgumentError("kv_lens: null or empty batch"), err, err_len);
  }
  attnd::kernels::decode::DecodeOptions options;
  options.num_splits = num_splits;
  options.sm_count = sm_count;
  absl::StatusOr<attnd::kernels::decode::DecodePlan> plan = attnd::kernels::decode::MakeDecodePlan(
      *l, absl::Span<const int32_t>(kv_lens, static_cast<size_t>(l->batch)), TableSpan(*l, block_table), options);
  if (!plan.ok()) return Fail(plan.status(), err, err_len);
  *out = new attnd_decode_plan{*plan};
  return 0;
}

size_t attnd_decode_plan_workspace_bytes(const attnd_decode_plan* plan) {
  return plan == nullptr ? 0 : plan->plan.workspace_bytes;
}

size_t attnd_decode_plan_counter_bytes(const attnd_decode_plan* plan) {
  return plan == nullptr ? 0 : plan->plan.counter_bytes;
}

int attnd_decode_plan_num_splits(const attnd_decode_plan* plan) { return plan == nullptr ? 0 : plan->plan.max_splits; }

int attnd_decode_launch(const attnd_decode_plan* plan, const void* q, const void* k, const void* v, void* o,
                        float* lse, const int32_t* kv_lens, const int32_t* block_table, const float* k_descale,
                        const float* v_descale, void* workspace, int32_t* counters, void* stream, char* err,
                        size_t err_len) {
  if (plan == nullptr) return Fail(absl::InvalidArgumentError("plan: null"), err, err_len);
  attnd::kernels::decode::DecodeTensors t{q, k, v, o, lse, kv_lens, block_table};
  t.k_descale = k_descale;
  t.v_descale = v_descale;
  const absl::Status st = attnd::kernels::decode::LaunchDecode(plan->plan, t, {workspace, counters},
                                                               static_cast<cudaStream_t>(stream));
  return st.ok() ? 0 : Fail(st, err, err_len);
}

void attnd_decode_plan_destroy(attnd_decode_plan* plan) { delete plan; }

int attnd_decode_append(const attnd_decode_layout* layout, int new_len, const int32_t* host_kv_lens,
                        const int32_t* host_block_table, const void* new_k, const void* new_v, void* k, void* v,
                        const int32_t* kv_lens, const int32_t* block_table, const float* k_descale,
                        const float* v_descale, void* stream, char* err, size_t err_len) {
  return CopyKv<AppendPlan>(err, err_len, layout, new_len, host_kv_lens, host_block_table, [&](const auto& plan) {
    return LaunchAppend(plan, {new_k, new_v, k, v, kv_lens, block_table, k_descale, v_descale},
                        static_cast<cudaStream_t>(stream));
  });
}

int attnd_decode_gather(const attnd_decode_layout* layout, int capacity, const int32_t* host_kv_lens,
                        const int32_t* host_block_table, const void* k, const void* v, void* out_k, void* out_v,
                        const int32_t* kv_lens, const int32_t* block_table, const float* k_descale,
                        const float* v_descale, void* stream, char* err, size_t err_len) {
  return CopyKv<GatherPlan>(err, err_len, layout, capacity, host_kv_lens, host_block_table, [&](const auto& plan) {
    return LaunchGather(plan, {k, v, out_k, out_v, kv_lens, block_table, k_descale, v_descale},
                        static_cast<cudaStream_t>(stream));
  });
}

}  // extern "C"
