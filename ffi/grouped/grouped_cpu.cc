// CPU handlers of the grouped targets: plain loops over the numerics header, so CI exercises
// the grouped FFI path (lowering, argument checks, layouts) with the CUDA kernels' math.
#include <algorithm>
#include <cstring>
#include <vector>

#include "gemm/cpu_values.h"
#include "grouped/grouped_args.h"
#include "grouped/handlers.h"
#include "quantize/nvfp4_cpu.h"
#include "quantize/quantize_cpu.h"

namespace jqffi {
namespace {

using jq::float_of;

// Element i of x (bfloat16, float16 or float32) as float32.
float load_x(const GroupedRows& p, int64_t i) {
  switch (static_cast<In>(p.in_type)) {
    case In::kBF16: return value_at(p.x, kOutBF16, i);
    case In::kF16: return value_at(p.x, kOutF16, i);
    default: return value_at(p.x, kOutF32, i);
  }
}

// Per-group amax over the rows of each group (NaN-propagating max of |x| bits).
void group_amax(const QuantizeParams& p, std::vector<uint32_t>* bits) {
  bits->assign(static_cast<size_t>(p.G), 0u);
  for (int64_t g = 0; g < p.G; ++g) {
    const int64_t r0 = std::min<int64_t>(p.starts[g], p.T), r1 = std::min<int64_t>(p.starts[g + 1], p.T);
    uint32_t m = 0;
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t c = 0; c < p.C; ++c) m = std::max(m, jq::abs_bits(load_x(p, r * p.C + c)));
    }
    (*bits)[g] = m;
  }
}

// Position -> (group, source row or -1 for padding / no group).
void locate(const QuantizeParams& p, int64_t pos, int64_t* group, int64_t* src, int64_t* local) {
  const int32_t* end = std::upper_bound(p.pstarts, p.pstarts + p.G + 1, static_cast<int32_t>(pos));
  const int64_t g = (end - p.pstarts) - 1;
  *group = g;
  *src = -1;
  *local = 0;
  if (g < 0 || g >= p.G) return;
  *local = pos - p.pstarts[g];
  if (*local < p.starts[g + 1] - p.starts[g]) *src = p.starts[g] + *local;
}

ffi::Error GroupedQuantizeFp8Cpu(ffi::AnyBuffer x, ffi::AnyBuffer starts, ffi::AnyBuffer pstarts,
                                 ffi::AnyBuffer s, ffi::RemainingRets rets, bool rowwise,
                                 bool columnwise, bool delayed, bool pow2_scale,
                                 bool row_packed, float amax_epsilon, int64_t length,
                                 int64_t expert_rows) {
  QuantizeParams p;
  JQ_RETURN_IF_ERROR(decode_grouped_quantize_fp8("jaxquant_grouped_quantize_fp8", x, starts,
                                                 pstarts, s, rets, rowwise, columnwise, delayed,
                                                 pow2_scale, row_packed, amax_epsilon, length,
                                                 expert_rows, &p));
  std::vector<uint32_t> bits;
  group_amax(p, &bits);
  const jq::Fp8 fmt = static_cast<jq::Fp8>(p.fmt);
  const float fmax = jq::spec_of(fmt).fmax;
  std::vector<float> scale(static_cast<size_t>(p.G));
  for (int64_t g = 0; g < p.G; ++g) {
    p.amax[g] = float_of(bits[g]);
    scale[g] = delayed ? p.s[g] : jq::scale_from_amax(p.amax[g], fmax, pow2_scale, amax_epsilon);
    p.scale_inv[g] = jq::rcp_f32(scale[g]);
  }
  for (int64_t pos = 0; pos < p.L; ++pos) {
    int64_t g, src, local;
    locate(p, pos, &g, &src, &local);
    for (int64_t c = 0; c < p.C; ++c) {
      const float v = src >= 0 ? load_x(p, src * p.C + c) * scale[g] : 0.0f;
      const uint8_t code = src >= 0 ? uint8_t(jq::encode_fp8(v, fmt)) : uint8_t(0);
      if (p.row && !p.row_packed) p.row[pos * p.C + c] = code;
      if (p.row && p.row_packed && src >= 0) p.row[src * p.C + c] = code;
      if (p.col) {
        if (p.expert_rows > 0) {
          p.col[(g * p.C + c) * p.expert_rows + local] = code;
        } else {
          p.col[c * p.L + pos] = code;
        }
      }
    }
  }
  if (p.row_packed) {  // rows of no group
    const int64_t total = std::min<int64_t>(p.starts[p.G], p.T);
    std::fill(p.row + total * p.C, p.row + p.T * p.C, uint8_t(0));
  }
  return ffi::Error::Success();
}

