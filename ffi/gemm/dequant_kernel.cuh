// wgmma GEMM that dequantizes MXFP8 / NVFP4 operands inside the kernel (sm_90a).
//
// Hopper cannot multiply MXFP8 (E8M0 scale per 32) or NVFP4 (E4M3 scale per 16 plus a float32
// tensor/row factor) natively, so this kernel multiplies bf16 tiles that it decodes itself in
// shared memory: every decoded value q * s is exact in bf16 (E4M3/E5M2 times 2^k; E2M1 times an
// E4M3 scale has at most 6 significant bits), so the products are the reference's and only the
// float32 accumulation order differs. Nothing dequantized ever reaches device memory.
//
// C[m, n] = f_a[m] * f_b[n] * sum_k A[m, k] B[n, k] (+ bias[n]), A = data_a[M, K], B = data_b[N, K]
// (the TN storage convention), f = the NVFP4 second-level factor amax / (6 * 448) or 1.
//
// CTA tile 128 x 256 x 64, 384 threads in three warpgroups:
//   WG0 (dequant): the bulk tensor copy engine (TMA) brings the raw payload (FP8 bytes / packed
//       FP4 nibbles) of k-tile i + kRaw into a ring of raw stages (raw_full[r] mbarriers;
//       zero fill outside the matrix); the warpgroup loads k-tile i's chunks into registers,
//       decodes them into a bf16 stage laid out as wgmma's K-major 128-byte-swizzled operand,
//       fences the async proxy, arrives on full[s], and only then syncs (named barrier) so the
//       raw slot can be refilled. Block scales are prefetched into registers one k-tile ahead.
//   WG1, WG2 (math): wait full[s], issue 4 x wgmma.m64n256k16 (rows 64*w .. 64*w+63 of the
//       tile), keep one wgmma group in flight and release stage s-1 on empty[s-1].
// Epilogue: accumulators times the factors, plus bias, cast, stored straight from registers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda.h>  // CUtensorMap
#include <cuda_runtime.h>

#include <cstdint>

#include "gemm/bf16_decode.cuh"
#include "gemm/dequant_params.h"
#include "gemm/store_pairs.cuh"

namespace jqffi {
namespace dequant {

constexpr int kBM = 128, kBN = 256, kBK = 64;
constexpr int kStages = 3;  // bf16 stages (dequant -> wgmma)
constexpr int kRaw = 3;     // raw payload stages (global -> dequant), TMA loads in flight
constexpr int kTileBytesA = kBM * kBK * 2;  // one bf16 stage of A: 128 rows x 128 bytes
constexpr int kTileBytesB = kBN * kBK * 2;
constexpr int kGroupM = 8;  // tile rasterization: 8 row-tiles per group share B in L2

template <Elem E> struct Traits;
template <> struct Traits<Elem::kE4M3> { static constexpr int kRowBytes = 64; };  // per k-tile
template <> struct Traits<Elem::kE5M2> { static constexpr int kRowBytes = 64; };
template <> struct Traits<Elem::kE2M1> { static constexpr int kRowBytes = 32; };

template <Elem EA, Elem EB>
struct Layout {
  static constexpr int kRawBytesA = kBM * Traits<EA>::kRowBytes;
  static constexpr int kRawBytesB = kBN * Traits<EB>::kRowBytes;
  static constexpr int kBf16Offset = 0;  // 1024-aligned (128B swizzle atoms)
  static constexpr int kRawOffset = kStages * (kTileBytesA + kTileBytesB);
  static constexpr int kBarOffset = kRawOffset + kRaw * (kRawBytesA + kRawBytesB);
  static constexpr int kBarBytes = (2 * kStages + kRaw) * 8 + 8;  // mbarriers, E2M1 LUT
  static constexpr int kSmemBytes = kBarOffset + kBarBytes + 1024;  // + alignment slack
};

// ------------------------------------------------------------------------------------------
// PTX wrappers.
// ------------------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 2-D bulk tensor copy global -> shared, completing on an mbarrier (expect_tx bytes).
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int x, int y,
                                            uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr));
  return v;
}
__device__ __forceinline__ void sts128(uint32_t addr, uint32_t a, uint32_t b, uint32_t c,
                                       uint32_t d) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(a), "r"(b), "r"(c),
               "r"(d)
               : "memory");
}

