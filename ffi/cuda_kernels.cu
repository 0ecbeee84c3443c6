// CUDA kernels and handlers of every jaxquant FFI target (sm_90a; see CMakeLists.txt).
//
// Design (ffi/NOTES.md has the reasoning and the measurements):
//  * Quantize is one pass over x per call: a CTA loads a TR x TC tile with 16-byte loads, makes
//    the rowwise output from registers (block reductions by warp shuffles), keeps the tile in a
//    swizzled shared-memory buffer and makes the transposed columnwise output from it: a thread
//    owns a 16-row chunk of one column (one NVFP4 block / RHT chunk, half an MXFP8 block, an
//    eighth of a 1x128 block, reduced across lanes by shuffles) and the lanes of a warp cover
//    consecutive chunks, so each warp store writes a few output rows with 64-128 contiguous
//    bytes each (writing 32 different output rows per store ran at half the bandwidth).
//  * Per-tensor amax (and the per-row / per-column amax of row-scaled NVFP4) is a separate
//    kernel (`jaxquant_amax`) whose result feeds the quantize call, so a sharded caller can
//    insert a pmax in between. Formats whose scales don't depend on the tensor amax (MXFP8,
//    Float8Block, delayed FP8) fold the amax output into the quantize pass with atomicMax on
//    the float bits (|x| bits order like the floats and put NaN above inf: NaN-propagating).
//  * Handlers use only the FFI stream, no host syncs and no allocations (outputs that are
//    reduced with atomics are cleared with cudaMemsetAsync), so they are marked
//    command-buffer compatible.
//  * NVFP4 data is written straight into XLA's packed float4_e2m1fn layout. An output whose
//    row length is odd (rows then share bytes) takes a simple two-kernel path (scales, then one
//    thread per output byte).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "handler_common.h"
#include "handlers.h"

namespace jqffi {
namespace {

constexpr int kThreads = 256;

struct __align__(2) BF16 { uint16_t u; };
struct __align__(2) F16 { uint16_t u; };

__device__ __forceinline__ float to_float(BF16 v) { return __uint_as_float(uint32_t(v.u) << 16); }
__device__ __forceinline__ float to_float(F16 v) { return __half2float(__ushort_as_half(v.u)); }
__device__ __forceinline__ float to_float(float v) { return v; }

template <typename T> __device__ __forceinline__ T zero_of() { return T{0}; }

__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// Loads x[r, c .. c+7] (zeros outside the matrix) into `out` (16-byte aligned).
template <typename In>
__device__ __forceinline__ void load8(const In* __restrict__ x, int64_t R, int64_t C, int64_t r,
                                      int64_t c, bool vec, In* out) {
  if (vec && r < R && c + 8 <= C) {
    const uint4* p = reinterpret_cast<const uint4*>(x + r * C + c);
    uint4* o = reinterpret_cast<uint4*>(out);
    o[0] = __ldg(p);
    if constexpr (sizeof(In) == 4) o[1] = __ldg(p + 1);
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = (r < R && c + i < C) ? x[r * C + c + i] : zero_of<In>();
  }
}

template <typename In>
__device__ __forceinline__ void copy8(In* dst, const In* src) {
  reinterpret_cast<uint4*>(dst)[0] = reinterpret_cast<const uint4*>(src)[0];
  if constexpr (sizeof(In) == 4) reinterpret_cast<uint4*>(dst)[1] = reinterpret_cast<const uint4*>(src)[1];
}

// Stores the low n bytes of (w0, w1) (little-endian) at dst; one 8-byte store when full.
// (Unrolled with constant indices so the words stay in registers.)
__device__ __forceinline__ void store_bytes8(uint8_t* dst, uint32_t w0, uint32_t w1, int n, bool vec) {
  if (vec && n == 8) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(w0, w1);
    return;
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    if (i < n) dst[i] = uint8_t(((i < 4 ? w0 : w1) >> (8 * (i % 4))) & 0xFF);
  }
}

__device__ __forceinline__ void store_bytes16(uint8_t* dst, const uint32_t (&w)[4], int n, bool vec) {
  if (vec && n == 16) {
    *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
    return;
  }
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    if (i < n) dst[i] = uint8_t((w[i / 4] >> (8 * (i % 4))) & 0xFF);
  }
}

__device__ __forceinline__ void store_bytes4(uint8_t* dst, uint32_t w, int n, bool vec) {
  if (vec && n == 4) {
    *reinterpret_cast<uint32_t*>(dst) = w;
    return;
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (i < n) dst[i] = uint8_t((w >> (8 * i)) & 0xFF);
  }
}