ffi::Error GroupedAmaxCpu(ffi::AnyBuffer x, ffi::AnyBuffer starts, ffi::Result<ffi::AnyBuffer> amax) {
  QuantizeParams p;
  JQ_RETURN_IF_ERROR(decode_grouped_amax("jaxquant_grouped_amax", x, starts, amax, &p));
  std::vector<uint32_t> bits;
  group_amax(p, &bits);
  for (int64_t g = 0; g < p.G; ++g) p.amax[g] = float_of(bits[g]);
  return ffi::Error::Success();
}

// Gated: the amax only while some group's scale (gate) is still 0, else zeros (as the CUDA
// kernel, which exits at once, leaves them).
ffi::Error GroupedAmaxGatedCpu(ffi::AnyBuffer x, ffi::AnyBuffer starts, ffi::AnyBuffer gate,
                               ffi::Result<ffi::AnyBuffer> amax) {
  QuantizeParams p;
  JQ_RETURN_IF_ERROR(
      decode_grouped_amax_gated("jaxquant_grouped_amax_gated", x, starts, gate, amax, &p));
  std::vector<uint32_t> bits(static_cast<size_t>(p.G), 0u);
  if (std::any_of(p.gate, p.gate + p.G, [](float s) { return s == 0.0f; })) group_amax(p, &bits);
  for (int64_t g = 0; g < p.G; ++g) p.amax[g] = float_of(bits[g]);
  return ffi::Error::Success();
}

// Grouped NVFP4: each group's extent of the layout is quantized as its own matrix (its rows of
// x, zero-padded to the extent; transposed and RHT'd for the columnwise copy) with the
// single-tensor host code, then placed at the group's positions; positions of no group stay 0.
// A packed rowwise copy (row_packed) takes the group's own rows at its rows of x (1x16 blocks:
// each row quantizes alone, so the padding rows change none of them).
void nvfp4_group_copy(const Nvfp4QuantizeParams& p, int64_t g, bool columnwise) {
  const int64_t ps = p.pstarts[g], extent = p.pstarts[g + 1] - ps, C = p.C;
  const int64_t n = std::min<int64_t>(p.starts[g + 1] - p.starts[g], extent), s0 = p.starts[g];
  const int64_t br = p.block_2d ? 16 : 1;
  Matrix m{std::vector<float>(static_cast<size_t>(extent * C), 0.0f),
                  columnwise ? C : extent, columnwise ? extent : C};
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t c = 0; c < C; ++c) {
      const float v = load_x(p, (s0 + i) * C + c);
      if (columnwise) m.v[c * extent + i] = v; else m.v[i * C + c] = v;
    }
  }
  if (columnwise && p.rht) {
    for (int64_t r = 0; r < m.rows; ++r) {
      for (int64_t c = 0; c < m.cols; c += 16) jq::rht16(&m.v[r * m.cols + c]);
    }
  }
  const float amax = float_of(amax_bits_of_range(m, 0, m.rows, 0, m.cols));
  (columnwise ? p.col_amax : p.row_amax)[g] = amax;
  const int64_t nbr = ceil_div(m.rows, br), nbc = ceil_div(m.cols, 16);
  std::vector<uint8_t> data(static_cast<size_t>((m.rows * m.cols + 1) / 2)), scale(static_cast<size_t>(nbr * nbc));
  const uint32_t* key = p.stochastic ? (columnwise ? p.col_key : p.row_key) + 2 * g : nullptr;
  nvfp4_matrix(m, br, false, &amax, key, data.data(), scale.data());
  // Where the group's matrix goes: rows of the rowwise copy from position ps; columns ps.. of
  // the columnwise copy [C, L] (or expert g's own [C, E] matrix).
  const bool expert = p.expert_rows > 0;
  const bool packed = !columnwise && p.row_packed;
  const int64_t out_cols = columnwise ? (expert ? p.expert_rows : p.L) : C;
  const int64_t col0 = columnwise && !expert ? ps : 0;
  const int64_t row0 = columnwise ? 0 : packed ? s0 : ps;
  const int64_t out_rows = packed ? n : m.rows;  // rows of the group's matrix placed
  const int64_t out_base = columnwise && expert ? g * C * p.expert_rows : 0;  // elements
  uint8_t* out = columnwise ? p.col : p.row;
  const int64_t out_nbc = ceil_div(out_cols, 16);
  uint8_t* out_scale = columnwise ? p.col_scale + (expert ? g * nbr * out_nbc : 0) : p.row_scale;
  for (int64_t r = 0; r < out_rows; ++r) {
    for (int64_t c = 0; c < m.cols; ++c) {
      const int64_t i = r * m.cols + c;
      const uint32_t code = (data[i >> 1] >> (4 * (i & 1))) & 0xFu;
      const int64_t at = out_base + (row0 + r) * out_cols + col0 + c;
      if (p.raw) {  // code x block scale in bfloat16 (the CPU decode's bits)
        const float value = jq::nvfp4_raw(code, jq::decode_e4m3(scale[(r / br) * nbc + c / 16]));
        reinterpret_cast<uint16_t*>(out)[at] = static_cast<uint16_t>(jq::bf16_bits_rne(value));
      } else {
        put_nibble(out, at, code);
      }
    }
  }
  for (int64_t r = 0; r < (packed ? n : nbr); ++r) {
    for (int64_t c = 0; c < nbc; ++c) out_scale[(row0 / br + r) * out_nbc + col0 / 16 + c] = scale[r * nbc + c];
  }
}

