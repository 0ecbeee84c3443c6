// Codes the dense (ffi/gemm) and grouped (ffi/grouped) GEMM targets share, in host and device
// code alike: the payload element of a quantized operand and the output / bias dtype.
#pragma once

namespace jqffi {

// Payload element of a quantized operand: FP8 E4M3 / E5M2 bytes (per-tensor FP8, MXFP8,
// Float8Block) or E2M1 nibbles, two a byte with element 2i in the low nibble (NVFP4).
enum class Elem : int { kE4M3 = 0, kE5M2 = 1, kE2M1 = 2 };

// Output (and bias) dtype of a GEMM; kOutNone: no bias, or a dtype that is none of the three.
enum : int { kOutBF16 = 0, kOutF16 = 1, kOutF32 = 2, kOutNone = -1 };

}  // namespace jqffi
