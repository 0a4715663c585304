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
#include "ipc_peer.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "attnd/client/client.h"
#include "attnd/client/tensors.h"

ABSL_FLAG(std::string, target, "", "attnd server (unix:/path for IPC)");
ABSL_FLAG(int, device, 0, "CUDA device of the buffers (the server's numbering; same host, no CUDA_VISIBLE_DEVICES)");
ABSL_FLAG(std::string, transport, "grpc", "bench: grpc (Forward RPCs on --target) or shm (the server's --shm_socket)");
ABSL_FLAG(std::string, shm_socket, "", "bench, decode --transport=shm: the server's shared-memory channel socket");

namespace ipc_peer {

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

uint64_t Align(uint64_t x) { return (x + 4095) & ~uint64_t{4095}; }

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

absl::StatusOr<std::string> RegisterRegion(client::Client& c, const std::string& handle, uint64_t offset,
                                           uint64_t size, const std::string& name) {
  v1::RegisterCudaBufferRequest r;
  r.set_ipc_handle(handle);
  r.set_device(absl::GetFlag(FLAGS_device));
  r.set_offset(offset);
  r.set_byte_size(size);
  r.set_name(name);
  return c.RegisterCudaBuffer(r);
}

absl::Status Register(client::Client& c, Buffers& b, int outs) {
  absl::StatusOr<std::string> id = RegisterRegion(c, b.handle, 0, b.o_off, "inputs");
  if (!id.ok()) return id.status();
  b.inputs_id = *id;
  for (int i = 0; i < outs; ++i) {
    id = RegisterRegion(c, b.handle, b.o_off + b.o_stride * i, b.q_bytes, absl::StrCat("out", i));
    if (!id.ok()) return id.status();
    b.out_ids.push_back(*id);
  }
  return absl::OkStatus();
}

LaunchTimer::LaunchTimer(cudaStream_t stream, std::function<void()> launch)
    : stream_(stream), launch_(std::move(launch)) {
  CUDA_OR_DIE(cudaEventCreate(&start_));
  CUDA_OR_DIE(cudaEventCreate(&end_));
}

LaunchTimer::~LaunchTimer() {
  cudaEventDestroy(start_);
  cudaEventDestroy(end_);
}

double LaunchTimer::Time(int n) {
  CUDA_OR_DIE(cudaEventRecord(start_, stream_));
  for (int i = 0; i < n; ++i) launch_();
  CUDA_OR_DIE(cudaEventRecord(end_, stream_));
  CUDA_OR_DIE(cudaEventSynchronize(end_));
  float ms = 0;
  CUDA_OR_DIE(cudaEventElapsedTime(&ms, start_, end_));
  return static_cast<double>(ms) * 1e3;
}

void LaunchTimer::BurstAndSingles(int burst, int singles, KernelOnly* k) {
  k->burst_us = Time(burst) / burst;
  std::vector<double> one;
  for (int i = 0; i < singles; ++i) one.push_back(Time(1));
  k->isolated_us = Median(one);
}

double Median(std::vector<double>& v) {
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
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

Inputs Upload(const client::RequestSpec& spec, const Buffers& b, uint64_t seed) {
  Inputs in{client::RandomTensor(spec.dtype, attnd::QElems(spec.shape), seed * 3),
            client::RandomTensor(spec.dtype, attnd::KVElems(spec.shape), seed * 3 + 1),
            client::RandomTensor(spec.dtype, attnd::KVElems(spec.shape), seed * 3 + 2)};
  CUDA_OR_DIE(cudaMemcpy(b.base, in.q.data(), in.q.size(), cudaMemcpyHostToDevice));
  CUDA_OR_DIE(cudaMemcpy(b.base + b.k_off(), in.k.data(), in.k.size(), cudaMemcpyHostToDevice));
  CUDA_OR_DIE(cudaMemcpy(b.base + b.v_off(), in.v.data(), in.v.size(), cudaMemcpyHostToDevice));
  return in;
}

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

std::vector<int64_t> Ints(const std::string& list) {
  std::vector<int64_t> out;
  for (absl::string_view p : absl::StrSplit(list, ',', absl::SkipWhitespace())) {
    int64_t v;
    if (absl::SimpleAtoi(p, &v)) out.push_back(v);
  }
  return out;
}

}  // namespace ipc_peer

using ipc_peer::Bench;
using ipc_peer::Check;
using ipc_peer::Decode;
using ipc_peer::Tcp;
namespace client = attnd::client;

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
