// Instantiates the seed kernel for the sm90-budget head_dim 64 tile shapes (tile_size.h).
// Compiled for sm_90a only.
#include "fwd_launch.cuh"
#include "tile_size.h"

namespace attnd::kernels::seed {

EntryList Sm90D64Entries() {
  static const KernelEntry kEntries[] = {Entry<SeedSm90D64M128S2R2>("seed_sm90_d64_m128n64s2w4")};
  return ListOf(kEntries);
}

}  // namespace attnd::kernels::seed