__device__ __forceinline__ uint32_t warp_max(uint32_t v) {
#pragma unroll
  for (int o = 16; o; o >>= 1) v = max(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  return v;
}

// Max over the CTA, returned to every thread. `red` holds kThreads / 32 words.
__device__ __forceinline__ uint32_t cta_max(uint32_t v, uint32_t* red) {
  v = warp_max(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  v = lane < kThreads / 32 ? red[lane] : 0u;
  return warp_max(v);
}

__device__ __forceinline__ void atomic_max_float(float* out, uint32_t abs_bits) {
  atomicMax(reinterpret_cast<unsigned int*>(out), abs_bits);
}

// Tile geometry of the quantize kernels. Load (row) phase: each thread holds 8 consecutive
// elements of a tile row per pass. Column phase: each thread owns a 16-row chunk of one tile
// column (lane % NJ = the chunk, so a block of 32 or 128 rows is reduced with warp shuffles),
// and the lanes of a warp cover CPW columns: a warp's store writes CPW output rows with
// NJ * (8 or 16) contiguous bytes each.
template <typename In, int TR_, int TC_>
struct Geometry {
  static constexpr int TR = TR_, TC = TC_;
  static constexpr int TPR = TC / 8;           // threads per tile row
  static constexpr int RPP = kThreads / TPR;   // tile rows per pass
  static constexpr int NP = TR / RPP;          // passes
  static constexpr int NJ = TR / 16;           // 16-row chunks per column
  static constexpr int CPW = 32 / NJ;          // columns per warp in the column phase
  static constexpr int CPI = CPW * (kThreads / 32);  // columns per column-phase iteration
  static constexpr int ITERS = TC / CPI;
  static constexpr int EPC = 16 / sizeof(In);  // elements per 16-byte chunk
  // 16-byte chunks of a tile row are XOR-swizzled by the row's 16-row chunk index, so the NJ
  // lanes reading one column at rows 16j + i hit distinct banks (f32 rows span two chunks per
  // 8 columns, hence the factor 2 there).
  static constexpr int SWM = (sizeof(In) == 4 && NJ == 4) ? 2 : 1;
  static constexpr int kSmemBytes = TR * TC * int(sizeof(In));
  static_assert(TPR * RPP == kThreads && NP * RPP == TR && ITERS * CPI == TC, "tile shape");

  __device__ static __forceinline__ int offset(int r, int c) {
    const int chunk = (c / EPC) ^ (((r >> 4) & (NJ - 1)) * SWM);
    return r * TC + chunk * EPC + c % EPC;
  }
};

// Writes the 8 elements a load-phase thread holds at (r, c..c+7) into the swizzled tile.
template <typename G, typename In>
__device__ __forceinline__ void tile_store8(In* tile, int r, int c, const In* v) {
  reinterpret_cast<uint4*>(tile + G::offset(r, c))[0] = reinterpret_cast<const uint4*>(v)[0];
  if constexpr (sizeof(In) == 4) {
    reinterpret_cast<uint4*>(tile + G::offset(r, c + 4))[0] = reinterpret_cast<const uint4*>(v)[1];
  }
}

// Reads 16 rows (r0 .. r0+15) of tile column c as floats.
template <typename G, typename In>
__device__ __forceinline__ void tile_column16(const In* tile, int r0, int c, float* w) {
#pragma unroll
  for (int i = 0; i < 16; ++i) w[i] = to_float(tile[G::offset(r0 + i, c)]);
}

// The column-phase coordinates of this thread in iteration `it`.
template <typename G>
struct ColumnSlot {
  int cl;  // tile column
  int j;   // 16-row chunk
  __device__ __forceinline__ ColumnSlot(int it) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    j = lane % G::NJ;
    cl = it * G::CPI + warp * G::CPW + lane / G::NJ;
  }
};

struct TileIndex {
  int64_t r0, c0;
};

__device__ __forceinline__ TileIndex tile_index(int64_t C, int TR, int TC) {
  const int64_t ntc = (C + TC - 1) / TC;
  return {int64_t(blockIdx.x / ntc) * TR, int64_t(blockIdx.x % ntc) * TC};
}

inline unsigned num_tiles(int64_t R, int64_t C, int TR, int TC) {
  return unsigned(ceil_div(R, TR) * ceil_div(C, TC));
}

inline bool aligned(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// Launches a tile kernel with `smem` bytes of dynamic shared memory (opting in above 48 KiB).
template <typename Kernel, typename Params>
cudaError_t launch_tiles(Kernel kernel, unsigned tiles, int smem, cudaStream_t stream, const Params& p) {
  if (smem > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
  }
  kernel<<<tiles, kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

// ============================================================================================
// amax: per tensor, per row, per column, optionally of rht16(x^T) (16-row chunks of columns).
// A CTA owns a strip of 32*W columns and a range of rows; each warp takes 16-row chunks.
// ============================================================================================

struct AmaxParams {
  const void* x;
  int64_t R, C, rows_per_cta;
  bool vec;
  float *tensor, *tensor_rht, *rows, *cols, *cols_rht;
  const float* gate;  // jaxquant_amax_gated: skip (outputs stay zero) unless *gate == 0
};

template <typename In>
__global__ void __launch_bounds__(kThreads) amax_kernel(const AmaxParams p) {
  if (p.gate != nullptr && __ldg(p.gate) != 0.f) return;  // uniform across the grid
  constexpr int W = 16 / sizeof(In);  // columns per thread (one 16-byte load per row)
  constexpr int STRIP = 32 * W;
  __shared__ uint32_t s_col[kThreads / 32][STRIP];
  __shared__ uint32_t s_col_rht[kThreads / 32][STRIP];
  __shared__ uint32_t red[kThreads / 32];
  const In* x = static_cast<const In*>(p.x);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t nstrips = (p.C + STRIP - 1) / STRIP;
  const int64_t strip = blockIdx.x % nstrips, group = blockIdx.x / nstrips;
  const int64_t c = strip * STRIP + lane * W;
  const int64_t row_begin = group * p.rows_per_cta;
  const int64_t row_end = min64(p.R, row_begin + p.rows_per_cta);
  const bool want_rht = p.tensor_rht || p.cols_rht;
  uint32_t col_part[W], col_rht_part[W];
#pragma unroll
  for (int j = 0; j < W; ++j) col_part[j] = col_rht_part[j] = 0;
  for (int64_t r0 = row_begin + warp * 16; r0 < row_end; r0 += (kThreads / 32) * 16) {
    alignas(16) In raw[16][W];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int64_t r = r0 + i;
      if (p.vec && r < p.R && c + W <= p.C) {
        *reinterpret_cast<uint4*>(raw[i]) = __ldg(reinterpret_cast<const uint4*>(x + r * p.C + c));
      } else {
#pragma unroll
        for (int j = 0; j < W; ++j) raw[i][j] = (r < p.R && c + j < p.C) ? x[r * p.C + c + j] : zero_of<In>();
      }
    }
    uint32_t row_part[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      row_part[i] = 0;
#pragma unroll
      for (int j = 0; j < W; ++j) {
        const uint32_t a = jq::abs_bits(to_float(raw[i][j]));
        row_part[i] = max(row_part[i], a);
        col_part[j] = max(col_part[j], a);
      }
    }
    if (p.rows) {
      // Reduce-scatter the 16 row maxima across the warp (8+4+2+1+1 shuffles instead of 16x5):
      // afterwards lane l holds row 8*b4 + 4*b3 + 2*b2 + b1 (b_k = bit k of l), max over lanes.
#pragma unroll
      for (int half = 8, bit = 4; half >= 1; half >>= 1, --bit) {
        const bool upper = (lane >> bit) & 1;
#pragma unroll
        for (int k = 0; k < half; ++k) {
          const uint32_t send = upper ? row_part[k] : row_part[k + half];
          const uint32_t keep = upper ? row_part[k + half] : row_part[k];
          row_part[k] = max(keep, __shfl_xor_sync(0xFFFFFFFFu, send, 1 << bit));
        }
      }
      row_part[0] = max(row_part[0], __shfl_xor_sync(0xFFFFFFFFu, row_part[0], 1));
      const int64_t r = r0 + ((lane >> 1) & 15);
      if ((lane & 1) == 0 && r < p.R) atomic_max_float(p.rows + r, row_part[0]);
    }
    if (want_rht) {
#pragma unroll
      for (int j = 0; j < W; ++j) {
        float w[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) w[i] = to_float(raw[i][j]);
        jq::rht16(w);
#pragma unroll
        for (int i = 0; i < 16; ++i) col_rht_part[j] = max(col_rht_part[j], jq::abs_bits(w[i]));
      }
    }
  }
  uint32_t t = 0, t_rht = 0;
#pragma unroll
  for (int j = 0; j < W; ++j) {
    t = max(t, col_part[j]);
    t_rht = max(t_rht, col_rht_part[j]);
    s_col[warp][lane * W + j] = col_part[j];
    s_col_rht[warp][lane * W + j] = col_rht_part[j];
  }
  __syncthreads();
  for (int j = threadIdx.x; j < STRIP; j += kThreads) {
    const int64_t cj = strip * STRIP + j;
    if (cj >= p.C) continue;
    uint32_t m = 0, m_rht = 0;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) {
      m = max(m, s_col[w][j]);
      m_rht = max(m_rht, s_col_rht[w][j]);
    }
    if (p.cols) atomic_max_float(p.cols + cj, m);
    if (p.cols_rht) atomic_max_float(p.cols_rht + cj, m_rht);
  }
  if (p.tensor) {
    t = cta_max(t, red);
    if (threadIdx.x == 0) atomic_max_float(p.tensor, t);
  }
  if (p.tensor_rht) {
    t_rht = cta_max(t_rht, red);
    if (threadIdx.x == 0) atomic_max_float(p.tensor_rht, t_rht);
  }
}

// ============================================================================================
// FP8 per tensor (current and delayed scaling). Tile 128x128.
// ============================================================================================

struct Fp8TensorParams {
  const void* x;
  int64_t R, C;
  bool vec_in, vec_row, vec_col;
  bool do_row, do_col, delayed, pow2_scale;
  float amax_epsilon;
  jq::Fp8 fmt;
  const float* s;
  uint8_t *row, *col;
  float *scale_inv, *amax;
};

template <typename In>
using FP8Tile = Geometry<In, 128, 128>;

template <typename In>
__global__ void __launch_bounds__(kThreads) fp8_tensor_kernel(const Fp8TensorParams p) {
  using G = FP8Tile<In>;
  extern __shared__ __align__(16) unsigned char smem[];
  In* tile = reinterpret_cast<In*>(smem);
  __shared__ uint32_t red[kThreads / 32];
  const In* x = static_cast<const In*>(p.x);
  const int tid = threadIdx.x;
  const TileIndex t = tile_index(p.C, G::TR, G::TC);
  const float fmax = jq::spec_of(p.fmt).fmax;
  const float scale = p.delayed ? *p.s : jq::scale_from_amax(*p.s, fmax, p.pow2_scale, p.amax_epsilon);
  const int lr = tid / G::TPR, lc = (tid % G::TPR) * 8;
  alignas(16) In raw[G::NP][8];
#pragma unroll
  for (int pp = 0; pp < G::NP; ++pp) load8(x, p.R, p.C, t.r0 + pp * G::RPP + lr, t.c0 + lc, p.vec_in, raw[pp]);
  uint32_t amax = 0;
#pragma unroll
  for (int pp = 0; pp < G::NP; ++pp) {
    if (p.do_col) tile_store8<G>(tile, pp * G::RPP + lr, lc, raw[pp]);
    float v[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      v[i] = to_float(raw[pp][i]);
      amax = max(amax, jq::abs_bits(v[i]));
    }
    const int64_t r = t.r0 + pp * G::RPP + lr, c = t.c0 + lc;
    if (p.do_row && r < p.R && c < p.C) {
      const uint32_t w0 = jq::encode_fp8x4(v[0] * scale, v[1] * scale, v[2] * scale, v[3] * scale, p.fmt);
      const uint32_t w1 = jq::encode_fp8x4(v[4] * scale, v[5] * scale, v[6] * scale, v[7] * scale, p.fmt);
      store_bytes8(p.row + r * p.C + c, w0, w1, int(min64(8, p.C - c)), p.vec_row);
    }
  }
  if (p.amax) {
    amax = cta_max(amax, red);
    if (tid == 0) atomic_max_float(p.amax, amax);
  }
  if (blockIdx.x == 0 && tid == 0) *p.scale_inv = jq::rcp_f32(scale);
  if (!p.do_col) return;
  __syncthreads();
#pragma unroll
  for (int it = 0; it < G::ITERS; ++it) {
    const ColumnSlot<G> slot(it);
    const int64_t c = t.c0 + slot.cl, rr = t.r0 + 16 * slot.j;
    if (c >= p.C || rr >= p.R) continue;
    float w[16];
    tile_column16<G>(tile, 16 * slot.j, slot.cl, w);
    uint32_t q[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      q[k] = jq::encode_fp8x4(w[4 * k] * scale, w[4 * k + 1] * scale, w[4 * k + 2] * scale, w[4 * k + 3] * scale,
                              p.fmt);
    }
    store_bytes16(p.col + c * p.R + rr, q, int(min64(16, p.R - rr)), p.vec_col);
  }
}

// ============================================================================================
// MXFP8: 1x32 blocks along each output's rows, E8M0 scales; fused tensor amax. Tile 128x128.
// ============================================================================================

struct Mxfp8Params {
  const void* x;
  int64_t R, C;
  bool vec_in, vec_row, vec_col, do_row, do_col;
  jq::Fp8 fmt;
  uint8_t *row, *row_scale, *col, *col_scale;
  float* amax;
};

__device__ __forceinline__ uint32_t mxfp8_codes4(const float* v, jq::Mxfp8Factors f, uint32_t e, jq::Fp8 fmt) {
  if (e == 255) return 0x7F7F7F7Fu;
  return jq::encode_fp8x4(v[0] * f.a * f.b, v[1] * f.a * f.b, v[2] * f.a * f.b, v[3] * f.a * f.b, fmt);
}

template <typename In>
__global__ void __launch_bounds__(kThreads) mxfp8_kernel(const Mxfp8Params p) {
  using G = FP8Tile<In>;
  extern __shared__ __align__(16) unsigned char smem[];
  In* tile = reinterpret_cast<In*>(smem);
  __shared__ uint32_t red[kThreads / 32];
  const In* x = static_cast<const In*>(p.x);
  const int tid = threadIdx.x;
  const TileIndex t = tile_index(p.C, G::TR, G::TC);
  const float inv_fmax = jq::inv_fmax_of(p.fmt);
  const int64_t row_nb = (p.C + 31) / 32, col_nb = (p.R + 31) / 32;
  const int lr = tid / G::TPR, lc = (tid % G::TPR) * 8;
  alignas(16) In raw[G::NP][8];
#pragma unroll
  for (int pp = 0; pp < G::NP; ++pp) load8(x, p.R, p.C, t.r0 + pp * G::RPP + lr, t.c0 + lc, p.vec_in, raw[pp]);
  uint32_t amax = 0;
#pragma unroll
  for (int pp = 0; pp < G::NP; ++pp) {
    if (p.do_col) tile_store8<G>(tile, pp * G::RPP + lr, lc, raw[pp]);
    float v[8];
    uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      v[i] = to_float(raw[pp][i]);
      m = max(m, jq::abs_bits(v[i]));
    }
    amax = max(amax, m);
    if (!p.do_row) continue;
    m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, 1));  // 4 threads = one 32-wide block
    m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, 2));
    const int64_t r = t.r0 + pp * G::RPP + lr, c = t.c0 + lc;
    if (r < p.R && c < p.C) {
      const uint32_t e = jq::e8m0_from_amax(__uint_as_float(m), inv_fmax);
      const jq::Mxfp8Factors f = jq::mxfp8_factors(e);
      store_bytes8(p.row + r * p.C + c, mxfp8_codes4(v, f, e, p.fmt), mxfp8_codes4(v + 4, f, e, p.fmt),
                   int(min64(8, p.C - c)), p.vec_row);
      if ((tid & 3) == 0) p.row_scale[r * row_nb + c / 32] = uint8_t(e);
    }
  }
  if (p.amax) {
    amax = cta_max(amax, red);
    if (tid == 0) atomic_max_float(p.amax, amax);
  }
  if (!p.do_col) return;
  __syncthreads();
