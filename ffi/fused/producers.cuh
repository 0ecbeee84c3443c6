// Producers of the fused quantize kernels: each computes the 8 values at (r, c .. c+7) of the
// matrix the FP8-format tile kernels (quantize/*.cuh) quantize, in its output type, with zeros
// outside [R, C] (the contract of `Direct`, tile.cuh). The values come from the numerics header
// (norm_value, act_value, act_backward), rounded to the output type with the CUDA conversion
// intrinsics (the instructions XLA:GPU's convert uses).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "quantize/tile.cuh"

namespace jqffi {
namespace {

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ BF16 from_float<BF16>(float v) {
  return BF16{__bfloat16_as_ushort(__float2bfloat16_rn(v))};
}
template <> __device__ __forceinline__ F16 from_float<F16>(float v) { return F16{__half_as_ushort(__float2half_rn(v))}; }
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }

// v rounded to `out` and back (the amax passes, which keep no typed copy).
__device__ __forceinline__ float round_to_device(jq::OutType out, float v) {
  if (out == jq::OutType::kBF16) return __bfloat162float(__float2bfloat16_rn(v));
  if (out == jq::OutType::kF16) return __half2float(__float2half_rn(v));
  return v;
}

// Columns c .. c+7 of a row (`row` points at its first element) as floats, zeros at columns
// >= limit; one or two 16-byte loads when `vec` (row + c 16-byte aligned) and the 8 are inside.
template <typename In>
__device__ __forceinline__ void row_floats8(const In* row, int64_t c, int64_t limit, bool vec, float* out) {
  if (vec && c + 8 <= limit) {
    alignas(16) In raw[8];
    const uint4* p = reinterpret_cast<const uint4*>(row + c);
    reinterpret_cast<uint4*>(raw)[0] = __ldg(p);
    if constexpr (sizeof(In) == 4) reinterpret_cast<uint4*>(raw)[1] = __ldg(p + 1);
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = to_float(raw[i]);
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = c + i < limit ? to_float(row[c + i]) : 0.0f;
  }
}

// Stores v[0..8) at columns c .. c+7 of a row, the ones below `limit`.
template <typename T>
__device__ __forceinline__ void row_store8(T* row, int64_t c, int64_t limit, bool vec, const T* v) {
  if (vec && c + 8 <= limit) {
    uint4* p = reinterpret_cast<uint4*>(row + c);
    p[0] = reinterpret_cast<const uint4*>(v)[0];
    if constexpr (sizeof(T) == 4) p[1] = reinterpret_cast<const uint4*>(v)[1];
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (c + i < limit) row[c + i] = v[i];
    }
  }
}

// The activation and its gradient as calls, one copy of each in a kernel: inlined, every
// activation's exp and division were copied into each of the 64 unrolled values a thread
// computes (a DactProducer tile kernel was ~46,000 PTX instructions, far past the instruction
// cache). Same math (the numerics header's), so the same values.
__device__ __noinline__ float act_value_call(jq::Act a, float x) { return jq::act_value(a, x); }
__device__ __noinline__ float act_backward_call(jq::Act a, float g, float x) { return jq::act_backward(a, g, x); }

template <typename T>
__device__ __forceinline__ void zeros8(T* out) {
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = zero_of<T>();
}

// LayerNorm / RMSNorm of x [R, C] with per-row mean, rsigma and per-column scale, bias (float32);
// also writes the high-precision output y when it is given.
template <typename In, typename OutT>
struct NormProducer {
  using Out = OutT;
  const In* x;
  const float *mean, *rsigma, *scale, *bias;
  Out* y;
  int64_t R, C;
  bool vec_x, vec_params, vec_y, layernorm, has_scale, has_bias;

  __device__ __forceinline__ void load8(int64_t r, int64_t c, Out* out) const {
    if (r >= R || c >= C) {
      zeros8(out);
      return;
    }
    float xv[8], g[8] = {}, b[8] = {};
    row_floats8(x + r * C, c, C, vec_x, xv);
    if (has_scale) row_floats8(scale, c, C, vec_params, g);
    if (has_bias) row_floats8(bias, c, C, vec_params, b);
    const float m = layernorm ? __ldg(mean + r) : 0.0f, rs = __ldg(rsigma + r);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      out[i] = c + i < C ? from_float<Out>(jq::norm_value(xv[i], m, rs, g[i], b[i], layernorm, has_scale, has_bias))
                         : zero_of<Out>();
    }
    if (y != nullptr) row_store8(y + r * C, c, C, vec_y, out);
  }
};

