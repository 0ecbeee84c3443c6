// CUDA handler of jaxquant_grouped_gemm: the grouped GEMM of every quantized pair (sm_90 and
// later; the CUTLASS Hopper kernels of grouped_sm90.cu serve the per-tensor FP8 and Float8Block
// pairs they can, the Python side picks), one launch whatever G.
//
// A CTA computes a 128 x 128 output tile with 8 warps of bf16 (or f16) mma.sync m16n8k16,
// float32 accumulation. Operands are loaded raw (FP8 / packed FP4 bytes) into registers one
// k-tile ahead, decoded exactly (payload times block scale: E4M3/E5M2 x 2^k (MXFP8,
// power-of-two Float8Block) and E2M1 x E4M3 are exact in bf16; per-tensor FP8 x per-tensor FP8
// is decoded to f16 without a scale, also exact) into a double-buffered shared-memory tile, and
// multiplied. Per-group scale products, per-row and per-(group, column) factors and the bias are
// applied to the float32 accumulator in the epilogue.
//   mode 0 (ragged rows): CTA -> (m-tile, n-tile); m-tiles are numbered group by group from the
//     device-side `pstarts` (a warp scan in each CTA), rows outside the CTA's group are masked;
//     the rows after the last group get zero tiles. Grid = (ceil(L/128) + G + 1) x n-tiles.
//   mode 1 (wgrad): CTA -> (group, m-tile, n-tile); the k-loop runs over the group's positions
//     (masked at both ends); an empty group writes zeros.
// Group sizes never leave the device: no host sync, no allocation, command-buffer compatible.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <atomic>
#include <vector>

#include "cuda_handler.h"
#include "gemm/bf16_decode.cuh"
#include "gemm/store_pairs.cuh"
#include "grouped/grouped_args.h"
#include "grouped/handlers.h"

namespace jqffi {
namespace {

constexpr const char* kTarget = "jaxquant_grouped_gemm";

constexpr int kBM = 128, kBN = 128, kBK = 64, kThreads = 256;
constexpr int kRow = kBK + 8;  // 16-bit elements per shared-memory row (144 B: ldmatrix conflict-free)
constexpr int kTileElems = kBM * kRow;
constexpr int kSmemBytes = 2 * 2 * kTileElems * 2;  // 2 stages x (A + B) x 2 bytes

// One thread's raw share of an operand k-tile: 2 chunks of 16 elements (FP8: 16 bytes; FP4: 8).
struct Raw {
  uint4 w[2];
  uint32_t code[2];  // block scale: E8M0 / E4M3 byte, or float32 bits (Float8Block)
};

// A scale code that decodes to 1 (for chunks with no valid element).
__device__ __forceinline__ uint32_t unit_code(int scaling) {
  return scaling == kScaleMx ? 127u : (scaling == kScaleNv || scaling == kScaleNv2d) ? 0x38u : 0x3F800000u;
}

struct OperandTile {
  const uint8_t* data;   // the operand (expert) matrix
  const uint8_t* scale;  // its block scales (nullptr: per tensor)
  int64_t row0, row_lo, row_hi;  // tile's first row; rows in [row_lo, row_hi) are valid
};

__device__ __forceinline__ uint32_t fetch_code(const GemmOperand& op, const uint8_t* d, int64_t row, int64_t k) {
  const uint8_t* base = d + row * op.row_bytes;
  if (op.elem == Elem::kE2M1) return (__ldg(base + (k >> 1)) >> (4 * (k & 1))) & 0xFu;
  return __ldg(base + k);
}

__device__ __forceinline__ void load_tile(const GemmOperand& op, const OperandTile& t, int64_t k0, int64_t kbeg,
                                          int64_t kend, Raw* raw) {
  const bool fp4 = op.elem == Elem::kE2M1;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int c = threadIdx.x + i * kThreads;
    const int64_t row = t.row0 + (c >> 2), k = k0 + (c & 3) * 16;
    raw->w[i] = make_uint4(0, 0, 0, 0);
    raw->code[i] = unit_code(op.scaling);
    if (row < t.row_lo || row >= t.row_hi || k >= kend || k + 16 <= kbeg) continue;
    const uint8_t* src = t.data + row * op.row_bytes + (fp4 ? (k >> 1) : k);
    const bool full = k >= kbeg && k + 16 <= kend;
    if (full && !fp4 && (reinterpret_cast<uintptr_t>(src) & 15) == 0) {
      raw->w[i] = __ldg(reinterpret_cast<const uint4*>(src));
    } else if (full && fp4 && (reinterpret_cast<uintptr_t>(src) & 7) == 0) {
      const uint2 u = __ldg(reinterpret_cast<const uint2*>(src));
      raw->w[i] = make_uint4(u.x, u.y, 0, 0);
    } else {
      uint32_t words[4] = {0, 0, 0, 0};
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const int64_t kk = k + j;
        if (kk < kbeg || kk >= kend) continue;
        const uint32_t code = fetch_code(op, t.data, row, kk);
        if (fp4) {
          words[j >> 3] |= code << (4 * (j & 7));
        } else {
          words[j >> 2] |= code << (8 * (j & 3));
        }
      }
      raw->w[i] = make_uint4(words[0], words[1], words[2], words[3]);
    }
    if (t.scale) {
      const int64_t k_first = k > kbeg ? k : kbeg;  // any valid element of the chunk: same block
      const float* f32 = reinterpret_cast<const float*>(t.scale);
      switch (op.scaling) {
        case kScaleMx: raw->code[i] = __ldg(t.scale + row * op.scale_cols + k_first / 32); break;
        case kScaleNv: raw->code[i] = __ldg(t.scale + row * op.scale_cols + k_first / 16); break;
        case kScaleNv2d: raw->code[i] = __ldg(t.scale + (row >> 4) * op.scale_cols + k_first / 16); break;
        case kScaleBlock: raw->code[i] = __float_as_uint(__ldg(f32 + row * op.scale_cols + k_first / 128)); break;
        default: raw->code[i] = __float_as_uint(__ldg(f32 + (row >> 7) * op.scale_cols + k_first / 128)); break;
      }
    }
  }
}

