// Instantiates the mma.sync kernel for the sm120-budget head_dim 64 tile shapes (tile_size.h).
// Compiled for sm_90a and sm_120a.
#include "fwd_launch.cuh"
#include "tile_size.h"

namespace attnd::kernels::mma_sync {

EntryList Sm120D64Entries() {
  static const KernelEntry kEntries[] = {Entry<MmaSyncSm120D64>("mma_sync_sm120_d64_m64n64s2")};
  return ListOf(kEntries);
}

}  // namespace attnd::kernels::mma_sync
