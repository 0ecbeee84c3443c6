// Float8Block's 1x128 quantize of a whole-tile bfloat16 matrix, both copies: the kernel a
// Float8Block training step runs on every activation and gradient (fp8_block_kernel serves the
// other cases). Same numerics as fp8_block_kernel, bit for bit; a third fewer instructions.
#pragma once

#include "quantize/bf16_words.cuh"
#include "quantize/fp8_block.cuh"

namespace jqffi {
namespace {

// Whether fp8_block_1x128_bf16_kernel serves the call: 1x128 blocks, both copies, a producer it
// reads (TileWords), whole 128 x 128 tiles (R and C multiples of 128), 16-byte aligned rows and
// copies, 32-bit element offsets, no expert layout.
template <typename P>
inline bool fp8_block_1x128_fast(const Fp8BlockParams& p, const P& prod) {
  return TileWords<P>::serves(prod) && !p.block_2d && p.do_row && p.do_col &&
         p.expert_rows == 0 && p.vec_row && p.vec_col && p.R % 128 == 0 && p.C % 128 == 0 &&
         p.R * p.C < (int64_t(1) << 31) && aligned(p.col, 16);
}

// Tile 128 x 128, 256 threads, the tile in shared memory as 64 words (bfloat16 pairs) a row,
// 16-byte chunks XOR-swizzled by the row's 16-row chunk (fp8_block_kernel's layout).
// - Rows: thread (lr = tid / 16, q = tid % 16) loads columns 8q .. 8q+7 of tile rows 16 pp + lr
//   (8 passes, all issued first). Block maxima are taken on the bfloat16 |bits| two at a time
//   (__vmaxu2), and two passes' maxima share one word through the 16-lane shuffle reduction
//   (16 shuffles, not 40). Each lane of a half-warp's first 8 (16 rows a warp) computes one
//   row's scale and stores its inverse; the codes are written from the tile.
// - Columns: a thread owns rows 16j .. 16j+15 of two adjacent columns (one 32-bit word a row),
//   8 lanes a column pair, two iterations of 32 pairs: half the shared loads of one column a
//   thread, and both columns' maxima in one shuffle reduction.
// The bfloat16 |bits| order is the float32 one (a bfloat16 is a float32's upper half), NaN
// above +inf, so every amax, scale and code is fp8_block_kernel's.
template <typename P>
__global__ void __launch_bounds__(kThreads, 4) fp8_block_1x128_bf16_kernel(const Fp8BlockParams p, const P prod) {
  using Words = TileWords<P>;
  __shared__ uint32_t red[kThreads / 32];
  uint4* tile4 = shared_tile<uint4>();  // [128 rows][16 chunks]
  const uint32_t* tile = reinterpret_cast<const uint32_t*>(tile4);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const TileIndex t = tile_index(p.C, 128, 128);
  const uint32_t C = uint32_t(p.C), R = uint32_t(p.R);
  const float fmax = jq::spec_of(p.fmt).fmax;

  // Row phase: loads, the tile, and each pass's |bits| maximum (two halves).
  const int lr = tid >> 4, q = tid & 15;
  const uint32_t first = uint32_t(t.r0 + lr) * C + uint32_t(t.c0) + 8u * q;  // element offset, pass 0
  uint4 raw[8];
  load_tile_rows(prod, t, C, lr, q, raw);
  uint32_t pass_max[8];
#pragma unroll
  for (int pp = 0; pp < 8; ++pp) {
    raw[pp] = make_uint4(Words::word(raw[pp].x), Words::word(raw[pp].y), Words::word(raw[pp].z),
                         Words::word(raw[pp].w));
    tile4[(16 * pp + lr) * 16 + (q ^ pp)] = raw[pp];
    pass_max[pp] = __vmaxu2(__vmaxu2(raw[pp].x & kAbsBf16x2, raw[pp].y & kAbsBf16x2),
                            __vmaxu2(raw[pp].z & kAbsBf16x2, raw[pp].w & kAbsBf16x2));
  }
  // Passes 2k and 2k+1's row maxima (low and high half), reduced over the row's 16 lanes.
  uint32_t pair_max[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    uint32_t m = pack_pass_maxima(pass_max[2 * k], pass_max[2 * k + 1]);
#pragma unroll
    for (int o = 1; o < 16; o <<= 1) m = __vmaxu2(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
    pair_max[k] = m;
  }
  // Lane l (l % 16 < 8 computes; the other 8 repeat it) takes pass l % 8 of half (l / 8) % 2:
  // half-warp h's lanes all hold its pair maxima, and lane 16 h + k offers pair k.
  const int my_pass = lane & 7, my_half = (lane >> 3) & 1;
  const uint32_t offer = (lane & 2) ? ((lane & 1) ? pair_max[3] : pair_max[2])
                                    : ((lane & 1) ? pair_max[1] : pair_max[0]);
  const uint32_t got = __shfl_sync(0xFFFFFFFFu, offer, 16 * my_half + (my_pass >> 1));
  const float row_scale = jq::scale_from_amax(__uint_as_float(bf16_half_bits(got, my_pass & 1)), fmax,
                                              p.pow2_scale, p.amax_epsilon);
  if (lane < 16) {
    const int64_t row = t.r0 + 16 * my_pass + 2 * warp + my_half;
    p.row_scale[row * ((p.C + 127) / 128) + t.c0 / 128] = jq::rcp_f32(row_scale);
  }
  // The codes of each pass's row from the tile (this thread's own chunk: no barrier).
  uint8_t* row_out = p.row + first;
#pragma unroll
  for (int pp = 0; pp < 8; ++pp) {
    const float scale = __shfl_sync(0xFFFFFFFFu, row_scale, 8 * (lane >> 4) + pp);
    const bool nan = ((pair_max[pp >> 1] >> (16 * (pp & 1))) & 0xFFFFu) > kBf16NanAbove;
    const uint4 w = tile4[(16 * pp + lr) * 16 + (q ^ pp)];
    *reinterpret_cast<uint2*>(row_out + pp * 16u * C) =
        make_uint2(bf16_codes4(w.x, w.y, scale, p.fmt, nan), bf16_codes4(w.z, w.w, scale, p.fmt, nan));
  }
  // The tensor amax, and the barrier before the column phase reads other threads' rows.
  if (p.amax) {
    const uint32_t m2 = __vmaxu2(__vmaxu2(pair_max[0], pair_max[1]), __vmaxu2(pair_max[2], pair_max[3]));
    const uint32_t tile_amax = cta_max(max(m2 << 16, m2 & 0xFFFF0000u), red);
    if (tid == 0) atomic_max_float(p.amax, tile_amax);
  } else {
    __syncthreads();
  }

  // Column phase: column pair cp (tile columns 2cp, 2cp+1), rows 16j .. 16j+15.
  const int j = lane & 7;
  const int64_t col_nb = (p.R + 127) / 128;
#pragma unroll
  for (int it = 0; it < 2; ++it) {
    const int cp = it * 32 + warp * 4 + (lane >> 3);
    uint32_t w[16];
    uint32_t m = load_column_pair(tile, j, cp, w);
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) m = __vmaxu2(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
    const float scale0 = jq::scale_from_amax(__uint_as_float(m << 16), fmax, p.pow2_scale, p.amax_epsilon);
    const float scale1 = jq::scale_from_amax(__uint_as_float(m & 0xFFFF0000u), fmax, p.pow2_scale, p.amax_epsilon);
    const bool nan0 = (m & 0xFFFFu) > kBf16NanAbove, nan1 = (m >> 16) > kBf16NanAbove;
    const int64_t c = t.c0 + 2 * cp;
    uint32_t q0[4], q1[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      q0[k] = bf16_column_codes4(w + 4 * k, false, scale0, p.fmt, nan0);
      q1[k] = bf16_column_codes4(w + 4 * k, true, scale1, p.fmt, nan1);
    }
    uint8_t* col_out = p.col + uint32_t(c) * R + uint32_t(t.r0) + 16u * j;
    *reinterpret_cast<uint4*>(col_out) = make_uint4(q0[0], q0[1], q0[2], q0[3]);
    *reinterpret_cast<uint4*>(col_out + R) = make_uint4(q1[0], q1[1], q1[2], q1[3]);
    if (j < 2) p.col_scale[(c + j) * col_nb + t.r0 / 128] = jq::rcp_f32(j ? scale1 : scale0);
    if (p.col_sums) {  // a bias gradient's per-tile column sums (uniform: every lane shuffles)
      bf16_column_tile_sum(w, false, j, c, t.r0 / 128, p.C, p.col_sums);
      bf16_column_tile_sum(w, true, j, c + 1, t.r0 / 128, p.C, p.col_sums);
    }
  }
}

}  // namespace
}  // namespace jqffi
