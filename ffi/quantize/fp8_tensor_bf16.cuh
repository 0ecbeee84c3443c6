// Per-tensor FP8 quantize (current and delayed scaling) of a whole-tile bfloat16 matrix, both
// copies: the kernel a per-tensor FP8 training step runs on every activation and gradient
// (fp8_tensor_kernel serves the other cases). Same numerics as fp8_tensor_kernel, bit for bit.
#pragma once

#include "quantize/bf16_words.cuh"
#include "quantize/fp8_tensor.cuh"

namespace jqffi {
namespace {

// Whether fp8_tensor_bf16_kernel serves the call: both copies, a producer it reads (TileWords),
// whole 128 x 128 tiles (R and C multiples of 128), 16-byte aligned rows and copies, 32-bit
// element offsets (column sums, a bias gradient's, come from the column phase).
template <typename P>
inline bool fp8_tensor_bf16_fast(const Fp8TensorParams& p, const P& prod) {
  return TileWords<P>::serves(prod) && p.do_row && p.do_col && p.vec_row && p.vec_col && p.R % 128 == 0 &&
         p.C % 128 == 0 && p.R * p.C < (int64_t(1) << 31) && aligned(p.col, 16);
}

// fp8_block_1x128_bf16_kernel's tile and mappings with the tensor's one scale, known before a
// value is read: each pass's rowwise codes go out from registers as soon as its loads land (no
// row reductions, nothing read back), and the codes of a thread's 8 values (a row pass) or 16
// (a column chunk) are made NaN-canonical only where they hold a NaN. The tensor amax, where
// asked, from the passes' packed maxima.
template <typename P>
__global__ void __launch_bounds__(kThreads, 4) fp8_tensor_bf16_kernel(const Fp8TensorParams p, const P prod) {
  using Words = TileWords<P>;
  __shared__ uint32_t red[kThreads / 32];
  uint4* tile4 = shared_tile<uint4>();  // [128 rows][16 chunks]
  const uint32_t* tile = reinterpret_cast<const uint32_t*>(tile4);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const TileIndex t = tile_index(p.C, 128, 128);
  const uint32_t C = uint32_t(p.C), R = uint32_t(p.R);
  const float fmax = jq::spec_of(p.fmt).fmax;
  const float scale =
      jq::fp8_tensor_scale(*p.s, p.delayed, fmax, p.pow2_scale, p.amax_epsilon, p.first_amax, p.margin);

  // Row phase: thread (lr = tid / 16, q = tid % 16) holds columns 8q .. 8q+7 of tile rows 16 pp + lr.
  const int lr = tid >> 4, q = tid & 15;
  const uint32_t first = uint32_t(t.r0 + lr) * C + uint32_t(t.c0) + 8u * q;
  uint4 raw[8];
  load_tile_rows(prod, t, C, lr, q, raw);
  uint8_t* row_out = p.row + first;
  uint32_t thread_max = 0;
#pragma unroll
  for (int pp = 0; pp < 8; ++pp) {
    const uint4 w = make_uint4(Words::word(raw[pp].x), Words::word(raw[pp].y), Words::word(raw[pp].z),
                               Words::word(raw[pp].w));
    tile4[(16 * pp + lr) * 16 + (q ^ pp)] = w;
    const uint32_t m = abs_max_bf16x2(w);
    thread_max = __vmaxu2(thread_max, m);
    const bool nan = has_nan_bf16x2(m);
    *reinterpret_cast<uint2*>(row_out + pp * 16u * C) =
        make_uint2(bf16_codes4(w.x, w.y, scale, p.fmt, nan), bf16_codes4(w.z, w.w, scale, p.fmt, nan));
  }
  // The tensor amax, and the barrier before the column phase reads other threads' rows.
  if (p.amax) {
    const uint32_t tile_amax = cta_max(max(thread_max << 16, thread_max & 0xFFFF0000u), red);
    if (tid == 0) atomic_max_float(p.amax, tile_amax);
  } else {
    __syncthreads();
  }
  if (blockIdx.x == 0 && tid == 0) *p.scale_inv = jq::rcp_f32(scale);

  // Column phase: column pair cp (tile columns 2cp, 2cp+1), rows 16j .. 16j+15.
  const int j = lane & 7;
#pragma unroll
  for (int it = 0; it < 2; ++it) {
    const int cp = it * 32 + warp * 4 + (lane >> 3);
    uint32_t w[16];
    uint32_t m = load_column_pair(tile, j, cp, w);
    const bool nan0 = (m & 0xFFFFu) > kBf16NanAbove, nan1 = (m >> 16) > kBf16NanAbove;
    uint32_t q0[4], q1[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      q0[k] = bf16_column_codes4(w + 4 * k, false, scale, p.fmt, nan0);
      q1[k] = bf16_column_codes4(w + 4 * k, true, scale, p.fmt, nan1);
    }
    uint8_t* col_out = p.col + (uint32_t(t.c0) + 2u * cp) * R + uint32_t(t.r0) + 16u * j;
    *reinterpret_cast<uint4*>(col_out) = make_uint4(q0[0], q0[1], q0[2], q0[3]);
    *reinterpret_cast<uint4*>(col_out + R) = make_uint4(q1[0], q1[1], q1[2], q1[3]);
    if (p.col_sums) {  // a bias gradient's per-tile column sums (uniform: every lane shuffles)
      bf16_column_tile_sum(w, false, j, t.c0 + 2 * cp, t.r0 / 128, p.C, p.col_sums);
      bf16_column_tile_sum(w, true, j, t.c0 + 2 * cp + 1, t.r0 / 128, p.C, p.col_sums);
    }
  }
}

}  // namespace
}  // namespace jqffi
