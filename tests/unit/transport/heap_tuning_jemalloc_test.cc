// attnd's heap on jemalloc (attnd/transport/heap_tuning.h with server/jemalloc_conf.cc's options, as the attnd
// binary has them): freed tensor-sized blocks stay in their arena for the next request, the idle purge hands back
// every arena's, and --retain_heap=false hands them back at once.
#include <jemalloc/jemalloc.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "attnd/transport/heap_tuning.h"
#include "gtest/gtest.h"

namespace attnd {
namespace {

constexpr size_t kBlock = size_t{16} << 20;  // one bf16 tensor of 1k tokens x 32 heads x 256

template <typename T>
T Read(const std::string& name) {
  T value{};
  size_t len = sizeof value;
  EXPECT_EQ(mallctl(name.c_str(), &value, &len, nullptr, 0), 0) << name;
  return value;
}

// Unused pages that every arena holds, freshly counted.
size_t DirtyPages() {
  uint64_t epoch = 1;
  size_t len = sizeof epoch;
  EXPECT_EQ(mallctl("epoch", &epoch, &len, &epoch, len), 0);
  return Read<size_t>("stats.arenas." + std::to_string(MALLCTL_ARENAS_ALL) + ".pdirty");
}

// A block written through and freed.
void UseAndFree() {
  void* p = std::malloc(kBlock);
  ASSERT_NE(p, nullptr);
  std::memset(p, 1, kBlock);
  std::free(p);
}

TEST(HeapTuningJemalloc, AttndsOptionsAreRead) {
  ASSERT_TRUE(HeapIsJemalloc());
  EXPECT_EQ(Read<size_t>("opt.oversize_threshold"), 0u) << "tensor-sized blocks would be purged at once";
  EXPECT_EQ(Read<size_t>("opt.tcache_max"), size_t{16384});
  EXPECT_STREQ(Read<const char*>("opt.percpu_arena"), "percpu");
}

TEST(HeapTuningJemalloc, FreedBlocksStayUntilTheIdlePurge) {
  ASSERT_TRUE(RetainFreedHeapMemory());
  EXPECT_EQ(Read<ssize_t>("arenas.dirty_decay_ms"), 10000);
  ASSERT_TRUE(ReleaseFreedHeapMemory());
  UseAndFree();
  EXPECT_GE(DirtyPages(), kBlock / 4096) << "the freed block's pages went back at once";
  ASSERT_TRUE(ReleaseFreedHeapMemory());
  EXPECT_EQ(DirtyPages(), 0u);
}

TEST(HeapTuningJemalloc, WithoutRetainingFreedBlocksGoBackAtOnce) {
  ASSERT_TRUE(ReturnFreedHeapMemoryAtOnce());
  EXPECT_EQ(Read<ssize_t>("arenas.dirty_decay_ms"), 0);
  ASSERT_TRUE(ReleaseFreedHeapMemory());
  UseAndFree();
  EXPECT_LT(DirtyPages(), kBlock / 4096);
  ASSERT_TRUE(RetainFreedHeapMemory());
}

}  // namespace
}  // namespace attnd
