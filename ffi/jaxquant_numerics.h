// jaxquant numerics: the scalar and block math of docs/design.md §5 "Numerics", host and device.
//
// This is the one C++ copy of the formulas in jaxquant/numerics/*.py (the spec); the CPU
// handlers and the CUDA kernels both include it, and the tests compare both bit-for-bit with
// the Python reference. Every function mirrors the Python one named in its comment.
//
// Floating-point environment: the CPU side is compiled with -ffp-contract=off and the CUDA side
// with -fmad=false (no FMA contraction), no fast-math, FTZ off on the device. On the host the
// handlers inherit XLA:CPU's MXCSR (FTZ+DAZ on), exactly like the reference they are compared
// with; see ffi/NOTES.md.
//
// Two encoders have a faster exact form (checked against the spec form exhaustively over all
// 2^32 float32 inputs by the `jaxquant_debug_encoder_mismatches` target):
//   * E4M3/E5M2 on the device use the hardware `cvt.rn.satfinite.{e4m3,e5m2}x2.f32` (sm_89+),
//     with NaN canonicalized to the spec's code 0x7F;
//   * E2M1 is the smallest of three one-add roundings (e2m1_magnitude_code), host and device.
#pragma once

#include <stdint.h>

#include <cmath>
#include <string.h>  // memcpy, host and device

#if defined(__CUDACC__)
#define JQ_HD __host__ __device__ __forceinline__
#include <cuda_fp8.h>
#else
#define JQ_HD inline
#endif

namespace jq {

// ---------------------------------------------------------------------------------------------
// Bits and NaN-propagating min/max (jnp.minimum / jnp.maximum semantics).
// ---------------------------------------------------------------------------------------------

// The bits of `from` as a `To` of the same size (C++20's std::bit_cast); a register move on the
// device, where memcpy of a local is lowered to one.
template <typename To, typename From>
JQ_HD To bit_cast(From from) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast between types of one size");
  To to;
  memcpy(&to, &from, sizeof(To));
  return to;
}

JQ_HD uint32_t bits_of(float x) { return bit_cast<uint32_t>(x); }

JQ_HD float float_of(uint32_t u) { return bit_cast<float>(u); }

// IEEE half bits -> float32, built from bits (exact; a half subnormal m * 2^-24 is a float32
// normal, so no denormal flushing can touch it). The CPU handlers read float16 inputs with it.
JQ_HD float f16_bits_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  if (e == 0x1F) return float_of(sign | 0x7F800000u | (m << 13));
  if (e != 0) return float_of(sign | ((e - 15 + 127) << 23) | (m << 13));
  if (m == 0) return float_of(sign);
  int shift = 0;
  uint32_t mm = m;
  while (!(mm & 0x400u)) { mm <<= 1; ++shift; }
  return float_of(sign | static_cast<uint32_t>(127 - 15 - shift + 1) << 23 | ((mm & 0x3FFu) << 13));
}

JQ_HD bool is_nan(float x) { return (bits_of(x) & 0x7FFFFFFFu) > 0x7F800000u; }
JQ_HD bool is_inf(float x) { return (bits_of(x) & 0x7FFFFFFFu) == 0x7F800000u; }
JQ_HD float abs_f(float x) { return float_of(bits_of(x) & 0x7FFFFFFFu); }
JQ_HD float min_prop(float a, float b) { return is_nan(a) ? a : (is_nan(b) ? b : (b < a ? b : a)); }
JQ_HD float max_prop(float a, float b) { return is_nan(a) ? a : (is_nan(b) ? b : (b > a ? b : a)); }
JQ_HD int max_i(int a, int b) { return a > b ? a : b; }
JQ_HD uint32_t min_u(uint32_t a, uint32_t b) { return a < b ? a : b; }
JQ_HD uint32_t max_u(uint32_t a, uint32_t b) { return a > b ? a : b; }

// Round half to even (jnp.round) of a non-negative x < 2^22 (every caller scales a magnitude
// onto a small integer grid). On the host, adding and subtracting 2^23 rounds exactly that way
// in the (round-to-nearest) mode XLA runs in, without libm's slow nearbyintf; NaN stays NaN.
JQ_HD float rint_nonneg(float x) {
#if defined(__CUDA_ARCH__)
  return rintf(x);
#else
  const float shifted = x + 8388608.0f;  // IEEE semantics: the compiler may not fold this
  return shifted - 8388608.0f;
#endif
}

// floor of a non-negative, non-NaN x < 2^31.
JQ_HD float floor_nonneg(float x) {
#if defined(__CUDA_ARCH__)
  return floorf(x);
#else
  return static_cast<float>(static_cast<int32_t>(x));
#endif
}

// IEEE float32 division, correctly rounded (jaxquant/numerics/division.py). The reference does
// it with integer long division because XLA:GPU's own f32 divide is approximate (div.full /
// rcp.approx). The device uses the IEEE instructions (no FTZ); the host uses the same integer
// routine as the reference, so flush-to-zero / denormals-are-zero on XLA:CPU's threads cannot
// change a scale.
JQ_HD void normalize_f32(uint32_t abs_bits, uint32_t* mantissa, int32_t* exponent) {
  int32_t e = static_cast<int32_t>((abs_bits >> 23) & 0xFF);
  uint32_t fraction = abs_bits & 0x7FFFFFu;
  if (e == 0) {
    int32_t shift = 0;
    while (fraction != 0 && (fraction & 0x800000u) == 0) { fraction <<= 1; ++shift; }
    *mantissa = fraction;
    *exponent = 1 - shift;
  } else {
    *mantissa = fraction | 0x800000u;
    *exponent = e;
  }
}