__device__ __forceinline__ uint32_t fp8x2_to_f16x2(uint32_t two, Elem elem) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two & 0xFFFFu),
                                                   elem == Elem::kE4M3 ? __NV_E4M3 : __NV_E5M2);
  return uint32_t(h.x) | (uint32_t(h.y) << 16);
}

__device__ __forceinline__ uint32_t pack_bf16(float a, float b) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// ---- exact decoders: gemm/bf16_decode.cuh (shared with the dense dequant kernel) ----------

__device__ __forceinline__ void decode_fp8x4(uint32_t w, Elem elem, uint32_t& lo, uint32_t& hi) {
  if (elem == Elem::kE4M3) {
    decode_e4m3x4(w, lo, hi);
  } else {
    decode_e5m2x4(w, lo, hi);
  }
}

// Decodes a thread's raw chunks into 16-bit values in the shared-memory tile.
template <bool F16>
__device__ __forceinline__ void store_tile(const GemmOperand& op, const Raw& raw, uint16_t* tile) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int c = threadIdx.x + i * kThreads;
    uint32_t out[8];
    const uint32_t w[4] = {raw.w[i].x, raw.w[i].y, raw.w[i].z, raw.w[i].w};
    if constexpr (F16) {
#pragma unroll
      for (int j = 0; j < 8; ++j) out[j] = fp8x2_to_f16x2(w[j >> 1] >> (16 * (j & 1)), op.elem);
    } else if (op.elem == Elem::kE2M1) {
      decode_e2m1x8(w[0], out, kE2M1HiLo, kE2M1LoLo);
      decode_e2m1x8(w[1], out + 4, kE2M1HiLo, kE2M1LoLo);
      const uint32_t f = e4m3_scale_bf16x2(raw.code[i]);
#pragma unroll
      for (int j = 0; j < 8; ++j) out[j] = hmul2_bf16(out[j], f);
    } else {
      // The chunk scale as 2^(e - 127): E8M0 code, 1 for per-tensor FP8, or a power-of-two float.
      uint32_t e = 127u;
      bool exact_pow2 = true;
      if (op.scaling == kScaleMx) {
        e = raw.code[i];
      } else if (op.scaling == kScaleBlock || op.scaling == kScaleBlock2d) {
        const uint32_t bits = raw.code[i];
        if ((bits & 0x807FFFFFu) == 0 && bits != 0) {
          e = bits >> 23;  // a normal power of two (255: inf)
          exact_pow2 = e != 255u;
        } else {
          exact_pow2 = bits == 0x00400000u;  // 2^-127
          e = 0;
        }
      }
      if (exact_pow2) {
#pragma unroll
        for (int q = 0; q < 4; ++q) decode_fp8x4(w[q], op.elem, out[2 * q], out[2 * q + 1]);
        const uint32_t offset = op.elem == Elem::kE4M3 ? 120u : 112u;  // decode gives value * 2^-offset
        const uint32_t t = e + offset;
        if (t <= 254u) {
          const uint32_t f = pow2_bf16x2(t);
#pragma unroll
          for (int j = 0; j < 8; ++j) out[j] = hmul2_bf16(out[j], f);
        } else {  // 2^offset first, then 2^(e - 127) (NaN for e == 255)
          const uint32_t f1 = pow2_bf16x2(offset + 127u), f2 = e8m0_bf16x2(e);
#pragma unroll
          for (int j = 0; j < 8; ++j) out[j] = hmul2_bf16(hmul2_bf16(out[j], f1), f2);
        }
      } else {  // any other float32 scale: exact float path (not exact in bf16 in general)
        const float s = __uint_as_float(raw.code[i]);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const uint32_t h = fp8x2_to_f16x2(w[j >> 1] >> (16 * (j & 1)), op.elem);
          const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
          out[j] = pack_bf16(f.x * s, f.y * s);
        }
      }
    }
    uint4* dst = reinterpret_cast<uint4*>(tile + (c >> 2) * kRow + (c & 3) * 16);
    dst[0] = make_uint4(out[0], out[1], out[2], out[3]);
    dst[1] = make_uint4(out[4], out[5], out[6], out[7]);
  }
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t* r, const uint16_t* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

