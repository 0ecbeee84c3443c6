// The grouped amax kernels and the loads they share with the grouped quantize kernels (CUDA):
//   grouped_amax_kernel      per-group max |x| over each group's rows of x (one warp a row)
//   grouped_amax_span_kernel the same over spans of ~64 KB of whole rows (one CTA a span): a span
//                            inside one group is read as one flat run of 16-byte loads
//   grouped_rht_amax_kernel  per-group max |RHT(chunk)| over the 16-position chunks of a token
//                            layout (NVFP4 rht: the amax of the Hadamard-transformed columnwise
//                            copy), one CTA a chunk; with PLAIN also the plain max |x| of the
//                            same values (the rowwise copy's, from the same read)
// All reduce |x| as float32 bit patterns with atomicMax (NaN above inf: NaN-propagating, as
// the reference's segment max), into an amax[G] the handler cleared.
// `launch_grouped_amax` picks between the two (the span kernel where rows are 16-byte aligned).
// Either kernel with `p.gate` (jaxquant_grouped_amax_gated) returns at once, leaving the
// zeros, when every gate[g] (a delayed-scaling group's scale) is nonzero: the just-in-time first
// scale reads the amax only where the scale is 0.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "grouped/grouped_params.h"
#include "jaxquant_numerics.h"

