// Float8Block quantize kernel.
#pragma once

#include "quantize/tile.cuh"

namespace jqffi {
namespace {
// ============================================================================================
// Float8Block: FP32 scale per 1x128 block or 128x128 tile; fused tensor amax. Tile 128x128.
// ============================================================================================

struct Fp8BlockParams {
  int64_t R, C;  // the quantized matrix (the producer's values)
  bool vec_row, vec_col, do_row, do_col, block_2d, pow2_scale;
  float amax_epsilon;
  jq::Fp8 fmt;
  uint8_t *row, *col;
  float *row_scale, *col_scale, *amax;
  float* col_sums = nullptr;  // [ceil(R/128), C] per-tile column sums (fused dact's bias gradient)
};

template <typename P>
__global__ void __launch_bounds__(kThreads) fp8_block_kernel(const Fp8BlockParams p, const P prod) {
  using In = typename P::Out;
  using G = FP8Tile<In>;
  static_assert(G::TPR == 16 && G::NJ == 8, "a tile row is one 1x128 block; 8 lanes a column");
  extern __shared__ __align__(16) unsigned char smem[];
  In* tile = reinterpret_cast<In*>(smem);
  __shared__ uint32_t red[kThreads / 32];
  const bool column_phase = p.do_col || p.col_sums != nullptr;
  const int tid = threadIdx.x;
  const TileIndex t = tile_index(p.C, G::TR, G::TC);
  const float fmax = jq::spec_of(p.fmt).fmax;
  const int64_t row_nb = (p.C + 127) / 128, col_nb = (p.R + 127) / 128;
  const int lr = tid / G::TPR, lc = (tid % G::TPR) * 8;
  alignas(16) In raw[G::NP][8];
#pragma unroll
  for (int pp = 0; pp < G::NP; ++pp) prod.load8(t.r0 + pp * G::RPP + lr, t.c0 + lc, raw[pp]);
  uint32_t row_m[G::NP];
  uint32_t amax = 0;
#pragma unroll
  for (int pp = 0; pp < G::NP; ++pp) {
    if (column_phase) tile_store8<G>(tile, pp * G::RPP + lr, lc, raw[pp]);
    uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) m = max(m, jq::abs_bits(to_float(raw[pp][i])));
    amax = max(amax, m);
#pragma unroll
    for (int o = 1; o < 16; o <<= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
    row_m[pp] = m;
  }
  const uint32_t tile_amax = cta_max(amax, red);  // also the 128x128 block amax; orders the tile
  if (p.amax && tid == 0) atomic_max_float(p.amax, tile_amax);
  const float tile_scale = jq::scale_from_amax(__uint_as_float(tile_amax), fmax, p.pow2_scale, p.amax_epsilon);
  if (p.do_row) {
#pragma unroll
    for (int pp = 0; pp < G::NP; ++pp) {
      const int64_t r = t.r0 + pp * G::RPP + lr, c = t.c0 + lc;
      if (r >= p.R || c >= p.C) continue;
      const float scale = p.block_2d ? tile_scale
                                     : jq::scale_from_amax(__uint_as_float(row_m[pp]), fmax, p.pow2_scale, p.amax_epsilon);
      float v[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = to_float(raw[pp][i]) * scale;
      const uint32_t w0 = jq::encode_fp8x4(v[0], v[1], v[2], v[3], p.fmt);
      const uint32_t w1 = jq::encode_fp8x4(v[4], v[5], v[6], v[7], p.fmt);
      store_bytes8(p.row + r * p.C + c, w0, w1, int(min64(8, p.C - c)), p.vec_row);
      if (p.block_2d) {
        if (tid == 0) p.row_scale[(t.r0 / 128) * row_nb + t.c0 / 128] = jq::rcp_f32(scale);
      } else if (lc == 0) {
        p.row_scale[r * row_nb + t.c0 / 128] = jq::rcp_f32(scale);
      }
    }
  }
  if (!column_phase) return;
#pragma unroll
  for (int it = 0; it < G::ITERS; ++it) {
    const ColumnSlot<G> slot(it);
    const int64_t c = t.c0 + slot.cl, rr = t.r0 + 16 * slot.j;
    float w[16];
    tile_column16<G>(tile, 16 * slot.j, slot.cl, w);
    if (p.col_sums) column_tile_sum<G>(w, slot.j, c, t.r0 / G::TR, p.C, p.col_sums);
    uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < 16; ++i) m = max(m, jq::abs_bits(w[i]));
#pragma unroll
    for (int o = 1; o < G::NJ; o <<= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));  // 128 rows
    const float scale = p.block_2d ? tile_scale
                                   : jq::scale_from_amax(__uint_as_float(m), fmax, p.pow2_scale, p.amax_epsilon);
    if (!p.do_col || c >= p.C || rr >= p.R) continue;
    if (p.block_2d) {
      if (tid == 0) p.col_scale[(t.c0 / 128) * col_nb + t.r0 / 128] = jq::rcp_f32(scale);
    } else if (slot.j == 0) {
      p.col_scale[c * col_nb + t.r0 / 128] = jq::rcp_f32(scale);
    }
    uint32_t q[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      q[k] = jq::encode_fp8x4(w[4 * k] * scale, w[4 * k + 1] * scale, w[4 * k + 2] * scale, w[4 * k + 3] * scale,
                              p.fmt);
    }
    store_bytes16(p.col + c * p.R + rr, q, int(min64(16, p.R - rr)), p.vec_col);
  }
}

}  // namespace
}  // namespace jqffi
