// Debug kernel: the fast encoders against the spec forms.
#pragma once

#include "quantize/tile.cuh"

namespace jqffi {
namespace {
// ============================================================================================
// Debug: fast encoders vs spec forms over float32 bit patterns.
// ============================================================================================

__global__ void encoder_check_kernel(uint32_t* out, int64_t start, int64_t count, int64_t stride) {
  uint32_t counts[3] = {0, 0, 0}, last[3] = {0, 0, 0};
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count; i += int64_t(gridDim.x) * blockDim.x) {
    const uint32_t b = uint32_t(start + i * stride);
    const float v = __uint_as_float(b), v1 = __uint_as_float(b ^ 0x80000000u);
    const float v2 = __uint_as_float(b + 1u), v3 = __uint_as_float(b * 2654435761u);
    for (int k = 0; k < 2; ++k) {
      const jq::Fp8 f = k == 0 ? jq::Fp8::kE4M3 : jq::Fp8::kE5M2;
      const jq::Spec s = jq::spec_of(f);
      const uint32_t x4 = jq::encode_fp8x4(v, v1, v2, v3, f);
      const uint32_t ref = jq::encode_spec(v, s) | (jq::encode_spec(v1, s) << 8) |
                           (jq::encode_spec(v2, s) << 16) | (jq::encode_spec(v3, s) << 24);
      if (x4 != ref || jq::encode_fp8(v, f) != jq::encode_spec(v, s)) { ++counts[k]; last[k] = max(last[k], b); }
    }
    if (jq::encode_e2m1(v) != jq::encode_spec(v, jq::e2m1())) { ++counts[2]; last[2] = max(last[2], b); }
  }
  for (int k = 0; k < 3; ++k) {
    if (counts[k]) {
      atomicAdd(out + k, counts[k]);
      atomicMax(out + 3 + k, last[k]);
    }
  }
}

}  // namespace
}  // namespace jqffi
