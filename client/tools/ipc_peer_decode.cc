// ipc_peer decode (the modes: ipc_peer.cc).
#include "ipc_peer.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "attnd/client/bench.h"
#include "attnd/client/client.h"
#include "attnd/client/tensors.h"
#include "attnd/kernels/decode.h"

ABSL_FLAG(std::string, decode_sequences, "1,64", "decode: sequences stepping together, one run each");
ABSL_FLAG(int64_t, context, 4096, "decode: tokens prefilled into each sequence before the steps");
ABSL_FLAG(int64_t, steps, 300, "decode: measured steps per sequence (each: one Step per layer for all sequences)");
ABSL_FLAG(int64_t, layers, 1, "decode: layers of each sequence");
ABSL_FLAG(int, decode_callers, 1,
          "decode: callers (threads) the sequences are split between, each stepping its share in one Step per layer");

namespace ipc_peer {
namespace {

// Decode steps through registered buffers. One allocation holds Q [S, q_heads, d], the new K and V [S, kv_heads,
// d] and the prefill chunk's K and V [context, kv_heads, d] (registration "inputs"); O [S, q_heads, d] is a
// registration of its own. Every step appends the same new row of each sequence, so the keys a sequence holds
// after n appends are the prefill chunk followed by n copies of its new row: what the oracle recomputes.
struct DecodeBuffers {
  int64_t seqs = 0, context = 0, q_row = 0, kv_row = 0;  // rows in elements
  uint64_t q_off = 0, k_off = 0, v_off = 0, pk_off = 0, pv_off = 0, in_bytes = 0, o_off = 0, total = 0;
  uint8_t* base = nullptr;
  std::string inputs_id, out_id;
  std::string q, k, v, pk, pv;  // host copies