template <bool F16>
__device__ __forceinline__ void mma(float* c, const uint32_t* a, const uint32_t* b) {
  if constexpr (F16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

// The ragged-mode tile of CTA `mt`: its group and its first row; g == G for the zero tiles
// after the last group, -1 for a CTA with nothing to do.
struct TileAssignment {
  int g;
  int64_t row0, row_hi;
};

__device__ TileAssignment assign_ragged(const GemmParams& p, int64_t mt) {
  __shared__ int s_group;
  __shared__ long long s_row0;
  const int lane = threadIdx.x & 31;
  if (threadIdx.x < 32) {
    int64_t base = 0;
    int found = -1;
    long long row0 = 0;
    for (int g0 = 0; g0 < p.G && found < 0; g0 += 32) {
      const int g = g0 + lane;
      int64_t tiles = 0;
      if (g < p.G) {
        const int64_t ext = int64_t(__ldg(p.pstarts + g + 1)) - __ldg(p.pstarts + g);
        tiles = ext > 0 ? (ext + kBM - 1) / kBM : 0;
      }
      int64_t incl = tiles;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int64_t v = __shfl_up_sync(0xFFFFFFFFu, incl, o);
        if (lane >= o) incl += v;
      }
      const int64_t excl = incl - tiles;
      const bool mine = g < p.G && base + excl <= mt && mt < base + incl;
      const unsigned hit = __ballot_sync(0xFFFFFFFFu, mine);
      if (hit) {
        const int src = __ffs(hit) - 1;
        found = g0 + src;
        const int64_t e = __shfl_sync(0xFFFFFFFFu, excl, src);
        row0 = __ldg(p.pstarts + found) + (mt - base - e) * kBM;
      }
      base += __shfl_sync(0xFFFFFFFFu, incl, 31);
    }
    if (found < 0) {  // zero tiles after the last group
      const int64_t tail0 = __ldg(p.pstarts + p.G);
      row0 = tail0 + (mt - base) * kBM;
      found = row0 < p.L ? int(p.G) : -1;
    }
    if (lane == 0) {
      s_group = found;
      s_row0 = row0;
    }
  }
  __syncthreads();
  TileAssignment a;
  a.g = s_group;
  a.row0 = s_row0;
  a.row_hi = a.g >= 0 && a.g < p.G ? min(int64_t(__ldg(p.pstarts + a.g + 1)), p.L) : p.L;
  return a;
}

// v0 (and v1 when `pair`) as the output dtype at out[idx].
__device__ __forceinline__ void store_out(const GemmParams& p, int64_t idx, float v0, float v1,
                                          bool pair) {
  switch (p.out_kind) {
    case kOutBF16: store_pair(static_cast<__nv_bfloat16*>(p.out) + idx, v0, v1, pair); break;
    case kOutF16: store_pair(static_cast<__half*>(p.out) + idx, v0, v1, pair); break;
    default: store_pair(static_cast<float*>(p.out) + idx, v0, v1, pair); break;
  }
}

template <bool F16>
__global__ void __launch_bounds__(kThreads, 2) grouped_gemm_kernel(const GemmParams p) {
  extern __shared__ __align__(16) uint16_t smem[];
  const int64_t n_tiles = (p.N + kBN - 1) / kBN;
  const int64_t nt = blockIdx.x % n_tiles, mt = blockIdx.x / n_tiles;
  int g;
  OperandTile ta, tb;
  int64_t kbeg = 0, kend = p.K, out_row0, out_row_hi;
  if (p.mode == kModeRagged) {
    const TileAssignment as = assign_ragged(p, mt);
    if (as.g < 0) return;
    g = as.g;
    out_row0 = as.row0;
    out_row_hi = as.row_hi;
    ta = {p.a.data, p.a.scale, as.row0, as.row0, as.row_hi};
    const int gb = g < p.G ? g : 0;
    tb = {p.b.data + int64_t(gb) * p.N * p.b.row_bytes,
          p.b.scale ? p.b.scale + int64_t(gb) * p.b.scale_rows * p.b.scale_cols * (p.b.scaling >= kScaleBlock ? 4 : 1)
                    : nullptr,
          nt * kBN, 0, p.N};
    if (g == p.G) kend = 0;  // zero tile
  } else {
    const int64_t m_tiles = (p.M + kBM - 1) / kBM;
    g = int(mt / m_tiles);
    const int64_t m0 = (mt % m_tiles) * kBM;
    out_row0 = m0;
    out_row_hi = p.M;
    ta = {p.a.data, p.a.scale, m0, 0, p.M};
    tb = {p.b.data, p.b.scale, nt * kBN, 0, p.N};
    kbeg = min(int64_t(__ldg(p.pstarts + g)), p.K);
    kend = max(kbeg, min(int64_t(__ldg(p.pstarts + g + 1)), p.K));
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int wm = warp >> 2, wn = warp & 3;  // 2 x 4 warps, 64 x 32 each
  float acc[4][4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

  if (kend > kbeg) {
    int64_t k0 = (kbeg / kBK) * kBK;
    Raw ra, rb;
    load_tile(p.a, ta, k0, kbeg, kend, &ra);
    load_tile(p.b, tb, k0, kbeg, kend, &rb);
    int stage = 0;
    for (; k0 < kend; k0 += kBK) {
      uint16_t* sa = smem + stage * 2 * kTileElems;
      uint16_t* sb = sa + kTileElems;
      store_tile<F16>(p.a, ra, sa);
      store_tile<F16>(p.b, rb, sb);
      __syncthreads();
      if (k0 + kBK < kend) {
        load_tile(p.a, ta, k0 + kBK, kbeg, kend, &ra);
        load_tile(p.b, tb, k0 + kBK, kbeg, kend, &rb);
      }
#pragma unroll
      for (int kk = 0; kk < kBK; kk += 16) {
        uint32_t af[4][4], bf[2][4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          ldmatrix_x4(af[i], sa + (wm * 64 + i * 16 + (lane & 15)) * kRow + kk + (lane >> 4) * 8);
        }
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          ldmatrix_x4(bf[j], sb + (wn * 32 + j * 16 + (lane >> 4) * 8 + (lane & 7)) * kRow + kk + ((lane >> 3) & 1) * 8);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) mma<F16>(acc[i][j], af[i], &bf[j >> 1][(j & 1) * 2]);
      }
      stage ^= 1;
    }
  }

  // Epilogue: per-group, per-row and per-column factors, bias, masked stores.
  const bool zero_tile = p.mode == kModeRagged && g == p.G;
  const float gf = (!zero_tile && p.group_factor) ? __ldg(p.group_factor + g) : 1.0f;
  const bool pairs = p.N % 2 == 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t r = out_row0 + wm * 64 + i * 16 + (lane >> 2) + h * 8;
      if (r >= out_row_hi || r < 0) continue;
      const int64_t row_index = p.mode == kModeRagged ? r : int64_t(g) * p.M + r;
      const float rf = (!zero_tile && p.row_factor) ? __ldg(p.row_factor + row_index) : 1.0f;
      const int64_t out_row = p.mode == kModeRagged ? r : int64_t(g) * p.M + r;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int64_t n = nt * kBN + wn * 32 + j * 8 + (lane & 3) * 2;
        if (n >= p.N) continue;
        float v[2] = {acc[i][j][2 * h], acc[i][j][2 * h + 1]};
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (zero_tile) {
            v[e] = 0.0f;
            continue;
          }
          if (n + e >= p.N) continue;
          if (p.group_factor) v[e] = v[e] * gf;
          if (p.row_factor) v[e] = v[e] * rf;
          if (p.col_factor) v[e] = v[e] * __ldg(p.col_factor + int64_t(g) * p.N + n + e);
          if (p.bias) v[e] = v[e] + __ldg(p.bias + int64_t(g) * p.N + n + e);
        }
        if (pairs) {
          store_out(p, out_row * p.N + n, v[0], v[1], true);
        } else {
          store_out(p, out_row * p.N + n, v[0], 0.0f, false);
          if (n + 1 < p.N) store_out(p, out_row * p.N + n + 1, v[1], 0.0f, false);
        }
      }
    }
  }
}