JQ_HD float ieee_div_host(float a, float b) {
  const uint32_t a_bits = bits_of(a), b_bits = bits_of(b);
  const uint32_t sign = (a_bits ^ b_bits) & 0x80000000u;
  const uint32_t a_abs = a_bits & 0x7FFFFFFFu, b_abs = b_bits & 0x7FFFFFFFu;
  const uint32_t inf = 0x7F800000u;
  if (a_abs > inf || b_abs > inf || (a_abs == 0 && b_abs == 0) || (a_abs == inf && b_abs == inf))
    return float_of(0x7FC00000u);
  if (a_abs == 0 || b_abs == inf) return float_of(sign);
  if (a_abs == inf || b_abs == 0) return float_of(sign | inf);
  uint32_t a_mant, b_mant;
  int32_t a_exp, b_exp;
  normalize_f32(a_abs, &a_mant, &a_exp);
  normalize_f32(b_abs, &b_mant, &b_exp);
  int32_t exponent = a_exp - b_exp + 127;
  uint32_t remainder = a_mant;
  if (a_mant < b_mant) { remainder <<= 1; --exponent; }
  uint32_t quotient = 0;
  for (int i = 0; i < 25; ++i) {  // 24 mantissa bits and a guard bit
    const bool take = remainder >= b_mant;
    quotient = (quotient << 1) | (take ? 1u : 0u);
    remainder = (take ? remainder - b_mant : remainder) << 1;
  }
  const bool sticky = remainder != 0;
  int32_t drop_i = 2 - exponent;
  drop_i = drop_i < 1 ? 1 : (drop_i > 31 ? 31 : drop_i);
  const uint32_t drop = static_cast<uint32_t>(drop_i);
  uint32_t kept = quotient >> drop;
  const uint32_t dropped = quotient & ((1u << drop) - 1u);
  const uint32_t half = 1u << (drop - 1u);
  if (dropped > half || (dropped == half && (sticky || (kept & 1u)))) ++kept;
  if (exponent < 1) return float_of(sign | kept);  // subnormal (a carry makes it the min normal)
  const uint32_t normal_bits = (static_cast<uint32_t>(exponent - 1) << 23) + kept;
  if (exponent >= 255 || normal_bits >= inf) return float_of(sign | inf);
  return float_of(sign | normal_bits);
}

JQ_HD float div_f32(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return ieee_div_host(a, b);
#endif
}

JQ_HD float rcp_f32(float b) {
#if defined(__CUDA_ARCH__)
  return __frcp_rn(b);
#else
  return ieee_div_host(1.0f, b);
#endif
}

// a * p + c for a power of two p whose product with a is exact (or overflows, or is a subnormal
// that c absorbs): one rounding either way, so the device's single FFMA (which -fmad=false would
// not contract) gives the host's multiply-then-add bits.
JQ_HD float mul_pow2_add(float a, float p, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, p, c);
#else
  return a * p + c;
#endif
}

// |x| as ordered bits: for non-negative floats the uint32 order is the float order, and every
// NaN pattern is above +inf, so a max over these bits is a NaN-propagating amax.
JQ_HD uint32_t abs_bits(float x) { return bits_of(x) & 0x7FFFFFFFu; }

constexpr float kFltMax = 0x1.fffffep+127f;
constexpr float kOneSixth = 0x1.555556p-3f;  // jnp.float32(1.0 / 6.0)
constexpr float kNvfp4GlobalNumerator = 2688.0f;  // 448 * 6

// minifloat._pow2: 2^k for k in the normal range [-126, 127].
JQ_HD float pow2_normal(int k) { return float_of(static_cast<uint32_t>(k + 127) << 23); }

// scales.exp2i: 2^k for k in [-149, 127], subnormals included.
JQ_HD float exp2i(int k) {
  if (k >= -126) return float_of(static_cast<uint32_t>(k + 127) << 23);
  int s = k + 149;
  s = s < 0 ? 0 : (s > 22 ? 22 : s);
  return float_of(1u << s);
}

// ---------------------------------------------------------------------------------------------
// Minifloat formats (minifloat.MinifloatSpec).
// ---------------------------------------------------------------------------------------------

struct Spec {
  int mbits, emin, bias;
  float fmax;
  uint32_t nan_code, sign_bit;
};

// Functions rather than globals, so device code can use them without device symbols.
JQ_HD constexpr Spec e4m3() { return Spec{3, -6, 7, 448.0f, 0x7Fu, 0x80u}; }
JQ_HD constexpr Spec e5m2() { return Spec{2, -14, 15, 57344.0f, 0x7Fu, 0x80u}; }
JQ_HD constexpr Spec e2m1() { return Spec{1, 0, 1, 6.0f, 0x7u, 0x8u}; }

