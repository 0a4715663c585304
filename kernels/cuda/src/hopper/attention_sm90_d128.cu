// Instantiates the Hopper family for head_dim 128 (tile_size_sm90.h). sm_90a only.
#include "flash_fwd_launch_sm90.cuh"
#include "tile_size_sm90.h"

namespace attnd::kernels::hopper {

EntryList Sm90D128Entries() {
  static const KernelEntry kEntries[] = {
      Entry<HopperD128N128S2>("hopper_sm90_d128_m128n128s2"),
      Entry<HopperD128N128S3>("hopper_sm90_d128_m128n128s3"),
      Entry<HopperD128N128S3Osk>("hopper_sm90_d128_m128n128s3_osk"),
      Entry<HopperD128N128S3OskP2>("hopper_sm90_d128_m128n128s3_osk_p2"),
      Entry<HopperD128N160S2>("hopper_sm90_d128_m128n160s2"),
      Entry<HopperD128N176S2>("hopper_sm90_d128_m128n176s2"),
      Entry<HopperD128N176S2Os>("hopper_sm90_d128_m128n176s2_os"),
      Entry<HopperD128N128S2Plain>("hopper_sm90_d128_m128n128s2_plain"),
      Entry<HopperD128N128S2X>("hopper_sm90_d128_m128n128s2_x"),
  };
  return {kEntries, static_cast<int>(sizeof(kEntries) / sizeof(kEntries[0]))};
}

}  // namespace attnd::kernels::hopper
