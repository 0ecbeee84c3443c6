// CPU handlers of the fused producer targets: plain loops over the numerics header.
//
// The produced matrix (a normalization's or an activation's output, rounded to the output
// dtype) is materialized as float32 and quantized by the same host routines as the quantize
// targets (quantize/quantize_cpu.h), so the CPU handlers are the reference composition written
// in C++: CI runs the fused path and its argument checks without a GPU.
#include <algorithm>
#include <cstring>
#include <vector>

#include "fused/fused_args.h"
#include "fused/registrations.h"
#include "quantize/quantize_cpu.h"

namespace jqffi {
namespace {

using jq::float_of;

// One element of the produced matrix before rounding (ffi/jaxquant_numerics.h, "Fused producers").
float produced_value(const FusedArgs& f, int64_t r, int64_t c) {
  switch (f.producer) {
    case Producer::kLayerNorm:
    case Producer::kRmsNorm:
      return jq::norm_value(input_value(f.a, r * f.C + c), f.mean ? f.mean[r] : 0.f, f.rsigma[r],
                            f.scale ? f.scale[c] : 0.f, f.bias ? f.bias[c] : 0.f, f.layernorm(),
                            f.has_scale, f.has_bias);
    case Producer::kAct: {
      const int64_t width = f.gated ? 2 * f.C : f.C;
      const float h0 = input_value(f.a, r * width + c);
      const float a = jq::act_value(f.act, h0);
      return f.gated ? a * input_value(f.a, r * width + f.C + c) : a;
    }
    default: {  // activation gradient
      if (!f.gated) return jq::act_backward(f.act, input_value(f.a, r * f.N + c), input_value(f.b, r * f.C + c));
      if (c < f.N) {
        const float dy = input_value(f.a, r * f.N + c);
        const float h1 = input_value(f.b, r * f.C + f.N + c);
        return jq::act_backward(f.act, dy * h1, input_value(f.b, r * f.C + c));
      }
      const int64_t k = c - f.N;
      return input_value(f.a, r * f.N + k) * jq::act_value(f.act, input_value(f.b, r * f.C + k));
    }
  }
}

// The produced [R, C] matrix, each value rounded to the output dtype.
Matrix produce(const FusedArgs& f) {
  Matrix m{std::vector<float>(static_cast<size_t>(f.R * f.C)), f.R, f.C};
  for (int64_t r = 0; r < f.R; ++r) {
    for (int64_t c = 0; c < f.C; ++c) m.v[r * f.C + c] = jq::round_to_host(f.out, produced_value(f, r, c));
  }
  return m;
}

void write_y(const Matrix& m, jq::OutType out, void* y) {
  const size_t n = m.v.size();
  if (out == jq::OutType::kF32) {
    std::memcpy(y, m.v.data(), 4 * n);
    return;
  }
  uint16_t* dst = static_cast<uint16_t*>(y);
  for (size_t i = 0; i < n; ++i) {
    dst[i] = static_cast<uint16_t>(out == jq::OutType::kBF16 ? jq::bf16_bits_rne(m.v[i]) : jq::f16_bits_rne(m.v[i]));
  }
}

// reductions.column_tile_sums: per 128-row tile and column, 8 chunks of 16 rows summed top to
// bottom, then pairwise; rows past the matrix are +0.
void column_tile_sums(const Matrix& m, float* out) {
  const int64_t tiles = ceil_div(m.rows, 128);
  for (int64_t t = 0; t < tiles; ++t) {
    for (int64_t c = 0; c < m.cols; ++c) {
      float chunk[8];
      for (int j = 0; j < 8; ++j) {
        float v[16];
        for (int i = 0; i < 16; ++i) {
          const int64_t r = 128 * t + 16 * j + i;
          v[i] = r < m.rows ? m.at(r, c) : 0.0f;
        }
        float s = v[0] + v[1];
        for (int i = 2; i < 16; ++i) s = s + v[i];
        chunk[j] = s;
      }
      for (int width = 8; width > 1; width /= 2) {
        for (int j = 0; j < width / 2; ++j) chunk[j] = chunk[2 * j] + chunk[2 * j + 1];
      }
      out[t * m.cols + c] = chunk[0];
    }
  }
}

float amax_of(const Matrix& m) { return float_of(amax_bits_of_range(m, 0, m.rows, 0, m.cols)); }

// ------------------------------------- norm statistics ---------------------------------------

ffi::Error NormStatsCpu(ffi::AnyBuffer x, ffi::AnyBuffer scale, ffi::AnyBuffer bias, ffi::AnyBuffer gate,
                        ffi::RemainingRets rets, bool rmsnorm, float epsilon, int32_t amax, int32_t out_type,
                        bool has_scale, bool has_bias) {
  NormStatsArgs a;
  JQ_RETURN_IF_ERROR(decode_norm_stats(x, scale, bias, gate, rets, rmsnorm, epsilon, amax, out_type, has_scale,
                                       has_bias, &a));
  const int64_t R = a.x.rows, C = a.x.cols;
  const bool want_amax = a.amax != nullptr && (a.amax_mode == 1 || *a.gate == 0.0f);
  const float k = static_cast<float>(C);
  uint32_t amax_bits = 0;
  std::vector<float> row(C), terms(C);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t c = 0; c < C; ++c) row[c] = input_value(a.x, r * C + c);
    float mean = 0.f;
    if (a.layernorm) mean = jq::div_f32(jq::row_sum_host(row.data(), C), k);
    for (int64_t c = 0; c < C; ++c) {
      const float d = a.layernorm ? row[c] - mean : row[c];
      terms[c] = jq::mul_rn(d, d);
    }
    const float rsigma = jq::rsigma_of(jq::div_f32(jq::row_sum_host(terms.data(), C), k), a.epsilon);
    if (a.mean) a.mean[r] = mean;
    a.rsigma[r] = rsigma;
    if (!want_amax) continue;
    for (int64_t c = 0; c < C; ++c) {
      const float y = jq::norm_value(row[c], mean, rsigma, a.scale ? a.scale[c] : 0.f, a.bias ? a.bias[c] : 0.f,
                                     a.layernorm, a.has_scale, a.has_bias);
      amax_bits = std::max(amax_bits, jq::abs_bits(jq::round_to_host(a.out, y)));
    }
  }
  if (a.amax) *a.amax = want_amax ? float_of(amax_bits) : 0.f;
  return ffi::Error::Success();
}

