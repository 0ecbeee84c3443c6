// Argument checking and FFI signatures of the GEMM targets (host code), shared by the CPU and
// CUDA handlers.
//
//   jaxquant_gemm_fp8      per-tensor FP8 or Float8Block (cuBLASLt on CUDA)
//       args  a[M,K] f8e4m3fn|f8e5m2, a_scale f32, b[N,K], b_scale f32, bias[N] | [0]
//       rets  out[M,N] bf16|f16|f32, workspace u8[W] (CUDA: cuBLASLt workspace; CPU: W = 0)
//       attrs a_scale_mode, b_scale_mode (0 per tensor (), 1 = 1x128 blocks, 2 = 128x128 tiles;
//             block scales in cuBLASLt's layouts, see scale_shape), fast_accum (bool)
//   jaxquant_gemm_fp8_gelu per-tensor FP8 with the tanh-approximation gelu in the epilogue
//       args  as jaxquant_gemm_fp8 (per-tensor scales only)
//       rets  out[M,N] = gelu(h) bf16|f16|f32, aux[M,N] = h (the pre-activation a b^T + bias,
//             out's dtype: the activation gradient's input), workspace u8[W]
//       attrs as jaxquant_gemm_fp8 (both scale modes 0)
//   jaxquant_gemm_dequant  MXFP8 / NVFP4 (in-kernel dequantize + wgmma on CUDA)
//       args  a[M, K] f8e4m3fn|f8e5m2|f4e2m1fn (XLA packs FP4 two per byte; u8 [M, K/2] of the
//             same bytes also accepted), a_scale e8m0|e4m3,
//             a_factor f32 () | [M] | [0], b.., b_scale, b_factor, bias[N] | [0]
//       rets  out[M,N] bf16|f16|f32
//       attrs k (padded contraction length), a_scale_tile_rows, b_scale_tile_rows (1 or 16)
// Bad arguments give ffi::Error::InvalidArgument naming the target and the buffer.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

#include "binding.h"
#include "gemm/dequant_params.h"
#include "buffer_checks.h"

namespace jqffi {

// "float8_e4m3fn(128, 64)": a buffer's dtype and shape, for error messages.
inline std::string describe(const ffi::AnyBuffer& b) {
  return std::string(dtype_name(b.element_type())) + dims_str(b.dimensions());
}

inline int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

inline bool has_shape(const ffi::AnyBuffer& b, std::initializer_list<int64_t> dims) {
  auto d = b.dimensions();
  if (d.size() != dims.size()) return false;
  size_t i = 0;
  for (int64_t x : dims) {
    if (d[i++] != x) return false;
  }
  return true;
}

inline int out_kind_of(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::BF16: return kOutBF16;
    case ffi::DataType::F16: return kOutF16;
    case ffi::DataType::F32: return kOutF32;
    default: return kOutNone;
  }
}

