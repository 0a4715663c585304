// ipc_peer: a second process that owns CUDA buffers and uses an attnd server through CUDA IPC, as a
// same-host inference engine would. Three modes:
//   check  --target=unix:/path   correctness of the zero-copy path (every mask/GQA/head_dim against the
//                                double-precision oracle, outputs poisoned before each call), rejection of bad
//                                handles and references, and --clients concurrent callers. Exit 0 = all passed.
//   bench  --target=unix:/path   client-observed latency/throughput of IPC Forward for batch 1, 32 heads,
//                                head_dim 128, causal, at --seqs and --concurrency, next to the kernel-only time
//                                measured here with the same kernel library; --verify_every checks replies.
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
ABSL_FLAG(std::string, shm_socket, "", "bench --transport=shm: the server's shared-memory channel socket");

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
  if (mode != "check" && mode != "bench") {
    std::fprintf(stderr, "usage: ipc_peer check|bench|tcp --target=unix:/path [flags]\n");
    return 2;
  }
  CUDA_OR_DIE(cudaSetDevice(absl::GetFlag(FLAGS_device)));
  client::ClientOptions o;
  o.target = absl::GetFlag(FLAGS_target);
  o.default_deadline = absl::Seconds(60);
  auto c = client::Client::Create(o);
  if (!c.ok()) {
    std::fprintf(stderr, "ipc_peer: %s\n", c.status().ToString().c_str());
    return 2;
  }
  return mode == "check" ? Check(**c) : Bench(**c);
}
