// ipc_peer: a second process that owns CUDA buffers and uses an attnd server through CUDA IPC, as a
// same-host inference engine would. Three modes:
//   check  --target=unix:/path   correctness of the zero-copy path (every mask/GQA/head_dim against the
//                                double-precision oracle, outputs poisoned before each call), rejection of bad
//                                handles and references, and --clients concurrent callers. Exit 0 = all passed.
//   bench  --target=unix:/path   client-observed latency/throughput of IPC Forward for batch 1, 32 heads,
//                                head_dim 128, causal, at --seqs and --concurrency, next to the kernel-only time
//                                measured here with the same kernel library; --verify_every checks replies.
//   decode --target=unix:/path   KV-sequence decode steps whose Q, new K/V and O live in this process's CUDA
//                                buffers: --decode_sequences sequences prefilled to --context, then one Step
//                                per layer for all of them (--transport grpc or shm), next to the decode
//                                kernel's own time on the same batch measured here; replies checked against
//                                the double-precision oracle before and after the measured steps.
//   tcp                          a plain TCP loopback transfer of the bytes an inline request moves (Q+K+V up,
//                                O down): the baseline of the inline transport's payload rate.
// Prints one line per finding; `bench` and `tcp` also print CSV rows prefixed "csv,".
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "attnd/client/bench.h"
#include "attnd/client/client.h"
#include "attnd/client/shm_channel.h"
#include "attnd/client/tensors.h"
#include "attnd/kernels/attention.h"
#include "attnd/kernels/decode.h"

ABSL_FLAG(std::string, target, "", "attnd server (unix:/path for IPC)");
ABSL_FLAG(int, device, 0, "CUDA device of the buffers (the server's numbering; same host, no CUDA_VISIBLE_DEVICES)");
ABSL_FLAG(int, clients, 8, "check: concurrent IPC callers");
ABSL_FLAG(int, requests, 8, "check: requests per concurrent caller");
ABSL_FLAG(std::string, seqs, "1024,4096", "bench: sequence lengths");
ABSL_FLAG(std::string, concurrency, "1,16", "bench: callers in flight");
ABSL_FLAG(double, duration_s, 3, "bench: measured seconds per point");
ABSL_FLAG(double, warmup_s, 0.5, "bench: unmeasured seconds per point");
ABSL_FLAG(int64_t, verify_every, 0, "bench: > 0: verify max(1, N/10) replies per caller after the measured span, all callers at once");
ABSL_FLAG(int, tcp_iters, 20, "tcp: transfers per size");
ABSL_FLAG(std::string, transport, "grpc", "bench: grpc (Forward RPCs on --target) or shm (the server's --shm_socket)");
ABSL_FLAG(std::string, shm_socket, "", "bench, decode --transport=shm: the server's shared-memory channel socket");
ABSL_FLAG(std::string, decode_sequences, "1,64", "decode: sequences stepping together, one run each");
ABSL_FLAG(int64_t, context, 4096, "decode: tokens prefilled into each sequence before the steps");
ABSL_FLAG(int64_t, steps, 300, "decode: measured steps per sequence (each: one Step per layer for all sequences)");
ABSL_FLAG(int64_t, layers, 1, "decode: layers of each sequence");
ABSL_FLAG(int, decode_callers, 1,
          "decode: callers (threads) the sequences are split between, each stepping its share in one Step per layer");

namespace {

using attnd::DType;
using attnd::Mask;
using attnd::Shape;
namespace client = attnd::client;
namespace v1 = attnd::v1;

int failures = 0;

void Fail(const std::string& what) {
  ++failures;
  std::printf("FAIL: %s\n", what.c_str());
  std::fflush(stdout);
}

void Pass(const std::string& what) {
  std::printf("ok: %s\n", what.c_str());
  std::fflush(stdout);
}

#define CUDA_OR_DIE(expr)                                                                         \
  do {                                                                                            \
    const cudaError_t _e = (expr);                                                                \
    if (_e != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "ipc_peer: %s: %s\n", #expr, cudaGetErrorString(_e));                \
      std::exit(3);                                                                               \
    }                                                                                             \
  } while (0)

uint64_t Align(uint64_t x) { return (x + 4095) & ~uint64_t{4095}; }

// One exported allocation holding Q, K, V (one registration, "inputs") and `outs` O regions (one
// registration each): registrations share the handle, as a real engine's pool would.
struct Buffers {
  Shape shape;
  uint64_t q_bytes = 0, kv_bytes = 0, o_off = 0, o_stride = 0, total = 0;
  uint8_t* base = nullptr;
  std::string handle;
  std::string inputs_id;
  std::vector<std::string> out_ids;

