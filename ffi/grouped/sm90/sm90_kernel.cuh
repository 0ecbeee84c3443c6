// The CUTLASS Hopper grouped GEMM instances behind jaxquant_grouped_gemm_sm90 (per-tensor FP8)
// and jaxquant_grouped_gemm_bf16 (bfloat16), sm_90a.
//
// One CUTLASS 3.x/4.x pointer-array grouped GEMM (GroupProblemShape, persistent,
// warp-specialized cooperative or pingpong: TMA producer warp, wgmma consumer warpgroups; for
// FP8 the two-level accumulation that promotes the tensor-core partial sums to float32 every 4
// k-blocks; TMA-store epilogue D = alpha[g] * acc). The two modes of jaxquant_grouped_gemm
// differ only in the per-group pointers and strides:
//   mode 0 (ragged rows x experts): group g = rows [pstarts[g], pstarts[g+1]) of a [L, K] times
//     b[g] ([N, K] K-major, or [K, N] N-major for bf16 kLayoutNN) -> the same rows of out [L, N];
//   mode 1 (wgrad): the tokens [pstarts[g], pstarts[g+1]) of a and b (K-major: a [M, L] and
//     b [N, L], row stride L; bf16 kLayoutNT: a [L, M] and b [L, N], the tokens themselves)
//     -> out[g] [M, N].
// A setup kernel writes every group's problem shape, pointers and strides from the device-side
// `pstarts` into the workspace (no host sync: CUDA-graph compatible) and writes the zeros the
// GEMM never touches (mode 0: rows past the last group; mode 1: the outputs of empty groups,
// which get a 0 x N x 0 problem so the tile scheduler skips them); sm90_launch.cuh runs it.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "grouped/sm90/sm90_gemm.h"
#include "grouped/sm90/sm90_launch.cuh"

