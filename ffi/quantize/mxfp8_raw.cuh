// MXFP8 raw values in bfloat16 on the device: code x 2^(e - 127) in float32, rounded once to
// bfloat16 (jq::mxfp8_raw; XLA's decode, exact above 2^-126). The grouped decode kernel
// (ffi/grouped/decode_cuda.cu) and the quantize kernel's raw output (quantize/mxfp8.cuh) share
// it, so a copy written raw by the quantize kernel is bit for bit its codes decoded.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "jaxquant_numerics.h"

namespace jqffi {
namespace {

// Codes 2k and 2k + 1 of `word` (k = 0: bits 0-15, the first in the low byte) times their
// block scales `s0`, `s1` (jq::decode_e8m0), as one bfloat16x2 word (the first in the low half).
__device__ __forceinline__ uint32_t mxfp8_raw_pair(uint32_t word, int k, float s0, float s1, bool e5m2) {
  const uint32_t pair = (word >> (16 * k)) & 0xFFFFu;
  __half2_raw h;
  if (e5m2) {  // E5M2 is float16's high byte
    h.x = uint16_t((pair & 0xFFu) << 8);
    h.y = uint16_t(pair & 0xFF00u);
  } else {
    h = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(pair), __NV_E4M3);
  }
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));  // exact
  const __nv_bfloat162 b = __floats2bfloat162_rn(jq::mxfp8_raw(f.x, s0), jq::mxfp8_raw(f.y, s1));
  return *reinterpret_cast<const uint32_t*>(&b);
}

// The same for two codes of one block (scale `s`).
__device__ __forceinline__ uint32_t mxfp8_raw_pair(uint32_t word, int k, float s, bool e5m2) {
  return mxfp8_raw_pair(word, k, s, s, e5m2);
}

// `n` words of four codes each as 2n bfloat16x2 words (`out[2i]`, `out[2i + 1]` from word i).
template <int N>
__device__ __forceinline__ void mxfp8_raw_words(const uint32_t* codes, float s, bool e5m2,
                                                uint32_t* out) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    out[2 * i] = mxfp8_raw_pair(codes[i], 0, s, e5m2);
    out[2 * i + 1] = mxfp8_raw_pair(codes[i], 1, s, e5m2);
  }
}

}  // namespace
}  // namespace jqffi
