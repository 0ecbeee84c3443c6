// CUDA handler of jaxquant_grouped_gemm_bf16: the bfloat16 grouped GEMM on Hopper through the
// CUTLASS pointer-array instances of grouped/sm90/ (kBF16 x kBF16, three operand layouts), for
// GroupedDense without a recipe, high-precision (Identity) operands and operands decoded exactly
// to bfloat16 by XLA (MXFP8, NVFP4, ...). Arguments: grouped_args.h (decode_grouped_gemm_bf16);
// results out and a u8 workspace of at least sm90::workspace_bytes(G) bytes. No CUTLASS code
// here (the instances have their own translation units). It checks that the problem is one an
// instance serves (else an error naming what is not: the Python side,
// jaxquant.backends.ffi.grouped.bf16, decides, never this handler) and dispatches on the layout,
// the output type and the `config` attribute (sm90::kCfgBf16*). A configuration without an
// instance is an error, never a substitute.
#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "cuda_handler.h"
#include "grouped/grouped_args.h"
#include "grouped/handlers.h"
#include "grouped/sm90_call.h"

namespace jqffi {
namespace {

constexpr const char* kTarget = "jaxquant_grouped_gemm_bf16";

int layout_of(const Bf16GemmParams& p) {
  if (p.a_k_major) return p.b_k_major ? sm90::kLayoutTN : sm90::kLayoutNN;
  return p.b_k_major ? -1 : sm90::kLayoutNT;
}

// Why no instance can serve `p` ("" when one can). Mirrors
// jaxquant.backends.ffi.grouped.bf16.unsupported.
std::string unserved(const Bf16GemmParams& p) {
  if (layout_of(p) < 0) {
    return "a M-major a with a K-major b has no instance (layouts: TN, NN, NT)";
  }
  // 16-byte TMA rows and group bases: every leading dimension a multiple of 8 bf16 (4 float32
  // for the output).
  if (std::string why = sm90_output_reason(p); !why.empty()) return why;
  if (p.mode == kModeRagged) {
    if (p.K % 8) return "K must be a multiple of 8";
    if (!p.b_k_major && p.N % 8) return "N must be a multiple of 8 (N-major b)";
  } else {
    if ((p.a_k_major || p.b_k_major) && p.L % 8) {
      return "the token length L must be a multiple of 8 (K-major operands)";
    }
    if (!p.a_k_major && p.M % 8) return "M must be a multiple of 8 (M-major a)";
    if (!p.b_k_major && p.N % 8) return "N must be a multiple of 8 (N-major b)";
  }
  return sm90_device_reason(p);
}

template <int CFG, int LAYOUT, int OUT, int EPI = sm90::kEpiAlpha>
constexpr Sm90Runner instance() {
  return sm90::run_instance<sm90::kBF16, sm90::kBF16, OUT, CFG, LAYOUT, EPI>;
}

// The row-scaled instance (layout TN) of (config, output); nullptr when sm90.cmake built none
// (bfloat16 out: bf16 and bf16_c2x1, the configurations TN takes; float32 out: bf16).
Sm90Runner row_scaled_runner(int cfg, int layout, int out) {
  if (layout != sm90::kLayoutTN) return nullptr;
  constexpr int kTN = sm90::kLayoutTN, kRow = sm90::kEpiRowScale;
  if (out == kOutF32) {
    return cfg == sm90::kCfgBf16 ? instance<sm90::kCfgBf16, kTN, kOutF32, kRow>() : nullptr;
  }
  switch (cfg) {
    case sm90::kCfgBf16: return instance<sm90::kCfgBf16, kTN, kOutBF16, kRow>();
#ifndef JAXQUANT_SM90_DEFAULT_CONFIGS_ONLY  // sm90.cmake's JAXQUANT_SM90_ALL_CONFIGS
    case sm90::kCfgBf16C2x1: return instance<sm90::kCfgBf16C2x1, kTN, kOutBF16, kRow>();
#endif
    default: return nullptr;
  }
}

// The bfloat16-output instance of configuration CFG for `layout` (every layout is built).
template <int CFG>
Sm90Runner bf16_out(int layout) {
  switch (layout) {
    case sm90::kLayoutTN: return instance<CFG, sm90::kLayoutTN, kOutBF16>();
    case sm90::kLayoutNN: return instance<CFG, sm90::kLayoutNN, kOutBF16>();
    default: return instance<CFG, sm90::kLayoutNT, kOutBF16>();
  }
}

// The instance of (config, layout, output); nullptr when sm90.cmake built none (float32 output:
// layout TN in the default configuration, layout NT in those the no-recipe wgrad takes, both in
// the k-grouped wgrad's).
Sm90Runner runner(int cfg, int layout, int out) {
  if (out == kOutF32) {
    if (layout == sm90::kLayoutTN && cfg == sm90::kCfgBf16) {
      return instance<sm90::kCfgBf16, sm90::kLayoutTN, kOutF32>();
    }
    if (layout == sm90::kLayoutTN && cfg == sm90::kCfgKGrouped) {
      return instance<sm90::kCfgKGrouped, sm90::kLayoutTN, kOutF32>();
    }
    if (layout != sm90::kLayoutNT) return nullptr;
    switch (cfg) {
      case sm90::kCfgBf16: return instance<sm90::kCfgBf16, sm90::kLayoutNT, kOutF32>();
      case sm90::kCfgKGrouped: return instance<sm90::kCfgKGrouped, sm90::kLayoutNT, kOutF32>();
#ifndef JAXQUANT_SM90_DEFAULT_CONFIGS_ONLY
      case sm90::kCfgBf16C2x1: return instance<sm90::kCfgBf16C2x1, sm90::kLayoutNT, kOutF32>();
      case sm90::kCfgBf16M256: return instance<sm90::kCfgBf16M256, sm90::kLayoutNT, kOutF32>();
#endif
      default: return nullptr;
    }
  }
  switch (cfg) {
    case sm90::kCfgBf16: return bf16_out<sm90::kCfgBf16>(layout);
    case sm90::kCfgKGrouped:  // wgrads (mode 1) of layouts NT and TN
      return layout == sm90::kLayoutNT   ? instance<sm90::kCfgKGrouped, sm90::kLayoutNT, kOutBF16>()
             : layout == sm90::kLayoutTN ? instance<sm90::kCfgKGrouped, sm90::kLayoutTN, kOutBF16>()
                                         : nullptr;
    case sm90::kCfgKGroupedPingpong:  // the same, pingpong (bfloat16 out only)
      return layout == sm90::kLayoutNT ? instance<sm90::kCfgKGroupedPingpong, sm90::kLayoutNT, kOutBF16>()
             : layout == sm90::kLayoutTN
                 ? instance<sm90::kCfgKGroupedPingpong, sm90::kLayoutTN, kOutBF16>()
                 : nullptr;
#ifndef JAXQUANT_SM90_DEFAULT_CONFIGS_ONLY
    case sm90::kCfgBf16C2x1: return bf16_out<sm90::kCfgBf16C2x1>(layout);
    case sm90::kCfgBf16Pingpong: return bf16_out<sm90::kCfgBf16Pingpong>(layout);
    case sm90::kCfgBf16M256: return bf16_out<sm90::kCfgBf16M256>(layout);
    case sm90::kCfgBf16N128: return bf16_out<sm90::kCfgBf16N128>(layout);
    case sm90::kCfgBf16N176: return bf16_out<sm90::kCfgBf16N176>(layout);
#endif
    default: return nullptr;
  }
}

ffi::Error GroupedGemmBf16Cuda(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b,
                               ffi::AnyBuffer pstarts, ffi::AnyBuffer alpha,
                               ffi::AnyBuffer row_scale, ffi::Result<ffi::AnyBuffer> out,
                               ffi::Result<ffi::AnyBuffer> workspace, int32_t mode, bool a_k_major,
                               bool b_k_major, bool has_alpha, bool has_row_scale, int32_t config,
                               bool raster_along_n) {
  Bf16GemmParams p;
  JQ_RETURN_IF_ERROR(decode_grouped_gemm_bf16(kTarget, a, b, pstarts, alpha, row_scale, out, mode,
                                              a_k_major, b_k_major, has_alpha, has_row_scale,
                                              &p));
  const std::string why = unserved(p);
  if (!why.empty()) return invalid(kTarget, why);
  JQ_RETURN_IF_ERROR(check_sm90_workspace(kTarget, *workspace, sm90::workspace_bytes(p.G)));
  const int layout = layout_of(p);
  if ((config == sm90::kCfgKGrouped || config == sm90::kCfgKGroupedPingpong) &&
      p.mode != kModeWgrad) {
    return invalid(kTarget, "config " + std::to_string(config) +
                                (config == sm90::kCfgKGrouped ? " (bf16_kgrouped)"
                                                              : " (bf16_kgrouped_pingpong)") +
                                " serves wgrads (mode 1) only; got mode " + std::to_string(p.mode));
  }
  const Sm90Runner run = p.row_scale ? row_scaled_runner(config, layout, p.out_kind)
                                     : runner(config, layout, p.out_kind);
  if (run == nullptr) {
    return invalid(kTarget, "config " + std::to_string(config) + " has no " +
                                (p.row_scale ? "row-scaled " : "") + "instance for layout " +
                                std::to_string(layout) + " -> " +
                                (p.out_kind == kOutF32 ? "float32" : "bfloat16") +
                                " (jaxquant/backends/ffi/grouped/sm90_configs.py lists the "
                                "instances)");
  }
  sm90::Problem q = sm90_problem(p, p.alpha, *workspace, config, raster_along_n);
  q.a = reinterpret_cast<const uint8_t*>(p.a);
  q.b = reinterpret_cast<const uint8_t*>(p.b);
  q.layout = layout;
  q.a_elem = q.b_elem = sm90::kBF16;
  q.row_scale = p.row_scale;
  return run_sm90(kTarget, run, q, stream);
}

}  // namespace

JQ_DEFINE_CUDA_HANDLER(kGroupedGemmBf16Cuda, GroupedGemmBf16Cuda, BindGroupedGemmBf16);

std::vector<Target> grouped_sm90_bf16_cuda_targets() {
  return {target(kTarget, kGroupedGemmBf16Cuda)};
}

}  // namespace jqffi