#pragma unroll
  for (int it = 0; it < G::ITERS; ++it) {
    const ColumnSlot<G> slot(it);
    const int64_t c = t.c0 + slot.cl, rr = t.r0 + 16 * slot.j;
    float w[16];
    tile_column16<G>(tile, 16 * slot.j, slot.cl, w);
    uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < 16; ++i) m = max(m, jq::abs_bits(w[i]));
    m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, 1));  // chunks j, j^1 = one 32-row block
    if (c >= p.C || rr >= p.R) continue;
    const uint32_t e = jq::e8m0_from_amax(__uint_as_float(m), inv_fmax);
    const jq::Mxfp8Factors f = jq::mxfp8_factors(e);
    if ((slot.j & 1) == 0) p.col_scale[c * col_nb + rr / 32] = uint8_t(e);
    uint32_t q[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) q[k] = mxfp8_codes4(w + 4 * k, f, e, p.fmt);
    store_bytes16(p.col + c * p.R + rr, q, int(min64(16, p.R - rr)), p.vec_col);
  }
}

// ============================================================================================
// Float8Block: FP32 scale per 1x128 block or 128x128 tile; fused tensor amax. Tile 128x128.
// ============================================================================================

struct Fp8BlockParams {
  const void* x;
  int64_t R, C;
  bool vec_in, vec_row, vec_col, do_row, do_col, block_2d, pow2_scale;
  float amax_epsilon;
  jq::Fp8 fmt;
  uint8_t *row, *col;
  float *row_scale, *col_scale, *amax;
};

