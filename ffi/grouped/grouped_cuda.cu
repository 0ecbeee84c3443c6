// CUDA handlers of the grouped (mixture-of-experts) targets (sm_90; see registrations.h).
//
// Grouped FP8 quantize (jaxquant_grouped_quantize_fp8), launches for all groups, whatever G:
//   1. amax (current scaling only): one warp per row of x, the row's group found by binary
//      search in `starts`, an atomicMax of |x| bits into amax[group] (NaN above inf, as the
//      reference's segment max);
//   2. quantize: a CTA owns 64 token positions x 64 features of the output layout; each position
//      finds its group and source row (or is padding / no group: code 0), scales by its group's
//      scale (from the amax, or the delayed-scaling state), writes the rowwise bytes, keeps the
//      values in shared memory and writes the transposed columnwise bytes from there (for expert
//      weights the columnwise copy is [G, C, rows]). Delayed scaling has its scales before the
//      launch, so there is no amax pass: the load phase (which runs for either copy and reads
//      every element of every group's rows exactly once, the layout holding each group's rows
//      at its positions) also reduces each group's amax, the state's history entry: the rows
//      of the tile's first group reduced in the CTA (one atomicMax a CTA, as many as the amax
//      pass's one a row), those of later groups by warp (warp_group_amax).
// jaxquant_grouped_amax_gated (the just-in-time first scale of delayed scaling): the amax
// kernel, exiting at once unless some group's scale is still 0.
//
// Grouped GEMM (jaxquant_grouped_gemm): one launch. A CTA computes a 128 x 128 output tile with
// 8 warps of bf16 (or f16) mma.sync m16n8k16, float32 accumulation. Operands are loaded raw
// (FP8 / packed FP4 bytes) into registers one k-tile ahead, decoded exactly (payload times block
// scale: E4M3/E5M2 x 2^k (MXFP8, power-of-two Float8Block) and E2M1 x E4M3 are exact in bf16; per-tensor FP8 x per-tensor FP8 is
// decoded to f16 without a scale, also exact) into a double-buffered shared-memory tile, and
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
#include <string>

#include "gemm/bf16_decode.cuh"
#include "grouped/cuda_targets.h"
#include "grouped/grouped_amax.cuh"
#include "grouped/grouped_args.h"

