#include "attnd/transport/heap_tuning.h"

#include <utility>
#include <cstdlib>  // any libc header defines __GLIBC__, which the #if below checks

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace attnd {

bool RetainFreedHeapMemory(int arenas) {
#if defined(__GLIBC__)
  // mallopt returns 1 on success. Setting the thresholds also turns off glibc's dynamic adjustment of them.
  bool ok = mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1;
  ok = mallopt(M_TRIM_THRESHOLD, 1 << 30) == 1 && ok;
  ok = mallopt(M_TOP_PAD, 64 << 20) == 1 && ok;
  if (arenas > 0) ok = mallopt(M_ARENA_MAX, arenas) == 1 && ok;
  return ok;
#else
  return false;
#endif
}

bool ReleaseFreedHeapMemory() {
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
