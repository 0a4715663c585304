// Instantiates the Hopper family for head_dim 128 (tile_size_sm90.h). sm_90a only.
#include "flash_fwd_launch_sm90.cuh"
#include "tile_size_sm90.h"

namespace attnd::kernels::hopper {

EntryList Sm90D128Entries() {
  static const KernelEntry kEntries[] = {
      Entry<TileShape<HopperD128M128N128S3OskP2>>("hopper_sm90_d128_m128n128s3_osk_p2"),
      Entry<TileShape<HopperD128Fp8M128N128S6OskP2>>("hopper_sm90_d128_fp8_m128n128s6_osk_p2"),
  };
  return ListOf(kEntries);
}

}  // namespace attnd::kernels::hopper
