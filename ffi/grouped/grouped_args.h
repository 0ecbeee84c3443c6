// Argument checking and FFI signatures of the grouped (mixture-of-experts) targets, shared by
// the CPU and CUDA handlers (host code only). Every `decode_grouped_*` checks the buffers XLA
// passes against the target's contract and fills a plain struct the two platforms execute
// identically; every `BindGrouped*` is the target's signature for both platforms.
//
// Group geometry is passed as device arrays computed by XLA (never read on the host, so the
// handlers need no host sync and are CUDA-graph compatible):
//   starts[G + 1]   packed start row of each group in x (starts[G] = tokens that belong to a group)
//   pstarts[G + 1]  start position of each group in the output token layout (padded to the
//                   layout's block; pstarts[G] = first position of no group)
#pragma once

#include <cstdint>
#include <string>
#include <tuple>
#include <utility>

#include "binding.h"
#include "grouped/grouped_params.h"
#include "quantize/quantize_args.h"

namespace jqffi {

inline ffi::Error decode_int_vector(const char* t, const char* what, const ffi::AnyBuffer& b,
                                    int64_t n, const int32_t** out) {
  JQ_RETURN_IF_ERROR(expect(t, what, b, {ffi::DataType::S32}, {n}));
  *out = static_cast<const int32_t*>(b.untyped_data());
  return ffi::Error::Success();
}

// Group offsets `what` (starts or pstarts): int32[G + 1] with G >= 1; sets *G and *out.
inline ffi::Error decode_group_offsets(const char* t, const char* what, const ffi::AnyBuffer& b,
                                       int64_t* G, const int32_t** out) {
  const auto dims = b.dimensions();
  if (dims.size() != 1 || dims[0] < 2) {
    return invalid(t, std::string(what) + " must be int32[G + 1] with G >= 1; got shape " +
                          dims_str(dims));
  }
  *G = dims[0] - 1;
  return decode_int_vector(t, what, b, *G + 1, out);
}

// x, starts and (when given) pstarts of a grouped quantize or amax into `p`.
inline ffi::Error decode_grouped_rows(const char* t, const ffi::AnyBuffer& x,
                                      const ffi::AnyBuffer& starts, const ffi::AnyBuffer* pstarts,
                                      GroupedRows* p) {
  Input in;
  JQ_RETURN_IF_ERROR(decode_input(t, x, &in));
  JQ_RETURN_IF_ERROR(decode_group_offsets(t, "starts", starts, &p->G, &p->starts));
  if (pstarts) JQ_RETURN_IF_ERROR(decode_int_vector(t, "pstarts", *pstarts, p->G + 1, &p->pstarts));
  p->x = in.data;
  p->in_type = static_cast<int>(in.type);
  p->T = in.rows;
  p->C = in.cols;
  return ffi::Error::Success();
}

// The output layout's length of a grouped quantize.
inline ffi::Error decode_length(const char* t, int64_t length, GroupedRows* p) {
  if (length < 1 || length >= (int64_t{1} << 31)) {
    return invalid(t, "length=" + std::to_string(length) + " must be in [1, 2^31)");
  }
  p->L = length;
  return ffi::Error::Success();
}

// jaxquant_grouped_quantize_fp8(x[T, C], starts[G+1], pstarts[G+1], s[G])
//   -> [row f8 [L, C]], [col f8 [C, L] or [G, C, E] (experts)], scale_inv f32[G], amax f32[G]
//   row_packed: the rowwise copy is [T, C] in the packed layout (row r of x at row r, rows from
//   starts[G] zero) while the columnwise copy takes pstarts' layout: both from one read of x.
// jaxquant_grouped_amax(x[T, C], starts[G+1]) -> amax f32[G]  (rowwise = columnwise = false)
// jaxquant_grouped_amax_gated(x[T, C], starts[G+1], gate f32[G]) -> amax f32[G]: the same amax
//   when some gate[g] == 0 (a delayed-scaling group with no scale yet), else zeros
inline ffi::Error decode_grouped_quantize_fp8(const char* t, ffi::AnyBuffer x,
                                              ffi::AnyBuffer starts, ffi::AnyBuffer pstarts,
                                              ffi::AnyBuffer s, ffi::RemainingRets rets,
                                              bool rowwise, bool columnwise, bool delayed,
                                              bool pow2_scale, bool row_packed,
                                              float amax_epsilon, int64_t length,
                                              int64_t expert_rows, QuantizeParams* p) {
  JQ_RETURN_IF_ERROR(need_direction(t, rowwise, columnwise));
  JQ_RETURN_IF_ERROR(decode_grouped_rows(t, x, starts, &pstarts, p));
  const int64_t G = p->G, C = p->C;
  JQ_RETURN_IF_ERROR(expect(t, delayed ? "scale" : "s (unused placeholder)", s,
                            {ffi::DataType::F32}, {delayed ? G : int64_t{1}}));
  JQ_RETURN_IF_ERROR(decode_length(t, length, p));
  if (expert_rows < 0 || (expert_rows > 0 && expert_rows * G != length)) {
    return invalid(t, "expert_rows=" + std::to_string(expert_rows) + " must be 0 (tokens) or "
                      "length / G = " + std::to_string(length) + " / " + std::to_string(G));
  }
  if (row_packed && (!rowwise || expert_rows > 0 || length < p->T)) {
    return invalid(t, "row_packed needs a rowwise copy of tokens (expert_rows = 0) and a layout "
                      "at least as long as x (length " + std::to_string(length) + ", T = " +
                      std::to_string(p->T) + ")");
  }
  p->row_packed = row_packed;
  p->expert_rows = expert_rows;
  p->delayed = delayed;
  p->pow2_scale = pow2_scale;
  p->amax_epsilon = amax_epsilon;
  p->s = static_cast<const float*>(s.untyped_data());
  RetReader r(t, rets);
  void* q;
  ffi::DataType row_type = ffi::DataType::INVALID, col_type = ffi::DataType::INVALID;
  if (rowwise) {
    JQ_RETURN_IF_ERROR(r.next("rowwise data", kFp8Types, {row_packed ? p->T : length, C}, &q,
                              &row_type));
    p->row = static_cast<uint8_t*>(q);
  }
  if (columnwise) {
    if (expert_rows > 0) {
      JQ_RETURN_IF_ERROR(r.next("columnwise data", kFp8Types, {G, C, expert_rows}, &q, &col_type));
    } else {
      JQ_RETURN_IF_ERROR(r.next("columnwise data", kFp8Types, {C, length}, &q, &col_type));
    }
    p->col = static_cast<uint8_t*>(q);
  }
  if (rowwise && columnwise && row_type != col_type) {
    return invalid(t, "rowwise and columnwise data must share one FP8 dtype");
  }
  p->fmt = static_cast<int>(fp8_of(rowwise ? row_type : col_type));
  JQ_RETURN_IF_ERROR(r.next("scale_inv", {ffi::DataType::F32}, {G}, &q));
  p->scale_inv = static_cast<float*>(q);
  JQ_RETURN_IF_ERROR(r.next("amax", {ffi::DataType::F32}, {G}, &q));
  p->amax = static_cast<float*>(q);
  return r.done();
}

inline ffi::Error decode_grouped_amax(const char* t, ffi::AnyBuffer x, ffi::AnyBuffer starts,
                                      ffi::Result<ffi::AnyBuffer> amax, QuantizeParams* p) {
  JQ_RETURN_IF_ERROR(decode_grouped_rows(t, x, starts, nullptr, p));
  JQ_RETURN_IF_ERROR(expect(t, "amax", *amax, {ffi::DataType::F32}, {p->G}));
  p->amax = static_cast<float*>(amax->untyped_data());
  return ffi::Error::Success();
}

inline ffi::Error decode_grouped_amax_gated(const char* t, ffi::AnyBuffer x, ffi::AnyBuffer starts,
                                            ffi::AnyBuffer gate, ffi::Result<ffi::AnyBuffer> amax,
                                            QuantizeParams* p) {
  JQ_RETURN_IF_ERROR(decode_grouped_amax(t, x, starts, amax, p));
  JQ_RETURN_IF_ERROR(expect(t, "gate (the groups' scales)", gate, {ffi::DataType::F32}, {p->G}));
  p->gate = static_cast<const float*>(gate.untyped_data());
  return ffi::Error::Success();
}

// jaxquant_grouped_quantize_nvfp4(x[T, C], starts[G+1], pstarts[G+1], row_key, col_key)
//   -> [row f4 [L, C], row_scale e4m3], [col f4 [C, L] or [G, C, E], col_scale e4m3],
//      [row_amax f32[G]], [col_amax f32[G]]; with `raw` both data outputs are bfloat16 raw
//      values (code x block scale) of the same shapes. `row_packed` (tokens, 1x16 rows): the
//      rowwise copy and its scales are [T, ...] in the packed layout (row r of x at row r, the
//      rows from starts[G] on zero) while the columnwise copy takes the layout of `length`.
// A key is u32[G, 2] when `stochastic` and its direction is requested, else a u32[1, 2]
// placeholder. Contract the device data must keep (not checked on the host, it never reads
// the offsets): with `columnwise` or `block_2d`, every pstarts[g] is a multiple of 16; with
// expert_rows E > 0, starts[g] = pstarts[g] = g E (the CUDA kernel takes row r's expert as r / E).
inline ffi::Error decode_grouped_quantize_nvfp4(const char* t, ffi::AnyBuffer x,
                                                ffi::AnyBuffer starts, ffi::AnyBuffer pstarts,
                                                ffi::AnyBuffer row_key, ffi::AnyBuffer col_key,
                                                ffi::RemainingRets rets, bool rowwise,
                                                bool columnwise, bool block_2d, bool rht,
                                                bool stochastic, int64_t length,
                                                int64_t expert_rows, bool raw, bool row_packed,
                                                Nvfp4QuantizeParams* p) {
  JQ_RETURN_IF_ERROR(need_direction(t, rowwise, columnwise));
  if (rht && block_2d) return invalid(t, "rht and block_2d cannot be combined");
  if (rht && !columnwise) {
    return invalid(t, "rht transforms the columnwise copy; columnwise is false");
  }
  JQ_RETURN_IF_ERROR(decode_grouped_rows(t, x, starts, &pstarts, p));
  const int64_t G = p->G, C = p->C;
  JQ_RETURN_IF_ERROR(decode_length(t, length, p));
  const bool chunked = columnwise || block_2d;  // blocks of 16 positions
  if (chunked && length % 16) {
    return invalid(t, "length=" + std::to_string(length) + " must be a multiple of 16 for a "
                      "columnwise or 2-D copy (16-position blocks)");
  }
  if (expert_rows < 0 || (expert_rows > 0 && expert_rows * G != length) ||
      (expert_rows > 0 && chunked && expert_rows % 16)) {
    return invalid(t, "expert_rows=" + std::to_string(expert_rows) + " must be 0 (tokens) or "
                      "length / G = " + std::to_string(length) + " / " + std::to_string(G) +
                      (chunked ? ", a multiple of 16" : ""));
  }
  if (rowwise && C % 2) {
    return invalid(t, "the rowwise copy needs an even row length (rows own whole bytes); got " +
                          std::to_string(C) + " columns");
  }
  if (row_packed && (!rowwise || expert_rows > 0 || block_2d || length < p->T)) {
    return invalid(t, "row_packed needs a rowwise copy of tokens (expert_rows = 0) in 1x16 "
                      "blocks (block_2d false) and a layout at least as long as x (length " +
                          std::to_string(length) + ", x has " + std::to_string(p->T) + " rows)");
  }
  for (auto [key, on, what] : {std::tuple{&row_key, rowwise, "row_key"},
                               std::tuple{&col_key, columnwise, "col_key"}}) {
    JQ_RETURN_IF_ERROR(expect(t, what, *key, {ffi::DataType::U32},
                              {stochastic && on ? G : int64_t{1}, 2}));
  }
  p->expert_rows = expert_rows;
  p->rowwise = rowwise;
  p->columnwise = columnwise;
  p->block_2d = block_2d;
  p->rht = rht;
  p->stochastic = stochastic;
  p->raw = raw;
  p->row_packed = row_packed;
  p->row_key = static_cast<const uint32_t*>(row_key.untyped_data());
  p->col_key = static_cast<const uint32_t*>(col_key.untyped_data());
  const auto f4 = {ffi::DataType::F4E2M1FN};
  const auto bf16 = {ffi::DataType::BF16};
  const std::initializer_list<ffi::DataType>& data_type = raw ? bf16 : f4;  // both named above
  const auto e4m3 = {ffi::DataType::F8E4M3FN};
  const int64_t br = block_2d ? 16 : 1;
  RetReader r(t, rets);
  void* q;
  if (rowwise) {
    const int64_t rows = row_packed ? p->T : length;
    JQ_RETURN_IF_ERROR(r.next(raw ? "rowwise raw values" : "rowwise data", data_type, {rows, C}, &q));
    p->row = static_cast<uint8_t*>(q);
    JQ_RETURN_IF_ERROR(r.next("rowwise scale_inv", e4m3,
                              {ceil_div(rows, br), ceil_div(C, 16)}, &q));
    p->row_scale = static_cast<uint8_t*>(q);
  }
  if (columnwise) {
    const int64_t srows = ceil_div(C, br);
    if (expert_rows > 0) {
      JQ_RETURN_IF_ERROR(r.next(raw ? "columnwise raw values" : "columnwise data", data_type, {G, C, expert_rows}, &q));
      p->col = static_cast<uint8_t*>(q);
      JQ_RETURN_IF_ERROR(r.next("columnwise scale_inv", e4m3, {G, srows, expert_rows / 16}, &q));
    } else {
      JQ_RETURN_IF_ERROR(r.next(raw ? "columnwise raw values" : "columnwise data", data_type, {C, length}, &q));
      p->col = static_cast<uint8_t*>(q);
      JQ_RETURN_IF_ERROR(r.next("columnwise scale_inv", e4m3, {srows, length / 16}, &q));
    }
    p->col_scale = static_cast<uint8_t*>(q);
  }
  if (rowwise) {
    JQ_RETURN_IF_ERROR(r.next("row_amax", {ffi::DataType::F32}, {G}, &q));
    p->row_amax = static_cast<float*>(q);
  }
  if (columnwise) {
    JQ_RETURN_IF_ERROR(r.next("col_amax", {ffi::DataType::F32}, {G}, &q));
    p->col_amax = static_cast<float*>(q);
  }
  return r.done();
}

// ---------------------------------------------------------------------------------------------
// jaxquant_grouped_gemm(a, a_scale, b, b_scale, pstarts[G+1], row_factor, col_factor,
//                       group_factor, bias) -> out
//   mode 0 (ragged): a[L, K] rows in groups, b[G, N, K]      -> out[L, N]
//   mode 1 (wgrad):  a[M, L], b[N, L], contraction over each group's positions -> out[G, M, N]
// ---------------------------------------------------------------------------------------------

// The mode and the group offsets every grouped GEMM starts with.
inline ffi::Error decode_gemm_groups(const char* t, const ffi::AnyBuffer& pstarts, int32_t mode,
                                     GroupedGemm* p) {
  if (mode != kModeRagged && mode != kModeWgrad) {
    return invalid(t, "mode=" + std::to_string(mode) + "; expected 0 (ragged) or 1 (wgrad)");
  }
  p->mode = mode;
  return decode_group_offsets(t, "pstarts", pstarts, &p->G, &p->pstarts);
}

// The output every grouped GEMM ends with, once its L, M, N, K are known: [L, N] (mode 0) or
// [G, M, N] (mode 1) in one of `types`.
inline ffi::Error decode_gemm_out(const char* t, ffi::Result<ffi::AnyBuffer> out,
                                  std::initializer_list<ffi::DataType> types, GroupedGemm* p) {
  if (p->L >= (int64_t{1} << 31) || p->M >= (int64_t{1} << 31) || p->N >= (int64_t{1} << 31) ||
      p->K >= (int64_t{1} << 31)) {
    return invalid(t, "a dimension is >= 2^31");
  }
  const ffi::DataType ot = out->element_type();
  p->out_kind = ot == ffi::DataType::BF16 ? kOutBF16 : ot == ffi::DataType::F16 ? kOutF16 : kOutF32;
  if (p->mode == kModeRagged) {
    JQ_RETURN_IF_ERROR(expect(t, "out", *out, types, {p->L, p->N}));
  } else {
    JQ_RETURN_IF_ERROR(expect(t, "out", *out, types, {p->G, p->M, p->N}));
  }
  p->out = out->untyped_data();
  return ffi::Error::Success();
}

inline ffi::Error operand_elem(const char* t, const char* what, const ffi::AnyBuffer& b,
                               Elem* elem) {
  switch (b.element_type()) {
    case ffi::DataType::F8E4M3FN: *elem = Elem::kE4M3; return ffi::Error::Success();
    case ffi::DataType::F8E5M2: *elem = Elem::kE5M2; return ffi::Error::Success();
    case ffi::DataType::F4E2M1FN: *elem = Elem::kE2M1; return ffi::Error::Success();
    default:
      return invalid(t, std::string(what) + " is " + dtype_name(b.element_type()) +
                            "; expected float8_e4m3fn, float8_e5m2 or float4_e2m1fn");
  }
}

// Checks an operand's block scales: [scale_rows, ceil(K / block)] uint8 (scale bytes), with a
// leading [G] for expert operands; `scaling` is kScalePerTensor (placeholder u8[1]),
// kScaleMx (E8M0 per 32), kScaleNv (E4M3 per 16) or kScaleNv2d (E4M3 per 16x16).
inline ffi::Error decode_grouped_operand(const char* t, const char* what,
                                         const ffi::AnyBuffer& data, const ffi::AnyBuffer& scale,
                                         int scaling, int64_t experts, int64_t rows, int64_t K,
                                         GemmOperand* op) {
  JQ_RETURN_IF_ERROR(operand_elem(t, what, data, &op->elem));
  const bool fp4 = op->elem == Elem::kE2M1;
  if (fp4 != (scaling == kScaleNv || scaling == kScaleNv2d)) {
    return invalid(t, std::string(what) + ": scaling=" + std::to_string(scaling) +
                          " does not fit its payload dtype (float4_e2m1fn <-> NVFP4 scaling)");
  }
  if (fp4 && K % 2) {
    return invalid(t, std::string(what) + ": an FP4 operand needs an even contraction length; "
                      "got " + std::to_string(K));
  }
  const auto dims = data.dimensions();
  const bool ok = experts > 0 ? (dims.size() == 3 && dims[0] == experts && dims[1] == rows &&
                                 dims[2] == K)
                              : (dims.size() == 2 && dims[0] == rows && dims[1] == K);
  if (!ok) {
    return invalid(t, std::string(what) + " has shape " + dims_str(dims) + "; expected " +
                          (experts > 0 ? dims_str({experts, rows, K}) : dims_str({rows, K})));
  }
  op->data = static_cast<const uint8_t*>(data.untyped_data());
  op->rows = rows;
  op->K = K;
  op->row_bytes = fp4 ? K / 2 : K;
  op->scaling = scaling;
  op->scale = static_cast<const uint8_t*>(scale.untyped_data());
  if (scaling == kScalePerTensor) {
    op->scale = nullptr;
    return ffi::Error::Success();
  }
  const bool f32 = scaling >= kScaleBlock;
  const int64_t block = scaling == kScaleMx ? 32 : f32 ? 128 : 16;
  const int64_t srows = scaling == kScaleNv2d      ? ceil_div(rows, 16)
                        : scaling == kScaleBlock2d ? ceil_div(rows, 128)
                                                   : rows;
  op->scale_cols = ceil_div(K, block);
  op->scale_rows = srows;
  const auto type = f32 ? ffi::DataType::F32 : ffi::DataType::U8;
  if (experts > 0) {
    JQ_RETURN_IF_ERROR(expect(t, "block scales", scale, {type}, {experts, srows, op->scale_cols}));
  } else {
    JQ_RETURN_IF_ERROR(expect(t, "block scales", scale, {type}, {srows, op->scale_cols}));
  }
  return ffi::Error::Success();
}

inline ffi::Error decode_factor(const char* t, const char* what, const ffi::AnyBuffer& b,
                                int64_t n, bool on, const float** out) {
  if (!on) {
    *out = nullptr;
    return ffi::Error::Success();
  }
  JQ_RETURN_IF_ERROR(expect(t, what, b, {ffi::DataType::F32}, {n}));
  *out = static_cast<const float*>(b.untyped_data());
  return ffi::Error::Success();
}

inline ffi::Error decode_grouped_gemm(const char* t, ffi::AnyBuffer a, ffi::AnyBuffer a_scale,
                                      ffi::AnyBuffer b, ffi::AnyBuffer b_scale,
                                      ffi::AnyBuffer pstarts, ffi::AnyBuffer row_factor,
                                      ffi::AnyBuffer col_factor, ffi::AnyBuffer group_factor,
                                      ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> out,
                                      int32_t mode, int32_t a_scaling, int32_t b_scaling,
                                      bool has_row_factor, bool has_col_factor,
                                      bool has_group_factor, bool has_bias, GemmParams* p) {
  for (int32_t s : {a_scaling, b_scaling}) {
    if (s < kScalePerTensor || s > kScaleBlock2d) {
      return invalid(t, "scaling=" + std::to_string(s) + "; expected 0 (per tensor), 1 (MXFP8), "
                        "2 (NVFP4 1x16), 3 (NVFP4 16x16), 4 (Float8Block 1x128) or 5 (128x128)");
    }
  }
  JQ_RETURN_IF_ERROR(decode_gemm_groups(t, pstarts, mode, p));
  const int64_t G = p->G;
  const auto ad = a.dimensions(), bd = b.dimensions();
  if (ad.size() != 2) return invalid(t, "a must be 2-D; got shape " + dims_str(ad));
  if (mode == kModeRagged) {
    if (bd.size() != 3) return invalid(t, "b must be [G, N, K]; got shape " + dims_str(bd));
    p->L = ad[0];
    p->K = ad[1];
    p->N = bd[1];
    p->M = p->L;
    JQ_RETURN_IF_ERROR(decode_grouped_operand(t, "a", a, a_scale, a_scaling, 0, p->L, p->K, &p->a));
    JQ_RETURN_IF_ERROR(decode_grouped_operand(t, "b", b, b_scale, b_scaling, G, p->N, p->K, &p->b));
  } else {
    if (bd.size() != 2) return invalid(t, "b must be [N, L]; got shape " + dims_str(bd));
    p->M = ad[0];
    p->L = ad[1];
    p->K = p->L;
    p->N = bd[0];
    JQ_RETURN_IF_ERROR(decode_grouped_operand(t, "a", a, a_scale, a_scaling, 0, p->M, p->L, &p->a));
    JQ_RETURN_IF_ERROR(decode_grouped_operand(t, "b", b, b_scale, b_scaling, 0, p->N, p->L, &p->b));
  }
  const int64_t row_n = mode == kModeRagged ? p->L : G * p->M;
  JQ_RETURN_IF_ERROR(decode_factor(t, "row_factor", row_factor, row_n, has_row_factor,
                                   &p->row_factor));
  JQ_RETURN_IF_ERROR(decode_factor(t, "col_factor", col_factor, G * p->N, has_col_factor,
                                   &p->col_factor));
  JQ_RETURN_IF_ERROR(decode_factor(t, "group_factor", group_factor, G, has_group_factor,
                                   &p->group_factor));
  if (has_bias && mode != kModeRagged) return invalid(t, "bias is only taken in mode 0");
  JQ_RETURN_IF_ERROR(decode_factor(t, "bias", bias, G * p->N, has_bias, &p->bias));
  return decode_gemm_out(t, out, {ffi::DataType::BF16, ffi::DataType::F16, ffi::DataType::F32}, p);
}

// jaxquant_grouped_gemm_bf16(a, b, pstarts[G+1], alpha, row_scale) -> out, workspace
// (Bf16GemmParams; alpha f32[G] with has_alpha, row_scale f32[L] with has_row_scale (mode 0),
// else placeholders; the workspace is checked by the CUDA handler, unused on the CPU).
inline ffi::Error decode_grouped_gemm_bf16(const char* t, ffi::AnyBuffer a, ffi::AnyBuffer b,
                                           ffi::AnyBuffer pstarts, ffi::AnyBuffer alpha,
                                           ffi::AnyBuffer row_scale,
                                           ffi::Result<ffi::AnyBuffer> out, int32_t mode,
                                           bool a_k_major, bool b_k_major, bool has_alpha,
                                           bool has_row_scale, Bf16GemmParams* p) {
  JQ_RETURN_IF_ERROR(decode_gemm_groups(t, pstarts, mode, p));
  if (mode == kModeRagged && !a_k_major) {
    return invalid(t, "mode 0 takes a [L, K] with K contiguous (a_k_major = true)");
  }
  const int64_t G = p->G;
  for (auto [buf, what] : {std::pair{&a, "a"}, std::pair{&b, "b"}}) {
    if (buf->element_type() != ffi::DataType::BF16) {
      return invalid(t, std::string(what) + " is " + dtype_name(buf->element_type()) +
                            "; expected bfloat16");
    }
  }
  const auto ad = a.dimensions(), bd = b.dimensions();
  if (ad.size() != 2) return invalid(t, "a must be 2-D; got shape " + dims_str(ad));
  p->a_k_major = a_k_major;
  p->b_k_major = b_k_major;
  if (mode == kModeRagged) {
    p->L = p->M = ad[0];
    p->K = ad[1];
    if (bd.size() != 3 || bd[0] != G || bd[b_k_major ? 2 : 1] != p->K) {
      return invalid(t, "b has shape " + dims_str(bd) + "; expected [G = " + std::to_string(G) +
                            (b_k_major ? ", N, K = " : ", K = ") + std::to_string(p->K) +
                            (b_k_major ? "]" : ", N]"));
    }
    p->N = bd[b_k_major ? 1 : 2];
  } else {
    p->L = ad[a_k_major ? 1 : 0];
    p->M = ad[a_k_major ? 0 : 1];
    p->K = p->L;
    if (bd.size() != 2 || bd[b_k_major ? 1 : 0] != p->L) {
      return invalid(t, "b has shape " + dims_str(bd) + "; expected " +
                            (b_k_major ? "[N, L = " : "[L = ") + std::to_string(p->L) +
                            (b_k_major ? "]" : ", N]"));
    }
    p->N = bd[b_k_major ? 0 : 1];
  }
  JQ_RETURN_IF_ERROR(decode_factor(t, "alpha", alpha, G, has_alpha, &p->alpha));
  if (has_row_scale && mode != kModeRagged) {
    return invalid(t, "row_scale scales the rows of a ragged GEMM (mode 0); mode is " +
                          std::to_string(mode));
  }
  JQ_RETURN_IF_ERROR(decode_factor(t, "row_scale", row_scale, p->L, has_row_scale, &p->row_scale));
  p->a = static_cast<const uint16_t*>(a.untyped_data());
  p->b = static_cast<const uint16_t*>(b.untyped_data());
  return decode_gemm_out(t, out, {ffi::DataType::BF16, ffi::DataType::F32}, p);
}

// jaxquant_grouped_quantize_mxfp8 / _fp8_block(x[T, C], starts[G+1], pstarts[G+1]): the results
// of jaxquant_quantize_mxfp8 / _fp8_block for the token layout of `length` positions gathered
// from x (position pstarts[g] + i holds row starts[g] + i while inside group g, else zeros),
// without the gathered copy: the kernel reads x through the offsets. `a->x` describes that
// [length, C] matrix for the results (its data pointer stays x's); `rows` the groups and x.
//
// row_packed (tokens): the rowwise copy `[T, C]` (and its scales) in the packed layout, row r of
// x at row r and the rows from starts[G] as zeros, while the columnwise copy takes the layout of
// pstarts: a packed rowwise copy and a padded columnwise one from one read of x (1-row blocks
// only: not Float8Block's 128x128).
//
// Expert weights (expert_rows E > 0; starts[g] = pstarts[g] = g E, length L = G E): the
// rowwise copy as for tokens (`[L, C]`, which is `[G, E, C]`), and the columnwise copy with each
// expert's written on its own, `[G, C, E]` data and scales `[G, C, E / block]` (Float8Block
// 128x128: `[G, ceil(C / 128), E / 128]`), then the amax. E must be a multiple of the format's
// block (`e_block`). MXFP8 raw copies with `col_in_x_layout`: the columnwise copy in the
// weights' own layout, `[G, E, C]` data and scales `[G, E / 32, C]`; with `row_flags` too, the
// rowwise data result is u8[x_layout_flag_count(G E, C)] (64 flag bits a 32 x 64 block, one a
// 32-value row block; mxfp8_x_layout.cuh) instead of the rowwise values, which
// jaxquant_grouped_patch_mxfp8_rows writes later over the columnwise copy (decision 56).
inline bool col_in_x_layout(const Mxfp8Args& a) { return a.col_in_x_layout; }
inline bool col_in_x_layout(const Fp8BlockArgs&) { return false; }
inline bool rows_as_flags(const Mxfp8Args& a) { return a.rows_as_flags; }
inline bool rows_as_flags(const Fp8BlockArgs&) { return false; }
inline void set_row_flags(Mxfp8Args* a, void* p) { a->row_flags = static_cast<uint8_t*>(p); }
inline void set_row_flags(Fp8BlockArgs*, void*) {}

// The flag bytes of an [R, C] matrix: 8 (64 bits, little-endian) for each 32 x 64 block, 8 blocks a
// 128 x 128 tile (tiles row-major, block w at rows 32 (w / 2) and columns 64 (w % 2) of its tile);
// bit 32 h + i is row i of the block's row block h (its columns 32 h ..).
inline int64_t x_layout_flag_count(int64_t R, int64_t C) { return ceil_div(R, 128) * ceil_div(C, 128) * 64; }

template <typename Args, typename Scale>
ffi::Error read_expert_copies(const char* t, ffi::RemainingRets rets, int64_t G, int64_t E,
                              ffi::DataType scale_type, int64_t row_block_rows,
                              int64_t col_scale_rows, int64_t block, Args* a, Scale** row_scale,
                              Scale** col_scale) {
  RetReader r(t, rets);
  const int64_t C = a->x.cols;
  ffi::DataType row_type = ffi::DataType::INVALID, col_type = ffi::DataType::INVALID;
  if (a->rowwise && rows_as_flags(*a)) {  // flags, then the scales as always
    void* p;
    JQ_RETURN_IF_ERROR(r.next("rowwise flags", {ffi::DataType::U8}, {x_layout_flag_count(G * E, C)}, &p));
    set_row_flags(a, p);
    JQ_RETURN_IF_ERROR(r.next("rowwise scale_inv", {scale_type},
                              {ceil_div(G * E, row_block_rows), ceil_div(C, block)}, &p));
    *row_scale = static_cast<Scale*>(p);
  } else if (a->rowwise) {
    JQ_RETURN_IF_ERROR(read_blocks(r, "rowwise", G * E, C, data_types(*a), scale_type,
                                   row_block_rows, block, &a->row_data, row_scale, &row_type));
  }
  if (a->columnwise) {
    void* p;
    const bool x_layout = col_in_x_layout(*a);  // [G, E, C], scales [G, E / block, C]
    JQ_RETURN_IF_ERROR(r.next("columnwise data", data_types(*a),
                              {G, x_layout ? E : C, x_layout ? C : E}, &p, &col_type));
    a->col_data = static_cast<uint8_t*>(p);
    JQ_RETURN_IF_ERROR(r.next("columnwise scale_inv", {scale_type},
                              {G, x_layout ? E / block : col_scale_rows, x_layout ? C : E / block}, &p));
    *col_scale = static_cast<Scale*>(p);
  }
  JQ_RETURN_IF_ERROR(read_payload_format(t, a, row_type, col_type));
  JQ_RETURN_IF_ERROR(read_scalar(r, "amax", &a->amax));
  return r.done();
}

inline ffi::Error read_expert_results(const char* t, ffi::RemainingRets rets, int64_t G,
                                      int64_t E, Mxfp8Args* a) {
  return read_expert_copies(t, rets, G, E, ffi::DataType::F8E8M0FNU, 1, a->x.cols, 32, a,
                            &a->row_scale, &a->col_scale);
}

inline ffi::Error read_expert_results(const char* t, ffi::RemainingRets rets, int64_t G,
                                      int64_t E, Fp8BlockArgs* a) {
  const int64_t col_scale_rows = a->block_2d ? ceil_div(a->x.cols, 128) : a->x.cols;
  return read_expert_copies(t, rets, G, E, ffi::DataType::F32, a->block_2d ? 128 : 1,
                            col_scale_rows, 128, a, &a->row_scale, &a->col_scale);
}

// Whether a format's rowwise blocks are one row tall (row_packed needs them).
inline bool one_row_blocks(const Mxfp8Args&) { return true; }
inline bool one_row_blocks(const Fp8BlockArgs& a) { return !a.block_2d; }

template <typename Args, typename SetAttrs>
ffi::Error decode_gathered(const char* t, ffi::AnyBuffer x, ffi::AnyBuffer starts,
                           ffi::AnyBuffer pstarts, ffi::RemainingRets rets, int64_t length,
                           int64_t expert_rows, bool row_packed, int64_t e_block, Args* a,
                           GroupedRows* rows, SetAttrs set_attrs) {
  JQ_RETURN_IF_ERROR(decode_input(t, x, &a->x));
  JQ_RETURN_IF_ERROR(decode_grouped_rows(t, x, starts, &pstarts, rows));
  JQ_RETURN_IF_ERROR(decode_length(t, length, rows));
  a->x.rows = length;
  JQ_RETURN_IF_ERROR(set_attrs(a));
  if (expert_rows < 0 || (expert_rows > 0 && (expert_rows * rows->G != length ||
                                              expert_rows % e_block))) {
    return invalid(t, "expert_rows=" + std::to_string(expert_rows) + " must be 0 (tokens) or "
                      "length / G (= " + std::to_string(length / rows->G) + ") and a multiple of " +
                      std::to_string(e_block));
  }
  rows->expert_rows = expert_rows;
  if (row_packed) {
    if (!a->rowwise || expert_rows > 0 || length < rows->T || !one_row_blocks(*a)) {
      return invalid(t, "row_packed needs a rowwise copy of tokens (expert_rows = 0) in 1-row "
                        "blocks and a layout at least as long as x (length " +
                        std::to_string(length) + ", T = " + std::to_string(rows->T) + ")");
    }
    rows->row_packed = true;
    RetReader r(t, rets);
    JQ_RETURN_IF_ERROR(read_results(t, r, length, rows->C, a, rows->T));
    return r.done();
  }
  if (expert_rows == 0) return read_all_results(t, rets, a);
  if (length >= (int64_t(1) << 31)) {  // the kernels index positions in 32 bits
    return invalid(t, "expert weights of " + std::to_string(length) + " rows (G E) must have "
                      "fewer than 2^31");
  }
  return read_expert_results(t, rets, rows->G, expert_rows, a);
}

// `raw`: the data results are bfloat16 raw values (code x block scale, the bits
// jaxquant_grouped_decode_mxfp8 gives the codes) of payload format E5M2 when `raw_e5m2`, else
// E4M3; the scales and amax as always. Without `raw`, `raw_e5m2` must be false (the data
// dtypes give the format). `col_in_x_layout` (raw expert weights' columnwise copy only): that
// copy in the weights' own layout (read_expert_copies), for GEMMs that read it along N.
// `row_flags` (with col_in_x_layout and rowwise): the rowwise values' flags instead of them.
inline ffi::Error decode_gathered_mxfp8(ffi::AnyBuffer x, ffi::AnyBuffer starts,
                                        ffi::AnyBuffer pstarts, ffi::RemainingRets rets,
                                        bool rowwise, bool columnwise, int64_t length,
                                        int64_t expert_rows, bool row_packed, bool raw,
                                        bool raw_e5m2, bool col_in_x_layout, bool row_flags,
                                        Mxfp8Args* a, GroupedRows* rows) {
  const char* t = "jaxquant_grouped_quantize_mxfp8";
  if (raw_e5m2 && !raw) {
    return invalid(t, "raw_e5m2 is true without raw; the codes' dtype gives their format");
  }
  if (col_in_x_layout && (!raw || !columnwise || expert_rows <= 0 ||
                          x.element_type() != ffi::DataType::BF16)) {
    return invalid(t, "col_in_x_layout needs raw copies of bfloat16 expert weights with a "
                      "columnwise copy (raw, columnwise true, expert_rows > 0, x bfloat16); got "
                      "raw=" + std::to_string(raw) + ", columnwise=" + std::to_string(columnwise) +
                      ", expert_rows=" + std::to_string(expert_rows) + ", x " +
                      dtype_name(x.element_type()));
  }
  if (row_flags && (!col_in_x_layout || !rowwise)) {
    return invalid(t, "row_flags needs col_in_x_layout and a rowwise copy (its flags stand in for "
                      "its values); got col_in_x_layout=" + std::to_string(col_in_x_layout) +
                      ", rowwise=" + std::to_string(rowwise));
  }
  return decode_gathered(t, x, starts, pstarts, rets, length, expert_rows, row_packed, 32, a,
                         rows,
                         [&](Mxfp8Args* m) {
    m->raw = raw;
    m->col_in_x_layout = col_in_x_layout;
    m->rows_as_flags = row_flags;
    if (raw) m->fmt = raw_e5m2 ? jq::Fp8::kE5M2 : jq::Fp8::kE4M3;
    return set_directions(t, rowwise, columnwise, m);
  });
}

inline ffi::Error decode_gathered_fp8_block(ffi::AnyBuffer x, ffi::AnyBuffer starts,
                                            ffi::AnyBuffer pstarts, ffi::RemainingRets rets,
                                            bool rowwise, bool columnwise, bool block_2d,
                                            bool pow2_scale, float amax_epsilon, int64_t length,
                                            int64_t expert_rows, bool row_packed,
                                            Fp8BlockArgs* a, GroupedRows* rows) {
  const char* t = "jaxquant_grouped_quantize_fp8_block";
  return decode_gathered(t, x, starts, pstarts, rets, length, expert_rows, row_packed, 128, a,
                         rows,
                         [&](Fp8BlockArgs* b) {
    return set_fp8_block_attrs(t, rowwise, columnwise, block_2d, pow2_scale, amax_epsilon, b);
  });
}

// jaxquant_grouped_patch_mxfp8_rows(w bf16[R, C], flags u8[x_layout_flag_count(R, C)],
//   copy bf16[G, E, C], after) -> out bf16[G, E, C], aliased to `copy` (design decision 56):
// the raw MXFP8 rowwise copy of expert weights w (G E = R rows, E % 32 == 0) written over the
// columnwise copy in the weights' own layout that jaxquant_grouped_quantize_mxfp8 wrote with
// `row_flags` beside those flags: each flagged 32-value row block is rewritten. `after` is not
// read: an operand computed from the columnwise copy (the forward GEMM's output), so XLA runs
// this call after that copy's last reader and updates it in place. `raw_e5m2`: the payload
// format, as for the quantize call.
struct PatchRowsArgs {
  const uint16_t* w;  // bfloat16 bits
  const uint8_t* flags;
  const uint16_t* copy;
  uint16_t* out;
  int64_t R, C;
  jq::Fp8 fmt;
};

inline ffi::Error decode_patch_mxfp8_rows(ffi::AnyBuffer w, ffi::AnyBuffer flags, ffi::AnyBuffer copy,
                                          ffi::Result<ffi::AnyBuffer> out, bool raw_e5m2,
                                          PatchRowsArgs* a) {
  const char* t = "jaxquant_grouped_patch_mxfp8_rows";
  const auto wd = w.dimensions(), cd = copy.dimensions();
  if (w.element_type() != ffi::DataType::BF16 || wd.size() != 2) {
    return invalid(t, std::string("w must be the bfloat16 expert weights [G E, C]; got ") +
                          dtype_name(w.element_type()) + dims_str(wd));
  }
  const int64_t R = wd[0], C = wd[1];
  if (cd.size() != 3 || cd[0] * cd[1] != R || cd[2] != C || cd[1] % 32) {
    return invalid(t, "copy must be [G, E, C] with G E = " + std::to_string(R) + ", C = " +
                          std::to_string(C) + " and E a multiple of 32; got " + dims_str(cd));
  }
  if (R >= (int64_t(1) << 31)) return invalid(t, "w must have fewer than 2^31 rows");
  JQ_RETURN_IF_ERROR(expect(t, "copy", copy, {ffi::DataType::BF16}, {cd[0], cd[1], C}));
  JQ_RETURN_IF_ERROR(expect(t, "flags", flags, {ffi::DataType::U8}, {x_layout_flag_count(R, C)}));
  JQ_RETURN_IF_ERROR(expect(t, "out", *out, {ffi::DataType::BF16}, {cd[0], cd[1], C}));
  *a = {static_cast<const uint16_t*>(w.untyped_data()), static_cast<const uint8_t*>(flags.untyped_data()),
        static_cast<const uint16_t*>(copy.untyped_data()), static_cast<uint16_t*>(out->untyped_data()),
        R, C, raw_e5m2 ? jq::Fp8::kE5M2 : jq::Fp8::kE4M3};
  return ffi::Error::Success();
}

// jaxquant_grouped_decode_nvfp4(data f4[B, R, C], scales e4m3[B, ceil(R / block_rows), C / 16])
//   -> out bf16[B, R, C]: NVFP4's raw values (code x block scale, exact in bfloat16) for the
// grouped GEMMs on decoded operands. C % 16 == 0 keeps each 16-wide block in whole bytes.
struct Nvfp4DecodeParams {
  const uint8_t* data;   // packed codes, first element in the low nibble
  const uint8_t* scale;  // E4M3 codes
  uint16_t* out;         // bfloat16 bits
  int64_t B, R, C, scale_rows;
  int block_rows;
};

inline ffi::Error decode_nvfp4_decode(const char* t, ffi::AnyBuffer data, ffi::AnyBuffer scale,
                                      ffi::Result<ffi::AnyBuffer> out, int64_t block_rows,
                                      Nvfp4DecodeParams* p) {
  const auto dims = data.dimensions();
  if (dims.size() != 3) {
    return invalid(t, "data must be float4_e2m1fn[batch, rows, cols]; got shape " + dims_str(dims));
  }
  if (block_rows != 1 && block_rows != 16) {
    return invalid(t, "block_rows=" + std::to_string(block_rows) + "; expected 1 (1x16 blocks) "
                      "or 16 (16x16 blocks)");
  }
  const int64_t B = dims[0], R = dims[1], C = dims[2];
  if (C % 16) {
    return invalid(t, "cols=" + std::to_string(C) + " must be a multiple of 16 (whole blocks)");
  }
  if (B * R * (C / 16) >= (int64_t(1) << 32)) {
    return invalid(t, "more than 2^32 blocks of 16 values");
  }
  JQ_RETURN_IF_ERROR(expect(t, "data", data, {ffi::DataType::F4E2M1FN}, {B, R, C}));
  const int64_t scale_rows = ceil_div(R, block_rows);
  JQ_RETURN_IF_ERROR(
      expect(t, "scales", scale, {ffi::DataType::F8E4M3FN}, {B, scale_rows, C / 16}));
  JQ_RETURN_IF_ERROR(expect(t, "out", *out, {ffi::DataType::BF16}, {B, R, C}));
  *p = {static_cast<const uint8_t*>(data.untyped_data()),
        static_cast<const uint8_t*>(scale.untyped_data()),
        static_cast<uint16_t*>(out->untyped_data()), B, R, C, scale_rows, int(block_rows)};
  return ffi::Error::Success();
}

// jaxquant_grouped_decode_mxfp8(data f8[B, R, C], scales e8m0[B, R, ceil(C / 32)])
//   -> out bf16[B, R, C]: MXFP8's raw values (code x 2^(e - 127), rounded once to bfloat16 as
// XLA's decode does). C % 16 == 0: a thread's 16 values share one scale.
struct Mxfp8DecodeParams {
  const uint8_t* data;   // E4M3 or E5M2 codes
  const uint8_t* scale;  // E8M0 exponents
  uint16_t* out;         // bfloat16 bits
  int64_t B, R, C, scale_cols;
  bool e5m2;
};

inline ffi::Error decode_mxfp8_decode(const char* t, ffi::AnyBuffer data, ffi::AnyBuffer scale,
                                      ffi::Result<ffi::AnyBuffer> out, Mxfp8DecodeParams* p) {
  const auto dims = data.dimensions();
  if (dims.size() != 3) {
    return invalid(t, "data must be float8[batch, rows, cols]; got shape " + dims_str(dims));
  }
  const int64_t B = dims[0], R = dims[1], C = dims[2];
  if (C % 16) return invalid(t, "cols=" + std::to_string(C) + " must be a multiple of 16");
  if (B * R * (C / 16) >= (int64_t(1) << 32)) return invalid(t, "more than 2^32 16-value chunks");
  JQ_RETURN_IF_ERROR(expect(t, "data", data, kFp8Types, {B, R, C}));
  const int64_t scale_cols = ceil_div(C, 32);
  JQ_RETURN_IF_ERROR(
      expect(t, "scales", scale, {ffi::DataType::F8E8M0FNU}, {B, R, scale_cols}));
  JQ_RETURN_IF_ERROR(expect(t, "out", *out, {ffi::DataType::BF16}, {B, R, C}));
  *p = {static_cast<const uint8_t*>(data.untyped_data()),
        static_cast<const uint8_t*>(scale.untyped_data()),
        static_cast<uint16_t*>(out->untyped_data()), B, R, C, scale_cols,
        data.element_type() == ffi::DataType::F8E5M2};
  return ffi::Error::Success();
}

// The FFI signatures of the grouped targets, one copy for both platforms: the CPU handlers bind
// `BindX(ffi::Ffi::Bind())`, the CUDA ones `BindX(ffi::Ffi::Bind().Ctx<Stream>())`.
// jaxquant_grouped_quantize_fp8: x, starts, padded starts, delayed scales -> outputs.
template <typename Binding>
auto BindGroupedQuantizeFp8(Binding binding) {
  auto flags = Attrs<bool>(Args<4>(std::move(binding)).RemainingRets(), "rowwise", "columnwise",
                           "delayed", "pow2_scale", "row_packed");
  return Attrs<int64_t>(std::move(flags).template Attr<float>("amax_epsilon"), "length",
                        "expert_rows");
}

// jaxquant_grouped_quantize_mxfp8 / _fp8_block: x, starts, padded starts -> the single-tensor
// target's outputs for the gathered layout; its attributes, then the layout length.
template <typename Binding>
auto BindGroupedQuantizeMxfp8(Binding binding) {
  return Attrs<bool>(Attrs<int64_t>(Mxfp8Attrs(Args<3>(std::move(binding)).RemainingRets()),
                                    "length", "expert_rows"),
                     "row_packed", "raw", "raw_e5m2", "col_in_x_layout", "row_flags");
}

// jaxquant_grouped_patch_mxfp8_rows: w, flags, copy, after -> out (aliased to copy).
template <typename Binding>
auto BindGroupedPatchMxfp8Rows(Binding binding) {
  return Rets<1>(Args<4>(std::move(binding))).template Attr<bool>("raw_e5m2");
}

template <typename Binding>
auto BindGroupedQuantizeFp8Block(Binding binding) {
  return Attrs<int64_t>(Fp8BlockAttrs(Args<3>(std::move(binding)).RemainingRets()), "length",
                        "expert_rows").template Attr<bool>("row_packed");
}

// jaxquant_grouped_quantize_nvfp4: x, starts, padded starts, row key, col key -> outputs.
template <typename Binding>
auto BindGroupedQuantizeNvfp4(Binding binding) {
  auto flags = Attrs<bool>(Args<5>(std::move(binding)).RemainingRets(), "rowwise", "columnwise",
                           "block_2d", "rht", "stochastic");
  return Attrs<bool>(Attrs<int64_t>(std::move(flags), "length", "expert_rows"), "raw",
                     "row_packed");
}

// jaxquant_grouped_amax: x, starts -> per-group amax.
template <typename Binding>
auto BindGroupedAmax(Binding binding) {
  return Rets<1>(Args<2>(std::move(binding)));
}

// jaxquant_grouped_decode_mxfp8: data, scales -> bfloat16 raw values.
template <typename Binding>
auto BindGroupedDecodeMxfp8(Binding binding) {
  return Rets<1>(Args<2>(std::move(binding)));
}

// jaxquant_grouped_decode_nvfp4: data, scales -> bfloat16 raw values; block_rows.
template <typename Binding>
auto BindGroupedDecodeNvfp4(Binding binding) {
  return std::move(Rets<1>(Args<2>(std::move(binding)))).template Attr<int64_t>("block_rows");
}

// jaxquant_grouped_amax_gated: x, starts, gate -> per-group amax (zeros when no gate is 0).
template <typename Binding>
auto BindGroupedAmaxGated(Binding binding) {
  return Rets<1>(Args<3>(std::move(binding)));
}

// The attributes of the quantized grouped GEMMs, after their results.
template <typename Binding>
auto BindGroupedGemmAttrs(Binding&& binding) {
  auto scaling = Attrs<int32_t>(std::move(binding), "mode", "a_scaling", "b_scaling");
  return Attrs<bool>(std::move(scaling), "has_row_factor", "has_col_factor", "has_group_factor",
                     "has_bias");
}

// jaxquant_grouped_gemm: a, a_scale, b, b_scale, pstarts, row, column and group factors, bias
// -> out.
template <typename Binding>
auto BindGroupedGemm(Binding binding) {
  return BindGroupedGemmAttrs(Rets<1>(Args<9>(std::move(binding))));
}

// jaxquant_grouped_gemm_sm90 (CUDA only, built with CUTLASS): the same operands and attributes,
// results out and a u8 workspace (grouped/sm90/sm90_gemm.h), plus the kernel configuration
// (`config`, sm90::kCfg*) and the tile order (`raster_along_n`).
template <typename Binding>
auto BindGroupedGemmSm90(Binding binding) {
  auto gemm = BindGroupedGemmAttrs(Rets<2>(Args<9>(std::move(binding))));
  return std::move(gemm).template Attr<int32_t>("config").template Attr<bool>("raster_along_n");
}

// jaxquant_grouped_gemm_bf16: a, b, pstarts, alpha, row_scale -> out, workspace; the mode, the
// operand layouts, which factors are given, and (CUDA) the kernel configuration and tile order.
template <typename Binding>
auto BindGroupedGemmBf16(Binding binding) {
  auto layout = Attrs<bool>(Rets<2>(Args<5>(std::move(binding))).template Attr<int32_t>("mode"),
                            "a_k_major", "b_k_major", "has_alpha", "has_row_scale");
  return std::move(layout).template Attr<int32_t>("config").template Attr<bool>("raster_along_n");
}

}  // namespace jqffi