enum class Fp8 : int { kE4M3 = 0, kE5M2 = 1 };

JQ_HD Spec spec_of(Fp8 f) { return f == Fp8::kE4M3 ? e4m3() : e5m2(); }

// minifloat._code_from_magnitude: code of the on-grid magnitude `mag` with the sign of `v`.
JQ_HD uint32_t code_from_magnitude(float v, float mag, Spec s) {
  // Written without branches (selects only), so host loops vectorize.
  const uint32_t mag_bits = bits_of(mag);
  const int mag_exp = static_cast<int>((mag_bits >> 23) & 0xFFu) - 127;
  const uint32_t normal_code = (static_cast<uint32_t>(mag_exp + s.bias) << s.mbits) |
                               ((mag_bits >> (23 - s.mbits)) & ((1u << s.mbits) - 1u));
  // Subnormal (and zero) codes count quanta of 2^(emin - mbits): an exact small integer.
  const bool subnormal = mag < pow2_normal(s.emin);  // false for NaN
  const float quanta = subnormal ? mag * pow2_normal(s.mbits - s.emin) : 0.0f;
  uint32_t code = subnormal ? static_cast<uint32_t>(static_cast<int32_t>(quanta)) : normal_code;
  code |= (bits_of(v) >> 31) * s.sign_bit;
  code = is_nan(v) ? s.nan_code : code;
  return code & 0xFFu;
}

// minifloat.encode (round_to_grid + code): RNE, saturating, NaN -> nan_code. The spec form.
JQ_HD uint32_t encode_spec(float v, Spec s) {
  const float a = min_prop(abs_f(v), 2.0f * s.fmax);
  const int exponent = static_cast<int>((bits_of(a) >> 23) & 0xFFu) - 127;
  const int quantum_exp = max_i(exponent, s.emin) - s.mbits;
  const float steps = rint_nonneg(a * pow2_normal(-quantum_exp));
  const float rounded = steps * pow2_normal(quantum_exp);
  return code_from_magnitude(v, min_prop(rounded, s.fmax), s);
}

// E2M1 magnitude code of |a| rounded half-to-even onto {0, .5, 1, 1.5, 2, 3, 4, 6}, saturating
// (a >= 0 or NaN; NaN and inf give 7, the caller maps NaN to 0x7). The code is piecewise linear
// in the rounded value r: 2r on [0, 2], r + 2 on [2, 4], r / 2 + 4 on [4, 6], and the smallest
// of the three everywhere (the pieces are concave), so it is the smallest of rne(2a), rne(a) + 2,
// rne(a / 2) + 4 and 7 (rounding is monotone and commutes with adding an even integer). Each
// term is one float32 add of 2^23 + c, which rounds to an integer half to even in the low
// mantissa bits; the minimum of the bit patterns is taken as integers (NaN and inf patterns
// are above every finite one). Two adds and two multiplies by exact powers of two instead of
// a compare-and-select ladder: the quantize kernels spent most of their integer pipe there.
JQ_HD uint32_t e2m1_magnitude_code(float a) {
  constexpr float kRound = 8388608.0f;  // 2^23: t + 2^23 holds rne(t) in its mantissa, 0 <= t < 2^23
  const uint32_t t1 = bits_of(mul_pow2_add(a, 2.0f, kRound));
  const uint32_t t2 = bits_of(a + (kRound + 2.0f));
  const uint32_t t3 = bits_of(mul_pow2_add(a, 0.5f, kRound + 4.0f));
  return min_u(min_u(t1, t2), min_u(t3, bits_of(kRound + 7.0f))) - bits_of(kRound);
}

// encode(v, E2M1), fast exact form.
JQ_HD uint32_t encode_e2m1(float v) {
  if (is_nan(v)) return 0x7u;
  return e2m1_magnitude_code(abs_f(v)) | ((bits_of(v) >> 31) << 3);
}

// minifloat.encode_stochastic for E2M1: round |v| (clamped to fmax) up to the next grid value
// when u < (|v| - lo) / quantum.
// In the binade e = max(exponent(|v|), 0) (0, 1 or 2 below the clamp at 6) the quantum is
// 2^(e - 1) and t = |v| / quantum lies in [0, 4); lo = floor(t) quantum and frac = t - floor(t)
// (exact). The E2M1 codes are monotone on the grid and lo's code is floor(t) + 2e (codes 0-3 in
// [0, 2), 4-5 in [2, 4), 6-7 in [4, 6]), so the code is floor(t) + 2e, plus one when rounding up
// (to the next grid value; at 6, frac is 0).
JQ_HD uint32_t encode_e2m1_stochastic(float v, float u) {
  if (is_nan(v)) return 0x7u;
  const float a = min_prop(abs_f(v), 6.0f);
  const int e = max_i(static_cast<int>(bits_of(a) >> 23) - 127, 0);  // E2M1: emin 0
  const float t = a * pow2_normal(1 - e);
  const float steps = floor_nonneg(t);
  const uint32_t up = u < t - steps ? 1u : 0u;
  const uint32_t code =
      bits_of(steps + 8388608.0f) - bits_of(8388608.0f) + 2u * static_cast<uint32_t>(e) + up;
  return code | ((bits_of(v) >> 31) << 3);
}