// The norm producer's tile kernels with a 16-bit output compiled for 3 CTAs a multiprocessor
// (at most 80 registers a thread: unbounded they take 92-95, i.e. 2 CTAs; bounded they spill 8-16
// bytes). A float32 output stays unbounded (114-130 registers; at 80 it spills 240-480 bytes).
// Measured on an H100 (session 11): fused layernorm 1.35 -> 1.28x the unfused time, delayed
// scaling (ffi/fused/NOTES.md).
template <typename In, typename OutT>
struct TileMinCtas<NormProducer<In, OutT>> {
  static constexpr int value = sizeof(OutT) == 2 ? 3 : 1;
};
template <typename In, typename OutT>
struct ProducerMinCtas<NormProducer<In, OutT>> : TileMinCtas<NormProducer<In, OutT>> {};

// act(h) of h [R, C], or act(h0) * h1 of a gated unit's h [R, 2C] = [h0 | h1].
template <typename T>
struct ActProducer {
  using Out = T;
  const T* h;
  int64_t R, C;
  bool vec, gated;
  jq::Act act;

  __device__ __forceinline__ void load8(int64_t r, int64_t c, T* out) const {
    if (r >= R || c >= C) {
      zeros8(out);
      return;
    }
    const T* row = h + r * (gated ? 2 * C : C);
    float h0[8], h1[8];
    row_floats8(row, c, C, vec, h0);
    if (gated) row_floats8(row + C, c, C, vec, h1);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float a = act_value_call(act, h0[i]);
      out[i] = c + i < C ? from_float<T>(gated ? a * h1[i] : a) : zero_of<T>();
    }
  }
};

// The gradient through an activation: dy [R, N] times act'(h), h [R, C]; gated (C = 2N):
// columns < N are dh0 = (dy * h1) * act'(h0), the others dh1 = dy * act(h0).
template <typename T>
struct DactProducer {
  using Out = T;
  const T *dy, *h;
  int64_t R, C, N;
  bool vec, gated;  // vec: dy and h 16-byte aligned and N % 8 == 0
  jq::Act act;

  __device__ __noinline__ float gated_value(int64_t r, int64_t c) const {  // rare: unaligned rows
    if (c < N) {
      const float d = to_float(dy[r * N + c]);
      return act_backward_call(act, d * to_float(h[r * C + N + c]), to_float(h[r * C + c]));
    }
    const int64_t k = c - N;
    return to_float(dy[r * N + k]) * act_value_call(act, to_float(h[r * C + k]));
  }

  __device__ __forceinline__ void load8(int64_t r, int64_t c, T* out) const {
    if (r >= R || c >= C) {
      zeros8(out);
      return;
    }
    float d[8], h0[8], h1[8];
    if (!gated) {
      row_floats8(dy + r * N, c, N, vec, d);
      row_floats8(h + r * C, c, C, vec, h0);
#pragma unroll
      for (int i = 0; i < 8; ++i) out[i] = c + i < C ? from_float<T>(act_backward_call(act, d[i], h0[i])) : zero_of<T>();
      return;
    }
    if (!vec) {  // 8 columns may straddle the two halves
#pragma unroll
      for (int i = 0; i < 8; ++i) out[i] = c + i < C ? from_float<T>(gated_value(r, c + i)) : zero_of<T>();
      return;
    }
    const bool first_half = c < N;  // N % 8 == 0: all 8 columns in one half
    const int64_t k = first_half ? c : c - N;
    row_floats8(dy + r * N, k, N, true, d);
    row_floats8(h + r * C, k, N, true, h0);
    if (first_half) {
      row_floats8(h + r * C + N, k, N, true, h1);
#pragma unroll
      for (int i = 0; i < 8; ++i) out[i] = from_float<T>(act_backward_call(act, d[i] * h1[i], h0[i]));
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) out[i] = from_float<T>(d[i] * act_value_call(act, h0[i]));
    }
  }
};

}  // namespace
}  // namespace jqffi
