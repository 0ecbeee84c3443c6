// Shared pieces of the quantize kernels: element types, 16-byte loads and stores, CTA
// reductions, and the tile geometry (row phase / swizzled column phase) they all use.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "handler_common.h"

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

// Host helpers of the handlers.
inline ffi::Error launch_status(const char* target, cudaError_t e = cudaSuccess) {
  if (e == cudaSuccess) e = cudaGetLastError();
  if (e != cudaSuccess) return ffi::Error::Internal(std::string(target) + ": CUDA error: " + cudaGetErrorString(e));
  return ffi::Error::Success();
}

// Zeroes an output that is reduced with atomics (a no-op for a null pointer).
inline ffi::Error clear(cudaStream_t stream, void* p, size_t bytes) {
  if (p && cudaMemsetAsync(p, 0, bytes, stream) != cudaSuccess) return launch_status("cudaMemsetAsync");
  return ffi::Error::Success();
}

// Calls f with a value of the element type of `type`.
template <typename F>
ffi::Error by_input_type(In type, F&& f) {
  switch (type) {
    case In::kBF16: f(BF16{}); break;
    case In::kF16: f(F16{}); break;
    default: f(float{}); break;
  }
  return ffi::Error::Success();
}

inline bool vec_input(const Input& x) { return aligned(x.data, 16) && x.cols % 8 == 0; }

// Launches a tile kernel with `smem` bytes of dynamic shared memory (opting in above 48 KiB).
template <typename Kernel, typename... Args>
cudaError_t launch_tiles(Kernel kernel, unsigned tiles, int smem, cudaStream_t stream, const Args&... args) {
  if (smem > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
  }
  kernel<<<tiles, kThreads, smem, stream>>>(args...);
  return cudaGetLastError();
}

// What the FP8-format tile kernels quantize: a producer gives the 8 values of the matrix being
// quantized at (r, c .. c+7) in its element type `Out` (zeros outside [R, C]); the tile and the
// column phase keep that type. `Direct` reads them from x (the quantize targets); the fused
// producers (ffi/fused) compute them from a normalization's or an activation's inputs.
template <typename In>
struct Direct {
  using Out = In;
  const In* x;
  int64_t R, C;
  bool vec;
  __device__ __forceinline__ void load8(int64_t r, int64_t c, In* out) const {
    jqffi::load8(x, R, C, r, c, vec, out);
  }
};

// The column phase's share of reductions.column_tile_sums (a bias gradient): the 16 values a
// thread holds, summed top to bottom, then the NJ chunks of the column pairwise by xor shuffles
// 1, 2, 4 (neighbours first). Every lane must call it (shuffles); `out` is [tiles, C].
template <typename G>
__device__ __forceinline__ void column_tile_sum(const float* w, int j, int64_t c, int64_t tile_row, int64_t C,
                                                float* out) {
  float s = w[0] + w[1];
#pragma unroll
  for (int i = 2; i < 16; ++i) s = s + w[i];
#pragma unroll
  for (int o = 1; o < G::NJ; o <<= 1) s = s + __shfl_xor_sync(0xFFFFFFFFu, s, o);
  if (j == 0 && c < C) out[tile_row * C + c] = s;
}

}  // namespace
}  // namespace jqffi
