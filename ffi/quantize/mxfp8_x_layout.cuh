// MXFP8 raw copies of bfloat16 expert weights with both copies in the weights' own layout
// (design decision 49): the rowwise copy (32-blocks along each row) and the columnwise one
// (32-blocks down each column) written as bfloat16 raw values into two [R, C] matrices, the
// columnwise scales as [R / 32, C]. The grouped GEMMs that read raw values take bfloat16
// operands along either axis, so the forward GEMM reads the columnwise copy along N: no copy is
// transposed and every store writes whole rows. (The transposed copy of `mxfp8_kernel` stored 32
// bytes a lane into rows 2 KiB apart, half L2 sectors a store instruction, which held the
// 64-expert weights' copy at ~3.2 TB/s with L2 92% busy: sessions 20-22.)
//
// A raw value is code x 2^(e - 127) for code = fp8(v x 2^(127 - e)) (jq::mxfp8_factors). Where
// v x 2^(127 - e) is a normal FP8 value (|v| >= 2^(e - 127 + emin), emin -6 for E4M3, -14 for
// E5M2) and the block is finite (e < 254), the power of two commutes with the rounding: the raw
// value is v rounded to the payload's mantissa bits, RNE, which for a bfloat16 v is an integer
// add and mask on its bits, the same in both directions (the block bounds |v x 2^(127 - e)| by
// the format's largest value, which needs no saturation). So one rounding of each value serves
// both copies. A row of a lane's values holding a value below its row's or a column's bound
// (zeros included), or in a block with e >= 254, takes the general path: the codes and their
// decode, as mxfp8_kernel computes them (mxfp8_codes, mxfp8_raw_words), bit for bit.
//
// No shared memory and no barrier (but the amax's): a warp holds a 32 x 64 block in registers,
// so a column block is the four lanes that share a column chunk and a row block the four lanes
// that share a row (xor shuffles).
//
// The rowwise (dgrad) copy need not be written at all (design decision 56): it equals the
// columnwise one except in general-path rows, and there only where the two blocks' exponents
// round a value differently. The kernel's kFlag form writes the columnwise copy and, for each
// warp's 32 x 64 block, 64 flag bits (8 bytes, one store a warp): bit 32 h + i for row i of the
// block's row block h (its columns 32 h ..), set where that row block's rowwise values differ
// from its columnwise ones (general_row computes both). Flag words in tile order (blockIdx.x)
// times 8 plus the warp. After the forward GEMM has read the columnwise copy,
// mxfp8_patch_rows_kernel rewrites the flagged row blocks of that copy in place with their
// rowwise values (the codes and their decode, which the rounding path equals where it serves):
// the result is kWrite's rowwise copy bit for bit. (A flag byte a row block beside each rowwise
// scale, session 30's first form, cost ~60 us at 64 experts: scattered one-byte stores.)
#pragma once

#include <type_traits>

#include "quantize/mxfp8.cuh"

