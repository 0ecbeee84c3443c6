// CPU handlers of the GEMM targets: the same contract as the CUDA handlers (argument checks,
// layouts, epilogue order), computed by decoding both operands to float32 and a plain loop.
//
// They exist so CI exercises the FFI GEMM path (lowering, the Python-side operand
// preparation such as cuBLASLt's block-scale layouts and FP4 packing, argument checking) on
// machines without a GPU. Meant for small shapes: O(M N K) scalar-ish work on one thread.
#include <cmath>
#include <cstring>
#include <vector>

#include "gemm/gemm_args.h"
#include "gemm/handlers.h"
#include "jaxquant_numerics.h"

namespace jaxquant_gemm {
namespace {

using jq::bits_of;
using jq::float_of;

// --- element decoding (exact float32 values) ---

float decode_e5m2(uint32_t code) {
  const uint32_t sign = (code >> 7) & 1u, e = (code >> 2) & 0x1Fu, m = code & 3u;
  float mag;
  if (e == 0x1F) {
    mag = m == 0 ? float_of(0x7F800000u) : float_of(0x7FC00000u);
  } else if (e == 0) {
    mag = static_cast<float>(m) * 0x1p-16f;
  } else {
    mag = float_of(((e - 15u + 127u) << 23) | (m << 21));
  }
  return sign ? -mag : mag;
}

float decode_e2m1(uint32_t nibble) {
  static const float kMag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float mag = kMag[nibble & 7u];
  return (nibble & 8u) ? -mag : mag;
}

float decode_e8m0(uint32_t e) {
  return e == 255u ? float_of(0x7FC00000u) : jq::exp2i(static_cast<int>(e) - 127);
}

float decode_fp8(uint8_t code, bool e5m2) {
  return e5m2 ? decode_e5m2(code) : jq::decode_e4m3(code);
}

// --- float32 -> output dtype, round to nearest even ---

uint16_t to_bf16(float f) {
  const uint32_t x = bits_of(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  return static_cast<uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

uint16_t to_f16(float f) {
  const uint32_t x = bits_of(f), sign = (x >> 16) & 0x8000u, ax = x & 0x7FFFFFFFu;
  if (ax > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u);
  if (ax >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520 -> inf
  if (ax < 0x38800000u) {  // below 2^-14: f16 subnormal (or zero), units of 2^-24
    const float units = std::nearbyint(float_of(ax) * 0x1p24f);
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(units));
  }
  uint32_t h = (((ax >> 23) - 127u + 15u) << 10) | ((ax & 0x7FFFFFu) >> 13);
  const uint32_t rest = ax & 0x1FFFu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

float f16_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  if (e == 0x1F) return float_of(sign | 0x7F800000u | (m << 13));
  if (e != 0) return float_of(sign | ((e - 15u + 127u) << 23) | (m << 13));
  const float mag = static_cast<float>(m) * 0x1p-24f;  // exact (normal float32)
  return sign ? -mag : mag;
}

float load_hp(const void* p, int kind, int64_t i) {
  switch (kind) {
    case kBF16: return float_of(uint32_t(static_cast<const uint16_t*>(p)[i]) << 16);
    case kF16: return f16_to_float(static_cast<const uint16_t*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

void store_out(void* p, int kind, int64_t i, float v) {
  switch (kind) {
    case kBF16: static_cast<uint16_t*>(p)[i] = to_bf16(v); break;
    case kF16: static_cast<uint16_t*>(p)[i] = to_f16(v); break;
    default: static_cast<float*>(p)[i] = v; break;
  }
}

// C = A B^T on decoded float32 rows (K contiguous), 8 partial sums per dot product.
void gemm_f32(const std::vector<float>& A, const std::vector<float>& B, int64_t M, int64_t N,
              int64_t K, std::vector<float>* C) {
  C->assign(static_cast<size_t>(M * N), 0.0f);
  for (int64_t m = 0; m < M; ++m) {
    const float* a = A.data() + m * K;
    for (int64_t n = 0; n < N; ++n) {
      const float* b = B.data() + n * K;
      float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t k = 0;
      for (; k + 8 <= K; k += 8) {
        for (int l = 0; l < 8; ++l) part[l] = part[l] + a[k + l] * b[k + l];
      }
      for (; k < K; ++k) part[0] = part[0] + a[k] * b[k];
      float acc = 0.0f;
      for (int l = 0; l < 8; ++l) acc = acc + part[l];
      (*C)[static_cast<size_t>(m * N + n)] = acc;
    }
  }
}

// --- jaxquant_gemm_fp8 ---

std::vector<float> decode_fp8_operand(const Fp8Operand& op, int64_t K) {
  std::vector<float> v(static_cast<size_t>(op.rows * K));
  const uint8_t* q = static_cast<const uint8_t*>(op.data);
  int64_t d0 = 0, d1 = 0;
  if (op.mode != kPerTensor) scale_shape(op.mode, op.rows, K, &d0, &d1);
  for (int64_t r = 0; r < op.rows; ++r) {
    for (int64_t k = 0; k < K; ++k) {
      float x = decode_fp8(q[r * K + k], op.e5m2);
      if (op.mode == kVec128) x = x * op.scale[(k / 128) * d1 + r];
      if (op.mode == kBlk128) x = x * op.scale[(r / 128) * d1 + k / 128];
      v[static_cast<size_t>(r * K + k)] = x;
    }
  }
  return v;
}

ffi::Error Fp8GemmCpu(ffi::AnyBuffer a, ffi::AnyBuffer a_scale, ffi::AnyBuffer b,
                      ffi::AnyBuffer b_scale, ffi::AnyBuffer bias,
                      ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace,
                      int64_t a_scale_mode, int64_t b_scale_mode, bool fast_accum) {
  Fp8Gemm g;
  if (ffi::Error e = decode_fp8_gemm("jaxquant_gemm_fp8", a, a_scale, b, b_scale, bias, *out,
                                     *workspace, a_scale_mode, b_scale_mode, fast_accum, &g);
      e.failure()) {
    return e;
  }
  std::vector<float> C;
  gemm_f32(decode_fp8_operand(g.a, g.K), decode_fp8_operand(g.b, g.K), g.M, g.N, g.K, &C);
  const float alpha = g.a.mode == kPerTensor ? g.a.scale[0] * g.b.scale[0] : 1.0f;
  for (int64_t m = 0; m < g.M; ++m) {
    for (int64_t n = 0; n < g.N; ++n) {
      float v = C[static_cast<size_t>(m * g.N + n)] * alpha;
      if (g.bias_kind != kNone) v = v + load_hp(g.bias, g.bias_kind, n);
      store_out(g.out, g.out_kind, m * g.N + n, v);
    }
  }
  return ffi::Error::Success();
}

// --- jaxquant_gemm_dequant ---

std::vector<float> decode_dequant_operand(const DequantOperand& op, int64_t K) {
  std::vector<float> v(static_cast<size_t>(op.rows) * K);
  for (int64_t r = 0; r < op.rows; ++r) {
    const uint8_t* q = op.data + r * op.row_bytes;
    const uint8_t* s = op.scale + (r >> op.scale_row_shift) * op.scale_stride;
    for (int64_t k = 0; k < K; ++k) {
      float x;
      if (op.elem == Elem::kE2M1) {
        const uint32_t byte = q[k / 2];
        x = decode_e2m1((k & 1) ? byte >> 4 : byte & 0xFu) * jq::decode_e4m3(s[k / 16]);
      } else {
        x = decode_fp8(q[k], op.elem == Elem::kE5M2) * decode_e8m0(s[k / 32]);
      }
      v[static_cast<size_t>(r * K + k)] = x;
    }
  }
  return v;
}

ffi::Error DequantGemmCpu(ffi::AnyBuffer a, ffi::AnyBuffer a_scale, ffi::AnyBuffer a_factor,
                          ffi::AnyBuffer b, ffi::AnyBuffer b_scale, ffi::AnyBuffer b_factor,
                          ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> out, int64_t k,
                          int64_t a_scale_tile_rows, int64_t b_scale_tile_rows) {
  DequantParams p;
  if (ffi::Error e = decode_dequant_gemm("jaxquant_gemm_dequant", a, a_scale, a_factor, b,
                                         b_scale, b_factor, bias, *out, k, a_scale_tile_rows,
                                         b_scale_tile_rows, &p);
      e.failure()) {
    return e;
  }
  std::vector<float> C;
  gemm_f32(decode_dequant_operand(p.a, p.K), decode_dequant_operand(p.b, p.K), p.M, p.N, p.K, &C);
  for (int64_t m = 0; m < p.M; ++m) {
    const float fa = p.a.factor_kind == 2 ? p.a.factor[m] : (p.a.factor_kind ? p.a.factor[0] : 1.f);
    for (int64_t n = 0; n < p.N; ++n) {
      float v = C[static_cast<size_t>(m * p.N + n)];
      if (p.a.factor_kind) v = v * fa;
      if (p.b.factor_kind) v = v * (p.b.factor_kind == 2 ? p.b.factor[n] : p.b.factor[0]);
      if (p.bias_kind != kNone) v = v + load_hp(p.bias, p.bias_kind, n);
      store_out(p.out, p.out_kind, m * p.N + n, v);
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kFp8GemmCpu, Fp8GemmCpu,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()  // a
                           .Arg<ffi::AnyBuffer>()  // a_scale
                           .Arg<ffi::AnyBuffer>()  // b
                           .Arg<ffi::AnyBuffer>()  // b_scale
                           .Arg<ffi::AnyBuffer>()  // bias
                           .Ret<ffi::AnyBuffer>()  // out
                           .Ret<ffi::AnyBuffer>()  // workspace
                           .Attr<int64_t>("a_scale_mode")
                           .Attr<int64_t>("b_scale_mode")
                           .Attr<bool>("fast_accum"));

XLA_FFI_DEFINE_HANDLER(kDequantGemmCpu, DequantGemmCpu,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()  // a
                           .Arg<ffi::AnyBuffer>()  // a_scale
                           .Arg<ffi::AnyBuffer>()  // a_factor
                           .Arg<ffi::AnyBuffer>()  // b
                           .Arg<ffi::AnyBuffer>()  // b_scale
                           .Arg<ffi::AnyBuffer>()  // b_factor
                           .Arg<ffi::AnyBuffer>()  // bias
                           .Ret<ffi::AnyBuffer>()  // out
                           .Attr<int64_t>("k")
                           .Attr<int64_t>("a_scale_tile_rows")
                           .Attr<int64_t>("b_scale_tile_rows"));

void* Fp8GemmCpuHandler() { return reinterpret_cast<void*>(kFp8GemmCpu); }
void* DequantGemmCpuHandler() { return reinterpret_cast<void*>(kDequantGemmCpu); }

}  // namespace jaxquant_gemm