// encode(v, E4M3 | E5M2) for one value (host: spec form; device: hardware cvt).
JQ_HD uint32_t encode_fp8(float v, Fp8 f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  const __nv_fp8_interpretation_t kind = f == Fp8::kE4M3 ? __NV_E4M3 : __NV_E5M2;
  uint32_t code = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, kind);
  return is_nan(v) ? 0x7Fu : code;
#else
  return encode_spec(v, spec_of(f));
#endif
}

#if defined(__CUDACC__)
// Four FP8 codes packed little-endian (v0 in the low byte) of four values none of which is NaN
// (the caller knows, e.g. MXFP8 scales a finite or infinite block by a finite factor and writes
// a NaN block's codes itself): two hardware conversions; satfinite gives every non-NaN input
// its code.
__device__ __forceinline__ uint32_t encode_fp8x4_not_nan(float v0, float v1, float v2, float v3,
                                                         Fp8 f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  const __nv_fp8_interpretation_t kind = f == Fp8::kE4M3 ? __NV_E4M3 : __NV_E5M2;
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(v0, v1), __NV_SATFINITE, kind);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(v2, v3), __NV_SATFINITE, kind);
  return lo | (hi << 16);
#else
  return encode_fp8(v0, f) | (encode_fp8(v1, f) << 8) | (encode_fp8(v2, f) << 16) |
         (encode_fp8(v3, f) << 24);
#endif
}

// Four codes of encode_fp8x4_not_nan with each NaN code made the canonical x7F: a SIMD
// canonicalization (satfinite never yields a NaN code for a non-NaN input: E4M3 NaN is x7F,
// E5M2 NaNs are x7D..x7F). Kernels that know a block holds no NaN (its amax is not NaN) skip it.
__device__ __forceinline__ uint32_t canonical_nan_fp8x4(uint32_t code, Fp8 f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  const uint32_t mag = code & 0x7F7F7F7Fu;
  const uint32_t limit = f == Fp8::kE4M3 ? 0x7E7E7E7Eu : 0x7C7C7C7Cu;
  const uint32_t nan_mask = __vcmpgtu4(mag, limit);  // 0xFF in each NaN byte
  return (code & ~nan_mask) | (0x7F7F7F7Fu & nan_mask);
#else
  return code;  // encode_fp8 writes NaN's canonical code itself
#endif
}

// The same for any four values, device fast path: the conversions, then the NaN codes made
// canonical.
__device__ __forceinline__ uint32_t encode_fp8x4(float v0, float v1, float v2, float v3,
                                                 Fp8 f) {
  return canonical_nan_fp8x4(encode_fp8x4_not_nan(v0, v1, v2, v3, f), f);
}
#endif

// Exact float32 value of an E4M3 code (XLA's f8e4m3fn -> f32 conversion), without branches
// (the NVFP4 kernels decode a block scale per 16 values): exponent field e >= 1 is the float
// with bits (e + 120) << 23 | m << 20, i.e. ((code & 0x7F) << 20) + (120 << 23); a subnormal
// code (e = 0) is m 2^-9 = (1 + m / 8) 2^-6 - 2^-6, both terms and the difference exact.
JQ_HD float decode_e4m3(uint32_t code) {
  const uint32_t em = code & 0x7Fu, sign = (code & 0x80u) << 24;
  const bool subnormal = em < 8u;
  const float mag =
      float_of((em << 20) + ((subnormal ? 121u : 120u) << 23)) - (subnormal ? 0x1p-6f : 0.0f);
  return float_of((em == 0x7Fu ? 0x7FC00000u : bits_of(mag)) | sign);
}

// Exact float32 value of an E2M1 code (low 4 bits; XLA's f4e2m1fn -> f32 conversion):
// magnitude code m = 2e + mantissa is 2^(e-1) (1 + mantissa / 2) for e > 0, mantissa / 2 for
// e == 0, built as float32 bits (no table: a table indexed per element spills on the device).
JQ_HD float decode_e2m1(uint32_t code) {
  const uint32_t m = code & 7u, e = m >> 1, mantissa = m & 1u;
  const uint32_t normal = ((e + 126u) << 23) | (mantissa << 22);
  const uint32_t magnitude = e ? normal : mantissa * 0x3F000000u;  // 0.5 or 0
  return float_of(magnitude | ((code & 8u) << 28));
}

// Exact float32 value of an E5M2 code (the high byte of a float16).
JQ_HD float decode_e5m2(uint32_t code) {
  const uint32_t sign = (code >> 7) & 1u, e = (code >> 2) & 0x1Fu, m = code & 3u;
  float mag;
  if (e == 0x1Fu) {
    mag = m ? float_of(0x7FC00000u) : float_of(0x7F800000u);
  } else if (e == 0) {
    mag = static_cast<float>(m) * 0x1p-16f;
  } else {
    mag = float_of(((e - 15u + 127u) << 23) | (m << 21));
  }
  return sign ? -mag : mag;
}

