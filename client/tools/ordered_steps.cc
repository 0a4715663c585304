// ordered_steps: a C++ caller's KV-sequence steps from its own CUDA memory, ordered on its own CUDA stream
// (attnd/client/cuda_steps.h; docs/sequences.md, "Steps from CUDA memory"). The example for C++ callers of the
// client library, and a check: every step's O is copied back on the same stream, right after the call, and
// compared with the double-precision oracle over the sequence's whole history (the prefill's only up to 1024
// rows); then a dependent decode chain (each Q copied on the stream from the previous O) is timed by CUDA events
// between consecutive steps, once with Step (the call returns after the step ran) and once with Submit (it returns
// before; the stream waits for the step on the GPU). --submit checks the steps through Submit too.
//
//   ordered_steps --target=unix:/tmp/attnd.sock --shm_socket=/tmp/attnd_shm.sock --context=4096 --steps=2000
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "attnd/client/client.h"
#include "attnd/client/cuda_steps.h"
#include "attnd/client/tensors.h"

ABSL_FLAG(std::string, target, "unix:/tmp/attnd.sock", "the server (on this host, with --enable_cuda_ipc)");
ABSL_FLAG(std::string, shm_socket, "", "the server's --shm_socket (empty: steps over gRPC)");
ABSL_FLAG(int64_t, context, 1024, "keys cached before the decode steps");
ABSL_FLAG(int64_t, checked_steps, 8, "decode steps whose O is checked against the oracle");
ABSL_FLAG(int64_t, steps, 1000, "timed decode steps");
ABSL_FLAG(bool, submit, false, "the checked steps through Submit (the call returns before the step runs)");

