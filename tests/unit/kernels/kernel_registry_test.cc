// The kernel registry and the plan-time host logic, without a device (runs in CI):
//  - what auto runs on compute capability 9.0 is a compiled entry of the problem's head_dim, and at head_dim 128 and
//    256 one compiled with the split last round. That list (MaySplitTail) is kept by hand beside the choice, and
//    the GPU suite cannot see a mismatch: an unsplit last round is slower, not wrong;
//  - the library ships the configurations auto and DefaultConfig choose;
//  - plans get their schedule from PlanOptions::hopper and report the workspace their launches need, and a launch
//    without it is refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "attnd/kernels/attention.h"
#include "attnd/problem.h"
#include "config_registry.h"

namespace attnd::kernels {
namespace {

const KernelEntry* FindEntry(const std::string& name) {
  for (const KernelEntry& e : AllEntries()) {
    if (name == e.name) return &e;
  }
  return nullptr;
}

int EntryIndex(const std::string& name) {
  for (size_t i = 0; i < AllEntries().size(); ++i) {
    if (name == AllEntries()[i].name) return static_cast<int>(i);
  }
  return -1;
}

// The rows auto is tuned on (FA3's convention plus GQA and a long tail), each mask.
std::vector<Problem> AutoRows(int head_dim) {
  std::vector<Problem> out;
  for (Mask mask : {Mask::kNone, Mask::kCausalTopLeft, Mask::kCausalBottomRight}) {
    for (int64_t seq : {128, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536}) {
      for (int64_t kv_heads : {int64_t{2048 / head_dim}, int64_t{2}}) {
        Problem p;
        p.shape.batch = seq >= 16384 ? 1 : 16384 / seq;
        p.shape.q_len = seq;
        p.shape.kv_len = seq;
        p.shape.q_heads = 2048 / head_dim;
        p.shape.kv_heads = kv_heads;
        p.shape.head_dim = head_dim;
        p.mask = mask;
        out.push_back(p);
      }
    }
  }
  return out;
}

TEST(KernelRegistryTest, AutoChoosesCompiledHopperEntriesOfTheProblemsHeadDim) {
  for (int d : {64, 128, 256}) {
    for (const Problem& p : AutoRows(d)) {
      const char* name = DefaultHopperConfig(p);
      ASSERT_NE(name, nullptr) << "head_dim " << d;
      const KernelEntry* e = FindEntry(name);
      ASSERT_NE(e, nullptr) << name << " is not in the registry";
      EXPECT_EQ(e->family, Family::kHopper) << name;
      EXPECT_EQ(e->head_dim, d) << name;
      EXPECT_NE(e->plan_schedule, nullptr) << name;
    }
  }
}

TEST(KernelRegistryTest, AutoAtHeadDim128And256RunsKernelsWithTheSplitTail) {
  for (int d : {128, 256}) {
    for (const Problem& p : AutoRows(d)) {
      const KernelEntry* e = FindEntry(DefaultHopperConfig(p));
      ASSERT_NE(e, nullptr);
      EXPECT_TRUE(e->split_tail) << e->name << " (auto at head_dim " << d << ", seq " << p.shape.q_len << ", mask "
                                 << MaskName(p.mask) << ") is not compiled with the split tail (MaySplitTail)";
    }
  }
}

TEST(KernelRegistryTest, ShipsTheChosenConfigurations) {
  const std::set<std::string> hopper = {"hopper_sm90_d64_m128n128s6_p2",      "hopper_sm90_d64_m192n128s4_wrs",
                                        "hopper_sm90_d128_m128n128s3_osk_p2", "hopper_sm90_d256_m128n64s2",
                                        "hopper_sm90_d128_fp8_m128n128s6_osk_p2",    "hopper_sm90_d256_fp8_m128n128s2"};
  const std::set<std::string> mma_sync = {"mma_sync_sm120_d64_m64n64s2",    "mma_sync_sm120_d128_m64n64s1",
                                          "mma_sync_sm120_d256_m64n64s1",    "mma_sync_sm90_d64_m128n64s2w4",
                                          "mma_sync_sm90_d128_m128n64s2w4", "mma_sync_sm90_d128_m64n64s2"};
  for (const auto* names : {&hopper, &mma_sync}) {
    for (const std::string& name : *names) EXPECT_NE(FindEntry(name), nullptr) << name << " is not compiled";
  }
  for (const KernelEntry& e : AllEntries()) {
    if (e.family == Family::kMmaSync) {
      EXPECT_TRUE(mma_sync.count(e.name)) << e.name << " is compiled but DefaultConfig never chooses it";
      EXPECT_EQ(e.plan_schedule, nullptr) << e.name;
    }
  }
}

// Float8 problems run the `_fp8` entries, which run nothing else: each entry launches exactly its element types.
TEST(KernelRegistryTest, Fp8ProblemsRunTheFp8Entries) {
  for (int d : {128, 256}) {
    for (Problem p : AutoRows(d)) {
      p.dtype = DType::kFP8E4M3;
      const char* name = DefaultHopperConfig(p);
      ASSERT_NE(name, nullptr) << "head_dim " << d;
      const KernelEntry* e = FindEntry(name);
      ASSERT_NE(e, nullptr) << name << " is not in the registry";
      EXPECT_TRUE(e->fp8) << name;
      EXPECT_EQ(e->head_dim, d) << name;
    }
  }
  Problem d64;
  d64.shape = Shape{1, 1024, 1024, 8, 8, 64};
  d64.dtype = DType::kFP8E4M3;
  EXPECT_EQ(DefaultHopperConfig(d64), nullptr) << "float8 needs a 128-byte row: head_dim 128 or 256";
  for (const KernelEntry& e : AllEntries()) {
    EXPECT_EQ(e.launch[2] != nullptr, e.fp8) << e.name;
    EXPECT_EQ(e.launch[0] != nullptr, !e.fp8) << e.name;
    EXPECT_EQ(e.launch[1] != nullptr, !e.fp8) << e.name;
  }
}

// A selection as Select() makes it, for a device this host need not have.
Selection MakeSelection(const std::string& config, const Shape& shape, Mask mask,
                        const HopperScheduleOptions& hopper = {}) {
  Selection sel;
  sel.problem.shape = shape;
  sel.problem.mask = mask;
  sel.problem.scale = DefaultScale(shape.head_dim);
  sel.layout = ContiguousLayout(shape);
  sel.config = EntryIndex(config);
  sel.device = 0;
  sel.hopper = hopper;
  if (sel.config >= 0 && AllEntries()[sel.config].fp8) sel.problem.dtype = DType::kFP8E4M3;
  return sel;
}

// An H200: 132 SMs, 50 MiB of L2.
absl::StatusOr<Plan> PlanFor(const Selection& sel) {
  const DeviceTensors t{reinterpret_cast<const void*>(0x100000), reinterpret_cast<const void*>(0x200000),
                        reinterpret_cast<const void*>(0x300000), reinterpret_cast<void*>(0x400000), nullptr};
  const CUtensorMap map{};
  return AssemblePlan(sel, t, map, map, map, &map, DeviceLimits{132, 50 << 20});
}

constexpr const char* kD64Causal = "hopper_sm90_d64_m192n128s4_wrs";
constexpr const char* kD128 = "hopper_sm90_d128_m128n128s3_osk_p2";
constexpr const char* kD256 = "hopper_sm90_d256_m128n64s2";

TEST(KernelPlanTest, WorkspaceOnlyWherePlansNeedIt) {
  const Shape d128_16k{1, 16384, 16384, 16, 16, 128};
  // The mma_sync family: one block per tile, nothing to schedule.
  absl::StatusOr<Plan> mma_sync = PlanFor(MakeSelection("mma_sync_sm90_d128_m64n64s2", d128_16k, Mask::kNone));
  ASSERT_TRUE(mma_sync.ok()) << mma_sync.status();
  EXPECT_EQ(mma_sync->workspace_bytes, 0u);
  EXPECT_EQ(mma_sync->schedule.blocks, 0);
  // Short rows keep whole tiles: no workspace.
  absl::StatusOr<Plan> short_rows = PlanFor(MakeSelection(kD128, Shape{16, 1024, 1024, 16, 16, 128}, Mask::kNone));
  ASSERT_TRUE(short_rows.ok()) << short_rows.status();
  EXPECT_EQ(short_rows->workspace_bytes, 0u);
  EXPECT_EQ(short_rows->schedule.blocks, 132);
  EXPECT_FALSE(short_rows->schedule.split_tail);
  // Long rows split their last round: the parts' counters and partial outputs.
  for (const auto& [config, shape] : {std::pair<const char*, Shape>{kD128, d128_16k},
                                      std::pair<const char*, Shape>{kD256, Shape{2, 8192, 8192, 8, 8, 256}}}) {
    absl::StatusOr<Plan> split = PlanFor(MakeSelection(config, shape, Mask::kNone));
    ASSERT_TRUE(split.ok()) << split.status();
    const LaunchSchedule& s = split->schedule;
    EXPECT_TRUE(s.split_tail) << config;
    EXPECT_EQ(s.tile_counters, LaunchSchedule::kNoOffset);
    EXPECT_EQ(s.split_counters, 0u);
    ASSERT_NE(s.split_partials, LaunchSchedule::kNoOffset);
    EXPECT_EQ(s.split_partials % 256, 0u);
    EXPECT_GT(split->workspace_bytes, s.split_partials);
    EXPECT_EQ(split->workspace_bytes % 256, 0u);
  }
  // The dynamic causal order: its two tile counters.
  const Shape d64_1k{8, 1024, 1024, 32, 32, 64};
  absl::StatusOr<Plan> dynamic = PlanFor(MakeSelection(kD64Causal, d64_1k, Mask::kCausalTopLeft));
  ASSERT_TRUE(dynamic.ok()) << dynamic.status();
  EXPECT_EQ(dynamic->schedule.order, 2) << "hopper::kDynamic";
  EXPECT_EQ(dynamic->schedule.tile_counters, 0u);
  EXPECT_EQ(dynamic->workspace_bytes, 256u);
}

TEST(KernelPlanTest, ScheduleOptionsReachThePlan) {
  const Shape d128_16k{1, 16384, 16384, 16, 16, 128};
  HopperScheduleOptions off;
  off.split_tail = SplitTail::kOff;
  absl::StatusOr<Plan> whole = PlanFor(MakeSelection(kD128, d128_16k, Mask::kNone, off));
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_FALSE(whole->schedule.split_tail);
  EXPECT_EQ(whole->workspace_bytes, 0u);

  HopperScheduleOptions fixed;
  fixed.causal_order = CausalOrder::kStatic;
  absl::StatusOr<Plan> static_order =
      PlanFor(MakeSelection(kD64Causal, Shape{8, 1024, 1024, 32, 32, 64}, Mask::kCausalTopLeft, fixed));
  ASSERT_TRUE(static_order.ok()) << static_order.status();
  EXPECT_EQ(static_order->schedule.order, 0) << "hopper::kStatic";
  EXPECT_EQ(static_order->workspace_bytes, 0u);

  // Few blocks with the split tail forced: a small problem splits its last round among 3 blocks.
  HopperScheduleOptions few;
  few.max_blocks = 3;
  const Shape small{2, 1000, 1000, 4, 4, 128};
  absl::StatusOr<Plan> unforced = PlanFor(MakeSelection(kD128, small, Mask::kNone, few));
  ASSERT_TRUE(unforced.ok()) << unforced.status();
  EXPECT_EQ(unforced->schedule.blocks, 3);
  EXPECT_FALSE(unforced->schedule.split_tail);
  few.split_tail = SplitTail::kAlways;
  absl::StatusOr<Plan> forced = PlanFor(MakeSelection(kD128, small, Mask::kNone, few));
  ASSERT_TRUE(forced.ok()) << forced.status();
  EXPECT_EQ(forced->schedule.blocks, 3);
  EXPECT_TRUE(forced->schedule.split_tail);
  EXPECT_GT(forced->workspace_bytes, 0u);
}

TEST(KernelPlanTest, BadScheduleOptionsNameTheField) {
  HopperScheduleOptions o;
  o.max_blocks = -1;
  absl::Status st = CheckHopperOptions(o);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("options.hopper.max_blocks"), std::string::npos) << st;
  o = HopperScheduleOptions{};
  o.split_tail = static_cast<SplitTail>(7);
  st = CheckHopperOptions(o);
  EXPECT_NE(st.message().find("options.hopper.split_tail"), std::string::npos) << st;
  o = HopperScheduleOptions{};
  o.tail_tiles_per_block = 5000;
  EXPECT_EQ(PlanFor(MakeSelection(kD128, Shape{1, 1024, 1024, 16, 16, 128}, Mask::kNone, o)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(CheckHopperOptions(HopperScheduleOptions{}).ok());
}

// A float8 plan transposes V into the caller's scratch before its kernel, and takes the descales along.
TEST(KernelPlanTest, Fp8PlansCarryTheDescalesAndTheTranspose) {
  const Shape s{2, 1000, 1001, 8, 2, 128};
  const Selection sel = MakeSelection("hopper_sm90_d128_fp8_m128n128s6_osk_p2", s, Mask::kCausalBottomRight);
  ASSERT_GE(sel.config, 0);
  DeviceTensors t{reinterpret_cast<const void*>(0x100000), reinterpret_cast<const void*>(0x200000),
                  reinterpret_cast<const void*>(0x300000), reinterpret_cast<void*>(0x400000), nullptr};
  const CUtensorMap map{};
  absl::StatusOr<Plan> refused = AssemblePlan(sel, t, map, map, map, &map, DeviceLimits{132, 50 << 20});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("q_descale"), std::string::npos) << refused.status();
  const float descales[3] = {1, 1, 1};
  t.q_descale = &descales[0];
  t.k_descale = &descales[1];
  t.v_descale = &descales[2];
  refused = AssemblePlan(sel, t, map, map, map, &map, DeviceLimits{132, 50 << 20});
  EXPECT_NE(refused.status().message().find("v_t"), std::string::npos) << refused.status();
  t.v_t = reinterpret_cast<void*>(0x500000);
  absl::StatusOr<Plan> plan = AssemblePlan(sel, t, map, map, map, &map, DeviceLimits{132, 50 << 20});
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->params.q_descale, &descales[0]);
  EXPECT_EQ(plan->params.v_descale, &descales[2]);
  EXPECT_EQ(plan->v_transpose.v, t.v);
  EXPECT_EQ(plan->v_transpose.v_t, t.v_t);
  EXPECT_EQ(plan->v_transpose.kv_len_padded, 1024);
  EXPECT_EQ(VTransposedBytes(s, DType::kFP8E4M3), 2 * 2 * 128 * 1024);
  EXPECT_EQ(VTransposedBytes(s, DType::kBF16), 0);
}

TEST(KernelPlanTest, LaunchRefusesAMissingOrMisalignedWorkspace) {
  absl::StatusOr<Plan> plan = PlanFor(MakeSelection(kD128, Shape{1, 16384, 16384, 16, 16, 128}, Mask::kNone));
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_GT(plan->workspace_bytes, 0u);
  absl::Status st = Launch(*plan, nullptr, nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("workspace"), std::string::npos) << st;
  st = Launch(*plan, reinterpret_cast<void*>(0x1010), nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("workspace"), std::string::npos) << st;
  st = ZeroWorkspace(*plan, nullptr, nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("workspace"), std::string::npos) << st;
}

}  // namespace
}  // namespace attnd::kernels
