// The kernel registry against the hopper family's tuned choice (DefaultHopperConfig), on the host: what auto runs
// on compute capability 9.0 must be a compiled entry of the problem's head_dim, and at head_dim 128 and 256 one
// compiled with the split last round. That list (MaySplitTail) is kept by hand beside the choice; v21 changed auto's
// d128 kernel without it, and no d128 launch split its last round from session 18 to 21 (found in v29: non-causal 16k
// +3.5% once it did). The GPU suite cannot see that: an unsplit last round is slower, not wrong.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

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

}  // namespace
}  // namespace attnd::kernels
