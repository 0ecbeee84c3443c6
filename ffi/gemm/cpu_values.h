// Exact values for the GEMM targets' CPU handlers (ffi/gemm, ffi/grouped), one copy for both:
// operand codes to float32 (the reference's dequantize_raw: every FP8 / FP4 / E8M0 value is a
// float32) and float32 to the output dtype (round to nearest even, as XLA's convert). Host code;
// the CUDA kernels decode with gemm/bf16_decode.cuh and store with the CUDA intrinsics.
#pragma once

#include <cstdint>

#include "gemm/gemm_types.h"
#include "jaxquant_numerics.h"

namespace jqffi {

// Operand codes decode with the numerics header's jq::decode_e4m3 / _e5m2 / _e2m1 / _e8m0.
inline float decode_elem(Elem elem, uint32_t code) {
  switch (elem) {
    case Elem::kE4M3: return jq::decode_e4m3(code);
    case Elem::kE5M2: return jq::decode_e5m2(code);
    default: return jq::decode_e2m1(code);
  }
}

// float32 -> bfloat16 bits, round to nearest even (a NaN stays a NaN, quieted).
inline uint16_t bf16_bits(float f) {
  const uint32_t x = jq::bits_of(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  return static_cast<uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

// float32 -> float16 bits, round to nearest even, subnormal halves, overflow to inf.
inline uint16_t f16_bits(float f) {
  const uint32_t x = jq::bits_of(f), sign = (x >> 16) & 0x8000u, ax = x & 0x7FFFFFFFu;
  if (ax > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u);
  if (ax >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520 -> inf
  if (ax < 0x38800000u) {  // below 2^-14: f16 subnormal (or zero), units of 2^-24
    const float units = jq::rint_nonneg(jq::float_of(ax) * 0x1p24f);  // exact scaling
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(units));
  }
  uint32_t h = (((ax >> 23) - 127u + 15u) << 10) | ((ax & 0x7FFFFFu) >> 13);
  const uint32_t rest = ax & 0x1FFFu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

// Element i of a bfloat16 / float16 / float32 buffer (kOut*) as float32.
inline float value_at(const void* p, int kind, int64_t i) {
  switch (kind) {
    case kOutBF16: return jq::float_of(uint32_t(static_cast<const uint16_t*>(p)[i]) << 16);
    case kOutF16: return jq::f16_bits_to_float(static_cast<const uint16_t*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

// Writes v, rounded to the buffer's dtype (kOut*), as element i.
inline void store_at(void* p, int kind, int64_t i, float v) {
  switch (kind) {
    case kOutBF16: static_cast<uint16_t*>(p)[i] = bf16_bits(v); break;
    case kOutF16: static_cast<uint16_t*>(p)[i] = f16_bits(v); break;
    default: static_cast<float*>(p)[i] = v; break;
  }
}

}  // namespace jqffi