template <typename In>
__global__ void __launch_bounds__(kThreads) fp8_block_kernel(const Fp8BlockParams p) {
  using G = FP8Tile<In>;
  static_assert(G::TPR == 16 && G::NJ == 8, "a tile row is one 1x128 block; 8 lanes a column");
  extern __shared__ __align__(16) unsigned char smem[];
  In* tile = reinterpret_cast<In*>(smem);
  __shared__ uint32_t red[kThreads / 32];
  const In* x = static_cast<const In*>(p.x);
  const int tid = threadIdx.x;
  const TileIndex t = tile_index(p.C, G::TR, G::TC);
  const float fmax = jq::spec_of(p.fmt).fmax;
  const int64_t row_nb = (p.C + 127) / 128, col_nb = (p.R + 127) / 128;
  const int lr = tid / G::TPR, lc = (tid % G::TPR) * 8;
  alignas(16) In raw[G::NP][8];
#pragma unroll
  for (int pp = 0; pp < G::NP; ++pp) load8(x, p.R, p.C, t.r0 + pp * G::RPP + lr, t.c0 + lc, p.vec_in, raw[pp]);
  uint32_t row_m[G::NP];
  uint32_t amax = 0;
#pragma unroll
  for (int pp = 0; pp < G::NP; ++pp) {
    if (p.do_col) tile_store8<G>(tile, pp * G::RPP + lr, lc, raw[pp]);
    uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) m = max(m, jq::abs_bits(to_float(raw[pp][i])));
    amax = max(amax, m);
#pragma unroll
    for (int o = 1; o < 16; o <<= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
    row_m[pp] = m;
  }
  const uint32_t tile_amax = cta_max(amax, red);  // also the 128x128 block amax; orders the tile
  if (p.amax && tid == 0) atomic_max_float(p.amax, tile_amax);
  const float tile_scale = jq::scale_from_amax(__uint_as_float(tile_amax), fmax, p.pow2_scale, p.amax_epsilon);
  if (p.do_row) {
#pragma unroll
    for (int pp = 0; pp < G::NP; ++pp) {
      const int64_t r = t.r0 + pp * G::RPP + lr, c = t.c0 + lc;
      if (r >= p.R || c >= p.C) continue;
      const float scale = p.block_2d ? tile_scale
                                     : jq::scale_from_amax(__uint_as_float(row_m[pp]), fmax, p.pow2_scale, p.amax_epsilon);
      float v[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = to_float(raw[pp][i]) * scale;
      const uint32_t w0 = jq::encode_fp8x4(v[0], v[1], v[2], v[3], p.fmt);
      const uint32_t w1 = jq::encode_fp8x4(v[4], v[5], v[6], v[7], p.fmt);
      store_bytes8(p.row + r * p.C + c, w0, w1, int(min64(8, p.C - c)), p.vec_row);
      if (p.block_2d) {
        if (tid == 0) p.row_scale[(t.r0 / 128) * row_nb + t.c0 / 128] = jq::rcp_f32(scale);
      } else if (lc == 0) {
        p.row_scale[r * row_nb + t.c0 / 128] = jq::rcp_f32(scale);
      }
    }
  }
  if (!p.do_col) return;
#pragma unroll
  for (int it = 0; it < G::ITERS; ++it) {
    const ColumnSlot<G> slot(it);
    const int64_t c = t.c0 + slot.cl, rr = t.r0 + 16 * slot.j;
    float w[16];
    tile_column16<G>(tile, 16 * slot.j, slot.cl, w);
    uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < 16; ++i) m = max(m, jq::abs_bits(w[i]));
#pragma unroll
    for (int o = 1; o < G::NJ; o <<= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));  // 128 rows
    const float scale = p.block_2d ? tile_scale
                                   : jq::scale_from_amax(__uint_as_float(m), fmax, p.pow2_scale, p.amax_epsilon);
    if (c >= p.C || rr >= p.R) continue;
    if (p.block_2d) {
      if (tid == 0) p.col_scale[(t.c0 / 128) * col_nb + t.r0 / 128] = jq::rcp_f32(scale);
    } else if (slot.j == 0) {
      p.col_scale[c * col_nb + t.r0 / 128] = jq::rcp_f32(scale);
    }
    uint32_t q[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      q[k] = jq::encode_fp8x4(w[4 * k] * scale, w[4 * k + 1] * scale, w[4 * k + 2] * scale, w[4 * k + 3] * scale,
                              p.fmt);
    }
    store_bytes16(p.col + c * p.R + rr, q, int(min64(16, p.R - rr)), p.vec_col);
  }
}

// ============================================================================================
// NVFP4: E2M1 payload, E4M3 scale per 1x16 block or 16x16 tile, FP32 global scale from the
// given amax (per tensor or per row), RHT on the columnwise copy, stochastic rounding.
// Tile 64x128; a column-phase thread owns one 16-row chunk = one NVFP4 block (= one RHT chunk).
// ============================================================================================

struct Nvfp4Params {
  const void* x;
  int64_t R, C;
  bool vec_in, vec_row, vec_col, do_row, do_col, row_scaled, block_2d, rht, sr;
  const float *row_amax, *col_amax;
  const uint32_t *row_key, *col_key;
  uint8_t *row, *row_scale, *col, *col_scale;
};

struct Nvfp4Block {
  uint32_t code;  // E4M3 code of S_dec_b
  float s_enc_b;
};

__device__ __forceinline__ Nvfp4Block nvfp4_block(uint32_t amax_bits, float s_enc) {
  const uint32_t code = jq::nvfp4_block_decode_code(__uint_as_float(amax_bits), s_enc);
  return {code, jq::nvfp4_block_encode_scale(jq::decode_e4m3(code), s_enc)};
}

