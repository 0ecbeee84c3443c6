// Float8Block's 128x128 quantize of a whole-tile matrix (float32 or bfloat16), both copies: the
// kernel a Float8Block training step runs on every weight (fp8_block_kernel serves the other
// cases). Same numerics as fp8_block_kernel, bit for bit.
#pragma once

#include "quantize/fp8_block.cuh"
#include "quantize/one_scale_tile.cuh"

namespace jqffi {
namespace {

// Whether fp8_block_128x128_kernel serves the call: 128x128 blocks, both copies, x read
// directly, whole tiles (R and C multiples of 128), 16-byte aligned rows and copies, 32-bit
// element offsets, no column sums or expert layout.
template <typename In>
inline bool fp8_block_128x128_fast(const Fp8BlockParams& p, const Direct<In>& x) {
  return p.block_2d && p.do_row && p.do_col && p.col_sums == nullptr && p.expert_rows == 0 &&
         x.vec && p.vec_row && p.vec_col && p.R % 128 == 0 && p.C % 128 == 0 &&
         p.R * p.C < (int64_t(1) << 31) && aligned(p.col, 16);
}

// One scale a tile (`one_scale_tile`): the tile's amax gives the block's scale, whose inverse
// thread 0 stores to both copies' block scales.
template <typename In>
__global__ void __launch_bounds__(kThreads, 3) fp8_block_128x128_kernel(const Fp8BlockParams p,
                                                                       const Direct<In> prod) {
  const float fmax = jq::spec_of(p.fmt).fmax;
  one_scale_tile(prod.x, uint32_t(p.R), uint32_t(p.C), p.fmt, p.row, p.col, p.amax,
                 [&](uint32_t tile_amax, const TileIndex& t) {
                   const float scale = jq::scale_from_amax(__uint_as_float(tile_amax), fmax,
                                                           p.pow2_scale, p.amax_epsilon);
                   if (threadIdx.x == 0) {
                     const float scale_inv = jq::rcp_f32(scale);
                     p.row_scale[(t.r0 / 128) * ((p.C + 127) / 128) + t.c0 / 128] = scale_inv;
                     p.col_scale[(t.c0 / 128) * ((p.R + 127) / 128) + t.r0 / 128] = scale_inv;
                   }
                   return scale;
                 });
}

}  // namespace
}  // namespace jqffi
