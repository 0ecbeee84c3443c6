// Argument decoding and checking shared by the CPU and CUDA handlers (host code only).
//
// Each FFI target has one `decode_*` function here that checks the buffers XLA passes against
// the target's contract (ranks, dtypes, shapes) and fills a plain struct of pointers and sizes;
// each family's CPU handler (e.g. quantize/quantize_cpu.cc) and CUDA handler (quantize_cuda.cu)
// then differ only in how they execute that struct. Bad arguments give ffi::Error::InvalidArgument with a message
// naming the target, the buffer, what was passed and what is expected.
#pragma once

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <sstream>
#include <string>
#include <vector>

#include "jaxquant_numerics.h"
#include "xla/ffi/api/ffi.h"

namespace jqffi {

namespace ffi = xla::ffi;

enum class In : int { kBF16 = 0, kF16 = 1, kF32 = 2 };

struct Input {
  const void* data = nullptr;
  int64_t rows = 0, cols = 0;
  In type = In::kF32;
};

inline const char* dtype_name(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::U32: return "uint32";
    case ffi::DataType::F8E4M3FN: return "float8_e4m3fn";
    case ffi::DataType::F8E5M2: return "float8_e5m2";
    case ffi::DataType::F8E8M0FNU: return "float8_e8m0fnu";
    case ffi::DataType::F4E2M1FN: return "float4_e2m1fn";
    default: return "another dtype";
  }
}

inline std::string dims_str(ffi::Span<const int64_t> dims) {
  std::ostringstream s;
  s << "(";
  for (size_t i = 0; i < dims.size(); ++i) s << (i ? ", " : "") << dims[i];
  s << (dims.size() == 1 ? ",)" : ")");
  return s.str();
}

inline std::string dims_str(std::initializer_list<int64_t> dims) {
  std::vector<int64_t> v(dims);
  return dims_str(ffi::Span<const int64_t>(v.data(), v.size()));
}

inline ffi::Error invalid(const char* target, const std::string& msg) {
  return ffi::Error::InvalidArgument(std::string(target) + ": " + msg);
}

// Checks `buf` has one of `types` and exactly `dims`.
inline ffi::Error expect(const char* target, const char* what, const ffi::AnyBuffer& buf,
                         std::initializer_list<ffi::DataType> types,
                         std::initializer_list<int64_t> dims) {
  bool type_ok = false;
  std::string allowed;
  for (ffi::DataType t : types) {
    type_ok |= buf.element_type() == t;
    allowed += (allowed.empty() ? "" : " or ") + std::string(dtype_name(t));
  }
  auto got = buf.dimensions();
  bool dims_ok = got.size() == dims.size();
  if (dims_ok) {
    size_t i = 0;
    for (int64_t d : dims) dims_ok &= got[i++] == d;
  }
  if (!type_ok || !dims_ok) {
    return invalid(target, std::string(what) + " is " + dtype_name(buf.element_type()) +
                               dims_str(got) + "; expected " + allowed + dims_str(dims));
  }
  return ffi::Error::Success();
}

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

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Walks the variadic results in order, checking each against its expected dtype and shape.
class RetReader {
 public:
  RetReader(const char* target, ffi::RemainingRets rets) : target_(target), rets_(rets) {}

  ffi::Error next(const char* what, std::initializer_list<ffi::DataType> types,
                  std::initializer_list<int64_t> dims, void** data,
                  ffi::DataType* type = nullptr) {
    if (index_ >= rets_.size()) {
      return invalid(target_, std::string("missing result '") + what + "' (got " +
                                  std::to_string(rets_.size()) + " results)");
    }
    auto ret = rets_.get<ffi::AnyBuffer>(index_++);
    if (ret.has_error()) return invalid(target_, std::string("result '") + what + "' is not a buffer");
    ffi::AnyBuffer buf = *ret.value();
    if (ffi::Error e = expect(target_, what, buf, types, dims); e.failure()) return e;
    *data = buf.untyped_data();
    if (type) *type = buf.element_type();
    return ffi::Error::Success();
  }

  ffi::Error done() const {
    if (index_ != rets_.size()) {
      return invalid(target_, "got " + std::to_string(rets_.size()) + " results; expected " +
                                  std::to_string(index_) + " for these attributes");
    }
    return ffi::Error::Success();
  }

 private:
  const char* target_;
  ffi::RemainingRets rets_;
  size_t index_ = 0;
};

#define JQ_RETURN_IF_ERROR(expr)            \
  do {                                      \
    ::xla::ffi::Error jq_err_ = (expr);     \
    if (jq_err_.failure()) return jq_err_;  \
  } while (0)

inline jq::Fp8 fp8_of(ffi::DataType t) {
  return t == ffi::DataType::F8E5M2 ? jq::Fp8::kE5M2 : jq::Fp8::kE4M3;
}

constexpr std::initializer_list<ffi::DataType> kFp8Types = {ffi::DataType::F8E4M3FN,
                                                           ffi::DataType::F8E5M2};

