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

// The kernel's parameters for the decoded call `a` quantizing an R x C matrix (col_sums: the
// fused activation gradient's column sums, or null).
inline Fp8TensorParams fp8_tensor_params(const Fp8TensorArgs& a, int64_t R, int64_t C,
                                         float* col_sums = nullptr) {
  return {R, C, aligned(a.row_data, 8) && C % 8 == 0, aligned(a.col_data, 16) && R % 16 == 0,
          a.rowwise, a.columnwise, a.delayed, a.pow2_scale, a.amax_epsilon, a.fmt, a.s,
          a.row_data, a.col_data, a.scale_inv, a.amax, col_sums, a.first_amax, a.margin};
}

template <typename P>
__global__ void __launch_bounds__(kThreads, ProducerMinCtas<P>::value) fp8_tensor_kernel(const Fp8TensorParams p, const P prod) {
  using G = FP8Tile<typename P::Out>;
  __shared__ uint32_t red[kThreads / 32];
  const float fmax = jq::spec_of(p.fmt).fmax;
  const float scale =
      jq::fp8_tensor_scale(*p.s, p.delayed, fmax, p.pow2_scale, p.amax_epsilon, p.first_amax, p.margin);
  Fp8TileLoad<P> ld(prod, p);
#pragma unroll
  for (int pp = 0; pp < G::NP; ++pp) {
    float v[8];
    ld.pass(pp, v);
    const int64_t r = ld.row(pp), c = ld.col();
    if (p.do_row && r < p.R && c < p.C) {
      store_bytes8(p.row + r * p.C + c, fp8_codes4(v, scale, p.fmt), fp8_codes4(v + 4, scale, p.fmt),
                   int(min64(8, p.C - c)), p.vec_row);
    }
  }
  if (p.amax) {
    const uint32_t amax = cta_max(ld.amax, red);
    if (threadIdx.x == 0) atomic_max_float(p.amax, amax);
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) *p.scale_inv = jq::rcp_f32(scale);
  if (!ld.column_phase) return;
  __syncthreads();
#pragma unroll
  for (int it = 0; it < G::ITERS; ++it) {
    const Fp8TileColumn<G> chunk(ld.tile, ld.t, it, p.C, p.col_sums);
    if (!p.do_col || chunk.c >= p.C || chunk.rr >= p.R) continue;
    chunk.store(p.col, p.R, p.vec_col, [&](const float* v) { return fp8_codes4(v, scale, p.fmt); });
  }
}

}  // namespace
}  // namespace jqffi
