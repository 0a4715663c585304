// Instantiates the Hopper family for head_dim 256 (tile_size_sm90.h). sm_90a only.
#include "flash_fwd_launch_sm90.cuh"
#include "tile_size_sm90.h"

namespace attnd::kernels::hopper {

EntryList Sm90D256Entries() {
  static const KernelEntry kEntries[] = {
      Entry<TileShape<HopperD256M128N64S2>>("hopper_sm90_d256_m128n64s2"),
      Entry<TileShape<HopperD256Fp8M128N128S2>>("hopper_sm90_d256_fp8_m128n128s2"),
  };
  return ListOf(kEntries);
}

}  // namespace attnd::kernels::hopper
