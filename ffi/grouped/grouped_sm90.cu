// CUDA handler of jaxquant_grouped_gemm_sm90: the grouped GEMM of jaxquant_grouped_gemm for
// per-tensor FP8 and Float8Block (E4M3, 1x128 x 128x128 or 1x128 x 1x128) operands on Hopper,
// through the CUTLASS pointer-array grouped kernels (grouped/sm90/). Same arguments and
// attributes as jaxquant_grouped_gemm plus a u8 workspace result of at least
// sm90::workspace_bytes(G, sm90::block_scale_floats(...)) bytes. This file holds no CUTLASS code (the
// instances are compiled in their own translation units); it checks that the problem is one
// the kernel serves (else an error naming what is not: the Python side decides, never this
// handler) and dispatches on the (A, B, output) types and the `config` attribute (sm90::kCfg*;
// `raster_along_n` orders the persistent scheduler's tiles along N), the configuration
// jaxquant/backends/ffi/grouped/sm90_configs.py chose at trace time. A configuration without an
// instance for the types is an error, never a substitute.
#include <cuda_runtime.h>

#include <string>

#include "grouped/cuda_targets.h"
#include "grouped/grouped_args.h"
#include "grouped/sm90/sm90_gemm.h"

namespace jqgrouped {
namespace {

using Stream = ffi::PlatformStream<cudaStream_t>;
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
    if (p.a.elem != kElemE4M3 || p.b.elem != kElemE4M3) {
      return "Float8Block operands must both be E4M3";
    }
    if (p.group_factor) return "per-group factors are not taken with Float8Block";
  } else if (p.a.scaling != kScalePerTensor || p.b.scaling != kScalePerTensor) {
    return "operands must be per-tensor FP8 (a_scaling = b_scaling = 0) or Float8Block";
  }
  if (p.a.elem == kElemE2M1 || p.b.elem == kElemE2M1) return "operands must be FP8, not FP4";
  if (p.a.elem == kElemE5M2 && p.b.elem == kElemE5M2) return "E5M2 x E5M2 has no instance";
  if (p.row_factor || p.col_factor) return "row / column factors are not taken";
  if (p.bias) return "the bias is not taken";
  if (p.out_kind != kOutBF16 && p.out_kind != kOutF32) return "out must be bfloat16 or float32";
  const int64_t out_align = p.out_kind == kOutF32 ? 4 : 8;
  if (p.N % out_align) return "N must be a multiple of " + std::to_string(out_align);
  if (block) {
    if (p.mode == kModeRagged && p.K % sm90::kBlockK) return "K must be a multiple of 128";
    if (p.mode == kModeWgrad && p.L % sm90::kBlockK) {
      return "the token length L must be a multiple of 128";
    }
  }
  if (p.mode == kModeRagged && p.K % 16) return "K must be a multiple of 16";
  if (p.mode == kModeWgrad && p.L % 16) return "the token length L must be a multiple of 16";
  if (p.G >= (int64_t{1} << 24)) return "too many groups";
  return sm90::device_reason();
}

using Runner = std::string (*)(const sm90::Problem&, cudaStream_t);

// The instance of types (a, b, out) in configuration `cfg`; nullptr when sm90.cmake built none
// (the alternative configurations exist for E4M3 x E4M3 -> bfloat16 only).
Runner runner(int a, int b, int out, int cfg) {
  using sm90::kE4M3;
  using sm90::kE5M2;
  using sm90::run_instance;
  constexpr int F32 = sm90::kOutF32, BF16 = sm90::kOutBF16;
  const bool f32 = out == F32;
  if (cfg != sm90::kCfgDefault) {
    if (a != kE4M3 || b != kE4M3 || out != BF16) return nullptr;
    switch (cfg) {
      case sm90::kCfgC1x1: return run_instance<kE4M3, kE4M3, BF16, sm90::kCfgC1x1>;
      case sm90::kCfgN176: return run_instance<kE4M3, kE4M3, BF16, sm90::kCfgN176>;
      case sm90::kCfgFast: return run_instance<kE4M3, kE4M3, BF16, sm90::kCfgFast>;
      case sm90::kCfgPingpongFast: return run_instance<kE4M3, kE4M3, BF16, sm90::kCfgPingpongFast>;
      default: return nullptr;
    }
  }
  if (a == kE4M3 && b == kE4M3) return f32 ? run_instance<kE4M3, kE4M3, F32> : run_instance<kE4M3, kE4M3, BF16>;
  if (a == kE5M2 && b == kE4M3) return f32 ? run_instance<kE5M2, kE4M3, F32> : run_instance<kE5M2, kE4M3, BF16>;
  if (a == kE4M3 && b == kE5M2) return f32 ? run_instance<kE4M3, kE5M2, F32> : run_instance<kE4M3, kE5M2, BF16>;
  return nullptr;
}