  uint64_t k_off() const { return Align(q_bytes); }
  uint64_t v_off() const { return Align(q_bytes) + Align(kv_bytes); }
  uint8_t* out(int i) const { return base + o_off + o_stride * i; }
};

Buffers Allocate(const Shape& s, int outs) {
  Buffers b;
  b.shape = s;
  b.q_bytes = static_cast<uint64_t>(attnd::QElems(s)) * 2;
  b.kv_bytes = static_cast<uint64_t>(attnd::KVElems(s)) * 2;
  b.o_off = Align(b.q_bytes) + 2 * Align(b.kv_bytes);
  b.o_stride = Align(b.q_bytes);
  b.total = b.o_off + b.o_stride * outs;
  void* p = nullptr;
  CUDA_OR_DIE(cudaMalloc(&p, b.total));
  b.base = static_cast<uint8_t*>(p);
  cudaIpcMemHandle_t h;
  CUDA_OR_DIE(cudaIpcGetMemHandle(&h, p));
  b.handle.assign(reinterpret_cast<const char*>(&h), sizeof h);
  return b;
}

absl::Status Register(client::Client& c, Buffers& b, int outs) {
  v1::RegisterCudaBufferRequest r;
  r.set_ipc_handle(b.handle);
  r.set_device(absl::GetFlag(FLAGS_device));
  r.set_offset(0);
  r.set_byte_size(b.o_off);
  r.set_name("inputs");
  absl::StatusOr<std::string> id = c.RegisterCudaBuffer(r);
  if (!id.ok()) return id.status();
  b.inputs_id = *id;
  for (int i = 0; i < outs; ++i) {
    r.set_offset(b.o_off + b.o_stride * i);
    r.set_byte_size(b.q_bytes);
    r.set_name(absl::StrCat("out", i));
    id = c.RegisterCudaBuffer(r);
    if (!id.ok()) return id.status();
    b.out_ids.push_back(*id);
  }
  return absl::OkStatus();
}

v1::ForwardRequest RefRequest(const client::RequestSpec& spec, const Buffers& b, int out) {
  v1::ForwardRequest req = client::MakeForwardRequest(spec, "", "", "");
  auto ref = [&](v1::TensorInput* in, uint64_t off) {
    in->Clear();
    in->mutable_ref()->set_buffer_id(b.inputs_id);
    in->mutable_ref()->set_offset(off);
  };
  ref(req.mutable_q(), 0);
  ref(req.mutable_k(), b.k_off());
  ref(req.mutable_v(), b.v_off());
  req.mutable_o_ref()->set_buffer_id(b.out_ids[out]);
  req.mutable_o_ref()->set_offset(0);
  return req;
}

struct Inputs {
  std::string q, k, v;
};

Inputs Upload(const client::RequestSpec& spec, const Buffers& b, uint64_t seed) {
  Inputs in{client::RandomTensor(spec.dtype, attnd::QElems(spec.shape), seed * 3),
            client::RandomTensor(spec.dtype, attnd::KVElems(spec.shape), seed * 3 + 1),
            client::RandomTensor(spec.dtype, attnd::KVElems(spec.shape), seed * 3 + 2)};
  CUDA_OR_DIE(cudaMemcpy(b.base, in.q.data(), in.q.size(), cudaMemcpyHostToDevice));
  CUDA_OR_DIE(cudaMemcpy(b.base + b.k_off(), in.k.data(), in.k.size(), cudaMemcpyHostToDevice));
  CUDA_OR_DIE(cudaMemcpy(b.base + b.v_off(), in.v.data(), in.v.size(), cudaMemcpyHostToDevice));
  return in;
}

// Poisons O (all-ones bf16/fp16 is NaN), calls, reads O back and checks it.
using ForwardFn = std::function<absl::StatusOr<client::ForwardResult>(const v1::ForwardRequest&)>;

std::string CallAndCheck(const ForwardFn& forward, const v1::ForwardRequest& req, const Buffers& b, int out,
                         const client::Oracle& oracle) {
  // cudaMemset is asynchronous to the host: finish it before the server writes O, or it lands after.
  CUDA_OR_DIE(cudaMemset(b.out(out), 0xFF, b.q_bytes));
  CUDA_OR_DIE(cudaDeviceSynchronize());
  absl::StatusOr<client::ForwardResult> r = forward(req);
  if (!r.ok()) return absl::StrCat("call failed: ", r.status().ToString());
  if (!r->o.empty()) return "O came inline although o_ref was given";
  if (r->timing.h2d_us() != 0 || (r->timing.d2h_us() != 0 && !req.return_lse())) {
    return absl::StrCat("the zero-copy path copied: h2d ", r->timing.h2d_us(), " us, d2h ", r->timing.d2h_us(), " us");
  }
  if (r->device != absl::GetFlag(FLAGS_device)) {
    return absl::StrCat("ran on device ", r->device, " but the buffers are on device ", absl::GetFlag(FLAGS_device));
  }
  std::string o(b.q_bytes, '\0');
  CUDA_OR_DIE(cudaMemcpy(o.data(), b.out(out), b.q_bytes, cudaMemcpyDeviceToHost));
  const client::VerifyReport v = oracle.Check(o, r->lse);
  if (!v.pass) return absl::StrCat("wrong answer: ", v.detail);
  return "";
}

std::string CallAndCheck(client::Client& c, const v1::ForwardRequest& req, const Buffers& b, int out,
                         const client::Oracle& oracle) {
  return CallAndCheck([&c](const v1::ForwardRequest& r) { return c.Forward(r); }, req, b, out, oracle);
}

void ExpectCode(const std::string& what, const absl::Status& s, absl::StatusCode code, const std::string& field) {
  if (s.code() != code) {
    return Fail(absl::StrCat(what, ": expected ", absl::StatusCodeToString(code), ", got ", s.ToString()));
  }
  if (!field.empty() && s.message().find(field) == absl::string_view::npos) {
    return Fail(absl::StrCat(what, ": the message does not name ", field, ": ", s.message()));
  }
  Pass(absl::StrCat(what, " -> ", absl::StatusCodeToString(code), " (", s.message(), ")"));
}

int Check(client::Client& c) {
  // Correctness over every mask, GQA ratio and head_dim, with lengths that are not tile multiples; with
  // --shm_socket every case again over the shared-memory channel.
  std::unique_ptr<client::ShmChannel> shm;
  if (!absl::GetFlag(FLAGS_shm_socket).empty()) {
    client::ShmChannelOptions so;
    so.socket_path = absl::GetFlag(FLAGS_shm_socket);
    absl::StatusOr<std::unique_ptr<client::ShmChannel>> opened = client::ShmChannel::Connect(so);
    if (!opened.ok()) return Fail(absl::StrCat("shm channel: ", opened.status().ToString())), 1;
    shm = *std::move(opened);
  }
  int cases = 0;
  for (int64_t hd : {64, 128, 256}) {
    const Shape s{2, 200, 333, 8, 8, hd};
    Buffers b = Allocate(s, 1);
    if (absl::Status st = Register(c, b, 1); !st.ok()) {
      Fail(absl::StrCat("register: ", st.ToString()));
      return 1;
    }
    for (Mask m : {Mask::kNone, Mask::kCausalTopLeft, Mask::kCausalBottomRight}) {
      for (int64_t kvh : {8, 2, 1}) {
        client::RequestSpec spec;
        spec.shape = s;
        spec.shape.kv_heads = kvh;
        spec.mask = m;
        spec.want_lse = (cases % 2) == 0;
        spec.dtype = (cases % 5 == 4) ? DType::kFP16 : DType::kBF16;
        Inputs in = Upload(spec, b, 100 + cases);
        auto oracle = client::Oracle::Compute(spec.ToProblem(), in.q, in.k, in.v);
        if (!oracle.ok()) return Fail(oracle.status().ToString()), 1;
        const std::string why = CallAndCheck(c, RefRequest(spec, b, 0), b, 0, *oracle);
        const std::string what = absl::StrFormat("ipc d%d %s kv_heads %d %s%s", hd, attnd::MaskName(m), kvh,
                                                 attnd::DTypeName(spec.dtype), spec.want_lse ? " +lse" : "");
        why.empty() ? Pass(what) : Fail(absl::StrCat(what, ": ", why));
        if (shm != nullptr) {
          const std::string why_shm = CallAndCheck(
              [&](const v1::ForwardRequest& r) { return client::ForwardOverShm(*shm, r); }, RefRequest(spec, b, 0), b, 0, *oracle);
          why_shm.empty() ? Pass(what + " (shm)") : Fail(absl::StrCat(what, " (shm): ", why_shm));
        }
        ++cases;
      }
    }
    for (const std::string& id : b.out_ids) (void)c.UnregisterCudaBuffer(id);
    (void)c.UnregisterCudaBuffer(b.inputs_id);
    CUDA_OR_DIE(cudaFree(b.base));
  }

  // Bad input is rejected with the field named, and the server keeps serving.
  const Shape s{1, 128, 128, 4, 4, 64};
  Buffers b = Allocate(s, 1);
  if (absl::Status st = Register(c, b, 1); !st.ok()) return Fail(st.ToString()), 1;
  client::RequestSpec spec;
  spec.shape = s;
  Inputs in = Upload(spec, b, 7);
  auto oracle = client::Oracle::Compute(spec.ToProblem(), in.q, in.k, in.v);
  if (!oracle.ok()) return Fail(oracle.status().ToString()), 1;
  {
    v1::RegisterCudaBufferRequest r;
    std::string junk(64, '\0');
    for (int i = 0; i < 64; ++i) junk[i] = static_cast<char>(i * 37 + 11);
    r.set_ipc_handle(junk);
    r.set_device(absl::GetFlag(FLAGS_device));
    r.set_byte_size(4096);
    ExpectCode("register a forged handle", c.RegisterCudaBuffer(r).status(), absl::StatusCode::kInvalidArgument,
               "ipc_handle");
    r.set_ipc_handle(b.handle);
    r.set_offset(0);
    r.set_byte_size(b.total + 4096);
    ExpectCode("register past the allocation's end", c.RegisterCudaBuffer(r).status(),
               absl::StatusCode::kInvalidArgument, "byte_size");
    r.set_offset(b.total - 16);
    r.set_byte_size(32);
    ExpectCode("register a region straddling the end", c.RegisterCudaBuffer(r).status(),
               absl::StatusCode::kInvalidArgument, "byte_size");
    r.set_offset(0);
    r.set_byte_size(4096);
    r.set_device(999);
    ExpectCode("register on a device the server does not serve", c.RegisterCudaBuffer(r).status(),
               absl::StatusCode::kInvalidArgument, "device");
  }
  {
    v1::ForwardRequest req = RefRequest(spec, b, 0);
    req.mutable_v()->mutable_ref()->set_offset(b.o_off - 1024);  // V would run past the inputs region
    ExpectCode("V reference past its region", c.Forward(req).status(), absl::StatusCode::kInvalidArgument, "v.ref");
    req = RefRequest(spec, b, 0);
    req.mutable_o_ref()->set_offset(16);
    ExpectCode("O reference past its region", c.Forward(req).status(), absl::StatusCode::kInvalidArgument, "o_ref");
    req = RefRequest(spec, b, 0);
    req.mutable_q()->mutable_ref()->set_offset(~uint64_t{0} - 15);
    ExpectCode("offset near 2^64 (overflow)", c.Forward(req).status(), absl::StatusCode::kInvalidArgument, "q.ref");
    req = RefRequest(spec, b, 0);
    req.mutable_k()->mutable_ref()->set_buffer_id("cuda-1-0000000000000000");
    ExpectCode("unknown buffer id", c.Forward(req).status(), absl::StatusCode::kInvalidArgument, "k.ref");
    if (shm != nullptr) {
      ExpectCode("unknown buffer id (shm)", client::ForwardOverShm(*shm, req).status(), absl::StatusCode::kInvalidArgument, "k.ref");
    }
    req = RefRequest(spec, b, 0);
    // Valid strides (multiples of 16 bytes) whose span, 8x the contiguous one, runs past the region.
    const int64_t row = s.q_heads * s.head_dim;
    for (int64_t st : {8 * row * s.q_len, 8 * row, s.head_dim}) req.mutable_q()->mutable_ref()->add_strides(st);
    ExpectCode("strides reaching outside the region", c.Forward(req).status(), absl::StatusCode::kInvalidArgument,
               "q.ref");
    req = RefRequest(spec, b, 0);
    for (int i = 0; i < 3; ++i) req.mutable_k()->mutable_ref()->add_strides(i == 0 ? 1ll << 60 : 64);
    ExpectCode("strides the kernel cannot address", c.Forward(req).status(), absl::StatusCode::kInvalidArgument,
               "layout.k");
  }
  {
    const std::string why = CallAndCheck(c, RefRequest(spec, b, 0), b, 0, *oracle);
    why.empty() ? Pass("still correct after the rejected calls") : Fail(absl::StrCat("after rejections: ", why));
    auto list = c.ListCudaBuffers();
    if (!list.ok()) {
      Fail(list.status().ToString());
    } else {
      bool idle = true;
      for (const auto& info : *list) idle = idle && info.requests_in_flight() == 0;
      idle && list->size() >= 2 ? Pass(absl::StrCat("ListCudaBuffers: ", list->size(), " buffers, none in use"))
                                : Fail("ListCudaBuffers: buffers missing or still in use after the replies");
    }
    ExpectCode("unregister", c.UnregisterCudaBuffer(b.out_ids[0]), absl::StatusCode::kOk, "");
    ExpectCode("use after unregister", c.Forward(RefRequest(spec, b, 0)).status(), absl::StatusCode::kInvalidArgument,
               "o_ref");
    ExpectCode("unregister twice", c.UnregisterCudaBuffer(b.out_ids[0]), absl::StatusCode::kNotFound, "buffer_id");
    (void)c.UnregisterCudaBuffer(b.inputs_id);
  }
  CUDA_OR_DIE(cudaFree(b.base));

  // Concurrent callers, each with its own O region of one shared allocation and distinct inputs per request.
  const int clients = absl::GetFlag(FLAGS_clients), requests = absl::GetFlag(FLAGS_requests);
  if (clients > 0) {
    const Shape cs{1, 256, 256, 8, 2, 128};
    std::atomic<int> ok{0}, bad{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < clients; ++t) {
      threads.emplace_back([&, t] {
        cudaSetDevice(absl::GetFlag(FLAGS_device));
        Buffers mine = Allocate(cs, 1);
        if (!Register(c, mine, 1).ok()) {
          ++bad;
          return;
        }
        for (int i = 0; i < requests; ++i) {
          client::RequestSpec sp;
          sp.shape = cs;
          sp.mask = i % 2 ? Mask::kCausalTopLeft : Mask::kNone;
          Inputs in2 = Upload(sp, mine, 1000 + t * 100 + i);
          auto o2 = client::Oracle::Compute(sp.ToProblem(), in2.q, in2.k, in2.v, 1);
          const std::string why = o2.ok() ? CallAndCheck(c, RefRequest(sp, mine, 0), mine, 0, *o2) : "no oracle";
          if (why.empty()) {
            ++ok;
          } else {
            ++bad;
            Fail(absl::StrCat("concurrent caller ", t, " request ", i, ": ", why));
          }
        }
        (void)c.UnregisterCudaBuffer(mine.out_ids[0]);
        (void)c.UnregisterCudaBuffer(mine.inputs_id);
        cudaFree(mine.base);
      });
    }
    for (auto& th : threads) th.join();
    bad == 0 ? Pass(absl::StrCat(clients, " concurrent IPC callers: ", ok.load(), " correct replies"))
             : Fail(absl::StrCat(clients, " concurrent IPC callers: ", bad.load(), " failures"));
  }
  std::printf("%s: %d failures\n", failures == 0 ? "PASS" : "FAIL", failures);
  return failures == 0 ? 0 : 1;
}

std::vector<int64_t> Ints(const std::string& list) {
  std::vector<int64_t> out;
  for (absl::string_view p : absl::StrSplit(list, ',', absl::SkipWhitespace())) {
    int64_t v;
    if (absl::SimpleAtoi(p, &v)) out.push_back(v);
  }
  return out;
}

// Kernel-only time of the problem on the same GPU, back-to-back launches timed with events: a burst of 100
// (boost clocks) and launches sustained for `sustain`, as long as a measured point keeps the GPU busy (the
// clocks a loaded GPU settles at: on the H200 the sustained figure was up to ~15% slower at 4k). And the
// median of launches timed one at a time on an idle GPU, events around each as the server times a request's
// kernel: what one request's kernel costs when nothing runs before it. And the kernel benchmark's own method
// (kernels/bench/hopper_bench.py: triton's do_bench): the median of single launches, each after 256 MB of
// memset has flushed the L2.
struct KernelOnly {
  double burst_us = 0, sustained_us = 0, isolated_us = 0, flushed_us = 0;
};
KernelOnly KernelOnlyUs(const attnd::Problem& p, const Buffers& b, void* o, absl::Duration sustain) {
  attnd::kernels::DeviceTensors t{b.base, b.base + b.k_off(), b.base + b.v_off(), o, nullptr};
  auto plan = attnd::kernels::MakePlan(p, attnd::ContiguousLayout(p.shape), t);
  if (!plan.ok()) {
    Fail(absl::StrCat("kernel plan: ", plan.status().ToString()));
    return {};
  }
  cudaStream_t st;
  CUDA_OR_DIE(cudaStreamCreate(&st));
  void* ws = nullptr;  // the plan's workspace (one stream, so one serves every launch)
  if (plan->workspace_bytes > 0) {
    CUDA_OR_DIE(cudaMalloc(&ws, plan->workspace_bytes));
    CUDA_OR_DIE(cudaMemsetAsync(ws, 0, plan->workspace_bytes, st));
  }
  for (int i = 0; i < 10; ++i) (void)attnd::kernels::Launch(*plan, ws, st);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  const auto timed = [&](int n) {
    cudaEventRecord(e0, st);
    for (int i = 0; i < n; ++i) (void)attnd::kernels::Launch(*plan, ws, st);
    cudaEventRecord(e1, st);
    CUDA_OR_DIE(cudaEventSynchronize(e1));
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    return static_cast<double>(ms) * 1e3;
  };
  KernelOnly k;
  k.burst_us = timed(100) / 100;
  std::vector<double> one;
  for (int i = 0; i < 51; ++i) one.push_back(timed(1));
  std::nth_element(one.begin(), one.begin() + one.size() / 2, one.end());
  k.isolated_us = one[one.size() / 2];
  {
    constexpr size_t kFlushBytes = size_t{256} << 20;
    void* flush = nullptr;
    CUDA_OR_DIE(cudaMalloc(&flush, kFlushBytes));
    std::vector<double> flushed;
    for (int i = 0; i < 51; ++i) {
      CUDA_OR_DIE(cudaMemsetAsync(flush, 0, kFlushBytes, st));
      flushed.push_back(timed(1));
    }
    CUDA_OR_DIE(cudaFree(flush));
    std::nth_element(flushed.begin(), flushed.begin() + flushed.size() / 2, flushed.end());
    k.flushed_us = flushed[flushed.size() / 2];
  }
  double us = 0;
  int64_t launches = 0;
  for (const absl::Time end = absl::Now() + sustain; absl::Now() < end; launches += 50) us += timed(50);
  k.sustained_us = launches > 0 ? us / static_cast<double>(launches) : k.burst_us;
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaStreamDestroy(st);
  if (ws != nullptr) cudaFree(ws);
  return k;
}

int Bench(client::Client& c) {
  // What any RPC costs on this connection, to split the IPC latency into RPC floor and server work.
  absl::StatusOr<double> floor = client::MeasureRpcFloor(c, 1000);
  if (!floor.ok()) return Fail(floor.status().ToString()), 1;
  std::printf("csv,mode,rpc_floor_p50_us\ncsv,rpc_floor,%.1f\n", *floor);
  // kernel_only_us is the burst figure (p50_minus_kernel_us subtracts it); gpu_busy_ratio is the throughput
  // against the sustained kernel-only rate, gpu_busy_ratio_burst against the burst one.
  std::printf("csv,mode,seq,concurrency,requests,p50_us,p99_us,mean_us,req_per_s,kernel_only_us,kernel_only_req_per_s,"
              "p50_minus_kernel_us,gpu_busy_ratio,verified,verify_failures,srv_queue_us,srv_kernel_us,srv_total_us,"
              "kernel_only_sustained_us,gpu_busy_ratio_burst,kernel_only_isolated_us,kernel_only_flushed_us\n");
  const bool use_shm = absl::GetFlag(FLAGS_transport) == "shm";
  if (!use_shm && absl::GetFlag(FLAGS_transport) != "grpc") return Fail("--transport: grpc or shm"), 1;
  const std::vector<int64_t> concs = Ints(absl::GetFlag(FLAGS_concurrency));
  if (concs.empty()) return Fail("--concurrency: empty"), 1;
  const int max_conc = static_cast<int>(*std::max_element(concs.begin(), concs.end()));
  for (int64_t seq : Ints(absl::GetFlag(FLAGS_seqs))) {
    client::RequestSpec spec;
    spec.shape = Shape{1, seq, seq, 32, 32, 128};
    spec.mask = Mask::kCausalTopLeft;
    Buffers b = Allocate(spec.shape, max_conc + 1);
    if (absl::Status st = Register(c, b, max_conc); !st.ok()) return Fail(st.ToString()), 1;
    Inputs in = Upload(spec, b, 42);
    std::unique_ptr<client::Oracle> oracle;
    if (absl::GetFlag(FLAGS_verify_every) > 0) {
      auto o = client::Oracle::Compute(spec.ToProblem(), in.q, in.k, in.v);
      if (!o.ok()) return Fail(o.status().ToString()), 1;
      oracle = std::make_unique<client::Oracle>(*std::move(o));
    }
    const KernelOnly kernel = KernelOnlyUs(spec.ToProblem(), b, b.out(max_conc),
                                           absl::Seconds(absl::GetFlag(FLAGS_duration_s)));
    const double kernel_us = kernel.burst_us;
    for (int64_t conc : concs) {
      absl::Mutex mu;
      std::vector<double> lat;
      int64_t verified = 0, verify_failures = 0, errors = 0;
      double srv_queue = 0, srv_kernel = 0, srv_total = 0;  // sums over measured replies
      std::string first_error;
      const absl::Time warm_end = absl::Now() + absl::Seconds(absl::GetFlag(FLAGS_warmup_s));
      const absl::Time end = warm_end + absl::Seconds(absl::GetFlag(FLAGS_duration_s));
      std::vector<std::thread> threads;
      absl::Time first = absl::InfiniteFuture(), last = absl::InfinitePast();
      // Each caller has its own connection, as separate engine processes would. Verification runs after the
      // measured span (every caller at once, so still under concurrency): checking inside the loop would
      // take callers away for the copy and the check and lower the offered load.
      const int64_t verify_rounds = oracle ? std::max<int64_t>(1, absl::GetFlag(FLAGS_verify_every) / 10) : 0;
      for (int t = 0; t < conc; ++t) {
        threads.emplace_back([&, t] {
          cudaSetDevice(absl::GetFlag(FLAGS_device));
          client::ClientOptions co = c.options();
          co.own_connection = true;
          auto own = client::Client::Create(co);
          client::Client& cl = own.ok() ? **own : c;
          std::unique_ptr<client::ShmChannel> shm;
          if (use_shm) {
            client::ShmChannelOptions so;
            so.socket_path = absl::GetFlag(FLAGS_shm_socket);
            absl::StatusOr<std::unique_ptr<client::ShmChannel>> opened = client::ShmChannel::Connect(so);
            if (!opened.ok()) {
              absl::MutexLock lock(&mu);
              ++errors;
              if (first_error.empty()) first_error = opened.status().ToString();
              return;
            }
            shm = *std::move(opened);
          }
          const ForwardFn forward = [&](const v1::ForwardRequest& r) -> absl::StatusOr<client::ForwardResult> {
            return shm != nullptr ? client::ForwardOverShm(*shm, r) : cl.Forward(r);
          };
          const v1::ForwardRequest req = RefRequest(spec, b, t);
          for (;;) {
            const absl::Time s0 = absl::Now();
            if (s0 >= end) break;
            absl::StatusOr<client::ForwardResult> r = forward(req);
            const absl::Time s1 = absl::Now();
            if (s0 < warm_end) continue;
            absl::MutexLock lock(&mu);
            if (!r.ok()) {
              ++errors;
              if (first_error.empty()) first_error = r.status().ToString();
              continue;
            }
            lat.push_back(absl::ToDoubleMicroseconds(s1 - s0));
            srv_queue += r->timing.queue_us();
            srv_kernel += r->timing.kernel_us();
            srv_total += r->timing.total_us();
            first = std::min(first, s0);
            last = std::max(last, s1);
          }
          for (int64_t i = 0; i < verify_rounds; ++i) {
            const std::string why = CallAndCheck(forward, req, b, t, *oracle);
            absl::MutexLock lock(&mu);
            ++verified;
            if (!why.empty()) {
              ++verify_failures;
              if (first_error.empty()) first_error = why;
            }
          }
        });
      }
      for (auto& th : threads) th.join();
      std::sort(lat.begin(), lat.end());
      double mean = 0;
      for (double v : lat) mean += v;
      mean = lat.empty() ? 0 : mean / lat.size();
      const double elapsed = lat.empty() ? 1 : absl::ToDoubleSeconds(last - first);
      const double rps = lat.size() / elapsed;
      const double kernel_rps = kernel_us > 0 ? 1e6 / kernel_us : 0;
      const double sustained_rps = kernel.sustained_us > 0 ? 1e6 / kernel.sustained_us : 0;
      const double p50 = client::Percentile(lat, 50), p99 = client::Percentile(lat, 99);
      const double nrep = lat.empty() ? 1 : static_cast<double>(lat.size());
      std::printf("csv,%s,%d,%d,%zu,%.1f,%.1f,%.1f,%.1f,%.1f,%.1f,%.1f,%.3f,%d,%d,%.1f,%.1f,%.1f,%.1f,%.3f,%.1f,%.1f\n",
                  use_shm ? "ipc_shm" : "ipc", static_cast<int>(seq), static_cast<int>(conc), lat.size(), p50, p99,
                  mean, rps, kernel_us, kernel_rps, p50 - kernel_us, sustained_rps > 0 ? rps / sustained_rps : 0,
                  static_cast<int>(verified), static_cast<int>(verify_failures), srv_queue / nrep, srv_kernel / nrep,
                  srv_total / nrep, kernel.sustained_us, kernel_rps > 0 ? rps / kernel_rps : 0, kernel.isolated_us,
                  kernel.flushed_us);
      if (errors > 0) Fail(absl::StrCat("bench seq ", seq, " concurrency ", conc, ": ", errors, " errors, first: ", first_error));
      if (verify_failures > 0) Fail(absl::StrCat("bench seq ", seq, ": ", verify_failures, " wrong replies"));
      std::fflush(stdout);
    }
    for (const std::string& id : b.out_ids) (void)c.UnregisterCudaBuffer(id);
    (void)c.UnregisterCudaBuffer(b.inputs_id);
    CUDA_OR_DIE(cudaFree(b.base));
  }
  return failures == 0 ? 0 : 1;
}

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
  v1::RegisterCudaBufferRequest r;
  r.set_ipc_handle(std::string(reinterpret_cast<const char*>(&h), sizeof h));
  r.set_device(absl::GetFlag(FLAGS_device));
  r.set_offset(0);
  r.set_byte_size(b.in_bytes);
  r.set_name("decode inputs");
  absl::StatusOr<std::string> id = c.RegisterCudaBuffer(r);
  if (!id.ok()) return id.status();
  b.inputs_id = *id;
  r.set_offset(b.o_off);
  r.set_byte_size(qb);
  r.set_name("decode out");
  id = c.RegisterCudaBuffer(r);
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
  cudaEvent_t e0, e1;
  CUDA_OR_DIE(cudaEventCreate(&e0));
  CUDA_OR_DIE(cudaEventCreate(&e1));
  const auto timed = [&](int n) {
    CUDA_OR_DIE(cudaEventRecord(e0, st));
    for (int i = 0; i < n; ++i) {
      if (absl::Status s = dk::LaunchDecode(*plan, t, {ws, counters}, st); !s.ok()) Fail(s.ToString());
    }
    CUDA_OR_DIE(cudaEventRecord(e1, st));
    CUDA_OR_DIE(cudaEventSynchronize(e1));
    float ms = 0;
    CUDA_OR_DIE(cudaEventElapsedTime(&ms, e0, e1));
    return static_cast<double>(ms) * 1e3;
  };
  (void)timed(20);
  KernelOnly r;
  r.burst_us = timed(200) / 200;
  std::vector<double> one;
  for (int i = 0; i < 101; ++i) one.push_back(timed(1));
  std::nth_element(one.begin(), one.begin() + one.size() / 2, one.end());
  r.isolated_us = one[one.size() / 2];
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
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
    int64_t errors = 0;
    std::string first_error;
    const auto note = [&](const absl::Status& s) {
      ++errors;
      if (first_error.empty()) first_error = s.ToString();
    };
    // Prefill: each sequence's layers from the registered chunk, append only.
    for (int64_t l = 0; l < layers && errors == 0; ++l) {
      for (int64_t s = 0; s < seqs && errors == 0; ++s) {
        client::StepSpec spec;
        spec.sequences.push_back({ids[s], context});
        spec.layer = l;
        spec.k.ref = DecodeRef(b.inputs_id, b.pk_off);
        spec.v.ref = DecodeRef(b.inputs_id, b.pv_off);
        if (absl::StatusOr<client::StepResult> r = c.Step(spec); !r.ok()) note(r.status());
      }
    }
    // Callers: the sequences split into --decode_callers groups, each stepping its own in one Step per layer.
    const int64_t callers = std::min<int64_t>(std::max(1, absl::GetFlag(FLAGS_decode_callers)), seqs);
    struct Group {
      int64_t first = 0, count = 0;
      std::vector<v1::StepRequest> reqs;  // per layer
    };
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
        if (!req.ok()) return Fail(req.status().ToString()), 1;
        gr.reqs.push_back(*std::move(req));
      }
    }
    absl::Mutex mu;
    std::vector<double> lat;
    double queue = 0, kernel = 0, total = 0;
    int64_t batch = 0;
    // Every caller runs n steps of its group (all layers each); measured ones are recorded.
    const auto run = [&](int64_t n, bool measured) {
      std::vector<std::thread> threads;
      for (const Group& gr : groups) {
        threads.emplace_back([&, n, measured] {
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
                absl::MutexLock lock(&mu);
                note(r.status());
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
          absl::MutexLock lock(&mu);
          lat.insert(lat.end(), mine.begin(), mine.end());
          queue += q, kernel += k, total += t;
          batch = std::max(batch, most);
        });
      }
      for (std::thread& th : threads) th.join();
    };
    int64_t verified = 0, verify_failures = 0;
    const auto verify = [&] {
      for (const Group& gr : groups) {
        if (errors > 0) return;
        const std::string why = DecodeCheck(c, gr.reqs[0], b, gr.first, gr.count);
        ++verified;
        if (!why.empty()) {
          ++verify_failures;
          if (first_error.empty()) first_error = why;
        }
        for (size_t l = 1; l < gr.reqs.size() && errors == 0; ++l) {  // the other layers take the same step
          if (absl::StatusOr<client::StepResult> r = c.Step(gr.reqs[l]); !r.ok()) note(r.status());
        }
      }
    };
    run(std::min<int64_t>(20, steps), false);
    verify();
    const absl::Time start = absl::Now();
    run(steps, true);
    const double elapsed = absl::ToDoubleSeconds(absl::Now() - start);
    verify();
    // At the keys the measured steps held on average.
    const KernelOnly k = DecodeKernelOnlyUs(b, context + std::min<int64_t>(20, steps) + 1 + steps / 2, page);
    const double n = lat.empty() ? 1 : static_cast<double>(lat.size());
    std::sort(lat.begin(), lat.end());
    const double tokens_per_s = elapsed > 0 && errors == 0 ? static_cast<double>(seqs * steps) / elapsed : 0;
    const double kernel_rate = k.burst_us > 0 ? static_cast<double>(seqs) / (k.burst_us * 1e-6) / layers : 0;
    const double p50 = client::Percentile(lat, 50);
    std::printf("csv,%s,%d,%d,%d,%d,%d,%zu,%.1f,%.1f,%.1f,%.0f,%.1f,%.1f,%.0f,%.3f,%.1f,%.1f,%.1f,%.1f,%d,%d,%d\n",
                use_shm ? "ipc_shm" : "ipc", static_cast<int>(seqs), static_cast<int>(callers),
                static_cast<int>(context), static_cast<int>(layers), static_cast<int>(steps), lat.size(), p50,
                client::Percentile(lat, 90), client::Percentile(lat, 99), tokens_per_s, k.burst_us, k.isolated_us,
                kernel_rate, kernel_rate > 0 ? tokens_per_s / kernel_rate : 0, p50 - k.isolated_us, queue / n,
                kernel / n, total / n, static_cast<int>(batch), static_cast<int>(verified),
                static_cast<int>(verify_failures));
    std::fflush(stdout);
    if (errors > 0) Fail(absl::StrCat("decode ", seqs, " sequences: ", errors, " errors, first: ", first_error));
    if (verify_failures > 0) Fail(absl::StrCat("decode ", seqs, " sequences: wrong replies: ", first_error));
    if (absl::Status s = c.CloseSequence(ids); !s.ok()) Fail(absl::StrCat("close: ", s.ToString()));
    (void)c.UnregisterCudaBuffer(b.out_id);
    (void)c.UnregisterCudaBuffer(b.inputs_id);
    CUDA_OR_DIE(cudaFree(b.base));
  }
  return failures == 0 ? 0 : 1;
}