// scales.e8m0_decode_exponent: 2^(e - 127) (subnormal for e = 0), NaN for e = 255.
JQ_HD float decode_e8m0(uint32_t e) { return e == 255u ? float_of(0x7FC00000u) : exp2i(int(e) - 127); }

// MXFP8's raw value (formats.mxfp8.dequantize_raw): decode(code) * 2^(e - 127) in float32 (one
// rounding, below 2^-126 only).
JQ_HD float mxfp8_raw(float value, float block_scale) { return value * block_scale; }

// NVFP4's raw value (minifloat.decode(code) * decode(scale), formats.nvfp4.dequantize_raw):
// exact in float32 and in bfloat16 (at most 6 significant bits, magnitudes 2^-10 .. 2688).
JQ_HD float nvfp4_raw(uint32_t code, float block_scale) { return decode_e2m1(code) * block_scale; }

// ---------------------------------------------------------------------------------------------
// Scales (scales.py).
// ---------------------------------------------------------------------------------------------

// scales.scale_from_amax (per-tensor current scaling, Float8Block).
JQ_HD float scale_from_amax(float amax, float fmax, bool pow2_scale, float amax_epsilon) {
  const float a = max_prop(amax, amax_epsilon);
  float scale = div_f32(fmax, a);
  if (is_inf(scale)) scale = kFltMax;
  if (a == 0.0f || is_inf(a) || is_nan(a)) scale = 1.0f;
  if (pow2_scale) scale = float_of(bits_of(scale) & 0xFF800000u);
  return scale;
}

// state.py's delayed-scaling scale from an amax `a`: `fmax / a / 2^margin` clamped to FLT_MAX
// where `a` is finite and > 0, else `fallback` (1 for the just-in-time first scale, the stored
// scale in the update). The division by 2^margin is skipped at margin 0 (exact either way).
// "Finite and > 0" is read off the bits: a float compare would see a subnormal amax as 0 under
// the CPU handlers' inherited DAZ, where XLA's compare does not.
JQ_HD bool is_zero(float x) { return (bits_of(x) & 0x7FFFFFFFu) == 0; }

JQ_HD float delayed_scale(float a, float fmax, int32_t margin, float fallback) {
  const uint32_t b = bits_of(a);
  if ((b >> 31) != 0 || b == 0 || (b & 0x7F800000u) == 0x7F800000u) return fallback;
  float scale = div_f32(fmax, a);
  if (margin != 0) scale = div_f32(scale, float_of(uint32_t(127 + (margin < 128 ? margin : 128)) << 23));
  return scale > kFltMax ? kFltMax : scale;
}

// The scale of a per-tensor FP8 quantize (jaxquant_quantize_fp8[_delayed]): the stored scale `s`
// (delayed) or scale_from_amax of the amax `s` (current); with the just-in-time first scale
// (`first_amax` not null), delayed_scale(*first_amax, fmax, margin, 1) where the stored one is 0.
JQ_HD float fp8_tensor_scale(float s, bool delayed, float fmax, bool pow2_scale, float amax_epsilon,
                             const float* first_amax, int32_t margin) {
  float scale = delayed ? s : scale_from_amax(s, fmax, pow2_scale, amax_epsilon);
  if (first_amax != nullptr && is_zero(scale)) scale = delayed_scale(*first_amax, fmax, margin, 1.0f);
  return scale;
}

// scales.e8m0_from_amax: MXFP8 biased block exponent in [0, 255]. `inv_fmax` = float32(1/fmax).
// With b = |s|'s bits, b + 0x7FFFFF carries into the exponent field exactly when the mantissa is
// not 0, so (b + 0x7FFFFF) >> 23 is exponent + (mantissa != 0): 0 for 0, 1 for a subnormal, 255
// for infinity and for finite s above 2^127 (both capped to 254); NaN is 255. `s == 0` also
// holds for a subnormal s where the host flushes it (the CPU handlers' inherited DAZ): e = 0
// there, as XLA:CPU.
JQ_HD uint32_t e8m0_from_amax(float block_amax, float inv_fmax) {
  const float s = block_amax * inv_fmax;
  const uint32_t b = bits_of(s) & 0x7FFFFFFFu;
  const uint32_t e = b > 0x7F800000u ? 255u : min_u((b + 0x7FFFFFu) >> 23, 254u);
  return s == 0.0f ? 0u : e;
}

constexpr float kInvFmaxE4M3 = 0x1.24924ap-9f;   // jnp.float32(1 / 448)
constexpr float kInvFmaxE5M2 = 0x1.24924ap-16f;  // jnp.float32(1 / 57344)

JQ_HD float inv_fmax_of(Fp8 f) { return f == Fp8::kE4M3 ? kInvFmaxE4M3 : kInvFmaxE5M2; }

// MXFP8 applies 2^(127 - e) before the cast as two normal power-of-two factors, x * a * b
// (formats/mxfp8.py): a single 2^-127 (e = 254) would be subnormal, which flush-to-zero backends
// turn into 0. (e == 255 gives a NaN payload, handled by the caller.)
struct Mxfp8Factors {
  float a, b;
};

