// CPU handlers of the quantize, amax, transpose and debug targets: plain loops over the numerics
// header.
//
// They exist so CI exercises the FFI path (lowering, argument checking, output layouts) without
// a GPU, with the same scalar math as the CUDA kernels. Speed is not a goal: each direction is
// materialized as a float32 matrix (the columnwise one transposed, and Hadamard-transformed for
// NVFP4 rht) and quantized row by row.
#include <algorithm>
#include <cstring>
#include <vector>

#include "quantize/handlers.h"
#include "quantize/nvfp4_cpu.h"
#include "quantize/quantize_args.h"
#include "quantize/quantize_cpu.h"

namespace jqffi {
namespace {

using jq::bits_of;
using jq::float_of;

Matrix direction_matrix(const Input& x, bool transposed, bool rht) {
  Matrix m{std::vector<float>(static_cast<size_t>(x.rows * x.cols)),
           transposed ? x.cols : x.rows, transposed ? x.rows : x.cols};
  for (int64_t r = 0; r < x.rows; ++r) {
    for (int64_t c = 0; c < x.cols; ++c) {
      const float value = input_value(x, r * x.cols + c);
      if (transposed) m.v[c * x.rows + r] = value; else m.v[r * x.cols + c] = value;
    }
  }
  if (rht) {
    for (int64_t r = 0; r < m.rows; ++r) {
      for (int64_t c = 0; c < m.cols; c += 16) jq::rht16(&m.v[r * m.cols + c]);
    }
  }
  return m;
}

// ------------------------------------------ amax ---------------------------------------------

ffi::Error AmaxCpu(ffi::AnyBuffer x, ffi::RemainingRets rets, int32_t outputs) {
  AmaxArgs a;
  JQ_RETURN_IF_ERROR(decode_amax(x, rets, outputs, &a));
  if (a.tensor || a.rows) {
    const Matrix m = direction_matrix(a.x, false, false);
    if (a.tensor) *a.tensor = amax_of(m);
    if (a.rows) for (int64_t r = 0; r < m.rows; ++r) a.rows[r] = float_of(amax_bits_of_range(m, r, r + 1, 0, m.cols));
  }
  if (a.cols) {
    const Matrix m = direction_matrix(a.x, true, false);
    for (int64_t r = 0; r < m.rows; ++r) a.cols[r] = float_of(amax_bits_of_range(m, r, r + 1, 0, m.cols));
  }
  if (a.tensor_rht || a.cols_rht) {
    const Matrix m = direction_matrix(a.x, true, true);
    if (a.tensor_rht) *a.tensor_rht = amax_of(m);
    if (a.cols_rht) for (int64_t r = 0; r < m.rows; ++r) a.cols_rht[r] = float_of(amax_bits_of_range(m, r, r + 1, 0, m.cols));
  }
  return ffi::Error::Success();
}

ffi::Error AmaxGatedCpu(ffi::AnyBuffer x, ffi::AnyBuffer gate, ffi::RemainingRets rets, int32_t outputs) {
  const float* g = nullptr;
  JQ_RETURN_IF_ERROR(decode_gate(gate, &g));
  if (*g == 0.f) return AmaxCpu(x, rets, outputs);
  AmaxArgs a;  // skipped: every output is zero, as the CUDA handler leaves it
  JQ_RETURN_IF_ERROR(decode_amax(x, rets, outputs, &a));
  if (a.tensor) *a.tensor = 0.f;
  if (a.tensor_rht) *a.tensor_rht = 0.f;
  if (a.rows) std::fill(a.rows, a.rows + a.x.rows, 0.f);
  if (a.cols) std::fill(a.cols, a.cols + a.x.cols, 0.f);
  if (a.cols_rht) std::fill(a.cols_rht, a.cols_rht + a.x.cols, 0.f);
  return ffi::Error::Success();
}

// --------------------------------------- FP8 per tensor --------------------------------------

ffi::Error QuantizeFp8Cpu(ffi::AnyBuffer x, ffi::AnyBuffer s, ffi::RemainingRets rets,
                          bool rowwise, bool columnwise, bool delayed, bool pow2_scale,
                          float amax_epsilon) {
  Fp8TensorArgs a;
  JQ_RETURN_IF_ERROR(decode_fp8_tensor(x, s, rets, rowwise, columnwise, delayed, pow2_scale,
                                       amax_epsilon, &a));
  quantize_matrix(direction_matrix(a.x, false, false), a);
  return ffi::Error::Success();
}

ffi::Error QuantizeFp8DelayedCpu(ffi::AnyBuffer x, ffi::AnyBuffer s, ffi::AnyBuffer first_amax,
                                 ffi::RemainingRets rets, bool rowwise, bool columnwise,
                                 int32_t margin) {
  Fp8TensorArgs a;
  JQ_RETURN_IF_ERROR(decode_fp8_delayed(x, s, first_amax, rets, rowwise, columnwise, margin, &a));
  quantize_matrix(direction_matrix(a.x, false, false), a);
  return ffi::Error::Success();
}

// As the CUDA handler: the amax (while the stored scale is 0) first, in the amax result the
// first scale is read from.
ffi::Error QuantizeFp8DelayedGatedCpu(ffi::AnyBuffer x, ffi::AnyBuffer s, ffi::RemainingRets rets,
                                      bool rowwise, bool columnwise, int32_t margin) {
  Fp8TensorArgs a;
  JQ_RETURN_IF_ERROR(decode_fp8_delayed_gated(x, s, rets, rowwise, columnwise, margin, &a));
  const Matrix m = direction_matrix(a.x, false, false);
  *a.amax = *a.s == 0.f ? amax_of(m) : 0.f;
  quantize_matrix(m, a);
  return ffi::Error::Success();
}

// ------------------------------------ delayed-scaling update ---------------------------------

// state.delayed_scaling_update on each of a's states, in place where the buffers alias.
void update_states(const DelayedUpdateArgs& a, float fmax, int32_t margin, bool most_recent);

ffi::Error DelayedUpdateCpu(ffi::AnyBuffer history, ffi::AnyBuffer scale, ffi::AnyBuffer amax,
                            ffi::Result<ffi::AnyBuffer> new_history,
                            ffi::Result<ffi::AnyBuffer> new_scale, float fmax, int32_t margin,
                            bool most_recent) {
  DelayedUpdateArgs a;
  JQ_RETURN_IF_ERROR(decode_delayed_update(history, scale, amax, new_history, new_scale, fmax,
                                           margin, &a));
  update_states(a, fmax, margin, most_recent);
  return ffi::Error::Success();
}

// One tensor's quantize (after the gated amax, when `gated`) and its state's update, as the
// CUDA handler runs them.
ffi::Error QuantizeFp8DelayedUpdateCpu(ffi::AnyBuffer x, ffi::AnyBuffer s, ffi::AnyBuffer history,
                                       ffi::RemainingRets rets, bool rowwise, bool columnwise,
                                       int32_t margin, bool gated, bool most_recent, float fmax) {
  Fp8TensorArgs a;
  DelayedUpdateArgs u;
  JQ_RETURN_IF_ERROR(decode_fp8_delayed_update(x, s, history, rets, rowwise, columnwise, margin,
                                               gated, fmax, &a, &u));
  const Matrix m = direction_matrix(a.x, false, false);
  *a.amax = gated && *a.s == 0.f ? amax_of(m) : 0.f;
  quantize_matrix(m, a);
  update_states(u, fmax, margin, most_recent);
  return ffi::Error::Success();
}

// ------------------------------- delayed-scaling update: each state --------------------------

void update_states(const DelayedUpdateArgs& a, float fmax, int32_t margin, bool most_recent) {
  const int64_t L = a.length;
  for (int64_t b = 0; b < a.batch; ++b) {
    const float* h = a.history + b * L;
    float* out = a.new_history + b * L;
    const float am = a.amax[b];
    uint32_t m = jq::abs_bits(am);  // max |hist| with hist[0] = amax, NaN-propagating
    for (int64_t j = 1; j < L; ++j) m = std::max(m, jq::abs_bits(h[j]));
    a.new_scale[b] = jq::delayed_scale(most_recent ? am : float_of(m), fmax, margin, a.scale[b]);
    // in order, so that out may be h's buffer (the call aliases them): out[i] reads h[i + 1]
    for (int64_t i = 0; i < L; ++i) out[i] = i == 0 ? 0.0f : (i + 1 == L ? am : h[i + 1]);
  }
}

// -------------------------------------------- MXFP8 ------------------------------------------

ffi::Error QuantizeMxfp8Cpu(ffi::AnyBuffer x, ffi::RemainingRets rets, bool rowwise,
                            bool columnwise) {
  Mxfp8Args a;
  JQ_RETURN_IF_ERROR(decode_mxfp8(x, rets, rowwise, columnwise, &a));
  quantize_matrix(direction_matrix(a.x, false, false), a);
  return ffi::Error::Success();
}

// ------------------------------------------ Float8Block --------------------------------------

ffi::Error QuantizeFp8BlockCpu(ffi::AnyBuffer x, ffi::RemainingRets rets, bool rowwise,
                               bool columnwise, bool block_2d, bool pow2_scale,
                               float amax_epsilon) {
  Fp8BlockArgs a;
  JQ_RETURN_IF_ERROR(decode_fp8_block(x, rets, rowwise, columnwise, block_2d, pow2_scale,
                                      amax_epsilon, &a));
  quantize_matrix(direction_matrix(a.x, false, false), a);
  return ffi::Error::Success();
}

// --------------------------------------------- NVFP4 -----------------------------------------

ffi::Error QuantizeNvfp4Cpu(ffi::AnyBuffer x, ffi::AnyBuffer row_amax, ffi::AnyBuffer col_amax,
                            ffi::AnyBuffer row_key, ffi::AnyBuffer col_key,
                            ffi::RemainingRets rets, bool rowwise, bool columnwise,
                            bool row_scaled, bool block_2d, bool rht, bool stochastic) {
  Nvfp4Args a;
  JQ_RETURN_IF_ERROR(decode_nvfp4(x, row_amax, col_amax, row_key, col_key, rets, rowwise,
                                  columnwise, row_scaled, block_2d, rht, stochastic, &a));
  const int64_t block_rows = block_2d ? 16 : 1;
  if (rowwise) {
    nvfp4_matrix(direction_matrix(a.x, false, false), block_rows, row_scaled, a.row_amax,
                 stochastic ? a.row_key : nullptr, a.row_data, a.row_scale);
  }
  if (columnwise) {
    nvfp4_matrix(direction_matrix(a.x, true, rht), block_rows, row_scaled, a.col_amax,
                 stochastic ? a.col_key : nullptr, a.col_data, a.col_scale);
  }
  return ffi::Error::Success();
}

// ------------------------------------------- transpose ---------------------------------------

ffi::Error TransposeFp8Cpu(ffi::AnyBuffer in, ffi::Result<ffi::AnyBuffer> out) {
  TransposeArgs a;
  JQ_RETURN_IF_ERROR(decode_transpose(in, out, &a));
  for (int64_t r = 0; r < a.rows; ++r) {
    for (int64_t c = 0; c < a.cols; ++c) a.out[c * a.rows + r] = a.in[r * a.cols + c];
  }
  return ffi::Error::Success();
}

// -------------------------------------------- debug ------------------------------------------

// Copies the first N raw bytes of any buffer into u8[N] (N = the result's length): how tests
// read the storage of an FP4 array (XLA packs it; size_bytes() cannot say so).
ffi::Error RawBytesCpu(ffi::AnyBuffer in, ffi::Result<ffi::AnyBuffer> out) {
  if (out->element_type() != ffi::DataType::U8 || out->dimensions().size() != 1) {
    return invalid("jaxquant_debug_raw_bytes", "the result must be a 1-D uint8 array");
  }
  std::memcpy(out->untyped_data(), in.untyped_data(), out->element_count());
  return ffi::Error::Success();
}

// Counts inputs in [start, start + count * stride) (stride-spaced float32 bit patterns) where
// the fast encoders differ from the spec forms. On the host only E2M1 has a separate fast
// form; the CUDA handler checks the hardware FP8 conversions too.
ffi::Error EncoderMismatchesCpu(ffi::Result<ffi::AnyBuffer> out, int64_t start, int64_t count,
                                int64_t stride) {
  JQ_RETURN_IF_ERROR(expect("jaxquant_debug_encoder_mismatches", "the result", *out,
                            {ffi::DataType::U32}, {6}));
  uint32_t* r = static_cast<uint32_t*>(out->untyped_data());
  uint32_t counts[3] = {0, 0, 0}, first[3] = {0, 0, 0};
  for (int64_t i = 0; i < count; ++i) {
    const uint32_t b = uint32_t(start + i * stride);
    const float v = float_of(b);
    const bool bad[3] = {
        jq::encode_fp8(v, jq::Fp8::kE4M3) != jq::encode_spec(v, jq::e4m3()),
        jq::encode_fp8(v, jq::Fp8::kE5M2) != jq::encode_spec(v, jq::e5m2()),
        jq::encode_e2m1(v) != jq::encode_spec(v, jq::e2m1())};
    for (int k = 0; k < 3; ++k) {
      if (bad[k] && counts[k]++ == 0) first[k] = b;
    }
  }
  for (int k = 0; k < 3; ++k) { r[k] = counts[k]; r[3 + k] = first[k]; }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kAmaxCpu, AmaxCpu, BindAmax(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER(kAmaxGatedCpu, AmaxGatedCpu, BindAmaxGated(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER(kQuantizeFp8Cpu, QuantizeFp8Cpu, BindQuantizeFp8(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER(kQuantizeFp8DelayedCpu, QuantizeFp8DelayedCpu,
                       BindQuantizeFp8Delayed(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER(kQuantizeFp8DelayedGatedCpu, QuantizeFp8DelayedGatedCpu,
                       BindQuantizeFp8DelayedGated(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER(kQuantizeFp8DelayedUpdateCpu, QuantizeFp8DelayedUpdateCpu,
                       BindQuantizeFp8DelayedUpdate(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER(kDelayedUpdateCpu, DelayedUpdateCpu, BindDelayedUpdate(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER(kQuantizeMxfp8Cpu, QuantizeMxfp8Cpu, BindQuantizeMxfp8(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER(kQuantizeFp8BlockCpu, QuantizeFp8BlockCpu,
                       BindQuantizeFp8Block(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER(kQuantizeNvfp4Cpu, QuantizeNvfp4Cpu, BindQuantizeNvfp4(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER(kTransposeFp8Cpu, TransposeFp8Cpu, BindBufferToBuffer(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER(kRawBytesCpu, RawBytesCpu, BindBufferToBuffer(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER(kEncoderMismatchesCpu, EncoderMismatchesCpu,
                       BindEncoderMismatches(ffi::Ffi::Bind()));

std::vector<Target> quantize_cpu_targets() {
  return {target("jaxquant_amax", kAmaxCpu),
          target("jaxquant_amax_gated", kAmaxGatedCpu),
          target("jaxquant_quantize_fp8", kQuantizeFp8Cpu),
          target("jaxquant_quantize_fp8_delayed", kQuantizeFp8DelayedCpu),
          target("jaxquant_quantize_fp8_delayed_gated", kQuantizeFp8DelayedGatedCpu),
          target("jaxquant_quantize_fp8_delayed_update", kQuantizeFp8DelayedUpdateCpu),
          target("jaxquant_delayed_update", kDelayedUpdateCpu),
          target("jaxquant_quantize_mxfp8", kQuantizeMxfp8Cpu),
          target("jaxquant_quantize_fp8_block", kQuantizeFp8BlockCpu),
          target("jaxquant_quantize_nvfp4", kQuantizeNvfp4Cpu),
          target("jaxquant_transpose_fp8", kTransposeFp8Cpu),
          target("jaxquant_debug_raw_bytes", kRawBytesCpu),
          target("jaxquant_debug_encoder_mismatches", kEncoderMismatchesCpu)};
}

}  // namespace jqffi
