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
#include "fused/handlers.h"
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
    case Producer::kParts: {  // column c of part c / Cp
      const int64_t part = c / f.N;
      return input_value(Input{f.parts[part], f.R, f.N, f.a.type}, r * f.N + (c - part * f.N));
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
                        ffi::RemainingArgs more, ffi::Result<ffi::AnyBuffer> amax, int32_t producer, int32_t act, int32_t out_type, bool gated,
                        bool has_scale, bool has_bias, bool gated_amax) {
  FusedAmaxArgs d;
  JQ_RETURN_IF_ERROR(decode_fused_amax({a, b, mean, rsigma, scale, bias, &more}, gate, amax,
                                       {producer, act, out_type, gated, has_scale, has_bias}, gated_amax, &d));
  *d.amax = d.gate && *d.gate != 0.0f ? 0.f : amax_of(produce(d.f));
  return ffi::Error::Success();
}

// --------------------------------------- fused quantize --------------------------------------

// The produced matrix of a fused quantize call, with its y and column sums written if asked for.
template <typename Q>
Matrix produce_outputs(const FusedQuantizeArgs<Q>& d) {
  Matrix m = produce(d.f);
  if (d.o.y) write_y(m, d.f.out, d.o.y);
  if (d.o.col_sums) column_tile_sums(m, d.o.col_sums);
  return m;
}

ffi::Error FusedQuantizeFp8Cpu(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer mean, ffi::AnyBuffer rsigma,
                               ffi::AnyBuffer scale, ffi::AnyBuffer bias, ffi::AnyBuffer s, ffi::RemainingArgs more, ffi::RemainingRets rets,
                               int32_t producer, int32_t act, int32_t out_type, bool gated, bool has_scale,
                               bool has_bias, bool write_y, bool col_sums, bool rowwise, bool columnwise,
                               bool delayed, bool pow2_scale, float amax_epsilon) {
  FusedQuantizeArgs<Fp8TensorArgs> d;
  JQ_RETURN_IF_ERROR(decode_fused_fp8({a, b, mean, rsigma, scale, bias, &more}, s, rets,
                                      {producer, act, out_type, gated, has_scale, has_bias}, write_y, col_sums,
                                      rowwise, columnwise, delayed, pow2_scale, amax_epsilon, &d));
  quantize_matrix(produce_outputs(d), d.q);
  return ffi::Error::Success();
}

ffi::Error FusedQuantizeMxfp8Cpu(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer mean, ffi::AnyBuffer rsigma,
                                 ffi::AnyBuffer scale, ffi::AnyBuffer bias, ffi::RemainingArgs more, ffi::RemainingRets rets, int32_t producer,
                                 int32_t act, int32_t out_type, bool gated, bool has_scale, bool has_bias,
                                 bool write_y, bool col_sums, bool rowwise, bool columnwise) {
  FusedQuantizeArgs<Mxfp8Args> d;
  JQ_RETURN_IF_ERROR(decode_fused_mxfp8({a, b, mean, rsigma, scale, bias, &more}, rets,
                                        {producer, act, out_type, gated, has_scale, has_bias}, write_y, col_sums,
                                        rowwise, columnwise, &d));
  quantize_matrix(produce_outputs(d), d.q);
  return ffi::Error::Success();
}

ffi::Error FusedQuantizeFp8BlockCpu(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer mean, ffi::AnyBuffer rsigma,
                                    ffi::AnyBuffer scale, ffi::AnyBuffer bias, ffi::RemainingArgs more, ffi::RemainingRets rets,
                                    int32_t producer, int32_t act, int32_t out_type, bool gated, bool has_scale,
                                    bool has_bias, bool write_y, bool col_sums, bool rowwise, bool columnwise,
                                    bool block_2d, bool pow2_scale, float amax_epsilon) {
  FusedQuantizeArgs<Fp8BlockArgs> d;
  JQ_RETURN_IF_ERROR(decode_fused_fp8_block({a, b, mean, rsigma, scale, bias, &more}, rets,
                                            {producer, act, out_type, gated, has_scale, has_bias}, write_y,
                                            col_sums, rowwise, columnwise, block_2d, pow2_scale, amax_epsilon, &d));
  quantize_matrix(produce_outputs(d), d.q);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kNormStatsCpu, NormStatsCpu, BindNormStats(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER(kFusedAmaxCpu, FusedAmaxCpu, BindFusedAmax(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER(kFusedQuantizeFp8Cpu, FusedQuantizeFp8Cpu, BindFusedQuantizeFp8(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER(kFusedQuantizeMxfp8Cpu, FusedQuantizeMxfp8Cpu, BindFusedQuantizeMxfp8(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER(kFusedQuantizeFp8BlockCpu, FusedQuantizeFp8BlockCpu,
                       BindFusedQuantizeFp8Block(ffi::Ffi::Bind()));

std::vector<Target> fused_cpu_targets() {
  return {target("jaxquant_norm_stats", kNormStatsCpu),
          target("jaxquant_fused_amax", kFusedAmaxCpu),
          target("jaxquant_fused_quantize_fp8", kFusedQuantizeFp8Cpu),
          target("jaxquant_fused_quantize_mxfp8", kFusedQuantizeMxfp8Cpu),
          target("jaxquant_fused_quantize_fp8_block", kFusedQuantizeFp8BlockCpu)};
}

}  // namespace jqffi