// ---------------------------------------- producer amax --------------------------------------

ffi::Error FusedAmaxCpu(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer mean, ffi::AnyBuffer rsigma,
                        ffi::AnyBuffer scale, ffi::AnyBuffer bias, ffi::AnyBuffer gate,
                        ffi::Result<ffi::AnyBuffer> amax, int32_t producer, int32_t act, int32_t out_type, bool gated,
                        bool has_scale, bool has_bias, bool gated_amax) {
  const char* t = "jaxquant_fused_amax";
  FusedArgs f;
  JQ_RETURN_IF_ERROR(decode_producer(t, a, b, mean, rsigma, scale, bias,
                                     {producer, act, out_type, gated, has_scale, has_bias}, &f));
  JQ_RETURN_IF_ERROR(expect(t, "gate", gate, {ffi::DataType::F32}, {}));
  JQ_RETURN_IF_ERROR(expect(t, "amax", *amax, {ffi::DataType::F32}, {}));
  float* out = static_cast<float*>(amax->untyped_data());
  if (gated_amax && *static_cast<const float*>(gate.untyped_data()) != 0.0f) {
    *out = 0.f;
    return ffi::Error::Success();
  }
  *out = amax_of(produce(f));
  return ffi::Error::Success();
}

// --------------------------------------- fused quantize --------------------------------------

