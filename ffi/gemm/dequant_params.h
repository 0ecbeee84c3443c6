// Plain-data description of one in-kernel-dequantize GEMM (target jaxquant_gemm_dequant),
// shared by the argument checking (host), the CPU handler and the CUDA kernel.
#pragma once

#include <cstdint>

#include "gemm/gemm_types.h"

namespace jqffi {

// One operand. E4M3/E5M2 payloads carry MXFP8 scales (E8M0 per 32 elements); E2M1 payloads are
// packed two per byte (element 2i in the low nibble) and carry NVFP4 scales (E4M3 per 16
// elements, or per 16x16 tile).
struct DequantOperand {
  const uint8_t* data = nullptr;   // [rows, row_bytes]
  int64_t row_bytes = 0;           // K (FP8) or K / 2 (FP4); a multiple of 16
  const uint8_t* scale = nullptr;  // block-scale bytes, [scale_rows, scale_stride]
  int64_t scale_stride = 0;        // bytes per scale row (= number of blocks along K)
  int scale_row_shift = 0;         // scale row = row >> shift (0; 4 for 16x16 NVFP4 tiles)
  const float* factor = nullptr;   // NVFP4 second level amax / (6 * 448)
  int factor_kind = 0;             // 0 none, 1 scalar, 2 one per row
  int rows = 0;
  Elem elem = Elem::kE4M3;
};

struct DequantParams {
  DequantOperand a, b;  // C[m, n] = sum_k A[m, k] B[n, k]
  const void* bias = nullptr;
  int bias_kind = kOutNone;  // kOut*, kOutNone: no bias
  void* out = nullptr;       // [M, N] row-major
  int out_kind = kOutBF16;
  int M = 0, N = 0, K = 0;  // K: logical contraction length (zero-padded to the payload's)
};

}  // namespace jqffi
