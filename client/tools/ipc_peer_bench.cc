// ipc_peer bench and tcp (the modes: ipc_peer.cc).
#include "ipc_peer.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "attnd/client/bench.h"
#include "attnd/client/client.h"
#include "attnd/client/shm_channel.h"
#include "attnd/client/tensors.h"
#include "attnd/kernels/attention.h"

ABSL_FLAG(std::string, seqs, "1024,4096", "bench: sequence lengths");
ABSL_FLAG(std::string, concurrency, "1,16", "bench: callers in flight");
ABSL_FLAG(double, duration_s, 3, "bench: measured seconds per point");
ABSL_FLAG(double, warmup_s, 0.5, "bench: unmeasured seconds per point");
ABSL_FLAG(int64_t, verify_every, 0, "bench: > 0: verify max(1, N/10) replies per caller after the measured span, all callers at once");
ABSL_FLAG(int, tcp_iters, 20, "tcp: transfers per size");

namespace ipc_peer {
namespace {

// Kernel-only time of the problem on the same GPU, back-to-back launches timed with events: a burst of 100
// (boost clocks) and launches sustained for `sustain`, as long as a measured point keeps the GPU busy (the
// clocks a loaded GPU settles at: on the H200 the sustained figure was up to ~15% slower at 4k). And the
// median of launches timed one at a time on an idle GPU, events around each as the server times a request's
// kernel: what one request's kernel costs when nothing runs before it. And the kernel benchmark's own method
// (kernels/bench/hopper_bench.py: triton's do_bench): the median of single launches, each after 256 MB of
// memset has flushed the L2.
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
  KernelOnly k;
  {
    LaunchTimer timer(st, [&] {
      if (absl::Status s = attnd::kernels::Launch(*plan, ws, st); !s.ok()) Fail(s.ToString());
    });
    (void)timer.Time(10);
    timer.BurstAndSingles(100, 51, &k);
    constexpr size_t kFlushBytes = size_t{256} << 20;
    void* flush = nullptr;
    CUDA_OR_DIE(cudaMalloc(&flush, kFlushBytes));
    std::vector<double> flushed;
    for (int i = 0; i < 51; ++i) {
      CUDA_OR_DIE(cudaMemsetAsync(flush, 0, kFlushBytes, st));
      flushed.push_back(timer.Time(1));
    }
    CUDA_OR_DIE(cudaFree(flush));
    k.flushed_us = Median(flushed);
    double us = 0;
    int64_t launches = 0;
    for (const absl::Time end = absl::Now() + sustain; absl::Now() < end; launches += 50) us += timer.Time(50);
    k.sustained_us = launches > 0 ? us / static_cast<double>(launches) : k.burst_us;
  }
  cudaStreamDestroy(st);
  if (ws != nullptr) cudaFree(ws);
  return k;
}

// One measured point (a sequence length at a concurrency): what its callers are given.
struct PointSetup {
  client::Client& c;
  const client::RequestSpec& spec;
  const Buffers& b;
  const client::Oracle* oracle;  // null: no verification
  bool use_shm;
  absl::Time warm_end, end;
  int64_t verify_rounds;
};

// The counts of one point's callers, under mu.
struct PointCounts {
  absl::Mutex mu;
  std::vector<double> lat;
  int64_t verified = 0, verify_failures = 0, errors = 0;
  double srv_queue = 0, srv_kernel = 0, srv_total = 0;  // sums over measured replies
  std::string first_error;
  absl::Time first = absl::InfiniteFuture(), last = absl::InfinitePast();
};

// One caller of a point: its own connection (or shm channel), calls until the end, then its verify rounds.
void BenchCaller(const PointSetup& p, int t, PointCounts& n) {
  client::Client& c = p.c;
  const Buffers& b = p.b;
  cudaSetDevice(absl::GetFlag(FLAGS_device));
  client::ClientOptions co = c.options();
  co.own_connection = true;
  auto own = client::Client::Create(co);
  client::Client& cl = own.ok() ? **own : c;
  std::unique_ptr<client::ShmChannel> shm;
  if (p.use_shm) {
    client::ShmChannelOptions so;
    so.socket_path = absl::GetFlag(FLAGS_shm_socket);
    absl::StatusOr<std::unique_ptr<client::ShmChannel>> opened = client::ShmChannel::Connect(so);
    if (!opened.ok()) {
      absl::MutexLock lock(&n.mu);
      ++n.errors;
      if (n.first_error.empty()) n.first_error = opened.status().ToString();
      return;
    }
    shm = *std::move(opened);
  }
  const ForwardFn forward = [&](const v1::ForwardRequest& r) -> absl::StatusOr<client::ForwardResult> {
    return shm != nullptr ? client::ForwardOverShm(*shm, r) : cl.Forward(r);
  };
  const v1::ForwardRequest req = RefRequest(p.spec, b, t);
  for (;;) {
    const absl::Time s0 = absl::Now();
    if (s0 >= p.end) break;
    absl::StatusOr<client::ForwardResult> r = forward(req);
    const absl::Time s1 = absl::Now();
    if (s0 < p.warm_end) continue;
    absl::MutexLock lock(&n.mu);
    if (!r.ok()) {
      ++n.errors;
      if (n.first_error.empty()) n.first_error = r.status().ToString();
      continue;
    }
    n.lat.push_back(absl::ToDoubleMicroseconds(s1 - s0));
    n.srv_queue += r->timing.queue_us();
    n.srv_kernel += r->timing.kernel_us();
    n.srv_total += r->timing.total_us();
    n.first = std::min(n.first, s0);
    n.last = std::max(n.last, s1);
  }
  for (int64_t i = 0; i < p.verify_rounds; ++i) {
    const std::string why = CallAndCheck(forward, req, b, t, *p.oracle);
    absl::MutexLock lock(&n.mu);
    ++n.verified;
    if (!why.empty()) {
      ++n.verify_failures;
      if (n.first_error.empty()) n.first_error = why;
    }
  }
}

// One point: `conc` callers over the measured span, then its CSV row.
void MeasurePoint(client::Client& c, const client::RequestSpec& spec, const Buffers& b, const client::Oracle* oracle,
                  const KernelOnly& kernel, int64_t seq, int64_t conc, bool use_shm) {
  const double kernel_us = kernel.burst_us;
  PointCounts n;
  const absl::Time warm_end = absl::Now() + absl::Seconds(absl::GetFlag(FLAGS_warmup_s));
  const absl::Time end = warm_end + absl::Seconds(absl::GetFlag(FLAGS_duration_s));
  std::vector<std::thread> threads;
  // Each caller has its own connection, as separate engine processes would. Verification runs after the
  // measured span (every caller at once, so still under concurrency): checking inside the loop would
  // take callers away for the copy and the check and lower the offered load.
  const PointSetup p{c, spec, b, oracle, use_shm, warm_end, end,
                     oracle ? std::max<int64_t>(1, absl::GetFlag(FLAGS_verify_every) / 10) : 0};
  for (int t = 0; t < conc; ++t) {
    threads.emplace_back([&p, &n, t] { BenchCaller(p, t, n); });
  }
  for (auto& th : threads) th.join();
  std::sort(n.lat.begin(), n.lat.end());
  double mean = 0;
  for (double v : n.lat) mean += v;
  mean = n.lat.empty() ? 0 : mean / n.lat.size();
  const double elapsed = n.lat.empty() ? 1 : absl::ToDoubleSeconds(n.last - n.first);
  const double rps = n.lat.size() / elapsed;
  const double kernel_rps = kernel_us > 0 ? 1e6 / kernel_us : 0;
  const double sustained_rps = kernel.sustained_us > 0 ? 1e6 / kernel.sustained_us : 0;
  const double p50 = client::Percentile(n.lat, 50), p99 = client::Percentile(n.lat, 99);
  const double nrep = n.lat.empty() ? 1 : static_cast<double>(n.lat.size());
  std::printf("csv,%s,%d,%d,%zu,%.1f,%.1f,%.1f,%.1f,%.1f,%.1f,%.1f,%.3f,%d,%d,%.1f,%.1f,%.1f,%.1f,%.3f,%.1f,%.1f\n",
              use_shm ? "ipc_shm" : "ipc", static_cast<int>(seq), static_cast<int>(conc), n.lat.size(), p50, p99,
              mean, rps, kernel_us, kernel_rps, p50 - kernel_us, sustained_rps > 0 ? rps / sustained_rps : 0,
              static_cast<int>(n.verified), static_cast<int>(n.verify_failures), n.srv_queue / nrep,
              n.srv_kernel / nrep, n.srv_total / nrep, kernel.sustained_us, kernel_rps > 0 ? rps / kernel_rps : 0,
              kernel.isolated_us, kernel.flushed_us);
  if (n.errors > 0) {
    Fail(absl::StrCat("bench seq ", seq, " concurrency ", conc, ": ", n.errors, " errors, first: ", n.first_error));
  }
  if (n.verify_failures > 0) Fail(absl::StrCat("bench seq ", seq, ": ", n.verify_failures, " wrong replies"));
  std::fflush(stdout);
}

}  // namespace

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
    for (int64_t conc : concs) MeasurePoint(c, spec, b, oracle.get(), kernel, seq, conc, use_shm);
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

}  // namespace ipc_peer
