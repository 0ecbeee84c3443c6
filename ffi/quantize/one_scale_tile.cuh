// The body of the kernels that quantize a whole 128 x 128 tile with one scale to both copies
// (Float8Block's 128x128 blocks, per-tensor FP8 of float32 inputs): with one scale a tile the
// columnwise copy's codes are the rowwise copy's, transposed, so each value is encoded once.
#pragma once

#include "quantize/tile.cuh"

namespace jqffi {
namespace {

// 8 values of x at element offset `at` (16-byte aligned) as floats.
__device__ __forceinline__ void load8_floats(const float* x, uint32_t at, float* v) {
  const float4 a = __ldg(reinterpret_cast<const float4*>(x + at));
  const float4 b = __ldg(reinterpret_cast<const float4*>(x + at) + 1);
  v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
  v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}
__device__ __forceinline__ void load8_floats(const BF16* x, uint32_t at, float* v) {
  const uint4 w = __ldg(reinterpret_cast<const uint4*>(x + at));
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = __uint_as_float(words[i] << 16);
    v[2 * i + 1] = __uint_as_float(words[i] & 0xFFFF0000u);
  }
}

// Rows a..d (four bytes each, one a column) as columns: word k holds column k's four bytes.
__device__ __forceinline__ void transpose4x4_bytes(uint32_t a, uint32_t b, uint32_t c, uint32_t d, uint32_t* out) {
  const uint32_t ab01 = __byte_perm(a, b, 0x5140), ab23 = __byte_perm(a, b, 0x7362);
  const uint32_t cd01 = __byte_perm(c, d, 0x5140), cd23 = __byte_perm(c, d, 0x7362);
  out[0] = __byte_perm(ab01, cd01, 0x5410);
  out[1] = __byte_perm(ab01, cd01, 0x7632);
  out[2] = __byte_perm(ab23, cd23, 0x5410);
  out[3] = __byte_perm(ab23, cd23, 0x7632);
}

// One tile, one scale. Thread (lr = tid / 16, q = tid % 16) loads columns 8q .. 8q+7 of tile
// rows 16 pp + lr (8 passes, all issued first), the CTA reduces the tile amax (float bits, to
// `*amax` where given), `scale_of(tile_amax)` gives the tile's scale, and each pass's codes go
// from registers to the rowwise copy and to a 16 KiB byte tile (32 words a row, word m of row r
// at m ^ (r / 16 % 8)). The column phase reads 16 rows x 4 columns a thread (one word a row; a
// warp's four column words are 8 apart, so with the swizzle its 32 lanes hit 32 banks),
// transposes them with byte permutations, and stores 16 bytes to each of the 4 columnwise
// rows. NaN codes are made canonical only in a tile whose amax is NaN.
template <typename In, typename ScaleOf>
__device__ __forceinline__ void one_scale_tile(const In* x, uint32_t R, uint32_t C, jq::Fp8 fmt,
                                               uint8_t* row, uint8_t* col, float* amax,
                                               ScaleOf scale_of) {
  __shared__ uint32_t red[kThreads / 32];
  __shared__ __align__(16) uint32_t codes[128 * 32];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const TileIndex t = tile_index(C, 128, 128);

  const int lr = tid >> 4, q = tid & 15;
  const uint32_t first = uint32_t(t.r0 + lr) * C + uint32_t(t.c0) + 8u * q;
  float v[8][8];
#pragma unroll
  for (int pp = 0; pp < 8; ++pp) load8_floats(x, first + pp * 16u * C, v[pp]);
  uint32_t m = 0;
#pragma unroll
  for (int pp = 0; pp < 8; ++pp) m = max(m, abs_bits_max<8>(v[pp]));
  const uint32_t tile_amax = cta_max(m, red);
  if (amax && tid == 0) atomic_max_float(amax, tile_amax);
  const float scale = scale_of(tile_amax, t);
  const bool nan = tile_amax > 0x7F800000u;  // a NaN in the tile: its codes made canonical
  uint8_t* row_out = row + first;
#pragma unroll
  for (int pp = 0; pp < 8; ++pp) {
    uint32_t w0 = jq::encode_fp8x4_not_nan(v[pp][0] * scale, v[pp][1] * scale, v[pp][2] * scale,
                                           v[pp][3] * scale, fmt);
    uint32_t w1 = jq::encode_fp8x4_not_nan(v[pp][4] * scale, v[pp][5] * scale, v[pp][6] * scale,
                                           v[pp][7] * scale, fmt);
    if (nan) {
      w0 = jq::canonical_nan_fp8x4(w0, fmt);
      w1 = jq::canonical_nan_fp8x4(w1, fmt);
    }
    *reinterpret_cast<uint2*>(row_out + pp * 16u * C) = make_uint2(w0, w1);
    const int r = 16 * pp + lr;  // r / 16 == pp
    codes[r * 32 + ((2 * q) ^ pp)] = w0;
    codes[r * 32 + ((2 * q + 1) ^ pp)] = w1;
  }
  __syncthreads();
  // Column phase: rows 16j .. 16j+15, tile columns 4 cw .. 4 cw + 3.
  const int j = lane & 7, cw = 8 * (lane >> 3) + warp;
  uint32_t col_words[4][4];  // [column k][rows 4b .. 4b+3]
#pragma unroll
  for (int b = 0; b < 4; ++b) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = codes[(16 * j + 4 * b + i) * 32 + (cw ^ j)];
    uint32_t out[4];
    transpose4x4_bytes(w[0], w[1], w[2], w[3], out);
#pragma unroll
    for (int k = 0; k < 4; ++k) col_words[k][b] = out[k];
  }
  uint8_t* col_out = col + (uint32_t(t.c0) + 4u * cw) * R + uint32_t(t.r0) + 16u * j;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    *reinterpret_cast<uint4*>(col_out + k * R) =
        make_uint4(col_words[k][0], col_words[k][1], col_words[k][2], col_words[k][3]);
  }
}

}  // namespace
}  // namespace jqffi