namespace {

namespace client = attnd::client;
constexpr int64_t kKvHeads = 8, kQHeads = 32, kHeadDim = 128;

int Die(const std::string& what) {
  std::fprintf(stderr, "ordered_steps: %s\n", what.c_str());
  return 1;
}

#define CUDA_OK(call)                                                                   \
  do {                                                                                  \
    const cudaError_t e_ = (call);                                                      \
    if (e_ != cudaSuccess) return Die(absl::StrCat(#call, ": ", cudaGetErrorString(e_))); \
  } while (0)

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int64_t context = absl::GetFlag(FLAGS_context), steps = absl::GetFlag(FLAGS_steps);
  // The caller's context must be current on the calling thread before CudaSteps::Create (the runtime makes the
  // device's primary context current on first use).
  CUDA_OK(cudaSetDevice(0));
  CUDA_OK(cudaFree(nullptr));
  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  client::ClientOptions o;
  o.target = absl::GetFlag(FLAGS_target);
  o.shm_socket = absl::GetFlag(FLAGS_shm_socket);
  o.transport = o.shm_socket.empty() ? client::Transport::kAuto : client::Transport::kShm;
  auto c = client::Client::Create(o);
  if (!c.ok()) return Die(c.status().ToString());
  auto steps_or = client::CudaSteps::Create(c->get());
  if (!steps_or.ok()) return Die(steps_or.status().ToString());
  client::CudaSteps& cuda = **steps_or;
  auto ordered = cuda.StreamOrdered();
  if (!ordered.ok()) return Die(ordered.status().ToString());
  auto opened = (*c)->OpenSequence(client::SequenceShape{1, kKvHeads, kHeadDim, attnd::DType::kBF16});
  if (!opened.ok()) return Die(opened.status().ToString());
  client::StepBatch batch(opened->ids, context);

  // Device buffers for the largest step (the prefill of `context` rows); one decode row uses their start.
  const uint64_t q_row = kQHeads * kHeadDim * 2, kv_row = kKvHeads * kHeadDim * 2;
  void *q = nullptr, *k = nullptr, *v = nullptr, *out = nullptr;
  CUDA_OK(cudaMalloc(&q, context * q_row));
  CUDA_OK(cudaMalloc(&k, context * kv_row));
  CUDA_OK(cudaMalloc(&v, context * kv_row));
  CUDA_OK(cudaMalloc(&out, context * q_row));
  std::string hist_k, hist_v;
  std::string o_host;
  double worst = 0;
  int64_t checked = 0;
  for (int64_t i = 0; i <= absl::GetFlag(FLAGS_checked_steps); ++i) {
    const int64_t rows = i == 0 ? context : 1;  // the prefill, then one-token steps
    const std::string hq = client::RandomTensor(attnd::DType::kBF16, rows * kQHeads * kHeadDim, 3 * i + 1);
    const std::string hk = client::RandomTensor(attnd::DType::kBF16, rows * kKvHeads * kHeadDim, 3 * i + 2);
    const std::string hv = client::RandomTensor(attnd::DType::kBF16, rows * kKvHeads * kHeadDim, 3 * i + 3);
    // The producer: the inputs land on the stream; the step reads them after it, without a host wait.
    CUDA_OK(cudaMemcpyAsync(q, hq.data(), hq.size(), cudaMemcpyHostToDevice, stream));
    CUDA_OK(cudaMemcpyAsync(k, hk.data(), hk.size(), cudaMemcpyHostToDevice, stream));
    CUDA_OK(cudaMemcpyAsync(v, hv.data(), hv.size(), cudaMemcpyHostToDevice, stream));
    batch.set_tokens(rows);
    batch.request().set_layer(0);
    batch.request().set_q_heads(kQHeads);
    const client::DeviceStepTensors t{q, k, v, out, rows * q_row, rows * kv_row};
    const absl::Status r =
        absl::GetFlag(FLAGS_submit) ? cuda.Submit(batch, t, stream) : cuda.Step(batch, t, stream).status();
    if (!r.ok()) return Die(absl::StrCat("step ", i, ": ", r.ToString()));
    // The consumer: O copied back on the stream after the call, before any host wait.
    o_host.resize(rows * q_row);
    CUDA_OK(cudaMemcpyAsync(o_host.data(), out, o_host.size(), cudaMemcpyDeviceToHost, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    if (absl::Status done = cuda.Sync(stream); !done.ok()) return Die(absl::StrCat("step ", i, ": ", done.ToString()));
    hist_k += hk;
    hist_v += hv;
    if (i == 0 && context > 1024) continue;  // a long prefill's double-precision oracle takes the CPU seconds
    attnd::Problem p;
    p.shape = attnd::Shape{1, rows, static_cast<int64_t>(hist_k.size() / kv_row), kQHeads, kKvHeads, kHeadDim};
    p.mask = attnd::Mask::kCausalBottomRight;
    p.scale = attnd::DefaultScale(kHeadDim);
    auto oracle = client::Oracle::Compute(p, hq, hist_k, hist_v);
    if (!oracle.ok()) return Die(oracle.status().ToString());
    const client::VerifyReport check = oracle->Check(o_host, "");
    worst = std::max(worst, check.max_abs_err);
    if (!check.pass) return Die(absl::StrCat("step ", i, ": O differs from the oracle: ", check.detail));
    ++checked;
  }
  std::printf("ordered_steps: %s; %lld checked steps, max |O - O_f64| %.4f\n",
              *ordered ? "stream-ordered" : "host-ordered (the server offers no stream order)",
              static_cast<long long>(checked), worst);

  // The decode chain: Q of step i+1 is O of step i, produced on the stream.
  batch.set_tokens(1);
  std::vector<cudaEvent_t> ev(steps);
  for (cudaEvent_t& e : ev) CUDA_OK(cudaEventCreate(&e));
  for (const bool submit : {false, true}) {
    for (int64_t i = 0; i < steps; ++i) {
      CUDA_OK(cudaMemcpyAsync(q, out, q_row, cudaMemcpyDeviceToDevice, stream));
      const client::DeviceStepTensors t{q, k, v, out, q_row, kv_row};
      const absl::Status r = submit ? cuda.Submit(batch, t, stream) : cuda.Step(batch, t, stream).status();
      if (!r.ok()) return Die(absl::StrCat("timed step ", i, ": ", r.ToString()));
      CUDA_OK(cudaEventRecord(ev[i], stream));
    }
    CUDA_OK(cudaStreamSynchronize(stream));
    if (absl::Status done = cuda.Sync(stream); !done.ok()) return Die(absl::StrCat("timed steps: ", done.ToString()));
    std::vector<double> gaps;
    for (int64_t i = 1; i < steps; ++i) {
      float ms = 0;
      CUDA_OK(cudaEventElapsedTime(&ms, ev[i - 1], ev[i]));
      gaps.push_back(ms * 1e3);
    }
    std::sort(gaps.begin(), gaps.end());
    if (!gaps.empty()) {
      std::printf("ordered_steps: %lld decode steps at %lld keys (%s): step p50 %.1f us, p90 %.1f us, p99 %.1f us\n",
                  static_cast<long long>(steps), static_cast<long long>(context), submit ? "Submit" : "Step",
                  gaps[gaps.size() / 2], gaps[gaps.size() * 9 / 10],
                  gaps[std::min(gaps.size() - 1, gaps.size() * 99 / 100)]);
    }
  }
  for (cudaEvent_t e : ev) cudaEventDestroy(e);
  (void)(*c)->CloseSequence(opened->ids);
  cudaFree(q), cudaFree(k), cudaFree(v), cudaFree(out);
  cudaStreamDestroy(stream);
  return 0;
}
