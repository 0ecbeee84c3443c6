// The normalization statistics kernel (`jaxquant_norm_stats`) and the producer amax kernel
// (`jaxquant_fused_amax`).
#pragma once

#include "fused/producers.cuh"

namespace jqffi {
namespace {

struct NormStatsParams {
  const void* x;
  int64_t R, C;
  bool vec, layernorm, has_scale, has_bias;
  float epsilon;
  jq::OutType out;
  const float *scale, *bias, *gate;  // gate: null, or the delayed-scaling scale (amax only when 0)
  float *mean, *rsigma, *amax;       // amax: null when not requested
};

// `levels` neighbours-first pairwise levels across lanes (xor 1, 2, 4, ...): every lane of a
// group of 2^levels ends with the group's sum (a + b == b + a, so partners agree bit for bit).
__device__ __forceinline__ float lane_pairwise(float v, int levels) {
  for (int l = 0, o = 1; l < levels; ++l, o <<= 1) v = v + __shfl_xor_sync(0xFFFFFFFFu, v, o);
  return v;
}

// reductions.row_sum of term(x[c]) over one row, by one warp; every lane returns the sum. Lane l
// holds chunk l of each 32-chunk sweep (8 consecutive elements); the sweep's chunks are summed
// pairwise across lanes, the sweeps pairwise by a binary-counter stack. Terms past the row are
// +0 (not term(0)): the spec pads the summed values.
template <typename In, typename Term>
__device__ __forceinline__ float row_sum_warp(const In* row, int64_t C, bool vec, Term term) {
  const int lane = threadIdx.x & 31;
  const int64_t chunks = (C + 7) / 8;
  int64_t padded = 1;
  int levels = 0;
  while (padded < chunks) {
    padded <<= 1;
    ++levels;
  }
  auto chunk_sum = [&](int64_t chunk) {
    float v[8];
    row_floats8(row, 8 * chunk, C, vec, v);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = 8 * chunk + i < C ? term(v[i]) : 0.0f;
    return jq::chunk_sum8(v);
  };
  if (padded <= 32) {  // one sweep of `padded` lanes
    const float s = lane_pairwise(chunk_sum(lane), levels);
    return __shfl_sync(0xFFFFFFFFu, s, 0);
  }
  const int64_t sweeps = padded / 32;
  jq::PairwiseStack stack;
  for (int64_t s0 = 0; s0 < sweeps; s0 += 4) {
    float part[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) part[u] = s0 + u < sweeps ? chunk_sum(32 * (s0 + u) + lane) : 0.0f;
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      if (s0 + u < sweeps) stack.push(lane_pairwise(part[u], 5));
    }
  }
  return stack.levels[levels - 5];
}

// `amax` and the largest |y| of the normalized output at columns c .. c+7 of a row (x's values
// xv) rounded to the output type, as bits. kWhole: all 8 columns are inside the row.
template <bool kWhole>
__device__ __forceinline__ uint32_t chunk_output_amax(const NormStatsParams& p, int64_t c, const float* xv,
                                                      float mean, float rsigma, bool vec_params, uint32_t amax) {
  float g[8] = {}, b[8] = {};
  if (p.has_scale) row_floats8(p.scale, c, p.C, vec_params, g);
  if (p.has_bias) row_floats8(p.bias, c, p.C, vec_params, b);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    if (!kWhole && c + i >= p.C) continue;
    const float y = jq::norm_value(xv[i], mean, rsigma, g[i], b[i], p.layernorm, p.has_scale, p.has_bias);
    amax = max(amax, jq::abs_bits(round_to_device(p.out, y)));
  }
  return amax;
}

// The largest |y| of a row's normalized output rounded to the output type, as bits, over the
// lanes' columns (a loop, not unrolled: one copy of the norm's code; the row is in L1/L2 by
// then).
template <typename In>
__device__ __forceinline__ uint32_t row_output_amax(const NormStatsParams& p, const In* row, float mean,
                                                    float rsigma) {
  const int lane = threadIdx.x & 31;
  const bool vec_params = p.vec;  // C % 8 == 0 and XLA's float32 buffers are 16-byte aligned
  uint32_t amax = 0;
  for (int64_t c = 8 * lane; c < p.C; c += 256) {
    float xv[8];
    row_floats8(row, c, p.C, p.vec, xv);
    amax = chunk_output_amax<false>(p, c, xv, mean, rsigma, vec_params, amax);
  }
  return amax;
}