template <bool F16>
cudaError_t launch_gemm(const GemmParams& p, cudaStream_t stream) {
  auto kernel = grouped_gemm_kernel<F16>;
  static std::atomic<uint64_t> configured{0};
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  const uint64_t bit = uint64_t(1) << (device & 63);
  if (!(configured.load(std::memory_order_acquire) & bit)) {
    if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
        e != cudaSuccess) {
      return e;
    }
    configured.fetch_or(bit, std::memory_order_release);
  }
  const int64_t n_tiles = (p.N + kBN - 1) / kBN;
  const int64_t m_tiles = p.mode == kModeRagged ? (p.L + kBM - 1) / kBM + p.G + 1
                                                : p.G * ((p.M + kBM - 1) / kBM);
  const int64_t ctas = m_tiles * n_tiles;
  if (ctas <= 0) return cudaSuccess;
  if (ctas >= (int64_t{1} << 31)) return cudaErrorInvalidConfiguration;
  kernel<<<unsigned(ctas), kThreads, kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

ffi::Error GroupedGemmCuda(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer a_scale,
                           ffi::AnyBuffer b, ffi::AnyBuffer b_scale, ffi::AnyBuffer pstarts,
                           ffi::AnyBuffer row_factor, ffi::AnyBuffer col_factor,
                           ffi::AnyBuffer group_factor, ffi::AnyBuffer bias,
                           ffi::Result<ffi::AnyBuffer> out, int32_t mode, int32_t a_scaling,
                           int32_t b_scaling, bool has_row_factor, bool has_col_factor,
                           bool has_group_factor, bool has_bias) {
  GemmParams p;
  JQ_RETURN_IF_ERROR(decode_grouped_gemm(kTarget, a, a_scale, b, b_scale, pstarts, row_factor,
                                         col_factor, group_factor, bias, out, mode, a_scaling,
                                         b_scaling, has_row_factor, has_col_factor,
                                         has_group_factor, has_bias, &p));
  if (p.L == 0 || p.N == 0 || p.M == 0) return ffi::Error::Success();
  const bool f16 = p.a.scaling == kScalePerTensor && p.b.scaling == kScalePerTensor &&
                   p.a.elem != Elem::kE2M1 && p.b.elem != Elem::kE2M1;
  return launch_status(kTarget, f16 ? launch_gemm<true>(p, stream) : launch_gemm<false>(p, stream));
}

}  // namespace

JQ_DEFINE_CUDA_HANDLER(kGroupedGemmCuda, GroupedGemmCuda, BindGroupedGemm);

std::vector<Target> grouped_gemm_cuda_targets() { return {target(kTarget, kGroupedGemmCuda)}; }

}  // namespace jqffi
