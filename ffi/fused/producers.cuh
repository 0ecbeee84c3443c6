// Producers of the fused quantize kernels: each computes the 8 values at (r, c .. c+7) of the
// matrix the FP8-format tile kernels (quantize/*.cuh) quantize, in its output type, with zeros
// outside [R, C] (the contract of `Direct`, tile.cuh). The values come from the numerics header
// (norm_value, act_value, act_backward), rounded to the output type with the CUDA conversion
// intrinsics (the instructions XLA:GPU's convert uses).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "quantize/fp8_block_1x128.cuh"
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

  // The normalized value of x (row statistics m, rs; column scale g and bias b) in Out.
  __device__ __forceinline__ Out value(float x, float m, float rs, float g, float b) const {
    return from_float<Out>(jq::norm_value(x, m, rs, g, b, layernorm, has_scale, has_bias));
  }

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
      out[i] = c + i < C ? value(xv[i], m, rs, g[i], b[i]) : zero_of<Out>();
    }
    if (y != nullptr) row_store8(y + r * C, c, C, vec_y, out);
  }
};

// A norm producer's passes where the thread's 8 columns and every pass's row are inside and
// x is 16-bit and aligned: every x, mean and rsigma load issued first, the thread's scale and
// bias loaded once (its columns are the same in every pass), then the passes' arithmetic
// (NormProducer::load8's, value for value). Elsewhere, load8 pass by pass.
template <typename In, typename OutT, int NP>
__device__ __forceinline__ void load_passes(const NormProducer<In, OutT>& n, int64_t r0, int step, int64_t c,
                                            OutT (&raw)[NP][8]) {
  if constexpr (sizeof(In) == 2) {
    if (n.vec_x && n.vec_params && c + 8 <= n.C && r0 + int64_t(NP - 1) * step < n.R) {
      alignas(16) In xs[NP][8];
      float m[NP], rs[NP];
#pragma unroll
      for (int pp = 0; pp < NP; ++pp) {
        const int64_t r = r0 + pp * step;
        reinterpret_cast<uint4*>(xs[pp])[0] = __ldg(reinterpret_cast<const uint4*>(n.x + r * n.C + c));
        m[pp] = n.layernorm ? __ldg(n.mean + r) : 0.0f;
        rs[pp] = __ldg(n.rsigma + r);
      }
      float g[8] = {}, b[8] = {};
      if (n.has_scale) row_floats8(n.scale, c, n.C, true, g);
      if (n.has_bias) row_floats8(n.bias, c, n.C, true, b);
#pragma unroll
      for (int pp = 0; pp < NP; ++pp) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          raw[pp][i] = n.value(to_float(xs[pp][i]), m[pp], rs[pp], g[i], b[i]);
        }
        if (n.y != nullptr) row_store8(n.y + (r0 + pp * step) * n.C, c, n.C, n.vec_y, raw[pp]);
      }
      return;
    }
  }
#pragma unroll
  for (int pp = 0; pp < NP; ++pp) n.load8(r0 + pp * step, c, raw[pp]);
}

// The norm producer's tile kernels with a 16-bit output compiled for 2 CTAs a multiprocessor
// (at most 128 registers a thread; ptxas spills nothing there). With load_passes holding every
// pass's x, mean and rsigma in flight, the 3-CTA bound of sessions 11-33 (80 registers) spilled
// 52-116 bytes; the staged loads took the tile kernel from 99 to 66 µs on an H200 (session 34,
// Nsight Compute, [16384, 2048] bf16). A float32 output stays unbounded (114-130 registers).
template <typename In, typename OutT>
struct TileMinCtas<NormProducer<In, OutT>> {
  static constexpr int value = sizeof(OutT) == 2 ? 2 : 1;
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

  // act(h0), or act(h0) * h1 for a gated unit, in T.
  __device__ __forceinline__ T value(float h0, float h1) const {
    const float a = act_value_call(act, h0);
    return from_float<T>(gated ? a * h1 : a);
  }