namespace jqgrouped {
namespace {

using namespace jaxquant_bf16_decode;

using Stream = ffi::PlatformStream<cudaStream_t>;

ffi::Error status(const char* target, cudaError_t e = cudaSuccess) {
  if (e == cudaSuccess) e = cudaGetLastError();
  if (e != cudaSuccess) return ffi::Error::Internal(std::string(target) + ": CUDA error: " + cudaGetErrorString(e));
  return ffi::Error::Success();
}

// ============================================================================================
// Grouped FP8 quantize
// ============================================================================================

constexpr int kQP = 64, kQC = 64;  // positions x features per quantize CTA

__device__ __forceinline__ float group_scale(const QuantizeParams& p, int g, float fmax) {
  if (g >= p.G) return 1.0f;
  return p.delayed ? p.s[g] : jq::scale_from_amax(p.amax[g], fmax, p.pow2_scale, p.amax_epsilon);
}

template <int TYPE>
__global__ void __launch_bounds__(256) grouped_quantize_kernel(const QuantizeParams p) {
  __shared__ float tile[kQP][kQC + 1];
  __shared__ float scales[kQP];
  __shared__ int tile_group;         // delayed: the group of the tile's first position
  __shared__ uint32_t tile_amax;     // and its max |x| bits over the tile
  const jq::Fp8 fmt = static_cast<jq::Fp8>(p.fmt);
  const float fmax = jq::spec_of(fmt).fmax;
  const int tid = threadIdx.x;
  const int64_t c_tiles = (p.C + kQC - 1) / kQC;
  const int64_t p0 = int64_t(blockIdx.x / c_tiles) * kQP, c0 = int64_t(blockIdx.x % c_tiles) * kQC;
  if (blockIdx.x == 0) {
    for (int g = tid; g < p.G; g += 256) p.scale_inv[g] = jq::rcp_f32(group_scale(p, g, fmax));
  }
  {  // rowwise: thread -> (position, 16 features)
    const int pr = tid >> 2, cq = (tid & 3) * 16;
    const int64_t pos = p0 + pr, c = c0 + cq;
    int64_t src = -1;
    int g = int(p.G);
    if (pos < p.L) {
      g = upper_group(p.pstarts, int(p.G), pos);
      if (g < p.G) {
        const int64_t local = pos - __ldg(p.pstarts + g);
        if (local < int64_t(__ldg(p.starts + g + 1)) - __ldg(p.starts + g)) src = __ldg(p.starts + g) + local;
      }
    }
    const float scale = group_scale(p, g, fmax);
    if (cq == 0) scales[pr] = scale;
    float v[16];
    const int n_valid = src >= 0 ? int(max(int64_t(0), min(int64_t(16), p.C - c))) : 0;
    const bool vec = (TYPE == 2 ? p.C % 4 == 0 : p.C % 8 == 0) && (reinterpret_cast<uintptr_t>(p.x) & 15) == 0;
    const int64_t off = src >= 0 ? src * p.C + c : 0;
    load8<TYPE>(p.x, off, n_valid, vec, v);
    load8<TYPE>(p.x, off + 8, n_valid - 8, vec, v + 8);
    if (p.delayed) {  // the amax to record (lanes past C or without a row hold zeros)
      uint32_t m = 0;
#pragma unroll
      for (int i = 0; i < 16; ++i) m = max(m, jq::abs_bits(v[i]));
      if (tid == 0) {  // position p0's group: usually the whole tile's
        tile_group = g;
        tile_amax = 0u;
      }
      __syncthreads();
      const int mine = src >= 0 ? g : -1;
      uint32_t mt = mine == tile_group ? m : 0u;  // reduced in the CTA: one global atomic
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) mt = max(mt, __shfl_xor_sync(0xFFFFFFFFu, mt, o));
      if ((tid & 31) == 0 && mt != 0u) atomicMax(&tile_amax, mt);
      warp_group_amax(p.amax, mine == tile_group ? -1 : mine, m);  // rows of later groups
      __syncthreads();
      if (tid == 0 && tile_amax != 0u) atomicMax(reinterpret_cast<uint32_t*>(p.amax) + tile_group, tile_amax);
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) tile[pr][cq + i] = v[i];
    if (p.row && pos < p.L && c < p.C) {
      uint32_t q[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        q[k] = jq::encode_fp8x4(v[4 * k] * scale, v[4 * k + 1] * scale, v[4 * k + 2] * scale, v[4 * k + 3] * scale, fmt);
      }
      uint8_t* dst = p.row + pos * p.C + c;
      if (c + 16 <= p.C && (reinterpret_cast<uintptr_t>(dst) & 15) == 0) {
        *reinterpret_cast<uint4*>(dst) = make_uint4(q[0], q[1], q[2], q[3]);
      } else {
        for (int i = 0; i < 16 && c + i < p.C; ++i) dst[i] = uint8_t(q[i / 4] >> (8 * (i % 4)));
      }
    }
  }
  if (!p.col) return;
  __syncthreads();
  {  // columnwise: thread -> (feature, 16 positions)
    const int cc = tid >> 2, pq = (tid & 3) * 16;
    const int64_t c = c0 + cc, pos = p0 + pq;
    if (c >= p.C || pos >= p.L) return;
    uint32_t q[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      float w[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) w[i] = tile[pq + 4 * k + i][cc] * scales[pq + 4 * k + i];
      q[k] = jq::encode_fp8x4(w[0], w[1], w[2], w[3], fmt);
    }
    const int n = int(min(int64_t(16), p.L - pos));
    if (p.expert_rows == 0) {
      uint8_t* dst = p.col + c * p.L + pos;
      if (n == 16 && (reinterpret_cast<uintptr_t>(dst) & 15) == 0) {
        *reinterpret_cast<uint4*>(dst) = make_uint4(q[0], q[1], q[2], q[3]);
      } else {
        for (int i = 0; i < n; ++i) dst[i] = uint8_t(q[i / 4] >> (8 * (i % 4)));
      }
    } else {
      const int64_t E = p.expert_rows;
      const int64_t g = pos / E, local = pos % E;
      uint8_t* dst = p.col + (g * p.C + c) * E + local;
      if (n == 16 && local + 16 <= E && (reinterpret_cast<uintptr_t>(dst) & 15) == 0) {
        *reinterpret_cast<uint4*>(dst) = make_uint4(q[0], q[1], q[2], q[3]);
      } else {
        for (int i = 0; i < n; ++i) {
          const int64_t pi = pos + i;
          p.col[((pi / E) * p.C + c) * E + pi % E] = uint8_t(q[i / 4] >> (8 * (i % 4)));
        }
      }
    }
  }
}

ffi::Error GroupedQuantizeFp8Cuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer starts,
                                  ffi::AnyBuffer pstarts, ffi::AnyBuffer s, ffi::RemainingRets rets,
                                  bool rowwise, bool columnwise, bool delayed, bool pow2_scale,
                                  float amax_epsilon, int64_t length, int64_t expert_rows) {
  const char* t = "jaxquant_grouped_quantize_fp8";
  QuantizeParams p;
  JQ_RETURN_IF_ERROR(decode_quantize_fp8(t, x, starts, pstarts, s, rets, rowwise, columnwise, delayed,
                                         pow2_scale, amax_epsilon, length, expert_rows, &p));
  if (cudaError_t e = cudaMemsetAsync(p.amax, 0, 4 * p.G, stream); e != cudaSuccess) return status(t, e);
  const int64_t tiles = ((p.L + kQP - 1) / kQP) * ((p.C + kQC - 1) / kQC);
  by_type(p.in_type, [&](auto tag) {
    constexpr int TYPE = decltype(tag)::value;
    if (!p.delayed) grouped_amax_kernel<TYPE><<<amax_grid(p.T), 256, 0, stream>>>(p);
    grouped_quantize_kernel<TYPE><<<unsigned(tiles), 256, 0, stream>>>(p);
  });
  return status(t);
}

