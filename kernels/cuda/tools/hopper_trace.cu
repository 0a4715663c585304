// hopper_trace: where a Hopper-family tile's cycles go.
//
// Builds its own instantiations of the Hopper kernel with the timeline probes on (trace_sm90.cuh), plans each
// problem through the library (same tensor maps, parameters and persistent grid as Launch), runs the library's
// kernel and the probed one on the same inputs, checks that their outputs are bit-identical, and prints per
// key-block count the mean cycles of each phase of a tile:
//   qwait  tile start -> Q resident          first  the first block (S alone + softmax)
//   middle the overlapped steps (per step)   lastpv the last P V alone
//   epi    normalise + store O               gap    store -> next tile's start (scheduler)
// and the overhead of a tile beyond n_blocks steady-state steps, in steps. Round 0 (pipeline fill) and a
// block's last traced round are left out. Then where the steady step itself goes (warp 0 of each consumer
// warpgroup): the K and V waits, the turn, issuing each GEMM, the S wait, the row max, the exponentials, the P V
// wait and the conversion of P. Usage: hopper_trace [config B S H causal]... (defaults below). These plans turn the
// split tail off: the probed instantiations run every tile whole, and the outputs are compared bit for bit.
//
// hopper_trace --timeline [--dump=FILE] [--split_tail=off|auto|always] [config B S H causal]...: the launcher's whole
// path (persistent grid, order, the split tail with its workspace) with %globaltimer stamps at every tile's and
// split-tail part's start and at each block's end, to see how evenly the blocks finish and how the rate per key block
// moves from round to round (the power cap raises the clock when blocks go idle). --split_tail sets the plans'
// HopperScheduleOptions::split_tail (default auto, the library's default).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#define ATTND_HOPPER_TRACE 1
#include "attnd/kernels/attention.h"
#include "hopper/flash_fwd_launch_sm90.cuh"
#include "hopper/tile_size_sm90.h"

namespace hk = attnd::kernels::hopper;