namespace jqffi {
namespace {

template <int TYPE>
__device__ __forceinline__ float load_in(const void* x, int64_t i) {
  if constexpr (TYPE == 0) return __uint_as_float(uint32_t(static_cast<const uint16_t*>(x)[i]) << 16);
  if constexpr (TYPE == 1) return __half2float(static_cast<const __half*>(x)[i]);
  return static_cast<const float*>(x)[i];
}

// 8 consecutive values of x as stored (zeros past `n_valid`): the raw words stay in registers
// until the batch's loads are all issued, half the registers of their float32 values (16-bit x).
template <int TYPE>
struct Raw8 {
  uint32_t w[TYPE == 2 ? 8 : 4];
};

template <int TYPE>
__device__ __forceinline__ Raw8<TYPE> load_raw8(const void* x, int64_t off, int n_valid, bool vec) {
  Raw8<TYPE> r;
  if (vec && n_valid >= 8) {
    const uint4* q = reinterpret_cast<const uint4*>(static_cast<const char*>(x) + off * (TYPE == 2 ? 4 : 2));
    const uint4 a = __ldg(q);
    r.w[0] = a.x; r.w[1] = a.y; r.w[2] = a.z; r.w[3] = a.w;
    if constexpr (TYPE == 2) {
      const uint4 b = __ldg(q + 1);
      r.w[4] = b.x; r.w[5] = b.y; r.w[6] = b.z; r.w[7] = b.w;
    }
    return r;
  }
  if constexpr (TYPE == 2) {
    const uint32_t* v = static_cast<const uint32_t*>(x) + off;
#pragma unroll
    for (int i = 0; i < 8; ++i) r.w[i] = i < n_valid ? v[i] : 0u;
  } else {
    const uint16_t* v = static_cast<const uint16_t*>(x) + off;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      r.w[i] = (2 * i < n_valid ? uint32_t(v[2 * i]) : 0u) | (2 * i + 1 < n_valid ? uint32_t(v[2 * i + 1]) << 16 : 0u);
    }
  }
  return r;
}

// Value i of `r` as float32 (load_in's conversion).
template <int TYPE>
__device__ __forceinline__ float value_of(const Raw8<TYPE>& r, int i) {
  if constexpr (TYPE == 2) {
    return __uint_as_float(r.w[i]);
  } else {
    const uint32_t h = (i & 1) ? r.w[i / 2] >> 16 : r.w[i / 2] & 0xFFFFu;
    if constexpr (TYPE == 0) return __uint_as_float(h << 16);
    return __half2float(__ushort_as_half(uint16_t(h)));
  }
}

// 8 consecutive inputs of one row, as float (zeros past `n_valid`).
template <int TYPE>
__device__ __forceinline__ void load8(const void* x, int64_t offset, int n_valid, bool vec, float* v) {
  const Raw8<TYPE> r = load_raw8<TYPE>(x, offset, n_valid, vec);
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = value_of<TYPE>(r, i);
}

__device__ __forceinline__ int upper_group(const int32_t* starts, int G, int64_t pos) {
  // Largest g in [0, G] with starts[g] <= pos (G: at or past the end of the last group).
  int lo = 0, hi = G;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (int64_t(__ldg(starts + mid)) <= pos) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Whether the CTA's group amaxes are wanted: with `p.gate` (jaxquant_grouped_amax_gated) only
// while some group's scale is still 0. The same answer in every CTA, so the grid exits together.
__device__ __forceinline__ bool amax_wanted(const QuantizeParams& p) {
  if (p.gate == nullptr) return true;
  bool open = false;
  for (int64_t g = threadIdx.x; g < p.G; g += blockDim.x) open |= __ldg(p.gate + g) == 0.0f;
  return __syncthreads_or(open);
}

// One warp a row of x at a time; a lane keeps kLoads 16-byte loads of its row in flight (one
// at a time would leave too few bytes in flight per SM to cover the memory latency).
template <int TYPE>
__global__ void __launch_bounds__(256) grouped_amax_kernel(const QuantizeParams p) {
  constexpr int kLoads = 4;
  if (!amax_wanted(p)) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t valid_rows = min(int64_t(__ldg(p.starts + p.G)), p.T);
  const bool vec = (TYPE == 2 ? p.C % 4 == 0 : p.C % 8 == 0) &&
                   (reinterpret_cast<uintptr_t>(p.x) & 15) == 0;
  uint32_t* amax = reinterpret_cast<uint32_t*>(p.amax);
  for (int64_t r = int64_t(blockIdx.x) * 8 + warp; r < valid_rows; r += int64_t(gridDim.x) * 8) {
    uint32_t m = 0;
    int64_t c = int64_t(lane) * 8;
    if (vec) {  // kLoads full 16-byte loads a lane in flight before any is reduced
      for (; c + (kLoads - 1) * 256 + 8 <= p.C; c += kLoads * 256) {
        float v[kLoads][8];
#pragma unroll
        for (int k = 0; k < kLoads; ++k) load8<TYPE>(p.x, r * p.C + c + k * 256, 8, true, v[k]);
#pragma unroll
        for (int k = 0; k < kLoads; ++k) {
#pragma unroll
          for (int i = 0; i < 8; ++i) m = max(m, jq::abs_bits(v[k][i]));
        }
      }
    }
    for (; c < p.C; c += 256) {
      float v[8];
      load8<TYPE>(p.x, r * p.C + c, int(min(int64_t(8), p.C - c)), vec, v);
#pragma unroll
      for (int i = 0; i < 8; ++i) m = max(m, jq::abs_bits(v[i]));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
    if (lane == 0) {
      const int g = upper_group(p.starts, int(p.G), r);
      if (g < p.G) atomicMax(amax + g, m);
    }
  }
}

// Elements (16-bit inputs; half as many float32 ones) of the span a grouped_amax_span_kernel
// CTA reads: whole rows, ~64 KB.
constexpr int64_t kAmaxSpanElems = 32768;

// Rows of a span: at least one, about kAmaxSpanElems elements (kAmaxSpanElems / 2 for float32).
inline int64_t amax_span_rows(int64_t C, int type) {
  return std::max<int64_t>(1, (type == 2 ? kAmaxSpanElems / 2 : kAmaxSpanElems) / std::max<int64_t>(C, 1));
}

// One CTA a span of `span_rows` whole rows of x (rows past starts[G] belong to no group and are
// not read). Session 28 (H200): one warp a row of 1408 bf16 values (the 64-expert weights) read
// at 2.3 TB/s, its row's last loads one at a time; a span inside one group (nearly all of
// them) is one flat run of 8-value loads, kLoads in flight a thread, one atomicMax a CTA. A
// span crossing a group start is read a row a warp, each row's max to its own group.
// Needs C % 8 == 0 and x 16-byte aligned (launch_grouped_amax checks): every 8-value load lies
// in one row.
template <int TYPE>
__global__ void __launch_bounds__(256) grouped_amax_span_kernel(const QuantizeParams p, int64_t span_rows) {
  constexpr int kLoads = TYPE == 2 ? 4 : 8;  // 8-value loads in flight a thread: 64 or 128 bytes
  __shared__ uint32_t red[8];
  if (!amax_wanted(p)) return;
  const int64_t valid_rows = min(int64_t(__ldg(p.starts + p.G)), p.T);
  const int64_t r0 = int64_t(blockIdx.x) * span_rows;
  if (r0 >= valid_rows) return;
  const int64_t r1 = min(r0 + span_rows, valid_rows);
  const int G = int(p.G);
  const int g0 = upper_group(p.starts, G, r0);  // < G: r0 is below starts[G]
  uint32_t* amax = reinterpret_cast<uint32_t*>(p.amax);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (int64_t(__ldg(p.starts + g0 + 1)) >= r1) {  // the whole span in group g0
    const int64_t end = r1 * p.C;
    uint32_t m = 0;
    int64_t base = r0 * p.C + int64_t(threadIdx.x) * 8;
    for (; base + (kLoads - 1) * 2048 < end; base += kLoads * 2048) {  // kLoads loads, all in range
      Raw8<TYPE> raw[kLoads];
#pragma unroll
      for (int k = 0; k < kLoads; ++k) raw[k] = load_raw8<TYPE>(p.x, base + k * 2048, 8, true);
#pragma unroll
      for (int k = 0; k < kLoads; ++k) {
#pragma unroll
        for (int i = 0; i < 8; ++i) m = max(m, jq::abs_bits(value_of<TYPE>(raw[k], i)));
      }
    }
    for (; base < end; base += 2048) {  // the span's last loads (2048 values a CTA pass)
      const Raw8<TYPE> raw = load_raw8<TYPE>(p.x, base, 8, true);
#pragma unroll
      for (int i = 0; i < 8; ++i) m = max(m, jq::abs_bits(value_of<TYPE>(raw, i)));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
    if (lane == 0) red[warp] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 1; w < 8; ++w) m = max(m, red[w]);
      atomicMax(amax + g0, m);
    }
    return;
  }
  for (int64_t r = r0 + warp; r < r1; r += 8) {  // across a group start: a row a warp
    uint32_t m = 0;
    for (int64_t c = int64_t(lane) * 8; c < p.C; c += 256) {
      const Raw8<TYPE> raw = load_raw8<TYPE>(p.x, r * p.C + c, 8, true);
#pragma unroll
      for (int i = 0; i < 8; ++i) m = max(m, jq::abs_bits(value_of<TYPE>(raw, i)));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
    if (lane == 0) atomicMax(amax + upper_group(p.starts, G, r), m);
  }
}

// Per group, the max |.| of the Hadamard-transformed 16-position chunks of the token layout
// whose group starts are `pstarts` (multiples of 16): chunk k holds positions 16k .. 16k+15, the
// rows starts[g] + (16k - pstarts[g]) .. of x while inside group g, zeros after. One CTA a chunk;
// a thread holds W features x 16 rows as raw inputs (one 16-byte load a row, as amax.cuh's
// amax_kernel) and transforms one feature at a time. PLAIN: also max |x| into `plain` (every
// row of every group is in exactly one chunk, so this is `grouped_amax_kernel`'s result).
template <int TYPE, bool PLAIN = false>
__global__ void __launch_bounds__(256, 2) grouped_rht_amax_kernel(const QuantizeParams p,
                                                               float* plain = nullptr) {
  constexpr int W = TYPE == 2 ? 4 : 8;  // features per thread: 16 bytes of a row
  __shared__ uint32_t red[8], red_plain[8];
  const int64_t pos0 = int64_t(blockIdx.x) * 16;
  const int G = int(p.G);
  const int g = upper_group(p.pstarts, G, pos0);
  if (g >= G) return;  // the whole CTA: a chunk of no group
  const int64_t local = pos0 - __ldg(p.pstarts + g);
  const int64_t n = min(int64_t(16), int64_t(__ldg(p.starts + g + 1)) - __ldg(p.starts + g) - local);
  if (n <= 0) return;  // padding only: zeros change no amax
  const int64_t src0 = __ldg(p.starts + g) + local;
  const bool vec = p.C % W == 0 && (reinterpret_cast<uintptr_t>(p.x) & 15) == 0;
  uint32_t m = 0, mp = 0;
  for (int64_t c = int64_t(threadIdx.x) * W; c < p.C; c += 256 * W) {
    uint4 raw[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int64_t offset = (src0 + i) * p.C + c;
      if (vec && i < n) {
        raw[i] = __ldg(reinterpret_cast<const uint4*>(static_cast<const char*>(p.x) + offset * (TYPE == 2 ? 4 : 2)));
      } else {
        uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
        for (int j = 0; j < W; ++j) {
          if (i >= n || c + j >= p.C) continue;
          const float v = load_in<TYPE>(p.x, offset + j);
          if constexpr (TYPE == 2) {
            w[j] = __float_as_uint(v);
          } else {  // re-pack the 16-bit input
            const uint32_t h = TYPE == 0 ? (__float_as_uint(v) >> 16) : uint32_t(__half_as_ushort(__float2half_rn(v)));
            w[j / 2] |= h << (16 * (j % 2));
          }
        }
        raw[i] = make_uint4(w[0], w[1], w[2], w[3]);
      }
    }
#pragma unroll
    for (int f = 0; f < W; ++f) {
      float w[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const uint32_t word = f / (W / 4) == 0 ? raw[i].x : f / (W / 4) == 1 ? raw[i].y : f / (W / 4) == 2 ? raw[i].z : raw[i].w;
        if constexpr (TYPE == 2) {
          w[i] = __uint_as_float(word);
        } else {
          const uint16_t h = uint16_t(word >> (16 * (f % 2)));
          w[i] = TYPE == 0 ? __uint_as_float(uint32_t(h) << 16) : __half2float(__ushort_as_half(h));
        }
      }
      if constexpr (PLAIN) {
#pragma unroll
        for (int i = 0; i < 16; ++i) mp = max(mp, jq::abs_bits(w[i]));
      }
      jq::rht16(w);
#pragma unroll
      for (int i = 0; i < 16; ++i) m = max(m, jq::abs_bits(w[i]));
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
    if constexpr (PLAIN) mp = max(mp, __shfl_xor_sync(0xFFFFFFFFu, mp, o));
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) {
    red[warp] = m;
    red_plain[warp] = mp;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < 8; ++w) {
      m = max(m, red[w]);
      mp = max(mp, red_plain[w]);
    }
    atomicMax(reinterpret_cast<uint32_t*>(p.amax) + g, m);
    if constexpr (PLAIN) atomicMax(reinterpret_cast<uint32_t*>(plain) + g, mp);
  }
}

template <typename F>
void by_type(int type, F&& f) {
  switch (type) {
    case 0: f(std::integral_constant<int, 0>{}); break;
    case 1: f(std::integral_constant<int, 1>{}); break;
    default: f(std::integral_constant<int, 2>{}); break;
  }
}

unsigned amax_grid(int64_t T) {
  return unsigned(std::max<int64_t>(1, std::min<int64_t>((T + 7) / 8, 132 * 16)));
}

// The amax pass into p.amax (cleared by the caller): the span kernel where every row starts
// 16-byte aligned (C % 8 == 0, x aligned), else a warp a row.
template <int TYPE>
void launch_grouped_amax(const QuantizeParams& p, cudaStream_t stream) {
  if (p.C % 8 == 0 && (reinterpret_cast<uintptr_t>(p.x) & 15) == 0 && p.C > 0) {
    const int64_t rows = amax_span_rows(p.C, TYPE);
    // x's rows are int32 (as the offsets), so there are fewer spans than the grid's 2^31 - 1.
    const int64_t spans = std::max<int64_t>(1, (p.T + rows - 1) / rows);
    grouped_amax_span_kernel<TYPE><<<unsigned(spans), 256, 0, stream>>>(p, rows);
  } else {
    grouped_amax_kernel<TYPE><<<amax_grid(p.T), 256, 0, stream>>>(p);
  }
}

}  // namespace
}  // namespace jqffi