namespace jqffi {
namespace {

// A CTA's tile is 128 x 128; warp w takes rows 32 (w / 2) .. and columns 64 (w % 2) .. of it.
// Lane q + 4k holds columns 8k .. 8k+7 of the warp's block at rows q + 4i (i < 8): the lanes of
// one k (xor 1, 2) cover a 32-row column block, the lanes k, k^1, k^2, k^3 of one row (xor 4, 8)
// a 32-column row block, and a warp's store writes four rows of 128 contiguous bytes.
struct XLayoutSlot {
  static constexpr int kRows = 8;  // rows a lane holds
  int64_t r0, c;                   // rows r0 + 4i, columns c .. c+7
  int q;
  __device__ __forceinline__ explicit XLayoutSlot(int64_t C) {
    const TileIndex t = tile_index(C, 128, 128);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    q = lane & 3;
    r0 = t.r0 + 32 * (warp >> 1) + q;
    c = t.c0 + 64 * (warp & 1) + 8 * (lane >> 2);
  }
  __device__ __forceinline__ int64_t row(int i) const { return r0 + 4 * i; }
};

// The payload format's constants for rounding bfloat16 bits: RNE to `bits` mantissa bits is
// (h + half - 1 + lsb) & mask, two values a word (no carry leaves a half: a finite bfloat16
// magnitude is at most 0x7F7F, a negative one 0xFF7F).
struct Fp8Grid {
  uint32_t lsb_shift, below_half, mask;
  int emin;  // the smallest normal exponent
  __device__ __forceinline__ explicit Fp8Grid(jq::Fp8 f)
      : lsb_shift(f == jq::Fp8::kE4M3 ? 4 : 5), below_half(f == jq::Fp8::kE4M3 ? 0x00070007u : 0x000F000Fu),
        mask(f == jq::Fp8::kE4M3 ? 0xFFF0FFF0u : 0xFFE0FFE0u), emin(f == jq::Fp8::kE4M3 ? -6 : -14) {}
  __device__ __forceinline__ uint32_t round2(uint32_t w) const {
    return (w + below_half + ((w >> lsb_shift) & 0x00010001u)) & mask;
  }
  // The smallest bfloat16 magnitude (bits) whose value times 2^(127 - e) is a normal FP8 value
  // (and a normal bfloat16): 2^(e - 127 + emin), as 15-bit magnitude bits.
  __device__ __forceinline__ uint32_t normal_bound(uint32_t e) const {
    return uint32_t(max(int(e) + emin, 1)) << 7;
  }
};

// |h| - 1 of both bfloat16 halves of w (magnitude bits, 0xFFFF for a zero), so that the least of
// them is below a bound - 1 exactly when a nonzero magnitude is below the bound: zeros round to
// zero in both paths and stay on the rounding one (a bfloat16 init holds ~1% exact zeros). Bit 15
// set in each half first, so the subtraction borrows within its half.
__device__ __forceinline__ uint32_t magnitude_less_one(uint32_t w) {
  return ((w | 0x80008000u) - 0x00010001u) ^ 0x80008000u;
}

__device__ __forceinline__ uint32_t lo16(uint32_t w) { return w & 0xFFFFu; }
__device__ __forceinline__ uint32_t hi16(uint32_t w) { return w >> 16; }

// The general path for one row of a lane's values (bfloat16 pairs w0 .. w3): their codes and
// raw values with the row block's exponent `row_e` and the 8 columns' `col_e0`, `col_e1` (bytes,
// column j in byte j % 4), stored at `row` and `col` (each when not null) as store_bf16_words
// stores (`n` values, 16-byte stores when `vec`). A column's codes are v x a x b with its
// factors (mxfp8_codes multiplies by b only at e = 254, where b != 1: the same products), NaN
// codes for a NaN column block (e = 255). Out of line: rare, and inlined into each of the 8
// rows it took ~60 registers more (126 in all). Returns whether the row's two raw copies differ.
__device__ __noinline__ bool general_row(uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3,
                                         uint32_t row_e, uint32_t col_e0, uint32_t col_e1, jq::Fp8 fmt,
                                         uint16_t* row, uint16_t* col, int n, bool vec_row, bool vec_col) {
  const uint32_t w[4] = {w0, w1, w2, w3}, col_e[2] = {col_e0, col_e1};
  float v[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = __uint_as_float((j % 2 ? w[j / 2] >> 16 : w[j / 2] & 0xFFFFu) << 16);
  uint32_t row_raw[4], col_raw[4];
  const bool e5m2 = fmt == jq::Fp8::kE5M2;
  uint32_t q[2];
  mxfp8_codes<8>(v, row_e, fmt, q);
  mxfp8_raw_words<2>(q, jq::decode_e8m0(row_e), e5m2, row_raw);
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    float u[4], scale[4];
    uint32_t nan = 0u;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t e = (col_e[k] >> (8 * j)) & 0xFFu;
      const jq::Mxfp8Factors f = jq::mxfp8_factors(e);
      u[j] = v[4 * k + j] * f.a * f.b;
      scale[j] = jq::decode_e8m0(e);
      if (e == 255u) nan |= 0xFFu << (8 * j);
    }
    uint32_t codes = jq::encode_fp8x4_not_nan(u[0], u[1], u[2], u[3], fmt);
    codes = (codes & ~nan) | (0x7F7F7F7Fu & nan);
    col_raw[2 * k] = mxfp8_raw_pair(codes, 0, scale[0], scale[1], e5m2);
    col_raw[2 * k + 1] = mxfp8_raw_pair(codes, 1, scale[2], scale[3], e5m2);
  }
  if (row != nullptr) store_bf16_words(row, row_raw, n, vec_row);
  if (col != nullptr) store_bf16_words(col, col_raw, n, vec_col);
  uint32_t differ = 0u;  // over the row's n values inside the matrix
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint32_t inside = (2 * k < n ? 0xFFFFu : 0u) | (2 * k + 1 < n ? 0xFFFF0000u : 0u);
    differ |= (row_raw[k] ^ col_raw[k]) & inside;
  }
  return differ != 0u;
}