__device__ __forceinline__ uint32_t lds32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ void sts32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t ldg_u8(const uint8_t* p) {
  uint16_t v;
  asm volatile("ld.global.nc.u8 %0, [%1];\n" : "=h"(v) : "l"(p));
  return v;
}

// K-major operand in the 128-byte swizzle: 8-row atoms of 1024 bytes (SBO), rows of 128 bytes.
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr) {
  uint64_t desc = (addr & 0x3FFFFu) >> 4;
  desc |= uint64_t(16 >> 4) << 16;    // leading byte offset (unused for swizzled K-major)
  desc |= uint64_t(1024 >> 4) << 32;  // stride byte offset: next 8-row atom
  desc |= uint64_t(1) << 62;          // 128-byte swizzle
  return desc;
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

#define JQ_R8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), \
                 "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])

// D[64 x 256] += A[64 x 16] * B[256 x 16]^T, bf16 inputs from shared memory, f32 accumulators.
__device__ __forceinline__ void wgmma_m64n256k16(float* d, uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "{\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, "
      "%111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, "
      "%125, %126, %127}, "
      "%128, %129, 1, 1, 1, 0, 0;\n"
      "}\n"
      : JQ_R8(0), JQ_R8(8), JQ_R8(16), JQ_R8(24), JQ_R8(32), JQ_R8(40), JQ_R8(48), JQ_R8(56),
        JQ_R8(64), JQ_R8(72), JQ_R8(80), JQ_R8(88), JQ_R8(96), JQ_R8(104), JQ_R8(112),
        JQ_R8(120)
      : "l"(desc_a), "l"(desc_b));
}
#undef JQ_R8

// ------------------------------------------------------------------------------------------
// Block scales as bf16x2 factors (the payload decoders: gemm/bf16_decode.cuh).
// ------------------------------------------------------------------------------------------

// Per-chunk scale factor(s) as bf16x2 (both halves equal). `two` = apply f2 after f1.
struct ChunkScale {
  uint32_t f1;
  uint32_t e;  // the E8M0 exponent (f2 is derived from it on the rare path)
  bool two;
};

// MXFP8: decoded value = raw * 2^offset * 2^(e - 127). One multiply by 2^(e - 127 - offset)
// when that is a bf16 normal (block scales up to 2^7 for E4M3, 2^15 for E5M2: all practical
// data); else 2^offset first, then 2^(e - 127) (f2), which is NaN for e == 255 (NaN block).
template <int kOffset>
__device__ __forceinline__ ChunkScale mx_scale(uint32_t e) {
  const uint32_t t = e + kOffset;
  ChunkScale s;
  s.two = t > 254u;
  s.f1 = pow2_bf16x2(s.two ? uint32_t(kOffset + 127) : t);
  s.e = e;
  return s;
}

// ------------------------------------------------------------------------------------------
// One operand's share of the dequant warpgroups' work.
// Chunk = 16 payload bytes of one row inside a k-tile (16 FP8 or 32 FP4 elements).
// Dequant thread t (of kDequantThreads) owns chunk c = t % kCPR of rows t / kCPR + kRPP * j.
// ------------------------------------------------------------------------------------------

template <Elem E, int kRows, int kDequantThreads>
struct OperandLoader {
  static constexpr int kRowBytes = Traits<E>::kRowBytes;
  static constexpr int kCPR = kRowBytes / 16;             // chunks per row per k-tile (4 or 2)
  static constexpr int kRPP = kDequantThreads / kCPR;      // rows covered per pass
  static constexpr int kPasses = kRows / kRPP;
  static_assert(kPasses * kRPP == kRows, "tile rows must be a multiple of the pass height");
  static constexpr bool kFp4 = E == Elem::kE2M1;
  static constexpr int kScalesPerChunk = kFp4 ? 2 : 1;

  const DequantOperand& op;
  int row0;  // first global row of the tile
  int c, r;  // this thread's chunk and first local row
  uint32_t scale[kPasses][kScalesPerChunk];
  uint32_t raw[kPasses][4];  // pass j's 16 payload bytes as four words