ffi::Error GroupedQuantizeNvfp4Cpu(ffi::AnyBuffer x, ffi::AnyBuffer starts, ffi::AnyBuffer pstarts,
                                   ffi::AnyBuffer row_key, ffi::AnyBuffer col_key, ffi::RemainingRets rets,
                                   bool rowwise, bool columnwise, bool block_2d, bool rht, bool stochastic,
                                   int64_t length, int64_t expert_rows, bool raw,
                                   bool row_packed) {
  Nvfp4QuantizeParams p;
  JQ_RETURN_IF_ERROR(decode_grouped_quantize_nvfp4("jaxquant_grouped_quantize_nvfp4", x, starts,
                                                   pstarts, row_key, col_key, rets, rowwise,
                                                   columnwise, block_2d, rht, stochastic, length,
                                                   expert_rows, raw, row_packed, &p));
  const int64_t br = block_2d ? 16 : 1, nbc = ceil_div(p.C, 16);
  if (rowwise) {  // every row a zero row's codes and scales until a group's are placed
    const int64_t rows = row_packed ? p.T : p.L;
    std::memset(p.row, 0, static_cast<size_t>(raw ? rows * p.C * 2 : rows * p.C / 2));
    std::memset(p.row_scale, 0, static_cast<size_t>(ceil_div(rows, br) * nbc));
  }
  if (columnwise) {
    std::memset(p.col, 0, static_cast<size_t>(raw ? p.C * p.L * 2 : p.C * p.L / 2));
    std::memset(p.col_scale, 0, static_cast<size_t>(ceil_div(p.C, br) * (p.L / 16)));
  }
  for (int64_t g = 0; g < p.G; ++g) {
    for (bool col : {false, true}) {
      if (!(col ? columnwise : rowwise)) continue;
      if (p.pstarts[g + 1] > p.pstarts[g]) {
        nvfp4_group_copy(p, g, col);
      } else {
        (col ? p.col_amax : p.row_amax)[g] = 0.0f;
      }
    }
  }
  return ffi::Error::Success();
}

// Block scale of element (row, k) of an operand (1 for per-tensor scaling); `s` points at the
// operand's (expert's) scale matrix.
float block_scale(const GemmOperand& op, const uint8_t* s, int64_t row, int64_t k) {
  const float* f32 = reinterpret_cast<const float*>(s);
  switch (op.scaling) {
    case kScaleMx: return jq::decode_e8m0(s[row * op.scale_cols + k / 32]);
    case kScaleNv: return jq::decode_e4m3(s[row * op.scale_cols + k / 16]);
    case kScaleNv2d: return jq::decode_e4m3(s[(row / 16) * op.scale_cols + k / 16]);
    case kScaleBlock: return f32[row * op.scale_cols + k / 128];
    case kScaleBlock2d: return f32[(row / 128) * op.scale_cols + k / 128];
    default: return 1.0f;
  }
}

// An operand decoded to float32 (payload times block scale, exactly).
std::vector<float> dequantize(const GemmOperand& op, int64_t experts) {
  const int64_t n = std::max<int64_t>(experts, 1);
  std::vector<float> out(static_cast<size_t>(n * op.rows * op.K));
  const int64_t scale_size = op.scale_rows * op.scale_cols * (op.scaling >= kScaleBlock ? 4 : 1);
  for (int64_t e = 0; e < n; ++e) {
    const uint8_t* d = op.data + e * op.rows * op.row_bytes;
    const uint8_t* s = op.scale ? op.scale + e * scale_size : nullptr;
    for (int64_t r = 0; r < op.rows; ++r) {
      for (int64_t k = 0; k < op.K; ++k) {
        const uint32_t code = op.elem == Elem::kE2M1
                                  ? (d[r * op.row_bytes + k / 2] >> (4 * (k & 1))) & 0xFu
                                  : d[r * op.row_bytes + k];
        const float v = decode_elem(op.elem, code);
        out[(e * op.rows + r) * op.K + k] = s ? v * block_scale(op, s, r, k) : v;
      }
    }
  }
  return out;
}

