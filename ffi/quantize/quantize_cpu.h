// Host quantize of a float32 matrix per FP8 format, shared by the CPU handlers of the quantize
// targets (quantize_cpu.cc) and of the fused producers (fused/fused_cpu.cc): plain loops over the
// numerics header, the same math as the CUDA kernels.
#pragma once

#include <algorithm>
#include <vector>

#include "quantize/nvfp4_cpu.h"
#include "quantize/quantize_args.h"

namespace jqffi {

// Element i of a bfloat16 / float16 / float32 input, as float32 (exact).
inline float input_value(const Input& x, int64_t i) {
  switch (x.type) {
    case In::kBF16: return jq::float_of(uint32_t(static_cast<const uint16_t*>(x.data)[i]) << 16);
    case In::kF16: return jq::f16_bits_to_float(static_cast<const uint16_t*>(x.data)[i]);
    default: return static_cast<const float*>(x.data)[i];
  }
}

inline Matrix transposed(const Matrix& m) {
  Matrix t{std::vector<float>(m.v.size()), m.cols, m.rows};
  for (int64_t r = 0; r < m.rows; ++r) {
    for (int64_t c = 0; c < m.cols; ++c) t.v[c * m.rows + r] = m.v[r * m.cols + c];
  }
  return t;
}

inline void fp8_with_scale(const Matrix& m, float scale, jq::Fp8 fmt, uint8_t* out) {
  for (int64_t i = 0; i < m.rows * m.cols; ++i) out[i] = uint8_t(jq::encode_fp8(m.v[i] * scale, fmt));
}

inline void mxfp8_matrix(const Matrix& m, jq::Fp8 fmt, uint8_t* data, uint8_t* scale) {
  const int64_t nb = ceil_div(m.cols, 32);
  for (int64_t r = 0; r < m.rows; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const float amax = jq::float_of(amax_bits_of_range(m, r, r + 1, 32 * b, 32 * b + 32));
      const uint32_t e = jq::e8m0_from_amax(amax, jq::inv_fmax_of(fmt));
      scale[r * nb + b] = uint8_t(e);
      const jq::Mxfp8Factors f = jq::mxfp8_factors(e);
      for (int64_t c = 32 * b; c < std::min(32 * b + 32, m.cols); ++c) {
        data[r * m.cols + c] = e == 255 ? uint8_t(0x7F) : uint8_t(jq::encode_fp8(m.at(r, c) * f.a * f.b, fmt));
      }
    }
  }
}

inline void fp8_block_matrix(const Matrix& m, int64_t block_rows, const Fp8BlockArgs& a, uint8_t* data,
                             float* scale_inv) {
  const float fmax = jq::spec_of(a.fmt).fmax;
  const int64_t nbr = ceil_div(m.rows, block_rows), nbc = ceil_div(m.cols, 128);
  for (int64_t br = 0; br < nbr; ++br) {
    for (int64_t bc = 0; bc < nbc; ++bc) {
      const int64_t r0 = br * block_rows, c0 = bc * 128;
      const float amax = jq::float_of(amax_bits_of_range(m, r0, r0 + block_rows, c0, c0 + 128));
      const float scale = jq::scale_from_amax(amax, fmax, a.pow2_scale, a.amax_epsilon);
      scale_inv[br * nbc + bc] = jq::rcp_f32(scale);
      for (int64_t r = r0; r < std::min(r0 + block_rows, m.rows); ++r) {
        for (int64_t c = c0; c < std::min(c0 + 128, m.cols); ++c) {
          data[r * m.cols + c] = uint8_t(jq::encode_fp8(m.at(r, c) * scale, a.fmt));
        }
      }
    }
  }
}

// max |m| (by the float bits: NaN-propagating, as the spec).
inline float amax_of(const Matrix& m) { return jq::float_of(amax_bits_of_range(m, 0, m.rows, 0, m.cols)); }

// Quantizes m (x, or a producer's output) into the copies `a` asks for, the columnwise one from
// m^T, and writes what the call returns besides them (scale_inv, amax), as the tile kernels do.
inline void quantize_matrix(const Matrix& m, const Fp8TensorArgs& a) {
  const float scale = jq::fp8_tensor_scale(*a.s, a.delayed, jq::spec_of(a.fmt).fmax, a.pow2_scale,
                                           a.amax_epsilon, a.first_amax, a.margin);
  if (a.rowwise) fp8_with_scale(m, scale, a.fmt, a.row_data);
  if (a.columnwise) fp8_with_scale(transposed(m), scale, a.fmt, a.col_data);
  *a.scale_inv = jq::rcp_f32(scale);
  if (a.amax) *a.amax = amax_of(m);
}

inline void quantize_matrix(const Matrix& m, const Mxfp8Args& a) {
  if (a.rowwise) mxfp8_matrix(m, a.fmt, a.row_data, a.row_scale);
  if (a.columnwise) mxfp8_matrix(transposed(m), a.fmt, a.col_data, a.col_scale);
  *a.amax = amax_of(m);
}

inline void quantize_matrix(const Matrix& m, const Fp8BlockArgs& a) {
  const int64_t block_rows = a.block_2d ? 128 : 1;
  if (a.rowwise) fp8_block_matrix(m, block_rows, a, a.row_data, a.row_scale);
  if (a.columnwise) fp8_block_matrix(transposed(m), block_rows, a, a.col_data, a.col_scale);
  *a.amax = amax_of(m);
}

}  // namespace jqffi
