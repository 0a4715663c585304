// Instantiates the mma.sync kernel for the sm90-budget head_dim 128 tile shapes (tile_size.h).
// Compiled for sm_90a only.
#include "fwd_launch.cuh"
#include "tile_size.h"

namespace attnd::kernels::mma_sync {

EntryList Sm90D128Entries() {
  static const KernelEntry kEntries[] = {
      Entry<MmaSyncSm90D128M64S2>("mma_sync_sm90_d128_m64n64s2"),
      Entry<MmaSyncSm90D128M128S2R2>("mma_sync_sm90_d128_m128n64s2w4"),
  };
  return ListOf(kEntries);
}

}  // namespace attnd::kernels::mma_sync
