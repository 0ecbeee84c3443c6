// Per-tensor FP8 quantize kernel (current and delayed scaling).
#pragma once

#include "quantize/tile.cuh"

namespace jqffi {
namespace {
// ============================================================================================
// FP8 per tensor (current and delayed scaling). Tile 128x128.
// ============================================================================================

struct Fp8TensorParams {
  int64_t R, C;  // the quantized matrix (the producer's values)
  bool vec_row, vec_col;
  bool do_row, do_col, delayed, pow2_scale;
  float amax_epsilon;
  jq::Fp8 fmt;
  const float* s;
  uint8_t *row, *col;
  float *scale_inv, *amax;
  float* col_sums = nullptr;  // [ceil(R/128), C] per-tile column sums (fused dact's bias gradient)
  // Delayed scaling's just-in-time first scale: where the stored scale `*s` is 0 ("none yet"),
  // the scale of this amax (`delayed_scale(*first_amax, fmax, margin, 1)`); null: `*s` as is.
  const float* first_amax = nullptr;
  int32_t margin = 0;
};

template <typename In>
using FP8Tile = Geometry<In, 128, 128>;

template <typename P>
__global__ void __launch_bounds__(kThreads) fp8_tensor_kernel(const Fp8TensorParams p, const P prod) {
  using In = typename P::Out;
  using G = FP8Tile<In>;
  extern __shared__ __align__(16) unsigned char smem[];
  In* tile = reinterpret_cast<In*>(smem);
  __shared__ uint32_t red[kThreads / 32];
  const bool column_phase = p.do_col || p.col_sums != nullptr;
  const int tid = threadIdx.x;
  const TileIndex t = tile_index(p.C, G::TR, G::TC);
  const float fmax = jq::spec_of(p.fmt).fmax;
  float scale = p.delayed ? *p.s : jq::scale_from_amax(*p.s, fmax, p.pow2_scale, p.amax_epsilon);
  if (p.first_amax != nullptr && jq::is_zero(scale)) scale = jq::delayed_scale(*p.first_amax, fmax, p.margin, 1.0f);
  const int lr = tid / G::TPR, lc = (tid % G::TPR) * 8;
  alignas(16) In raw[G::NP][8];
#pragma unroll
  for (int pp = 0; pp < G::NP; ++pp) prod.load8(t.r0 + pp * G::RPP + lr, t.c0 + lc, raw[pp]);
  uint32_t amax = 0;
#pragma unroll
  for (int pp = 0; pp < G::NP; ++pp) {
    if (column_phase) tile_store8<G>(tile, pp * G::RPP + lr, lc, raw[pp]);
    float v[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      v[i] = to_float(raw[pp][i]);
      amax = max(amax, jq::abs_bits(v[i]));
    }
    const int64_t r = t.r0 + pp * G::RPP + lr, c = t.c0 + lc;
    if (p.do_row && r < p.R && c < p.C) {
      const uint32_t w0 = jq::encode_fp8x4(v[0] * scale, v[1] * scale, v[2] * scale, v[3] * scale, p.fmt);
      const uint32_t w1 = jq::encode_fp8x4(v[4] * scale, v[5] * scale, v[6] * scale, v[7] * scale, p.fmt);
      store_bytes8(p.row + r * p.C + c, w0, w1, int(min64(8, p.C - c)), p.vec_row);
    }
  }
  if (p.amax) {
    amax = cta_max(amax, red);
    if (tid == 0) atomic_max_float(p.amax, amax);
  }
  if (blockIdx.x == 0 && tid == 0) *p.scale_inv = jq::rcp_f32(scale);
  if (!column_phase) return;
  __syncthreads();
#pragma unroll
  for (int it = 0; it < G::ITERS; ++it) {
    const ColumnSlot<G> slot(it);
    const int64_t c = t.c0 + slot.cl, rr = t.r0 + 16 * slot.j;
    float w[16];
    tile_column16<G>(tile, 16 * slot.j, slot.cl, w);
    if (p.col_sums) column_tile_sum<G>(w, slot.j, c, t.r0 / G::TR, p.C, p.col_sums);
    if (!p.do_col || c >= p.C || rr >= p.R) continue;
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
