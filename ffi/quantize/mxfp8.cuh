// MXFP8 quantize kernel.
#pragma once

#include "quantize/mxfp8_raw.cuh"
#include "quantize/tile.cuh"

namespace jqffi {
namespace {
// ============================================================================================
// MXFP8: 1x32 blocks along each output's rows, E8M0 scales; fused tensor amax. Tile 128x128.
// ============================================================================================

struct Mxfp8Params {
  int64_t R, C;  // the quantized matrix (the producer's values)
  bool vec_row, vec_col, do_row, do_col;
  bool raw;  // row / col hold bfloat16 raw values (code x block scale) instead of the codes
  jq::Fp8 fmt;
  uint8_t *row, *row_scale, *col, *col_scale;
  float* amax;
  float* col_sums = nullptr;  // [ceil(R/128), C] per-tile column sums (fused dact's bias gradient)
  int64_t expert_rows = 0;    // > 0: expert weights, the columnwise copy [R / E, C, E] (E % 32 == 0)
  bool col_in_x_layout = false;  // raw expert weights' columnwise copy [R, C] (mxfp8_x_layout.cuh)
  uint8_t* row_flags = nullptr;  // with col_in_x_layout: flags instead of the rowwise data (ibid.)
};

// The kernel's parameters for the decoded call `a` quantizing an R x C matrix (col_sums: the
// fused activation gradient's column sums, or null).
// Raw copies (`a.raw`) store 8 and 16 bfloat16 values a thread: 16-byte stores when aligned,
// tokens' columnwise ones by pairs of lanes over whole 32-row blocks (`Fp8TileColumn::store_raw`).
// A columnwise copy in the weights' own layout (`a.col_in_x_layout`) is stored as the rowwise one
// is, 8 values and their 8 scale bytes a lane (mxfp8_x_layout_kernel).
inline Mxfp8Params mxfp8_params(const Mxfp8Args& a, int64_t R, int64_t C, float* col_sums = nullptr) {
  const bool vec_col = a.col_in_x_layout ? aligned(a.col_data, 16) && aligned(a.col_scale, 8) && C % 8 == 0
                                         : aligned(a.col_data, 16) && R % (a.raw ? 32 : 16) == 0;
  return {R, C, aligned(a.row_data, a.raw ? 16 : 8) && C % 8 == 0, vec_col, a.rowwise,
          a.columnwise, a.raw, a.fmt, a.row_data, a.row_scale, a.col_data, a.col_scale, a.amax,
          col_sums, /*expert_rows=*/0, a.col_in_x_layout, a.row_flags};
}

// The codes of N values (a multiple of 4) of one block with exponent e, four a word (the first
// in the low byte): NaN codes for a NaN block (e = 255), else v * a * b, which is v * a where
// b = 1 (every e but 254; x * 1 == x) and is never NaN (finite or infinite values times finite
// factors). One branch a block: a branch a word cost ~20 instructions a row pass (session 21).
template <int N>
__device__ __forceinline__ void mxfp8_codes(const float* v, uint32_t e, jq::Fp8 fmt, uint32_t* q) {
  const jq::Mxfp8Factors f = jq::mxfp8_factors(e);
  if (e < 254u) {
#pragma unroll
    for (int k = 0; k < N / 4; ++k) {
      const float* w = v + 4 * k;
      q[k] = jq::encode_fp8x4_not_nan(w[0] * f.a, w[1] * f.a, w[2] * f.a, w[3] * f.a, fmt);
    }
  } else if (e == 254u) {
#pragma unroll
    for (int k = 0; k < N / 4; ++k) {
      const float* w = v + 4 * k;
      q[k] = jq::encode_fp8x4_not_nan(w[0] * f.a * f.b, w[1] * f.a * f.b, w[2] * f.a * f.b,
                                      w[3] * f.a * f.b, fmt);
    }
  } else {
#pragma unroll
    for (int k = 0; k < N / 4; ++k) q[k] = 0x7F7F7F7Fu;
  }
}

// kExperts: p.expert_rows > 0 (a separate instance, so the other kernels keep their registers).
// kRaw: p.raw, each copy written as the bfloat16 raw values of its codes (what the grouped
// GEMMs on decoded operands read; quantize/mxfp8_raw.cuh), its scales as always.
template <typename P, bool kExperts = false, bool kRaw = false>
__global__ void __launch_bounds__(kThreads, ProducerMinCtas<P>::value) mxfp8_kernel(const Mxfp8Params p, const P prod) {
  using G = FP8Tile<typename P::Out>;
  __shared__ uint32_t red[kThreads / 32];
  const int tid = threadIdx.x;
  const float inv_fmax = jq::inv_fmax_of(p.fmt);
  const int64_t row_nb = (p.C + 31) / 32, col_nb = (p.R + 31) / 32;
  Fp8TileLoad<P> ld(prod, p);
  const auto& reader = tile_reader(prod, ld.t.r0);
#pragma unroll
  for (int pp = 0; pp < G::NP; ++pp) {
    float v[8];
    uint32_t m = ld.pass(pp, v);
    if (!p.do_row) continue;
    m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, 1));  // 4 threads = one 32-wide block
    m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, 2));
    const int64_t r = ld.row(pp), c = ld.col();
    if (r < p.R && c < p.C) {
      const RowDestination to = row_destination(reader, r);
      const auto store_row = [&](int64_t row, const float* w, uint32_t bits) {
        const uint32_t e = jq::e8m0_from_amax(__uint_as_float(bits), inv_fmax);
        uint32_t q[2];
        mxfp8_codes<8>(w, e, p.fmt, q);
        if constexpr (kRaw) {
          uint32_t raw[4];
          mxfp8_raw_words<2>(q, jq::decode_e8m0(e), p.fmt == jq::Fp8::kE5M2, raw);
          store_bf16_words(reinterpret_cast<uint16_t*>(p.row) + row * p.C + c, raw,
                           int(min64(8, p.C - c)), p.vec_row);
        } else {
          store_bytes8(p.row + row * p.C + c, q[0], q[1], int(min64(8, p.C - c)), p.vec_row);
        }
        if ((tid & 3) == 0) p.row_scale[row * row_nb + c / 32] = uint8_t(e);
      };
      if (to.row >= 0) store_row(to.row, v, m);
      if (to.zero_row) {  // a packed row of no group: a zero row's codes and scale
        const float zeros[8] = {};
        store_row(r, zeros, 0u);
      }
    }
  }
  if (p.amax) {
    const uint32_t amax = cta_max(ld.amax, red);
    if (tid == 0) atomic_max_float(p.amax, amax);
  }
  if (!ld.column_phase) return;
  __syncthreads();
  // expert weights: the place of this thread's rows in the columnwise copies, for every iteration
  const ExpertRow er = kExperts ? ExpertRow(ld.t.r0 + 16 * ColumnSlot<G>(0).j, p.expert_rows) : ExpertRow{};