// The TCP loopback baseline for the sizes an inline request of each --seqs moves (Q+K+V up, O down).
int Tcp() {
  std::printf("csv,mode,seq,bytes_up,bytes_down,p50_us,rate_gb_per_s\n");
  for (int64_t seq : Ints(absl::GetFlag(FLAGS_seqs))) {
    const Shape s{1, seq, seq, 32, 32, 128};
    const uint64_t q = static_cast<uint64_t>(attnd::QElems(s)) * 2, kv = static_cast<uint64_t>(attnd::KVElems(s)) * 2;
    const uint64_t up = q + 2 * kv, down = q;
    absl::StatusOr<double> p50 = client::MeasureTcpLoopback(up, down, absl::GetFlag(FLAGS_tcp_iters));
    if (!p50.ok()) return Fail(std::string(p50.status().message())), 1;
    std::printf("csv,tcp_loopback,%d,%llu,%llu,%.1f,%.3f\n", static_cast<int>(seq),
                static_cast<unsigned long long>(up), static_cast<unsigned long long>(down), *p50,
                static_cast<double>(up + down) / *p50 / 1e3);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  const std::string mode = args.size() > 1 ? args[1] : "";
  if (mode == "tcp") return Tcp();
  if (mode != "check" && mode != "bench" && mode != "decode") {
    std::fprintf(stderr, "usage: ipc_peer check|bench|decode|tcp --target=unix:/path [flags]\n");
    return 2;
  }
  CUDA_OR_DIE(cudaSetDevice(absl::GetFlag(FLAGS_device)));
  client::ClientOptions o;
  o.target = absl::GetFlag(FLAGS_target);
  o.default_deadline = absl::Seconds(60);
  if (mode == "decode" && absl::GetFlag(FLAGS_transport) == "shm") {
    o.transport = client::Transport::kShm;
    o.shm_socket = absl::GetFlag(FLAGS_shm_socket);
  }
  auto c = client::Client::Create(o);
  if (!c.ok()) {
    std::fprintf(stderr, "ipc_peer: %s\n", c.status().ToString().c_str());
    return 2;
  }
  if (mode == "decode") return Decode(**c);
  return mode == "check" ? Check(**c) : Bench(**c);
}
