// Plain-data descriptions of the grouped targets, shared by argument checking (host), the CPU
// handlers and the CUDA kernels, plus the exact operand decode both GEMM handlers use.
#pragma once

#include <stdint.h>

#include "jaxquant_numerics.h"

namespace jqgrouped {

// Grouped FP8 (per-tensor, one scale per group) quantize; also the grouped amax.
struct QuantizeParams {
  const void* x = nullptr;  // [T, C] bf16 / f16 / f32 (jqffi::In)
  int in_type = 0;
  int64_t T = 0, C = 0, G = 0;
  int64_t L = 0;            // token positions of the output layout
  int64_t expert_rows = 0;  // > 0: columnwise output is [G, C, expert_rows] (expert weights)
  const int32_t* starts = nullptr;   // [G + 1] packed group starts
  const int32_t* pstarts = nullptr;  // [G + 1] layout group starts
  bool delayed = false, pow2_scale = false;
  float amax_epsilon = 0.0f;
  int fmt = 0;               // jq::Fp8
  const float* s = nullptr;  // delayed: scale[G]
  uint8_t* row = nullptr;    // [L, C]
  uint8_t* col = nullptr;    // [C, L] or [G, C, expert_rows]
  float* scale_inv = nullptr;
  float* amax = nullptr;     // [G]
  const float* gate = nullptr;  // jaxquant_grouped_amax_gated: [G] scales; all nonzero: no amax
};

// Grouped NVFP4 quantize (jaxquant_grouped_quantize_nvfp4): one second-level scale per group
// (the group's amax, after the RHT for an rht columnwise copy), 1x16 or 16x16 blocks, optional
// RHT (columnwise) and stochastic rounding with each group's words at the index within the group.
struct Nvfp4QuantizeParams {
  const void* x = nullptr;  // [T, C] bf16 / f16 / f32 (jqffi::In)
  int in_type = 0;
  int64_t T = 0, C = 0, G = 0;
  int64_t L = 0;            // token positions of the output layout
  int64_t expert_rows = 0;  // > 0: columnwise output is [G, C, expert_rows] (expert weights)
  const int32_t* starts = nullptr;   // [G + 1] packed group starts
  const int32_t* pstarts = nullptr;  // [G + 1] layout group starts
  bool rowwise = false, columnwise = false, block_2d = false, rht = false, stochastic = false;
  const uint32_t* row_key = nullptr;  // [G, 2] stochastic-rounding words per group
  const uint32_t* col_key = nullptr;
  uint8_t* row = nullptr;        // f4 [L, C]
  uint8_t* row_scale = nullptr;  // e4m3 [L, ceil(C/16)] or [L/16, ceil(C/16)] (2-D)
  uint8_t* col = nullptr;        // f4 [C, L] or [G, C, E]
  uint8_t* col_scale = nullptr;  // e4m3 [C or ceil(C/16), L/16], or [G, ..., E/16]
  float* row_amax = nullptr;     // [G]
  float* col_amax = nullptr;     // [G]
};

enum : int { kModeRagged = 0, kModeWgrad = 1 };
enum : int { kElemE4M3 = 0, kElemE5M2 = 1, kElemE2M1 = 2 };
// Block scales: E8M0 per 1x32 (MXFP8), E4M3 per 1x16 / 16x16 (NVFP4), float32 per 1x128 /
// 128x128 (Float8Block; the GEMM takes power-of-two scales only, exact in bf16).
enum : int { kScalePerTensor = 0, kScaleMx = 1, kScaleNv = 2, kScaleNv2d = 3, kScaleBlock = 4,
             kScaleBlock2d = 5 };
enum : int { kOutBF16 = 0, kOutF16 = 1, kOutF32 = 2 };

struct GemmOperand {
  const uint8_t* data = nullptr;  // [rows, row_bytes] (x G for expert operands)
  int64_t rows = 0, K = 0, row_bytes = 0;
  int elem = kElemE4M3;
  int scaling = kScalePerTensor;
  const uint8_t* scale = nullptr;  // [scale_rows, scale_cols] (x G for experts); f32 for Float8Block
  int64_t scale_rows = 0, scale_cols = 0;
};

struct GemmParams {
  int mode = kModeRagged;
  int64_t G = 0, L = 0, M = 0, N = 0, K = 0;
  const int32_t* pstarts = nullptr;  // [G + 1] group starts along the token axis
  GemmOperand a, b;
  const float* row_factor = nullptr;    // ragged: [L]; wgrad: [G, M]
  const float* col_factor = nullptr;    // [G, N]
  const float* group_factor = nullptr;  // [G]
  const float* bias = nullptr;          // [G, N] (ragged only)
  void* out = nullptr;                  // ragged: [L, N]; wgrad: [G, M, N]
  int out_kind = kOutBF16;
};

// jaxquant_grouped_gemm_bf16: bfloat16 x bfloat16 -> bfloat16 / float32, float32 sums,
// out = alpha[g] * acc. Operands K-major ("a_k_major" / "b_k_major") or M/N-major:
//   mode 0: a [L, K]; b [G, N, K] (K-major) or [G, K, N] (N-major)   -> out [L, N]
//   mode 1: a [M, L] (K-major) or [L, M]; b [N, L] or [L, N]          -> out [G, M, N]
struct Bf16GemmParams {
  int mode = kModeRagged;
  int64_t G = 0, L = 0, M = 0, N = 0, K = 0;
  bool a_k_major = true, b_k_major = true;
  const int32_t* pstarts = nullptr;  // [G + 1] group starts along the token axis
  const uint16_t* a = nullptr;       // bfloat16 bits
  const uint16_t* b = nullptr;
  const float* alpha = nullptr;      // [G], or nullptr (1)
  void* out = nullptr;
  int out_kind = kOutBF16;           // kOutBF16 or kOutF32
};

// ---- exact decode (the reference's dequantize_raw), host and device ------------------------

// E5M2 code -> float32 (exact: E5M2 is the high byte of an IEEE half).
JQ_HD float decode_e5m2(uint32_t code) {
  const uint32_t sign = (code >> 7) & 1u, e = (code >> 2) & 0x1Fu, m = code & 3u;
  float mag;
  if (e == 0x1Fu) {
    mag = m ? jq::float_of(0x7FC00000u) : jq::float_of(0x7F800000u);
  } else if (e == 0) {
    mag = static_cast<float>(m) * 0x1p-16f;
  } else {
    mag = jq::float_of(((e - 15u + 127u) << 23) | (m << 21));
  }
  return sign ? -mag : mag;
}

// E2M1 code (low nibble) -> float32.
JQ_HD float decode_e2m1(uint32_t code) {
  const uint32_t m = code & 7u;
  const float mag = m < 4 ? 0.5f * static_cast<float>(m) : (m == 4 ? 2.0f : m == 5 ? 3.0f : m == 6 ? 4.0f : 6.0f);
  return (code & 8u) ? -mag : mag;
}

// E8M0 code -> 2^(e - 127) (NaN for 255).
JQ_HD float decode_e8m0(uint32_t e) {
  return e == 255u ? jq::float_of(0x7FC00000u) : jq::exp2i(static_cast<int>(e) - 127);
}

JQ_HD float decode_elem(int elem, uint32_t code) {
  return elem == kElemE4M3 ? jq::decode_e4m3(code) : elem == kElemE5M2 ? decode_e5m2(code) : decode_e2m1(code);
}

// Block scale of element (row, k) of an operand (1 for per-tensor scaling); `s` points at the
// operand's (expert's) scale matrix.
JQ_HD float block_scale(const GemmOperand& op, const uint8_t* s, int64_t row, int64_t k) {
  switch (op.scaling) {
    case kScaleMx: return decode_e8m0(s[row * op.scale_cols + k / 32]);
    case kScaleNv: return jq::decode_e4m3(s[row * op.scale_cols + k / 16]);
    case kScaleNv2d: return jq::decode_e4m3(s[(row / 16) * op.scale_cols + k / 16]);
    case kScaleBlock: return reinterpret_cast<const float*>(s)[row * op.scale_cols + k / 128];
    case kScaleBlock2d: return reinterpret_cast<const float*>(s)[(row / 128) * op.scale_cols + k / 128];
    default: return 1.0f;
  }
}

}  // namespace jqgrouped
