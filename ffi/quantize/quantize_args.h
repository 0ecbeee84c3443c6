// Argument decoding and FFI signatures of the quantize targets (host code only), shared by the
// CPU handlers (quantize_cpu.cc) and the CUDA handlers (quantize_cuda.cu), and by the fused and
// grouped targets, which quantize the same formats.
//
// Each target has one `decode_*` function here that checks the buffers XLA passes against the
// target's contract (ranks, dtypes, shapes) and fills a plain struct of pointers and sizes, and
// one `Bind*` template, its FFI signature for both platforms; the two handlers then differ only
// in how they execute that struct. Bad arguments give ffi::Error::InvalidArgument with a message
// naming the target, the buffer, what was passed and what is expected.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "binding.h"
#include "buffer_checks.h"
#include "jaxquant_numerics.h"

namespace jqffi {

enum class In : int { kBF16 = 0, kF16 = 1, kF32 = 2 };

struct Input {
  const void* data = nullptr;
  int64_t rows = 0, cols = 0;
  In type = In::kF32;
};

inline ffi::Error decode_input(const char* target, const ffi::AnyBuffer& x, Input* in) {
  auto dims = x.dimensions();
  if (dims.size() != 2) {
    return invalid(target, "x must be a 2-D [rows, cols] matrix (flatten leading axes); got "
                           "shape " + dims_str(dims));
  }
  switch (x.element_type()) {
    case ffi::DataType::BF16: in->type = In::kBF16; break;
    case ffi::DataType::F16: in->type = In::kF16; break;
    case ffi::DataType::F32: in->type = In::kF32; break;
    default:
      return invalid(target, std::string("x is ") + dtype_name(x.element_type()) +
                                 "; expected bfloat16, float16 or float32");
  }
  if (dims[0] <= 0 || dims[1] <= 0) {
    return invalid(target, "x is empty, shape " + dims_str(dims) + "; nothing to quantize");
  }
  if (dims[0] >= (int64_t{1} << 31) || dims[1] >= (int64_t{1} << 31)) {
    return invalid(target, "x has a dimension >= 2^31, shape " + dims_str(dims));
  }
  in->data = x.untyped_data();
  in->rows = dims[0];
  in->cols = dims[1];
  return ffi::Error::Success();
}

inline jq::Fp8 fp8_of(ffi::DataType t) {
  return t == ffi::DataType::F8E5M2 ? jq::Fp8::kE5M2 : jq::Fp8::kE4M3;
}

constexpr std::initializer_list<ffi::DataType> kFp8Types = {ffi::DataType::F8E4M3FN,
                                                           ffi::DataType::F8E5M2};

inline ffi::Error need_direction(const char* target, bool rowwise, bool columnwise) {
  if (!rowwise && !columnwise) return invalid(target, "rowwise and columnwise are both false");
  return ffi::Error::Success();
}

// The `rowwise` and `columnwise` attributes of a quantize target (at least one) into `a`.
template <typename Args>
ffi::Error set_directions(const char* t, bool rowwise, bool columnwise, Args* a) {
  JQ_RETURN_IF_ERROR(need_direction(t, rowwise, columnwise));
  a->rowwise = rowwise;
  a->columnwise = columnwise;
  return ffi::Error::Success();
}

// One direction's results: data [rows, cols] (one of `data_types`), then its scales of
// `scale_type`, one per `block_rows` x `block_cols` block: [ceil(rows / block_rows),
// ceil(cols / block_cols)]. `direction` is "rowwise" (x's shape) or "columnwise" (transposed).
template <typename Scale>
ffi::Error read_blocks(RetReader& r, const char* direction, int64_t rows, int64_t cols,
                       std::initializer_list<ffi::DataType> data_types, ffi::DataType scale_type,
                       int64_t block_rows, int64_t block_cols, uint8_t** data, Scale** scale,
                       ffi::DataType* data_type = nullptr) {
  const std::string name(direction);
  void* p;
  JQ_RETURN_IF_ERROR(r.next((name + " data").c_str(), data_types, {rows, cols}, &p, data_type));
  *data = static_cast<uint8_t*>(p);
  JQ_RETURN_IF_ERROR(r.next((name + " scale_inv").c_str(), {scale_type},
                            {ceil_div(rows, block_rows), ceil_div(cols, block_cols)}, &p));
  *scale = static_cast<Scale*>(p);
  return ffi::Error::Success();
}

// The FP8 format of a quantize target's data results (`rowwise`/`columnwise` set in `a`): the
// dtype of each requested direction, which must agree.
template <typename Args>
ffi::Error read_format(const char* t, const Args& a, ffi::DataType row_type,
                       ffi::DataType col_type, jq::Fp8* fmt) {
  if (a.rowwise && a.columnwise && row_type != col_type) {
    return invalid(t, "the rowwise and columnwise data dtypes differ");
  }
  *fmt = fp8_of(a.rowwise ? row_type : col_type);
  return ffi::Error::Success();
}

// A float32 scalar result named `what` (an amax or a scale_inv).
inline ffi::Error read_scalar(RetReader& r, const char* what, float** out) {
  void* p;
  JQ_RETURN_IF_ERROR(r.next(what, {ffi::DataType::F32}, {}, &p));
  *out = static_cast<float*>(p);
  return ffi::Error::Success();
}

// The results of a quantize target for the whole of x (`read_results`, overloaded on the
// format's arguments below), and no more.
template <typename Args>
ffi::Error read_all_results(const char* t, ffi::RemainingRets rets, Args* a) {
  RetReader r(t, rets);
  JQ_RETURN_IF_ERROR(read_results(t, r, a->x.rows, a->x.cols, a));
  return r.done();
}

// ---------------------------------------------------------------------------------------------
// jaxquant_amax(x) -> requested reductions, in bit order of `outputs`.
// ---------------------------------------------------------------------------------------------

enum AmaxOutput : int32_t {
  kAmaxTensor = 1,      // f32[]   max |x|
  kAmaxTensorRht = 2,   // f32[]   max |rht16(x.T)| (16-row chunks of each column)
  kAmaxRows = 4,        // f32[R]  max |x[r, :]|
  kAmaxCols = 8,        // f32[C]  max |x[:, c]|
  kAmaxColsRht = 16,    // f32[C]  max |rht16(x.T)[c, :]|
};

struct AmaxArgs {
  Input x;
  float* tensor = nullptr;
  float* tensor_rht = nullptr;
  float* rows = nullptr;
  float* cols = nullptr;
  float* cols_rht = nullptr;
};

inline ffi::Error decode_amax(ffi::AnyBuffer x, ffi::RemainingRets rets, int32_t outputs,
                              AmaxArgs* a) {
  const char* t = "jaxquant_amax";
  JQ_RETURN_IF_ERROR(decode_input(t, x, &a->x));
  if (outputs <= 0 || outputs >= 32) {
    return invalid(t, "outputs=" + std::to_string(outputs) + " must be a non-empty bit set of "
                      "1 (tensor), 2 (tensor, RHT), 4 (rows), 8 (cols), 16 (cols, RHT)");
  }
  const bool rht = outputs & (kAmaxTensorRht | kAmaxColsRht);
  if (rht && a->x.rows % 16) {
    return invalid(t, "the RHT amax needs a row count that is a multiple of 16; got " +
                          std::to_string(a->x.rows));
  }
  RetReader r(t, rets);
  const auto f32 = {ffi::DataType::F32};
  void* p;
  if (outputs & kAmaxTensor) JQ_RETURN_IF_ERROR(read_scalar(r, "amax", &a->tensor));
  if (outputs & kAmaxTensorRht) JQ_RETURN_IF_ERROR(read_scalar(r, "amax_rht", &a->tensor_rht));
  if (outputs & kAmaxRows) { JQ_RETURN_IF_ERROR(r.next("row_amax", f32, {a->x.rows}, &p)); a->rows = (float*)p; }
  if (outputs & kAmaxCols) { JQ_RETURN_IF_ERROR(r.next("col_amax", f32, {a->x.cols}, &p)); a->cols = (float*)p; }
  if (outputs & kAmaxColsRht) { JQ_RETURN_IF_ERROR(r.next("col_amax_rht", f32, {a->x.cols}, &p)); a->cols_rht = (float*)p; }
  return r.done();
}

// jaxquant_amax_gated(x, gate) -> the same outputs, computed only when the float32 scalar `gate`
// is 0 (a delayed-scaling state with no scale yet); otherwise every output is 0.
inline ffi::Error decode_gate(ffi::AnyBuffer gate, const float** g) {
  if (gate.element_type() != ffi::DataType::F32 || gate.element_count() != 1) {
    return invalid("jaxquant_amax_gated", "gate must be one float32 value");
  }
  *g = static_cast<const float*>(gate.untyped_data());
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// jaxquant_quantize_fp8(x, s) -> [row_data], [col_data], scale_inv, [amax]
//   current scaling (delayed=false): s is the tensor amax; delayed: s is the stored scale and the
//   kernel also returns amax(x).
// ---------------------------------------------------------------------------------------------

struct Fp8TensorArgs {
  Input x;
  bool rowwise = false, columnwise = false, delayed = false, pow2_scale = false;
  float amax_epsilon = 0.0f;
  jq::Fp8 fmt = jq::Fp8::kE4M3;
  const float* s = nullptr;  // amax (current) or scale (delayed), device pointer on GPU
  uint8_t* row_data = nullptr;
  uint8_t* col_data = nullptr;
  float* scale_inv = nullptr;
  float* amax = nullptr;  // delayed only
  const float* first_amax = nullptr;  // jaxquant_quantize_fp8_delayed: the just-in-time scale's
  int32_t margin = 0;
};

// The attributes and the operand s of jaxquant_quantize_fp8 into `a`; shared with the fused
// target (ffi/fused), whose values come from a producer instead of x.
inline ffi::Error set_fp8_tensor_attrs(const char* t, ffi::AnyBuffer s, bool rowwise,
                                       bool columnwise, bool delayed, bool pow2_scale,
                                       float amax_epsilon, Fp8TensorArgs* a) {
  JQ_RETURN_IF_ERROR(set_directions(t, rowwise, columnwise, a));
  JQ_RETURN_IF_ERROR(expect(t, delayed ? "scale" : "amax", s, {ffi::DataType::F32}, {}));
  a->delayed = delayed;
  a->pow2_scale = pow2_scale;
  a->amax_epsilon = amax_epsilon;
  a->s = static_cast<const float*>(s.untyped_data());
  return ffi::Error::Success();
}

// The results of jaxquant_quantize_fp8 for an R x C matrix (attributes already set in `a`),
// read from `r` in order; shared with the fused target, which reads more around them.
inline ffi::Error read_results(const char* t, RetReader& r, int64_t R, int64_t C,
                               Fp8TensorArgs* a) {
  void* p;
  ffi::DataType row_type = ffi::DataType::INVALID, col_type = ffi::DataType::INVALID;
  if (a->rowwise) {
    JQ_RETURN_IF_ERROR(r.next("rowwise data", kFp8Types, {R, C}, &p, &row_type));
    a->row_data = static_cast<uint8_t*>(p);
  }
  if (a->columnwise) {
    JQ_RETURN_IF_ERROR(r.next("columnwise data", kFp8Types, {C, R}, &p, &col_type));
    a->col_data = static_cast<uint8_t*>(p);
  }
  JQ_RETURN_IF_ERROR(read_format(t, *a, row_type, col_type, &a->fmt));
  JQ_RETURN_IF_ERROR(read_scalar(r, "scale_inv", &a->scale_inv));
  if (a->delayed) JQ_RETURN_IF_ERROR(read_scalar(r, "amax", &a->amax));
  return ffi::Error::Success();
}

inline ffi::Error decode_fp8_tensor(ffi::AnyBuffer x, ffi::AnyBuffer s, ffi::RemainingRets rets,
                                    bool rowwise, bool columnwise, bool delayed, bool pow2_scale,
                                    float amax_epsilon, Fp8TensorArgs* a,
                                    const char* t = "jaxquant_quantize_fp8") {
  JQ_RETURN_IF_ERROR(decode_input(t, x, &a->x));
  JQ_RETURN_IF_ERROR(
      set_fp8_tensor_attrs(t, s, rowwise, columnwise, delayed, pow2_scale, amax_epsilon, a));
  return read_all_results(t, rets, a);
}

// ---------------------------------------------------------------------------------------------
// jaxquant_quantize_fp8_delayed(x, scale, first_amax) -> [row_data], [col_data], scale_inv, amax
//   delayed scaling with the just-in-time first scale: where the stored scale is 0 ("none yet")
//   the kernel quantizes with `delayed_scale(first_amax, fmax, margin, 1)` (first_amax from the
//   gated amax pass), so no scale arithmetic runs in XLA before it.
// ---------------------------------------------------------------------------------------------

inline ffi::Error decode_fp8_delayed(ffi::AnyBuffer x, ffi::AnyBuffer s, ffi::AnyBuffer first_amax,
                                     ffi::RemainingRets rets, bool rowwise, bool columnwise,
                                     int32_t margin, Fp8TensorArgs* a) {
  const char* t = "jaxquant_quantize_fp8_delayed";
  JQ_RETURN_IF_ERROR(decode_fp8_tensor(x, s, rets, rowwise, columnwise, true, false, 0.0f, a, t));
  JQ_RETURN_IF_ERROR(expect(t, "first_amax", first_amax, {ffi::DataType::F32}, {}));
  if (margin < 0) return invalid(t, "margin must be >= 0; got " + std::to_string(margin));
  a->first_amax = static_cast<const float*>(first_amax.untyped_data());
  a->margin = margin;
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// jaxquant_quantize_fp8_delayed_gated(x, scale) -> [row_data], [col_data], scale_inv, amax
//   jaxquant_quantize_fp8_delayed with its gated amax pass inside the call: where the stored
//   scale is 0 the call first reduces amax(x) into its own amax result and the kernel takes the
//   first scale from it (the kernel's own atomicMax of the same values leaves it unchanged);
//   elsewhere the pass exits at once. One command a tensor instead of two (a loss-fetching step's
//   host time follows the command count); partitioned programs whose x is sharded take the
//   two-call form, with a pmax of the shards' amax between (jaxquant/backends/ffi/partitioning.py).
// ---------------------------------------------------------------------------------------------

inline ffi::Error decode_fp8_delayed_gated(ffi::AnyBuffer x, ffi::AnyBuffer s,
                                           ffi::RemainingRets rets, bool rowwise,
                                           bool columnwise, int32_t margin, Fp8TensorArgs* a) {
  const char* t = "jaxquant_quantize_fp8_delayed_gated";
  JQ_RETURN_IF_ERROR(decode_fp8_tensor(x, s, rets, rowwise, columnwise, true, false, 0.0f, a, t));
  if (margin < 0) return invalid(t, "margin must be >= 0; got " + std::to_string(margin));
  a->first_amax = a->amax;
  a->margin = margin;
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// jaxquant_delayed_update(history [..., L], scale [...], amax [...]) -> history', scale'
//   state.delayed_scaling_update for a batch of states: hist[0] = amax; a = max(hist) (or amax
//   when most_recent); scale' = delayed_scale(a, fmax, margin, scale); history' = hist rolled by
//   -1 with its first entry zeroed.
// ---------------------------------------------------------------------------------------------

struct DelayedUpdateArgs {
  int64_t batch = 0, length = 0;
  const float *history = nullptr, *scale = nullptr, *amax = nullptr;
  float *new_history = nullptr, *new_scale = nullptr;
};

inline ffi::Error decode_delayed_update(ffi::AnyBuffer history, ffi::AnyBuffer scale,
                                        ffi::AnyBuffer amax, ffi::Result<ffi::AnyBuffer> new_history,
                                        ffi::Result<ffi::AnyBuffer> new_scale, float fmax,
                                        int32_t margin, DelayedUpdateArgs* a) {
  const char* t = "jaxquant_delayed_update";
  auto dims = history.dimensions();
  if (dims.size() < 1 || history.element_type() != ffi::DataType::F32 || dims.back() < 1) {
    return invalid(t, std::string("history is ") + dtype_name(history.element_type()) +
                          dims_str(dims) + "; expected float32 [..., L] with L >= 1");
  }
  if (!(fmax > 0.0f)) return invalid(t, "fmax must be > 0");
  if (margin < 0) return invalid(t, "margin must be >= 0; got " + std::to_string(margin));
  int64_t batch = 1;
  for (size_t i = 0; i + 1 < dims.size(); ++i) batch *= dims[i];
  for (auto [what, buf] : {std::pair<const char*, const ffi::AnyBuffer*>{"scale", &scale},
                           {"amax", &amax}, {"the new scale", &*new_scale}}) {
    auto got = buf->dimensions();
    bool ok = buf->element_type() == ffi::DataType::F32 && got.size() + 1 == dims.size();
    for (size_t i = 0; ok && i < got.size(); ++i) ok = got[i] == dims[i];
    if (!ok) {
      return invalid(t, std::string(what) + " is " + dtype_name(buf->element_type()) +
                            dims_str(got) + "; expected float32 of the history's leading shape " +
                            dims_str(dims.first(dims.size() - 1)));
    }
  }
  auto out = new_history->dimensions();
  if (new_history->element_type() != ffi::DataType::F32 || !(out == dims)) {
    return invalid(t, "the new history must be float32 of the history's shape " + dims_str(dims));
  }
  a->batch = batch;
  a->length = dims.back();
  a->history = static_cast<const float*>(history.untyped_data());
  a->scale = static_cast<const float*>(scale.untyped_data());
  a->amax = static_cast<const float*>(amax.untyped_data());
  a->new_history = static_cast<float*>(new_history->untyped_data());
  a->new_scale = static_cast<float*>(new_scale->untyped_data());
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// jaxquant_quantize_fp8_delayed_update(x, scale, history) -> [row_data], [col_data], scale_inv,
//   amax, history', scale'
//   A delayed-scaling tensor's quantize (with the gated amax pass first when `gated`:
//   jaxquant_quantize_fp8_delayed_gated) and its state's update (jaxquant_delayed_update) in
//   one call: one command a tensor and step instead of two (design decision 36). history' and
//   scale' alias history and scale (the update runs after the tile kernel, which read the
//   scale). Unsharded x only: a sharded x's amax is reduced between the two
//   (jaxquant/backends/ffi/partitioning.py, Layout.sharded).
// ---------------------------------------------------------------------------------------------

inline ffi::Error decode_fp8_delayed_update(ffi::AnyBuffer x, ffi::AnyBuffer s,
                                            ffi::AnyBuffer history, ffi::RemainingRets rets,
                                            bool rowwise, bool columnwise, int32_t margin,
                                            bool gated, float fmax, Fp8TensorArgs* a,
                                            DelayedUpdateArgs* u) {
  const char* t = "jaxquant_quantize_fp8_delayed_update";
  JQ_RETURN_IF_ERROR(decode_input(t, x, &a->x));
  JQ_RETURN_IF_ERROR(set_fp8_tensor_attrs(t, s, rowwise, columnwise, true, false, 0.0f, a));
  if (margin < 0) return invalid(t, "margin must be >= 0; got " + std::to_string(margin));
  if (!(fmax > 0.0f)) return invalid(t, "fmax must be > 0");
  auto dims = history.dimensions();
  if (dims.size() != 1 || history.element_type() != ffi::DataType::F32 || dims[0] < 1) {
    return invalid(t, std::string("history is ") + dtype_name(history.element_type()) +
                          dims_str(dims) + "; expected float32 [L] with L >= 1");
  }
  RetReader r(t, rets);
  JQ_RETURN_IF_ERROR(read_results(t, r, a->x.rows, a->x.cols, a));
  void* p;
  JQ_RETURN_IF_ERROR(r.next("the new history", {ffi::DataType::F32}, {dims[0]}, &p));
  u->new_history = static_cast<float*>(p);
  float* new_scale;
  JQ_RETURN_IF_ERROR(read_scalar(r, "the new scale", &new_scale));
  JQ_RETURN_IF_ERROR(r.done());
  a->first_amax = gated ? a->amax : nullptr;
  a->margin = margin;
  u->batch = 1;
  u->length = dims[0];
  u->history = static_cast<const float*>(history.untyped_data());
  u->scale = a->s;
  u->amax = a->amax;
  u->new_scale = new_scale;
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// jaxquant_quantize_mxfp8(x) -> [row_data, row_scale], [col_data, col_scale], amax
// ---------------------------------------------------------------------------------------------

struct Mxfp8Args {
  Input x;
  bool rowwise = false, columnwise = false;
  // The grouped target's `raw`: bfloat16 data results holding the codes' raw values (code x
  // block scale), the payload format then given by `raw_e5m2` rather than the data dtype.
  bool raw = false;
  // The grouped target's `col_in_x_layout`: raw expert weights' columnwise copy [G, E, C] with
  // scales [G, E / 32, C] (the weights' own layout) instead of [G, C, E] and [G, C, E / 32].
  bool col_in_x_layout = false;
  // The grouped target's `row_flags` (with col_in_x_layout): the rowwise data result is the
  // flags of the row blocks whose rowwise values differ from the columnwise copy's
  // (quantize/mxfp8_x_layout.cuh, design decision 56), not the values.
  bool rows_as_flags = false;
  jq::Fp8 fmt = jq::Fp8::kE4M3;
  uint8_t *row_data = nullptr, *row_scale = nullptr, *col_data = nullptr, *col_scale = nullptr;
  uint8_t* row_flags = nullptr;
  float* amax = nullptr;
};

// The results of jaxquant_quantize_mxfp8 for an R x C matrix (directions set in `a`): E8M0
// scales of 1x32 blocks. `row_R` >= 0: the rowwise copy's rows instead of R (a grouped call's
// packed rowwise copy beside its padded columnwise one).
constexpr std::initializer_list<ffi::DataType> kBf16Type = {ffi::DataType::BF16};

// The dtypes a quantize target's data results may have: FP8 codes, or bfloat16 for MXFP8's raw
// copies.
template <typename Args>
std::initializer_list<ffi::DataType> data_types(const Args&) { return kFp8Types; }
inline std::initializer_list<ffi::DataType> data_types(const Mxfp8Args& a) {
  return a.raw ? kBf16Type : kFp8Types;
}

// The payload format: from the data dtypes (`read_format`), or for raw copies the attribute's,
// already in `a->fmt`.
template <typename Args>
ffi::Error read_payload_format(const char* t, Args* a, ffi::DataType row_type,
                               ffi::DataType col_type) {
  return read_format(t, *a, row_type, col_type, &a->fmt);
}
inline ffi::Error read_payload_format(const char* t, Mxfp8Args* a, ffi::DataType row_type,
                                      ffi::DataType col_type) {
  return a->raw ? ffi::Error::Success() : read_format(t, *a, row_type, col_type, &a->fmt);
}

inline ffi::Error read_results(const char* t, RetReader& r, int64_t R, int64_t C, Mxfp8Args* a,
                               int64_t row_R = -1) {
  const auto e8m0 = ffi::DataType::F8E8M0FNU;
  ffi::DataType row_type = ffi::DataType::INVALID, col_type = ffi::DataType::INVALID;
  if (a->rowwise) {
    JQ_RETURN_IF_ERROR(read_blocks(r, "rowwise", row_R >= 0 ? row_R : R, C, data_types(*a), e8m0,
                                   1, 32, &a->row_data, &a->row_scale, &row_type));
  }
  if (a->columnwise) {
    JQ_RETURN_IF_ERROR(read_blocks(r, "columnwise", C, R, data_types(*a), e8m0, 1, 32,
                                   &a->col_data, &a->col_scale, &col_type));
  }
  JQ_RETURN_IF_ERROR(read_payload_format(t, a, row_type, col_type));
  return read_scalar(r, "amax", &a->amax);
}

inline ffi::Error decode_mxfp8(ffi::AnyBuffer x, ffi::RemainingRets rets, bool rowwise,
                               bool columnwise, Mxfp8Args* a) {
  const char* t = "jaxquant_quantize_mxfp8";
  JQ_RETURN_IF_ERROR(decode_input(t, x, &a->x));
  JQ_RETURN_IF_ERROR(set_directions(t, rowwise, columnwise, a));
  return read_all_results(t, rets, a);
}

// ---------------------------------------------------------------------------------------------
// jaxquant_quantize_fp8_block(x) -> [row_data, row_scale], [col_data, col_scale], amax
//   1x128 blocks: scales [R, ceil(C/128)] and [C, ceil(R/128)];
//   128x128 tiles (block_2d): [ceil(R/128), ceil(C/128)] and [ceil(C/128), ceil(R/128)].
// ---------------------------------------------------------------------------------------------

struct Fp8BlockArgs {
  Input x;
  bool rowwise = false, columnwise = false, block_2d = false, pow2_scale = true;
  float amax_epsilon = 0.0f;
  jq::Fp8 fmt = jq::Fp8::kE4M3;
  uint8_t *row_data = nullptr, *col_data = nullptr;
  float *row_scale = nullptr, *col_scale = nullptr, *amax = nullptr;
};

// The attributes of jaxquant_quantize_fp8_block into `a`; shared with the fused target.
inline ffi::Error set_fp8_block_attrs(const char* t, bool rowwise, bool columnwise, bool block_2d,
                                      bool pow2_scale, float amax_epsilon, Fp8BlockArgs* a) {
  JQ_RETURN_IF_ERROR(set_directions(t, rowwise, columnwise, a));
  a->block_2d = block_2d;
  a->pow2_scale = pow2_scale;
  a->amax_epsilon = amax_epsilon;
  return ffi::Error::Success();
}

// The results of jaxquant_quantize_fp8_block for an R x C matrix (attributes set in `a`;
// `row_R` as for MXFP8).
inline ffi::Error read_results(const char* t, RetReader& r, int64_t R, int64_t C,
                               Fp8BlockArgs* a, int64_t row_R = -1) {
  const auto f32 = ffi::DataType::F32;
  const int64_t block_rows = a->block_2d ? 128 : 1;
  ffi::DataType row_type = ffi::DataType::INVALID, col_type = ffi::DataType::INVALID;
  if (a->rowwise) {
    JQ_RETURN_IF_ERROR(read_blocks(r, "rowwise", row_R >= 0 ? row_R : R, C, kFp8Types, f32,
                                   block_rows, 128, &a->row_data, &a->row_scale, &row_type));
  }
  if (a->columnwise) {
    JQ_RETURN_IF_ERROR(read_blocks(r, "columnwise", C, R, kFp8Types, f32, block_rows, 128,
                                   &a->col_data, &a->col_scale, &col_type));
  }
  JQ_RETURN_IF_ERROR(read_format(t, *a, row_type, col_type, &a->fmt));
  return read_scalar(r, "amax", &a->amax);
}

inline ffi::Error decode_fp8_block(ffi::AnyBuffer x, ffi::RemainingRets rets, bool rowwise,
                                   bool columnwise, bool block_2d, bool pow2_scale,
                                   float amax_epsilon, Fp8BlockArgs* a) {
  const char* t = "jaxquant_quantize_fp8_block";
  JQ_RETURN_IF_ERROR(decode_input(t, x, &a->x));
  JQ_RETURN_IF_ERROR(
      set_fp8_block_attrs(t, rowwise, columnwise, block_2d, pow2_scale, amax_epsilon, a));
  return read_all_results(t, rets, a);
}

// ---------------------------------------------------------------------------------------------
// jaxquant_quantize_nvfp4(x, row_amax, col_amax, row_key, col_key)
//   -> [row_data f4[R, C], row_scale], [col_data f4[C, R], col_scale]
//   FP4 data is XLA's packed layout: two codes a byte, first element in the low nibble, rows
//   contiguous in nibbles (a row of odd length ends mid-byte). Scales are E4M3:
//   [R, ceil(C/16)] (1-D) or [ceil(R/16), ceil(C/16)] (block_2d), and likewise transposed.
//   row_amax: f32[] or f32[R] (row_scaled); col_amax: f32[] or f32[C] (row_scaled; post-RHT).
// ---------------------------------------------------------------------------------------------

struct Nvfp4Args {
  Input x;
  bool rowwise = false, columnwise = false, row_scaled = false, block_2d = false, rht = false,
       stochastic = false;
  const float* row_amax = nullptr;
  const float* col_amax = nullptr;
  const uint32_t* row_key = nullptr;
  const uint32_t* col_key = nullptr;
  uint8_t *row_data = nullptr, *row_scale = nullptr, *col_data = nullptr, *col_scale = nullptr;
};

inline ffi::Error decode_nvfp4(ffi::AnyBuffer x, ffi::AnyBuffer row_amax, ffi::AnyBuffer col_amax,
                               ffi::AnyBuffer row_key, ffi::AnyBuffer col_key,
                               ffi::RemainingRets rets, bool rowwise, bool columnwise,
                               bool row_scaled, bool block_2d, bool rht, bool stochastic,
                               Nvfp4Args* a) {
  const char* t = "jaxquant_quantize_nvfp4";
  JQ_RETURN_IF_ERROR(decode_input(t, x, &a->x));
  JQ_RETURN_IF_ERROR(need_direction(t, rowwise, columnwise));
  if (row_scaled && block_2d) return invalid(t, "row_scaled and block_2d cannot be combined");
  if (rht && block_2d) return invalid(t, "rht and block_2d cannot be combined");
  const int64_t R = a->x.rows, C = a->x.cols;
  if (columnwise && rht && R % 16) {
    return invalid(t, "rht transforms the columnwise copy in chunks of 16 rows of x; got " +
                          std::to_string(R) + " rows (use a multiple of 16)");
  }
  a->rowwise = rowwise; a->columnwise = columnwise; a->row_scaled = row_scaled;
  a->block_2d = block_2d; a->rht = rht; a->stochastic = stochastic;
  const auto f32 = {ffi::DataType::F32};
  const auto u32 = {ffi::DataType::U32};
  // An amax whose direction is not requested is a placeholder f32[].
  if (row_scaled && rowwise) {
    JQ_RETURN_IF_ERROR(expect(t, "row_amax", row_amax, f32, {R}));
  } else {
    JQ_RETURN_IF_ERROR(expect(t, "row_amax", row_amax, f32, {}));
  }
  if (row_scaled && columnwise) {
    JQ_RETURN_IF_ERROR(expect(t, "col_amax", col_amax, f32, {C}));
  } else {
    JQ_RETURN_IF_ERROR(expect(t, "col_amax", col_amax, f32, {}));
  }
  JQ_RETURN_IF_ERROR(expect(t, "row_key", row_key, u32, {2}));
  JQ_RETURN_IF_ERROR(expect(t, "col_key", col_key, u32, {2}));
  a->row_amax = (const float*)row_amax.untyped_data();
  a->col_amax = (const float*)col_amax.untyped_data();
  a->row_key = (const uint32_t*)row_key.untyped_data();
  a->col_key = (const uint32_t*)col_key.untyped_data();
  const auto f4 = {ffi::DataType::F4E2M1FN};
  const auto e4m3 = ffi::DataType::F8E4M3FN;
  const int64_t block_rows = block_2d ? 16 : 1;
  RetReader r(t, rets);
  if (rowwise) {
    JQ_RETURN_IF_ERROR(
        read_blocks(r, "rowwise", R, C, f4, e4m3, block_rows, 16, &a->row_data, &a->row_scale));
  }
  if (columnwise) {
    JQ_RETURN_IF_ERROR(read_blocks(r, "columnwise", C, R, f4, e4m3, block_rows, 16, &a->col_data,
                                   &a->col_scale));
  }
  return r.done();
}

// ---------------------------------------------------------------------------------------------
// jaxquant_transpose_fp8(data f8[R, C]) -> f8[C, R] (same dtype): bytes transposed.
// ---------------------------------------------------------------------------------------------

struct TransposeArgs {
  const uint8_t* in = nullptr;
  uint8_t* out = nullptr;
  int64_t rows = 0, cols = 0;
};

inline ffi::Error decode_transpose(ffi::AnyBuffer in, ffi::Result<ffi::AnyBuffer> out,
                                   TransposeArgs* a) {
  const char* t = "jaxquant_transpose_fp8";
  auto dims = in.dimensions();
  if (dims.size() != 2 || (in.element_type() != ffi::DataType::F8E4M3FN &&
                           in.element_type() != ffi::DataType::F8E5M2)) {
    return invalid(t, std::string("data is ") + dtype_name(in.element_type()) + dims_str(dims) +
                          "; expected a 2-D float8_e4m3fn or float8_e5m2 matrix");
  }
  if (dims[0] <= 0 || dims[1] <= 0) return invalid(t, "data is empty");
  JQ_RETURN_IF_ERROR(expect(t, "the result", *out, {in.element_type()}, {dims[1], dims[0]}));
  a->in = (const uint8_t*)in.untyped_data();
  a->out = (uint8_t*)out->untyped_data();
  a->rows = dims[0];
  a->cols = dims[1];
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// The FFI signatures, one copy for both platforms: the CPU handlers bind
// `BindX(ffi::Ffi::Bind())`, the CUDA ones `BindX(ffi::Ffi::Bind().Ctx<Stream>())`
// (binding.h). Results read by a RetReader are `RemainingRets`.
// ---------------------------------------------------------------------------------------------

// jaxquant_amax: x -> the reductions `outputs` selects.
template <typename Binding>
auto BindAmax(Binding binding) {
  return Attrs<int32_t>(Args<1>(std::move(binding)).RemainingRets(), "outputs");
}

// jaxquant_amax_gated: x, gate -> as jaxquant_amax.
template <typename Binding>
auto BindAmaxGated(Binding binding) {
  return Attrs<int32_t>(Args<2>(std::move(binding)).RemainingRets(), "outputs");
}

// `binding` followed by the scale attributes of the current-scaling formats.
template <typename Binding>
auto ScaleAttrs(Binding&& binding) {
  return Attrs<float>(Attrs<bool>(std::move(binding), "pow2_scale"), "amax_epsilon");
}

// `binding` followed by the attributes of jaxquant_quantize_fp8, _mxfp8 and _fp8_block (the fused
// targets take the same after their own).
template <typename Binding>
auto Fp8TensorAttrs(Binding&& binding) {
  return ScaleAttrs(Attrs<bool>(std::move(binding), "rowwise", "columnwise", "delayed"));
}

template <typename Binding>
auto Mxfp8Attrs(Binding&& binding) {
  return Attrs<bool>(std::move(binding), "rowwise", "columnwise");
}

template <typename Binding>
auto Fp8BlockAttrs(Binding&& binding) {
  return ScaleAttrs(Attrs<bool>(std::move(binding), "rowwise", "columnwise", "block_2d"));
}

// jaxquant_quantize_fp8: x, s -> [row data], [col data], scale_inv, [amax].
template <typename Binding>
auto BindQuantizeFp8(Binding binding) {
  return Fp8TensorAttrs(Args<2>(std::move(binding)).RemainingRets());
}

// jaxquant_quantize_fp8_delayed: x, scale, first_amax -> as jaxquant_quantize_fp8 delayed.
template <typename Binding>
auto BindQuantizeFp8Delayed(Binding binding) {
  auto flags = Attrs<bool>(Args<3>(std::move(binding)).RemainingRets(), "rowwise", "columnwise");
  return Attrs<int32_t>(std::move(flags), "margin");
}

// jaxquant_quantize_fp8_delayed_gated: x, scale -> as jaxquant_quantize_fp8_delayed.
template <typename Binding>
auto BindQuantizeFp8DelayedGated(Binding binding) {
  auto flags = Attrs<bool>(Args<2>(std::move(binding)).RemainingRets(), "rowwise", "columnwise");
  return Attrs<int32_t>(std::move(flags), "margin");
}

// jaxquant_quantize_fp8_delayed_update: x, scale, history -> as the two it runs.
template <typename Binding>
auto BindQuantizeFp8DelayedUpdate(Binding binding) {
  auto flags = Attrs<bool>(Args<3>(std::move(binding)).RemainingRets(), "rowwise", "columnwise");
  auto ints = Attrs<int32_t>(std::move(flags), "margin");
  return Attrs<float>(Attrs<bool>(Attrs<bool>(std::move(ints), "gated"), "most_recent"), "fmax");
}

// jaxquant_delayed_update: history, scale, amax -> history', scale'.
template <typename Binding>
auto BindDelayedUpdate(Binding binding) {
  auto fmax = Attrs<float>(Rets<2>(Args<3>(std::move(binding))), "fmax");
  return Attrs<bool>(Attrs<int32_t>(std::move(fmax), "margin"), "most_recent");
}

// jaxquant_quantize_mxfp8: x -> [row data, scales], [col data, scales], amax.
template <typename Binding>
auto BindQuantizeMxfp8(Binding binding) {
  return Mxfp8Attrs(Args<1>(std::move(binding)).RemainingRets());
}

// jaxquant_quantize_fp8_block: x -> [row data, scales], [col data, scales], amax.
template <typename Binding>
auto BindQuantizeFp8Block(Binding binding) {
  return Fp8BlockAttrs(Args<1>(std::move(binding)).RemainingRets());
}

// jaxquant_quantize_nvfp4: x, row_amax, col_amax, row_key, col_key -> [row data, scales],
// [col data, scales].
template <typename Binding>
auto BindQuantizeNvfp4(Binding binding) {
  return Attrs<bool>(Args<5>(std::move(binding)).RemainingRets(), "rowwise", "columnwise",
                     "row_scaled", "block_2d", "rht", "stochastic");
}

// jaxquant_transpose_fp8 (data -> its transpose) and jaxquant_debug_raw_bytes (any buffer ->
// its first bytes): one buffer in, one out.
template <typename Binding>
auto BindBufferToBuffer(Binding binding) {
  return Rets<1>(Args<1>(std::move(binding)));
}

// jaxquant_debug_encoder_mismatches: -> u32[6] counts for the float32 bits `start + i * stride`.
template <typename Binding>
auto BindEncoderMismatches(Binding binding) {
  return Attrs<int64_t>(Rets<1>(std::move(binding)), "start", "count", "stride");
}

}  // namespace jqffi