  __device__ OperandLoader(const DequantOperand& o, int tile_row0, int tid)
      : op(o), row0(tile_row0), c(tid % kCPR), r(tid / kCPR) {}

  __device__ __forceinline__ bool chunk_valid(int kt) const {
    return int64_t(kt) * kRowBytes + c * 16 < op.row_bytes;
  }

  // Block-scale bytes of k-tile kt (register prefetch; neutral values outside the matrix).
  __device__ __forceinline__ void load_scales(int kt) {
    const bool kvalid = chunk_valid(kt);
#pragma unroll
    for (int j = 0; j < kPasses; ++j) {
      const int gr = row0 + r + kRPP * j;
      const bool valid = kvalid && gr < op.rows;
      if constexpr (kFp4) {
        // 32 elements = NVFP4 blocks 4*kt + 2c and +1.
        const uint8_t* q =
            op.scale + int64_t(gr >> op.scale_row_shift) * op.scale_stride + 4 * kt + 2 * c;
        scale[j][0] = valid ? ldg_u8(q) : 0u;
        scale[j][1] = valid ? ldg_u8(q + 1) : 0u;
      } else {
        // 16 elements = half of MXFP8 block 2*kt + c/2.
        const uint8_t* q = op.scale + int64_t(gr) * op.scale_stride + 2 * kt + (c >> 1);
        scale[j][0] = valid ? ldg_u8(q) : 127u;
      }
    }
  }

  // This thread's raw chunks of the stage into registers (all loads in flight at once).
  __device__ __forceinline__ void load_raw(uint32_t stage) {
#pragma unroll
    for (int j = 0; j < kPasses; ++j) {
      const uint4 v = lds128(stage + (r + kRPP * j) * kRowBytes + c * 16);
      raw[j][0] = v.x;
      raw[j][1] = v.y;
      raw[j][2] = v.z;
      raw[j][3] = v.w;
    }
  }

  // Pass j's decoded bf16x2 words `o` into its row of the stage (rows of 128 bytes, 16-byte
  // units XOR row % 8), kUnits units from unit `first`.
  template <int kUnits>
  __device__ __forceinline__ void store_row(uint32_t tile, int j, int first,
                                            const uint32_t* o) const {
    const int lr = r + kRPP * j;
    const uint32_t row_base = tile + lr * 128, sw = lr & 7;
#pragma unroll
    for (int u = 0; u < kUnits; ++u) {
      sts128(row_base + (((first + u) ^ sw) << 4), o[4 * u], o[4 * u + 1], o[4 * u + 2],
             o[4 * u + 3]);
    }
  }

  // Decode the registers into the bf16 stage.
  __device__ __forceinline__ void decode(uint32_t tile, uint32_t lut_hi, uint32_t lut_lo) const {
    if constexpr (kFp4) {
#pragma unroll
      for (int j = 0; j < kPasses; ++j) {
        uint32_t o[16];
#pragma unroll
        for (int q = 0; q < 4; ++q) decode_e2m1x8(raw[j][q], o + 4 * q, lut_hi, lut_lo);
        const uint32_t f0 = e4m3_scale_bf16x2(scale[j][0]);
        const uint32_t f1 = e4m3_scale_bf16x2(scale[j][1]);
#pragma unroll
        for (int q = 0; q < 16; ++q) o[q] = hmul2_bf16(o[q], q < 8 ? f0 : f1);
        store_row<4>(tile, j, 4 * c, o);  // 32 elements -> 16-byte units 4c .. 4c+3
      }
    } else {
      ChunkScale s[kPasses];
      bool two = false;
#pragma unroll
      for (int j = 0; j < kPasses; ++j) {
        s[j] = E == Elem::kE4M3 ? mx_scale<120>(scale[j][0]) : mx_scale<112>(scale[j][0]);
        two |= s[j].two;
      }
      if (__builtin_expect(two, 0)) {
        decode_fp8<true>(tile, s);  // some block scale above 2^7 (E4M3) / 2^15 (E5M2)
      } else {
        decode_fp8<false>(tile, s);
      }
    }
  }