  __device__ __forceinline__ void load8(int64_t r, int64_t c, T* out) const {
    if (r >= R || c >= C) {
      zeros8(out);
      return;
    }
    const T* row = h + r * (gated ? 2 * C : C);
    float h0[8], h1[8] = {};
    row_floats8(row, c, C, vec, h0);
    if (gated) row_floats8(row + C, c, C, vec, h1);
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = c + i < C ? value(h0[i], h1[i]) : zero_of<T>();
  }
};

// An MLP's gelu of bfloat16 h (Act::kGeluApprox, ungated) quantized by Float8Block's whole-tile
// 1x128 kernel: the kernel turns each loaded word of h into two gelu values, jq::gelu_approx
// inlined, rounded as ActProducer::value rounds. (The spec's gelu inlined here was ~75
// instructions a value, slower than XLA's gelu and the plain kernel together.)
template <>
struct TileWords<ActProducer<BF16>> {
  static constexpr bool kServed = true;
  static bool serves(const ActProducer<BF16>& a) { return a.vec && !a.gated && a.act == jq::Act::kGeluApprox; }
  __device__ static TileSource source(const ActProducer<BF16>& a, uint32_t r0, uint32_t c0, uint32_t C) {
    return {a.h + r0 * C + c0, C};
  }
  __device__ static uint32_t word(uint32_t w) {
    const BF16 lo = from_float<BF16>(jq::gelu_approx(__uint_as_float(w << 16)));
    const BF16 hi = from_float<BF16>(jq::gelu_approx(__uint_as_float(w & 0xFFFF0000u)));
    return uint32_t(lo.u) | (uint32_t(hi.u) << 16);
  }
};

// The most parts a PartsProducer joins (fused_args.h's kMaxParts).
constexpr int kMaxProducerParts = 8;

// Column parts side by side: [part 0 | part 1 | ...], each [R, Cp] (a packed projection's dq,
// dk and dv where the attention wrote them), C = parts * Cp: the values as they are, no
// arithmetic. The whole-tile kernels read a tile from the one part it lies in (TileWords below).
template <typename T>
struct PartsProducer {
  using Out = T;
  const T* part[kMaxProducerParts];
  int64_t R, C, Cp;
  bool vec;  // every part 16-byte aligned and Cp % 8 == 0: 8 columns lie in one part

  // Part k's data, by selects over the parameter array (an indexed load would copy the array
  // to the stack first).
  __device__ __forceinline__ const T* part_at(int64_t k) const {
    const T* at = part[0];
#pragma unroll
    for (int i = 1; i < kMaxProducerParts; ++i) at = k == i ? part[i] : at;
    return at;
  }

  __device__ __forceinline__ void load8(int64_t r, int64_t c, T* out) const {
    if (r >= R || c >= C) {
      zeros8(out);
      return;
    }
    if (vec && c + 8 <= C) {
      const int64_t k = c / Cp;
      jqffi::load8(part_at(k), R, Cp, r, c - k * Cp, true, out);
      return;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int64_t k = (c + i) / Cp;
      out[i] = c + i < C ? part_at(k)[r * Cp + (c + i - k * Cp)] : zero_of<T>();
    }
  }
};

// Parts of whole tiles (Cp % 128 == 0: each 128-column tile in one part) for the whole-tile
// bfloat16 kernels: the tile's rows are read where its part holds them.
template <>
struct TileWords<PartsProducer<BF16>> {
  static constexpr bool kServed = true;
  static bool serves(const PartsProducer<BF16>& p) { return p.vec && p.Cp % 128 == 0; }
  __device__ static TileSource source(const PartsProducer<BF16>& p, uint32_t r0, uint32_t c0, uint32_t) {
    const uint32_t Cp = uint32_t(p.Cp), k = c0 / Cp;
    return {p.part_at(k) + r0 * Cp + (c0 - k * Cp), Cp};
  }
  __device__ static uint32_t word(uint32_t w) { return w; }
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

  // dh of one column from dy's d and h's h0: d * act'(h0); in a gated unit's first half (the
  // gate h1 given) (d * h1) * act'(h0), in its second half d * act(h0).
  __device__ __forceinline__ float value(float d, float h0, float h1, bool first_half) const {
    if (!gated) return act_backward_call(act, d, h0);
    return first_half ? act_backward_call(act, d * h1, h0) : d * act_value_call(act, h0);
  }

