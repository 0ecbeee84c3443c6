// NVFP4 raw values in bfloat16 on the device: E2M1 code x E4M3 block scale (jq::nvfp4_raw,
// exact in bfloat16). The grouped decode kernel (ffi/grouped/decode_cuda.cu) and the NVFP4
// quantize kernel's raw output (quantize/nvfp4.cuh, both copies) share it, so a copy written
// raw by the quantize kernel is bit for bit its codes decoded.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace jqffi {
namespace {

// Four E2M1 codes (the low 16 bits of `codes`, first in the low nibble) times the block scale,
// as two bfloat16x2 words. The magnitudes' bfloat16 bytes come from two 8-entry byte tables
// (prmt selects byte k of the result by selector nibble k), the signs are moved from bit 3 of
// each nibble to bit 15 of each half, and one packed bfloat16 multiply applies the scale: the
// products have at most 6 significant bits and lie in 2^-10 .. 2688, so they are exact and
// equal jq::nvfp4_raw rounded to bfloat16 (XLA's decode) bit for bit; the GPU tests compare
// them with it.
__device__ __forceinline__ void raw4(uint32_t codes, __nv_bfloat162 s, uint32_t* out) {
  // bfloat16 of {0, .5, 1, 1.5, 2, 3, 4, 6}: low bytes 00 00 80 C0 00 40 80 C0, high bytes
  // 00 3F 3F 3F 40 40 40 40.
  const uint32_t sel = codes & 0x7777u;
  const uint32_t lo = __byte_perm(0xC0800000u, 0xC0804000u, sel);
  const uint32_t hi = __byte_perm(0x3F3F3F00u, 0x40404040u, sel);
  uint32_t pair[2] = {__byte_perm(lo, hi, 0x5140u), __byte_perm(lo, hi, 0x7362u)};
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const uint32_t nibbles = codes >> (8 * k);  // codes 2k (bits 0-3), 2k + 1 (bits 4-7)
    pair[k] |= ((nibbles << 12) & 0x8000u) | ((nibbles << 24) & 0x80000000u);
    const __nv_bfloat162 v = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&pair[k]), s);
    out[k] = *reinterpret_cast<const uint32_t*>(&v);
  }
}

}  // namespace
}  // namespace jqffi
