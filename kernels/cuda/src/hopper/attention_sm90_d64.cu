// Instantiates the Hopper family for head_dim 64 (tile_size_sm90.h). sm_90a only.
#include "flash_fwd_launch_sm90.cuh"
#include "tile_size_sm90.h"

namespace attnd::kernels::hopper {

EntryList Sm90D64Entries() {
  static const KernelEntry kEntries[] = {
      Entry<TileShape<HopperD64M128N128S6P2>>("hopper_sm90_d64_m128n128s6_p2"),
      Entry<TileShape<HopperD64M192N128S4Wrs>>("hopper_sm90_d64_m192n128s4_wrs"),
  };
  return ListOf(kEntries);
}

}  // namespace attnd::kernels::hopper