  __device__ __noinline__ float gated_value(int64_t r, int64_t c) const {  // rare: unaligned rows
    if (c < N) return value(to_float(dy[r * N + c]), to_float(h[r * C + c]), to_float(h[r * C + N + c]), true);
    const int64_t k = c - N;
    return value(to_float(dy[r * N + k]), to_float(h[r * C + k]), 0.0f, false);
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
      for (int i = 0; i < 8; ++i) out[i] = c + i < C ? from_float<T>(value(d[i], h0[i], 0.0f, true)) : zero_of<T>();
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
      for (int i = 0; i < 8; ++i) out[i] = from_float<T>(value(d[i], h0[i], h1[i], true));
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) out[i] = from_float<T>(value(d[i], h0[i], 0.0f, false));
    }
  }
};

// 16 bytes of a 16-bit row at column c (16-byte aligned), as 8 values.
template <typename T>
__device__ __forceinline__ void load16b(const T* row, int64_t c, T* out) {
  static_assert(sizeof(T) == 2, "8 16-bit values");
  reinterpret_cast<uint4*>(out)[0] = __ldg(reinterpret_cast<const uint4*>(row + c));
}

// An activation producer's passes where the thread's 8 columns and every pass's row are inside
// and h is 16-bit and aligned: every pass's h loads issued first, then act (times the gate) in
// place, value for value ActProducer::load8's. Elsewhere, load8 pass by pass.
template <typename T, int NP>
__device__ __forceinline__ void load_passes(const ActProducer<T>& a, int64_t r0, int step, int64_t c,
                                            T (&raw)[NP][8]) {
  if constexpr (sizeof(T) == 2) {
    if (a.vec && c + 8 <= a.C && r0 + int64_t(NP - 1) * step < a.R) {
      const int64_t stride = a.gated ? 2 * a.C : a.C;
      alignas(16) T h1[NP][8] = {};
#pragma unroll
      for (int pp = 0; pp < NP; ++pp) {
        const T* row = a.h + (r0 + pp * step) * stride;
        load16b(row, c, raw[pp]);
        if (a.gated) load16b(row + a.C, c, h1[pp]);
      }
#pragma unroll
      for (int pp = 0; pp < NP; ++pp) {
#pragma unroll
        for (int i = 0; i < 8; ++i) raw[pp][i] = a.value(to_float(raw[pp][i]), to_float(h1[pp][i]));
      }
      return;
    }
  }
#pragma unroll
  for (int pp = 0; pp < NP; ++pp) a.load8(r0 + pp * step, c, raw[pp]);
}

// The activation gradient's passes, staged as the activation's (all loads first) where the
// thread's 8 columns and every pass's row are inside and the rows 16-bit and aligned (`vec`: 8
// columns then lie in one half of a gated unit); value for value DactProducer::load8's.
template <typename T, int NP>
__device__ __forceinline__ void load_passes(const DactProducer<T>& d, int64_t r0, int step, int64_t c,
                                            T (&raw)[NP][8]) {
  if constexpr (sizeof(T) == 2) {
    if (d.vec && c + 8 <= d.C && r0 + int64_t(NP - 1) * step < d.R) {
      const bool first_half = !d.gated || c < d.N;
      const int64_t k = first_half ? c : c - d.N;
      alignas(16) T dy[NP][8], h1[NP][8] = {};
#pragma unroll
      for (int pp = 0; pp < NP; ++pp) {
        const int64_t r = r0 + pp * step;
        load16b(d.dy + r * d.N, k, dy[pp]);
        load16b(d.h + r * d.C, k, raw[pp]);
        if (d.gated && first_half) load16b(d.h + r * d.C + d.N, k, h1[pp]);
      }
#pragma unroll
      for (int pp = 0; pp < NP; ++pp) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          raw[pp][i] = from_float<T>(d.value(to_float(dy[pp][i]), to_float(raw[pp][i]), to_float(h1[pp][i]), first_half));
        }
      }
      return;
    }
  }
#pragma unroll
  for (int pp = 0; pp < NP; ++pp) d.load8(r0 + pp * step, c, raw[pp]);
}

}  // namespace
}  // namespace jqffi
