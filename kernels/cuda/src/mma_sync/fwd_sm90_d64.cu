// Instantiates the mma.sync kernel for the sm90-budget head_dim 64 tile shapes (tile_size.h).
// Compiled for sm_90a only.
#include "fwd_launch.cuh"
#include "tile_size.h"

namespace attnd::kernels::mma_sync {

EntryList Sm90D64Entries() {
  static const KernelEntry kEntries[] = {Entry<MmaSyncSm90D64M128S2R2>("mma_sync_sm90_d64_m128n64s2w4")};
  return ListOf(kEntries);
}

}  // namespace attnd::kernels::mma_sync
