// Per-tensor FP8 quantize (current and delayed scaling) of a whole-tile float32 matrix, both
// copies: the kernel a per-tensor FP8 training step runs on its float32 weights
// (fp8_tensor_kernel serves the other cases). Same numerics as fp8_tensor_kernel, bit for bit.
#pragma once

#include "quantize/fp8_tensor.cuh"
#include "quantize/one_scale_tile.cuh"

namespace jqffi {
namespace {

// Whether fp8_tensor_f32_kernel serves the call: both copies, float32 read directly, whole
// 128 x 128 tiles (R and C multiples of 128), 16-byte aligned rows and copies, 32-bit element
// offsets, no column sums.
inline bool fp8_tensor_f32_fast(const Fp8TensorParams& p, const Direct<float>& x) {
  return p.do_row && p.do_col && p.col_sums == nullptr && x.vec && p.vec_row && p.vec_col &&
         p.R % 128 == 0 && p.C % 128 == 0 && p.R * p.C < (int64_t(1) << 31) && aligned(p.col, 16);
}

// One scale a tile (`one_scale_tile`) with the tensor's scale: each value is encoded once and
// the columnwise codes are the rowwise ones transposed in shared memory. The tile amax is
// reduced for the tensor amax (delayed scaling's history) and the NaN test.
__global__ void __launch_bounds__(kThreads, 3) fp8_tensor_f32_kernel(const Fp8TensorParams p,
                                                                    const Direct<float> prod) {
  const float fmax = jq::spec_of(p.fmt).fmax;
  const float scale = jq::fp8_tensor_scale(*p.s, p.delayed, fmax, p.pow2_scale, p.amax_epsilon,
                                           p.first_amax, p.margin);
  if (blockIdx.x == 0 && threadIdx.x == 0) *p.scale_inv = jq::rcp_f32(scale);
  one_scale_tile(prod.x, uint32_t(p.R), uint32_t(p.C), p.fmt, p.row, p.col, p.amax,
                 [&](uint32_t, const TileIndex&) { return scale; });
}

}  // namespace
}  // namespace jqffi