// Expert weights in bfloat16 read directly (`Direct<BF16>`: row r of the matrix is row r of the
// weights); the columnwise copy and its scales in the layout above, the rowwise ones as
// mxfp8_kernel writes them. p.raw, p.do_col and R % 32 == 0 hold (the handler checks).
// Two CTAs a multiprocessor (120 registers, no spills): bounded to three it spilled 76 bytes and
// took 358 against 297 us on the 64-expert weights (Nsight Compute, H200, session 23).
//
// kFlag (decision 56): the rowwise values are not written (p.row unused); p.row_flags gets the
// warp's 64 flag bits.
template <typename P, bool kFlag = false>
__global__ void __launch_bounds__(kThreads, 2) mxfp8_x_layout_kernel(const Mxfp8Params p, const P prod) {
  static_assert(std::is_same_v<typename P::Out, BF16>, "bfloat16 weights (bit rounding)");
  __shared__ uint32_t red[kThreads / 32];
  const float inv_fmax = jq::inv_fmax_of(p.fmt);
  const Fp8Grid grid(p.fmt);
  const XLayoutSlot s(p.C);
  uint32_t w[XLayoutSlot::kRows][4];  // bfloat16 pairs, column 2k in the low half of word k
#pragma unroll
  for (int i = 0; i < XLayoutSlot::kRows; ++i) prod.load8(s.row(i), s.c, reinterpret_cast<BF16*>(w[i]));

  // Halves of columns past C are left out of the smallest magnitudes (they read as zeros).
  uint32_t outside[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    outside[k] = (s.c + 2 * k < p.C ? 0u : 0xFFFFu) | (s.c + 2 * k + 1 < p.C ? 0u : 0xFFFF0000u);
  }
  // Each column's largest magnitude over the block (this lane's rows, then the other three
  // lanes'), and its smallest nonzero one, less one, over this lane's rows inside the matrix.
  uint32_t col_max[4] = {0u, 0u, 0u, 0u}, col_min[4] = {~0u, ~0u, ~0u, ~0u};
#pragma unroll
  for (int i = 0; i < XLayoutSlot::kRows; ++i) {
    const bool inside = s.row(i) < p.R;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      col_max[k] = __vmaxu2(col_max[k], w[i][k] & 0x7FFF7FFFu);
      col_min[k] = __vminu2(col_min[k], inside ? magnitude_less_one(w[i][k]) | outside[k] : ~0u);
    }
  }
  uint32_t col_e[2] = {0u, 0u}, amax = 0;
  bool general_cols = false;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    uint32_t m = __vmaxu2(col_max[k], __shfl_xor_sync(0xFFFFFFFFu, col_max[k], 1));
    m = __vmaxu2(m, __shfl_xor_sync(0xFFFFFFFFu, m, 2));
    amax = max(amax, max(lo16(m), hi16(m)));
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t mag = h ? hi16(m) : lo16(m), least = h ? hi16(col_min[k]) : lo16(col_min[k]);
      const uint32_t e = jq::e8m0_from_amax(__uint_as_float(mag << 16), inv_fmax);
      col_e[k / 2] |= e << (8 * (2 * (k % 2) + h));
      general_cols |= e >= 254u || least < grid.normal_bound(e) - 1;
    }
  }
  const bool in_cols = s.c < p.C;
  const int n = int(min64(8, p.C - s.c));
  const int64_t block_row = (s.r0 - s.q) / 32;
  if (s.q == 0 && in_cols && block_row * 32 < p.R) {
    store_bytes8(p.col_scale + block_row * p.C + s.c, col_e[0], col_e[1], n, p.vec_col);
  }

  // This lane's first row in each output; row i is 4i rows on (pointer steps, not 64-bit
  // products a row).
  const int64_t first = s.r0 * p.C + s.c, step = 4 * p.C, scale_step = 4 * ((p.C + 31) / 32);
  uint16_t* row_at = reinterpret_cast<uint16_t*>(p.row) + first;
  uint16_t* col_at = reinterpret_cast<uint16_t*>(p.col) + first;
  uint8_t* row_scale_at = p.row_scale + s.r0 * ((p.C + 31) / 32) + s.c / 32;
  uint32_t differ = 0u;  // kFlag: bit i for row i of this lane on the general path, its copies apart
