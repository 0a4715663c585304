#include "attnd/transport/heap_tuning.h"

#include <cstdlib>  // any libc header defines __GLIBC__, which the #if below checks

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace attnd {

bool RetainFreedHeapMemory() {
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

}  // namespace attnd
