// FP8 transpose kernel (`jaxquant_transpose_fp8`).
#pragma once

#include "quantize/tile.cuh"

namespace jqffi {
namespace {
// ============================================================================================
// FP8 transpose: 128x128 byte tiles through shared memory, 16-byte loads and stores.
// ============================================================================================

struct TransposeParams {
  const uint8_t* in;
  uint8_t* out;
  int64_t R, C;
  bool vec_in, vec_out;
};

__global__ void __launch_bounds__(kThreads) transpose_kernel(const TransposeParams p) {
  using G = Geometry<uint8_t, 128, 128>;  // 16-byte chunks swizzled by 16-row chunk index
  static_assert(G::NJ == 8 && G::ITERS == 4, "byte tile");
  __shared__ __align__(16) uint8_t tile[G::TR * G::TC];
  const TileIndex t = tile_index(p.C, G::TR, G::TC);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int v = threadIdx.x + k * kThreads, lr = v / 8, lc = (v % 8) * 16;
    const int64_t r = t.r0 + lr, c = t.c0 + lc;
    uint4 chunk;
    if (p.vec_in && r < p.R && c + 16 <= p.C) {
      chunk = __ldg(reinterpret_cast<const uint4*>(p.in + r * p.C + c));
    } else {
      uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        if (r < p.R && c + i < p.C) w[i / 4] |= uint32_t(p.in[r * p.C + c + i]) << (8 * (i % 4));
      }
      chunk = make_uint4(w[0], w[1], w[2], w[3]);
    }
    *reinterpret_cast<uint4*>(tile + G::offset(lr, lc)) = chunk;
  }
  __syncthreads();
#pragma unroll
  for (int it = 0; it < G::ITERS; ++it) {
    const ColumnSlot<G> slot(it);
    const int64_t c = t.c0 + slot.cl, r = t.r0 + 16 * slot.j;
    if (c >= p.C || r >= p.R) continue;
    uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
    for (int i = 0; i < 16; ++i) w[i / 4] |= uint32_t(tile[G::offset(16 * slot.j + i, slot.cl)]) << (8 * (i % 4));
    store_bytes16(p.out + c * p.R + r, w, int(min64(16, p.R - r)), p.vec_out);
  }
}

}  // namespace
}  // namespace jqffi