void store_out(const GemmParams& p, int64_t i, float v) { store_at(p.out, p.out_kind, i, v); }

float epilogue(const GemmParams& p, float acc, int64_t g, int64_t row_index, int64_t n) {
  if (p.group_factor) acc = acc * p.group_factor[g];
  if (p.row_factor) acc = acc * p.row_factor[row_index];
  if (p.col_factor) acc = acc * p.col_factor[g * p.N + n];
  if (p.bias) acc = acc + p.bias[g * p.N + n];
  return acc;
}

ffi::Error GroupedGemmCpu(ffi::AnyBuffer a, ffi::AnyBuffer a_scale, ffi::AnyBuffer b,
                          ffi::AnyBuffer b_scale, ffi::AnyBuffer pstarts, ffi::AnyBuffer row_factor,
                          ffi::AnyBuffer col_factor, ffi::AnyBuffer group_factor, ffi::AnyBuffer bias,
                          ffi::Result<ffi::AnyBuffer> out, int32_t mode, int32_t a_scaling,
                          int32_t b_scaling, bool has_row_factor, bool has_col_factor,
                          bool has_group_factor, bool has_bias) {
  GemmParams p;
  JQ_RETURN_IF_ERROR(decode_grouped_gemm("jaxquant_grouped_gemm", a, a_scale, b, b_scale, pstarts,
                                         row_factor, col_factor, group_factor, bias, out, mode,
                                         a_scaling, b_scaling, has_row_factor, has_col_factor,
                                         has_group_factor, has_bias, &p));
  const std::vector<float> A = dequantize(p.a, 0);
  const std::vector<float> B = dequantize(p.b, p.mode == kModeRagged ? p.G : 0);
  const int64_t K = p.K;
  if (p.mode == kModeRagged) {
    for (int64_t r = 0; r < p.L; ++r) {
      const int32_t* end = std::upper_bound(p.pstarts, p.pstarts + p.G + 1, static_cast<int32_t>(r));
      const int64_t g = (end - p.pstarts) - 1;
      for (int64_t n = 0; n < p.N; ++n) {
        if (g < 0 || g >= p.G) {
          store_out(p, r * p.N + n, 0.0f);
          continue;
        }
        float acc = 0.0f;
        const float* ar = &A[r * K];
        const float* br = &B[(g * p.N + n) * K];
        for (int64_t k = 0; k < K; ++k) acc += ar[k] * br[k];
        store_out(p, r * p.N + n, epilogue(p, acc, g, r, n));
      }
    }
  } else {
    for (int64_t g = 0; g < p.G; ++g) {
      const int64_t k0 = std::max<int64_t>(0, std::min<int64_t>(p.pstarts[g], K));
      const int64_t k1 = std::max<int64_t>(k0, std::min<int64_t>(p.pstarts[g + 1], K));
      for (int64_t m = 0; m < p.M; ++m) {
        for (int64_t n = 0; n < p.N; ++n) {
          float acc = 0.0f;
          for (int64_t k = k0; k < k1; ++k) acc += A[m * K + k] * B[n * K + k];
          store_out(p, (g * p.M + m) * p.N + n, epilogue(p, acc, g, g * p.M + m, n));
        }
      }
    }
  }
  return ffi::Error::Success();
}

