// MXFP8 quantize kernel.
#pragma once

#include "quantize/tile.cuh"

namespace jqffi {
namespace {
// ============================================================================================
// MXFP8: 1x32 blocks along each output's rows, E8M0 scales; fused tensor amax. Tile 128x128.
// ============================================================================================

struct Mxfp8Params {
  int64_t R, C;  // the quantized matrix (the producer's values)
  bool vec_row, vec_col, do_row, do_col;
  jq::Fp8 fmt;
  uint8_t *row, *row_scale, *col, *col_scale;
  float* amax;
  float* col_sums = nullptr;  // [ceil(R/128), C] per-tile column sums (fused dact's bias gradient)
};

__device__ __forceinline__ uint32_t mxfp8_codes4(const float* v, jq::Mxfp8Factors f, uint32_t e, jq::Fp8 fmt) {
  if (e == 255) return 0x7F7F7F7Fu;
  return jq::encode_fp8x4(v[0] * f.a * f.b, v[1] * f.a * f.b, v[2] * f.a * f.b, v[3] * f.a * f.b, fmt);
}

template <typename P>
__global__ void __launch_bounds__(kThreads) mxfp8_kernel(const Mxfp8Params p, const P prod) {
  using In = typename P::Out;
  using G = FP8Tile<In>;
  extern __shared__ __align__(16) unsigned char smem[];
  In* tile = reinterpret_cast<In*>(smem);
  __shared__ uint32_t red[kThreads / 32];
  const bool column_phase = p.do_col || p.col_sums != nullptr;
  const int tid = threadIdx.x;
  const TileIndex t = tile_index(p.C, G::TR, G::TC);
  const float inv_fmax = jq::inv_fmax_of(p.fmt);
  const int64_t row_nb = (p.C + 31) / 32, col_nb = (p.R + 31) / 32;
  const int lr = tid / G::TPR, lc = (tid % G::TPR) * 8;
  alignas(16) In raw[G::NP][8];
#pragma unroll
  for (int pp = 0; pp < G::NP; ++pp) prod.load8(t.r0 + pp * G::RPP + lr, t.c0 + lc, raw[pp]);
  uint32_t amax = 0;
#pragma unroll
  for (int pp = 0; pp < G::NP; ++pp) {
    if (column_phase) tile_store8<G>(tile, pp * G::RPP + lr, lc, raw[pp]);
    float v[8];
    uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      v[i] = to_float(raw[pp][i]);
      m = max(m, jq::abs_bits(v[i]));
    }
    amax = max(amax, m);
    if (!p.do_row) continue;
    m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, 1));  // 4 threads = one 32-wide block
    m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, 2));
    const int64_t r = t.r0 + pp * G::RPP + lr, c = t.c0 + lc;
    if (r < p.R && c < p.C) {
      const uint32_t e = jq::e8m0_from_amax(__uint_as_float(m), inv_fmax);
      const jq::Mxfp8Factors f = jq::mxfp8_factors(e);
      store_bytes8(p.row + r * p.C + c, mxfp8_codes4(v, f, e, p.fmt), mxfp8_codes4(v + 4, f, e, p.fmt),
                   int(min64(8, p.C - c)), p.vec_row);
      if ((tid & 3) == 0) p.row_scale[r * row_nb + c / 32] = uint8_t(e);
    }
  }
  if (p.amax) {
    amax = cta_max(amax, red);
    if (tid == 0) atomic_max_float(p.amax, amax);
  }
  if (!column_phase) return;
  __syncthreads();
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
    m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, 1));  // chunks j, j^1 = one 32-row block
    if (!p.do_col || c >= p.C || rr >= p.R) continue;
    const uint32_t e = jq::e8m0_from_amax(__uint_as_float(m), inv_fmax);
    const jq::Mxfp8Factors f = jq::mxfp8_factors(e);
    if ((slot.j & 1) == 0) p.col_scale[c * col_nb + rr / 32] = uint8_t(e);
    uint32_t q[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) q[k] = mxfp8_codes4(w + 4 * k, f, e, p.fmt);
    store_bytes16(p.col + c * p.R + rr, q, int(min64(16, p.R - rr)), p.vec_col);
  }
}

}  // namespace
}  // namespace jqffi
