// Shared pieces of the quantize kernels: element types, 16-byte loads and stores, CTA
// reductions, and the tile geometry (row phase / swizzled column phase) they all use.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda_handler.h"
#include "quantize/quantize_args.h"

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

// One 16-byte global store (st.global.v4): a plain uint4 store of the row phase's raw values
// compiled to four 4-byte stores (session 21, the SASS of every raw MXFP8 instance), writing
// partial L2 sectors; the instruction written out keeps it one store (a weak one, as a plain
// store; __stwb's `.wb` compiles to a strong one).
__device__ __forceinline__ void store16(void* dst, uint4 v) {
  asm("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
      : "memory");
}

// Stores the first n of the 2 * N bfloat16 values in words w (two a word, the first in the low
// half) at dst; 16-byte stores when all are stored and dst is 16-byte aligned (`vec`).
template <int N>
__device__ __forceinline__ void store_bf16_words(uint16_t* dst, const uint32_t (&w)[N], int n, bool vec) {
  static_assert(N % 4 == 0, "whole 16-byte stores");
  if (vec && n == 2 * N) {
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      store16(dst + 8 * i, make_uint4(w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]));
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < 2 * N; ++i) {
    if (i < n) dst[i] = uint16_t((w[i / 2] >> (16 * (i % 2))) & 0xFFFFu);
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

// Reads back the 8 elements a load-phase thread stored at (r, c..c+7).
template <typename G, typename In>
__device__ __forceinline__ void tile_load8(const In* tile, int r, int c, In* v) {
  reinterpret_cast<uint4*>(v)[0] = reinterpret_cast<const uint4*>(tile + G::offset(r, c))[0];
  if constexpr (sizeof(In) == 4) {
    reinterpret_cast<uint4*>(v)[1] = reinterpret_cast<const uint4*>(tile + G::offset(r, c + 4))[0];
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

// The block's tile by a 32-bit division: a launch has fewer than 2^32 tiles (num_tiles is an
// unsigned), so a row of them does too. (The 64-bit division it replaces is a ~70-instruction
// subroutine a thread; mxfp8_x_layout.cuh measured it at a tenth of that kernel's work.)
__device__ __forceinline__ TileIndex tile_index(int64_t C, int TR, int TC) {
  const uint32_t ntc = uint32_t((C + TC - 1) / TC), tile_row = blockIdx.x / ntc;
  return {int64_t(tile_row) * TR, int64_t(blockIdx.x - tile_row * ntc) * TC};
}

inline unsigned num_tiles(int64_t R, int64_t C, int TR, int TC) {
  return unsigned(ceil_div(R, TR) * ceil_div(C, TC));
}

inline bool aligned(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// Host helpers of the handlers.

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

// Launches a tile kernel with `smem` bytes of dynamic shared memory, opting in where that and
// the kernel's static shared memory (up to 1 KiB) may pass 48 KiB: a 48 KiB request plus a
// static word fails to launch without it (session 22).
template <typename Kernel, typename... Args>
cudaError_t launch_tiles(Kernel kernel, unsigned tiles, int smem, cudaStream_t stream, const Args&... args) {
  if (smem > 47 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
  }
  kernel<<<tiles, kThreads, smem, stream>>>(args...);
  return cudaGetLastError();
}

// The tile of the FP8-format kernels (per tensor, MXFP8, Float8Block): 128 x 128.
template <typename In>
using FP8Tile = Geometry<In, 128, 128>;

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

// The fewest CTAs a multiprocessor a tile kernel reading producer P is compiled for
// (`__launch_bounds__`'s second argument): 4 for 16-bit x read directly (64 registers a thread
// at 256 threads), 1 (no bound) for producers with arithmetic of their own, whose registers it
// would spill.
template <typename P>
struct TileMinCtas {
  static constexpr int value = 1;
};
template <typename In>
struct TileMinCtas<Direct<In>> {
  static constexpr int value = sizeof(In) == 2 ? 4 : 1;
};
// The same for the per-tensor FP8 and MXFP8 tile kernels: 0 (no bound: ptxas allocates as
// without the argument, where an explicit 1 gives it more registers) unless a producer
// specializes it (their readers of x, direct or gathered, measured at their rate unbounded).
template <typename P>
struct ProducerMinCtas {
  static constexpr int value = 0;
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

// The dynamic shared memory of a tile kernel, as its tile of element type T.
template <typename T>
__device__ __forceinline__ T* shared_tile() {
  extern __shared__ __align__(16) unsigned char smem[];
  return reinterpret_cast<T*>(smem);
}

// Whether an FP8-format tile kernel has a column phase: a columnwise copy or column sums to make
// from the tile it keeps in shared memory.
template <typename Params>
__host__ __device__ __forceinline__ bool has_column_phase(const Params& p) {
  return p.do_col || p.col_sums != nullptr;
}

// Whether a kernel keeps its tile in shared memory: for a column phase, or (`rows_from_tile`,
// overloaded by a format that reads its rowwise values back after a CTA-wide reduction rather
// than keeping them in registers across it) for the rows.
template <typename Params>
__host__ __device__ __forceinline__ bool rows_from_tile(const Params&) { return false; }
template <typename Params>
__host__ __device__ __forceinline__ bool keeps_tile(const Params& p) {
  return has_column_phase(p) || rows_from_tile(p);
}

// Per-tile work a producer does once, by the whole CTA, before any of the tile's rows is read
// (every thread calls it; an overload found by argument-dependent lookup may fill shared memory
// and synchronize): nothing, for a producer that reads rows directly.
template <typename P>
__device__ __forceinline__ void prepare_tile(const P&, int64_t) {}

// What reads a tile whose first row is r0: the producer itself, unless an overload for its type
// (found by argument-dependent lookup) gives a reader of what prepare_tile made. Cheap: the
// kernels call it again where they place their rowwise rows (`row_destination`).
template <typename P>
__device__ __forceinline__ const P& tile_reader(const P& prod, int64_t) {
  return prod;
}

// Where a tile kernel writes the rowwise codes of tile row r: matrix row `row` (-1: nowhere),
// and whether r is also a row of no group of a packed rowwise copy, written as a zero row there
// (`zero_row`). The reader of a producer that packs its rowwise copy overloads it (found by
// argument-dependent lookup); every other reader writes row r.
struct RowDestination {
  int64_t row;
  bool zero_row;
};
template <typename Reader>
__device__ __forceinline__ RowDestination row_destination(const Reader&, int64_t r) {
  return {r, false};
}

// The 8 values at (r0 + pp * step, c .. c+7) of each pass pp, read from a tile reader: each
// pass's load8 in turn. A producer whose values are arithmetic on its loads overloads it (found
// by argument-dependent lookup) to issue every pass's loads before any arithmetic: inside one
// load8 its arithmetic waits on that pass's loads, and the passes' loads then do not overlap.
template <typename Reader, typename Out, int NP>
__device__ __forceinline__ void load_passes(const Reader& reader, int64_t r0, int step, int64_t c, Out (&raw)[NP][8]) {
#pragma unroll
  for (int pp = 0; pp < NP; ++pp) reader.load8(r0 + pp * step, c, raw[pp]);
}

// The load phase of the FP8-format tile kernels: the CTA's tile, this thread's place in it (tile
// row pass * RPP + lr, columns lc .. lc+7) and its 8 values of each pass, read from the producer
// with every load issued before any is used.
template <typename P>
struct Fp8TileLoad {
  using In = typename P::Out;
  using G = FP8Tile<In>;
  In* tile;
  bool column_phase, keep_tile;
  TileIndex t;
  int lr, lc;
  alignas(16) In raw[G::NP][8];
  uint32_t amax = 0;  // the largest |bits| of the passes so far

  template <typename Params>
  __device__ __forceinline__ Fp8TileLoad(const P& prod, const Params& p)
      : tile(shared_tile<In>()), column_phase(has_column_phase(p)), keep_tile(keeps_tile(p)),
        t(tile_index(p.C, G::TR, G::TC)),
        lr(threadIdx.x / G::TPR), lc((threadIdx.x % G::TPR) * 8) {
    prepare_tile(prod, t.r0);
    load_passes(tile_reader(prod, t.r0), row(0), G::RPP, col(), raw);
  }

  // The matrix row of pass pp and the matrix column of this thread's first value.
  __device__ __forceinline__ int64_t row(int pp) const { return t.r0 + pp * G::RPP + lr; }
  __device__ __forceinline__ int64_t col() const { return t.c0 + lc; }

  // Pass pp: keeps its values in the shared tile when there is a column phase, and returns them
  // as floats in v with the largest of their |bits| (also taken into `amax`).
  __device__ __forceinline__ uint32_t pass(int pp, float* v) {
    if (keep_tile) tile_store8<G>(tile, pp * G::RPP + lr, lc, raw[pp]);
    uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      v[i] = to_float(raw[pp][i]);
      m = max(m, jq::abs_bits(v[i]));
    }
    amax = max(amax, m);
    return m;
  }
};

// Where position r of expert weights (E rows an expert) sits in their columnwise copy
// [G, rows, E / per] (per = positions an element covers: 1 for data, the block for scales;
// rows = C, or the row blocks for 2-D scales): expert r / E's [rows, E / per] matrix. A
// column-phase thread keeps its rows for the whole phase (only its column changes), so the
// kernels find this once, not at every store: the division cost ~35 instructions a store in
// the expert-weights instances (session 21 SASS). Positions are below 2^31 (the handlers
// check), so the division is a 32-bit one. E = 0 (the default): not expert weights.
struct ExpertRow {
  uint32_t E = 0, expert = 0, local = 0;
  ExpertRow() = default;
  __device__ __forceinline__ ExpertRow(int64_t r, int64_t rows_an_expert)
      : E(uint32_t(rows_an_expert)), expert(uint32_t(r) / E), local(uint32_t(r) - expert * E) {}
  // Index of (row c, this position) in the copy.
  __device__ __forceinline__ int64_t index(int64_t c, int64_t rows, int per) const {
    const int64_t len = E / uint32_t(per);
    return int64_t(expert) * rows * len + c * len + local / uint32_t(per);
  }
};

// Column phase, iteration `it`: this thread's 16-row chunk of its tile column (matrix column c,
// rows rr .. rr+15) as floats, and its share of the column sums when `col_sums` is not null
// (every lane takes part: shuffles).
template <typename G>
struct Fp8TileColumn {
  ColumnSlot<G> slot;
  int64_t c, rr;
  float w[16];

  template <typename In>
  __device__ __forceinline__ Fp8TileColumn(const In* tile, TileIndex t, int it, int64_t C, float* col_sums)
      : slot(it), c(t.c0 + slot.cl), rr(t.r0 + 16 * slot.j) {
    tile_column16<G>(tile, 16 * slot.j, slot.cl, w);
    if (col_sums) column_tile_sum<G>(w, slot.j, c, t.r0 / G::TR, C, col_sums);
  }

  // Writes the chunk's 16 one-byte codes (`code4(w + 4 * k)` packs four) to the columnwise copy
  // `out` [C, R] (the matrix transposed): row c, columns rr .. rr+15, clipped to R. Expert
  // weights (`er.E` > 0 rows an expert, a multiple of 16; `er` the place of rr): `out` is
  // [R / E, C, E], each expert's copy on its own.
  template <typename Code4>
  __device__ __forceinline__ void store(uint8_t* out, int64_t R, bool vec, Code4 code4,
                                        int64_t C = 0, ExpertRow er = {}) const {
    uint32_t q[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) q[k] = code4(w + 4 * k);
    store_codes(out, R, vec, q, C, er);
  }

  // The same for the chunk's codes already made, four a word (the first in the low byte).
  __device__ __forceinline__ void store_codes(uint8_t* out, int64_t R, bool vec, const uint32_t (&q)[4],
                                              int64_t C = 0, ExpertRow er = {}) const {
    if (er.E > 0) {
      store_bytes16(out + er.index(c, C, 1), q, 16, vec);
    } else {
      store_bytes16(out + c * R + rr, q, int(min64(16, R - rr)), vec);
    }
  }

  // The same chunk's codes `q` (four a word) as their bfloat16 raw values (`raw8(q, v)` turns
  // two words of codes into four of bfloat16 pairs) at the same positions of a bfloat16 copy.
  // Every lane calls it; `active`: whether this lane's chunk is in the matrix. kPairs, with
  // `vec` (16-byte aligned, R a multiple of 32): the lanes of a 32-row block (chunks j, j ^ 1,
  // neighbours) swap a half (a shuffle) so that each of the pair's two 16-byte stores writes 32
  // contiguous bytes with its partner's, whole L2 sectors; without it each lane stores its own
  // 32 bytes and every store instruction writes half sectors. Nsight Compute, H200, session
  // 20: the 64-expert step's dy copies 108 -> 84 us with pairs, its expert weights 448 -> 484 us
  // (session 21, with fewer instructions a chunk: 371 -> 401 us), so the kernel pairs tokens'
  // copies only.
  template <bool kPairs, typename Raw8>
  __device__ __forceinline__ void store_raw(uint16_t* out, int64_t R, bool vec, const uint32_t (&q)[4],
                                            Raw8 raw8, bool active, int64_t C = 0, ExpertRow er = {}) const {
    uint32_t v[8];
    raw8(q, v);          // v[0..3]: rows rr .. rr+7
    raw8(q + 2, v + 4);  // v[4..7]: rows rr+8 .. rr+15
    const bool odd = slot.j & 1;
    uint32_t got[4];  // even lane: the odd partner's rows rr+16 .. rr+23; odd: the even's rr-8 .. rr-1
    if constexpr (kPairs) {
#pragma unroll
      for (int i = 0; i < 4; ++i) got[i] = __shfl_xor_sync(0xFFFFFFFFu, odd ? v[i] : v[4 + i], 1);
    }
    if (!active) return;
    uint16_t* dst = er.E > 0 ? out + er.index(c, C, 1) : out + c * R + rr;
    if (!kPairs || !vec) {
      store_bf16_words(dst, v, er.E > 0 ? 16 : int(min64(16, R - rr)), vec);
      return;
    }
    // Branch-free, so both lanes of a pair issue the same two store instructions.
    const uint4 first = odd ? make_uint4(got[0], got[1], got[2], got[3]) : make_uint4(v[0], v[1], v[2], v[3]);
    const uint4 second = odd ? make_uint4(v[4], v[5], v[6], v[7]) : make_uint4(got[0], got[1], got[2], got[3]);
    store16(dst + (odd ? -8 : 0), first);
    store16(dst + (odd ? 8 : 16), second);
  }
};

// The largest |bits| of v[0 .. N-1] (the NaN-propagating amax order).
template <int N>
__device__ __forceinline__ uint32_t abs_bits_max(const float* v) {
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < N; ++i) m = max(m, jq::abs_bits(v[i]));
  return m;
}

// Four FP8 codes of v[0 .. 3] * scale, the first in the low byte.
__device__ __forceinline__ uint32_t fp8_codes4(const float* v, float scale, jq::Fp8 fmt) {
  return jq::encode_fp8x4(v[0] * scale, v[1] * scale, v[2] * scale, v[3] * scale, fmt);
}

}  // namespace
}  // namespace jqffi