// With k = 127 - min(e, 254) in [-127, 127]: a = 2^max(k, -126) and b = 2^min(k + 126, 0),
// both normal, so each is its bits (exp2i's subnormal branch never runs): b is 1 except at
// e = 254 (b = 1/2), where the product a * b = 2^-127 would be the subnormal.
JQ_HD Mxfp8Factors mxfp8_factors(uint32_t e) {
  const uint32_t ec = min_u(e, 254u);
  return {pow2_normal(ec == 254u ? -126 : 127 - static_cast<int>(ec)), ec == 254u ? 0.5f : 1.0f};
}

// scales.nvfp4_global_encode_scale: S_enc.
JQ_HD float nvfp4_global_encode_scale(float amax_g) {
  const float s_enc = min_prop(div_f32(kNvfp4GlobalNumerator, amax_g), kFltMax);
  return (amax_g == 0.0f || s_enc == 0.0f) ? 1.0f : s_enc;
}

// scales.nvfp4_block_decode_scale: the E4M3 code of S_dec_b.
JQ_HD uint32_t nvfp4_block_decode_code(float block_amax, float s_enc) {
  return encode_fp8(block_amax * (s_enc * kOneSixth), Fp8::kE4M3);
}

// scales.nvfp4_block_encode_scale: S_enc_b from the decoded S_dec_b.
JQ_HD float nvfp4_block_encode_scale(float s_dec_b, float s_enc) {
  const float inv = rcp_f32(s_dec_b * rcp_f32(s_enc));
  return s_dec_b == 0.0f ? 0.0f : min_prop(inv, kFltMax);
}

// ---------------------------------------------------------------------------------------------
// Random Hadamard transform (hadamard.rht16) and stochastic-rounding bits (random_bits.py).
// ---------------------------------------------------------------------------------------------

// diag(RHT_SIGNS) as a sign mask: bit i set where the sign is -1.
constexpr uint32_t kRhtNegativeMask = (1u << 3) | (1u << 5) | (1u << 6) | (1u << 7) | (1u << 8) |
                                      (1u << 9) | (1u << 10) | (1u << 12) | (1u << 14) |
                                      (1u << 15);

// v <- (v * signs) @ H16 * 0.25, butterfly stages h = 1, 2, 4, 8 with pairs (a + b, a - b).
JQ_HD void rht16(float* v) {
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    if ((kRhtNegativeMask >> i) & 1u) v[i] = -v[i];  // x * -1 is exact
  }
#pragma unroll
  for (int h = 1; h < 16; h *= 2) {
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      if ((i & h) == 0) {
        const float a = v[i], b = v[i + h];
        v[i] = a + b;
        v[i + h] = a - b;
      }
    }
  }
#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] = v[i] * 0.25f;
}

JQ_HD uint32_t lowbias32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

// The per-row half of random_bits.stochastic_round_bits: mix(row * 0x9E3779B9 + k0).
JQ_HD uint32_t sr_row_hash(uint32_t k0, uint32_t row) { return lowbias32(row * 0x9E3779B9u + k0); }

// The uniform draw in [0, 1) of element (row, col), given its row hash.
JQ_HD float sr_uniform(uint32_t row_hash, uint32_t k1, uint32_t col) {
  const uint32_t h = lowbias32(row_hash ^ (col * 0x85EBCA6Bu + k1));
  return static_cast<float>(h >> 8) * 0x1p-24f;
}

// ---------------------------------------------------------------------------------------------
// Fused producers (ffi/fused): normalization and activation values, in the exact float32 order
// of jaxquant/numerics/{exact,reductions,normalization,activations}.py.
//
// Compiled without FMA contraction on both sides, so every product below rounds on its own;
// `mul_rn` marks the products that feed an addition, where the pure-JAX spec adds a run-time
// zero to stop XLA's contraction (the value is the same: `a * b`, a product of -0 gives +0).
// ---------------------------------------------------------------------------------------------

JQ_HD float mul_rn(float a, float b) { return a * b + 0.0f; }

// exact.ieee_sqrt: correctly rounded square root from integer operations (host), so XLA:CPU's
// flush-to-zero mode cannot touch it; the device uses the IEEE instruction (-ftz=false).
JQ_HD float sqrt_host(float x) {
  const uint32_t bits = bits_of(x), magnitude = bits & 0x7FFFFFFFu, inf = 0x7F800000u;
  if (magnitude > inf || ((bits >> 31) && magnitude != 0)) return float_of(0x7FC00000u);
  if (magnitude == inf || magnitude == 0) return x;
  uint32_t mantissa;
  int32_t exponent;
  normalize_f32(magnitude, &mantissa, &exponent);
  int32_t unbiased = exponent - 127;
  const bool odd = (unbiased & 1) != 0;
  if (odd) mantissa <<= 1;  // [2^23, 2^25)
  const int32_t half_exponent = (unbiased - (odd ? 1 : 0)) / 2;  // even: exact
  uint32_t root = 0, remainder = 0;
  for (int step = 24; step >= 0; --step) {  // radicand mantissa * 2^25, two bits a step
    const int offset = 2 * step - 25;
    const uint32_t pair = offset >= 0 ? (mantissa >> offset) & 3u : (mantissa << -offset) & 3u;
    remainder = (remainder << 2) | pair;
    const uint32_t trial = (root << 2) | 1u;
    const bool take = remainder >= trial;
    if (take) remainder -= trial;
    root = (root << 1) | (take ? 1u : 0u);
  }
  uint32_t kept = root >> 1;
  if ((root & 1u) && (remainder != 0 || (kept & 1u))) ++kept;
  return float_of((static_cast<uint32_t>(half_exponent + 126) << 23) + kept);
}

