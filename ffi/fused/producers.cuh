// Producers of the fused quantize kernels: each computes the 8 values at (r, c .. c+7) of the
// matrix the FP8-format tile kernels (quantize/*.cuh) quantize, in its output type, with zeros
// outside [R, C] (the contract of `Direct`, tile.cuh). The values come from the numerics header
// (norm_value, act_value, act_backward), rounded to the output type with the CUDA conversion
// intrinsics (the instructions XLA:GPU's convert uses).
//
// Each producer works in two stages, `fetch` (the raw inputs of 8 values into a `Raw`) and
// `compute` (the values from them), so a kernel can issue every pass's loads before any math:
// the math (a correctly rounded division, exp) has a slow path the compiler does not move loads
// across, and with one stage each pass waited for its own loads. `load8` is both at once.
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

// Columns c .. c+7 of a row (`row` points at its first element) as stored, zeros at columns
// >= limit; one or two 16-byte loads when `vec` (row + c 16-byte aligned) and the 8 are inside.
template <typename In>
__device__ __forceinline__ void row_raw8(const In* row, int64_t c, int64_t limit, bool vec, In* out) {
  if (vec && c + 8 <= limit) {
    const uint4* p = reinterpret_cast<const uint4*>(row + c);
    reinterpret_cast<uint4*>(out)[0] = __ldg(p);
    if constexpr (sizeof(In) == 4) reinterpret_cast<uint4*>(out)[1] = __ldg(p + 1);
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = c + i < limit ? row[c + i] : zero_of<In>();
  }
}

// The same as floats.
template <typename In>
__device__ __forceinline__ void row_floats8(const In* row, int64_t c, int64_t limit, bool vec, float* out) {
  alignas(16) In raw[8];
  row_raw8(row, c, limit, vec, raw);
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = to_float(raw[i]);
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

  struct Raw {
    alignas(16) In x[8];
    float mean, rsigma;
  };

  __device__ __forceinline__ void fetch(int64_t r, int64_t c, Raw& w) const {
    if (r >= R || c >= C) return;
    row_raw8(x + r * C, c, C, vec_x, w.x);
    w.mean = layernorm ? __ldg(mean + r) : 0.0f;
    w.rsigma = __ldg(rsigma + r);
  }

  __device__ __forceinline__ void compute(int64_t r, int64_t c, const Raw& w, Out* out) const {
    if (r >= R || c >= C) {
      zeros8(out);
      return;
    }
    float g[8] = {}, b[8] = {};  // the same columns every pass: cached
    if (has_scale) row_floats8(scale, c, C, vec_params, g);
    if (has_bias) row_floats8(bias, c, C, vec_params, b);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      out[i] = c + i < C ? from_float<Out>(jq::norm_value(to_float(w.x[i]), w.mean, w.rsigma, g[i], b[i],
                                                          layernorm, has_scale, has_bias))
                         : zero_of<Out>();
    }
    if (y != nullptr) row_store8(y + r * C, c, C, vec_y, out);
  }

  __device__ __forceinline__ void load8(int64_t r, int64_t c, Out* out) const {
    Raw w;
    fetch(r, c, w);
    compute(r, c, w, out);
  }
};

// act(h) of h [R, C], or act(h0) * h1 of a gated unit's h [R, 2C] = [h0 | h1].
template <typename T>
struct ActProducer {
  using Out = T;
  const T* h;
  int64_t R, C;
  bool vec, gated;
  jq::Act act;

  struct Raw {
    alignas(16) T h0[8];
    alignas(16) T h1[8];
  };

  __device__ __forceinline__ void fetch(int64_t r, int64_t c, Raw& w) const {
    if (r >= R || c >= C) return;
    const T* row = h + r * (gated ? 2 * C : C);
    row_raw8(row, c, C, vec, w.h0);
    if (gated) row_raw8(row + C, c, C, vec, w.h1);
  }

  __device__ __forceinline__ void compute(int64_t r, int64_t c, const Raw& w, T* out) const {
    if (r >= R || c >= C) {
      zeros8(out);
      return;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float a = jq::act_value(act, to_float(w.h0[i]));
      out[i] = c + i < C ? from_float<T>(gated ? a * to_float(w.h1[i]) : a) : zero_of<T>();
    }
  }

  __device__ __forceinline__ void load8(int64_t r, int64_t c, T* out) const {
    Raw w;
    fetch(r, c, w);
    compute(r, c, w, out);
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

  // Per column: dy, h0 and (gated, first half) h1 of the column's pair.
  struct Raw {
    alignas(16) T d[8];
    alignas(16) T h0[8];
    alignas(16) T h1[8];
  };

  __device__ __forceinline__ void fetch(int64_t r, int64_t c, Raw& w) const {
    if (r >= R || c >= C) return;
    if (!gated) {
      row_raw8(dy + r * N, c, N, vec, w.d);
      row_raw8(h + r * C, c, C, vec, w.h0);
      return;
    }
    if (!vec) {  // 8 columns may straddle the two halves
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int64_t cc = c + i, k = cc < N ? cc : cc - N;
        const bool inside = cc < C;
        w.d[i] = inside ? dy[r * N + k] : zero_of<T>();
        w.h0[i] = inside ? h[r * C + k] : zero_of<T>();
        w.h1[i] = inside && cc < N ? h[r * C + N + k] : zero_of<T>();
      }
      return;
    }
    const bool first_half = c < N;  // N % 8 == 0: all 8 columns in one half
    const int64_t k = first_half ? c : c - N;
    row_raw8(dy + r * N, k, N, true, w.d);
    row_raw8(h + r * C, k, N, true, w.h0);
    if (first_half) row_raw8(h + r * C + N, k, N, true, w.h1);
  }

  __device__ __forceinline__ void compute(int64_t r, int64_t c, const Raw& w, T* out) const {
    if (r >= R || c >= C) {
      zeros8(out);
      return;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int64_t cc = c + i;
      const float d = to_float(w.d[i]), h0 = to_float(w.h0[i]);
      float v;
      if (!gated) {
        v = jq::act_backward(act, d, h0);
      } else if (cc < N) {
        v = jq::act_backward(act, d * to_float(w.h1[i]), h0);
      } else {
        v = d * jq::act_value(act, h0);
      }
      out[i] = cc < C ? from_float<T>(v) : zero_of<T>();
    }
  }

  __device__ __forceinline__ void load8(int64_t r, int64_t c, T* out) const {
    Raw w;
    fetch(r, c, w);
    compute(r, c, w, out);
  }
};

}  // namespace
}  // namespace jqffi