namespace jqgrouped {
namespace sm90 {

template <int E> struct ElementOf { using type = cutlass::float_e4m3_t; };
template <> struct ElementOf<kE5M2> { using type = cutlass::float_e5m2_t; };
template <> struct ElementOf<kBF16> { using type = cutlass::bfloat16_t; };
template <int O> struct OutputOf { using type = cutlass::bfloat16_t; };
template <> struct OutputOf<kOutF32> { using type = float; };

// Tile, cluster and schedule of each configuration (kCfg* in sm90_gemm.h).
// kCfgDefault: 128 x 128 x 128 tiles: with the FP8 promotion each consumer warpgroup holds two
// 64 x 128 float32 accumulators (128 registers); wider tiles would spill. Cluster 1 x 2: the two
// CTAs of a cluster share (multicast) the A tile.
template <int CFG>
struct TileConfig {
  using TileShape = cute::Shape<cute::_128, cute::_128, cute::_128>;
  using ClusterShape = cute::Shape<cute::_1, cute::_2, cute::_1>;
  static constexpr bool kPingpong = false;  // two consumer warpgroups on two tiles, else one tile
  static constexpr bool kFast = false;      // FP8 fast accumulation (no float32 promotion)
};
// No cluster: the tile grid of each group is not rounded up to the cluster (N = 1408 has 11
// column tiles of 128; a 1 x 2 cluster computes 12).
template <>
struct TileConfig<kCfgC1x1> : TileConfig<kCfgDefault> {
  using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
};
// 176-wide tiles: N = 1408 (Qwen-MoE fc1) is exactly 8 of them; each warpgroup's two 64 x 176
// float32 accumulators take 176 registers. Needs CUTLASS's extended wgmma shapes
// (CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED, defined by the generated translation unit).
template <>
struct TileConfig<kCfgN176> : TileConfig<kCfgC1x1> {
  using TileShape = cute::Shape<cute::_128, cute::Int<176>, cute::_128>;
};
// Fast accumulation: the wgmma accumulator is the result (no promotion every k-block).
template <>
struct TileConfig<kCfgFast> : TileConfig<kCfgC1x1> {
  static constexpr bool kFast = true;
};
// Pingpong: each consumer warpgroup owns a whole 128 x 128 tile (128 accumulator registers with
// fast accumulation; the promotion's second set would spill), and one warpgroup's epilogue runs
// under the other's mainloop (a short-K group is mostly epilogue).
template <>
struct TileConfig<kCfgPingpongFast> : TileConfig<kCfgFast> {
  static constexpr bool kPingpong = true;
};
// Cluster 2 x 1: the two CTAs of a cluster share (multicast) the B tile.
template <>
struct TileConfig<kCfgC2x1> : TileConfig<kCfgDefault> {
  using ClusterShape = cute::Shape<cute::_2, cute::_1, cute::_1>;
};
// bfloat16: no promotion, so each cooperative warpgroup's 64 x 256 float32 accumulator (128
// registers) fits a 128 x 256 tile; 64-deep k-tiles (128-byte bf16 rows, the widest TMA
// swizzle): (128 + 256) x 64 x 2 bytes = 48 KiB a stage, 4 stages. Cluster 1 x 2 (A multicast):
// N tiles of the bench shapes (1408 = 5.5 x 256, 14336 = 56 x 256) round to an even count
// anyway, while a group of 210..299 rows has 2 or 3 M tiles (a 2 x 1 cluster would round 3 up).
template <>
struct TileConfig<kCfgBf16> : TileConfig<kCfgDefault> {
  using TileShape = cute::Shape<cute::_128, cute::_256, cute::_64>;
};
// The same tile with cluster 2 x 1 (B multicast: a weight tile shared by two row tiles).
template <>
struct TileConfig<kCfgBf16C2x1> : TileConfig<kCfgBf16> {
  using ClusterShape = cute::Shape<cute::_2, cute::_1, cute::_1>;
};
// Small groups: each consumer warpgroup its own 64 x 128 tile (64 accumulator registers), one's
// epilogue under the other's mainloop; 64-row tiles waste less of a short group than 128.
template <>
struct TileConfig<kCfgBf16Pingpong> : TileConfig<kCfgDefault> {
  using TileShape = cute::Shape<cute::_64, cute::_128, cute::_128>;
  using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
  static constexpr bool kPingpong = true;
};

template <int A, int B, int OUT, int CFG = kCfgDefault, int LAYOUT = kLayoutTN>
struct Kernel {
  using ElementA = typename ElementOf<A>::type;
  using ElementB = typename ElementOf<B>::type;
  using ElementD = typename OutputOf<OUT>::type;
  static_assert(LAYOUT == kLayoutTN || (A == kBF16 && B == kBF16),
                "FP8 wgmma reads K-major operands only (layout TN)");
  static_assert((A == kBF16) == (B == kBF16), "bfloat16 pairs with bfloat16 only");
  static constexpr bool kAKMajor = a_k_major(LAYOUT), kBKMajor = b_k_major(LAYOUT);
  // CUTLASS's tags: A RowMajor = [M, K] K-major; B ColumnMajor = [N, K] K-major.
  using LayoutA = cute::conditional_t<kAKMajor, cutlass::layout::RowMajor,
                                      cutlass::layout::ColumnMajor>;
  using LayoutB = cute::conditional_t<kBKMajor, cutlass::layout::ColumnMajor,
                                      cutlass::layout::RowMajor>;
  using LayoutD = cutlass::layout::RowMajor;
  // 16-byte TMA rows.
  static constexpr int kAlignA = 16 / sizeof(ElementA), kAlignB = 16 / sizeof(ElementB),
                       kAlignD = 16 / sizeof(ElementD);
  using Config = TileConfig<CFG>;
  using TileShape = typename Config::TileShape;
  using ClusterShape = typename Config::ClusterShape;
  using KernelSchedule = cute::conditional_t<
      Config::kPingpong,
      cute::conditional_t<Config::kFast,
                          cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8FastAccum,
                          cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong>,
      cute::conditional_t<Config::kFast,
                          cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8FastAccum,
                          cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>>;
  using EpilogueSchedule =
      cute::conditional_t<Config::kPingpong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                          cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, LayoutD*, kAlignD, ElementD, LayoutD*, kAlignD, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA*, kAlignA,
      ElementB, LayoutB*, kAlignB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;

  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop,
                                                          CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
  using StrideA = typename GemmKernel::InternalStrideA;
  using StrideB = typename GemmKernel::InternalStrideB;
  using StrideD = typename GemmKernel::InternalStrideD;
};

// The per-group arrays in the workspace, each 256-byte aligned.
template <class K>
struct Setup {
  typename ProblemShape::UnderlyingProblemShape* shapes;
  const typename K::ElementA** ptr_a;
  const typename K::ElementB** ptr_b;
  typename K::ElementD** ptr_d;
  typename K::StrideA* stride_a;
  typename K::StrideB* stride_b;
  typename K::StrideD* stride_d;
  size_t bytes;  // bytes used by the arrays (CUTLASS's workspace follows)
};

template <class K>
Setup<K> carve(void* base, int64_t G) {
  static_assert(sizeof(typename ProblemShape::UnderlyingProblemShape) + 3 * sizeof(void*) +
                        sizeof(typename K::StrideA) + sizeof(typename K::StrideB) +
                        sizeof(typename K::StrideD) <=
                    kPerGroupBytes,
                "per-group setup arrays exceed kPerGroupBytes");
  Setup<K> s;
  char* p = static_cast<char*>(base);
  size_t off = 0;
  auto take = [&](size_t bytes) { char* q = p + off; off += align256(bytes); return q; };
  s.shapes = reinterpret_cast<decltype(s.shapes)>(take(G * sizeof(*s.shapes)));
  s.ptr_a = reinterpret_cast<decltype(s.ptr_a)>(take(G * sizeof(*s.ptr_a)));
  s.ptr_b = reinterpret_cast<decltype(s.ptr_b)>(take(G * sizeof(*s.ptr_b)));
  s.ptr_d = reinterpret_cast<decltype(s.ptr_d)>(take(G * sizeof(*s.ptr_d)));
  s.stride_a = reinterpret_cast<decltype(s.stride_a)>(take(G * sizeof(*s.stride_a)));
  s.stride_b = reinterpret_cast<decltype(s.stride_b)>(take(G * sizeof(*s.stride_b)));
  s.stride_d = reinterpret_cast<decltype(s.stride_d)>(take(G * sizeof(*s.stride_d)));
  s.bytes = off;
  return s;
}

// An operand's stride with the leading dimension `ld` in its dynamic mode: mode 0 (M or N) for
// a K-major operand, mode 1 (K) for an M/N-major one.
template <bool KMajor, class Stride>
__device__ __forceinline__ Stride leading(int64_t ld) {
  Stride s{};
  if constexpr (KMajor) {
    cute::get<0>(s) = ld;
  } else {
    cute::get<1>(s) = ld;
  }
  return s;
}

// Block 0 writes the per-group arrays; every block zero-fills what no GEMM tile writes.
template <class K>
__global__ void setup_kernel(const Problem p, Setup<K> s) {
  using ElementA = typename K::ElementA;
  using ElementB = typename K::ElementB;
  using ElementD = typename K::ElementD;
  const ElementA* a = reinterpret_cast<const ElementA*>(p.a);
  const ElementB* b = reinterpret_cast<const ElementB*>(p.b);
  if (blockIdx.x == 0) {
    for (int64_t g = threadIdx.x; g < p.G; g += blockDim.x) {
      const int64_t lo = clamp_start(p.pstarts, g, p.L);
      const int64_t hi = max(lo, clamp_start(p.pstarts, g + 1, p.L));
      // mode 1 slices the token axis of K-major operands: TMA needs each group's first token
      // 16-byte aligned (the caller's token layout block guarantees it). Never silently wrong:
      // trap. (M/N-major operands start a group on a whole row: aligned by M % 8, N % 8.)
      constexpr int64_t kAlignTokens = 16 / sizeof(ElementA);
      if (p.mode == 1 && hi > lo && (K::kAKMajor || K::kBKMajor) && (lo % kAlignTokens) != 0) {
        __trap();
      }
      typename K::StrideD sd{};
      cute::get<1>(sd) = cute::Int<1>{};
      cute::get<0>(sd) = p.N;
      if (p.mode == 0) {
        s.shapes[g] = {int(hi - lo), int(p.N), int(p.K)};
        s.ptr_a[g] = a + lo * p.K;
        s.ptr_b[g] = b + g * p.N * p.K;
        s.ptr_d[g] = static_cast<ElementD*>(p.out) + lo * p.N;
        s.stride_a[g] = leading<K::kAKMajor, typename K::StrideA>(p.K);
        s.stride_b[g] = leading<K::kBKMajor, typename K::StrideB>(K::kBKMajor ? p.K : p.N);
      } else {
        s.shapes[g] = {hi > lo ? int(p.M) : 0, int(p.N), int(hi - lo)};
        s.ptr_a[g] = K::kAKMajor ? a + lo : a + lo * p.M;
        s.ptr_b[g] = K::kBKMajor ? b + lo : b + lo * p.N;
        s.ptr_d[g] = static_cast<ElementD*>(p.out) + g * p.M * p.N;
        s.stride_a[g] = leading<K::kAKMajor, typename K::StrideA>(K::kAKMajor ? p.L : p.M);
        s.stride_b[g] = leading<K::kBKMajor, typename K::StrideB>(K::kBKMajor ? p.L : p.N);
      }
      s.stride_d[g] = sd;
    }
  }
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t threads = int64_t(gridDim.x) * blockDim.x;
  ElementD* out = static_cast<ElementD*>(p.out);
  if (p.mode == 0) {
    const int64_t tail = clamp_start(p.pstarts, p.G, p.L);
    for (int64_t i = tail * p.N + tid; i < p.L * p.N; i += threads) out[i] = ElementD(0);
  } else {
    for (int64_t g = 0; g < p.G; ++g) {
      if (clamp_start(p.pstarts, g + 1, p.L) > clamp_start(p.pstarts, g, p.L)) continue;
      ElementD* o = out + g * p.M * p.N;
      for (int64_t i = tid; i < p.M * p.N; i += threads) o[i] = ElementD(0);
    }
  }
}

template <int A, int B, int OUT, int CFG, int LAYOUT>
std::string run_instance(const Problem& p, cudaStream_t stream) {
  using K = Kernel<A, B, OUT, CFG, LAYOUT>;
  using Gemm = typename K::Gemm;
  if (p.layout != LAYOUT) return "operand layout does not match the instance";
  const Setup<K> s = carve<K>(p.workspace, p.G);
  const GroupArrays<Gemm> arrays{s.shapes, s.ptr_d, s.stride_d, s.bytes};
  return launch<Gemm>(p, stream, arrays, {s.ptr_a, s.stride_a, s.ptr_b, s.stride_b},
                      [&](unsigned blocks) { setup_kernel<K><<<blocks, 256, 0, stream>>>(p, s); });
}

}  // namespace sm90
}  // namespace jqgrouped

// Explicit instantiation, used by the generated sm90_inst_*.cu files.
#define JQ_SM90_INSTANTIATE(A, B, OUT, CFG) JQ_SM90_INSTANTIATE_LAYOUT(A, B, OUT, CFG, \
                                                                       jqgrouped::sm90::kLayoutTN)
#define JQ_SM90_INSTANTIATE_LAYOUT(A, B, OUT, CFG, LAYOUT)                           \
  template std::string jqgrouped::sm90::run_instance<A, B, OUT, CFG, LAYOUT>(        \
      const jqgrouped::sm90::Problem&, cudaStream_t);