// Eight E2M1 codes of v * s, packed low nibble first; SR draws at (row hash, col0 + i).
__device__ __forceinline__ uint32_t e2m1x8(const float* v, float s, bool sr, uint32_t row_hash,
                                           uint32_t k1, uint32_t col0) {
  uint32_t packed = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float y = v[i] * s;
    const uint32_t q = sr ? jq::encode_e2m1_stochastic(y, jq::sr_uniform(row_hash, k1, col0 + i))
                          : jq::encode_e2m1(y);
    packed |= q << (4 * i);
  }
  return packed;
}

template <typename In>
using NVFP4Tile = Geometry<In, 64, 128>;

template <typename In>
__global__ void __launch_bounds__(kThreads, 3) nvfp4_kernel(const Nvfp4Params p) {  // 3 CTAs an SM
  using G = NVFP4Tile<In>;
  static_assert(G::RPP == 16, "a load pass is one row of 16x16 tiles");
  extern __shared__ __align__(16) unsigned char smem[];
  In* tile = reinterpret_cast<In*>(smem);
  __shared__ uint32_t part2d[G::NP][16][G::TC / 16];  // per (row, 16-block) amax, block_2d
  __shared__ uint32_t tile2d[G::NP][G::TC / 16];      // 16x16 tile amax, block_2d
  const In* x = static_cast<const In*>(p.x);
  const int tid = threadIdx.x;
  const TileIndex t = tile_index(p.C, G::TR, G::TC);
  const int64_t row_nb = (p.C + 15) / 16, col_nb = (p.R + 15) / 16;
  const int lr = tid / G::TPR, lc = (tid % G::TPR) * 8;
  alignas(16) In raw[G::NP][8];
#pragma unroll
  for (int pp = 0; pp < G::NP; ++pp) load8(x, p.R, p.C, t.r0 + pp * G::RPP + lr, t.c0 + lc, p.vec_in, raw[pp]);
  uint32_t blk[G::NP];
#pragma unroll
  for (int pp = 0; pp < G::NP; ++pp) {
    if (p.do_col) tile_store8<G>(tile, pp * G::RPP + lr, lc, raw[pp]);
    uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) m = max(m, jq::abs_bits(to_float(raw[pp][i])));
    m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, 1));  // 2 threads = one 16-wide block
    blk[pp] = m;
    if (p.block_2d && (tid & 1) == 0) part2d[pp][lr][lc / 16] = m;
  }
  if (p.block_2d) {
    __syncthreads();
    if (tid < G::NP * (G::TC / 16)) {
      const int pp = tid / (G::TC / 16), j = tid % (G::TC / 16);
      uint32_t m = 0;
#pragma unroll
      for (int i = 0; i < 16; ++i) m = max(m, part2d[pp][i][j]);
      tile2d[pp][j] = m;
    }
    __syncthreads();
#pragma unroll
    for (int pp = 0; pp < G::NP; ++pp) blk[pp] = tile2d[pp][lc / 16];
  }
  if (p.do_row) {
    const float tensor_s_enc = p.row_scaled ? 0.0f : jq::nvfp4_global_encode_scale(*p.row_amax);
    const uint32_t k0 = p.sr ? p.row_key[0] : 0u, k1 = p.sr ? p.row_key[1] : 0u;
#pragma unroll
    for (int pp = 0; pp < G::NP; ++pp) {
      const int64_t r = t.r0 + pp * G::RPP + lr, c = t.c0 + lc;
      if (r >= p.R || c >= p.C) continue;
      const float s_enc = p.row_scaled ? jq::nvfp4_global_encode_scale(p.row_amax[r]) : tensor_s_enc;
      const Nvfp4Block b = nvfp4_block(blk[pp], s_enc);
      float v[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = to_float(raw[pp][i]);
      const uint32_t row_hash = p.sr ? jq::sr_row_hash(k0, uint32_t(r)) : 0u;
      const uint32_t packed = e2m1x8(v, b.s_enc_b, p.sr, row_hash, k1, uint32_t(c));
      store_bytes4(p.row + (r * p.C + c) / 2, packed, int(min64(8, p.C - c)) / 2, p.vec_row);
      if ((tid & 1) == 0) {
        if (!p.block_2d) {
          p.row_scale[r * row_nb + c / 16] = uint8_t(b.code);
        } else if (lr == 0) {
          p.row_scale[(r / 16) * row_nb + c / 16] = uint8_t(b.code);
        }
      }
    }
  }
  if (!p.do_col) return;
  __syncthreads();
  const float tensor_s_enc = p.row_scaled ? 0.0f : jq::nvfp4_global_encode_scale(*p.col_amax);
  const uint32_t k0 = p.sr ? p.col_key[0] : 0u, k1 = p.sr ? p.col_key[1] : 0u;
#pragma unroll
  for (int it = 0; it < G::ITERS; ++it) {
    const ColumnSlot<G> slot(it);
    const int64_t c = t.c0 + slot.cl, rr = t.r0 + 16 * slot.j;
    if (c >= p.C || rr >= p.R) continue;
    float w[16];
    tile_column16<G>(tile, 16 * slot.j, slot.cl, w);
    if (p.rht) jq::rht16(w);
    uint32_t m;
    if (p.block_2d) {
      m = tile2d[slot.j][slot.cl / 16];
    } else {
      m = 0;
#pragma unroll
      for (int i = 0; i < 16; ++i) m = max(m, jq::abs_bits(w[i]));
    }
    const float s_enc = p.row_scaled ? jq::nvfp4_global_encode_scale(p.col_amax[c]) : tensor_s_enc;
    const Nvfp4Block b = nvfp4_block(m, s_enc);
    const uint32_t row_hash = p.sr ? jq::sr_row_hash(k0, uint32_t(c)) : 0u;
    const uint32_t lo = e2m1x8(w, b.s_enc_b, p.sr, row_hash, k1, uint32_t(rr));
    const uint32_t hi = e2m1x8(w + 8, b.s_enc_b, p.sr, row_hash, k1, uint32_t(rr + 8));
    store_bytes8(p.col + (c * p.R + rr) / 2, lo, hi, int(min64(16, p.R - rr)) / 2, p.vec_col);
    if (!p.block_2d) {
      p.col_scale[c * col_nb + rr / 16] = uint8_t(b.code);
    } else if (slot.cl % 16 == 0) {
      p.col_scale[(c / 16) * col_nb + rr / 16] = uint8_t(b.code);
    }
  }
}

// NVFP4 for an output matrix M (x, or x^T when `transposed`; never RHT'd) whose row length is
// odd, so rows share bytes: first every block scale, then one thread per output byte.
struct Nvfp4GenericParams {
  const void* x;
  int64_t R, C, mrows, mcols;
  bool transposed, row_scaled, block_2d, sr;
  const float* amax;
  const uint32_t* key;
  uint8_t *data, *scale;
};

template <typename In>
__device__ __forceinline__ float m_at(const Nvfp4GenericParams& p, int64_t mr, int64_t mc) {
  const In* x = static_cast<const In*>(p.x);
  return to_float(p.transposed ? x[mc * p.C + mr] : x[mr * p.C + mc]);
}

