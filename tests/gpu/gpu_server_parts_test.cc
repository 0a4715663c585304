// The CUDA backend's host-side parts, which need no GPU: the caching allocator's budget accounting, the
// tensor-map LRU cache, the IPC bounds arithmetic and where a request's tensors sit in its blocks. They run in CI (no
// driver) as well as on GPU hosts.
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attnd/server/cuda/block_cache.h"
#include "attnd/server/cuda/ipc_registry.h"
#include "attnd/server/cuda/tensor_map_cache.h"
#include "cuda_device.h"
#include "gtest/gtest.h"

namespace attnd::server::cuda {
namespace {

// A fake raw allocator that hands out distinct fake addresses and records what is live.
struct FakeMemory {
  std::map<uintptr_t, uint64_t> live;
  uintptr_t next = 0x100000;
  int allocs = 0, frees = 0;
  bool fail = false;
  RawAllocator Raw() {
    return RawAllocator{"fake memory",
                        [this](uint64_t n) -> absl::StatusOr<void*> {
                          if (fail) return absl::InternalError("out of memory");
                          ++allocs;
                          const uintptr_t p = next;
                          next += n + 4096;
                          live[p] = n;
                          return reinterpret_cast<void*>(p);
                        },
                        [this](void* p) {
                          ++frees;
                          live.erase(reinterpret_cast<uintptr_t>(p));
                        }};
  }
};

constexpr uint64_t kMiB = 1 << 20;

TEST(BlockCacheTest, ReusesTheLastReleasedBlockOfASize) {
  FakeMemory mem;
  BlockCache cache(mem.Raw(), 64 * kMiB);
  auto a = cache.Acquire(3 * kMiB);
  auto b = cache.Acquire(3 * kMiB);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(a->ptr, b->ptr);
  EXPECT_GE(a->size, 3 * kMiB);
  cache.Release(*a);
  cache.Release(*b);
  // Last released comes back first: a stream of one shape keeps its addresses (and its tensor maps).
  auto c = cache.Acquire(3 * kMiB);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->ptr, b->ptr);
  auto d = cache.Acquire(3 * kMiB + 100);  // same 2 MiB class
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->ptr, a->ptr);
  EXPECT_EQ(mem.allocs, 2);
  EXPECT_EQ(cache.stats().reuses, 2u);
  cache.Release(*c);
  cache.Release(*d);
}

// A fresh block (a move's device rows, which another process maps) is never a cached one and is freed, not cached,
// when dropped: no earlier request's bytes go out in it, and no later request lands in it. It counts against the
// budget meanwhile.
TEST(BlockCacheTest, AFreshBlockIsItsOwnAllocationAndIsFreedWhenDropped) {
  FakeMemory mem;
  BlockCache cache(mem.Raw(), 16 * kMiB);
  auto cached = cache.Acquire(4 * kMiB);
  ASSERT_TRUE(cached.ok());
  cache.Release(*cached);
  auto fresh = cache.AcquireFresh(4 * kMiB);
  ASSERT_TRUE(fresh.ok());
  EXPECT_NE(fresh->ptr, cached->ptr);
  EXPECT_EQ(mem.allocs, 2);
  EXPECT_EQ(cache.stats().in_use_bytes, 4 * kMiB);
  EXPECT_EQ(cache.AcquireFresh(13 * kMiB).status().code(), absl::StatusCode::kResourceExhausted);
  cache.Drop(*fresh);
  EXPECT_EQ(mem.frees, 2);  // the fresh block, and the cached one given back to make room for the refused one
  EXPECT_EQ(mem.live.count(reinterpret_cast<uintptr_t>(fresh->ptr)), 0u);
  EXPECT_EQ(cache.stats().in_use_bytes, 0u);
  EXPECT_EQ(cache.stats().held_bytes, 0u);
  auto again = cache.Acquire(4 * kMiB);  // a new allocation: the dropped block was not cached
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(mem.allocs, 3);
  cache.Release(*again);
}

TEST(BlockCacheTest, DoesNotHandOutAFarLargerBlock) {
  FakeMemory mem;
  BlockCache cache(mem.Raw(), 256 * kMiB);
  auto big = cache.Acquire(64 * kMiB);
  ASSERT_TRUE(big.ok());
  cache.Release(*big);
  auto small = cache.Acquire(4 * kMiB);
  ASSERT_TRUE(small.ok());
  EXPECT_NE(small->ptr, big->ptr);
  EXPECT_LT(small->size, 8 * kMiB);
  cache.Release(*small);
}