namespace {

#define CHECK_CUDA(x)                                                                           \
  do {                                                                                          \
    const cudaError_t e_ = (x);                                                                 \
    if (e_ != cudaSuccess) {                                                                    \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                             \
    }                                                                                           \
  } while (0)

struct Case {
  std::string config;
  int b, s, h, causal;
};

// A probed launch of a plan's schedule: its persistent grid (plan.schedule.blocks) in its order, with the
// SchedulerParams that hk::BoundScheduler makes of the plan and its workspace.
using Launcher = void (*)(const attnd::kernels::Plan&, const hk::SchedulerParams&);

// One launch of the instantiation for kOrder without the split tail; with O through shared memory, the kernel that
// takes the O map.
template <typename Tile, int kOrder>
void LaunchOrder(const attnd::kernels::Plan& plan, const hk::SchedulerParams& sp) {
  constexpr int kSmem = static_cast<int>(Tile::kSmemBytes);
  const int blocks = plan.schedule.blocks;
  if constexpr (Tile::kSmemEpilogue) {
    auto* k = hk::HopperFwdKernelO<Tile, __nv_bfloat16, kOrder>;
    CHECK_CUDA(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
    k<<<blocks, Tile::kThreads, Tile::kSmemBytes>>>(plan.q_map, plan.k_map, plan.v_map, plan.o_map, plan.params, sp);
  } else {
    auto* k = hk::HopperFwdKernel<Tile, __nv_bfloat16, kOrder>;
    CHECK_CUDA(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
    k<<<blocks, Tile::kThreads, Tile::kSmemBytes>>>(plan.q_map, plan.k_map, plan.v_map, plan.params, sp);
  }
  CHECK_CUDA(cudaGetLastError());
}

// The instantiation LaunchFwd picks for a plan without the split tail (RunCase plans with SplitTail::kOff).
template <typename Tile>
void LaunchProbed(const attnd::kernels::Plan& plan, const hk::SchedulerParams& sp) {
  if (plan.schedule.split_tail) {
    std::fprintf(stderr, "the per-tile mode's probed kernels have no split tail\n");
    std::exit(1);
  }
  if constexpr (hk::MayRunDynamic(Tile::kHeadDim) && !Tile::kSmemEpilogue) {
    if (plan.schedule.order == hk::kDynamic) return LaunchOrder<Tile, hk::kDynamic>(plan, sp);
  }
  if constexpr (hk::MayPair(Tile::kHeadDim)) {
    if (plan.schedule.order == hk::kPaired) return LaunchOrder<Tile, hk::kPaired>(plan, sp);
  }
  LaunchOrder<Tile, hk::kStatic>(plan, sp);
}

// The configurations the tool instantiates: those `auto` picks.
const std::map<std::string, Launcher>& Launchers() {
  static const std::map<std::string, Launcher> m = {
      {"hopper_sm90_d64_m128n128s6_p2", &LaunchProbed<hk::TileShape<hk::HopperD64M128N128S6P2>>},
      {"hopper_sm90_d64_m192n128s4_wrs", &LaunchProbed<hk::TileShape<hk::HopperD64M192N128S4Wrs>>},
      {"hopper_sm90_d128_m128n128s3_osk_p2", &LaunchProbed<hk::TileShape<hk::HopperD128M128N128S3OskP2>>},
      {"hopper_sm90_d256_m128n64s2", &LaunchProbed<hk::TileShape<hk::HopperD256M128N64S2>>},
  };
  return m;
}

// Timeline mode. The tool's own tile types (empty subclasses in this file's anonymous namespace) give every
// template it instantiates here internal linkage; with the library's own types the linker would keep one copy of
// each host function for the tool and the library together, probed or not.
struct TracedD128 : hk::TileShape<hk::HopperD128M128N128S3OskP2> {};
struct TracedD256 : hk::TileShape<hk::HopperD256M128N64S2> {};

// LaunchFwd's static and paired paths (the split tail included) for the traced types, picked by the plan's schedule.
// These configurations have no dynamic order (head_dim 64 only), so the plan never asks for it.
template <typename Tile>
void LaunchTimelineRun(const attnd::kernels::Plan& plan, const hk::SchedulerParams& sp) {
  static_assert(!hk::MayRunDynamicTile<Tile>(), "the timeline mode launches the static and paired orders only");
  using Bf = __nv_bfloat16;
  static const bool raised = [] {
    CHECK_CUDA((hk::RaiseSmemLimit<Tile, Bf, hk::kStatic>()));
    CHECK_CUDA((hk::RaiseSmemLimit<Tile, Bf, hk::kPaired>()));
    CHECK_CUDA((hk::RaiseSmemLimit<Tile, Bf, hk::kStatic, true>()));
    CHECK_CUDA((hk::RaiseSmemLimit<Tile, Bf, hk::kPaired, true>()));
    return true;
  }();
  (void)raised;
  const attnd::kernels::LaunchSchedule& s = plan.schedule;
  const bool paired = s.order == hk::kPaired;
  if (s.split_tail) {
    CHECK_CUDA((paired ? hk::LaunchKernel<Tile, Bf, hk::kPaired, true>(plan, s.blocks, nullptr, sp)
                       : hk::LaunchKernel<Tile, Bf, hk::kStatic, true>(plan, s.blocks, nullptr, sp)));
  } else {
    CHECK_CUDA((paired ? hk::LaunchKernel<Tile, Bf, hk::kPaired>(plan, s.blocks, nullptr, sp)
                       : hk::LaunchKernel<Tile, Bf, hk::kStatic>(plan, s.blocks, nullptr, sp)));
  }
}

const std::map<std::string, Launcher>& TimelineLaunchers() {
  static const std::map<std::string, Launcher> m = {
      {"hopper_sm90_d128_m128n128s3_osk_p2", &LaunchTimelineRun<TracedD128>},
      {"hopper_sm90_d256_m128n64s2", &LaunchTimelineRun<TracedD256>},
  };
  return m;
}

struct Acc {
  double sum[8] = {};
  int n = 0;
};

// One case's inputs (random normal), two poisoned outputs, and two plans: the library's run writes o1, the probed
// run o2 through a plan of its own (with the O map, where the kernel stores O with TMA). Each plan has its own
// workspace (null when it needs none), zeroed once: every launch leaves it zero for the next.
struct CaseData {
  int d = 0;
  size_t elems = 0;
  void *q = nullptr, *k = nullptr, *v = nullptr, *o1 = nullptr, *o2 = nullptr;
  attnd::kernels::Plan plan, probed;
  void *plan_ws = nullptr, *probed_ws = nullptr;
};

CaseData SetUpCase(const Case& c, attnd::kernels::SplitTail split_tail) {
  CaseData cd;
  attnd::Problem pr;
  std::sscanf(c.config.c_str(), "hopper_sm90_d%d", &cd.d);
  pr.shape = attnd::Shape{c.b, c.s, c.s, c.h, c.h, cd.d};
  pr.dtype = attnd::DType::kBF16;
  pr.mask = c.causal ? attnd::Mask::kCausalTopLeft : attnd::Mask::kNone;
  pr.scale = 1.0f / std::sqrt(static_cast<float>(cd.d));
  cd.elems = static_cast<size_t>(c.b) * c.s * c.h * cd.d;
  std::vector<__nv_bfloat16> host(cd.elems);
  std::mt19937 rng(1234);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (void** p : {&cd.q, &cd.k, &cd.v}) {
    for (auto& x : host) x = __float2bfloat16(nd(rng));
    CHECK_CUDA(cudaMalloc(p, cd.elems * 2));
    CHECK_CUDA(cudaMemcpy(*p, host.data(), cd.elems * 2, cudaMemcpyHostToDevice));
  }
  for (void** p : {&cd.o1, &cd.o2}) {
    CHECK_CUDA(cudaMalloc(p, cd.elems * 2));
    CHECK_CUDA(cudaMemset(*p, 0xFF, cd.elems * 2));
  }
  attnd::kernels::PlanOptions po;
  po.config = c.config;
  po.hopper.split_tail = split_tail;
  for (auto [o, out, ws] : {std::tuple{cd.o1, &cd.plan, &cd.plan_ws}, std::tuple{cd.o2, &cd.probed, &cd.probed_ws}}) {
    absl::StatusOr<attnd::kernels::Plan> plan = attnd::kernels::MakePlan(
        pr, attnd::ContiguousLayout(pr.shape), attnd::kernels::DeviceTensors{cd.q, cd.k, cd.v, o, nullptr}, po);
    if (!plan.ok()) {
      std::fprintf(stderr, "%s\n", std::string(plan.status().message()).c_str());
      std::exit(1);
    }
    *out = *std::move(plan);
    if (out->workspace_bytes > 0) CHECK_CUDA(cudaMalloc(ws, out->workspace_bytes));
    if (absl::Status st = attnd::kernels::ZeroWorkspace(*out, *ws, nullptr); !st.ok()) {
      std::fprintf(stderr, "workspace: %s\n", std::string(st.message()).c_str());
      std::exit(1);
    }
  }
  return cd;
}

void FreeCase(CaseData& cd) {
  for (void* p : {cd.q, cd.k, cd.v, cd.o1, cd.o2, cd.plan_ws, cd.probed_ws}) CHECK_CUDA(cudaFree(p));
}

// The library's launch and the probed one, each timed once after `warmups` launches of both, with the probes
// writing only during the timed probed launch; both outputs and the stamps come back to the host.
struct PairRun {
  float ms_lib = 0, ms_probed = 0;
  std::vector<uint8_t> lib_out, probed_out;
  std::vector<uint64_t> stamps;  // [block][role][round][event], as trace::Put lays them out
  uint64_t At(int blk, int role, int round, int ev) const {
    return stamps[((static_cast<size_t>(blk) * hk::trace::kRoles + role) * hk::trace::kRounds + round) *
                      hk::trace::kEvents + ev];
  }
};

template <typename ProbedLaunch>
PairRun RunPair(const CaseData& cd, int blocks, int warmups, const ProbedLaunch& probed_launch) {
  const size_t words = static_cast<size_t>(blocks) * hk::trace::kRoles * hk::trace::kRounds * hk::trace::kEvents;
  uint64_t* buf = nullptr;
  CHECK_CUDA(cudaMalloc(&buf, words * 8));
  CHECK_CUDA(cudaMemset(buf, 0, words * 8));
  cudaEvent_t e0, e1, e2;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  CHECK_CUDA(cudaEventCreate(&e2));
  const auto launch_lib = [&] {
    if (absl::Status st = attnd::kernels::Launch(cd.plan, cd.plan_ws, nullptr); !st.ok()) {
      std::fprintf(stderr, "launch: %s\n", std::string(st.message()).c_str());
      std::exit(1);
    }
  };
  for (int i = 0; i < warmups; ++i) {
    launch_lib();
    probed_launch();
  }
  CHECK_CUDA(cudaDeviceSynchronize());
  CHECK_CUDA(cudaMemcpyToSymbol(hk::trace::g_buffer, &buf, sizeof(buf)));
  CHECK_CUDA(cudaEventRecord(e0));
  launch_lib();
  CHECK_CUDA(cudaEventRecord(e1));
  probed_launch();
  CHECK_CUDA(cudaEventRecord(e2));
  CHECK_CUDA(cudaDeviceSynchronize());
  uint64_t* none = nullptr;
  CHECK_CUDA(cudaMemcpyToSymbol(hk::trace::g_buffer, &none, sizeof(none)));
  PairRun r;
  CHECK_CUDA(cudaEventElapsedTime(&r.ms_lib, e0, e1));
  CHECK_CUDA(cudaEventElapsedTime(&r.ms_probed, e1, e2));
  r.lib_out.resize(cd.elems * 2);
  r.probed_out.resize(cd.elems * 2);
  r.stamps.resize(words);
  CHECK_CUDA(cudaMemcpy(r.lib_out.data(), cd.o1, cd.elems * 2, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(r.probed_out.data(), cd.o2, cd.elems * 2, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(r.stamps.data(), buf, words * 8, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaFree(buf));
  CHECK_CUDA(cudaEventDestroy(e0));
  CHECK_CUDA(cudaEventDestroy(e1));
  CHECK_CUDA(cudaEventDestroy(e2));
  return r;
}

double FlopsOf(const Case& c, int d) {
  return 4.0 * c.b * c.h * static_cast<double>(c.s) * c.s * d * (c.causal ? 0.5 : 1.0);
}

void RunCase(const Case& c) {
  const auto it = Launchers().find(c.config);
  if (it == Launchers().end()) {
    std::fprintf(stderr, "unknown config %s\n", c.config.c_str());
    std::exit(2);
  }
  CaseData cd = SetUpCase(c, attnd::kernels::SplitTail::kOff);
  const int d = cd.d;
  const hk::SchedulerParams sp = hk::BoundScheduler(cd.probed, cd.probed_ws);
  const int blocks = cd.probed.schedule.blocks;

  // Warm both once, then time one of each; the probed run is the one traced.
  const PairRun run = RunPair(cd, blocks, 1, [&] { it->second(cd.probed, sp); });
  const bool same = run.lib_out == run.probed_out;
  std::printf("\n== %s B=%d S=%d H=%d causal=%d: %d tiles on %d blocks; library %.1f us (%.0f TFLOP/s), probed %.1f us; "
              "outputs %s\n",
              c.config.c_str(), c.b, c.s, c.h, c.causal, sp.total_tiles, blocks, run.ms_lib * 1e3,
              FlopsOf(c, d) / (run.ms_lib * 1e-3) / 1e12, run.ms_probed * 1e3, same ? "bit-identical" : "DIFFER");

  const auto at = [&](int blk, int role, int round, int ev) { return run.At(blk, role, round, ev); };
  // Per n_blocks: qwait, first, middle, lastpv, epi, gap, total (cycles); middle steps counted apart.
  std::map<int, Acc> by_n;
  Acc prod;  // producer: first-K wait, Q wait (q_empty), Q issue -> consumer WG0 Q ready
  double middle_cycles = 0, middle_steps = 0;
  double parts[hk::trace::kStepParts] = {};  // summed over the same tiles' middle steps
  for (int blk = 0; blk < blocks; ++blk) {
    for (int role = 1; role < hk::trace::kRoles; ++role) {
      for (int r = 1; r + 1 < hk::trace::kRounds; ++r) {
        const uint64_t start = at(blk, role, r, hk::trace::kTileStart);
        const uint64_t next = at(blk, role, r + 1, hk::trace::kTileStart);
        if (start == 0 || next == 0) break;
        const int n = static_cast<int>(at(blk, role, r, hk::trace::kBlocks));
        if (n < 1) continue;
        const double ev[6] = {static_cast<double>(start),
                              static_cast<double>(at(blk, role, r, hk::trace::kQReady)),
                              static_cast<double>(at(blk, role, r, hk::trace::kFirstDone)),
                              static_cast<double>(at(blk, role, r, hk::trace::kMiddleDone)),
                              static_cast<double>(at(blk, role, r, hk::trace::kLastPVDone)),
                              static_cast<double>(at(blk, role, r, hk::trace::kStored))};
        Acc& acc = by_n[n];
        for (int i = 0; i < 5; ++i) acc.sum[i] += ev[i + 1] - ev[i];
        acc.sum[5] += static_cast<double>(next) - ev[5];
        acc.sum[6] += static_cast<double>(next) - ev[0];
        ++acc.n;
        if (n >= 4) {
          middle_cycles += ev[3] - ev[2];
          middle_steps += n - 1;
          for (int i = 0; i < hk::trace::kStepParts; ++i) {
            parts[i] += static_cast<double>(at(blk, role, r, hk::trace::kStepEvent0 + i));
          }
        }
      }
    }
    for (int r = 1; r + 1 < hk::trace::kRounds; ++r) {
      const uint64_t ps = at(blk, 0, r, hk::trace::kPTileStart);
      const uint64_t ready = at(blk, 1, r, hk::trace::kQReady);
      if (ps == 0 || ready == 0 || at(blk, 1, r + 1, hk::trace::kTileStart) == 0) break;
      const double k1 = static_cast<double>(at(blk, 0, r, hk::trace::kPFirstKIssued));
      const double qi = static_cast<double>(at(blk, 0, r, hk::trace::kPQIssued));
      prod.sum[0] += k1 - static_cast<double>(ps);
      prod.sum[1] += qi - k1;
      prod.sum[2] += static_cast<double>(ready) - qi;
      // When the Q load went out, relative to the consumer's start of this tile (negative: before it).
      prod.sum[3] += qi - static_cast<double>(at(blk, 1, r, hk::trace::kTileStart));
      ++prod.n;
    }
  }
  const double step = middle_steps > 0 ? middle_cycles / middle_steps : 0;
  std::printf("steady-state step (tiles with >= 4 blocks): %.0f cycles\n", step);
  if (middle_steps > 0) {
    // Warp 0 of each consumer warpgroup, between consecutive marks of the overlapped step (the probes' own clock
    // reads and shared-memory adds are in these figures).
    static const char* const kNames[hk::trace::kStepParts] = {"kwait", "turn", "issueS", "vwait",  "issuePV",
                                                              "Swait", "max",  "exp",    "PVwait", "convert"};
    double total = 0;
    for (double x : parts) total += x;
    std::printf("step parts (cycles per middle step, %% of their sum %.0f):", total / middle_steps);
    for (int i = 0; i < hk::trace::kStepParts; ++i) {
      std::printf(" %s %.0f (%.1f%%)", kNames[i], parts[i] / middle_steps, total > 0 ? 100.0 * parts[i] / total : 0.0);
    }
    std::printf("\n");
  }
  std::printf("%8s %6s %8s %8s %8s %8s %8s %8s %9s %10s\n", "n_blocks", "tiles", "qwait", "first", "middle/st",
              "lastpv", "epi", "gap", "total", "over(st)");
  for (const auto& [n, acc] : by_n) {
    const double m = 1.0 / acc.n;
    const double total = acc.sum[6] * m;
    std::printf("%8d %6d %8.0f %8.0f %8.0f %8.0f %8.0f %8.0f %9.0f %10.2f\n", n, acc.n, acc.sum[0] * m,
                acc.sum[1] * m, n > 1 ? acc.sum[2] * m / (n - 1) : 0.0, acc.sum[3] * m, acc.sum[4] * m,
                acc.sum[5] * m, total, step > 0 ? (total - n * step) / step : 0.0);
  }
  if (prod.n > 0) {
    const double m = 1.0 / prod.n;
    std::printf("producer: first-K slot wait %.0f, then q_empty wait %.0f, Q issue -> WG0 Q ready %.0f, Q issued "
                "%.0f cycles after WG0's tile start (%d tiles)\n",
                prod.sum[0] * m, prod.sum[1] * m, prod.sum[2] * m, prod.sum[3] * m, prod.n);
  }
  FreeCase(cd);
  if (!same) std::exit(3);
}

// --dump=FILE (timeline mode): one CSV row per block and round, to see which tiles and which SMs run
// slow: the tile (q tile, head, batch; for a split-tail part its tile and first key block), its key blocks, its start
// and length in us after the launch's first tile start, and the SM. Appends, so one file can hold several cases.
void DumpTimeline(const char* path, const Case& c, int blocks, const PairRun& run, uint64_t t0) {
  FILE* f = std::fopen(path, "a");
  if (f == nullptr) {
    std::fprintf(stderr, "cannot open %s\n", path);
    std::exit(1);
  }
  const int last = hk::trace::kRounds - 1;
  for (int blk = 0; blk < blocks; ++blk) {
    const uint64_t end =
        std::max(run.At(blk, 1, last, hk::trace::kGlobalStart), run.At(blk, 2, last, hk::trace::kGlobalStart));
    for (int r = 0; r < last; ++r) {
      const uint64_t s = run.At(blk, 1, r, hk::trace::kGlobalStart);
      if (s == 0) break;
      uint64_t next = run.At(blk, 1, r + 1, hk::trace::kGlobalStart);
      if (next == 0) next = end;
      const uint64_t tile = run.At(blk, 1, r, hk::trace::kTile);  // trace::PackTile's layout
      std::fprintf(f, "%s,%d,%d,%d,%d,%d,%d,%d,%d,%d,%d,%d,%llu,%llu,%.3f,%.3f\n", c.config.c_str(), c.b, c.s, c.h,
                   c.causal, blk, r, static_cast<int>(tile & 0xFFFFF), static_cast<int>((tile >> 20) & 0xFFFFF),
                   static_cast<int>(tile >> 40), static_cast<int>(run.At(blk, 1, r, hk::trace::kBlocks)),
                   static_cast<int>(run.At(blk, 1, r, hk::trace::kPartFirst)),
                   static_cast<unsigned long long>(run.At(blk, 1, r, hk::trace::kSmId)),
                   static_cast<unsigned long long>(run.At(blk, 2, r, hk::trace::kSmId)), (s - t0) * 1e-3,
                   (next - s) * 1e-3);
    }
  }
  std::fclose(f);
}

// One problem through the launcher's path with probes: block end times, and per round the rate per key block.
void RunTimeline(const Case& c, attnd::kernels::SplitTail split_tail, const char* dump_path) {
  const auto it = TimelineLaunchers().find(c.config);
  if (it == TimelineLaunchers().end()) {
    std::fprintf(stderr, "unknown timeline config %s\n", c.config.c_str());
    std::exit(2);
  }
  CaseData cd = SetUpCase(c, split_tail);
  const int d = cd.d;
  const hk::SchedulerParams sp = hk::BoundScheduler(cd.probed, cd.probed_ws);
  const int blocks = cd.probed.schedule.blocks;
  // Five warm-ups of each; a single probed launch after that still runs near the top clock, not at the power cap a
  // benchmark's back-to-back launches settle to.
  const PairRun run = RunPair(cd, blocks, 5, [&] { it->second(cd.probed, sp); });
  // The split tail combines parts in another order than a whole tile: compare in value, not bits.
  double max_diff = 0;
  for (size_t i = 0; i < cd.elems; ++i) {
    const float x = __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(run.lib_out.data())[i]);
    const float y = __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(run.probed_out.data())[i]);
    const double df = std::fabs(static_cast<double>(x) - y);
    if (!(df <= max_diff)) max_diff = std::isnan(df) ? INFINITY : df;
  }
  const auto at = [&](int blk, int role, int round, int ev) { return run.At(blk, role, round, ev); };
  const double flops = FlopsOf(c, d);
  std::printf("\n== timeline %s B=%d S=%d H=%d causal=%d: %d blocks, split tail %s (units %d from round %d); library "
              "%.1f us (%.0f TFLOP/s), probed %.1f us (%.0f TFLOP/s); max |O - library| %.3g\n",
              c.config.c_str(), c.b, c.s, c.h, c.causal, blocks, cd.probed.schedule.split_tail ? "on" : "off",
              sp.tail_units, sp.tail_round,
              run.ms_lib * 1e3, flops / (run.ms_lib * 1e-3) / 1e12, run.ms_probed * 1e3,
              flops / (run.ms_probed * 1e-3) / 1e12,
              max_diff);
  const int last = hk::trace::kRounds - 1;
  uint64_t t0 = UINT64_MAX;
  for (int blk = 0; blk < blocks; ++blk) {
    for (int role = 1; role < hk::trace::kRoles; ++role) {
      const uint64_t s0 = at(blk, role, 0, hk::trace::kGlobalStart);
      if (s0 != 0) t0 = std::min(t0, s0);
    }
  }
  // Per block: end (the later warpgroup's), and per round the start (warpgroup 0's); rounds past the last tile
  // or part hold 0.
  std::vector<double> ends;
  std::map<int, std::vector<double>> ns_per_block_by_round, dur_by_round;
  std::map<int, int> active_by_round;
  for (int blk = 0; blk < blocks; ++blk) {
    const uint64_t end = std::max(at(blk, 1, last, hk::trace::kGlobalStart), at(blk, 2, last, hk::trace::kGlobalStart));
    ends.push_back((end - t0) * 1e-3);
    for (int r = 0; r < last; ++r) {
      const uint64_t s = at(blk, 1, r, hk::trace::kGlobalStart);
      if (s == 0) break;
      uint64_t next = at(blk, 1, r + 1, hk::trace::kGlobalStart);
      if (next == 0) next = end;
      const int n = static_cast<int>(at(blk, 1, r, hk::trace::kBlocks)) -
                    static_cast<int>(at(blk, 1, r, hk::trace::kPartFirst));
      ++active_by_round[r];
      dur_by_round[r].push_back((next - s) * 1e-3);
      if (n > 0) ns_per_block_by_round[r].push_back(static_cast<double>(next - s) / n);
    }
  }
  if (dump_path != nullptr) DumpTimeline(dump_path, c, blocks, run, t0);
  std::vector<double> sorted = ends;
  std::sort(sorted.begin(), sorted.end());
  const double span = sorted.back();
  double mean_end = 0;
  for (double e : ends) mean_end += e;
  mean_end /= ends.size();
  std::printf("block ends (us after the first tile start): min %.1f, p10 %.1f, median %.1f, p90 %.1f, max %.1f; mean "
              "%.1f (%.2f%% of the span idle on average)\n",
              sorted.front(), sorted[sorted.size() / 10], sorted[sorted.size() / 2], sorted[sorted.size() * 9 / 10],
              span, mean_end, 100.0 * (span - mean_end) / span);
  std::printf("%6s %7s %10s %10s %10s %12s\n", "round", "blocks", "mean us", "min us", "max us", "ns/key-blk");
  for (const auto& [r, durs] : dur_by_round) {
    double m = 0;
    for (double x : durs) m += x;
    m /= durs.size();
    double nsb = 0;
    const auto& v = ns_per_block_by_round[r];
    for (double x : v) nsb += x;
    nsb = v.empty() ? 0 : nsb / v.size();
    std::printf("%6d %7d %10.1f %10.1f %10.1f %12.1f\n", r, active_by_round[r], m,
                *std::min_element(durs.begin(), durs.end()), *std::max_element(durs.begin(), durs.end()), nsb);
  }
  FreeCase(cd);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<Case> cases;
  bool timeline = false;
  const char* dump_path = nullptr;  // --dump=FILE, timeline mode only
  // --split_tail=..., timeline mode only: the per-tile mode's probed kernels have no split tail.
  attnd::kernels::SplitTail split_tail = attnd::kernels::SplitTail::kAuto;
  bool split_tail_set = false;
  for (; argc > 1 && std::strncmp(argv[1], "--", 2) == 0; --argc, ++argv) {
    const char* a = argv[1];
    if (std::strcmp(a, "--timeline") == 0) {
      timeline = true;
    } else if (std::strncmp(a, "--dump=", 7) == 0 && a[7] != '\0') {
      dump_path = a + 7;
    } else if (std::strcmp(a, "--split_tail=off") == 0) {
      split_tail = attnd::kernels::SplitTail::kOff;
      split_tail_set = true;
    } else if (std::strcmp(a, "--split_tail=auto") == 0) {
      split_tail = attnd::kernels::SplitTail::kAuto;
      split_tail_set = true;
    } else if (std::strcmp(a, "--split_tail=always") == 0) {
      split_tail = attnd::kernels::SplitTail::kAlways;
      split_tail_set = true;
    } else {
      std::fprintf(stderr, "unknown flag %s (--timeline, --dump=FILE, --split_tail=off|auto|always)\n", a);
      return 2;
    }
  }
  if (!timeline && (dump_path != nullptr || split_tail_set)) {
    std::fprintf(stderr, "--dump and --split_tail apply to --timeline only\n");
    return 2;
  }
  for (int i = 1; i + 4 < argc; i += 5) {
    cases.push_back(Case{argv[i], std::atoi(argv[i + 1]), std::atoi(argv[i + 2]), std::atoi(argv[i + 3]),
                         std::atoi(argv[i + 4])});
  }
  if (cases.empty()) {
    for (int causal : {0, 1}) {
      for (int s : {1024, 4096, 16384}) cases.push_back(Case{"hopper_sm90_d128_m128n128s3_osk_p2", 16384 / s, s, 16, causal});
    }
  }
  for (const Case& c : cases) timeline ? RunTimeline(c, split_tail, dump_path) : RunCase(c);
  return 0;
}