template <typename In>
__global__ void __launch_bounds__(kThreads) nvfp4_generic_scales_kernel(const Nvfp4GenericParams p) {
  const int bh = p.block_2d ? 16 : 1;
  const int64_t nbr = (p.mrows + bh - 1) / bh, nbc = (p.mcols + 15) / 16;
  for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i < nbr * nbc; i += int64_t(gridDim.x) * kThreads) {
    const int64_t br = i / nbc, bc = i % nbc;
    uint32_t m = 0;
    for (int64_t mr = br * bh; mr < min64(p.mrows, br * bh + bh); ++mr) {
      for (int64_t mc = bc * 16; mc < min64(p.mcols, bc * 16 + 16); ++mc) m = max(m, jq::abs_bits(m_at<In>(p, mr, mc)));
    }
    const float s_enc = jq::nvfp4_global_encode_scale(p.row_scaled ? p.amax[br] : *p.amax);
    p.scale[i] = uint8_t(jq::nvfp4_block_decode_code(__uint_as_float(m), s_enc));
  }
}

template <typename In>
__global__ void __launch_bounds__(kThreads) nvfp4_generic_data_kernel(const Nvfp4GenericParams p) {
  const int64_t n = p.mrows * p.mcols, nbytes = (n + 1) / 2, nbc = (p.mcols + 15) / 16;
  const int bh = p.block_2d ? 16 : 1;
  for (int64_t b = blockIdx.x * int64_t(kThreads) + threadIdx.x; b < nbytes; b += int64_t(gridDim.x) * kThreads) {
    uint32_t byte = 0;
    for (int e = 0; e < 2; ++e) {
      const int64_t i = 2 * b + e;
      if (i >= n) break;
      const int64_t mr = i / p.mcols, mc = i % p.mcols;
      const float s_enc = jq::nvfp4_global_encode_scale(p.row_scaled ? p.amax[mr] : *p.amax);
      const float s_dec = jq::decode_e4m3(p.scale[(mr / bh) * nbc + mc / 16]);
      const float y = m_at<In>(p, mr, mc) * jq::nvfp4_block_encode_scale(s_dec, s_enc);
      const uint32_t q = p.sr ? jq::encode_e2m1_stochastic(
                                    y, jq::sr_uniform(jq::sr_row_hash(p.key[0], uint32_t(mr)), p.key[1], uint32_t(mc)))
                              : jq::encode_e2m1(y);
      byte |= q << (4 * e);
    }
    p.data[b] = uint8_t(byte);
  }
}

// ============================================================================================
// FP8 transpose: 128x128 byte tiles through shared memory, 16-byte loads and stores.
// ============================================================================================

struct TransposeParams {
  const uint8_t* in;
  uint8_t* out;
  int64_t R, C;
  bool vec_in, vec_out;
};

__global__ void __launch_bounds__(kThreads) transpose_kernel(const TransposeParams p) {
  using G = Geometry<uint8_t, 128, 128>;  // 16-byte chunks swizzled by 16-row chunk index
  static_assert(G::NJ == 8 && G::ITERS == 4, "byte tile");
  __shared__ __align__(16) uint8_t tile[G::TR * G::TC];
  const TileIndex t = tile_index(p.C, G::TR, G::TC);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int v = threadIdx.x + k * kThreads, lr = v / 8, lc = (v % 8) * 16;
    const int64_t r = t.r0 + lr, c = t.c0 + lc;
    uint4 chunk;
    if (p.vec_in && r < p.R && c + 16 <= p.C) {
      chunk = __ldg(reinterpret_cast<const uint4*>(p.in + r * p.C + c));
    } else {
      uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        if (r < p.R && c + i < p.C) w[i / 4] |= uint32_t(p.in[r * p.C + c + i]) << (8 * (i % 4));
      }
      chunk = make_uint4(w[0], w[1], w[2], w[3]);
    }
    *reinterpret_cast<uint4*>(tile + G::offset(lr, lc)) = chunk;
  }
  __syncthreads();
#pragma unroll
  for (int it = 0; it < G::ITERS; ++it) {
    const ColumnSlot<G> slot(it);
    const int64_t c = t.c0 + slot.cl, r = t.r0 + 16 * slot.j;
    if (c >= p.C || r >= p.R) continue;
    uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
    for (int i = 0; i < 16; ++i) w[i / 4] |= uint32_t(tile[G::offset(16 * slot.j + i, slot.cl)]) << (8 * (i % 4));
    store_bytes16(p.out + c * p.R + r, w, int(min64(16, p.R - r)), p.vec_out);
  }
}

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

// ============================================================================================
// Handlers.
// ============================================================================================

ffi::Error launch_status(const char* target, cudaError_t e = cudaSuccess) {
  if (e == cudaSuccess) e = cudaGetLastError();
  if (e != cudaSuccess) return ffi::Error::Internal(std::string(target) + ": CUDA error: " + cudaGetErrorString(e));
  return ffi::Error::Success();
}

ffi::Error clear(cudaStream_t stream, void* p, size_t bytes) {
  if (p && cudaMemsetAsync(p, 0, bytes, stream) != cudaSuccess) return launch_status("cudaMemsetAsync");
  return ffi::Error::Success();
}

template <typename F>
ffi::Error by_input_type(In type, F&& f) {
  switch (type) {
    case In::kBF16: f(BF16{}); break;
    case In::kF16: f(F16{}); break;
    default: f(float{}); break;
  }
  return ffi::Error::Success();
}

bool vec_input(const Input& x) { return aligned(x.data, 16) && x.cols % 8 == 0; }

ffi::Error AmaxLaunch(cudaStream_t stream, ffi::AnyBuffer x, const float* gate, ffi::RemainingRets rets,
                      int32_t outputs) {
  AmaxArgs a;
  JQ_RETURN_IF_ERROR(decode_amax(x, rets, outputs, &a));
  JQ_RETURN_IF_ERROR(clear(stream, a.tensor, 4));
  JQ_RETURN_IF_ERROR(clear(stream, a.tensor_rht, 4));
  JQ_RETURN_IF_ERROR(clear(stream, a.rows, 4 * a.x.rows));
  JQ_RETURN_IF_ERROR(clear(stream, a.cols, 4 * a.x.cols));
  JQ_RETURN_IF_ERROR(clear(stream, a.cols_rht, 4 * a.x.cols));
  by_input_type(a.x.type, [&](auto tag) {
    using T = decltype(tag);
    constexpr int strip = 32 * (16 / sizeof(T));
    const int64_t nstrips = ceil_div(a.x.cols, strip);
    const int64_t chunks = ceil_div(a.x.rows, 128);  // a CTA step is 8 warps x 16 rows
    const int64_t groups = std::max<int64_t>(1, std::min<int64_t>(chunks, ceil_div(1056, nstrips)));
    AmaxParams p{a.x.data, a.x.rows, a.x.cols, ceil_div(chunks, groups) * 128,
                 aligned(a.x.data, 16) && a.x.cols % (16 / sizeof(T)) == 0,
                 a.tensor, a.tensor_rht, a.rows, a.cols, a.cols_rht, gate};
    const int64_t ngroups = ceil_div(a.x.rows, p.rows_per_cta);
    amax_kernel<T><<<unsigned(nstrips * ngroups), kThreads, 0, stream>>>(p);
  });
  return launch_status(gate ? "jaxquant_amax_gated" : "jaxquant_amax");
}