// jaxquant_grouped_gemm_bf16 on the CPU: the CUDA kernel's contract (layouts, offsets, alpha,
// zeros where no group writes) in plain loops, float32 sums in k order. The routing sends the
// no-recipe and decoded GEMMs to the CUDA kernel only; tests call this handler directly.
ffi::Error GroupedGemmBf16Cpu(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer pstarts,
                              ffi::AnyBuffer alpha, ffi::AnyBuffer row_scale,
                              ffi::Result<ffi::AnyBuffer> out,
                              ffi::Result<ffi::AnyBuffer> workspace, int32_t mode, bool a_k_major,
                              bool b_k_major, bool has_alpha, bool has_row_scale, int32_t config,
                              bool raster_along_n) {
  (void)workspace;
  (void)config;
  (void)raster_along_n;
  Bf16GemmParams p;
  JQ_RETURN_IF_ERROR(decode_grouped_gemm_bf16("jaxquant_grouped_gemm_bf16", a, b, pstarts, alpha,
                                              row_scale, out, mode, a_k_major, b_k_major,
                                              has_alpha, has_row_scale, &p));
  auto value = [](const uint16_t* v, int64_t i) { return value_at(v, kOutBF16, i); };
  auto store = [&](int64_t i, float v) { store_at(p.out, p.out_kind, i, v); };
  const int64_t N = p.N, M = p.M, L = p.L;
  auto start = [&](int64_t g) { return std::max<int64_t>(0, std::min<int64_t>(p.pstarts[g], L)); };
  if (p.mode == kModeRagged) {
    const int64_t K = p.K;
    for (int64_t g = 0; g <= p.G; ++g) {  // g == G: the rows past the last group (zeros)
      const int64_t lo = start(std::min(g, p.G)), hi = g < p.G ? std::max(lo, start(g + 1)) : L;
      for (int64_t r = lo; r < hi; ++r) {
        for (int64_t n = 0; n < N; ++n) {
          float acc = 0.0f;
          for (int64_t k = 0; g < p.G && k < K; ++k) {
            const float bv = p.b_k_major ? value(p.b, (g * N + n) * K + k)
                                         : value(p.b, (g * K + k) * N + n);
            acc += value(p.a, r * K + k) * bv;
          }
          float v = g < p.G && p.alpha ? acc * p.alpha[g] : acc;
          if (g < p.G && p.row_scale) v = v * p.row_scale[r];  // after alpha, as the reference
          store(r * N + n, v);
        }
      }
    }
  } else {
    for (int64_t g = 0; g < p.G; ++g) {
      const int64_t lo = start(g), hi = std::max(lo, start(g + 1));
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t n = 0; n < N; ++n) {
          float acc = 0.0f;
          for (int64_t l = lo; l < hi; ++l) {
            const float av = p.a_k_major ? value(p.a, m * L + l) : value(p.a, l * M + m);
            const float bv = p.b_k_major ? value(p.b, n * L + l) : value(p.b, l * N + n);
            acc += av * bv;
          }
          store((g * M + m) * N + n, p.alpha ? acc * p.alpha[g] : acc);
        }
      }
    }
  }
  return ffi::Error::Success();
}

// The token layout of rows.L positions gathered from x (zeros for padding and no group), as the
// float32 matrix the single-tensor CPU quantize takes.
Matrix gathered_matrix(const Input& x, const GroupedRows& rows) {
  QuantizeParams p;
  static_cast<GroupedRows&>(p) = rows;
  Matrix m{std::vector<float>(size_t(rows.L * rows.C), 0.0f), rows.L, rows.C};
  for (int64_t pos = 0; pos < rows.L; ++pos) {
    int64_t g, src, local;
    locate(p, pos, &g, &src, &local);
    if (src < 0) continue;
    for (int64_t c = 0; c < rows.C; ++c) m.v[pos * rows.C + c] = input_value(x, src * rows.C + c);
  }
  return m;
}

// Expert `[G, rows, E]` copy of a `[rows, G E]` one (`per` positions an element: 1 for data, the
// scale block for scales): expert e's columns as its own matrix, as the CUDA kernels store them.
template <typename T>
void regroup_experts(const std::vector<T>& flat, int64_t rows, int64_t L, int64_t E, int64_t per,
                     T* out) {
  const int64_t len = E / per, total = L / per;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < total; ++i) out[(i / len) * rows * len + r * len + i % len] = flat[r * total + i];
  }
}

// The gathered quantize of `a` (directions and attributes decoded); expert weights (E > 0) by
// way of the [C, L] columnwise copy, regrouped; row_packed: the rowwise copy from the packed
// layout (x's rows, those from starts[G] as zeros), the columnwise one from pstarts' layout.
template <typename Args, typename Scale>
void quantize_gathered(const GroupedRows& rows, Args& a, Scale** col_scale, int64_t scale_rows,
                       int64_t block) {
  const Matrix m = gathered_matrix(a.x, rows);
  if (rows.row_packed) {
    GroupedRows packed = rows;
    packed.pstarts = rows.starts;
    packed.L = rows.T;
    Args row = a, col = a;
    row.columnwise = false;
    quantize_matrix(gathered_matrix(a.x, packed), row);
    col.rowwise = false;
    if (col.columnwise) quantize_matrix(m, col);
    return;
  }
  const int64_t E = rows.expert_rows;
  if (E == 0 || !a.columnwise) {  // tokens, or the experts' rowwise copy alone (x's own rows)
    quantize_matrix(m, a);
    return;
  }
  const int64_t C = rows.C, L = rows.L;
  std::vector<uint8_t> data(size_t(C * L));
  std::vector<Scale> scale(size_t(scale_rows * (L / block)));
  uint8_t* out_data = a.col_data;
  Scale* out_scale = *col_scale;
  a.col_data = data.data();
  *col_scale = scale.data();
  quantize_matrix(m, a);
  regroup_experts(data, C, L, E, 1, out_data);
  regroup_experts(scale, scale_rows, L, E, block, out_scale);
}

