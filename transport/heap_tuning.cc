#include "attnd/transport/heap_tuning.h"

#include <sys/types.h>

#include <cstdlib>  // any libc header defines __GLIBC__, which the #if below checks
#include <limits>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

// jemalloc's control interface: defined where the process's allocator is jemalloc (attnd links it), null elsewhere.
// Declared here rather than from <jemalloc/jemalloc.h> so that the libraries built on this one need no jemalloc.
extern "C" int mallctl(const char* name, void* oldp, size_t* oldlenp, void* newp, size_t newlen)
    __attribute__((weak));

namespace attnd {
namespace {

// "arena.<MALLCTL_ARENAS_ALL>.purge": every arena's unused pages (MALLCTL_ARENAS_ALL is 4096 in jemalloc 5).
constexpr char kPurgeEveryArena[] = "arena.4096.purge";
// How long a jemalloc arena keeps what it frees under RetainFreedHeapMemory: long enough that a steady client's
// buffers are reused rather than faulted in again, short enough that a busy server (which the idle purge never
// reaches) hands back a burst's or a hostile upload's memory within seconds.
constexpr ssize_t kRetainedDecayMs = 10000;

// Every arena's decay of what it frees: the default for arenas made later, then each arena made so far (the
// indices not in use answer EFAULT). `keep_large` also lifts each one's threshold for purging a freed large block
// at once: jemalloc 5.3 gives arena 0 its default of 8 MiB before it reads malloc_conf, so attnd's
// oversize_threshold:0 reaches only the arenas made later, and arena 0 would purge tensor-sized blocks on free.
bool SetArenaDecay(ssize_t ms, bool keep_large) {
  if (mallctl("arenas.dirty_decay_ms", nullptr, nullptr, &ms, sizeof ms) != 0) return false;
  unsigned arenas = 0;
  size_t len = sizeof arenas;
  if (mallctl("arenas.narenas", &arenas, &len, nullptr, 0) != 0) return false;
  size_t no_threshold = std::numeric_limits<size_t>::max();
  for (unsigned i = 0; i < arenas; ++i) {
    const std::string arena = absl::StrCat("arena.", i, ".");
    mallctl((arena + "dirty_decay_ms").c_str(), nullptr, nullptr, &ms, sizeof ms);
    if (keep_large) {
      mallctl((arena + "oversize_threshold").c_str(), nullptr, nullptr, &no_threshold, sizeof no_threshold);
    }
  }
  return true;
}

}  // namespace

bool HeapIsJemalloc() { return mallctl != nullptr; }

bool RetainFreedHeapMemory() {
  if (HeapIsJemalloc()) return SetArenaDecay(kRetainedDecayMs, true);
#if defined(__GLIBC__)
  // mallopt returns 1 on success. Setting the thresholds also turns off glibc's dynamic adjustment of them.
  bool ok = mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1;
  ok = mallopt(M_TRIM_THRESHOLD, 1 << 30) == 1 && ok;
  ok = mallopt(M_TOP_PAD, 64 << 20) == 1 && ok;
  return ok;
#else
  return false;
#endif
}

bool ReturnFreedHeapMemoryAtOnce() {
  if (HeapIsJemalloc()) return SetArenaDecay(0, false);
#if defined(__GLIBC__)
  return true;
#else
  return false;
#endif
}

bool ReleaseFreedHeapMemory() {
  if (HeapIsJemalloc()) return mallctl(kPurgeEveryArena, nullptr, nullptr, nullptr, 0) == 0;
#if defined(__GLIBC__)
  malloc_trim(0);
  return true;
#else
  return false;
#endif
}

IdleHeapTrimmer::IdleHeapTrimmer(std::function<uint64_t()> activity, absl::Duration period)
    : activity_(std::move(activity)), period_(period), thread_([this] { Run(); }) {}

IdleHeapTrimmer::~IdleHeapTrimmer() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

uint64_t IdleHeapTrimmer::releases() const {
  absl::MutexLock lock(&mu_);
  return releases_;
}

void IdleHeapTrimmer::Run() {
  uint64_t seen = activity_();
  bool released = false;  // in this quiet spell
  absl::MutexLock lock(&mu_);
  while (!mu_.AwaitWithTimeout(absl::Condition(&stop_), period_)) {
    const uint64_t now = activity_();
    if (now != seen) {
      seen = now;
      released = false;
    } else if (!released) {
      mu_.Unlock();
      ReleaseFreedHeapMemory();
      mu_.Lock();
      released = true;
      ++releases_;
    }
  }
}

}  // namespace attnd