ffi::Error AmaxCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::RemainingRets rets, int32_t outputs) {
  return AmaxLaunch(stream, x, nullptr, rets, outputs);
}

ffi::Error AmaxGatedCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer gate, ffi::RemainingRets rets,
                         int32_t outputs) {
  const float* g = nullptr;
  JQ_RETURN_IF_ERROR(decode_gate(gate, &g));
  return AmaxLaunch(stream, x, g, rets, outputs);
}

ffi::Error QuantizeFp8Cuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer s, ffi::RemainingRets rets,
                           bool rowwise, bool columnwise, bool delayed, bool pow2_scale, float amax_epsilon) {
  Fp8TensorArgs a;
  JQ_RETURN_IF_ERROR(decode_fp8_tensor(x, s, rets, rowwise, columnwise, delayed, pow2_scale, amax_epsilon, &a));
  JQ_RETURN_IF_ERROR(clear(stream, a.amax, 4));
  Fp8TensorParams p{a.x.data, a.x.rows, a.x.cols, vec_input(a.x),
                    aligned(a.row_data, 8) && a.x.cols % 8 == 0, aligned(a.col_data, 16) && a.x.rows % 16 == 0,
                    rowwise, columnwise, delayed, pow2_scale, amax_epsilon, a.fmt, a.s,
                    a.row_data, a.col_data, a.scale_inv, a.amax};
  cudaError_t e = cudaSuccess;
  by_input_type(a.x.type, [&](auto tag) {
    using G = FP8Tile<decltype(tag)>;
    e = launch_tiles(fp8_tensor_kernel<decltype(tag)>, num_tiles(a.x.rows, a.x.cols, G::TR, G::TC),
                     columnwise ? G::kSmemBytes : 0, stream, p);
  });
  return launch_status("jaxquant_quantize_fp8", e);
}

ffi::Error QuantizeMxfp8Cuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::RemainingRets rets, bool rowwise,
                             bool columnwise) {
  Mxfp8Args a;
  JQ_RETURN_IF_ERROR(decode_mxfp8(x, rets, rowwise, columnwise, &a));
  JQ_RETURN_IF_ERROR(clear(stream, a.amax, 4));
  Mxfp8Params p{a.x.data, a.x.rows, a.x.cols, vec_input(a.x),
                aligned(a.row_data, 8) && a.x.cols % 8 == 0, aligned(a.col_data, 16) && a.x.rows % 16 == 0,
                rowwise, columnwise, a.fmt, a.row_data, a.row_scale, a.col_data, a.col_scale, a.amax};
  cudaError_t e = cudaSuccess;
  by_input_type(a.x.type, [&](auto tag) {
    using G = FP8Tile<decltype(tag)>;
    e = launch_tiles(mxfp8_kernel<decltype(tag)>, num_tiles(a.x.rows, a.x.cols, G::TR, G::TC),
                     columnwise ? G::kSmemBytes : 0, stream, p);
  });
  return launch_status("jaxquant_quantize_mxfp8", e);
}

ffi::Error QuantizeFp8BlockCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::RemainingRets rets, bool rowwise,
                                bool columnwise, bool block_2d, bool pow2_scale, float amax_epsilon) {
  Fp8BlockArgs a;
  JQ_RETURN_IF_ERROR(decode_fp8_block(x, rets, rowwise, columnwise, block_2d, pow2_scale, amax_epsilon, &a));
  JQ_RETURN_IF_ERROR(clear(stream, a.amax, 4));
  Fp8BlockParams p{a.x.data, a.x.rows, a.x.cols, vec_input(a.x),
                   aligned(a.row_data, 8) && a.x.cols % 8 == 0, aligned(a.col_data, 16) && a.x.rows % 16 == 0,
                   rowwise, columnwise, block_2d, pow2_scale, amax_epsilon, a.fmt,
                   a.row_data, a.col_data, a.row_scale, a.col_scale, a.amax};
  cudaError_t e = cudaSuccess;
  by_input_type(a.x.type, [&](auto tag) {
    using G = FP8Tile<decltype(tag)>;
    e = launch_tiles(fp8_block_kernel<decltype(tag)>, num_tiles(a.x.rows, a.x.cols, G::TR, G::TC),
                     columnwise ? G::kSmemBytes : 0, stream, p);
  });
  return launch_status("jaxquant_quantize_fp8_block", e);
}

template <typename T>
void launch_nvfp4_generic(cudaStream_t stream, const Nvfp4Args& a, bool transposed) {
  Nvfp4GenericParams g{a.x.data, a.x.rows, a.x.cols,
                       transposed ? a.x.cols : a.x.rows, transposed ? a.x.rows : a.x.cols,
                       transposed, a.row_scaled, a.block_2d, a.stochastic,
                       transposed ? a.col_amax : a.row_amax, transposed ? a.col_key : a.row_key,
                       transposed ? a.col_data : a.row_data, transposed ? a.col_scale : a.row_scale};
  const int64_t nblocks = ceil_div(g.mrows, a.block_2d ? 16 : 1) * ceil_div(g.mcols, 16);
  const int64_t nbytes = ceil_div(g.mrows * g.mcols, 2);
  nvfp4_generic_scales_kernel<T><<<unsigned(std::min<int64_t>(ceil_div(nblocks, kThreads), 4096)), kThreads, 0, stream>>>(g);
  nvfp4_generic_data_kernel<T><<<unsigned(std::min<int64_t>(ceil_div(nbytes, kThreads), 8192)), kThreads, 0, stream>>>(g);
}

ffi::Error QuantizeNvfp4Cuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer row_amax,
                             ffi::AnyBuffer col_amax, ffi::AnyBuffer row_key, ffi::AnyBuffer col_key,
                             ffi::RemainingRets rets, bool rowwise, bool columnwise, bool row_scaled,
                             bool block_2d, bool rht, bool stochastic) {
  Nvfp4Args a;
  JQ_RETURN_IF_ERROR(decode_nvfp4(x, row_amax, col_amax, row_key, col_key, rets, rowwise, columnwise,
                                  row_scaled, block_2d, rht, stochastic, &a));
  // The tiled kernel needs byte-aligned output rows (even row length); odd ones go generic.
  const bool tiled_row = rowwise && a.x.cols % 2 == 0;
  const bool tiled_col = columnwise && a.x.rows % 2 == 0;  // rht implies rows % 16 == 0
  cudaError_t e = cudaSuccess;
  by_input_type(a.x.type, [&](auto tag) {
    using T = decltype(tag);
    using G = NVFP4Tile<T>;
    if (tiled_row || tiled_col) {
      Nvfp4Params p{a.x.data, a.x.rows, a.x.cols, vec_input(a.x),
                    aligned(a.row_data, 4) && a.x.cols % 8 == 0, aligned(a.col_data, 8) && a.x.rows % 16 == 0,
                    tiled_row, tiled_col, row_scaled, block_2d, rht, stochastic,
                    a.row_amax, a.col_amax, a.row_key, a.col_key, a.row_data, a.row_scale, a.col_data, a.col_scale};
      e = launch_tiles(nvfp4_kernel<T>, num_tiles(a.x.rows, a.x.cols, G::TR, G::TC),
                       tiled_col ? G::kSmemBytes : 0, stream, p);
      if (e != cudaSuccess) return;
    }
    if (rowwise && !tiled_row) launch_nvfp4_generic<T>(stream, a, false);
    if (columnwise && !tiled_col) launch_nvfp4_generic<T>(stream, a, true);
  });
  return launch_status("jaxquant_quantize_nvfp4", e);
}