  template <bool kTwo>
  __device__ __forceinline__ void decode_fp8(uint32_t tile, const ChunkScale* s) const {
#pragma unroll
    for (int j = 0; j < kPasses; ++j) {
      uint32_t o[8];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        if constexpr (E == Elem::kE4M3) {
          decode_e4m3x4(raw[j][q], o[2 * q], o[2 * q + 1]);
        } else {
          decode_e5m2x4(raw[j][q], o[2 * q], o[2 * q + 1]);
        }
      }
#pragma unroll
      for (int q = 0; q < 8; ++q) o[q] = hmul2_bf16(o[q], s[j].f1);
      if constexpr (kTwo) {
        if (s[j].two) {
          const uint32_t f2 = e8m0_bf16x2(s[j].e);  // e > 0 here: t > 254
#pragma unroll
          for (int q = 0; q < 8; ++q) o[q] = hmul2_bf16(o[q], f2);
        }
      }
      store_row<2>(tile, j, 2 * c, o);  // 16 elements -> 16-byte units 2c, 2c+1
    }
  }
};

// ------------------------------------------------------------------------------------------
// Epilogue: acc * f_a[row] * f_b[col] (+ bias[col]) -> out, in the reference's order.
// Thread layout of wgmma's m64nNk16 f32 accumulator: d[4j + 2h + e] is row lane/4 + 8h (of the
// warp's 16), column 8j + 2(lane % 4) + e.
// ------------------------------------------------------------------------------------------

template <typename T> __device__ __forceinline__ float to_f32(T v);
template <> __device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_f32(float v) { return v; }

template <typename T>
__device__ __forceinline__ void add_bias(float* d, const void* bias, int n0, int lane, int N) {
  const T* b = static_cast<const T*>(bias);
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    const int col = n0 + 8 * j + 2 * (lane % 4);
    const float b0 = col < N ? to_f32(b[col]) : 0.0f;
    const float b1 = col + 1 < N ? to_f32(b[col + 1]) : 0.0f;
    d[4 * j] = d[4 * j] + b0;
    d[4 * j + 1] = d[4 * j + 1] + b1;
    d[4 * j + 2] = d[4 * j + 2] + b0;
    d[4 * j + 3] = d[4 * j + 3] + b1;
  }
}

template <typename T>
__device__ __forceinline__ void store_tile(const float* d, void* out, int row_a, int n0, int lane,
                                           int M, int N) {
  T* o = static_cast<T*>(out);
  const bool vec = (N % 2) == 0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row_a + 8 * h;
    if (row >= M) continue;
    T* orow = o + int64_t(row) * N;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const int col = n0 + 8 * j + 2 * (lane % 4);
      const float v0 = d[4 * j + 2 * h], v1 = d[4 * j + 2 * h + 1];
      if (vec && col + 1 < N) {
        *reinterpret_cast<typename Pack2<T>::V*>(orow + col) = Pack2<T>::pack(v0, v1);
      } else {
        if (col < N) orow[col] = Pack2<T>::one(v0);
        if (col + 1 < N) orow[col + 1] = Pack2<T>::one(v1);
      }
    }
  }
}