// Output [M, N] in bf16/f16/f32, bias [N] (same three dtypes) or [0] (no bias).
inline ffi::Error check_out_bias(const char* target, const ffi::AnyBuffer& out,
                                 const ffi::AnyBuffer& bias, int64_t M, int64_t N,
                                 int* out_kind, int* bias_kind) {
  *out_kind = out_kind_of(out.element_type());
  if (*out_kind == kOutNone || !has_shape(out, {M, N})) {
    return invalid(target, "out is " + describe(out) + "; expected bfloat16, float16 or float32 "
                           "of shape (" + std::to_string(M) + ", " + std::to_string(N) + ")");
  }
  auto bd = bias.dimensions();
  if (bd.size() == 1 && bd[0] == 0) {
    *bias_kind = kOutNone;
    return ffi::Error::Success();
  }
  *bias_kind = out_kind_of(bias.element_type());
  if (*bias_kind == kOutNone || !has_shape(bias, {N})) {
    return invalid(target, "bias is " + describe(bias) + "; expected bfloat16, float16 or "
                           "float32 of shape (" + std::to_string(N) + ",), or shape (0,) for "
                           "no bias");
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// jaxquant_gemm_fp8
// ---------------------------------------------------------------------------------------------

enum ScaleMode : int { kPerTensor = 0, kVec128 = 1, kBlk128 = 2 };

// cuBLASLt's layouts for a [rows, K] operand's scales: per tensor (); 1x128 blocks
// (ceil(K/128), round_up(rows, 4)), rows fastest; 128x128 tiles
// (ceil(rows/128), round_up(ceil(K/128), 4)), K-blocks fastest.
inline void scale_shape(int mode, int64_t rows, int64_t K, int64_t* d0, int64_t* d1) {
  if (mode == kVec128) {
    *d0 = ceil_div(K, 128);
    *d1 = round_up(rows, 4);
  } else {
    *d0 = ceil_div(rows, 128);
    *d1 = round_up(ceil_div(K, 128), 4);
  }
}

struct Fp8Operand {
  const void* data = nullptr;
  const float* scale = nullptr;
  int64_t rows = 0;
  bool e5m2 = false;
  int mode = kPerTensor;
};

// What the GEMM applies after bias: nothing, or gelu (tanh approximation) writing the
// pre-activation to `aux` as well.
enum GemmEpilogue : int { kEpilogueNone = 0, kEpilogueGeluAux = 1 };

struct Fp8Gemm {
  Fp8Operand a, b;
  int64_t M = 0, N = 0, K = 0;
  const void* bias = nullptr;
  int bias_kind = kOutNone;
  void* out = nullptr;
  int out_kind = kOutBF16;
  int epilogue = kEpilogueNone;
  void* aux = nullptr;  // [M, N] in out's dtype, with kEpilogueGeluAux
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  bool fast_accum = false;
};

inline ffi::Error decode_fp8_operand(const char* target, const char* name,
                                     const ffi::AnyBuffer& data, const ffi::AnyBuffer& scale,
                                     int64_t mode, int64_t K, Fp8Operand* op) {
  const auto t = data.element_type();
  if (t != ffi::DataType::F8E4M3FN && t != ffi::DataType::F8E5M2) {
    return invalid(target, std::string(name) + " is " + describe(data) +
                               "; expected float8_e4m3fn or float8_e5m2 [rows, K]");
  }
  if (mode < kPerTensor || mode > kBlk128) {
    return invalid(target, std::string(name) + "_scale_mode=" + std::to_string(mode) +
                               "; expected 0 (per tensor), 1 (1x128 blocks) or 2 (128x128)");
  }
  op->data = data.untyped_data();
  op->rows = data.dimensions()[0];
  op->e5m2 = t == ffi::DataType::F8E5M2;
  op->mode = static_cast<int>(mode);
  bool ok = scale.element_type() == ffi::DataType::F32;
  int64_t d0 = 0, d1 = 0;
  if (mode == kPerTensor) {
    ok = ok && scale.dimensions().size() == 0;
  } else {
    scale_shape(static_cast<int>(mode), op->rows, K, &d0, &d1);
    ok = ok && has_shape(scale, {d0, d1});
  }
  if (!ok) {
    std::string want = mode == kPerTensor ? "float32 ()"
                                          : "float32 (" + std::to_string(d0) + ", " +
                                                std::to_string(d1) + ") in cuBLASLt's layout";
    return invalid(target, std::string(name) + "_scale is " + describe(scale) + "; expected " +
                               want);
  }
  op->scale = static_cast<const float*>(scale.untyped_data());
  return ffi::Error::Success();
}

inline ffi::Error decode_fp8_gemm(const char* target, const ffi::AnyBuffer& a,
                                  const ffi::AnyBuffer& a_scale, const ffi::AnyBuffer& b,
                                  const ffi::AnyBuffer& b_scale, const ffi::AnyBuffer& bias,
                                  const ffi::AnyBuffer& out, const ffi::AnyBuffer& workspace,
                                  int64_t a_mode, int64_t b_mode, bool fast_accum, Fp8Gemm* g) {
  if (a.dimensions().size() != 2 || b.dimensions().size() != 2 ||
      a.dimensions()[1] != b.dimensions()[1]) {
    return invalid(target, "a is " + describe(a) + " and b is " + describe(b) +
                               "; expected [M, K] and [N, K] with the same K");
  }
  g->M = a.dimensions()[0];
  g->N = b.dimensions()[0];
  g->K = a.dimensions()[1];
  if (g->M <= 0 || g->N <= 0 || g->K <= 0) {
    return invalid(target, "empty operands a " + describe(a) + ", b " + describe(b));
  }
  JQ_RETURN_IF_ERROR(decode_fp8_operand(target, "a", a, a_scale, a_mode, g->K, &g->a));
  JQ_RETURN_IF_ERROR(decode_fp8_operand(target, "b", b, b_scale, b_mode, g->K, &g->b));
  if (g->a.e5m2 && g->b.e5m2) {
    return invalid(target, "a and b are both float8_e5m2; cuBLASLt multiplies E4M3 x E4M3, "
                           "E4M3 x E5M2 and E5M2 x E4M3 only");
  }
  if ((a_mode == kPerTensor) != (b_mode == kPerTensor)) {
    return invalid(target, "a_scale_mode=" + std::to_string(a_mode) + " and b_scale_mode=" +
                               std::to_string(b_mode) + "; per-tensor and block scales cannot "
                               "be mixed in one GEMM");
  }
  if (a_mode == kBlk128 && b_mode == kBlk128) {
    return invalid(target, "a and b both have 128x128 block scales; cuBLASLt supports 1x128 x "
                           "1x128, 1x128 x 128x128 and 128x128 x 1x128 only");
  }
  if (fast_accum && a_mode != kPerTensor) {
    return invalid(target, "fast_accum=True with block scales; cuBLASLt's block-scaled FP8 "
                           "GEMM always promotes the accumulator");
  }
  JQ_RETURN_IF_ERROR(
      check_out_bias(target, out, bias, g->M, g->N, &g->out_kind, &g->bias_kind));
  if (workspace.element_type() != ffi::DataType::U8 || workspace.dimensions().size() != 1) {
    return invalid(target, "workspace is " + describe(workspace) + "; expected uint8 (bytes,)");
  }
  g->bias = bias.untyped_data();
  g->out = out.untyped_data();
  g->workspace = workspace.untyped_data();
  g->workspace_bytes = static_cast<size_t>(workspace.dimensions()[0]);
  g->fast_accum = fast_accum;
  return ffi::Error::Success();
}

// jaxquant_gemm_fp8_gelu: jaxquant_gemm_fp8's arguments with per-tensor scales, and `aux`
// (the pre-activation) of out's dtype and shape.
inline ffi::Error decode_fp8_gelu_gemm(const char* target, const ffi::AnyBuffer& a,
                                       const ffi::AnyBuffer& a_scale, const ffi::AnyBuffer& b,
                                       const ffi::AnyBuffer& b_scale, const ffi::AnyBuffer& bias,
                                       const ffi::AnyBuffer& out, const ffi::AnyBuffer& aux,
                                       const ffi::AnyBuffer& workspace, int64_t a_mode,
                                       int64_t b_mode, bool fast_accum, Fp8Gemm* g) {
  if (a_mode != kPerTensor || b_mode != kPerTensor) {
    return invalid(target, "a_scale_mode=" + std::to_string(a_mode) + ", b_scale_mode=" +
                               std::to_string(b_mode) + "; the gelu epilogue takes per-tensor "
                               "scales only (0, 0)");
  }
  JQ_RETURN_IF_ERROR(decode_fp8_gemm(target, a, a_scale, b, b_scale, bias, out, workspace, a_mode,
                                     b_mode, fast_accum, g));
  if (aux.element_type() != out.element_type() || !has_shape(aux, {g->M, g->N})) {
    return invalid(target, "aux is " + describe(aux) + "; expected out's dtype and shape, " +
                               describe(out));
  }
  g->epilogue = kEpilogueGeluAux;
  g->aux = aux.untyped_data();
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// jaxquant_gemm_dequant
// ---------------------------------------------------------------------------------------------

inline ffi::Error decode_dequant_operand(const char* target, const char* name,
                                         const ffi::AnyBuffer& data, const ffi::AnyBuffer& scale,
                                         const ffi::AnyBuffer& factor, int64_t K,
                                         int64_t tile_rows, DequantOperand* op) {
  const auto t = data.element_type();
  auto d = data.dimensions();
  if (d.size() != 2 || d[0] <= 0) {
    return invalid(target, std::string(name) + " is " + describe(data) + "; expected a 2-D "
                                                "[rows, K] payload");
  }
  const int64_t rows = d[0];
  if (rows >= (int64_t{1} << 31)) return invalid(target, std::string(name) + ": too many rows");
  if (t == ffi::DataType::F8E4M3FN || t == ffi::DataType::F8E5M2) {
    op->elem = t == ffi::DataType::F8E4M3FN ? Elem::kE4M3 : Elem::kE5M2;
    if (d[1] != K || K % 16 != 0) {
      return invalid(target, std::string(name) + " is " + describe(data) + " with k=" +
                                 std::to_string(K) + "; expected [rows, k] with k a multiple "
                                 "of 16 (pad the contraction axis with zeros)");
    }
    op->row_bytes = K;
    const int64_t blocks = ceil_div(K, 32);
    if (scale.element_type() != ffi::DataType::F8E8M0FNU || !has_shape(scale, {rows, blocks}) ||
        tile_rows != 1) {
      return invalid(target, std::string(name) + "_scale is " + describe(scale) + " (tile rows " +
                                 std::to_string(tile_rows) + "); MXFP8 expects float8_e8m0fnu (" +
                                 std::to_string(rows) + ", " + std::to_string(blocks) +
                                 ") with one row per scale row");
    }
    op->scale_stride = blocks;
    op->scale_row_shift = 0;
  } else if (t == ffi::DataType::F4E2M1FN || t == ffi::DataType::U8) {
    // XLA stores float4_e2m1fn packed two per byte, element 2i in the low nibble (checked by
    // tests/test_ffi_storage.py); a uint8 [rows, k/2] view of the same bytes is accepted too.
    op->elem = Elem::kE2M1;
    const int64_t want = t == ffi::DataType::U8 ? K / 2 : K;
    if (K % 32 != 0 || d[1] != want) {
      return invalid(target, std::string(name) + " is " + describe(data) + " with k=" +
                                 std::to_string(K) + "; NVFP4 expects float4_e2m1fn [rows, k] "
                                 "(or its bytes, uint8 [rows, k/2]) with k a multiple of 32 "
                                 "(pad the contraction axis with zeros)");
    }
    op->row_bytes = K / 2;
    if (tile_rows != 1 && tile_rows != 16) {
      return invalid(target, std::string(name) + "_scale_tile_rows=" + std::to_string(tile_rows) +
                                 "; expected 1 (1x16 blocks) or 16 (16x16 tiles)");
    }
    const int64_t blocks = K / 16, srows = ceil_div(rows, tile_rows);
    if (scale.element_type() != ffi::DataType::F8E4M3FN || !has_shape(scale, {srows, blocks})) {
      return invalid(target, std::string(name) + "_scale is " + describe(scale) +
                                 "; NVFP4 expects float8_e4m3fn (" + std::to_string(srows) +
                                 ", " + std::to_string(blocks) + ")");
    }
    op->scale_stride = blocks;
    op->scale_row_shift = tile_rows == 16 ? 4 : 0;
  } else {
    return invalid(target, std::string(name) + " is " + describe(data) +
                               "; expected float8_e4m3fn / float8_e5m2 (MXFP8) or "
                               "float4_e2m1fn (NVFP4)");
  }
  op->data = static_cast<const uint8_t*>(data.untyped_data());
  op->scale = static_cast<const uint8_t*>(scale.untyped_data());
  op->rows = static_cast<int>(rows);
  auto fd = factor.dimensions();
  if (factor.element_type() != ffi::DataType::F32) {
    return invalid(target, std::string(name) + "_factor is " + describe(factor) +
                               "; expected float32 (), (rows,) or (0,)");
  }
  if (fd.size() == 0) {
    op->factor_kind = 1;
  } else if (fd.size() == 1 && fd[0] == 0) {
    op->factor_kind = 0;
  } else if (fd.size() == 1 && fd[0] == rows) {
    op->factor_kind = 2;
  } else {
    return invalid(target, std::string(name) + "_factor is " + describe(factor) +
                               "; expected float32 (), (" + std::to_string(rows) + ",) or (0,)");
  }
  op->factor = static_cast<const float*>(factor.untyped_data());
  return ffi::Error::Success();
}

inline ffi::Error decode_dequant_gemm(const char* target, const ffi::AnyBuffer& a,
                                      const ffi::AnyBuffer& a_scale,
                                      const ffi::AnyBuffer& a_factor, const ffi::AnyBuffer& b,
                                      const ffi::AnyBuffer& b_scale,
                                      const ffi::AnyBuffer& b_factor, const ffi::AnyBuffer& bias,
                                      const ffi::AnyBuffer& out, int64_t k, int64_t a_tile_rows,
                                      int64_t b_tile_rows, DequantParams* p) {
  if (k <= 0 || k >= (int64_t{1} << 31)) {
    return invalid(target, "k=" + std::to_string(k) + "; expected 0 < k < 2^31");
  }
  JQ_RETURN_IF_ERROR(
      decode_dequant_operand(target, "a", a, a_scale, a_factor, k, a_tile_rows, &p->a));
  JQ_RETURN_IF_ERROR(
      decode_dequant_operand(target, "b", b, b_scale, b_factor, k, b_tile_rows, &p->b));
  p->M = p->a.rows;
  p->N = p->b.rows;
  p->K = static_cast<int>(k);
  JQ_RETURN_IF_ERROR(
      check_out_bias(target, out, bias, p->M, p->N, &p->out_kind, &p->bias_kind));
  p->bias = bias.untyped_data();
  p->out = out.untyped_data();
  return ffi::Error::Success();
}

// The FFI signatures, one copy for both platforms: the CPU handlers bind
// `BindX(ffi::Ffi::Bind())`, the CUDA ones `BindX(ffi::Ffi::Bind().Ctx<Stream>())`.
// jaxquant_gemm_fp8: a, a_scale, b, b_scale, bias -> out, workspace.
template <typename Binding>
auto BindGemmFp8(Binding binding) {
  auto buffers = Rets<2>(Args<5>(std::move(binding)));
  return Attrs<bool>(Attrs<int64_t>(std::move(buffers), "a_scale_mode", "b_scale_mode"),
                     "fast_accum");
}

// jaxquant_gemm_fp8_gelu: a, a_scale, b, b_scale, bias -> out, aux, workspace.
template <typename Binding>
auto BindGemmFp8Gelu(Binding binding) {
  auto buffers = Rets<3>(Args<5>(std::move(binding)));
  return Attrs<bool>(Attrs<int64_t>(std::move(buffers), "a_scale_mode", "b_scale_mode"),
                     "fast_accum");
}

// jaxquant_gemm_dequant: a, a_scale, a_factor, b, b_scale, b_factor, bias -> out.
template <typename Binding>
auto BindGemmDequant(Binding binding) {
  return Attrs<int64_t>(Rets<1>(Args<7>(std::move(binding))), "k", "a_scale_tile_rows",
                        "b_scale_tile_rows");
}

}  // namespace jqffi