  uint64_t o_bytes() const { return static_cast<uint64_t>(seqs * q_row) * 2; }
};

constexpr int kDecodeQHeads = 32, kDecodeKvHeads = 8, kDecodeHeadDim = 128;

absl::StatusOr<DecodeBuffers> MakeDecodeBuffers(client::Client& c, int64_t seqs, int64_t context) {
  DecodeBuffers b;
  b.seqs = seqs;
  b.context = context;
  b.q_row = kDecodeQHeads * kDecodeHeadDim;
  b.kv_row = kDecodeKvHeads * kDecodeHeadDim;
  const uint64_t qb = static_cast<uint64_t>(seqs * b.q_row) * 2, kb = static_cast<uint64_t>(seqs * b.kv_row) * 2;
  const uint64_t pb = static_cast<uint64_t>(context * b.kv_row) * 2;
  b.k_off = Align(qb);
  b.v_off = b.k_off + Align(kb);
  b.pk_off = b.v_off + Align(kb);
  b.pv_off = b.pk_off + Align(pb);
  b.in_bytes = b.pv_off + Align(pb);
  b.o_off = b.in_bytes;
  b.total = b.o_off + Align(qb);
  void* p = nullptr;
  CUDA_OR_DIE(cudaMalloc(&p, b.total));
  b.base = static_cast<uint8_t*>(p);
  b.q = client::RandomTensor(DType::kBF16, seqs * b.q_row, 101);
  b.k = client::RandomTensor(DType::kBF16, seqs * b.kv_row, 102);
  b.v = client::RandomTensor(DType::kBF16, seqs * b.kv_row, 103);
  b.pk = client::RandomTensor(DType::kBF16, context * b.kv_row, 104);
  b.pv = client::RandomTensor(DType::kBF16, context * b.kv_row, 105);
  CUDA_OR_DIE(cudaMemcpy(b.base + b.q_off, b.q.data(), b.q.size(), cudaMemcpyHostToDevice));
  CUDA_OR_DIE(cudaMemcpy(b.base + b.k_off, b.k.data(), b.k.size(), cudaMemcpyHostToDevice));
  CUDA_OR_DIE(cudaMemcpy(b.base + b.v_off, b.v.data(), b.v.size(), cudaMemcpyHostToDevice));
  CUDA_OR_DIE(cudaMemcpy(b.base + b.pk_off, b.pk.data(), b.pk.size(), cudaMemcpyHostToDevice));
  CUDA_OR_DIE(cudaMemcpy(b.base + b.pv_off, b.pv.data(), b.pv.size(), cudaMemcpyHostToDevice));
  cudaIpcMemHandle_t h;
  CUDA_OR_DIE(cudaIpcGetMemHandle(&h, p));
  const std::string handle(reinterpret_cast<const char*>(&h), sizeof h);
  absl::StatusOr<std::string> id = RegisterRegion(c, handle, 0, b.in_bytes, "decode inputs");
  if (!id.ok()) return id.status();
  b.inputs_id = *id;
  id = RegisterRegion(c, handle, b.o_off, qb, "decode out");
  if (!id.ok()) return id.status();
  b.out_id = *id;
  return b;
}

v1::TensorRef DecodeRef(const std::string& id, uint64_t offset) {
  v1::TensorRef ref;
  ref.set_buffer_id(id);
  ref.set_offset(offset);
  return ref;
}

// The decode kernel alone on the batch the server runs: S sequences of `keys` keys in pages of `page` tokens
// (shuffled, as a pool hands them out), Q and O from `b`. Back-to-back launches timed with events (burst), and
// the median of single launches (isolated).
KernelOnly DecodeKernelOnlyUs(const DecodeBuffers& b, int64_t keys, int page) {
  namespace dk = attnd::kernels::decode;
  const int64_t per_seq = (keys + page - 1) / page;
  const int64_t pages = per_seq * b.seqs;
  dk::BatchLayout l;
  l.batch = static_cast<int>(b.seqs);
  l.q_len = 1;
  l.q_heads = kDecodeQHeads;
  l.kv_heads = kDecodeKvHeads;
  l.head_dim = kDecodeHeadDim;
  l.dtype = DType::kBF16;
  l.scale = attnd::DefaultScale(kDecodeHeadDim);
  l.q = l.o = attnd::Strides{b.q_row, b.q_row, kDecodeHeadDim};
  l.kv_storage = dk::KvStorage::kPaged;
  l.k = l.v = attnd::Strides{page * b.kv_row, b.kv_row, kDecodeHeadDim};
  l.paged = dk::PagedKv{page, static_cast<int>(pages), static_cast<int>(per_seq)};
  std::vector<int32_t> table(static_cast<size_t>(pages)), lens(static_cast<size_t>(b.seqs), static_cast<int32_t>(keys));
  for (int64_t i = 0; i < pages; ++i) table[i] = static_cast<int32_t>(i);
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (int64_t i = pages - 1; i > 0; --i) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    std::swap(table[i], table[x % static_cast<uint64_t>(i + 1)]);
  }
  absl::StatusOr<dk::DecodePlan> plan = dk::MakeDecodePlan(l, lens, table);
  if (!plan.ok()) {
    Fail(absl::StrCat("decode plan: ", plan.status().ToString()));
    return {};
  }
  const uint64_t pool = static_cast<uint64_t>(pages * page * b.kv_row) * 2;
  void *k = nullptr, *v = nullptr, *o = nullptr, *ws = nullptr, *dlens = nullptr, *dtable = nullptr;
  CUDA_OR_DIE(cudaMalloc(&k, pool));
  CUDA_OR_DIE(cudaMalloc(&v, pool));
  CUDA_OR_DIE(cudaMalloc(&o, b.o_bytes()));
  CUDA_OR_DIE(cudaMalloc(&dlens, lens.size() * sizeof(int32_t)));
  CUDA_OR_DIE(cudaMalloc(&dtable, table.size() * sizeof(int32_t)));
  int32_t* counters = nullptr;
  if (plan->workspace_bytes > 0) CUDA_OR_DIE(cudaMalloc(&ws, plan->workspace_bytes));
  if (plan->counter_bytes > 0) {
    CUDA_OR_DIE(cudaMalloc(reinterpret_cast<void**>(&counters), plan->counter_bytes));
    CUDA_OR_DIE(cudaMemset(counters, 0, plan->counter_bytes));  // once: every launch leaves them zero
  }
  CUDA_OR_DIE(cudaMemset(k, 0x3C, pool));  // bf16 0x3C3C: 0.0115, a finite value in every element
  CUDA_OR_DIE(cudaMemset(v, 0x3C, pool));
  CUDA_OR_DIE(cudaMemcpy(dlens, lens.data(), lens.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  CUDA_OR_DIE(cudaMemcpy(dtable, table.data(), table.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  dk::DecodeTensors t;
  t.q = b.base + b.q_off;
  t.k = k;
  t.v = v;
  t.o = o;
  t.kv_lens = static_cast<const int32_t*>(dlens);
  t.block_table = static_cast<const int32_t*>(dtable);
  cudaStream_t st;
  CUDA_OR_DIE(cudaStreamCreate(&st));
  KernelOnly r;
  {
    LaunchTimer timer(st, [&] {
      if (absl::Status s = dk::LaunchDecode(*plan, t, {ws, counters}, st); !s.ok()) Fail(s.ToString());
    });
    (void)timer.Time(20);
    timer.BurstAndSingles(200, 101, &r);
  }
  cudaStreamDestroy(st);
  for (void* p : {k, v, o, ws, static_cast<void*>(counters), dlens, dtable}) {
    if (p != nullptr) CUDA_OR_DIE(cudaFree(p));
  }
  return r;
}

// Poisons O, runs `req` (one step of sequences first .. first + count - 1), and checks its first and last sequence
// against the oracle over the keys they hold after it (StepResult.lengths). "" when both pass.
std::string DecodeCheck(client::Client& c, const v1::StepRequest& req, const DecodeBuffers& b, int64_t first,
                        int64_t count) {
  CUDA_OR_DIE(cudaMemset(b.base + b.o_off, 0xFF, b.o_bytes()));
  CUDA_OR_DIE(cudaDeviceSynchronize());
  absl::StatusOr<client::StepResult> r = c.Step(req);
  if (!r.ok()) return absl::StrCat("step failed: ", r.status().ToString());
  if (!r->o.empty()) return "O came inline although o_ref was given";
  // The server still copies the step's page tables in (h2d); nothing of Q, K, V or O travels, so nothing comes back.
  if (r->timing.timing().d2h_us() != 0) {
    return absl::StrCat("the zero-copy step copied O back: d2h ", r->timing.timing().d2h_us(), " us");
  }
  std::string o(b.o_bytes(), '\0');
  CUDA_OR_DIE(cudaMemcpy(o.data(), b.base + b.o_off, o.size(), cudaMemcpyDeviceToHost));
  const uint64_t q_row = static_cast<uint64_t>(b.q_row) * 2, kv_row = static_cast<uint64_t>(b.kv_row) * 2;
  for (int64_t i : {int64_t{0}, count - 1}) {
    const int64_t s = first + i;
    const int64_t keys = r->lengths[static_cast<size_t>(i)];
    if (keys <= b.context) return absl::StrCat("sequence ", s, " holds ", keys, " keys after a step");
    attnd::Problem p;
    p.shape = Shape{1, 1, keys, kDecodeQHeads, kDecodeKvHeads, kDecodeHeadDim};
    p.scale = attnd::DefaultScale(kDecodeHeadDim);
    std::string k = b.pk, v = b.pv;
    for (int64_t n = b.context; n < keys; ++n) {
      k.append(b.k, s * kv_row, kv_row);
      v.append(b.v, s * kv_row, kv_row);
    }
    absl::StatusOr<client::Oracle> oracle = client::Oracle::Compute(p, b.q.substr(s * q_row, q_row), k, v);
    if (!oracle.ok()) return oracle.status().ToString();
    const client::VerifyReport rep = oracle->Check(std::string_view(o).substr(s * q_row, q_row), "");
    if (!rep.pass) return absl::StrCat("sequence ", s, " at ", keys, " keys: ", rep.detail);
  }
  return "";
}

// One decode caller's share: sequences first .. first + count - 1, and its Step request of each layer.
struct Group {
  int64_t first = 0, count = 0;
  std::vector<v1::StepRequest> reqs;  // per layer
};

// The counts of one run (one --decode_sequences value): errors of every phase, the checks, and the measured
// steps' timings; the callers write them under mu.
struct DecodeCounts {
  absl::Mutex mu;
  int64_t errors = 0;
  std::string first_error;
  std::vector<double> lat;
  double queue = 0, kernel = 0, total = 0;
  int64_t batch = 0;
  int64_t verified = 0, verify_failures = 0;

  void Note(const absl::Status& s) {
    ++errors;
    if (first_error.empty()) first_error = s.ToString();
  }
};

// Prefill: each sequence's layers from the registered chunk, append only.
void DecodePrefill(client::Client& c, const DecodeBuffers& b, const std::vector<std::string>& ids, int64_t layers,
                   DecodeCounts& counts) {
  const int64_t seqs = b.seqs, context = b.context;
  for (int64_t l = 0; l < layers && counts.errors == 0; ++l) {
    for (int64_t s = 0; s < seqs && counts.errors == 0; ++s) {
      client::StepSpec spec;
      spec.sequences.push_back({ids[s], context});
      spec.layer = l;
      spec.k.ref = DecodeRef(b.inputs_id, b.pk_off);
      spec.v.ref = DecodeRef(b.inputs_id, b.pv_off);
      if (absl::StatusOr<client::StepResult> r = c.Step(spec); !r.ok()) counts.Note(r.status());
    }
  }
}

// `callers` groups of near-equal size, and each group's Step request of every layer through the registered buffers.
absl::StatusOr<std::vector<Group>> DecodeGroups(const DecodeBuffers& b, const std::vector<std::string>& ids,
                                                int64_t callers, int64_t layers) {
  const int64_t seqs = b.seqs;
  std::vector<Group> groups(static_cast<size_t>(callers));
  const uint64_t q_row = static_cast<uint64_t>(b.q_row) * 2, kv_row = static_cast<uint64_t>(b.kv_row) * 2;
  for (int64_t g = 0, first = 0; g < callers; ++g) {
    Group& gr = groups[g];
    gr.first = first;
    gr.count = seqs / callers + (g < seqs % callers ? 1 : 0);
    first += gr.count;
    for (int64_t l = 0; l < layers; ++l) {
      client::StepSpec spec;
      for (int64_t i = gr.first; i < gr.first + gr.count; ++i) spec.sequences.push_back({ids[i], 1});
      spec.layer = l;
      spec.q_heads = kDecodeQHeads;
      spec.q.ref = DecodeRef(b.inputs_id, b.q_off + gr.first * q_row);
      spec.k.ref = DecodeRef(b.inputs_id, b.k_off + gr.first * kv_row);
      spec.v.ref = DecodeRef(b.inputs_id, b.v_off + gr.first * kv_row);
      spec.o_ref = DecodeRef(b.out_id, gr.first * q_row);
      absl::StatusOr<v1::StepRequest> req = client::MakeStepRequest(spec);
      if (!req.ok()) return req.status();
      gr.reqs.push_back(*std::move(req));
    }
  }
  return groups;
}

// One group's caller; the timings of a measured run go into counts.
void DecodeCaller(client::Client& c, const Group& gr, int64_t n, bool measured, DecodeCounts& counts) {
  cudaSetDevice(absl::GetFlag(FLAGS_device));
  std::vector<double> mine;
  double q = 0, k = 0, t = 0;
  int64_t most = 0;
  for (int64_t i = 0; i < n; ++i) {
    for (const v1::StepRequest& req : gr.reqs) {
      const absl::Time t0 = absl::Now();
      absl::StatusOr<client::StepResult> r = c.Step(req);
      const absl::Time t1 = absl::Now();
      if (!r.ok()) {
        absl::MutexLock lock(&counts.mu);
        counts.Note(r.status());
        return;
      }
      mine.push_back(absl::ToDoubleMicroseconds(t1 - t0));
      q += r->timing.timing().queue_us();
      k += r->timing.timing().kernel_us();
      t += r->timing.timing().total_us();
      most = std::max<int64_t>(most, r->timing.batch_sequences());
    }
  }
  if (!measured) return;
  absl::MutexLock lock(&counts.mu);
  counts.lat.insert(counts.lat.end(), mine.begin(), mine.end());
  counts.queue += q, counts.kernel += k, counts.total += t;
  counts.batch = std::max(counts.batch, most);
}

// Every caller runs n steps of its group (all layers each), one thread per group.
void RunDecodeSteps(client::Client& c, const std::vector<Group>& groups, int64_t n, bool measured,
                    DecodeCounts& counts) {
  std::vector<std::thread> threads;
  for (const Group& gr : groups) {
    threads.emplace_back([&c, &gr, &counts, n, measured] { DecodeCaller(c, gr, n, measured, counts); });
  }
  for (std::thread& th : threads) th.join();
}

// Each group's next step checked against the oracle (DecodeCheck); none once an error is counted.
void VerifyDecode(client::Client& c, const std::vector<Group>& groups, const DecodeBuffers& b, DecodeCounts& counts) {
  for (const Group& gr : groups) {
    if (counts.errors > 0) return;
    const std::string why = DecodeCheck(c, gr.reqs[0], b, gr.first, gr.count);
    ++counts.verified;
    if (!why.empty()) {
      ++counts.verify_failures;
      if (counts.first_error.empty()) counts.first_error = why;
    }
    for (size_t l = 1; l < gr.reqs.size() && counts.errors == 0; ++l) {  // the other layers take the same step
      if (absl::StatusOr<client::StepResult> r = c.Step(gr.reqs[l]); !r.ok()) counts.Note(r.status());
    }
  }
}

// One --decode_sequences value: prefill, warm-up and measured steps, each checked after, and its CSV row.
// 1: the mode cannot go on.
int DecodeRun(client::Client& c, int64_t seqs, int64_t context, int64_t steps, int64_t layers, int page,
              bool use_shm) {
  absl::StatusOr<DecodeBuffers> made = MakeDecodeBuffers(c, seqs, context);
  if (!made.ok()) return Fail(made.status().ToString()), 1;
  const DecodeBuffers& b = *made;
  client::SequenceShape shape;
  shape.layers = layers;
  shape.kv_heads = kDecodeKvHeads;
  shape.head_dim = kDecodeHeadDim;
  absl::StatusOr<client::OpenedSequences> opened =
      c.OpenSequence(shape, context + steps + 64, static_cast<uint32_t>(seqs));
  if (!opened.ok()) return Fail(opened.status().ToString()), 1;
  const std::vector<std::string>& ids = opened->ids;
  DecodeCounts counts;
  DecodePrefill(c, b, ids, layers, counts);
  // Callers: the sequences split into --decode_callers groups, each stepping its own in one Step per layer.
  const int64_t callers = std::min<int64_t>(std::max(1, absl::GetFlag(FLAGS_decode_callers)), seqs);
  absl::StatusOr<std::vector<Group>> groups = DecodeGroups(b, ids, callers, layers);
  if (!groups.ok()) return Fail(groups.status().ToString()), 1;
  RunDecodeSteps(c, *groups, std::min<int64_t>(20, steps), false, counts);
  VerifyDecode(c, *groups, b, counts);
  const absl::Time start = absl::Now();
  RunDecodeSteps(c, *groups, steps, true, counts);
  const double elapsed = absl::ToDoubleSeconds(absl::Now() - start);
  VerifyDecode(c, *groups, b, counts);
  // At the keys the measured steps held on average.
  const KernelOnly k = DecodeKernelOnlyUs(b, context + std::min<int64_t>(20, steps) + 1 + steps / 2, page);
  const double n = counts.lat.empty() ? 1 : static_cast<double>(counts.lat.size());
  std::sort(counts.lat.begin(), counts.lat.end());
  const double tokens_per_s = elapsed > 0 && counts.errors == 0 ? static_cast<double>(seqs * steps) / elapsed : 0;
  const double kernel_rate = k.burst_us > 0 ? static_cast<double>(seqs) / (k.burst_us * 1e-6) / layers : 0;
  const double p50 = client::Percentile(counts.lat, 50);
  std::printf("csv,%s,%d,%d,%d,%d,%d,%zu,%.1f,%.1f,%.1f,%.0f,%.1f,%.1f,%.0f,%.3f,%.1f,%.1f,%.1f,%.1f,%d,%d,%d\n",
              use_shm ? "ipc_shm" : "ipc", static_cast<int>(seqs), static_cast<int>(callers),
              static_cast<int>(context), static_cast<int>(layers), static_cast<int>(steps), counts.lat.size(), p50,
              client::Percentile(counts.lat, 90), client::Percentile(counts.lat, 99), tokens_per_s, k.burst_us,
              k.isolated_us, kernel_rate, kernel_rate > 0 ? tokens_per_s / kernel_rate : 0, p50 - k.isolated_us,
              counts.queue / n, counts.kernel / n, counts.total / n, static_cast<int>(counts.batch),
              static_cast<int>(counts.verified), static_cast<int>(counts.verify_failures));
  std::fflush(stdout);
  if (counts.errors > 0) {
    Fail(absl::StrCat("decode ", seqs, " sequences: ", counts.errors, " errors, first: ", counts.first_error));
  }
  if (counts.verify_failures > 0) {
    Fail(absl::StrCat("decode ", seqs, " sequences: wrong replies: ", counts.first_error));
  }
  if (absl::Status s = c.CloseSequence(ids); !s.ok()) Fail(absl::StrCat("close: ", s.ToString()));
  (void)c.UnregisterCudaBuffer(b.out_id);
  (void)c.UnregisterCudaBuffer(b.inputs_id);
  CUDA_OR_DIE(cudaFree(b.base));
  return 0;
}

}  // namespace

int Decode(client::Client& c) {
  const bool use_shm = absl::GetFlag(FLAGS_transport) == "shm";
  if (!use_shm && absl::GetFlag(FLAGS_transport) != "grpc") return Fail("--transport: grpc or shm"), 1;
  const int64_t context = absl::GetFlag(FLAGS_context), steps = absl::GetFlag(FLAGS_steps);
  const int64_t layers = absl::GetFlag(FLAGS_layers);
  if (context < 1 || steps < 1 || layers < 1) return Fail("--context, --steps, --layers: must be >= 1"), 1;
  absl::StatusOr<v1::ServerInfo> info = c.ServerInfo();
  if (!info.ok()) return Fail(info.status().ToString()), 1;
  const int page = info->sequences().page_tokens();
  std::printf("csv,mode,sequences,callers,context,layers,steps,calls,p50_us,p90_us,p99_us,tokens_per_s,kernel_only_us,"
              "kernel_only_isolated_us,kernel_tokens_per_s,x_kernel_rate,p50_minus_kernel_us,srv_queue_us,"
              "srv_kernel_us,srv_total_us,batch_sequences,verified,verify_failures\n");
  for (int64_t seqs : Ints(absl::GetFlag(FLAGS_decode_sequences))) {
    if (seqs < 1) return Fail("--decode_sequences: each >= 1"), 1;
    if (int rc = DecodeRun(c, seqs, context, steps, layers, page, use_shm); rc != 0) return rc;
  }
  return failures == 0 ? 0 : 1;
}

}  // namespace ipc_peer
