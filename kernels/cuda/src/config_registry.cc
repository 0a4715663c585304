#include "config_registry.h"

namespace attnd::kernels {

const std::vector<KernelEntry>& AllEntries() {
  static const std::vector<KernelEntry> kAll = [] {
    std::vector<KernelEntry> all;
    // Hopper-budget first: Configs() order is the order ConfigNames() reports.
    for (EntryList list : {mma_sync::Sm90D64Entries(), mma_sync::Sm90D128Entries(),
                           mma_sync::Sm120D64Entries(), mma_sync::Sm120D128Entries(), mma_sync::Sm120D256Entries(),
                           hopper::Sm90D64Entries(), hopper::Sm90D128Entries(), hopper::Sm90D256Entries()}) {
      all.insert(all.end(), list.entries, list.entries + list.count);
    }
    return all;
  }();
  return kAll;
}

}  // namespace attnd::kernels
