// Plain-data descriptions of the grouped targets, shared by argument checking (host), the CPU
// handlers and the CUDA kernels.
#pragma once

#include <stdint.h>

#include "gemm/gemm_types.h"

namespace jqffi {

// The rows of x a grouped quantize (or amax) reads and the token layout it writes: group g owns
// rows [starts[g], starts[g + 1]) of x and positions [pstarts[g], pstarts[g + 1]) of the layout
// (position pstarts[g] + i holds row starts[g] + i; the rest of a group's positions, and those
// past pstarts[G], are padding).
struct GroupedRows {
  const void* x = nullptr;  // [T, C] bf16 / f16 / f32 (jqffi::In)
  int in_type = 0;
  int64_t T = 0, C = 0, G = 0;
  int64_t L = 0;            // token positions of the output layout
  int64_t expert_rows = 0;  // > 0: columnwise output is [G, C, expert_rows] (expert weights)
  bool row_packed = false;  // rowwise copy in the packed layout [T, C] while columnwise follows pstarts
  const int32_t* starts = nullptr;   // [G + 1] packed group starts
  const int32_t* pstarts = nullptr;  // [G + 1] layout group starts
};

// Grouped FP8 (per-tensor, one scale per group) quantize; also the grouped amax.
struct QuantizeParams : GroupedRows {
  bool delayed = false, pow2_scale = false;
  float amax_epsilon = 0.0f;
  int fmt = 0;               // jq::Fp8
  const float* s = nullptr;  // delayed: scale[G]
  uint8_t* row = nullptr;    // [L, C], or [T, C] packed (row_packed)
  uint8_t* col = nullptr;    // [C, L] or [G, C, expert_rows]
  float* scale_inv = nullptr;
  float* amax = nullptr;     // [G]
  const float* gate = nullptr;  // jaxquant_grouped_amax_gated: [G] scales; all nonzero: no amax
};

// Grouped NVFP4 quantize (jaxquant_grouped_quantize_nvfp4): one second-level scale per group
// (the group's amax, after the RHT for an rht columnwise copy), 1x16 or 16x16 blocks, optional
// RHT (columnwise) and stochastic rounding with each group's words at the index within the group.
struct Nvfp4QuantizeParams : GroupedRows {
  bool rowwise = false, columnwise = false, block_2d = false, rht = false, stochastic = false;
  bool raw = false;  // both copies as bfloat16 raw values (code x block scale), not codes
  // The rowwise copy [T, C] in the packed layout (row r of x at row r, rows of no group zero)
  // beside a columnwise copy in the padded layout: both from one launch (design decision 55).
  bool row_packed = false;
  const uint32_t* row_key = nullptr;  // [G, 2] stochastic-rounding words per group
  const uint32_t* col_key = nullptr;
  uint8_t* row = nullptr;        // f4 [L, C], or [T, C] (row_packed)
  uint8_t* row_scale = nullptr;  // e4m3 [L or T, ceil(C/16)] or [L/16, ceil(C/16)] (2-D)
  uint8_t* col = nullptr;        // f4 [C, L] or [G, C, E]
  uint8_t* col_scale = nullptr;  // e4m3 [C or ceil(C/16), L/16], or [G, ..., E/16]
  float* row_amax = nullptr;     // [G]
  float* col_amax = nullptr;     // [G]
};

enum : int { kModeRagged = 0, kModeWgrad = 1 };
// Block scales: E8M0 per 1x32 (MXFP8), E4M3 per 1x16 / 16x16 (NVFP4), float32 per 1x128 /
// 128x128 (Float8Block; the GEMM takes power-of-two scales only, exact in bf16).
enum : int { kScalePerTensor = 0, kScaleMx = 1, kScaleNv = 2, kScaleNv2d = 3, kScaleBlock = 4,
             kScaleBlock2d = 5 };

// The problem every grouped GEMM target shares:
//   mode 0 (ragged): rows [pstarts[g], pstarts[g+1]) of a [L, K] times expert g -> out [L, N]
//   mode 1 (wgrad): a [M, L] and b [N, L] contracted over each group's positions -> out [G, M, N]
struct GroupedGemm {
  int mode = kModeRagged;
  int64_t G = 0, L = 0, M = 0, N = 0, K = 0;
  const int32_t* pstarts = nullptr;  // [G + 1] group starts along the token axis
  void* out = nullptr;               // ragged: [L, N]; wgrad: [G, M, N]
  int out_kind = kOutBF16;
};

struct GemmOperand {
  const uint8_t* data = nullptr;  // [rows, row_bytes] (x G for expert operands)
  int64_t rows = 0, K = 0, row_bytes = 0;
  Elem elem = Elem::kE4M3;
  int scaling = kScalePerTensor;
  const uint8_t* scale = nullptr;  // [scale_rows, scale_cols] (x G for experts); f32 for Float8Block
  int64_t scale_rows = 0, scale_cols = 0;
};

// jaxquant_grouped_gemm(_sm90): quantized operands, per-group / per-row / per-column factors and
// a bias applied to the float32 sums.
struct GemmParams : GroupedGemm {
  GemmOperand a, b;
  const float* row_factor = nullptr;    // ragged: [L]; wgrad: [G, M]
  const float* col_factor = nullptr;    // [G, N]
  const float* group_factor = nullptr;  // [G]
  const float* bias = nullptr;          // [G, N] (ragged only)
};

// jaxquant_grouped_gemm_bf16: bfloat16 x bfloat16 -> bfloat16 / float32, float32 sums,
// out = alpha[g] * acc. Operands K-major ("a_k_major" / "b_k_major") or M/N-major:
//   mode 0: a [L, K]; b [G, N, K] (K-major) or [G, K, N] (N-major)   -> out [L, N]
//   mode 1: a [M, L] (K-major) or [L, M]; b [N, L] or [L, N]          -> out [G, M, N]
struct Bf16GemmParams : GroupedGemm {
  bool a_k_major = true, b_k_major = true;
  const uint16_t* a = nullptr;       // bfloat16 bits
  const uint16_t* b = nullptr;
  const float* alpha = nullptr;      // [G], or nullptr (1)
  const float* row_scale = nullptr;  // mode 0: [L] per-row factor applied after alpha, or nullptr
};

}  // namespace jqffi