ffi::Error FusedQuantizeFp8Cpu(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer mean, ffi::AnyBuffer rsigma,
                               ffi::AnyBuffer scale, ffi::AnyBuffer bias, ffi::AnyBuffer s, ffi::RemainingRets rets,
                               int32_t producer, int32_t act, int32_t out_type, bool gated, bool has_scale,
                               bool has_bias, bool write_y_attr, bool col_sums, bool rowwise, bool columnwise,
                               bool delayed, bool pow2_scale, float amax_epsilon) {
  const char* t = "jaxquant_fused_quantize_fp8";
  FusedArgs f;
  JQ_RETURN_IF_ERROR(decode_producer(t, a, b, mean, rsigma, scale, bias,
                                     {producer, act, out_type, gated, has_scale, has_bias}, &f));
  JQ_RETURN_IF_ERROR(need_direction(t, rowwise, columnwise));
  JQ_RETURN_IF_ERROR(expect(t, delayed ? "scale" : "amax", s, {ffi::DataType::F32}, {}));
  Fp8TensorArgs q;
  q.rowwise = rowwise; q.columnwise = columnwise; q.delayed = delayed;
  q.pow2_scale = pow2_scale; q.amax_epsilon = amax_epsilon;
  FusedOutputs o;
  RetReader r(t, rets);
  JQ_RETURN_IF_ERROR(read_y(t, r, f, write_y_attr, &o));
  JQ_RETURN_IF_ERROR(read_fp8_tensor_results(t, r, f.R, f.C, &q));
  JQ_RETURN_IF_ERROR(read_col_sums(t, r, f, col_sums, &o));
  JQ_RETURN_IF_ERROR(r.done());
  const Matrix m = produce(f);
  const float given = *static_cast<const float*>(s.untyped_data());
  const float sc = delayed ? given : jq::scale_from_amax(given, jq::spec_of(q.fmt).fmax, pow2_scale, amax_epsilon);
  if (o.y) write_y(m, f.out, o.y);
  if (rowwise) fp8_with_scale(m, sc, q.fmt, q.row_data);
  if (columnwise) fp8_with_scale(transposed(m), sc, q.fmt, q.col_data);
  *q.scale_inv = jq::rcp_f32(sc);
  if (q.amax) *q.amax = amax_of(m);
  if (o.col_sums) column_tile_sums(m, o.col_sums);
  return ffi::Error::Success();
}

ffi::Error FusedQuantizeMxfp8Cpu(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer mean, ffi::AnyBuffer rsigma,
                                 ffi::AnyBuffer scale, ffi::AnyBuffer bias, ffi::RemainingRets rets, int32_t producer,
                                 int32_t act, int32_t out_type, bool gated, bool has_scale, bool has_bias,
                                 bool write_y_attr, bool col_sums, bool rowwise, bool columnwise) {
  const char* t = "jaxquant_fused_quantize_mxfp8";
  FusedArgs f;
  JQ_RETURN_IF_ERROR(decode_producer(t, a, b, mean, rsigma, scale, bias,
                                     {producer, act, out_type, gated, has_scale, has_bias}, &f));
  JQ_RETURN_IF_ERROR(need_direction(t, rowwise, columnwise));
  Mxfp8Args q;
  q.rowwise = rowwise; q.columnwise = columnwise;
  FusedOutputs o;
  RetReader r(t, rets);
  JQ_RETURN_IF_ERROR(read_y(t, r, f, write_y_attr, &o));
  JQ_RETURN_IF_ERROR(read_mxfp8_results(t, r, f.R, f.C, &q));
  JQ_RETURN_IF_ERROR(read_col_sums(t, r, f, col_sums, &o));
  JQ_RETURN_IF_ERROR(r.done());
  const Matrix m = produce(f);
  if (o.y) write_y(m, f.out, o.y);
  if (rowwise) mxfp8_matrix(m, q.fmt, q.row_data, q.row_scale);
  if (columnwise) mxfp8_matrix(transposed(m), q.fmt, q.col_data, q.col_scale);
  *q.amax = amax_of(m);
  if (o.col_sums) column_tile_sums(m, o.col_sums);
  return ffi::Error::Success();
}

ffi::Error FusedQuantizeFp8BlockCpu(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer mean, ffi::AnyBuffer rsigma,
                                    ffi::AnyBuffer scale, ffi::AnyBuffer bias, ffi::RemainingRets rets,
                                    int32_t producer, int32_t act, int32_t out_type, bool gated, bool has_scale,
                                    bool has_bias, bool write_y_attr, bool col_sums, bool rowwise, bool columnwise,
                                    bool block_2d, bool pow2_scale, float amax_epsilon) {
  const char* t = "jaxquant_fused_quantize_fp8_block";
  FusedArgs f;
  JQ_RETURN_IF_ERROR(decode_producer(t, a, b, mean, rsigma, scale, bias,
                                     {producer, act, out_type, gated, has_scale, has_bias}, &f));
  JQ_RETURN_IF_ERROR(need_direction(t, rowwise, columnwise));
  Fp8BlockArgs q;
  q.rowwise = rowwise; q.columnwise = columnwise; q.block_2d = block_2d;
  q.pow2_scale = pow2_scale; q.amax_epsilon = amax_epsilon;
  FusedOutputs o;
  RetReader r(t, rets);
  JQ_RETURN_IF_ERROR(read_y(t, r, f, write_y_attr, &o));
  JQ_RETURN_IF_ERROR(read_fp8_block_results(t, r, f.R, f.C, &q));
  JQ_RETURN_IF_ERROR(read_col_sums(t, r, f, col_sums, &o));
  JQ_RETURN_IF_ERROR(r.done());
  const Matrix m = produce(f);
  const int64_t block_rows = block_2d ? 128 : 1;
  if (o.y) write_y(m, f.out, o.y);
  if (rowwise) fp8_block_matrix(m, block_rows, q, q.row_data, q.row_scale);
  if (columnwise) fp8_block_matrix(transposed(m), block_rows, q, q.col_data, q.col_scale);
  *q.amax = amax_of(m);
  if (o.col_sums) column_tile_sums(m, o.col_sums);
  return ffi::Error::Success();
}

}  // namespace

