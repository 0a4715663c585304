// RetainFreedHeapMemory (attnd/transport/heap_tuning.h) on the C library's allocator, as attn and the client
// libraries have it: tensor-sized blocks come from the heap, not from fresh mmaps that every request would
// page-fault in again; IdleHeapTrimmer gives them back once requests stop. heap_tuning_jemalloc_test covers attnd's.
#include "attnd/transport/heap_tuning.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace attnd {
namespace {

#if defined(__GLIBC__)
TEST(HeapTuning, TensorSizedBlocksStayInTheHeap) {
  ASSERT_FALSE(HeapIsJemalloc());
  ASSERT_TRUE(RetainFreedHeapMemory());
  // 16 MiB: one bf16 tensor of 1k tokens x 32 heads x 256. glibc's default would mmap it (hblkhd grows).
  const size_t before = mallinfo2().hblkhd;
  void* p = std::malloc(16u << 20);
  ASSERT_NE(p, nullptr);
  std::memset(p, 1, 16u << 20);
  EXPECT_EQ(mallinfo2().hblkhd, before) << "a 16 MiB block was served by mmap";
  std::free(p);
  // Freed, it stays mapped for the next one: the arena keeps at least that much.
  const size_t kept = mallinfo2().arena;
  EXPECT_GE(kept, size_t{16} << 20);
}
#else
TEST(HeapTuning, OtherCLibrariesAreLeftAlone) { EXPECT_FALSE(RetainFreedHeapMemory()); }
#endif

TEST(IdleHeapTrimmer, ReleasesOnceAQuietSpellAndNotWhileBusy) {
  std::atomic<uint64_t> activity{0};
  IdleHeapTrimmer trimmer([&] { return activity.load(); }, absl::Milliseconds(50));
  // Busy: the count moves between every two looks.
  const absl::Time busy_until = absl::Now() + absl::Milliseconds(400);
  while (absl::Now() < busy_until) {
    ++activity;
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(trimmer.releases(), 0u);
  // Quiet for many periods: one release, not one per period.
  absl::SleepFor(absl::Milliseconds(500));
  EXPECT_EQ(trimmer.releases(), 1u);
  // Busy again, then quiet again: a second.
  ++activity;
  absl::SleepFor(absl::Milliseconds(400));
  EXPECT_EQ(trimmer.releases(), 2u);
}

}  // namespace
}  // namespace attnd
