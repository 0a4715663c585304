// Host side of attnd/kernels/decode.h: layout validation, the split heuristic, the workspace layout and the
// launches. Nothing here touches device memory; the only device query is the SM count when the options do not
// give it.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "attnd/kernels/decode.h"
#include "decode_launch.h"
#include "decode_params.h"
#include "tile_size_decode.h"

namespace attnd::kernels::decode {
namespace {

// Splits beyond this cost more in the merge than they add in parallelism even on the largest GPUs.
constexpr int kMaxSplits = 128;
// The largest grid.y / grid.z.
constexpr int64_t kMaxGridYZ = 65535;
constexpr size_t kWorkspaceAlign = 256;

absl::Status Invalid(const std::string& field, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", why));
}

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t RoundUp(int64_t a, int64_t b) { return CeilDiv(a, b) * b; }

// The split workspace: every split's fp32 O, then its log2 sums.
struct WorkspaceLayout {
  size_t lse_offset = 0;
  size_t bytes = 0;
};

WorkspaceLayout LayoutWorkspace(const DecodePlan& plan) {
  const BatchLayout& l = plan.layout;
  const size_t rows = static_cast<size_t>(l.batch) * plan.max_splits * l.q_len * l.q_heads;
  WorkspaceLayout w;
  w.lse_offset = RoundUp(rows * l.head_dim * sizeof(float), kWorkspaceAlign);
  w.bytes = w.lse_offset + rows * sizeof(float);
  return w;
}

// The append and gather kernels index one sequence's 16-byte chunks in 32 bits.
constexpr int64_t kMaxChunksPerSequence = int64_t{1} << 31;

int64_t RowChunks(const BatchLayout& l) { return int64_t{l.kv_heads} * (l.head_dim / 8); }

int Log2(int x) {
  int s = 0;
  while ((1 << s) < x) ++s;
  return s;
}

bool Fp8Kv(const BatchLayout& l) { return l.kv_format == KvFormat::kFp8E4M3; }

// `multiple`: the elements of a 16-byte copy (8 of 16 bits, 16 of float8).
absl::Status CheckStrides(const std::string& name, const Strides& s, int multiple = 8) {
  const std::pair<const char*, int64_t> fields[] = {{"batch", s.batch}, {"seq", s.seq}, {"head", s.head}};
  for (const auto& [field, v] : fields) {
    if (v < 0 || v % multiple != 0) {
      return Invalid(absl::StrCat(name, ".", field), absl::StrCat(v, " is not a non-negative multiple of ", multiple,
                                                                  " elements (rows move in 16-byte copies)"));
    }
  }
  return absl::OkStatus();
}

// The K/V side of a layout: heads, head_dim, element type, storage and its extents.
absl::Status CheckCache(const BatchLayout& l) {
  if (l.batch < 1 || l.batch > kMaxGridYZ) return Invalid("layout.batch", absl::StrCat(l.batch, " not in [1, 65535]"));
  if (l.kv_heads < 1) return Invalid("layout.kv_heads", absl::StrCat(l.kv_heads, " < 1"));
  if (l.head_dim != 64 && l.head_dim != 128 && l.head_dim != 256) {
    return Invalid("layout.head_dim", absl::StrCat(l.head_dim, " is not 64, 128 or 256"));
  }
  if (l.dtype != DType::kBF16 && l.dtype != DType::kFP16) return Invalid("layout.dtype", "not bf16 or fp16");
  if (l.kv_format != KvFormat::kAsQuery && l.kv_format != KvFormat::kFp8E4M3) {
    return Invalid("layout.kv_format", "unknown format");
  }
  const int multiple = Fp8Kv(l) ? 16 : 8;
  if (absl::Status st = CheckStrides("layout.k", l.k, multiple); !st.ok()) return st;
  if (absl::Status st = CheckStrides("layout.v", l.v, multiple); !st.ok()) return st;
  if (l.kv_storage == KvStorage::kContiguous) {
    if (l.kv_capacity < 1) return Invalid("layout.kv_capacity", absl::StrCat(l.kv_capacity, " < 1"));
  } else if (l.kv_storage == KvStorage::kPaged) {
    const int ps = l.paged.page_size;
    if (ps < 16 || ps > 256 || (ps & (ps - 1)) != 0) {
      return Invalid("layout.paged.page_size", absl::StrCat(ps, " is not a power of two from 16 to 256"));
    }
    if (l.paged.num_pages < 1) return Invalid("layout.paged.num_pages", absl::StrCat(l.paged.num_pages, " < 1"));
    if (l.paged.max_pages_per_seq < 1) {
      return Invalid("layout.paged.max_pages_per_seq", absl::StrCat(l.paged.max_pages_per_seq, " < 1"));
    }
  } else {
    return Invalid("layout.kv_storage", "unknown storage");
  }
  return absl::OkStatus();
}

// Checks that key positions [0, end_b) of every sequence fit its buffer or table (end_b = kv_lens[b] + extra)
// and, for paged KV, that the table entries of the positions [first_b, end_b) name existing pages
// (first_b = kv_lens[b] when checking an append's target pages, 0 otherwise).
absl::Status CheckLengthsAndTable(const BatchLayout& l, absl::Span<const int32_t> kv_lens,
                                  absl::Span<const int32_t> table, int extra, bool from_current_length) {
  if (kv_lens.size() != static_cast<size_t>(l.batch)) {
    return Invalid("kv_lens", absl::StrCat(kv_lens.size(), " entries for a batch of ", l.batch));
  }
  const bool paged = l.kv_storage == KvStorage::kPaged;
  const int64_t pages_per_seq = l.paged.max_pages_per_seq;
  const int64_t capacity = paged ? pages_per_seq * l.paged.page_size : l.kv_capacity;
  if (paged) {
    if (table.size() != static_cast<size_t>(l.batch * pages_per_seq)) {
      return Invalid("block_table", absl::StrCat(table.size(), " entries, expected batch x max_pages_per_seq = ",
                                                 l.batch * pages_per_seq));
    }
  } else if (!table.empty()) {
    return Invalid("block_table", "given for contiguous KV");
  }
  for (int b = 0; b < l.batch; ++b) {
    const int64_t len = kv_lens[b];
    // The field's name is built only for an error: a 64-sequence step would otherwise pay 64 allocations.
    const auto field = [b] { return absl::StrCat("kv_lens[", b, "]"); };
    if (len < 0) return Invalid(field(), absl::StrCat(len, " < 0"));
    const int64_t end = len + extra;
    if (end > capacity) {
      return Invalid(field(), absl::StrCat(len, extra > 0 ? absl::StrCat(" + ", extra, " new rows") : "",
                                         " exceeds the capacity of ", capacity, " keys",
                                         paged ? " (max_pages_per_seq x page_size)" : " (kv_capacity)"));
    }
    if (!paged) continue;
    const int64_t first_page = from_current_length ? len / l.paged.page_size : 0;
    const int64_t end_page = CeilDiv(end, l.paged.page_size);
    for (int64_t j = first_page; j < end_page; ++j) {
      const int32_t page = table[b * pages_per_seq + j];
      if (page < 0 || page >= l.paged.num_pages) {
        return Invalid(absl::StrCat("block_table[", b, "][", j, "]"),
                       absl::StrCat("page ", page, " out of range [0, ", l.paged.num_pages, ")"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CheckPointer(const char* field, const void* p, bool required) {
  if (p == nullptr) return required ? Invalid(field, "null") : absl::OkStatus();
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return Invalid(field, "not 16-byte aligned");
  return absl::OkStatus();
}

// The tensors a launch cannot run without: each given and 16-byte aligned (the kernels' vector loads).
absl::Status CheckRequired(std::initializer_list<std::pair<const char*, const void*>> tensors) {
  for (const auto& [field, p] : tensors) {
    if (absl::Status st = CheckPointer(field, p, true); !st.ok()) return st;
  }
  return absl::OkStatus();
}

// A float8 cache's descales: both given, 4-byte aligned; none otherwise (a stray one would be ignored silently).
absl::Status CheckDescales(const BatchLayout& l, const float* k_descale, const float* v_descale) {
  const std::pair<const char*, const float*> fields[] = {{"tensors.k_descale", k_descale},
                                                          {"tensors.v_descale", v_descale}};
  for (const auto& [field, p] : fields) {
    if (!Fp8Kv(l)) {
      if (p != nullptr) return Invalid(field, "given for 16-bit K/V (layout.kv_format)");
    } else if (p == nullptr) {
      return Invalid(field, "null for float8 K/V");
    } else if (reinterpret_cast<uintptr_t>(p) % alignof(float) != 0) {
      return Invalid(field, "not 4-byte aligned");
    }
  }
  return absl::OkStatus();
}

// The fields the append's and the gather's parameters share (the same names in both, as in their tensors): the
// cache's pointers, strides, shape, paging and descales, the device tensors among them checked first.
template <typename Tensors, typename Params>
absl::Status SetCacheFields(const BatchLayout& l, const Tensors& t, Params* p) {
  const bool paged = l.kv_storage == KvStorage::kPaged;
  if (absl::Status st = CheckRequired({{"tensors.k", t.k}, {"tensors.v", t.v}}); !st.ok()) return st;
  if (t.kv_lens == nullptr) return Invalid("tensors.kv_lens", "null");
  if (paged && t.block_table == nullptr) return Invalid("tensors.block_table", "null for paged KV");
  if (absl::Status st = CheckDescales(l, t.k_descale, t.v_descale); !st.ok()) return st;
  p->k = t.k;
  p->v = t.v;
  p->kv_lens = t.kv_lens;
  p->block_table = paged ? t.block_table : nullptr;
  p->k_sb = l.k.batch, p->k_ss = l.k.seq, p->k_sh = l.k.head;
  p->v_sb = l.v.batch, p->v_ss = l.v.seq, p->v_sh = l.v.head;
  p->batch = l.batch;
  p->kv_heads = l.kv_heads;
  p->head_dim = l.head_dim;
  p->chunk_shift = Log2(l.head_dim / (Fp8Kv(l) ? 16 : 8));
  p->page_shift = paged ? Log2(l.paged.page_size) : 0;
  p->max_pages_per_seq = paged ? l.paged.max_pages_per_seq : 0;
  p->k_descale = t.k_descale;
  p->v_descale = t.v_descale;
  return absl::OkStatus();
}

absl::Status FromCuda(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(err)));
}

}  // namespace

absl::StatusOr<DecodePlan> MakeDecodePlan(const BatchLayout& layout, absl::Span<const int32_t> kv_lens,
                                          absl::Span<const int32_t> block_table, const DecodeOptions& options) {
  const BatchLayout& l = layout;
  if (absl::Status st = CheckCache(l); !st.ok()) return st;
  if (l.q_len < 1 || l.q_len > 16) return Invalid("layout.q_len", absl::StrCat(l.q_len, " not in [1, 16]"));
  if (l.q_heads < 1 || l.q_heads % l.kv_heads != 0) {
    return Invalid("layout.q_heads", absl::StrCat(l.q_heads, " is not a positive multiple of kv_heads ", l.kv_heads));
  }
  if (l.mask != Mask::kNone && l.mask != Mask::kCausalBottomRight) {
    return Invalid("layout.mask", absl::StrCat(MaskName(l.mask), " is not none or causal bottom-right"));
  }
  if (!std::isfinite(l.scale)) return Invalid("layout.scale", "not finite");
  if (absl::Status st = CheckStrides("layout.q", l.q); !st.ok()) return st;
  if (absl::Status st = CheckStrides("layout.o", l.o); !st.ok()) return st;
  if (options.num_splits < 0) return Invalid("options.num_splits", absl::StrCat(options.num_splits, " < 0"));
  if (options.sm_count < 0) return Invalid("options.sm_count", absl::StrCat(options.sm_count, " < 0"));
  if (options.target_blocks_per_sm < 0) {
    return Invalid("options.target_blocks_per_sm", absl::StrCat(options.target_blocks_per_sm, " < 0"));
  }
  if (options.min_split_keys < 1) return Invalid("options.min_split_keys", absl::StrCat(options.min_split_keys, " < 1"));
  if (absl::Status st = CheckLengthsAndTable(l, kv_lens, block_table, 0, false); !st.ok()) return st;
  if (l.append && Fp8Kv(l)) {
    return Invalid("layout.append", "not with float8 K/V: LaunchAppend (which quantizes), then LaunchDecode");
  }
  if (l.append) {
    if (absl::Status st = CheckStrides("layout.new_k", l.new_k); !st.ok()) return st;
    if (absl::Status st = CheckStrides("layout.new_v", l.new_v); !st.ok()) return st;
    for (int b = 0; b < l.batch; ++b) {
      if (kv_lens[b] < l.q_len) {
        return Invalid(absl::StrCat("kv_lens[", b, "]"),
                       absl::StrCat(kv_lens[b], " < q_len ", l.q_len, ": with layout.append the last q_len keys are "
                                                "the new rows"));
      }
    }
  }

  DecodePlan plan;
  plan.layout = l;
  const int group = l.q_heads / l.kv_heads;
  plan.rows = group * l.q_len;
  plan.row_block = DecodeRowBlock(plan.rows);
  plan.m_blocks = static_cast<int>(CeilDiv(plan.rows, plan.row_block));
  if (static_cast<int64_t>(l.kv_heads) * plan.m_blocks > kMaxGridYZ) {
    return Invalid("layout.kv_heads", absl::StrCat("kv_heads x row blocks = ", int64_t{l.kv_heads} * plan.m_blocks,
                                                   " exceeds 65535"));
  }
  plan.block_n = DecodeBlockN(l.head_dim);

  plan.sm_count = options.sm_count;
  if (plan.sm_count == 0) {
    int device = options.device;
    if (device < 0) {
      if (absl::Status st = FromCuda(cudaGetDevice(&device), "cudaGetDevice"); !st.ok()) return st;
    }
    if (absl::Status st = FromCuda(cudaDeviceGetAttribute(&plan.sm_count, cudaDevAttrMultiProcessorCount, device),
                                   "cudaDeviceGetAttribute(MultiProcessorCount)");
        !st.ok()) {
      return st;
    }
  }

  // Split heuristic: the keys per block that would make the whole batch about target_blocks_per_sm blocks per
  // SM (by default the tile's DecodeBlocksPerSm, each block streaming its keys at the bandwidth one block can pull),
  // never fewer than min_split_keys; the longest sequence gets the whole number of such splits that fits (rounding
  // down keeps a uniform batch within one wave of resident blocks instead of spilling a short second wave), cut into
  // equal tile-aligned parts.
  // Every sequence is cut at the same split size, so a ragged batch splits its long sequences and leaves its
  // short ones whole; a batch that fills the GPU without splitting gets one split.
  int64_t max_len = 0, total_keys = 0;
  for (int32_t len : kv_lens) {
    max_len = std::max<int64_t>(max_len, len);
    total_keys += len;
  }
  int64_t splits;
  if (options.num_splits > 0) {
    splits = options.num_splits;
  } else {
    const int64_t blocks_per_split = static_cast<int64_t>(l.kv_heads) * plan.m_blocks;
    const int per_sm = options.target_blocks_per_sm > 0 ? options.target_blocks_per_sm
                                                         : DecodeBlocksPerSm(l.head_dim, Fp8Kv(l));
    const int64_t target_blocks = static_cast<int64_t>(plan.sm_count) * per_sm;
    const int64_t keys_per_block =
        std::max<int64_t>(CeilDiv(total_keys * blocks_per_split, target_blocks), options.min_split_keys);
    splits = max_len / keys_per_block;
  }
  splits = std::clamp<int64_t>(splits, 1, kMaxSplits);
  const int64_t split_keys = RoundUp(std::max<int64_t>(CeilDiv(max_len, splits), 1), plan.block_n);
  plan.max_splits = static_cast<int>(std::max<int64_t>(1, CeilDiv(max_len, split_keys)));
  plan.split_keys = static_cast<int>(split_keys);

  if (plan.max_splits > 1) {
    plan.workspace_bytes = LayoutWorkspace(plan).bytes;
    const size_t merged_bytes = static_cast<size_t>(std::min(plan.rows, plan.row_block)) * plan.max_splits *
                                l.head_dim * sizeof(float);
    plan.merge_in_kernel = merged_bytes <= options.max_fused_merge_bytes;
    if (plan.merge_in_kernel) {
      plan.counter_bytes = static_cast<size_t>(l.batch) * l.kv_heads * plan.m_blocks * sizeof(int32_t);
    }
  }
  return plan;
}

absl::Status LaunchDecode(const DecodePlan& plan, const DecodeTensors& t, const DecodeWorkspace& workspace,
                          cudaStream_t stream) {
  const BatchLayout& l = plan.layout;
  if (plan.rows == 0) return absl::FailedPreconditionError("plan: not made by MakeDecodePlan");
  if (absl::Status st = CheckRequired(
          {{"tensors.q", t.q}, {"tensors.k", t.k}, {"tensors.v", t.v}, {"tensors.o", t.o}});
      !st.ok()) {
    return st;
  }
  if (l.want_lse && t.lse == nullptr) return Invalid("tensors.lse", "null but the layout wants LSE");
  if (t.kv_lens == nullptr) return Invalid("tensors.kv_lens", "null");
  const bool paged = l.kv_storage == KvStorage::kPaged;
  if (paged && t.block_table == nullptr) return Invalid("tensors.block_table", "null for paged KV");
  if (absl::Status st = CheckPointer("workspace.partials", workspace.partials, plan.workspace_bytes > 0); !st.ok()) {
    return st;
  }
  if (l.append) {
    if (absl::Status st = CheckRequired({{"tensors.new_k", t.new_k}, {"tensors.new_v", t.new_v}}); !st.ok()) return st;
  }
  if (absl::Status st = CheckDescales(l, t.k_descale, t.v_descale); !st.ok()) return st;
  if (plan.counter_bytes > 0 && workspace.counters == nullptr) {
    return Invalid("workspace.counters", "null but the plan splits");
  }
  if (reinterpret_cast<uintptr_t>(workspace.counters) % alignof(int32_t) != 0) {
    return Invalid("workspace.counters", "not 4-byte aligned");
  }

  DecodeParams p;
  p.q = t.q;
  p.k = t.k;
  p.v = t.v;
  p.o = t.o;
  p.lse = l.want_lse ? t.lse : nullptr;
  p.kv_lens = t.kv_lens;
  p.block_table = paged ? t.block_table : nullptr;
  if (plan.max_splits > 1) {
    p.split_counters = workspace.counters;
    p.o_part = static_cast<float*>(workspace.partials);
    p.lse_part = reinterpret_cast<float*>(static_cast<uint8_t*>(workspace.partials) + LayoutWorkspace(plan).lse_offset);
  }
  p.q_sb = l.q.batch, p.q_ss = l.q.seq, p.q_sh = l.q.head;
  p.o_sb = l.o.batch, p.o_ss = l.o.seq, p.o_sh = l.o.head;
  p.k_sb = l.k.batch, p.k_ss = l.k.seq, p.k_sh = l.k.head;
  p.v_sb = l.v.batch, p.v_ss = l.v.seq, p.v_sh = l.v.head;
  p.batch = l.batch;
  p.q_len = l.q_len;
  p.q_heads = l.q_heads;
  p.kv_heads = l.kv_heads;
  p.group = l.q_heads / l.kv_heads;
  p.rows = plan.rows;
  p.m_blocks = plan.m_blocks;
  p.causal = l.mask == Mask::kCausalBottomRight ? 1 : 0;
  p.scale_log2 = l.scale * 1.4426950408889634f;
  p.page_shift = paged ? Log2(l.paged.page_size) : 0;
  p.max_pages_per_seq = paged ? l.paged.max_pages_per_seq : 0;
  p.split_keys = plan.split_keys;
  p.max_splits = plan.max_splits;
  p.merge_in_kernel = plan.merge_in_kernel ? 1 : 0;
  if (l.append) {
    p.new_k = t.new_k;
    p.new_v = t.new_v;
    // The layout's contract: with append the cache is writable.
    p.k_cache = const_cast<void*>(t.k);
    p.v_cache = const_cast<void*>(t.v);
    p.nk_sb = l.new_k.batch, p.nk_ss = l.new_k.seq, p.nk_sh = l.new_k.head;
    p.nv_sb = l.new_v.batch, p.nv_ss = l.new_v.seq, p.nv_sh = l.new_v.head;
  }
  p.k_descale = t.k_descale;
  p.v_descale = t.v_descale;

  const dim3 grid(static_cast<unsigned>(plan.max_splits), static_cast<unsigned>(l.kv_heads * plan.m_blocks),
                  static_cast<unsigned>(l.batch));
  cudaError_t err;
  switch (l.head_dim) {
    case 64:
      err = LaunchDecodeD64(p, l.dtype, Fp8Kv(l), plan.row_block, grid, stream);
      break;
    case 128:
      err = LaunchDecodeD128(p, l.dtype, Fp8Kv(l), plan.row_block, grid, stream);
      break;
    default:
      err = LaunchDecodeD256(p, l.dtype, Fp8Kv(l), plan.row_block, grid, stream);
      break;
  }
  if (absl::Status st = FromCuda(err, "decode kernel launch"); !st.ok()) return st;
  if (plan.max_splits > 1 && !plan.merge_in_kernel) {
    return FromCuda(LaunchMergeSplits(p, l.dtype, l.head_dim, stream), "decode merge launch");
  }
  return absl::OkStatus();
}

absl::StatusOr<AppendPlan> MakeAppendPlan(const BatchLayout& cache, int new_len, const Strides& new_k,
                                          const Strides& new_v, absl::Span<const int32_t> kv_lens,
                                          absl::Span<const int32_t> block_table) {
  if (absl::Status st = CheckCache(cache); !st.ok()) return st;
  if (new_len < 1) return Invalid("new_len", absl::StrCat(new_len, " < 1"));
  if (absl::Status st = CheckStrides("new_k", new_k); !st.ok()) return st;
  if (absl::Status st = CheckStrides("new_v", new_v); !st.ok()) return st;
  if (absl::Status st = CheckLengthsAndTable(cache, kv_lens, block_table, new_len, true); !st.ok()) return st;
  if (RowChunks(cache) * new_len > kMaxChunksPerSequence) {
    return Invalid("new_len", absl::StrCat(new_len, " rows of ", RowChunks(cache),
                                           " 16-byte chunks exceed a launch's 2^31 chunks per sequence"));
  }
  return AppendPlan{cache, new_len, new_k, new_v};
}

absl::Status LaunchAppend(const AppendPlan& plan, const AppendTensors& t, cudaStream_t stream) {
  const BatchLayout& l = plan.layout;
  if (plan.new_len < 1) return absl::FailedPreconditionError("plan: not made by MakeAppendPlan");
  if (absl::Status st = CheckRequired({{"tensors.new_k", t.new_k}, {"tensors.new_v", t.new_v}}); !st.ok()) return st;
  AppendParams p;
  if (absl::Status st = SetCacheFields(l, t, &p); !st.ok()) return st;
  p.new_k = t.new_k;
  p.new_v = t.new_v;
  p.nk_sb = plan.new_k.batch, p.nk_ss = plan.new_k.seq, p.nk_sh = plan.new_k.head;
  p.nv_sb = plan.new_v.batch, p.nv_ss = plan.new_v.seq, p.nv_sh = plan.new_v.head;
  p.new_len = plan.new_len;
  p.new_bf16 = l.dtype == DType::kBF16 ? 1 : 0;
  return FromCuda(LaunchAppendKv(p, stream), "append launch");
}

absl::StatusOr<GatherPlan> MakeGatherPlan(const BatchLayout& cache, int capacity, const Strides& out_k,
                                          const Strides& out_v, absl::Span<const int32_t> kv_lens,
                                          absl::Span<const int32_t> block_table) {
  if (cache.kv_storage != KvStorage::kPaged) return Invalid("cache.kv_storage", "a gather reads paged KV");
  if (absl::Status st = CheckCache(cache); !st.ok()) return st;
  if (capacity < 1) return Invalid("capacity", absl::StrCat(capacity, " < 1"));
  if (absl::Status st = CheckStrides("out_k", out_k); !st.ok()) return st;
  if (absl::Status st = CheckStrides("out_v", out_v); !st.ok()) return st;
  if (absl::Status st = CheckLengthsAndTable(cache, kv_lens, block_table, 0, false); !st.ok()) return st;
  if (RowChunks(cache) * capacity > kMaxChunksPerSequence) {
    return Invalid("capacity", absl::StrCat(capacity, " rows of ", RowChunks(cache),
                                            " 16-byte chunks exceed a launch's 2^31 chunks per sequence"));
  }
  int max_kv_len = 0;
  for (size_t b = 0; b < kv_lens.size(); ++b) {
    if (kv_lens[b] > capacity) {
      return Invalid(absl::StrCat("kv_lens[", b, "]"),
                     absl::StrCat(kv_lens[b], " exceeds the output's capacity of ", capacity, " rows"));
    }
    max_kv_len = std::max(max_kv_len, kv_lens[b]);
  }
  return GatherPlan{cache, capacity, out_k, out_v, max_kv_len};
}

absl::Status LaunchGather(const GatherPlan& plan, const GatherTensors& t, cudaStream_t stream) {
  const BatchLayout& l = plan.layout;
  if (plan.capacity < 1) return absl::FailedPreconditionError("plan: not made by MakeGatherPlan");
  if (absl::Status st = CheckRequired({{"tensors.out_k", t.out_k}, {"tensors.out_v", t.out_v}}); !st.ok()) return st;
  GatherParams p;
  if (absl::Status st = SetCacheFields(l, t, &p); !st.ok()) return st;
  p.out_k = t.out_k;
  p.out_v = t.out_v;
  p.ok_sb = plan.out_k.batch, p.ok_ss = plan.out_k.seq, p.ok_sh = plan.out_k.head;
  p.ov_sb = plan.out_v.batch, p.ov_ss = plan.out_v.seq, p.ov_sh = plan.out_v.head;
  p.capacity = plan.capacity;
  p.max_kv_len = plan.max_kv_len;
  p.out_bf16 = l.dtype == DType::kBF16 ? 1 : 0;
  return FromCuda(LaunchGatherKv(p, stream), "gather launch");
}

}  // namespace attnd::kernels::decode
