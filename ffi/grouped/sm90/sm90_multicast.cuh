// The TMA multicast masks of a CTA in a cluster, for mainloops that issue CUTLASS's loads
// themselves (sm90_kgrouped.cuh, sm90_ragged.cuh): A's tile goes to the CTAs of the cluster's
// row (same M), B's to those of its column (same N), as CUTLASS's own TMA mainloop does.
#pragma once

#include <cstdint>

#include "cute/tensor.hpp"

namespace jqffi {
namespace sm90 {

struct MulticastMasks {
  uint16_t a = 0, b = 0;
};

// `in_cluster`: the CTA's (x: M, y: N) position in a cluster of shape ClusterShape. A mask is
// left 0 where its copy is not a multicast one.
template <class ClusterShape, class GmemTiledCopyA, class GmemTiledCopyB>
CUTLASS_DEVICE MulticastMasks multicast_masks(uint2 in_cluster) {
  using namespace cute;
  MulticastMasks masks;
  auto block_layout = Layout<ClusterShape>{};  // (m, n) -> block id
  if constexpr (cute::is_same_v<GmemTiledCopyA, SM90_TMA_LOAD_MULTICAST>) {
    for (int n = 0; n < size<1>(block_layout); ++n) {
      masks.a |= uint16_t(1) << block_layout(in_cluster.x, n, Int<0>{});
    }
  }
  if constexpr (cute::is_same_v<GmemTiledCopyB, SM90_TMA_LOAD_MULTICAST>) {
    for (int m = 0; m < size<0>(block_layout); ++m) {
      masks.b |= uint16_t(1) << block_layout(m, in_cluster.y, Int<0>{});
    }
  }
  return masks;
}

}  // namespace sm90
}  // namespace jqffi