JQ_HD float sqrt_f32(float x) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(x);
#else
  return sqrt_host(x);
#endif
}

// jnp.round (half to even) of |v| < 2^22, any sign; NaN stays NaN.
JQ_HD float round_half_even(float v) {
#if defined(__CUDA_ARCH__)
  return rintf(v);
#else
  return float_of(bits_of(rint_nonneg(abs_f(v))) | (bits_of(v) & 0x80000000u));
#endif
}

// Output dtypes of the fused producers (the value is rounded to it before quantizing).
enum class OutType : int { kBF16 = 0, kF16 = 1, kF32 = 2 };

// XLA's float32 -> bfloat16 conversion: round to nearest even; NaN -> quiet NaN with its sign.
JQ_HD uint32_t bf16_bits_rne(float x) {
  const uint32_t b = bits_of(x);
  if (is_nan(x)) return ((b >> 16) & 0x8000u) | 0x7FC0u;
  return (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
}

// XLA's float32 -> float16 conversion: round to nearest even, subnormal halves, overflow to
// inf; NaN keeps its sign and top payload bits, quieted.
JQ_HD uint32_t f16_bits_rne(float x) {
  const uint32_t b = bits_of(x), sign = (b >> 16) & 0x8000u, magnitude = b & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) return sign | 0x7E00u | ((magnitude & 0x7FFFFFu) >> 13);
  if (magnitude >= 0x477FF000u) return sign | 0x7C00u;  // rounds to >= 65520: inf
  const int32_t e = static_cast<int32_t>(magnitude >> 23) - 127;
  if (e >= -14) {  // normal half: drop 13 mantissa bits
    const uint32_t m = magnitude + 0xFFFu + ((magnitude >> 13) & 1u);
    return sign | (((m >> 13) - (112u << 10)) & 0x7FFFu);
  }
  if (e < -25) return sign;  // below half the smallest subnormal (2^-25): zero
  // Subnormal half: value = mant * 2^(e - 23), in units of 2^-24: shift right by (-14 - e) + 13.
  const uint32_t mant = (magnitude & 0x7FFFFFu) | 0x800000u;
  const int shift = -1 - e;  // 14 .. 24
  const uint32_t kept = mant >> shift, dropped = mant & ((1u << shift) - 1u), half = 1u << (shift - 1);
  const uint32_t rounded = kept + ((dropped > half || (dropped == half && (kept & 1u))) ? 1u : 0u);
  return sign | rounded;
}

// The float32 value of x rounded to `out` (host; the kernels convert with the CUDA intrinsics).
JQ_HD float round_to_host(OutType out, float x) {
  if (out == OutType::kBF16) return float_of(bf16_bits_rne(x) << 16);
  if (out == OutType::kF16) return f16_bits_to_float(static_cast<uint16_t>(f16_bits_rne(x)));
  return x;
}

// normalization.norm_apply, one element.
JQ_HD float norm_value(float x, float mean, float rsigma, float g, float b, bool layernorm,
                       bool has_scale, bool has_bias) {
  const float d = layernorm ? x - mean : x;
  if (!has_bias) {
    const float t = d * rsigma;
    return has_scale ? t * g : t;
  }
  if (!has_scale) return mul_rn(d, rsigma) + b;
  return mul_rn(d * rsigma, g) + b;
}

// normalization.norm_statistics' last step: rsigma = 1 / sqrt(var + eps).
JQ_HD float rsigma_of(float var, float eps) { return div_f32(1.0f, sqrt_f32(var + eps)); }

// reductions.row_sum's chunk: 8 consecutive values summed left to right.
JQ_HD float chunk_sum8(const float* v) {
  float s = v[0] + v[1];
#pragma unroll
  for (int i = 2; i < 8; ++i) s = s + v[i];
  return s;
}

// Pairwise (neighbours first) merging of a stream of partial sums, the binary-counter way:
// after pushing 2^L partials, `levels[L]` holds their pairwise sum.
struct PairwiseStack {
  float levels[40];
  uint64_t count = 0;
  JQ_HD void push(float c) {
    int level = 0;
    uint64_t n = ++count;
    while ((n & 1u) == 0) {
      c = levels[level] + c;
      n >>= 1;
      ++level;
    }
    levels[level] = c;
  }
};

// reductions.row_sum of v[0..k) on the host (values already float32): chunks of 8 (zero
// padded), padded with zero chunks to a power of two, pairwise.
inline float row_sum_host(const float* v, int64_t k) {
  const int64_t chunks = (k + 7) / 8;
  int64_t padded = 1;
  int levels = 0;
  while (padded < chunks) { padded <<= 1; ++levels; }
  PairwiseStack stack;
  for (int64_t i = 0; i < padded; ++i) {
    float c[8];
    for (int j = 0; j < 8; ++j) c[j] = (8 * i + j < k) ? v[8 * i + j] : 0.0f;
    stack.push(chunk_sum8(c));
  }
  return stack.levels[levels];
}