// MXFP8 codes [rows, cols] with their E8M0 scales [rows, ceil(cols / 32)] as raw values in
// bfloat16 bits (XLA:CPU's f32 product and f32 -> bf16 rounding): the decode target's values and
// the quantize target's raw copies.
void mxfp8_raw_matrix(const uint8_t* codes, const uint8_t* scale, int64_t rows, int64_t cols,
                      int64_t scale_cols, bool e5m2, uint16_t* out) {
  for (int64_t row = 0; row < rows; ++row) {
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t i = row * cols + c;
      const float v = e5m2 ? jq::decode_e5m2(codes[i]) : jq::decode_e4m3(codes[i]);
      const float value = jq::mxfp8_raw(v, jq::decode_e8m0(scale[row * scale_cols + c / 32]));
      out[i] = static_cast<uint16_t>(jq::bf16_bits_rne(value));
    }
  }
}

// out[b, c, r] = in[b, r, c] for in [B, R, C].
template <typename T>
void transpose_batches(const T* in, int64_t B, int64_t R, int64_t C, T* out) {
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t c = 0; c < C; ++c) out[(b * C + c) * R + r] = in[(b * R + r) * C + c];
    }
  }
}

// Calls f(flag byte, flag bit, row, first column, column end) for each 32-value row block of an
// [R, C] matrix, in the flags' layout (x_layout_flag_count).
template <typename F>
void for_each_row_block(int64_t R, int64_t C, F&& f) {
  const int64_t tile_cols = ceil_div(C, 128);
  for (int64_t b = 0; b < x_layout_flag_count(R, C) / 8; ++b) {
    const int64_t tile = b / 8, w = b % 8;
    const int64_t r0 = (tile / tile_cols) * 128 + 32 * (w / 2), c0 = (tile % tile_cols) * 128 + 64 * (w % 2);
    for (int bit = 0; bit < 64; ++bit) {
      const int64_t r = r0 + bit % 32, c = c0 + 32 * (bit / 32);
      if (r < R && c < C) f(8 * b + bit / 8, bit % 8, r, c, std::min(c + 32, C));
    }
  }
}

