// The amax kernel (`jaxquant_amax`).
#pragma once

#include "quantize/tile.cuh"

namespace jqffi {
namespace {
// ============================================================================================
// amax: per tensor, per row, per column, optionally of rht16(x^T) (16-row chunks of columns).
// A CTA owns a strip of 32*W columns and a range of rows; each warp takes 16-row chunks.
// ============================================================================================

struct AmaxParams {
  const void* x;
  int64_t R, C, rows_per_cta;
  bool vec;
  float *tensor, *tensor_rht, *rows, *cols, *cols_rht;
  const float* gate;  // jaxquant_amax_gated: skip (outputs stay zero) unless *gate == 0
};

template <typename In>
__global__ void __launch_bounds__(kThreads) amax_kernel(const AmaxParams p) {
  if (p.gate != nullptr && __ldg(p.gate) != 0.f) return;  // uniform across the grid
  constexpr int W = 16 / sizeof(In);  // columns per thread (one 16-byte load per row)
  constexpr int STRIP = 32 * W;
  __shared__ uint32_t s_col[kThreads / 32][STRIP];
  __shared__ uint32_t s_col_rht[kThreads / 32][STRIP];
  __shared__ uint32_t red[kThreads / 32];
  const In* x = static_cast<const In*>(p.x);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t nstrips = (p.C + STRIP - 1) / STRIP;
  const int64_t strip = blockIdx.x % nstrips, group = blockIdx.x / nstrips;
  const int64_t c = strip * STRIP + lane * W;
  const int64_t row_begin = group * p.rows_per_cta;
  const int64_t row_end = min64(p.R, row_begin + p.rows_per_cta);
  const bool want_rht = p.tensor_rht || p.cols_rht;
  uint32_t col_part[W], col_rht_part[W];
#pragma unroll
  for (int j = 0; j < W; ++j) col_part[j] = col_rht_part[j] = 0;
  for (int64_t r0 = row_begin + warp * 16; r0 < row_end; r0 += (kThreads / 32) * 16) {
    alignas(16) In raw[16][W];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int64_t r = r0 + i;
      if (p.vec && r < p.R && c + W <= p.C) {
        *reinterpret_cast<uint4*>(raw[i]) = __ldg(reinterpret_cast<const uint4*>(x + r * p.C + c));
      } else {
#pragma unroll
        for (int j = 0; j < W; ++j) raw[i][j] = (r < p.R && c + j < p.C) ? x[r * p.C + c + j] : zero_of<In>();
      }
    }
    uint32_t row_part[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      row_part[i] = 0;
#pragma unroll
      for (int j = 0; j < W; ++j) {
        const uint32_t a = jq::abs_bits(to_float(raw[i][j]));
        row_part[i] = max(row_part[i], a);
        col_part[j] = max(col_part[j], a);
      }
    }
    if (p.rows) {
      // Reduce-scatter the 16 row maxima across the warp (8+4+2+1+1 shuffles instead of 16x5):
      // afterwards lane l holds row 8*b4 + 4*b3 + 2*b2 + b1 (b_k = bit k of l), max over lanes.
#pragma unroll
      for (int half = 8, bit = 4; half >= 1; half >>= 1, --bit) {
        const bool upper = (lane >> bit) & 1;
#pragma unroll
        for (int k = 0; k < half; ++k) {
          const uint32_t send = upper ? row_part[k] : row_part[k + half];
          const uint32_t keep = upper ? row_part[k + half] : row_part[k];
          row_part[k] = max(keep, __shfl_xor_sync(0xFFFFFFFFu, send, 1 << bit));
        }
      }
      row_part[0] = max(row_part[0], __shfl_xor_sync(0xFFFFFFFFu, row_part[0], 1));
      const int64_t r = r0 + ((lane >> 1) & 15);
      if ((lane & 1) == 0 && r < p.R) atomic_max_float(p.rows + r, row_part[0]);
    }
    if (want_rht) {
#pragma unroll
      for (int j = 0; j < W; ++j) {
        float w[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) w[i] = to_float(raw[i][j]);
        jq::rht16(w);
#pragma unroll
        for (int i = 0; i < 16; ++i) col_rht_part[j] = max(col_rht_part[j], jq::abs_bits(w[i]));
      }
    }
  }
  uint32_t t = 0, t_rht = 0;
#pragma unroll
  for (int j = 0; j < W; ++j) {
    t = max(t, col_part[j]);
    t_rht = max(t_rht, col_rht_part[j]);
    s_col[warp][lane * W + j] = col_part[j];
    s_col_rht[warp][lane * W + j] = col_rht_part[j];
  }
  __syncthreads();
  for (int j = threadIdx.x; j < STRIP; j += kThreads) {
    const int64_t cj = strip * STRIP + j;
    if (cj >= p.C) continue;
    uint32_t m = 0, m_rht = 0;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) {
      m = max(m, s_col[w][j]);
      m_rht = max(m_rht, s_col_rht[w][j]);
    }
    if (p.cols) atomic_max_float(p.cols + cj, m);
    if (p.cols_rht) atomic_max_float(p.cols_rht + cj, m_rht);
  }
  if (p.tensor) {
    t = cta_max(t, red);
    if (threadIdx.x == 0) atomic_max_float(p.tensor, t);
  }
  if (p.tensor_rht) {
    t_rht = cta_max(t_rht, red);
    if (threadIdx.x == 0) atomic_max_float(p.tensor_rht, t_rht);
  }
}

}  // namespace
}  // namespace jqffi
