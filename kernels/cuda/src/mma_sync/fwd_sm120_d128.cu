// Instantiates the mma.sync kernel for the sm120-budget head_dim 128 tile shapes (tile_size.h).
// Compiled for sm_90a and sm_120a.
#include "fwd_launch.cuh"
#include "tile_size.h"

namespace attnd::kernels::mma_sync {

EntryList Sm120D128Entries() {
  static const KernelEntry kEntries[] = {Entry<MmaSyncSm120D128>("mma_sync_sm120_d128_m64n64s1")};
  return ListOf(kEntries);
}

}  // namespace attnd::kernels::mma_sync