ffi::Error GroupedAmaxCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer starts,
                           ffi::Result<ffi::AnyBuffer> amax) {
  const char* t = "jaxquant_grouped_amax";
  QuantizeParams p;
  JQ_RETURN_IF_ERROR(decode_amax(t, x, starts, amax, &p));
  if (cudaError_t e = cudaMemsetAsync(p.amax, 0, 4 * p.G, stream); e != cudaSuccess) return status(t, e);
  by_type(p.in_type, [&](auto tag) {
    grouped_amax_kernel<decltype(tag)::value><<<amax_grid(p.T), 256, 0, stream>>>(p);
  });
  return status(t);
}

ffi::Error GroupedAmaxGatedCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer starts,
                                ffi::AnyBuffer gate, ffi::Result<ffi::AnyBuffer> amax) {
  const char* t = "jaxquant_grouped_amax_gated";
  QuantizeParams p;
  JQ_RETURN_IF_ERROR(decode_amax_gated(t, x, starts, gate, amax, &p));
  if (cudaError_t e = cudaMemsetAsync(p.amax, 0, 4 * p.G, stream); e != cudaSuccess) return status(t, e);
  by_type(p.in_type, [&](auto tag) {
    grouped_amax_kernel<decltype(tag)::value><<<amax_grid(p.T), 256, 0, stream>>>(p);
  });
  return status(t);
}

// ============================================================================================
// Grouped GEMM
// ============================================================================================

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
  if (op.elem == kElemE2M1) return (__ldg(base + (k >> 1)) >> (4 * (k & 1))) & 0xFu;
  return __ldg(base + k);
}

__device__ __forceinline__ void load_tile(const GemmOperand& op, const OperandTile& t, int64_t k0, int64_t kbeg,
                                          int64_t kend, Raw* raw) {
  const bool fp4 = op.elem == kElemE2M1;
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

__device__ __forceinline__ uint32_t fp8x2_to_f16x2(uint32_t two, int elem) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two & 0xFFFFu),
                                                   elem == kElemE4M3 ? __NV_E4M3 : __NV_E5M2);
  return uint32_t(h.x) | (uint32_t(h.y) << 16);
}

__device__ __forceinline__ uint32_t pack_bf16(float a, float b) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// ---- exact decoders: ffi/gemm/bf16_decode.cuh (shared with the dense dequant kernel) -------

__device__ __forceinline__ void decode_fp8x4(uint32_t w, int elem, uint32_t& lo, uint32_t& hi) {
  if (elem == kElemE4M3) {
    decode_e4m3x4(w, lo, hi);
  } else {
    decode_e5m2x4(w, lo, hi);
  }
}

__device__ __forceinline__ void decode_e2m1x8(uint32_t w, uint32_t* out) {
  jaxquant_bf16_decode::decode_e2m1x8(w, out, kE2M1HiLo, kE2M1LoLo);
}

// The bf16x2 factor 2^t (t a biased exponent in [1, 254]).
__device__ __forceinline__ uint32_t pow2_bf16x2(uint32_t t) { return (t << 7) * 0x10001u; }