// A row of `kSweeps` 32-chunk sweeps held in registers by one warp (lane l: chunk 32 s + l of
// sweep s, 8 consecutive elements as raw 16-byte words), so the sums read x once. Streamed
// (row_sum_warp), the mean and the variance each read the row with a few loads in flight a
// lane, and the sweeps' partial sums go through PairwiseStack's array in local memory (168
// bytes of stack). For a 16-byte aligned row with C % 8 == 0 (a chunk is wholly inside the row
// or wholly past it) whose chunks pad to exactly 32 * kSweeps: the sums are row_sum_warp's,
// term for term and in its order (each sweep pairwise across lanes, the sweeps pairwise
// neighbours first, as PairwiseStack merges a power of two of them).
template <typename In, int kSweeps>
struct RowInRegisters {
  static constexpr int kWords = sizeof(In) / 2;  // 16-byte words a chunk: 1 (16-bit), 2 (float32)
  uint4 raw[kSweeps][kWords];
  bool inside[kSweeps];

  __device__ __forceinline__ void load(const In* row, int64_t C, int lane) {
#pragma unroll
    for (int s = 0; s < kSweeps; ++s) {
      const int64_t c = 8 * (32 * int64_t(s) + lane);
      inside[s] = c < C;
      const uint4* p = reinterpret_cast<const uint4*>(row + c);
#pragma unroll
      for (int w = 0; w < kWords; ++w) raw[s][w] = inside[s] ? __ldg(p + w) : make_uint4(0, 0, 0, 0);
    }
  }

  __device__ __forceinline__ void values(int s, float* v) const {
    alignas(16) In e[8];
#pragma unroll
    for (int w = 0; w < kWords; ++w) reinterpret_cast<uint4*>(e)[w] = raw[s][w];
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = to_float(e[i]);
  }

  // reductions.row_sum of term(x[c]) over the row; every lane returns it.
  template <typename Term>
  __device__ __forceinline__ float sum(Term term) const {
    float part[kSweeps];
#pragma unroll
    for (int s = 0; s < kSweeps; ++s) {
      float v[8];
      values(s, v);
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = term(v[i]);
      part[s] = lane_pairwise(inside[s] ? jq::chunk_sum8(v) : 0.0f, 5);
    }
#pragma unroll
    for (int w = 1; w < kSweeps; w *= 2) {
#pragma unroll
      for (int s = 0; s < kSweeps; s += 2 * w) part[s] = part[s] + part[s + w];
    }
    return part[0];
  }

  // row_output_amax's value from the held row: no second read of x.
  __device__ __forceinline__ uint32_t output_amax(const NormStatsParams& p, float mean, float rsigma,
                                                  int lane) const {
    uint32_t amax = 0;
#pragma unroll
    for (int s = 0; s < kSweeps; ++s) {
      if (!inside[s]) continue;  // a chunk is wholly inside the row or wholly past it
      float v[8];
      values(s, v);
      amax = chunk_output_amax<true>(p, 8 * (32 * int64_t(s) + lane), v, mean, rsigma, true, amax);
    }
    return amax;
  }
};

// The mean (LayerNorm) and rsigma of a row from `row_sum(term)`, reductions.row_sum of term(x)
// over it (every lane gets them).
template <typename RowSum>
__device__ __forceinline__ void row_stats(const NormStatsParams& p, RowSum row_sum, float* mean, float* rsigma) {
  const float k = static_cast<float>(p.C);
  const bool layernorm = p.layernorm;
  const float m = layernorm ? jq::div_f32(row_sum([](float v) { return v; }), k) : 0.0f;
  const float var = jq::div_f32(row_sum([m, layernorm](float v) {
                                  const float d = layernorm ? v - m : v;
                                  return jq::mul_rn(d, d);
                                }),
                                k);
  *mean = m;
  *rsigma = jq::rsigma_of(var, p.epsilon);
}