#define JQ_FUSED_OPERANDS                                                                          \
  .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()        \
      .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
#define JQ_PRODUCER_ATTRS                                                                          \
  .Attr<int32_t>("producer").Attr<int32_t>("act").Attr<int32_t>("out_type").Attr<bool>("gated")   \
      .Attr<bool>("has_scale").Attr<bool>("has_bias")

XLA_FFI_DEFINE_HANDLER(kNormStatsCpu, NormStatsCpu,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()
                           .Arg<ffi::AnyBuffer>()
                           .Arg<ffi::AnyBuffer>()
                           .Arg<ffi::AnyBuffer>()
                           .RemainingRets()
                           .Attr<bool>("rmsnorm")
                           .Attr<float>("epsilon")
                           .Attr<int32_t>("amax")
                           .Attr<int32_t>("out_type")
                           .Attr<bool>("has_scale")
                           .Attr<bool>("has_bias"));

XLA_FFI_DEFINE_HANDLER(kFusedAmaxCpu, FusedAmaxCpu,
                       ffi::Ffi::Bind() JQ_FUSED_OPERANDS.Arg<ffi::AnyBuffer>()
                           .Ret<ffi::AnyBuffer>() JQ_PRODUCER_ATTRS.Attr<bool>("gated_amax"));

XLA_FFI_DEFINE_HANDLER(kFusedQuantizeFp8Cpu, FusedQuantizeFp8Cpu,
                       ffi::Ffi::Bind() JQ_FUSED_OPERANDS.Arg<ffi::AnyBuffer>()
                           .RemainingRets() JQ_PRODUCER_ATTRS.Attr<bool>("write_y")
                           .Attr<bool>("col_sums")
                           .Attr<bool>("rowwise")
                           .Attr<bool>("columnwise")
                           .Attr<bool>("delayed")
                           .Attr<bool>("pow2_scale")
                           .Attr<float>("amax_epsilon"));

XLA_FFI_DEFINE_HANDLER(kFusedQuantizeMxfp8Cpu, FusedQuantizeMxfp8Cpu,
                       ffi::Ffi::Bind() JQ_FUSED_OPERANDS.RemainingRets() JQ_PRODUCER_ATTRS.Attr<bool>("write_y")
                           .Attr<bool>("col_sums")
                           .Attr<bool>("rowwise")
                           .Attr<bool>("columnwise"));

XLA_FFI_DEFINE_HANDLER(kFusedQuantizeFp8BlockCpu, FusedQuantizeFp8BlockCpu,
                       ffi::Ffi::Bind() JQ_FUSED_OPERANDS.RemainingRets() JQ_PRODUCER_ATTRS.Attr<bool>("write_y")
                           .Attr<bool>("col_sums")
                           .Attr<bool>("rowwise")
                           .Attr<bool>("columnwise")
                           .Attr<bool>("block_2d")
                           .Attr<bool>("pow2_scale")
                           .Attr<float>("amax_epsilon"));

std::vector<Target> fused_cpu_targets() {
  return {
      {"jaxquant_norm_stats", reinterpret_cast<void*>(kNormStatsCpu)},
      {"jaxquant_fused_amax", reinterpret_cast<void*>(kFusedAmaxCpu)},
      {"jaxquant_fused_quantize_fp8", reinterpret_cast<void*>(kFusedQuantizeFp8Cpu)},
      {"jaxquant_fused_quantize_mxfp8", reinterpret_cast<void*>(kFusedQuantizeMxfp8Cpu)},
      {"jaxquant_fused_quantize_fp8_block", reinterpret_cast<void*>(kFusedQuantizeFp8BlockCpu)},
  };
}

}  // namespace jqffi