__device__ __forceinline__ void epilogue(float* d, const DequantParams& p, int row_a, int n0,
                                         int lane) {
  if (p.a.factor_kind != 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row_a + 8 * h;
      const float fa = p.a.factor_kind == 1 ? p.a.factor[0] : (row < p.M ? p.a.factor[row] : 0.f);
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        d[4 * j + 2 * h] = d[4 * j + 2 * h] * fa;
        d[4 * j + 2 * h + 1] = d[4 * j + 2 * h + 1] * fa;
      }
    }
  }
  if (p.b.factor_kind == 1) {
    const float fb = p.b.factor[0];
#pragma unroll
    for (int i = 0; i < 128; ++i) d[i] = d[i] * fb;
  } else if (p.b.factor_kind == 2) {
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const int col = n0 + 8 * j + 2 * (lane % 4);
      const float f0 = col < p.N ? p.b.factor[col] : 0.0f;
      const float f1 = col + 1 < p.N ? p.b.factor[col + 1] : 0.0f;
      d[4 * j] = d[4 * j] * f0;
      d[4 * j + 1] = d[4 * j + 1] * f1;
      d[4 * j + 2] = d[4 * j + 2] * f0;
      d[4 * j + 3] = d[4 * j + 3] * f1;
    }
  }
  switch (p.bias_kind) {
    case kOutBF16: add_bias<__nv_bfloat16>(d, p.bias, n0, lane, p.N); break;
    case kOutF16: add_bias<__half>(d, p.bias, n0, lane, p.N); break;
    case kOutF32: add_bias<float>(d, p.bias, n0, lane, p.N); break;
    default: break;
  }
  switch (p.out_kind) {
    case kOutBF16: store_tile<__nv_bfloat16>(d, p.out, row_a, n0, lane, p.M, p.N); break;
    case kOutF16: store_tile<__half>(d, p.out, row_a, n0, lane, p.M, p.N); break;
    default: store_tile<float>(d, p.out, row_a, n0, lane, p.M, p.N); break;
  }
}

// ------------------------------------------------------------------------------------------
// The kernel. (A second dequant warpgroup does not fit: 512 threads leave 128 registers per
// thread, and m64n256 accumulators alone need 128; setmaxnreg cannot lift ptxas's limit.)
// ------------------------------------------------------------------------------------------

constexpr int kDW = 1;  // dequant warpgroups
constexpr int kThreads = 128 * (kDW + 2);

