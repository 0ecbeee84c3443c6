// bfloat16 words, two values at a time: what the whole-tile quantize kernels read
// (`TileWords`), their |bits| maxima and their FP8 codes.
#pragma once

#include "quantize/tile.cuh"

namespace jqffi {
namespace {

// Where a whole-tile kernel reads its 128 x 128 tile: element (i, j) of the tile at
// `first[i * stride + j]` (element offsets below 2^31).
struct TileSource {
  const BF16* first;
  uint32_t stride;
};

// What the whole-tile bfloat16 kernels (fp8_block_1x128.cuh, fp8_tensor_bf16.cuh) read for
// producer P: `kServed` producers give each tile (r0, c0) of the quantized R x C matrix as a
// bfloat16 `source` with 16-byte aligned rows where `serves`, each loaded word (two values)
// turned into two of the quantized values by `word`. x itself here; the fused producers' header
// adds the gelu of an MLP's fc1 output and a packed projection's parts (fused/producers.cuh).
template <typename P>
struct TileWords {
  static constexpr bool kServed = false;
};
template <>
struct TileWords<Direct<BF16>> {
  static constexpr bool kServed = true;
  static bool serves(const Direct<BF16>& x) { return x.vec; }
  __device__ static TileSource source(const Direct<BF16>& x, uint32_t r0, uint32_t c0, uint32_t C) {
    return {x.x + r0 * C + c0, C};
  }
  __device__ static uint32_t word(uint32_t w) { return w; }
};

// The row phase's loads of a whole-tile kernel: thread (lr = tid / 16, q = tid % 16) gets
// columns 8q .. 8q+7 of tile rows 16 pp + lr (pp = 0..7) of tile t, read where producer P's
// `source` holds them, every load issued first.
template <typename P>
__device__ __forceinline__ void load_tile_rows(const P& prod, const TileIndex& t, uint32_t C, int lr, int q,
                                               uint4 (&raw)[8]) {
  const TileSource in = TileWords<P>::source(prod, uint32_t(t.r0), uint32_t(t.c0), C);
  const uint4* src = reinterpret_cast<const uint4*>(in.first + uint32_t(lr) * in.stride + 8u * q);
#pragma unroll
  for (int pp = 0; pp < 8; ++pp) raw[pp] = __ldg(src + pp * 2u * in.stride);  // 16 rows = 2 strides of chunks
}

// Two passes' maxima in one word: the larger bfloat16 half of a in the low half, of b in the
// high half.
__device__ __forceinline__ uint32_t pack_pass_maxima(uint32_t a, uint32_t b) {
  return __vmaxu2(__byte_perm(a, b, 0x5410), __byte_perm(a, b, 0x7632));
}

// The float32 |bits| of a bfloat16 half (hi: the upper one) of a packed word.
__device__ __forceinline__ uint32_t bf16_half_bits(uint32_t w, bool hi) {
  return hi ? (w & 0xFFFF0000u) : (w << 16);
}

// Four codes of the bfloat16 pairs w0, w1 (values lo, hi, lo, hi) times scale; NaN codes made
// canonical only where the block holds a NaN (`nan`).
__device__ __forceinline__ uint32_t bf16_codes4(uint32_t w0, uint32_t w1, float scale, jq::Fp8 fmt, bool nan) {
  const uint32_t code = jq::encode_fp8x4_not_nan(__uint_as_float(w0 << 16) * scale,
                                                 __uint_as_float(w0 & 0xFFFF0000u) * scale,
                                                 __uint_as_float(w1 << 16) * scale,
                                                 __uint_as_float(w1 & 0xFFFF0000u) * scale, fmt);
  return nan ? jq::canonical_nan_fp8x4(code, fmt) : code;
}

// Four codes of one bfloat16 half (hi: the upper) of words w[0..3] (four rows of one column).
__device__ __forceinline__ uint32_t bf16_column_codes4(const uint32_t* w, bool hi, float scale, jq::Fp8 fmt,
                                                       bool nan) {
  const uint32_t code = jq::encode_fp8x4_not_nan(
      __uint_as_float(bf16_half_bits(w[0], hi)) * scale, __uint_as_float(bf16_half_bits(w[1], hi)) * scale,
      __uint_as_float(bf16_half_bits(w[2], hi)) * scale, __uint_as_float(bf16_half_bits(w[3], hi)) * scale, fmt);
  return nan ? jq::canonical_nan_fp8x4(code, fmt) : code;
}

constexpr uint32_t kAbsBf16x2 = 0x7FFF7FFFu;
constexpr uint32_t kBf16NanAbove = 0x7F80u;  // |bits| above +inf's: NaN

// The column phase's words of a whole-tile kernel: rows 16j .. 16j+15 of the tile's column pair
// cp (one bfloat16 pair a row) from the swizzled shared tile (64 words a row), and their packed
// |bits| maximum.
__device__ __forceinline__ uint32_t load_column_pair(const uint32_t* tile, int j, int cp, uint32_t (&w)[16]) {
  const uint32_t* at = tile + 16 * j * 64 + (((cp >> 2) ^ j) << 2) + (cp & 3);
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    w[i] = at[64 * i];
    m = __vmaxu2(m, w[i] & kAbsBf16x2);
  }
  return m;
}

// column_tile_sum (tile.cuh) of one bfloat16 half (hi: the upper) of words w[0..15]: the 16
// rows of column c a whole-tile kernel's column phase holds, the column's 8 chunks in lanes
// j = lane % 8. Every lane must call it (shuffles).
__device__ __forceinline__ void bf16_column_tile_sum(const uint32_t* w, bool hi, int j, int64_t c, int64_t tile_row,
                                                     int64_t C, float* out) {
  float s = __uint_as_float(bf16_half_bits(w[0], hi)) + __uint_as_float(bf16_half_bits(w[1], hi));
#pragma unroll
  for (int i = 2; i < 16; ++i) s = s + __uint_as_float(bf16_half_bits(w[i], hi));
#pragma unroll
  for (int o = 1; o < 8; o <<= 1) s = s + __shfl_xor_sync(0xFFFFFFFFu, s, o);
  if (j == 0) out[tile_row * C + c] = s;
}

// The larger |bits| of each half over a uint4 of bfloat16 pairs.
__device__ __forceinline__ uint32_t abs_max_bf16x2(uint4 w) {
  return __vmaxu2(__vmaxu2(w.x & kAbsBf16x2, w.y & kAbsBf16x2), __vmaxu2(w.z & kAbsBf16x2, w.w & kAbsBf16x2));
}

// Whether either half of packed |bits| maxima is a NaN's.
__device__ __forceinline__ bool has_nan_bf16x2(uint32_t m) {
  return (m & 0xFFFFu) > kBf16NanAbove || (m >> 16) > kBf16NanAbove;
}

}  // namespace
}  // namespace jqffi
