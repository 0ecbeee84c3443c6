// The CUTLASS Hopper grouped GEMM instances behind jaxquant_grouped_gemm_sm90 (per-tensor FP8)
// and jaxquant_grouped_gemm_bf16 (bfloat16), sm_90a: sm90_instance.cuh's kernel with operands
// read as stored, no block scales (per-tensor FP8 scales and the bf16 target's factors are the
// epilogue's alpha[g]). For FP8 the mainloop promotes the tensor-core partial sums to float32
// every 4 k-blocks (CUTLASS's two-level accumulation) unless the configuration asks for fast
// accumulation. Run by sm90_launch.cuh.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "grouped/sm90/sm90_launch.cuh"

namespace jqffi {
namespace sm90 {

// Per-tensor FP8 (A, B: kE4M3 / kE5M2, layout TN) or bfloat16 (kBF16 x kBF16, any layout).
template <int A, int B, int LAYOUT>
struct DenseOperands {
  static_assert(LAYOUT == kLayoutTN || (A == kBF16 && B == kBF16),
                "FP8 wgmma reads K-major operands only (layout TN)");
  static_assert((A == kBF16) == (B == kBF16), "bfloat16 pairs with bfloat16 only");
  using ElementA = typename ElementOf<A>::type;
  using ElementB = typename ElementOf<B>::type;
  static constexpr bool kAKMajor = a_k_major(LAYOUT), kBKMajor = b_k_major(LAYOUT);
  // CUTLASS's tags: A RowMajor = [M, K] K-major; B ColumnMajor = [N, K] K-major.
  using MainloopLayoutA =
      cute::conditional_t<kAKMajor, cutlass::layout::RowMajor, cutlass::layout::ColumnMajor>*;
  using MainloopLayoutB =
      cute::conditional_t<kBKMajor, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>*;
  template <class Config>
  using Schedule = cute::conditional_t<
      Config::kPingpong,
      cute::conditional_t<Config::kFast,
                          cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8FastAccum,
                          cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong>,
      cute::conditional_t<Config::kFast,
                          cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8FastAccum,
                          cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>>;
  // mode 1: a K-major operand's group starts 16 bytes into its rows at least.
  static constexpr int64_t kTokenAlign = 16 / sizeof(ElementA);

  static constexpr bool kBlockScaled = false;
  static constexpr size_t kScaleBytesPerGroup = 0;
  struct Scales {};
  template <class Take>
  static Scales carve_scales(Take&, const Problem&) {
    return {};
  }
};

// The k-grouped wgrad's launcher (sm90_kgrouped.cuh, included by its instances' translation
// units only, so the other instances do not depend on it).
template <class K>
std::string launch_kgrouped(const Problem& p, cudaStream_t stream);

template <int A, int B, int OUT, int CFG, int LAYOUT, int EPI>
std::string run_instance(const Problem& p, cudaStream_t stream) {
  if (p.layout != LAYOUT) return "operand layout does not match the instance";
  using K = Instance<DenseOperands<A, B, LAYOUT>, OUT, CFG, EPI>;
  if constexpr (CFG == kCfgKGrouped || CFG == kCfgKGroupedFp8 || CFG == kCfgKGroupedPingpong) {
    static_assert((CFG != kCfgKGroupedFp8) == (A == kBF16) && LAYOUT != kLayoutNN &&
                      EPI == kEpiAlpha,
                  "the k-grouped wgrad takes bfloat16 operands of layout TN or NT (kCfgKGrouped, "
                  "kCfgKGroupedPingpong) or per-tensor FP8 ones of layout TN (kCfgKGroupedFp8)");
    return launch_kgrouped<K>(p, stream);
  } else {
    return launch<K>(p, stream);
  }
}

}  // namespace sm90
}  // namespace jqffi

// Explicit instantiation, used by the generated sm90_inst_*.cu files.
#define JQ_SM90_INSTANTIATE(A, B, OUT, CFG) \
  JQ_SM90_INSTANTIATE_LAYOUT(A, B, OUT, CFG, jqffi::sm90::kLayoutTN)
#define JQ_SM90_INSTANTIATE_LAYOUT(A, B, OUT, CFG, LAYOUT) \
  JQ_SM90_INSTANTIATE_EPI(A, B, OUT, CFG, LAYOUT, jqffi::sm90::kEpiAlpha)
#define JQ_SM90_INSTANTIATE_EPI(A, B, OUT, CFG, LAYOUT, EPI)                     \
  template std::string jqffi::sm90::run_instance<A, B, OUT, CFG, LAYOUT, EPI>(   \
      const jqffi::sm90::Problem&, cudaStream_t);
