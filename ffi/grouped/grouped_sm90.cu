// CUDA handler of jaxquant_grouped_gemm_sm90: the grouped GEMM of jaxquant_grouped_gemm for
// per-tensor FP8 and Float8Block (E4M3, 1x128 x 128x128 or 1x128 x 1x128) operands on Hopper,
// through the CUTLASS pointer-array grouped kernels (grouped/sm90/). Same arguments and
// attributes as jaxquant_grouped_gemm plus a u8 workspace result of at least
// sm90::workspace_bytes(G, sm90::block_scale_floats(...)) bytes. This file holds no CUTLASS code
// (the instances are compiled in their own translation units); it checks that the problem is one
// the kernel serves (else an error naming what is not: the Python side decides, never this
// handler) and dispatches on the (A, B, output) types and the `config` attribute (sm90::kCfg*;
// `raster_along_n` orders the persistent scheduler's tiles along N), the configuration
// jaxquant/backends/ffi/grouped/sm90_configs.py chose at trace time. A configuration without an
// instance for the types is an error, never a substitute.
#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "cuda_handler.h"
#include "grouped/grouped_args.h"
#include "grouped/handlers.h"
#include "grouped/sm90_call.h"

namespace jqffi {
namespace {

constexpr const char* kTarget = "jaxquant_grouped_gemm_sm90";

bool is_block(int scaling) { return scaling == kScaleBlock || scaling == kScaleBlock2d; }

// Why the sm90 kernel cannot serve `p` ("" when it can). Mirrors
// jaxquant.backends.ffi.grouped.support.sm90_unsupported.
std::string unserved(const GemmParams& p) {
  const bool block = is_block(p.a.scaling) || is_block(p.b.scaling);
  if (block) {
    // Float8Block: A 1 x 128 blocks, B 128 x 128 tiles (mode 0 expert weights) or 1 x 128.
    if (p.a.scaling != kScaleBlock || !is_block(p.b.scaling)) {
      return "Float8Block operands need a with 1x128 blocks and b Float8Block (a_scaling = 4, "
             "b_scaling = 4 or 5)";
    }
    if (p.mode == kModeWgrad && p.b.scaling != kScaleBlock) {
      return "the Float8Block wgrad needs 1x128 blocks on both operands";
    }
    if (p.a.elem != Elem::kE4M3 || p.b.elem != Elem::kE4M3) {
      return "Float8Block operands must both be E4M3";
    }
    if (p.group_factor) return "per-group factors are not taken with Float8Block";
  } else if (p.a.scaling != kScalePerTensor || p.b.scaling != kScalePerTensor) {
    return "operands must be per-tensor FP8 (a_scaling = b_scaling = 0) or Float8Block";
  }
  if (p.a.elem == Elem::kE2M1 || p.b.elem == Elem::kE2M1) return "operands must be FP8, not FP4";
  if (p.a.elem == Elem::kE5M2 && p.b.elem == Elem::kE5M2) return "E5M2 x E5M2 has no instance";
  if (p.row_factor || p.col_factor) return "row / column factors are not taken";
  if (p.bias) return "the bias is not taken";
  if (p.out_kind != kOutBF16 && p.out_kind != kOutF32) return "out must be bfloat16 or float32";
  if (std::string why = sm90_output_reason(p); !why.empty()) return why;
  if (block) {
    if (p.mode == kModeRagged && p.K % sm90::kBlockK) return "K must be a multiple of 128";
    if (p.mode == kModeWgrad && p.L % sm90::kBlockK) {
      return "the token length L must be a multiple of 128";
    }
  }
  if (p.mode == kModeRagged && p.K % 16) return "K must be a multiple of 16";
  if (p.mode == kModeWgrad && p.L % 16) return "the token length L must be a multiple of 16";
  return sm90_device_reason(p);
}


// The instance of types (a, b, out) in configuration `cfg`; nullptr when sm90.cmake built none
// (the alternative configurations exist for E4M3 x E4M3 -> bfloat16, n176 also for E5M2 x E4M3
// -> bfloat16; the k-grouped wgrad for E4M3 x E4M3 / E5M2, both outputs).
Sm90Runner runner(int a, int b, int out, int cfg) {
  using sm90::kE4M3;
  using sm90::kE5M2;
  using sm90::run_instance;
  constexpr int F32 = kOutF32, BF16 = kOutBF16;
  const bool f32 = out == F32;
  if (cfg == sm90::kCfgKGroupedFp8) {  // wgrads (mode 1) of E4M3 x E4M3 / E5M2
    if (a != kE4M3) return nullptr;
    if (b == kE4M3) {
      return f32 ? run_instance<kE4M3, kE4M3, F32, sm90::kCfgKGroupedFp8>
                 : run_instance<kE4M3, kE4M3, BF16, sm90::kCfgKGroupedFp8>;
    }
    return f32 ? run_instance<kE4M3, kE5M2, F32, sm90::kCfgKGroupedFp8>
               : run_instance<kE4M3, kE5M2, BF16, sm90::kCfgKGroupedFp8>;
  }
  if (cfg != sm90::kCfgDefault) {
#ifndef JAXQUANT_SM90_DEFAULT_CONFIGS_ONLY  // sm90.cmake's JAXQUANT_SM90_ALL_CONFIGS
    if (cfg == sm90::kCfgN176 && a == kE5M2 && b == kE4M3 && out == BF16) {
      return run_instance<kE5M2, kE4M3, BF16, sm90::kCfgN176>;
    }
#endif
    if (a != kE4M3 || b != kE4M3 || out != BF16) return nullptr;
#ifndef JAXQUANT_SM90_DEFAULT_CONFIGS_ONLY
    switch (cfg) {
      case sm90::kCfgC1x1: return run_instance<kE4M3, kE4M3, BF16, sm90::kCfgC1x1>;
      case sm90::kCfgN176: return run_instance<kE4M3, kE4M3, BF16, sm90::kCfgN176>;
      case sm90::kCfgFast: return run_instance<kE4M3, kE4M3, BF16, sm90::kCfgFast>;
      case sm90::kCfgPingpongFast: return run_instance<kE4M3, kE4M3, BF16, sm90::kCfgPingpongFast>;
      case sm90::kCfgC2x1: return run_instance<kE4M3, kE4M3, BF16, sm90::kCfgC2x1>;
      case sm90::kCfgWideFast: return run_instance<kE4M3, kE4M3, BF16, sm90::kCfgWideFast>;
      default: return nullptr;
    }
#else
    return nullptr;
#endif
  }
  if (a == kE4M3 && b == kE4M3) return f32 ? run_instance<kE4M3, kE4M3, F32> : run_instance<kE4M3, kE4M3, BF16>;
  if (a == kE5M2 && b == kE4M3) return f32 ? run_instance<kE5M2, kE4M3, F32> : run_instance<kE5M2, kE4M3, BF16>;
  if (a == kE4M3 && b == kE5M2) return f32 ? run_instance<kE4M3, kE5M2, F32> : run_instance<kE4M3, kE5M2, BF16>;
  return nullptr;
}

// The Float8Block instance; the alternative configurations exist for 1x128 B -> bfloat16 only.
Sm90Runner block_runner(int b_rows, int out, int cfg) {
  using sm90::run_block_instance;
  constexpr int F32 = kOutF32, BF16 = kOutBF16;
  constexpr int R1 = sm90::kBlockRows1, R128 = sm90::kBlockRows128;
  const bool f32 = out == F32;
  if (cfg != sm90::kCfgDefault) {
    if (b_rows != R1 || out != BF16) return nullptr;
#ifndef JAXQUANT_SM90_DEFAULT_CONFIGS_ONLY
    switch (cfg) {
      case sm90::kCfgC1x1: return run_block_instance<R1, BF16, sm90::kCfgC1x1>;
      case sm90::kCfgC2x1: return run_block_instance<R1, BF16, sm90::kCfgC2x1>;
      default: return nullptr;
    }
#else
    return nullptr;
#endif
  }
  if (b_rows == R128) return f32 ? run_block_instance<R128, F32> : run_block_instance<R128, BF16>;
  return f32 ? run_block_instance<R1, F32> : run_block_instance<R1, BF16>;
}

// The sm90 element of an FP8 operand.
int sm90_elem(Elem e) { return e == Elem::kE5M2 ? sm90::kE5M2 : sm90::kE4M3; }

ffi::Error GroupedGemmSm90Cuda(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer a_scale,
                               ffi::AnyBuffer b, ffi::AnyBuffer b_scale, ffi::AnyBuffer pstarts,
                               ffi::AnyBuffer row_factor, ffi::AnyBuffer col_factor,
                               ffi::AnyBuffer group_factor, ffi::AnyBuffer bias,
                               ffi::Result<ffi::AnyBuffer> out,
                               ffi::Result<ffi::AnyBuffer> workspace, int32_t mode,
                               int32_t a_scaling, int32_t b_scaling, bool has_row_factor,
                               bool has_col_factor, bool has_group_factor, bool has_bias,
                               int32_t config, bool raster_along_n) {
  GemmParams p;
  JQ_RETURN_IF_ERROR(decode_grouped_gemm(kTarget, a, a_scale, b, b_scale, pstarts, row_factor,
                                         col_factor, group_factor, bias, out, mode, a_scaling,
                                         b_scaling, has_row_factor, has_col_factor,
                                         has_group_factor, has_bias, &p));
  const std::string why = unserved(p);
  if (!why.empty()) return invalid(kTarget, why + " (use jaxquant_grouped_gemm)");
  const bool block = is_block(p.a.scaling);
  const int b_rows = p.b.scaling == kScaleBlock2d ? sm90::kBlockRows128 : sm90::kBlockRows1;
  const size_t scale_floats =
      sm90::block_scale_floats(p.mode, block, p.G, p.L, p.M, p.N, p.K, b_rows);
  JQ_RETURN_IF_ERROR(
      check_sm90_workspace(kTarget, *workspace, sm90::workspace_bytes(p.G, scale_floats)));
  if (config == sm90::kCfgKGroupedFp8 && (p.mode != kModeWgrad || block)) {
    return invalid(kTarget, "config " + std::to_string(config) +
                                " (kgrouped) serves per-tensor FP8 wgrads (mode 1) only");
  }
  const Sm90Runner run = block ? block_runner(b_rows, p.out_kind, config)
                           : runner(sm90_elem(p.a.elem), sm90_elem(p.b.elem), p.out_kind, config);
  if (run == nullptr) {
    return invalid(kTarget, "config " + std::to_string(config) + " has no instance for " +
                                (block ? "this Float8Block pair" : "these FP8 types") +
                                " and output (jaxquant/backends/ffi/grouped/"
                                "sm90_configs.py lists the instances)");
  }
  sm90::Problem q = sm90_problem(p, p.group_factor, *workspace, config, raster_along_n);
  q.a = p.a.data;
  q.b = p.b.data;
  q.a_elem = sm90_elem(p.a.elem);
  q.b_elem = sm90_elem(p.b.elem);
  q.block_scaled = block;
  if (block) {
    q.a_scale = reinterpret_cast<const float*>(p.a.scale);
    q.b_scale = reinterpret_cast<const float*>(p.b.scale);
    q.b_block_rows = b_rows;
  }
  return run_sm90(kTarget, run, q, stream);
}

}  // namespace

JQ_DEFINE_CUDA_HANDLER(kGroupedGemmSm90Cuda, GroupedGemmSm90Cuda, BindGroupedGemmSm90);

std::vector<Target> grouped_sm90_cuda_targets() { return {target(kTarget, kGroupedGemmSm90Cuda)}; }

}  // namespace jqffi
