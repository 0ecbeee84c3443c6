// Exact bit-level decoders of FP8 / FP4 payloads into bf16x2 words, shared by the GEMM kernels
// that decode operands in the kernel (ffi/gemm/dequant_kernel.cuh: wgmma; ffi/grouped: the
// grouped mma.sync kernel). One copy of this math, device-only: each decoder builds
// `value * 2^-offset` from the code's bits (E4M3 offset 120, E5M2 112, E2M1 -120), so the
// caller's one bf16x2 multiply by `block scale * 2^offset` gives the exact decoded value
// (E4M3 / E5M2 x 2^k and E2M1 x E4M3 are exact in bf16). Subnormal codes become bf16
// subnormals, which mul.rn.bf16x2 keeps.
#pragma once

#include <cstdint>

namespace jqffi {

__device__ __forceinline__ uint32_t hmul2_bf16(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// Four E4M3 bytes -> two bf16x2 holding value * 2^-120: each 16-bit lane gets
// [sign-replicated byte, byte] (prmt msb mode), << 4 puts the byte's exponent and mantissa
// in bf16's bits 10..4 and a copy of its sign in bit 15; the mask clears the rest (including
// what the shift carried over from the neighbouring lane). E4M3 subnormals become bf16
// subnormals, which mul.bf16x2 keeps.
__device__ __forceinline__ void decode_e4m3x4(uint32_t w, uint32_t& lo, uint32_t& hi) {
  lo = (prmt(w, 0, 0x9180) << 4) & 0x87F087F0u;  // elements 0, 1
  hi = (prmt(w, 0, 0xB3A2) << 4) & 0x87F087F0u;  // elements 2, 3
}

// Four E5M2 bytes -> two bf16x2 holding value * 2^-112 (same idea, shift 5).
__device__ __forceinline__ void decode_e5m2x4(uint32_t w, uint32_t& lo, uint32_t& hi) {
  lo = (prmt(w, 0, 0x9180) << 5) & 0x8FE08FE0u;
  hi = (prmt(w, 0, 0xB3A2) << 5) & 0x8FE08FE0u;
}

// Eight E2M1 nibbles (element 0 in the low nibble) -> four bf16x2 holding value * 2^120.
// Magnitudes come from byte lookups (prmt) into the bf16 high and low bytes of
// {0, 0.5, 1, 1.5, 2, 3, 4, 6} * 2^120; the signs (nibble bit 3) are merged into the
// high bytes before the high and low bytes are interleaved into bf16 lanes.
// `hilo`, `lolo`: the tables' first halves, kept in registers by the caller (kE2M1HiLo, kE2M1LoLo).
constexpr uint32_t kE2M1HiLo = 0x7B7B7B00u, kE2M1LoLo = 0xC0800000u;
__device__ __forceinline__ void decode_e2m1x8(uint32_t w, uint32_t* out, uint32_t kHiLo,
                                              uint32_t kLoLo) {
  constexpr uint32_t kHiHi = 0x7C7C7C7Cu, kLoHi = 0xC0804000u;  // high / low bytes, codes 4-7
  const uint32_t m = w & 0x77777777u;  // selector nibbles < 8: plain byte selection
  const uint32_t m_hi = m >> 16;
  const uint32_t sw = w << 4;  // byte j's bit 7 = the sign of nibble 2j (w's bit 7: nibble 2j+1)
  // Sign bytes of nibbles 0..3 and 4..7, each in bit 7 of its byte.
  const uint32_t s0 = prmt(w, sw, 0x1504), s1 = prmt(w, sw, 0x3726);
  const uint32_t h0 = prmt(kHiLo, kHiHi, m) | (s0 & 0x80808080u);
  const uint32_t h1 = prmt(kHiLo, kHiHi, m_hi) | (s1 & 0x80808080u);
  const uint32_t l0 = prmt(kLoLo, kLoHi, m), l1 = prmt(kLoLo, kLoHi, m_hi);
  out[0] = prmt(l0, h0, 0x5140);
  out[1] = prmt(l0, h0, 0x7362);
  out[2] = prmt(l1, h1, 0x5140);
  out[3] = prmt(l1, h1, 0x7362);
}

// NVFP4 block scale: E4M3 code -> bf16x2 (both halves) holding scale * 2^-120, from bits like
// decode_e4m3x4 (subnormal scales stay exact as bf16 subnormals). A NaN scale code is not
// propagated here; it can only come from a NaN amax, which also makes the operand's tensor or
// row factor NaN, and the epilogue multiplies by that.
__device__ __forceinline__ uint32_t e4m3_scale_bf16x2(uint32_t code) {
  const uint32_t b = ((code & 0x7Fu) << 4) | ((code & 0x80u) << 8);
  return b | (b << 16);
}

// The bf16x2 factor 2^(t - 127) (t a biased exponent in [1, 254]) in both halves.
__device__ __forceinline__ uint32_t pow2_bf16x2(uint32_t t) { return (t << 7) * 0x10001u; }

// An E8M0 block scale 2^(e - 127) as bf16x2: NaN for e == 255, 2^-127 (a bf16 subnormal) for
// e == 0. A scale above bf16's normal range first needs pow2_bf16x2 of the decoder's offset.
__device__ __forceinline__ uint32_t e8m0_bf16x2(uint32_t e) {
  const uint32_t b = e == 0 ? 0x0040u : ((e << 7) | (((e + 1u) >> 8) << 6));
  return b * 0x10001u;
}

}  // namespace jqffi