#pragma unroll
  for (int i = 0; i < XLayoutSlot::kRows; ++i, row_at += step, col_at += step, row_scale_at += scale_step) {
    // The row block's largest magnitude (this lane's 8 values, then its three neighbours').
    const uint32_t m2 = __vmaxu2(__vmaxu2(w[i][0] & 0x7FFF7FFFu, w[i][1] & 0x7FFF7FFFu),
                                 __vmaxu2(w[i][2] & 0x7FFF7FFFu, w[i][3] & 0x7FFF7FFFu));
    uint32_t m = max(lo16(m2), hi16(m2));
    m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, 4));
    m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, 8));
    const int64_t r = s.row(i);
    if (r >= p.R || !in_cols) continue;
    const uint32_t row_e = jq::e8m0_from_amax(__uint_as_float(m << 16), inv_fmax);
    if (p.do_row && (threadIdx.x & 12) == 0) *row_scale_at = uint8_t(row_e);  // k % 4 == 0
    uint32_t least2 = ~0u;
#pragma unroll
    for (int k = 0; k < 4; ++k) least2 = __vminu2(least2, magnitude_less_one(w[i][k]) | outside[k]);
    const uint32_t least = min(lo16(least2), hi16(least2));
    uint16_t* row = (!kFlag && p.do_row) ? row_at : nullptr;
    uint16_t* col = col_at;
    if (!general_cols && row_e < 254u && least >= grid.normal_bound(row_e) - 1) {
      uint32_t raw[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) raw[k] = grid.round2(w[i][k]);
      if (row != nullptr) store_bf16_words(row, raw, n, p.vec_row);
      store_bf16_words(col, raw, n, p.vec_col);
    } else if (general_row(w[i][0], w[i][1], w[i][2], w[i][3], row_e, col_e[0], col_e[1], p.fmt, row, col, n,
                           p.vec_row, p.vec_col)) {
      differ |= 1u << i;
    }
  }
  if constexpr (kFlag) {
    // A row block's flag is its four lanes' bits (xor 4, 8); lanes 0..3 (q, k = 0) then hold row
    // block 0's rows q + 4i, lanes 16..19 (k = 4) row block 1's.
    differ |= __shfl_xor_sync(0xFFFFFFFFu, differ, 4);
    differ |= __shfl_xor_sync(0xFFFFFFFFu, differ, 8);
    uint32_t lo = 0u, hi = 0u;
#pragma unroll
    for (int i = 0; i < XLayoutSlot::kRows; ++i) {
      const uint32_t b = __ballot_sync(0xFFFFFFFFu, (differ >> i) & 1u);
      lo |= (b & 0xFu) << (4 * i);
      hi |= ((b >> 16) & 0xFu) << (4 * i);
    }
    if ((threadIdx.x & 31) == 0) {
      reinterpret_cast<uint2*>(p.row_flags)[blockIdx.x * 8u + (threadIdx.x >> 5)] = make_uint2(lo, hi);
    }
  }
  if (p.amax) {
    const uint32_t t = cta_max(amax << 16, red);
    if (threadIdx.x == 0) atomic_max_float(p.amax, t);
  }
}