ffi::Error TransposeFp8Cuda(cudaStream_t stream, ffi::AnyBuffer in, ffi::Result<ffi::AnyBuffer> out) {
  TransposeArgs a;
  JQ_RETURN_IF_ERROR(decode_transpose(in, out, &a));
  TransposeParams p{a.in, a.out, a.rows, a.cols, aligned(a.in, 16) && a.cols % 16 == 0,
                    aligned(a.out, 16) && a.rows % 16 == 0};
  transpose_kernel<<<num_tiles(a.rows, a.cols, 128, 128), kThreads, 0, stream>>>(p);
  return launch_status("jaxquant_transpose_fp8");
}

ffi::Error RawBytesCuda(cudaStream_t stream, ffi::AnyBuffer in, ffi::Result<ffi::AnyBuffer> out) {
  if (out->element_type() != ffi::DataType::U8 || out->dimensions().size() != 1) {
    return invalid("jaxquant_debug_raw_bytes", "the result must be a 1-D uint8 array");
  }
  cudaMemcpyAsync(out->untyped_data(), in.untyped_data(), out->element_count(), cudaMemcpyDeviceToDevice, stream);
  return launch_status("jaxquant_debug_raw_bytes");
}

ffi::Error EncoderMismatchesCuda(cudaStream_t stream, ffi::Result<ffi::AnyBuffer> out, int64_t start,
                                 int64_t count, int64_t stride) {
  JQ_RETURN_IF_ERROR(expect("jaxquant_debug_encoder_mismatches", "the result", *out, {ffi::DataType::U32}, {6}));
  JQ_RETURN_IF_ERROR(clear(stream, out->untyped_data(), 24));
  encoder_check_kernel<<<1024, kThreads, 0, stream>>>(static_cast<uint32_t*>(out->untyped_data()), start, count, stride);
  return launch_status("jaxquant_debug_encoder_mismatches");
}

using Stream = ffi::PlatformStream<cudaStream_t>;

}  // namespace

XLA_FFI_DEFINE_HANDLER(kAmaxCuda, AmaxCuda,
                       ffi::Ffi::Bind().Ctx<Stream>().Arg<ffi::AnyBuffer>().RemainingRets().Attr<int32_t>("outputs"),
                       {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER(kAmaxGatedCuda, AmaxGatedCuda,
                       ffi::Ffi::Bind()
                           .Ctx<Stream>()
                           .Arg<ffi::AnyBuffer>()
                           .Arg<ffi::AnyBuffer>()
                           .RemainingRets()
                           .Attr<int32_t>("outputs"),
                       {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER(kQuantizeFp8Cuda, QuantizeFp8Cuda,
                       ffi::Ffi::Bind()
                           .Ctx<Stream>()
                           .Arg<ffi::AnyBuffer>()
                           .Arg<ffi::AnyBuffer>()
                           .RemainingRets()
                           .Attr<bool>("rowwise")
                           .Attr<bool>("columnwise")
                           .Attr<bool>("delayed")
                           .Attr<bool>("pow2_scale")
                           .Attr<float>("amax_epsilon"),
                       {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER(kQuantizeMxfp8Cuda, QuantizeMxfp8Cuda,
                       ffi::Ffi::Bind()
                           .Ctx<Stream>()
                           .Arg<ffi::AnyBuffer>()
                           .RemainingRets()
                           .Attr<bool>("rowwise")
                           .Attr<bool>("columnwise"),
                       {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER(kQuantizeFp8BlockCuda, QuantizeFp8BlockCuda,
                       ffi::Ffi::Bind()
                           .Ctx<Stream>()
                           .Arg<ffi::AnyBuffer>()
                           .RemainingRets()
                           .Attr<bool>("rowwise")
                           .Attr<bool>("columnwise")
                           .Attr<bool>("block_2d")
                           .Attr<bool>("pow2_scale")
                           .Attr<float>("amax_epsilon"),
                       {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER(kQuantizeNvfp4Cuda, QuantizeNvfp4Cuda,
                       ffi::Ffi::Bind()
                           .Ctx<Stream>()
                           .Arg<ffi::AnyBuffer>()
                           .Arg<ffi::AnyBuffer>()
                           .Arg<ffi::AnyBuffer>()
                           .Arg<ffi::AnyBuffer>()
                           .Arg<ffi::AnyBuffer>()
                           .RemainingRets()
                           .Attr<bool>("rowwise")
                           .Attr<bool>("columnwise")
                           .Attr<bool>("row_scaled")
                           .Attr<bool>("block_2d")
                           .Attr<bool>("rht")
                           .Attr<bool>("stochastic"),
                       {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER(kTransposeFp8Cuda, TransposeFp8Cuda,
                       ffi::Ffi::Bind().Ctx<Stream>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>(),
                       {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER(kRawBytesCuda, RawBytesCuda,
                       ffi::Ffi::Bind().Ctx<Stream>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>(),
                       {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER(kEncoderMismatchesCuda, EncoderMismatchesCuda,
                       ffi::Ffi::Bind()
                           .Ctx<Stream>()
                           .Ret<ffi::AnyBuffer>()
                           .Attr<int64_t>("start")
                           .Attr<int64_t>("count")
                           .Attr<int64_t>("stride"));

std::vector<Target> cuda_targets() {
  return {
      {"jaxquant_amax", reinterpret_cast<void*>(kAmaxCuda)},
      {"jaxquant_amax_gated", reinterpret_cast<void*>(kAmaxGatedCuda)},
      {"jaxquant_quantize_fp8", reinterpret_cast<void*>(kQuantizeFp8Cuda)},
      {"jaxquant_quantize_mxfp8", reinterpret_cast<void*>(kQuantizeMxfp8Cuda)},
      {"jaxquant_quantize_fp8_block", reinterpret_cast<void*>(kQuantizeFp8BlockCuda)},
      {"jaxquant_quantize_nvfp4", reinterpret_cast<void*>(kQuantizeNvfp4Cuda)},
      {"jaxquant_transpose_fp8", reinterpret_cast<void*>(kTransposeFp8Cuda)},
      {"jaxquant_debug_raw_bytes", reinterpret_cast<void*>(kRawBytesCuda)},
      {"jaxquant_debug_encoder_mismatches", reinterpret_cast<void*>(kEncoderMismatchesCuda)},
  };
}

}  // namespace jqffi