template <Elem EA, Elem EB>
__global__ void __launch_bounds__(kThreads, 1)
    dequant_gemm_kernel(const __grid_constant__ DequantParams p,
                        const __grid_constant__ CUtensorMap map_a,
                        const __grid_constant__ CUtensorMap map_b) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using L = Layout<EA, EB>;
  constexpr int kDequantThreads = 128 * kDW;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t smem_base = (smem_u32(smem_raw) + 1023u) & ~1023u;  // swizzle atoms: 1024 B
  const uint32_t bf16_a = smem_base + L::kBf16Offset;                  // + s * kTileBytesA
  const uint32_t bf16_b = bf16_a + kStages * kTileBytesA;              // + s * kTileBytesB
  const uint32_t raw_a = smem_base + L::kRawOffset;                    // + r * kRawBytesA
  const uint32_t raw_b = raw_a + kRaw * L::kRawBytesA;                 // + r * kRawBytesB
  const uint32_t full_bar = smem_base + L::kBarOffset;                 // + s * 8
  const uint32_t empty_bar = full_bar + kStages * 8;
  const uint32_t raw_bar = empty_bar + kStages * 8;                    // + r * 8

  // Tile coordinates, grouped rasterization.
  const int tiles_m = (p.M + kBM - 1) / kBM, tiles_n = (p.N + kBN - 1) / kBN;
  const int pid = blockIdx.x;
  const int per_group = kGroupM * tiles_n;
  const int first_m = (pid / per_group) * kGroupM;
  const int group_m = min(tiles_m - first_m, kGroupM);
  const int tile_m = first_m + (pid % per_group) % group_m;
  const int tile_n = (pid % per_group) / group_m;
  const int m0 = tile_m * kBM, n0 = tile_n * kBN;
  const int ktiles = (p.K + kBK - 1) / kBK;

  const uint32_t lut_addr = raw_bar + kRaw * 8;
  constexpr uint32_t kRawRowA = Traits<EA>::kRowBytes, kRawRowB = Traits<EB>::kRowBytes;
  constexpr uint32_t kRawTx = L::kRawBytesA + L::kRawBytesB;  // full boxes, zero-filled or not
  auto issue_raw = [&](int kt) {  // one thread: TMA of k-tile kt's payload boxes
    const int r = kt % kRaw;
    const uint32_t bar = raw_bar + 8 * r;
    mbar_arrive_expect_tx(bar, kRawTx);
    tma_load_2d(raw_a + r * L::kRawBytesA, &map_a, kt * kRawRowA, m0, bar);
    tma_load_2d(raw_b + r * L::kRawBytesB, &map_b, kt * kRawRowB, n0, bar);
  };
  if (threadIdx.x == 0) {
    sts32(lut_addr, kE2M1HiLo);
    sts32(lut_addr + 4, kE2M1LoLo);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full_bar + 8 * s, kDequantThreads);  // every dequant thread arrives
      mbar_init(empty_bar + 8 * s, 256);             // every math thread arrives
    }
    for (int r = 0; r < kRaw; ++r) mbar_init(raw_bar + 8 * r, 1);  // TMA issuer + tx bytes
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  const int wg = threadIdx.x / 128;
  if (wg < kDW) {
    // ---------------- dequant warpgroup(s) ----------------
    const int t = threadIdx.x;
    OperandLoader<EA, kBM, kDequantThreads> la(p.a, m0, t);
    OperandLoader<EB, kBN, kDequantThreads> lb(p.b, n0, t);
    if (t == 0) {
      for (int i = 0; i < kRaw && i < ktiles; ++i) issue_raw(i);
    }
    la.load_scales(0);
    lb.load_scales(0);
    // E2M1 lookup tables in ordinary registers: read back from shared memory so the compiler
    // cannot turn them into uniform-register constants copied before every prmt.
    const uint32_t lut_hi = lds32(lut_addr), lut_lo = lds32(lut_addr + 4);
    for (int i = 0; i < ktiles; ++i) {
      const int rs = i % kRaw;
      mbar_wait(raw_bar + 8 * rs, (i / kRaw) & 1);  // k-tile i's payload has landed
      la.load_raw(raw_a + rs * L::kRawBytesA);
      lb.load_raw(raw_b + rs * L::kRawBytesB);
      const int s = i % kStages;
      mbar_wait(empty_bar + 8 * s, ((i / kStages) & 1) ^ 1);
      la.decode(bf16_a + s * kTileBytesA, lut_hi, lut_lo);
      lb.decode(bf16_b + s * kTileBytesB, lut_hi, lut_lo);
      // One proxy fence orders this thread's generic-proxy accesses before the async proxy's:
      // the decode's stores before wgmma's reads of stage s, and the loads of raw slot rs
      // before the bulk tensor copy that refills it below.
      fence_proxy_async();
      mbar_arrive(full_bar + 8 * s);
      // Raw slot rs is refilled only once every dequant thread has *consumed* its chunks (the
      // stores above depend on the loaded values, so those loads have returned). Releasing the
      // slot right after issuing the loads (an earlier version) let the copy of k-tile i + kRaw
      // overwrite chunks whose shared-memory loads were still queued behind wgmma's operand
      // reads: bar.sync orders generic-proxy accesses only, not the async-proxy copy.
      named_barrier_sync(1, kDequantThreads);
      if (t == 0 && i + kRaw < ktiles) issue_raw(i + kRaw);
      if (i + 1 < ktiles) {
        la.load_scales(i + 1);
        lb.load_scales(i + 1);
      }
    }
  } else {
    // ---------------- math warpgroups ----------------
    const int w = wg - kDW;  // rows 64*w .. 64*w+63 of the tile
    float d[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) d[i] = 0.0f;
    for (int i = 0; i < ktiles; ++i) {
      const int s = i % kStages;
      mbar_wait(full_bar + 8 * s, (i / kStages) & 1);
      const uint32_t a_tile = bf16_a + s * kTileBytesA + w * 64 * 128;
      const uint32_t b_tile = bf16_b + s * kTileBytesB;
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk) {
        wgmma_m64n256k16(d, smem_desc(a_tile + kk * 32), smem_desc(b_tile + kk * 32));
      }
      wgmma_commit();
      wgmma_wait<1>();
      if (i > 0) mbar_arrive(empty_bar + 8 * ((i - 1) % kStages));
    }
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < 128; ++i) asm volatile("" : "+f"(d[i])::"memory");
    const int lane = threadIdx.x & 31, warp = (threadIdx.x / 32) & 3;
    epilogue(d, p, m0 + w * 64 + warp * 16 + lane / 4, n0, lane);
  }
#else
  __trap();  // built for another architecture: the handler refuses before launching
#endif
}

}  // namespace dequant
}  // namespace jqffi