TEST(BlockCacheTest, OverBudgetIsResourceExhaustedAndNeverAllocates) {
  FakeMemory mem;
  BlockCache cache(mem.Raw(), 10 * kMiB);
  auto a = cache.Acquire(6 * kMiB);
  ASSERT_TRUE(a.ok());
  auto b = cache.Acquire(6 * kMiB);  // 6 in use + 6 > 10
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(b.status().message().find("budget"), std::string::npos) << b.status();
  auto huge = cache.Acquire(11 * kMiB);  // more than the whole budget
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(mem.allocs, 1);
  EXPECT_LE(cache.stats().held_bytes, 10 * kMiB);
  cache.Release(*a);
}

TEST(BlockCacheTest, EmptiesTheCacheBeforeRefusing) {
  FakeMemory mem;
  BlockCache cache(mem.Raw(), 10 * kMiB);
  auto a = cache.Acquire(6 * kMiB);
  ASSERT_TRUE(a.ok());
  cache.Release(*a);  // cached, still held
  auto b = cache.Acquire(8 * kMiB);  // needs the cached 6 MiB given back first
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(mem.frees, 1);
  EXPECT_EQ(cache.stats().held_bytes, b->size);
  cache.Release(*b);
}

TEST(BlockCacheTest, RawAllocationFailureIsResourceExhausted) {
  FakeMemory mem;
  mem.fail = true;
  BlockCache cache(mem.Raw(), 10 * kMiB);
  auto a = cache.Acquire(kMiB);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(BlockCacheTest, DestructorFreesCachedBlocks) {
  FakeMemory mem;
  {
    BlockCache cache(mem.Raw(), 64 * kMiB);
    auto a = cache.Acquire(kMiB), b = cache.Acquire(5 * kMiB);
    cache.Release(*a);
    cache.Release(*b);
  }
  EXPECT_TRUE(mem.live.empty());
  EXPECT_EQ(mem.frees, 2);
}

TEST(BlockCacheTest, SizeClassesCoverTheRequest) {
  for (uint64_t n : {uint64_t{1}, uint64_t{65536}, uint64_t{65537}, kMiB + 1, 2 * kMiB, 2 * kMiB + 1, 999 * kMiB + 7}) {
    const uint64_t c = BlockCache::SizeClass(n);
    EXPECT_GE(c, n);
    EXPECT_LE(c, n < 2 * kMiB ? 2 * n + 65536 : n + 2 * kMiB) << n;
  }
}

kernels::TensorMapKey Key(uint64_t address, uint64_t seq = 128) {
  kernels::TensorMapKey k;
  k.address = address;
  k.dims[0] = 128;
  k.dims[1] = 8;
  k.dims[2] = seq;
  k.dims[3] = 1;
  k.strides_bytes[0] = 256;
  k.strides_bytes[1] = 2048;
  k.strides_bytes[2] = 2048 * seq;
  k.box[0] = 64;
  k.box[1] = 1;
  k.box[2] = 64;
  k.box[3] = 1;
  return k;
}

struct CountingEncoder {
  std::vector<uint64_t> encoded;  // addresses, in order
  TensorMapCache::Encoder Fn() {
    return [this](const kernels::TensorMapKey& k) -> absl::StatusOr<CUtensorMap> {
      if (k.address == 0xbad) return absl::InvalidArgumentError("rejected");
      encoded.push_back(k.address);
      CUtensorMap m{};
      std::memcpy(&m, &k.address, sizeof k.address);  // so a hit can be checked to return the right map
      return m;
    };
  }
};

uint64_t Tag(const CUtensorMap& m) {
  uint64_t a;
  std::memcpy(&a, &m, sizeof a);
  return a;
}

TEST(TensorMapCacheTest, RepeatedKeysHitWithoutEncoding) {
  CountingEncoder enc;
  TensorMapCache cache(16, enc.Fn());
  for (int i = 0; i < 5; ++i) {
    auto m = cache.Get(Key(0x1000));
    ASSERT_TRUE(m.ok());
    EXPECT_EQ(Tag(*m), 0x1000u);
  }
  EXPECT_EQ(enc.encoded.size(), 1u);
  EXPECT_EQ(cache.hits(), 4u);
  EXPECT_EQ(cache.misses(), 1u);
  // Any field of the key distinguishes entries.
  ASSERT_TRUE(cache.Get(Key(0x1000, 256)).ok());
  EXPECT_EQ(cache.misses(), 2u);
}

TEST(TensorMapCacheTest, EvictsTheLeastRecentlyUsed) {
  CountingEncoder enc;
  TensorMapCache cache(2, enc.Fn());
  ASSERT_TRUE(cache.Get(Key(0xa0)).ok());
  ASSERT_TRUE(cache.Get(Key(0xb0)).ok());
  ASSERT_TRUE(cache.Get(Key(0xa0)).ok());  // a is now the most recent
  ASSERT_TRUE(cache.Get(Key(0xc0)).ok());  // evicts b
  EXPECT_EQ(cache.size(), 2u);
  ASSERT_TRUE(cache.Get(Key(0xa0)).ok());
  EXPECT_EQ(enc.encoded.size(), 3u);  // a hit
  ASSERT_TRUE(cache.Get(Key(0xb0)).ok());
  EXPECT_EQ(enc.encoded.size(), 4u);  // b was evicted: encoded again
}

TEST(TensorMapCacheTest, EncodeErrorsAreReturnedAndNotCached) {
  CountingEncoder enc;
  TensorMapCache cache(4, enc.Fn());
  EXPECT_EQ(cache.Get(Key(0xbad)).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache.Get(Key(0xbad)).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache.size(), 0u);
  EXPECT_EQ(cache.misses(), 2u);
}

TEST(IpcBoundsTest, ContiguousSpanIsTheTensorSize) {
  const Strides st = ContiguousStrides(100, 8, 128);
  auto b = TensorSpanBytes("q.ref", 2, 100, 8, 128, st, 2);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(*b, uint64_t{2} * 100 * 8 * 128 * 2);
}

TEST(IpcBoundsTest, StridedSpanEndsAtTheLastElement) {
  // Heads interleaved in a wider row (e.g. a fused QKV buffer): seq stride 3 * heads * head_dim.
  const Strides st{3 * 50 * 4 * 64, 3 * 4 * 64, 64};
  auto b = TensorSpanBytes("k.ref", 3, 50, 4, 64, st, 2);
  ASSERT_TRUE(b.ok());
  const uint64_t last = 2ull * st.batch + 49ull * st.seq + 3ull * st.head + 63;
  EXPECT_EQ(*b, (last + 1) * 2);
}

TEST(IpcBoundsTest, OverflowingStridesAreInvalidArgument) {
  const int64_t big = std::numeric_limits<int64_t>::max() / 2;
  auto b = TensorSpanBytes("v.ref", 4, 8, 8, 64, Strides{big, 64, 64}, 2);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(b.status().message().find("v.ref"), std::string::npos);
}

TEST(IpcBoundsTest, RegionChecks) {
  EXPECT_TRUE(CheckInRegion("q.ref.offset", 0, 100, 100).ok());
  EXPECT_TRUE(CheckInRegion("q.ref.offset", 16, 84, 100).ok());
  EXPECT_EQ(CheckInRegion("q.ref.offset", 16, 85, 100).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckInRegion("q.ref.offset", ~uint64_t{0} - 8, 64, 100).code(), absl::StatusCode::kInvalidArgument);
  const absl::Status s = CheckInRegion("o_ref.offset", 4096, 1, 4096);
  EXPECT_NE(s.message().find("o_ref.offset"), std::string::npos) << s;
}

// Float8 inputs take one byte an element and O two; the descales follow the inline inputs, each array 16-byte
// aligned, inside the range the one H2D copy moves, also when every tensor is a reference.
TEST(PlacementTest, Float8InputsBytesOfOneOBf16DescalesWithTheInputs) {
  const Shape s{2, 100, 300, 6, 3, 128};
  const Placement bf16 = Place(s, DType::kBF16, true, true, true, true, true);
  const Placement fp8 = Place(s, DType::kFP8E4M3, true, true, true, true, true);
  EXPECT_EQ(bf16.descales, Placement::kAbsent);
  EXPECT_EQ(fp8.q, 0u);
  EXPECT_EQ(fp8.k, Align(2 * 100 * 6 * 128));
  EXPECT_EQ(fp8.v, fp8.k + Align(2 * 300 * 3 * 128));
  EXPECT_EQ(fp8.descales, fp8.v + Align(2 * 300 * 3 * 128));
  EXPECT_EQ(fp8.k_descale_at, 32u);                  // 6 floats, to 16 bytes
  EXPECT_EQ(fp8.v_descale_at, 48u);                  // then 3 floats, to 16 bytes
  EXPECT_EQ(fp8.descale_bytes, 64u);
  EXPECT_EQ(fp8.in_bytes, fp8.descales + Align(64));
  EXPECT_EQ(fp8.o, fp8.in_bytes);
  EXPECT_EQ(fp8.lse, fp8.o + Align(2 * 100 * 6 * 128 * 2));  // O in bf16, as the 16-bit placement's
  EXPECT_EQ(fp8.lse - fp8.o, bf16.lse - bf16.o);
  EXPECT_LT(fp8.in_bytes, bf16.in_bytes);
  const Placement refs = Place(s, DType::kFP8E4M3, false, false, false, false, false);
  EXPECT_EQ(refs.descales, 0u);
  EXPECT_EQ(refs.in_bytes, Align(64));
  EXPECT_EQ(refs.total, refs.in_bytes);
}

}  // namespace
}  // namespace attnd::server::cuda