ffi::Error GroupedQuantizeMxfp8Cpu(ffi::AnyBuffer x, ffi::AnyBuffer starts, ffi::AnyBuffer pstarts,
                                   ffi::RemainingRets rets, bool rowwise, bool columnwise,
                                   int64_t length, int64_t expert_rows, bool row_packed, bool raw,
                                   bool raw_e5m2, bool col_in_x_layout, bool row_flags) {
  Mxfp8Args a;
  GroupedRows rows;
  JQ_RETURN_IF_ERROR(decode_gathered_mxfp8(x, starts, pstarts, rets, rowwise, columnwise, length,
                                           expert_rows, row_packed, raw, raw_e5m2,
                                           col_in_x_layout, row_flags, &a, &rows));
  if (!raw) {
    quantize_gathered(rows, a, &a.col_scale, rows.C, 32);
    return ffi::Error::Success();
  }
  // Raw copies: the codes into scratch, then decoded into the bfloat16 results. Every copy is a
  // [rows, cols] matrix of 32-blocks along its rows: the rowwise one [L or T, C], the columnwise
  // one [C, L], or for experts [G C, E].
  const int64_t C = rows.C, L = rows.L, row_rows = rows.row_packed ? rows.T : L;
  // row_flags: the rowwise values into scratch, each row block flagged where they differ from
  // the columnwise copy's (the CUDA kernel's flags, bit for bit).
  std::vector<uint16_t> row_values(a.rows_as_flags ? size_t(row_rows * C) : 0);
  auto* row_out = a.rows_as_flags ? row_values.data() : reinterpret_cast<uint16_t*>(a.row_data);
  auto* col_out = reinterpret_cast<uint16_t*>(a.col_data);
  const uint8_t* row_scale = a.row_scale;
  uint8_t* col_scale = a.col_scale;
  std::vector<uint8_t> row_codes(a.rowwise ? size_t(row_rows * C) : 0);
  std::vector<uint8_t> col_codes(a.columnwise ? size_t(C * L) : 0);
  a.row_data = row_codes.data();
  a.col_data = col_codes.data();
  quantize_gathered(rows, a, &a.col_scale, C, 32);
  const bool e5m2 = a.fmt == jq::Fp8::kE5M2;
  if (a.rowwise) {
    mxfp8_raw_matrix(row_codes.data(), row_scale, row_rows, C, ceil_div(C, 32), e5m2, row_out);
  }
  if (a.columnwise) {
    const int64_t E = rows.expert_rows, col_rows = E ? (L / E) * C : C, col_cols = E ? E : L;
    if (!a.col_in_x_layout) {
      mxfp8_raw_matrix(col_codes.data(), col_scale, col_rows, col_cols, ceil_div(col_cols, 32),
                       e5m2, col_out);
      return ffi::Error::Success();
    }
    // The weights' own layout: each expert's [C, E] values and [C, E / 32] scales transposed.
    std::vector<uint16_t> values(size_t(C * L));
    mxfp8_raw_matrix(col_codes.data(), col_scale, col_rows, col_cols, E / 32, e5m2, values.data());
    transpose_batches(values.data(), L / E, C, E, col_out);
    const std::vector<uint8_t> scales(col_scale, col_scale + C * (L / 32));
    transpose_batches(scales.data(), L / E, C, E / 32, col_scale);
    if (a.rows_as_flags) {
      std::fill(a.row_flags, a.row_flags + x_layout_flag_count(L, C), uint8_t(0));
      for_each_row_block(L, C, [&](int64_t byte, int bit, int64_t r, int64_t c0, int64_t c1) {
        bool differ = false;
        for (int64_t c = c0; c < c1; ++c) differ |= row_out[r * C + c] != col_out[r * C + c];
        a.row_flags[byte] |= uint8_t(differ) << bit;
      });
    }
  }
  return ffi::Error::Success();
}

// The rowwise raw values of the flagged row blocks written over the columnwise copy (decision 56).
ffi::Error GroupedPatchMxfp8RowsCpu(ffi::AnyBuffer w, ffi::AnyBuffer flags, ffi::AnyBuffer copy,
                                    ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> out, bool raw_e5m2) {
  PatchRowsArgs a;
  JQ_RETURN_IF_ERROR(decode_patch_mxfp8_rows(w, flags, copy, out, raw_e5m2, &a));
  if (a.out != a.copy) std::copy(a.copy, a.copy + a.R * a.C, a.out);
  Matrix m{std::vector<float>(size_t(a.R * a.C)), a.R, a.C};
  for (int64_t i = 0; i < a.R * a.C; ++i) m.v[i] = jq::float_of(uint32_t(a.w[i]) << 16);
  std::vector<uint8_t> codes(size_t(a.R * a.C)), scales(size_t(a.R * ceil_div(a.C, 32)));
  std::vector<uint16_t> values(size_t(a.R * a.C));
  mxfp8_matrix(m, a.fmt, codes.data(), scales.data());
  mxfp8_raw_matrix(codes.data(), scales.data(), a.R, a.C, ceil_div(a.C, 32), a.fmt == jq::Fp8::kE5M2,
                   values.data());
  for_each_row_block(a.R, a.C, [&](int64_t byte, int bit, int64_t r, int64_t c0, int64_t c1) {
    if (((a.flags[byte] >> bit) & 1) == 0) return;
    for (int64_t c = c0; c < c1; ++c) a.out[r * a.C + c] = values[r * a.C + c];
  });
  return ffi::Error::Success();
}

ffi::Error GroupedQuantizeFp8BlockCpu(ffi::AnyBuffer x, ffi::AnyBuffer starts,
                                      ffi::AnyBuffer pstarts, ffi::RemainingRets rets,
                                      bool rowwise, bool columnwise, bool block_2d,
                                      bool pow2_scale, float amax_epsilon, int64_t length,
                                      int64_t expert_rows, bool row_packed) {
  Fp8BlockArgs a;
  GroupedRows rows;
  JQ_RETURN_IF_ERROR(decode_gathered_fp8_block(x, starts, pstarts, rets, rowwise, columnwise,
                                               block_2d, pow2_scale, amax_epsilon, length,
                                               expert_rows, row_packed, &a, &rows));
  quantize_gathered(rows, a, &a.col_scale, block_2d ? ceil_div(rows.C, 128) : rows.C, 128);
  return ffi::Error::Success();
}