// 2^(e - 127) as bf16x2, NaN for e == 255, 2^-127 (subnormal) for e == 0.
__device__ __forceinline__ uint32_t e8m0_bf16x2(uint32_t e) {
  const uint32_t b = e == 0 ? 0x0040u : ((e << 7) | (((e + 1u) >> 8) << 6));
  return b * 0x10001u;
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
    } else if (op.elem == kElemE2M1) {
      decode_e2m1x8(w[0], out);
      decode_e2m1x8(w[1], out + 4);
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
        const uint32_t offset = op.elem == kElemE4M3 ? 120u : 112u;  // decode gives value * 2^-offset
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

__device__ __forceinline__ void store_pair(const GemmParams& p, int64_t idx, float v0, float v1, bool pair) {
  switch (p.out_kind) {
    case kOutBF16: {
      __nv_bfloat16* o = static_cast<__nv_bfloat16*>(p.out) + idx;
      if (pair) {
        *reinterpret_cast<__nv_bfloat162*>(o) = __floats2bfloat162_rn(v0, v1);
      } else {
        o[0] = __float2bfloat16_rn(v0);
      }
      break;
    }
    case kOutF16: {
      __half* o = static_cast<__half*>(p.out) + idx;
      if (pair) {
        *reinterpret_cast<__half2*>(o) = __floats2half2_rn(v0, v1);
      } else {
        o[0] = __float2half_rn(v0);
      }
      break;
    }
    default: {
      float* o = static_cast<float*>(p.out) + idx;
      o[0] = v0;
      if (pair) o[1] = v1;
      break;
    }
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
          store_pair(p, out_row * p.N + n, v[0], v[1], true);
        } else {
          store_pair(p, out_row * p.N + n, v[0], 0.0f, false);
          if (n + 1 < p.N) store_pair(p, out_row * p.N + n + 1, v[1], 0.0f, false);
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

ffi::Error GroupedGemmCuda(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer a_scale, ffi::AnyBuffer b,
                           ffi::AnyBuffer b_scale, ffi::AnyBuffer pstarts, ffi::AnyBuffer row_factor,
                           ffi::AnyBuffer col_factor, ffi::AnyBuffer group_factor, ffi::AnyBuffer bias,
                           ffi::Result<ffi::AnyBuffer> out, int32_t mode, int32_t a_scaling, int32_t b_scaling,
                           bool has_row_factor, bool has_col_factor, bool has_group_factor, bool has_bias) {
  const char* t = "jaxquant_grouped_gemm";
  GemmParams p;
  JQ_RETURN_IF_ERROR(decode_gemm(t, a, a_scale, b, b_scale, pstarts, row_factor, col_factor, group_factor, bias,
                                 out, mode, a_scaling, b_scaling, has_row_factor, has_col_factor,
                                 has_group_factor, has_bias, &p));
  if (p.L == 0 || p.N == 0 || p.M == 0) return ffi::Error::Success();
  const bool f16 = p.a.scaling == kScalePerTensor && p.b.scaling == kScalePerTensor &&
                   p.a.elem != kElemE2M1 && p.b.elem != kElemE2M1;
  return status(t, f16 ? launch_gemm<true>(p, stream) : launch_gemm<false>(p, stream));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kGroupedQuantizeFp8Cuda, GroupedQuantizeFp8Cuda,
                       BindGroupedQuantizeFp8(ffi::Ffi::Bind().Ctx<Stream>()),
                       {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER(kGroupedAmaxCuda, GroupedAmaxCuda,
                       BindGroupedAmax(ffi::Ffi::Bind().Ctx<Stream>()),
                       {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER(kGroupedAmaxGatedCuda, GroupedAmaxGatedCuda,
                       BindGroupedAmaxGated(ffi::Ffi::Bind().Ctx<Stream>()),
                       {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER(kGroupedGemmCuda, GroupedGemmCuda,
                       BindGroupedGemm(ffi::Ffi::Bind().Ctx<Stream>()),
                       {ffi::Traits::kCmdBufferCompatible});

std::vector<CudaTarget> GroupedCudaTargets() {
  std::vector<CudaTarget> targets = {
      {"jaxquant_grouped_quantize_fp8", reinterpret_cast<void*>(kGroupedQuantizeFp8Cuda)},
      {"jaxquant_grouped_amax", reinterpret_cast<void*>(kGroupedAmaxCuda)},
      {"jaxquant_grouped_amax_gated", reinterpret_cast<void*>(kGroupedAmaxGatedCuda)},
      {"jaxquant_grouped_gemm", reinterpret_cast<void*>(kGroupedGemmCuda)}};
  for (const CudaTarget& t : GroupedNvfp4CudaTargets()) targets.push_back(t);
#ifdef JAXQUANT_GROUPED_SM90
  for (const CudaTarget& t : GroupedSm90Targets()) targets.push_back(t);
#endif
  return targets;
}

}  // namespace jqgrouped