// One warp per row: mean (LayerNorm), rsigma, and the amax of the normalized output rounded to
// the output type. kSweeps > 0: the row held in registers for the sums and (up to 8 sweeps)
// the amax (RowInRegisters; launch_norm_stats says where), one read of x; 0: the sums stream
// the row (row_sum_warp); the amax elsewhere is a third sweep (the row in L1/L2 by then).
template <typename In, int kSweeps>
__global__ void __launch_bounds__(kThreads) norm_stats_kernel(const NormStatsParams p) {
  __shared__ uint32_t red[kThreads / 32];
  const int lane = threadIdx.x & 31;
  const int64_t r = int64_t(blockIdx.x) * (kThreads / 32) + (threadIdx.x >> 5);
  const bool want_amax = p.amax != nullptr && (p.gate == nullptr || __ldg(p.gate) == 0.0f);
  uint32_t amax = 0;
  if (r < p.R) {
    const In* row = static_cast<const In*>(p.x) + r * p.C;
    float mean, rsigma;
    if constexpr (kSweeps > 0) {
      RowInRegisters<In, kSweeps> regs;
      regs.load(row, p.C, lane);
      row_stats(p, [&](auto term) { return regs.sum(term); }, &mean, &rsigma);
      if (want_amax) {
        // Up to 8 sweeps (16-bit rows to 2048 columns, float32 to 1024) from the held row; the
        // 16-sweep instance unrolled that way is ~24,000 instructions, so it re-reads the row.
        if constexpr (kSweeps <= 8) {
          amax = regs.output_amax(p, mean, rsigma, lane);
        } else {
          amax = row_output_amax(p, row, mean, rsigma);
        }
      }
    } else {
      row_stats(p, [&](auto term) { return row_sum_warp(row, p.C, p.vec, term); }, &mean, &rsigma);
      if (want_amax) amax = row_output_amax(p, row, mean, rsigma);
    }
    if (lane == 0) {
      if (p.mean) p.mean[r] = mean;
      p.rsigma[r] = rsigma;
    }
  }
  if (want_amax) {
    amax = cta_max(amax, red);
    if (threadIdx.x == 0) atomic_max_float(p.amax, amax);
  }
}

// The sweeps a row of C columns pads to (row_sum_warp: chunks of 8, a power of two of them, 32
// a sweep), or 0 when it takes one partial sweep.
inline int64_t norm_sweeps(int64_t C) {
  int64_t padded = 1;
  while (padded < (C + 7) / 8) padded <<= 1;
  return padded >= 32 ? padded / 32 : 0;
}

// Launches the statistics over p: the row in registers where it fits (16-bit inputs up to 4096
// columns, float32 up to 2048), streamed otherwise. Same outputs.
template <typename In>
void launch_norm_stats(cudaStream_t stream, const NormStatsParams& p, unsigned blocks) {
  constexpr int64_t kMaxSweeps = sizeof(In) == 2 ? 16 : 8;
  const int64_t sweeps = p.vec ? norm_sweeps(p.C) : 0;
  switch (sweeps > kMaxSweeps ? 0 : sweeps) {
    case 1: norm_stats_kernel<In, 1><<<blocks, kThreads, 0, stream>>>(p); return;
    case 2: norm_stats_kernel<In, 2><<<blocks, kThreads, 0, stream>>>(p); return;
    case 4: norm_stats_kernel<In, 4><<<blocks, kThreads, 0, stream>>>(p); return;
    case 8: norm_stats_kernel<In, 8><<<blocks, kThreads, 0, stream>>>(p); return;
    case 16:
      if constexpr (kMaxSweeps >= 16) {
        norm_stats_kernel<In, 16><<<blocks, kThreads, 0, stream>>>(p);
        return;
      }
      break;
    default: break;
  }
  norm_stats_kernel<In, 0><<<blocks, kThreads, 0, stream>>>(p);
}

// The amax of a producer's matrix (activation / activation gradient; current scaling, or the
// first step of delayed scaling when `gate`, the state's scale, is 0).
template <typename P>
__global__ void __launch_bounds__(kThreads) producer_amax_kernel(const P prod, int64_t R, int64_t C,
                                                                 const float* gate, float* amax) {
  if (gate != nullptr && __ldg(gate) != 0.0f) return;  // uniform across the grid
  __shared__ uint32_t red[kThreads / 32];
  const int64_t per_row = (C + 7) / 8, total = R * per_row;
  uint32_t m = 0;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < total; i += int64_t(gridDim.x) * kThreads) {
    alignas(16) typename P::Out v[8];
    prod.load8(i / per_row, (i % per_row) * 8, v);
#pragma unroll
    for (int k = 0; k < 8; ++k) m = max(m, jq::abs_bits(to_float(v[k])));
  }
  m = cta_max(m, red);
  if (threadIdx.x == 0) atomic_max_float(amax, m);
}

}  // namespace
}  // namespace jqffi