// Row block (r, columns c0 ..) of bfloat16 weights w [R, C] as its rowwise raw values into out:
// the codes of its 32 values with their block's exponent, decoded, as general_row writes them.
__device__ __forceinline__ void patch_row_block(const uint16_t* __restrict__ w, uint16_t* out, int64_t R,
                                                int64_t C, int64_t r, int64_t c0, jq::Fp8 fmt) {
  const bool vec = C % 8 == 0;
  BF16 v[32];
#pragma unroll
  for (int k = 0; k < 4; ++k) load8(reinterpret_cast<const BF16*>(w), R, C, r, c0 + 8 * k, vec, v + 8 * k);
  uint32_t m = 0u;  // the largest magnitude's bits (NaN above infinity, as the kernels take it)
#pragma unroll
  for (int k = 0; k < 32; ++k) m = max(m, uint32_t(v[k].u) & 0x7FFFu);
  const uint32_t e = jq::e8m0_from_amax(__uint_as_float(m << 16), jq::inv_fmax_of(fmt));
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    float x[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = __uint_as_float(uint32_t(v[8 * k + i].u) << 16);
    uint32_t q[2], raw[4];
    mxfp8_codes<8>(x, e, fmt, q);
    mxfp8_raw_words<2>(q, jq::decode_e8m0(e), fmt == jq::Fp8::kE5M2, raw);
    const int64_t c = c0 + 8 * k;
    if (c < C) store_bf16_words(out + r * C + c, raw, int(min64(8, C - c)), vec);
  }
}

// The rowwise copy written over the columnwise one (decision 56): `out` [R, C] holds the
// columnwise copy in the weights' layout; each row block flagged by the x-layout kernel's kFlag
// form (`flags`: 64 bits a 32 x 64 warp block) gets its rowwise values. A thread a warp block,
// grid-stride; set flags are rare.
__global__ void __launch_bounds__(kThreads) mxfp8_patch_rows_kernel(const uint16_t* __restrict__ w,
                                                                    const uint2* __restrict__ flags,
                                                                    uint16_t* out, int64_t R, int64_t C,
                                                                    jq::Fp8 fmt) {
  const uint32_t tile_cols = uint32_t((C + 127) / 128);
  const int64_t blocks = ((R + 127) / 128) * int64_t(tile_cols) * 8;
  for (int64_t b = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; b < blocks;
       b += int64_t(gridDim.x) * blockDim.x) {
    const uint2 f = __ldg(flags + b);
    if ((f.x | f.y) == 0u) continue;
    const uint32_t tile = uint32_t(b / 8), warp = uint32_t(b % 8), tile_row = tile / tile_cols;
    const int64_t r0 = int64_t(tile_row) * 128 + 32 * (warp >> 1);
    const int64_t c0 = int64_t(tile - tile_row * tile_cols) * 128 + 64 * (warp & 1);
    for (int h = 0; h < 2; ++h) {
      for (uint32_t bits = h ? f.y : f.x; bits != 0u; bits &= bits - 1u) {
        patch_row_block(w, out, R, C, r0 + __ffs(bits) - 1, c0 + 32 * h, fmt);
      }
    }
  }
}

}  // namespace
}  // namespace jqffi