// exp, activations and their derivatives (activations.py). Constants are the float32 values
// of the Python ones.
constexpr float kLog2e = 0x1.715476p+0f;
constexpr float kLn2Hi = 0x1.63p-1f;  // 0.693359375: n * kLn2Hi is exact
constexpr float kLn2Lo = -0x1.bd0106p-13f;
constexpr float kGeluC1 = 0x1.988454p+0f;   // 2 sqrt(2 / pi)
constexpr float kGeluC2 = 0x1.2444f2p-4f;   // 2 sqrt(2 / pi) * 0.044715
constexpr float kGeluC3 = 0x1.b6676cp-3f;   // 3 * kGeluC2
constexpr float kQuickGeluC = 0x1.b3b646p+0f;  // 1.702

JQ_HD float exp_f32(float x) {
  const float xc = min_prop(max_prop(x, -104.0f), 89.0f);
  const float n = round_half_even(xc * kLog2e);
  const float r = (xc - n * kLn2Hi) - mul_rn(n, kLn2Lo);
  float p = 0x1.a01a02p-13f;  // 1/5040, then Horner down to 1
  p = mul_rn(p, r) + 0x1.6c16c2p-10f;
  p = mul_rn(p, r) + 0x1.111112p-7f;
  p = mul_rn(p, r) + 0x1.555556p-5f;
  p = mul_rn(p, r) + 0x1.555556p-3f;
  p = mul_rn(p, r) + 0.5f;
  p = mul_rn(p, r) + 1.0f;
  p = mul_rn(p, r) + 1.0f;
  const int ni = is_nan(n) ? 0 : static_cast<int>(n);
  const int n1 = ni < -126 ? -126 : (ni > 127 ? 127 : ni);
  return mul_rn(p * exp2i(n1), exp2i(ni - n1));  // the callers add 1
}

// Activation kinds of the fused kernels (the `act` attribute); activations.ACTIVATIONS order,
// then kGeluApprox: gelu whose CUDA kernels may use the hardware's approximations (gelu_approx).
enum class Act : int { kGelu = 0, kSilu = 1, kRelu = 2, kQuickGelu = 3, kSquaredRelu = 4, kGeluApprox = 5 };

JQ_HD float relu_value(float x) { return x > 0.0f ? x : (is_nan(x) ? x : 0.0f); }

// (v, q) of the x * sigmoid(v) family: the sigmoid's argument and q = x * dv/dx.
JQ_HD void sigmoid_argument(Act a, float x, float* v, float* q) {
  if (a == Act::kSilu) {
    *v = x;
    *q = x;
  } else if (a == Act::kQuickGelu) {
    *v = x * kQuickGeluC;
    *q = *v;
  } else {
    const float w = x * x;
    *v = x * (mul_rn(kGeluC2, w) + kGeluC1);
    *q = x * (mul_rn(kGeluC3, w) + kGeluC1);
  }
}

JQ_HD float act_value(Act a, float x);

// gelu (tanh approximation) as x / (1 + 2^t), t = -2 log2(e) sqrt(2 / pi) (x + 0.044715 x^3),
// with the hardware's exp2 and reciprocal (ex2.approx, rcp.approx: ~2^-21 relative in all,
// before the caller's rounding) on the device, where the spec's exp and correctly rounded
// division cost ~75 instructions a value: Float8Block's whole-tile MLP kernel (Act::kGeluApprox,
// docs/design.md decision 62), in the tolerance class of the GEMM epilogue's gelu (decision 60).
// The host computes the spec's gelu.
constexpr float kGeluApproxA = -0x1.26aec2p+1f;  // -2 log2(e) sqrt(2 / pi)
constexpr float kGeluApproxB = -0x1.a5a7d0p-4f;  // kGeluApproxA * 0.044715
JQ_HD float gelu_approx(float x) {
#if defined(__CUDA_ARCH__)
  const float t = x * __fmaf_rn(kGeluApproxB, x * x, kGeluApproxA);
  float e, r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(t));
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.0f + e));
  return x * r;
#else
  return act_value(Act::kGelu, x);
#endif
}

JQ_HD float act_value(Act a, float x) {
  if (a == Act::kGeluApprox) return gelu_approx(x);
  if (a == Act::kRelu) return relu_value(x);
  if (a == Act::kSquaredRelu) {
    const float r = relu_value(x);
    return r * r;
  }
  float v, q;
  sigmoid_argument(a, x, &v, &q);
  return div_f32(x, exp_f32(-v) + 1.0f);
}

// The incoming gradient g times act'(x).
JQ_HD float act_backward(Act a, float g, float x) {
  if (a == Act::kRelu) return x > 0.0f ? g : 0.0f;
  if (a == Act::kSquaredRelu) return x > 0.0f ? g * (x * 2.0f) : 0.0f;
  float v, q;
  sigmoid_argument(a, x, &v, &q);
  const float s = div_f32(1.0f, exp_f32(-v) + 1.0f);
  return g * (s * (mul_rn(q, 1.0f - s) + 1.0f));
}

}  // namespace jq