// The Float8Block instance; the alternative configurations exist for 1x128 B -> bfloat16 only.
Runner block_runner(int b_rows, int out, int cfg) {
  using sm90::run_block_instance;
  constexpr int F32 = sm90::kOutF32, BF16 = sm90::kOutBF16;
  constexpr int R1 = sm90::kBlockRows1, R128 = sm90::kBlockRows128;
  const bool f32 = out == F32;
  if (cfg != sm90::kCfgDefault) {
    if (b_rows != R1 || out != BF16) return nullptr;
    switch (cfg) {
      case sm90::kCfgC1x1: return run_block_instance<R1, BF16, sm90::kCfgC1x1>;
      case sm90::kCfgC2x1: return run_block_instance<R1, BF16, sm90::kCfgC2x1>;
      default: return nullptr;
    }
  }
  if (b_rows == R128) return f32 ? run_block_instance<R128, F32> : run_block_instance<R128, BF16>;
  return f32 ? run_block_instance<R1, F32> : run_block_instance<R1, BF16>;
}

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
  JQ_RETURN_IF_ERROR(decode_gemm(kTarget, a, a_scale, b, b_scale, pstarts, row_factor, col_factor,
                                 group_factor, bias, out, mode, a_scaling, b_scaling,
                                 has_row_factor, has_col_factor, has_group_factor, has_bias, &p));
  const std::string why = unserved(p);
  if (!why.empty()) return jqffi::invalid(kTarget, why + " (use jaxquant_grouped_gemm)");
  const bool block = is_block(p.a.scaling);
  const int b_rows = p.b.scaling == kScaleBlock2d ? sm90::kBlockRows128 : sm90::kBlockRows1;
  const size_t scale_floats =
      sm90::block_scale_floats(p.mode, block, p.G, p.L, p.M, p.N, p.K, b_rows);
  const auto wdims = workspace->dimensions();
  const int64_t need = static_cast<int64_t>(sm90::workspace_bytes(p.G, scale_floats));
  if (workspace->element_type() != ffi::DataType::U8 || wdims.size() != 1 || wdims[0] < need) {
    return jqffi::invalid(kTarget, "workspace must be uint8[>= " + std::to_string(need) +
                                       "]; got " + jqffi::dtype_name(workspace->element_type()) +
                                       jqffi::dims_str(wdims));
  }
  const int out_kind = p.out_kind == kOutF32 ? sm90::kOutF32 : sm90::kOutBF16;
  const Runner run =
      block ? block_runner(b_rows, out_kind, config)
            : runner(p.a.elem == kElemE5M2 ? sm90::kE5M2 : sm90::kE4M3,
                     p.b.elem == kElemE5M2 ? sm90::kE5M2 : sm90::kE4M3, out_kind, config);
  if (run == nullptr) {
    return jqffi::invalid(kTarget, "config " + std::to_string(config) + " has no instance for " +
                                       (block ? "this Float8Block pair" : "these FP8 types") +
                                       " and output (jaxquant/backends/ffi/grouped/"
                                       "sm90_configs.py lists the instances)");
  }
  if (p.L == 0 || p.N == 0 || p.M == 0) return ffi::Error::Success();
  sm90::Problem q;
  q.mode = p.mode;
  q.G = p.G;
  q.L = p.L;
  q.M = p.M;
  q.N = p.N;
  q.K = p.K;
  q.pstarts = p.pstarts;
  q.a = p.a.data;
  q.b = p.b.data;
  q.alpha = p.group_factor;
  q.out = p.out;
  q.a_elem = p.a.elem == kElemE5M2 ? sm90::kE5M2 : sm90::kE4M3;
  q.b_elem = p.b.elem == kElemE5M2 ? sm90::kE5M2 : sm90::kE4M3;
  q.out_kind = out_kind;
  q.block_scaled = block;
  if (block) {
    q.a_scale = reinterpret_cast<const float*>(p.a.scale);
    q.b_scale = reinterpret_cast<const float*>(p.b.scale);
    q.b_block_rows = b_rows;
  }
  q.workspace = workspace->untyped_data();
  q.workspace_bytes = static_cast<size_t>(wdims[0]);
  q.config = config;
  q.raster_along_n = raster_along_n;
  const std::string err = run(q, stream);
  if (!err.empty()) return ffi::Error::Internal(std::string(kTarget) + ": " + err);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kGroupedGemmSm90Cuda, GroupedGemmSm90Cuda,
                       BindGroupedGemmSm90(ffi::Ffi::Bind().Ctx<Stream>()),
                       {ffi::Traits::kCmdBufferCompatible});

std::vector<CudaTarget> GroupedSm90Targets() {
  return {{kTarget, reinterpret_cast<void*>(kGroupedGemmSm90Cuda)}, GroupedSm90Bf16Target()};
}

}  // namespace jqgrouped
