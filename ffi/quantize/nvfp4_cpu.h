// Host NVFP4 quantize of a float32 matrix, shared by the CPU handlers of the single-tensor
// (quantize_cpu.cc) and grouped (grouped/grouped_cpu.cc) targets: plain loops over the numerics
// header, the same math as the CUDA kernels.
#pragma once

#include <algorithm>
#include <vector>

#include "buffer_checks.h"
#include "jaxquant_numerics.h"

namespace jqffi {

// A float32 matrix: one direction of x (itself, or x^T, RHT'd along its rows for NVFP4 rht).
struct Matrix {
  std::vector<float> v;
  int64_t rows, cols;
  float at(int64_t r, int64_t c) const { return v[r * cols + c]; }
};

inline uint32_t amax_bits_of_range(const Matrix& m, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  uint32_t a = 0;
  for (int64_t r = r0; r < std::min(r1, m.rows); ++r) {
    for (int64_t c = c0; c < std::min(c1, m.cols); ++c) a = std::max(a, jq::abs_bits(m.at(r, c)));
  }
  return a;
}

// XLA's packed FP4 layout: element i of the row-major matrix in nibble i (low nibble first).
inline void put_nibble(uint8_t* out, int64_t i, uint32_t code) {
  uint8_t& byte = out[i >> 1];
  byte = (i & 1) ? uint8_t((byte & 0x0F) | (code << 4)) : uint8_t(code & 0x0F);
}

// NVFP4 of `m` (rows quantized along cols): block scales of `block_rows` x 16, the second-level
// scale from amax[0] (amax[r] per row when row_scaled), stochastic rounding with `key`'s two
// words at (row, col) when key is not null.
inline void nvfp4_matrix(const Matrix& m, int64_t block_rows, bool row_scaled, const float* amax,
                         const uint32_t* key, uint8_t* data, uint8_t* scale) {
  const int64_t nbr = ceil_div(m.rows, block_rows), nbc = ceil_div(m.cols, 16);
  std::vector<float> s_enc(row_scaled ? m.rows : 1);
  for (size_t i = 0; i < s_enc.size(); ++i) s_enc[i] = jq::nvfp4_global_encode_scale(amax[i]);
  // Block scales first (a 16x16 tile spans 16 rows).
  for (int64_t br = 0; br < nbr; ++br) {
    for (int64_t bc = 0; bc < nbc; ++bc) {
      const int64_t r0 = br * block_rows, c0 = bc * 16;
      const float block_amax = jq::float_of(amax_bits_of_range(m, r0, r0 + block_rows, c0, c0 + 16));
      scale[br * nbc + bc] = uint8_t(jq::nvfp4_block_decode_code(block_amax, s_enc[row_scaled ? r0 : 0]));
    }
  }
  // Payload in linear (nibble) order, so a row of odd length shares its last byte correctly.
  std::vector<float> s_enc_b(nbc);
  for (int64_t r = 0; r < m.rows; ++r) {
    const float row_s_enc = s_enc[row_scaled ? r : 0];
    const uint32_t row_hash = key ? jq::sr_row_hash(key[0], uint32_t(r)) : 0;
    if (r % block_rows == 0) {
      for (int64_t bc = 0; bc < nbc; ++bc) {
        s_enc_b[bc] = jq::nvfp4_block_encode_scale(jq::decode_e4m3(scale[(r / block_rows) * nbc + bc]),
                                                   row_s_enc);
      }
    }
    for (int64_t c = 0; c < m.cols; ++c) {
      const float v = m.at(r, c) * s_enc_b[c / 16];
      const uint32_t code = key ? jq::encode_e2m1_stochastic(v, jq::sr_uniform(row_hash, key[1], uint32_t(c)))
                                : jq::encode_e2m1(v);
      put_nibble(data, r * m.cols + c, code);
    }
  }
}

}  // namespace jqffi