// MXFP8 raw values to bfloat16 (XLA:CPU's f32 product and f32 -> bf16 rounding).
ffi::Error GroupedDecodeMxfp8Cpu(ffi::AnyBuffer data, ffi::AnyBuffer scale,
                                 ffi::Result<ffi::AnyBuffer> out) {
  Mxfp8DecodeParams p;
  JQ_RETURN_IF_ERROR(decode_mxfp8_decode("jaxquant_grouped_decode_mxfp8", data, scale, out, &p));
  mxfp8_raw_matrix(p.data, p.scale, p.B * p.R, p.C, p.scale_cols, p.e5m2, p.out);
  return ffi::Error::Success();
}

// NVFP4 raw values to bfloat16 (XLA:CPU's f32 -> bf16 rounding; the values are exact).
ffi::Error GroupedDecodeNvfp4Cpu(ffi::AnyBuffer data, ffi::AnyBuffer scale,
                                 ffi::Result<ffi::AnyBuffer> out, int64_t block_rows) {
  Nvfp4DecodeParams p;
  JQ_RETURN_IF_ERROR(
      decode_nvfp4_decode("jaxquant_grouped_decode_nvfp4", data, scale, out, block_rows, &p));
  const int64_t blocks_per_row = p.C / 16;
  for (int64_t row = 0; row < p.B * p.R; ++row) {
    const int64_t b = row / p.R, r = row % p.R;
    const uint8_t* scales = p.scale + (b * p.scale_rows + r / p.block_rows) * blocks_per_row;
    for (int64_t c = 0; c < p.C; ++c) {
      const int64_t i = row * p.C + c;
      const uint32_t code = (p.data[i / 2] >> (4 * (i % 2))) & 0xFu;
      const float value = jq::nvfp4_raw(code, jq::decode_e4m3(scales[c / 16]));
      p.out[i] = static_cast<uint16_t>(jq::bf16_bits_rne(value));
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kGroupedQuantizeMxfp8Cpu, GroupedQuantizeMxfp8Cpu,
                       BindGroupedQuantizeMxfp8(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER(kGroupedPatchMxfp8RowsCpu, GroupedPatchMxfp8RowsCpu,
                       BindGroupedPatchMxfp8Rows(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER(kGroupedQuantizeFp8BlockCpu, GroupedQuantizeFp8BlockCpu,
                       BindGroupedQuantizeFp8Block(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER(kGroupedQuantizeFp8Cpu, GroupedQuantizeFp8Cpu,
                       BindGroupedQuantizeFp8(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER(kGroupedQuantizeNvfp4Cpu, GroupedQuantizeNvfp4Cpu,
                       BindGroupedQuantizeNvfp4(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER(kGroupedDecodeMxfp8Cpu, GroupedDecodeMxfp8Cpu,
                       BindGroupedDecodeMxfp8(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER(kGroupedDecodeNvfp4Cpu, GroupedDecodeNvfp4Cpu,
                       BindGroupedDecodeNvfp4(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER(kGroupedAmaxCpu, GroupedAmaxCpu, BindGroupedAmax(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER(kGroupedAmaxGatedCpu, GroupedAmaxGatedCpu,
                       BindGroupedAmaxGated(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER(kGroupedGemmCpu, GroupedGemmCpu, BindGroupedGemm(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER(kGroupedGemmBf16Cpu, GroupedGemmBf16Cpu,
                       BindGroupedGemmBf16(ffi::Ffi::Bind()));

std::vector<Target> grouped_cpu_targets() {
  return {target("jaxquant_grouped_quantize_fp8", kGroupedQuantizeFp8Cpu),
          target("jaxquant_grouped_quantize_nvfp4", kGroupedQuantizeNvfp4Cpu),
          target("jaxquant_grouped_quantize_mxfp8", kGroupedQuantizeMxfp8Cpu),
          target("jaxquant_grouped_patch_mxfp8_rows", kGroupedPatchMxfp8RowsCpu),
          target("jaxquant_grouped_quantize_fp8_block", kGroupedQuantizeFp8BlockCpu),
          target("jaxquant_grouped_decode_nvfp4", kGroupedDecodeNvfp4Cpu),
          target("jaxquant_grouped_decode_mxfp8", kGroupedDecodeMxfp8Cpu),
          target("jaxquant_grouped_amax", kGroupedAmaxCpu),
          target("jaxquant_grouped_amax_gated", kGroupedAmaxGatedCpu),
          target("jaxquant_grouped_gemm", kGroupedGemmCpu),
          target("jaxquant_grouped_gemm_bf16", kGroupedGemmBf16Cpu)};
}

}  // namespace jqffi
