// CUDA handler of jaxquant_grouped_gemm_bf16: the bfloat16 grouped GEMM on Hopper through the
// CUTLASS pointer-array instances of grouped/sm90/ (kBF16 x kBF16, three operand layouts), for
// GroupedDense without a recipe, high-precision (Identity) operands and operands decoded exactly
// to bfloat16 by XLA (MXFP8, NVFP4, ...). Arguments: grouped_args.h (decode_gemm_bf16); results
// out and a u8 workspace of at least sm90::workspace_bytes(G) bytes. No CUTLASS code here (the
// instances have their own translation units). It checks that the problem is one an instance
// serves (else an error naming what is not: the Python side, jaxquant.backends.ffi.grouped.bf16,
// decides, never this handler) and dispatches on the layout, the output type and the `config`
// attribute (sm90::kCfgBf16*). A configuration without an instance is an error, never a
// substitute.
#include <cuda_runtime.h>

#include <string>

#include "grouped/cuda_targets.h"
#include "grouped/grouped_args.h"
#include "grouped/sm90/sm90_gemm.h"

namespace jqgrouped {
namespace {

using Stream = ffi::PlatformStream<cudaStream_t>;
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
  const int64_t out_align = p.out_kind == kOutF32 ? 4 : 8;
  if (p.N % out_align) return "N must be a multiple of " + std::to_string(out_align);
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
  if (p.G >= (int64_t{1} << 24)) return "too many groups";
  return sm90::device_reason();
}

using Runner = std::string (*)(const sm90::Problem&, cudaStream_t);

template <int CFG, int LAYOUT, int OUT>
constexpr Runner instance() {
  return sm90::run_instance<sm90::kBF16, sm90::kBF16, OUT, CFG, LAYOUT>;
}

// The instance of (config, layout, output); nullptr when sm90.cmake built none (float32 output:
// the default configuration, layout TN only).
Runner runner(int cfg, int layout, int out) {
  constexpr int TN = sm90::kLayoutTN, NN = sm90::kLayoutNN, NT = sm90::kLayoutNT;
  constexpr int BF16 = sm90::kOutBF16, F32 = sm90::kOutF32;
  if (out == F32) {
    return cfg == sm90::kCfgBf16 && layout == TN ? instance<sm90::kCfgBf16, TN, F32>() : nullptr;
  }
  switch (cfg) {
    case sm90::kCfgBf16:
      return layout == TN   ? instance<sm90::kCfgBf16, TN, BF16>()
             : layout == NN ? instance<sm90::kCfgBf16, NN, BF16>()
                            : instance<sm90::kCfgBf16, NT, BF16>();
    case sm90::kCfgBf16C2x1:
      return layout == TN   ? instance<sm90::kCfgBf16C2x1, TN, BF16>()
             : layout == NN ? instance<sm90::kCfgBf16C2x1, NN, BF16>()
                            : instance<sm90::kCfgBf16C2x1, NT, BF16>();
    case sm90::kCfgBf16Pingpong:
      return layout == TN   ? instance<sm90::kCfgBf16Pingpong, TN, BF16>()
             : layout == NN ? instance<sm90::kCfgBf16Pingpong, NN, BF16>()
                            : instance<sm90::kCfgBf16Pingpong, NT, BF16>();
    default:
      return nullptr;
  }
}

ffi::Error GroupedGemmBf16Cuda(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b,
                               ffi::AnyBuffer pstarts, ffi::AnyBuffer alpha,
                               ffi::Result<ffi::AnyBuffer> out,
                               ffi::Result<ffi::AnyBuffer> workspace, int32_t mode, bool a_k_major,
                               bool b_k_major, bool has_alpha, int32_t config,
                               bool raster_along_n) {
  Bf16GemmParams p;
  JQ_RETURN_IF_ERROR(decode_gemm_bf16(kTarget, a, b, pstarts, alpha, out, mode, a_k_major,
                                      b_k_major, has_alpha, &p));
  const std::string why = unserved(p);
  if (!why.empty()) return jqffi::invalid(kTarget, why);
  const auto wdims = workspace->dimensions();
  const int64_t need = static_cast<int64_t>(sm90::workspace_bytes(p.G));
  if (workspace->element_type() != ffi::DataType::U8 || wdims.size() != 1 || wdims[0] < need) {
    return jqffi::invalid(kTarget, "workspace must be uint8[>= " + std::to_string(need) +
                                       "]; got " + jqffi::dtype_name(workspace->element_type()) +
                                       jqffi::dims_str(wdims));
  }
  const int layout = layout_of(p);
  const int out_kind = p.out_kind == kOutF32 ? sm90::kOutF32 : sm90::kOutBF16;
  const Runner run = runner(config, layout, out_kind);
  if (run == nullptr) {
    return jqffi::invalid(kTarget, "config " + std::to_string(config) + " has no instance for "
                                   "layout " + std::to_string(layout) + " -> " +
                                   (out_kind == sm90::kOutF32 ? "float32" : "bfloat16") +
                                   " (jaxquant/backends/ffi/grouped/sm90_configs.py lists the "
                                   "instances)");
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
  q.a = reinterpret_cast<const uint8_t*>(p.a);
  q.b = reinterpret_cast<const uint8_t*>(p.b);
  q.layout = layout;
  q.alpha = p.alpha;
  q.out = p.out;
  q.a_elem = q.b_elem = sm90::kBF16;
  q.out_kind = out_kind;
  q.workspace = workspace->untyped_data();
  q.workspace_bytes = static_cast<size_t>(wdims[0]);
  q.config = config;
  q.raster_along_n = raster_along_n;
  const std::string err = run(q, stream);
  if (!err.empty()) return ffi::Error::Internal(std::string(kTarget) + ": " + err);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kGroupedGemmBf16Cuda, GroupedGemmBf16Cuda,
                       BindGroupedGemmBf16(ffi::Ffi::Bind().Ctx<Stream>()),
                       {ffi::Traits::kCmdBufferCompatible});

CudaTarget GroupedSm90Bf16Target() {
  return {kTarget, reinterpret_cast<void*>(kGroupedGemmBf16Cuda)};
}

}  // namespace jqgrouped
