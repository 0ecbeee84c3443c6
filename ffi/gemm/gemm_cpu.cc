// CPU handlers of the GEMM targets: the same contract as the CUDA handlers (argument checks,
// layouts, epilogue order), computed by decoding both operands to float32 and a plain loop.
//
// They exist so CI exercises the FFI GEMM path (lowering, the Python-side operand
// preparation such as cuBLASLt's block-scale layouts and FP4 packing, argument checking) on
// machines without a GPU. Meant for small shapes: O(M N K) scalar-ish work on one thread.
#include <vector>

#include "gemm/cpu_values.h"
#include "gemm/gemm_args.h"
#include "gemm/handlers.h"

namespace jqffi {
namespace {

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

std::vector<float> dequantize(const Fp8Operand& op, int64_t K) {
  std::vector<float> v(static_cast<size_t>(op.rows * K));
  const uint8_t* q = static_cast<const uint8_t*>(op.data);
  int64_t d0 = 0, d1 = 0;
  if (op.mode != kPerTensor) scale_shape(op.mode, op.rows, K, &d0, &d1);
  for (int64_t r = 0; r < op.rows; ++r) {
    for (int64_t k = 0; k < K; ++k) {
      float x = decode_elem(op.e5m2 ? Elem::kE5M2 : Elem::kE4M3, q[r * K + k]);
      if (op.mode == kVec128) x = x * op.scale[(k / 128) * d1 + r];
      if (op.mode == kBlk128) x = x * op.scale[(r / 128) * d1 + k / 128];
      v[static_cast<size_t>(r * K + k)] = x;
    }
  }
  return v;
}

// h = a b^T * alpha (+ bias) in float32; out = h, or with the gelu epilogue out = gelu(h)
// (the spec's tanh approximation, jq::act_value) and aux = h, each rounded once.
void fp8_gemm_cpu(const Fp8Gemm& g) {
  std::vector<float> C;
  gemm_f32(dequantize(g.a, g.K), dequantize(g.b, g.K), g.M, g.N, g.K, &C);
  const float alpha = g.a.mode == kPerTensor ? g.a.scale[0] * g.b.scale[0] : 1.0f;
  for (int64_t m = 0; m < g.M; ++m) {
    for (int64_t n = 0; n < g.N; ++n) {
      float v = C[static_cast<size_t>(m * g.N + n)] * alpha;
      if (g.bias_kind != kOutNone) v = v + value_at(g.bias, g.bias_kind, n);
      if (g.epilogue == kEpilogueGeluAux) {
        store_at(g.aux, g.out_kind, m * g.N + n, v);
        v = jq::act_value(jq::Act::kGelu, v);
      }
      store_at(g.out, g.out_kind, m * g.N + n, v);
    }
  }
}

ffi::Error Fp8GemmCpu(ffi::AnyBuffer a, ffi::AnyBuffer a_scale, ffi::AnyBuffer b,
                      ffi::AnyBuffer b_scale, ffi::AnyBuffer bias,
                      ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace,
                      int64_t a_scale_mode, int64_t b_scale_mode, bool fast_accum) {
  Fp8Gemm g;
  JQ_RETURN_IF_ERROR(decode_fp8_gemm("jaxquant_gemm_fp8", a, a_scale, b, b_scale, bias, *out,
                                     *workspace, a_scale_mode, b_scale_mode, fast_accum, &g));
  fp8_gemm_cpu(g);
  return ffi::Error::Success();
}

ffi::Error Fp8GeluGemmCpu(ffi::AnyBuffer a, ffi::AnyBuffer a_scale, ffi::AnyBuffer b,
                          ffi::AnyBuffer b_scale, ffi::AnyBuffer bias,
                          ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> aux,
                          ffi::Result<ffi::AnyBuffer> workspace, int64_t a_scale_mode,
                          int64_t b_scale_mode, bool fast_accum) {
  Fp8Gemm g;
  JQ_RETURN_IF_ERROR(decode_fp8_gelu_gemm("jaxquant_gemm_fp8_gelu", a, a_scale, b, b_scale, bias,
                                          *out, *aux, *workspace, a_scale_mode, b_scale_mode,
                                          fast_accum, &g));
  fp8_gemm_cpu(g);
  return ffi::Error::Success();
}

// --- jaxquant_gemm_dequant ---

std::vector<float> dequantize(const DequantOperand& op, int64_t K) {
  std::vector<float> v(static_cast<size_t>(op.rows) * K);
  for (int64_t r = 0; r < op.rows; ++r) {
    const uint8_t* q = op.data + r * op.row_bytes;
    const uint8_t* s = op.scale + (r >> op.scale_row_shift) * op.scale_stride;
    for (int64_t k = 0; k < K; ++k) {
      float x;
      if (op.elem == Elem::kE2M1) {
        const uint32_t byte = q[k / 2];
        x = jq::decode_e2m1((k & 1) ? byte >> 4 : byte & 0xFu) * jq::decode_e4m3(s[k / 16]);
      } else {
        x = decode_elem(op.elem, q[k]) * jq::decode_e8m0(s[k / 32]);
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
  JQ_RETURN_IF_ERROR(decode_dequant_gemm("jaxquant_gemm_dequant", a, a_scale, a_factor, b,
                                         b_scale, b_factor, bias, *out, k, a_scale_tile_rows,
                                         b_scale_tile_rows, &p));
  std::vector<float> C;
  gemm_f32(dequantize(p.a, p.K), dequantize(p.b, p.K), p.M, p.N, p.K, &C);
  for (int64_t m = 0; m < p.M; ++m) {
    const float fa = p.a.factor_kind == 2 ? p.a.factor[m] : (p.a.factor_kind ? p.a.factor[0] : 1.f);
    for (int64_t n = 0; n < p.N; ++n) {
      float v = C[static_cast<size_t>(m * p.N + n)];
      if (p.a.factor_kind) v = v * fa;
      if (p.b.factor_kind) v = v * (p.b.factor_kind == 2 ? p.b.factor[n] : p.b.factor[0]);
      if (p.bias_kind != kOutNone) v = v + value_at(p.bias, p.bias_kind, n);
      store_at(p.out, p.out_kind, m * p.N + n, v);
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kFp8GemmCpu, Fp8GemmCpu, BindGemmFp8(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER(kFp8GeluGemmCpu, Fp8GeluGemmCpu, BindGemmFp8Gelu(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER(kDequantGemmCpu, DequantGemmCpu, BindGemmDequant(ffi::Ffi::Bind()));

std::vector<Target> gemm_cpu_targets() {
  return {target("jaxquant_gemm_fp8", kFp8GemmCpu),
          target("jaxquant_gemm_fp8_gelu", kFp8GeluGemmCpu),
          target("jaxquant_gemm_dequant", kDequantGemmCpu)};
}

}  // namespace jqffi