#pragma unroll
  for (int it = 0; it < G::ITERS; ++it) {
    const Fp8TileColumn<G> chunk(ld.tile, ld.t, it, p.C, p.col_sums);
    uint32_t m = abs_bits_max<16>(chunk.w);
    m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, 1));  // chunks j, j^1 = one 32-row block
    const bool active = p.do_col && chunk.c < p.C && chunk.rr < p.R;
    if (!kRaw && !active) continue;  // raw copies: every lane stores (store_raw's shuffle)
    const uint32_t e = jq::e8m0_from_amax(__uint_as_float(m), inv_fmax);
    uint32_t q[4];
    mxfp8_codes<16>(chunk.w, e, p.fmt, q);
    const float s = jq::decode_e8m0(e);
    const auto raw8 = [&](const uint32_t* codes, uint32_t* out) {
      mxfp8_raw_words<2>(codes, s, p.fmt == jq::Fp8::kE5M2, out);
    };
    if (active && (chunk.slot.j & 1) == 0) {
      p.col_scale[kExperts ? er.index(chunk.c, p.C, 32) : chunk.c * col_nb + chunk.rr / 32] = uint8_t(e);
    }
    if constexpr (kRaw) {
      chunk.template store_raw<!kExperts>(reinterpret_cast<uint16_t*>(p.col), p.R, p.vec_col, q,
                                          raw8, active, p.C, er);
    } else {
      chunk.store_codes(p.col, p.R, p.vec_col, q, p.C, er);
    }
  }
}

}  // namespace
}  // namespace jqffi
