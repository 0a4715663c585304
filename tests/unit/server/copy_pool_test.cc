// attnd/server/copy_pool.h: every byte lands where it should, for parts below and above the chunk size, with
// and without helpers, and with several callers sharing the helpers at once.
#include "attnd/server/copy_pool.h"

#include <cstdint>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace attnd::server {
namespace {

std::string RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng());
  return s;
}

// Copies `sizes` random parts into one destination, packed, and checks every byte; the bytes around the
// destination stay untouched.
void CheckCopy(CopyPool& pool, const std::vector<size_t>& sizes, uint32_t seed) {
  std::vector<std::string> src;
  size_t total = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    src.push_back(RandomBytes(sizes[i], seed + static_cast<uint32_t>(i)));
    total += sizes[i];
  }
  std::string dst(total + 64, '\x5a');
  std::vector<CopyPool::Part> parts;
  size_t at = 32;
  for (const std::string& s : src) {
    parts.push_back({reinterpret_cast<uint8_t*>(dst.data()) + at, reinterpret_cast<const uint8_t*>(s.data()), s.size()});
    at += s.size();
  }
  pool.Copy(parts);
  at = 32;
  for (size_t i = 0; i < src.size(); ++i) {
    ASSERT_TRUE(dst.compare(at, src[i].size(), src[i]) == 0) << "part " << i << " of " << src[i].size() << " bytes";
    at += src[i].size();
  }
  EXPECT_EQ(dst.substr(0, 32), std::string(32, '\x5a'));
  EXPECT_EQ(dst.substr(at), std::string(32, '\x5a'));
}

TEST(CopyPool, CopiesEveryPartWithAndWithoutHelpers) {
  const size_t chunk = CopyPool::kChunkBytes;
  const std::vector<std::vector<size_t>> cases = {
      {},  // nothing to copy
      {1},
      {100, 0, 7},
      {chunk},
      {chunk + 1},
      {3 * chunk + 17, 5, 2 * chunk - 3},
      std::vector<size_t>(300, 16 * 1024 + 3),  // many slice-sized pieces, as a unary request arrives
  };
  for (int threads : {0, 1, 3}) {
    CopyPool pool(threads);
    EXPECT_EQ(pool.threads(), threads);
    for (size_t c = 0; c < cases.size(); ++c) {
      SCOPED_TRACE(testing::Message() << "threads " << threads << " case " << c);
      CheckCopy(pool, cases[c], static_cast<uint32_t>(c));
    }
  }
}

TEST(CopyPool, CallersShareTheHelpers) {
  CopyPool pool(2);
  std::vector<std::thread> callers;
  for (int t = 0; t < 6; ++t) {
    callers.emplace_back([&pool, t] {
      for (int round = 0; round < 5; ++round) {
        CheckCopy(pool, {3 * CopyPool::kChunkBytes + static_cast<size_t>(t), 4096, CopyPool::kChunkBytes / 2},
                  static_cast<uint32_t>(100 * t + round));
      }
    });
  }
  for (std::thread& c : callers) c.join();
}

TEST(CopyPool, DefaultHelperCountIsBounded) {
  const int n = DefaultCopyThreads();
  EXPECT_GE(n, 0);
  EXPECT_LE(n, 4);
}

}  // namespace
}  // namespace attnd::server
