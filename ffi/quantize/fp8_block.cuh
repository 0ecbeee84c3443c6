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
  int64_t expert_rows = 0;    // > 0: expert weights, the columnwise copy [R / E, C, E] (E % 128 == 0)
};

// The kernel's parameters for the decoded call `a` quantizing an R x C matrix (col_sums: the
// fused activation gradient's column sums, or null).
inline Fp8BlockParams fp8_block_params(const Fp8BlockArgs& a, int64_t R, int64_t C,
                                       float* col_sums = nullptr) {
  return {R, C, aligned(a.row_data, 8) && C % 8 == 0, aligned(a.col_data, 16) && R % 16 == 0,
          a.rowwise, a.columnwise, a.block_2d, a.pow2_scale, a.amax_epsilon, a.fmt,
          a.row_data, a.col_data, a.row_scale, a.col_scale, a.amax, col_sums};
}

// Rowwise codes are written from the tile in shared memory, not from registers held across a
// reduction: 128x128 blocks wait for the tile's amax, 1x128 blocks for the warp's 16 row
// scales (one a lane).
__host__ __device__ __forceinline__ bool rows_from_tile(const Fp8BlockParams& p) {
  return p.do_row;
}

// kExperts: p.expert_rows > 0 (a separate instance, so the other kernels keep their registers).
// kBlock2d: p.block_2d (128x128 blocks), its own instance. Both read their rows back from the
// tile, so neither holds its loaded values across a reduction (bfloat16 input, 119 registers
// before session 10: 128x128 64 (4 CTAs), H100 16384 x 8192 both copies 256 -> 208 µs; 1x128
// wrote each pass's codes as it was loaded until session 34, 64 registers with a 4-byte spill,
// a scale division and reciprocal a pass).
template <typename P, bool kExperts = false, bool kBlock2d = false>
__global__ void __launch_bounds__(kThreads, TileMinCtas<P>::value) fp8_block_kernel(const Fp8BlockParams p,
                                                                         const P prod) {
  using G = FP8Tile<typename P::Out>;
  static_assert(G::TPR == 16 && G::NJ == 8, "a tile row is one 1x128 block; 8 lanes a column");
  __shared__ uint32_t red[kThreads / 32];
  const int tid = threadIdx.x;
  const float fmax = jq::spec_of(p.fmt).fmax;
  const int64_t row_nb = (p.C + 127) / 128, col_nb = (p.R + 127) / 128;
  Fp8TileLoad<P> ld(prod, p);
  const TileIndex t = ld.t;
  [[maybe_unused]] const auto& reader = tile_reader(prod, t.r0);  // the 1x128 rows' destination
  // 1x128 blocks: each lane computes one of the warp's 16 rows' scale and reciprocal (pass
  // (l % 16) / 2's row of half l % 2; the FP8 tile's layout: 16 lanes a row, 2 rows a warp, 8
  // passes) rather than one a pass; the codes are then written from the tile (each thread reads
  // back what it stored: no barrier).
  static_assert(G::NP == 8 && G::RPP == 16, "16 rows a warp");
  [[maybe_unused]] const int lane = tid & 31, mine = (lane & 15) >> 1;
  [[maybe_unused]] uint32_t lane_bits = 0;
  const auto store_row = [&](int64_t row, const float* w, float scale, float scale_inv) {
    store_bytes8(p.row + row * p.C + ld.col(), fp8_codes4(w, scale, p.fmt), fp8_codes4(w + 4, scale, p.fmt),
                 int(min64(8, p.C - ld.col())), p.vec_row);
    if (ld.lc == 0) p.row_scale[row * row_nb + t.c0 / 128] = scale_inv;
  };
  // Writes tile row pass pp's codes (values v, their row's scale), and a zero row's where a
  // packed reader places none.
  const auto write_pass = [&](int pp, const float* v, float scale, float scale_inv) {
    const int64_t r = ld.row(pp), c = ld.col();
    if (!p.do_row || r >= p.R || c >= p.C) return;
    const RowDestination to = row_destination(reader, r);
    if (to.row >= 0) store_row(to.row, v, scale, scale_inv);
    if (to.zero_row) {  // a packed row of no group: a zero row's codes and scale
      const float zeros[8] = {};
      const float zero_scale = jq::scale_from_amax(0.0f, fmax, p.pow2_scale, p.amax_epsilon);
      store_row(r, zeros, zero_scale, jq::rcp_f32(zero_scale));
    }
  };
#pragma unroll
  for (int pp = 0; pp < G::NP; ++pp) {
    float v[8];
    uint32_t m = ld.pass(pp, v);
#pragma unroll
    for (int o = 1; o < 16; o <<= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
    if constexpr (!kBlock2d) {
      const uint32_t b = __shfl_sync(0xFFFFFFFFu, m, (lane & 1) * 16);
      if (pp == mine) lane_bits = b;
    }
  }
  if constexpr (!kBlock2d) {
    if (p.do_row) {  // rows_from_tile: the tile is kept
      const float lane_scale = jq::scale_from_amax(__uint_as_float(lane_bits), fmax, p.pow2_scale, p.amax_epsilon);
      const float lane_scale_inv = jq::rcp_f32(lane_scale);
      const int half = lane >> 4;
#pragma unroll
      for (int pp = 0; pp < G::NP; ++pp) {
        const float scale = __shfl_sync(0xFFFFFFFFu, lane_scale, 2 * pp + half);
        const float scale_inv = __shfl_sync(0xFFFFFFFFu, lane_scale_inv, 2 * pp + half);
        typename P::Out raw[8];
        tile_load8<G>(ld.tile, pp * G::RPP + ld.lr, ld.lc, raw);
        float v[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = to_float(raw[i]);
        write_pass(pp, v, scale, scale_inv);
      }
    }
  }
  const uint32_t tile_amax = cta_max(ld.amax, red);  // also the 128x128 block amax; orders the tile
  if (p.amax && tid == 0) atomic_max_float(p.amax, tile_amax);
  const float tile_scale = jq::scale_from_amax(__uint_as_float(tile_amax), fmax, p.pow2_scale, p.amax_epsilon);
  if (kBlock2d && p.do_row) {
#pragma unroll
    for (int pp = 0; pp < G::NP; ++pp) {
      const int64_t r = ld.row(pp), c = ld.col();
      if (r >= p.R || c >= p.C) continue;
      typename P::Out raw[8];
      tile_load8<G>(ld.tile, pp * G::RPP + ld.lr, ld.lc, raw);
      float v[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = to_float(raw[i]);
      store_bytes8(p.row + r * p.C + c, fp8_codes4(v, tile_scale, p.fmt),
                   fp8_codes4(v + 4, tile_scale, p.fmt), int(min64(8, p.C - c)), p.vec_row);
      if (tid == 0) p.row_scale[(t.r0 / 128) * row_nb + t.c0 / 128] = jq::rcp_f32(tile_scale);
    }
  }
  if (!ld.column_phase) return;
  // expert weights: the place of this thread's rows in the columnwise copies (E % 128 == 0, so
  // the tile's rows are one expert's and a 128-row block's scale index is its chunk's)
  const ExpertRow er = kExperts ? ExpertRow(t.r0 + 16 * ColumnSlot<G>(0).j, p.expert_rows) : ExpertRow{};
#pragma unroll
  for (int it = 0; it < G::ITERS; ++it) {
    const Fp8TileColumn<G> chunk(ld.tile, t, it, p.C, p.col_sums);
    uint32_t m = abs_bits_max<16>(chunk.w);
#pragma unroll
    for (int o = 1; o < G::NJ; o <<= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));  // 128 rows
    const float scale = kBlock2d ? tile_scale
                                   : jq::scale_from_amax(__uint_as_float(m), fmax, p.pow2_scale, p.amax_epsilon);
    if (!p.do_col || chunk.c >= p.C || chunk.rr >= p.R) continue;
    const auto codes4 = [&](const float* v) { return fp8_codes4(v, scale, p.fmt); };
    if constexpr (kExperts) {
      if constexpr (kBlock2d) {
        if (tid == 0) p.col_scale[er.index(t.c0 / 128, (p.C + 127) / 128, 128)] = jq::rcp_f32(scale);
      } else if (chunk.slot.j == 0) {
        p.col_scale[er.index(chunk.c, p.C, 128)] = jq::rcp_f32(scale);
      }
      chunk.store(p.col, p.R, p.vec_col, codes4, p.C, er);
    } else {
      if constexpr (kBlock2d) {
        if (tid == 0) p.col_scale[(t.c0 / 128) * col_nb + t.r0 / 128] = jq::rcp_f32(scale);
      } else if (chunk.slot.j == 0) {
        p.col_scale[chunk.c * col_nb + t.r0 / 128] = jq::rcp_f32(scale);
      }
      chunk.store(p.col, p.R, p.vec_col, codes4);
    }
  }
}

}  // namespace
}  // namespace jqffi