inline ffi::Error need_direction(const char* target, bool rowwise, bool columnwise) {
  if (!rowwise && !columnwise) return invalid(target, "rowwise and columnwise are both false");
  return ffi::Error::Success();
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
  if (outputs & kAmaxTensor) { JQ_RETURN_IF_ERROR(r.next("amax", f32, {}, &p)); a->tensor = (float*)p; }
  if (outputs & kAmaxTensorRht) { JQ_RETURN_IF_ERROR(r.next("amax_rht", f32, {}, &p)); a->tensor_rht = (float*)p; }
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

// The results of jaxquant_quantize_fp8 for an R x C matrix (flags already set in `a`), read
// from `r` in order; shared with the fused targets (ffi/fused), which read more around them.
inline ffi::Error read_fp8_tensor_results(const char* t, RetReader& r, int64_t R, int64_t C,
                                          Fp8TensorArgs* a) {
  void* p;
  ffi::DataType row_type = ffi::DataType::INVALID, col_type = ffi::DataType::INVALID;
  if (a->rowwise) {
    JQ_RETURN_IF_ERROR(r.next("rowwise data", kFp8Types, {R, C}, &p, &row_type));
    a->row_data = (uint8_t*)p;
  }
  if (a->columnwise) {
    JQ_RETURN_IF_ERROR(r.next("columnwise data", kFp8Types, {C, R}, &p, &col_type));
    a->col_data = (uint8_t*)p;
  }
  if (a->rowwise && a->columnwise && row_type != col_type) {
    return invalid(t, "the rowwise and columnwise data dtypes differ");
  }
  a->fmt = fp8_of(a->rowwise ? row_type : col_type);
  JQ_RETURN_IF_ERROR(r.next("scale_inv", {ffi::DataType::F32}, {}, &p));
  a->scale_inv = (float*)p;
  if (a->delayed) {
    JQ_RETURN_IF_ERROR(r.next("amax", {ffi::DataType::F32}, {}, &p));
    a->amax = (float*)p;
  }
  return ffi::Error::Success();
}

inline ffi::Error decode_fp8_tensor(ffi::AnyBuffer x, ffi::AnyBuffer s, ffi::RemainingRets rets,
                                    bool rowwise, bool columnwise, bool delayed, bool pow2_scale,
                                    float amax_epsilon, Fp8TensorArgs* a,
                                    const char* t = "jaxquant_quantize_fp8") {
  JQ_RETURN_IF_ERROR(decode_input(t, x, &a->x));
  JQ_RETURN_IF_ERROR(need_direction(t, rowwise, columnwise));
  JQ_RETURN_IF_ERROR(expect(t, delayed ? "scale" : "amax", s, {ffi::DataType::F32}, {}));
  a->rowwise = rowwise; a->columnwise = columnwise; a->delayed = delayed;
  a->pow2_scale = pow2_scale; a->amax_epsilon = amax_epsilon;
  a->s = static_cast<const float*>(s.untyped_data());
  RetReader r(t, rets);
  JQ_RETURN_IF_ERROR(read_fp8_tensor_results(t, r, a->x.rows, a->x.cols, a));
  return r.done();
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
// jaxquant_quantize_mxfp8(x) -> [row_data, row_scale], [col_data, col_scale], amax
// ---------------------------------------------------------------------------------------------

struct Mxfp8Args {
  Input x;
  bool rowwise = false, columnwise = false;
  jq::Fp8 fmt = jq::Fp8::kE4M3;
  uint8_t *row_data = nullptr, *row_scale = nullptr, *col_data = nullptr, *col_scale = nullptr;
  float* amax = nullptr;
};

// The results of jaxquant_quantize_mxfp8 for an R x C matrix (directions set in `a`).
inline ffi::Error read_mxfp8_results(const char* t, RetReader& r, int64_t R, int64_t C,
                                     Mxfp8Args* a) {
  const bool rowwise = a->rowwise, columnwise = a->columnwise;
  const auto e8m0 = {ffi::DataType::F8E8M0FNU};
  void* p;
  ffi::DataType row_type = ffi::DataType::INVALID, col_type = ffi::DataType::INVALID;
  if (rowwise) {
    JQ_RETURN_IF_ERROR(r.next("rowwise data", kFp8Types, {R, C}, &p, &row_type));
    a->row_data = (uint8_t*)p;
    JQ_RETURN_IF_ERROR(r.next("rowwise scale_inv", e8m0, {R, ceil_div(C, 32)}, &p));
    a->row_scale = (uint8_t*)p;
  }
  if (columnwise) {
    JQ_RETURN_IF_ERROR(r.next("columnwise data", kFp8Types, {C, R}, &p, &col_type));
    a->col_data = (uint8_t*)p;
    JQ_RETURN_IF_ERROR(r.next("columnwise scale_inv", e8m0, {C, ceil_div(R, 32)}, &p));
    a->col_scale = (uint8_t*)p;
  }
  if (rowwise && columnwise && row_type != col_type) {
    return invalid(t, "the rowwise and columnwise data dtypes differ");
  }
  a->fmt = fp8_of(rowwise ? row_type : col_type);
  JQ_RETURN_IF_ERROR(r.next("amax", {ffi::DataType::F32}, {}, &p));
  a->amax = (float*)p;
  return ffi::Error::Success();
}

inline ffi::Error decode_mxfp8(ffi::AnyBuffer x, ffi::RemainingRets rets, bool rowwise,
                               bool columnwise, Mxfp8Args* a) {
  const char* t = "jaxquant_quantize_mxfp8";
  JQ_RETURN_IF_ERROR(decode_input(t, x, &a->x));
  JQ_RETURN_IF_ERROR(need_direction(t, rowwise, columnwise));
  a->rowwise = rowwise; a->columnwise = columnwise;
  RetReader r(t, rets);
  JQ_RETURN_IF_ERROR(read_mxfp8_results(t, r, a->x.rows, a->x.cols, a));
  return r.done();
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

// The results of jaxquant_quantize_fp8_block for an R x C matrix (flags set in `a`).
inline ffi::Error read_fp8_block_results(const char* t, RetReader& r, int64_t R, int64_t C,
                                         Fp8BlockArgs* a) {
  const bool rowwise = a->rowwise, columnwise = a->columnwise, block_2d = a->block_2d;
  const auto f32 = {ffi::DataType::F32};
  void* p;
  ffi::DataType row_type = ffi::DataType::INVALID, col_type = ffi::DataType::INVALID;
  if (rowwise) {
    JQ_RETURN_IF_ERROR(r.next("rowwise data", kFp8Types, {R, C}, &p, &row_type));
    a->row_data = (uint8_t*)p;
    if (block_2d) {
      JQ_RETURN_IF_ERROR(r.next("rowwise scale_inv", f32, {ceil_div(R, 128), ceil_div(C, 128)}, &p));
    } else {
      JQ_RETURN_IF_ERROR(r.next("rowwise scale_inv", f32, {R, ceil_div(C, 128)}, &p));
    }
    a->row_scale = (float*)p;
  }
  if (columnwise) {
    JQ_RETURN_IF_ERROR(r.next("columnwise data", kFp8Types, {C, R}, &p, &col_type));
    a->col_data = (uint8_t*)p;
    if (block_2d) {
      JQ_RETURN_IF_ERROR(r.next("columnwise scale_inv", f32, {ceil_div(C, 128), ceil_div(R, 128)}, &p));
    } else {
      JQ_RETURN_IF_ERROR(r.next("columnwise scale_inv", f32, {C, ceil_div(R, 128)}, &p));
    }
    a->col_scale = (float*)p;
  }
  if (rowwise && columnwise && row_type != col_type) {
    return invalid(t, "the rowwise and columnwise data dtypes differ");
  }
  a->fmt = fp8_of(rowwise ? row_type : col_type);
  JQ_RETURN_IF_ERROR(r.next("amax", f32, {}, &p));
  a->amax = (float*)p;
  return ffi::Error::Success();
}

inline ffi::Error decode_fp8_block(ffi::AnyBuffer x, ffi::RemainingRets rets, bool rowwise,
                                   bool columnwise, bool block_2d, bool pow2_scale,
                                   float amax_epsilon, Fp8BlockArgs* a) {
  const char* t = "jaxquant_quantize_fp8_block";
  JQ_RETURN_IF_ERROR(decode_input(t, x, &a->x));
  JQ_RETURN_IF_ERROR(need_direction(t, rowwise, columnwise));
  a->rowwise = rowwise; a->columnwise = columnwise; a->block_2d = block_2d;
  a->pow2_scale = pow2_scale; a->amax_epsilon = amax_epsilon;
  RetReader r(t, rets);
  JQ_RETURN_IF_ERROR(read_fp8_block_results(t, r, a->x.rows, a->x.cols, a));
  return r.done();
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
  const auto e4m3 = {ffi::DataType::F8E4M3FN};
  RetReader r(t, rets);
  void* p;
  if (rowwise) {
    JQ_RETURN_IF_ERROR(r.next("rowwise data", f4, {R, C}, &p));
    a->row_data = (uint8_t*)p;
    if (block_2d) {
      JQ_RETURN_IF_ERROR(r.next("rowwise scale_inv", e4m3, {ceil_div(R, 16), ceil_div(C, 16)}, &p));
    } else {
      JQ_RETURN_IF_ERROR(r.next("rowwise scale_inv", e4m3, {R, ceil_div(C, 16)}, &p));
    }
    a->row_scale = (uint8_t*)p;
  }
  if (columnwise) {
    JQ_RETURN_IF_ERROR(r.next("columnwise data", f4, {C, R}, &p));
    a->col_data = (uint8_t*)p;
    if (block_2d) {
      JQ_RETURN_IF_ERROR(r.next("columnwise scale_inv", e4m3, {ceil_div(C, 16), ceil_div(R, 16)}, &p));
    } else {
      JQ_RETURN_IF_ERROR(r.next("columnwise scale_inv", e4m3, {C, ceil_div(R, 16)}, &p));
    }
    a->col_scale = (uint8_t*)p;
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

}  // namespace jqffi
