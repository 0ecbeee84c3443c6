// One CUTLASS Hopper grouped GEMM instance (sm_90a), whatever its operands: a CUTLASS 3.x/4.x
// pointer-array grouped GEMM (GroupProblemShape; persistent, warp-specialized cooperative or
// pingpong: TMA producer warp, wgmma consumer warpgroups) with the TMA-store epilogue
// D = alpha[g] * acc (no C) every instance shares. What differs between instances:
//   * the operand policy `Ops`: element types, layouts, mainloop schedule, and the per-group
//     scale arrays Float8Block adds (DenseOperands in sm90_kernel.cuh: per-tensor FP8, whose
//     scales are alpha, and bfloat16; BlockScaledOperands in sm90_block_kernel.cuh);
//   * the configuration `CFG` (kCfg* in sm90_gemm.h): tile, cluster, schedule, accumulation;
//   * the output type (kOutBF16 / kOutF32).
// sm90_launch.cuh runs an instance.
#pragma once

#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "grouped/sm90/sm90_gemm.h"

namespace jqffi {
namespace sm90 {

using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;  // (M, N, K)

template <int E> struct ElementOf { using type = cutlass::float_e4m3_t; };
template <> struct ElementOf<kE5M2> { using type = cutlass::float_e5m2_t; };
template <> struct ElementOf<kBF16> { using type = cutlass::bfloat16_t; };
template <int O> struct OutputOf { using type = cutlass::bfloat16_t; };
template <> struct OutputOf<kOutF32> { using type = float; };

// A configuration: tile (M x N x K), cluster (M x N), schedule and accumulation.
template <int TM, int TN, int TK, int CM, int CN, bool Pingpong = false, bool Fast = false>
struct Tiles {
  using TileShape = cute::Shape<cute::Int<TM>, cute::Int<TN>, cute::Int<TK>>;
  using ClusterShape = cute::Shape<cute::Int<CM>, cute::Int<CN>, cute::_1>;
  static constexpr bool kPingpong = Pingpong;  // each consumer warpgroup its own tile, else one
  static constexpr bool kFast = Fast;          // FP8 fast accumulation (no float32 promotion)
};

// The configurations (kCfg* in sm90_gemm.h).
template <int CFG>
struct TileConfig;
// 128 x 128 x 128 tiles: with the FP8 promotion each consumer warpgroup holds two 64 x 128
// float32 accumulators (128 registers); wider tiles would spill. Cluster 1 x 2: the two CTAs of
// a cluster share (multicast) the A tile.
template <> struct TileConfig<kCfgDefault> : Tiles<128, 128, 128, 1, 2> {};
// No cluster: the tile grid of each group is not rounded up to the cluster (N = 1408 has 11
// column tiles of 128; a 1 x 2 cluster computes 12).
template <> struct TileConfig<kCfgC1x1> : Tiles<128, 128, 128, 1, 1> {};
// 176-wide tiles: N = 1408 (Qwen-MoE fc1) is exactly 8 of them; each warpgroup's two 64 x 176
// float32 accumulators take 176 registers. Needs CUTLASS's extended wgmma shapes
// (CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED, defined by the generated translation unit).
template <> struct TileConfig<kCfgN176> : Tiles<128, 176, 128, 1, 1> {};
// Fast accumulation: the wgmma accumulator is the result (no promotion every k-block).
template <> struct TileConfig<kCfgFast> : Tiles<128, 128, 128, 1, 1, false, true> {};
// Pingpong: each consumer warpgroup owns a whole 128 x 128 tile (128 accumulator registers with
// fast accumulation; the promotion's second set would spill), and one warpgroup's epilogue runs
// under the other's mainloop (a short-K group is mostly epilogue).
template <> struct TileConfig<kCfgPingpongFast> : Tiles<128, 128, 128, 1, 1, true, true> {};
// Cluster 2 x 1: the two CTAs of a cluster share (multicast) the B tile.
template <> struct TileConfig<kCfgC2x1> : Tiles<128, 128, 128, 2, 1> {};
// Fast accumulation frees the promotion's second accumulator set: each cooperative warpgroup's
// 64 x 256 float32 accumulator is 128 registers, so the tile is 128 x 256 (the shape of the
// bfloat16 default), fewer operand bytes a FLOP than 128 x 128. (128 + 256) x 128 bytes a
// stage, 4 stages. Cluster 1 x 2: the A (token) tile multicast along N.
template <> struct TileConfig<kCfgWideFast> : Tiles<128, 256, 128, 1, 2, false, true> {};
// bfloat16: no promotion, so each cooperative warpgroup's 64 x 256 float32 accumulator (128
// registers) fits a 128 x 256 tile; 64-deep k-tiles (128-byte bf16 rows, the widest TMA
// swizzle): (128 + 256) x 64 x 2 bytes = 48 KiB a stage, 4 stages. Cluster 1 x 2 (A multicast):
// N tiles of the bench shapes (1408 = 5.5 x 256, 14336 = 56 x 256) round to an even count
// anyway, while a group of 210..299 rows has 2 or 3 M tiles (a 2 x 1 cluster would round 3 up).
template <> struct TileConfig<kCfgBf16> : Tiles<128, 256, 64, 1, 2> {};
// The same tile with cluster 2 x 1 (B multicast: a weight tile shared by two row tiles).
template <> struct TileConfig<kCfgBf16C2x1> : Tiles<128, 256, 64, 2, 1> {};
// Small groups: each consumer warpgroup its own 64 x 128 tile (64 accumulator registers), one's
// epilogue under the other's mainloop; 64-row tiles waste less of a short group than 128.
template <> struct TileConfig<kCfgBf16Pingpong> : Tiles<64, 128, 128, 1, 1, true> {};
// 256 x 128 tiles (each cooperative warpgroup a 128 x 128 float32 accumulator, 128 registers):
// an N that is an odd multiple of 128 (1408 = 11 x 128) has no half-empty column of tiles
// (5.5 x 256 rounds to 6); cluster 2 x 1 (B multicast) pairs the row tiles of an M that is a
// multiple of 512, where a 1 x 2 cluster would pad 11 column tiles to 12.
template <> struct TileConfig<kCfgBf16M256> : Tiles<256, 128, 64, 2, 1> {};
// The k-grouped wgrad (sm90_kgrouped.cuh) on the same tile: its types come from this Instance,
// its kernel is CUTLASS's batched one, not the pointer-array kernel below.
template <> struct TileConfig<kCfgKGrouped> : Tiles<256, 128, 64, 2, 1> {};
// Its per-tensor FP8 form on kCfgC2x1's tile (the promotion's second accumulator set rules out
// 256 rows a CTA).
template <> struct TileConfig<kCfgKGroupedFp8> : Tiles<128, 128, 128, 2, 1> {};
// 128 x 128 bfloat16 tiles without a cluster: a ragged GEMM computes each group's row tiles
// and an N of 1408 (11 x 128) exactly, where 256-wide tiles compute 6 columns of them.
template <> struct TileConfig<kCfgBf16N128> : Tiles<128, 128, 64, 1, 1> {};
// The bfloat16 k-grouped wgrad on the pingpong schedule: a warpgroup's whole 128 x 128 tile is
// 128 accumulator registers; cluster 2 x 1 (B multicast), as the batched peer measured best.
template <> struct TileConfig<kCfgKGroupedPingpong> : Tiles<128, 128, 64, 2, 1, true> {};
// 176-wide bfloat16 tiles: a forward's N of 1408 is 8 whole tiles (256-wide ones compute 6 x
// 256, 9% padding), an even count for the 1 x 2 cluster. Needs CUTLASS's extended wgmma shapes
// (defined by the generated translation unit, as for kCfgN176).
template <> struct TileConfig<kCfgBf16N176> : Tiles<128, 176, 64, 1, 2> {};

// kEpiRowScale's epilogue tree: D = convert((alpha[g] * acc) * row_scale[m]), float32 products
// rounded once to ElementD (XLA's order when it scaled a float32 output). alpha: one float32
// per group through a strided pointer (or the literal 1); row_scale: a pointer per group to its
// rows' factors (scalar loads: a group starts at any row, so its pointer is only 4-byte aligned).
template <class ElementD, class TileShape>
using RowScaledEpilogue = cutlass::epilogue::fusion::Sm90EVT<
    cutlass::epilogue::fusion::Sm90Compute<cutlass::multiplies, ElementD, float,
                                           cutlass::FloatRoundStyle::round_to_nearest>,
    cutlass::epilogue::fusion::Sm90EVT<
        cutlass::epilogue::fusion::Sm90Compute<cutlass::multiplies, float, float,
                                               cutlass::FloatRoundStyle::round_to_nearest>,
        cutlass::epilogue::fusion::Sm90ScalarBroadcastPtrArray<
            float, cute::Stride<cute::_0, cute::_0, int64_t>>,
        cutlass::epilogue::fusion::Sm90AccFetch>,
    cutlass::epilogue::fusion::Sm90ColBroadcast<0, TileShape, float*, float,
                                                cute::Stride<cute::_1, cute::_0, cute::_0>, 1>>;

// The CUTLASS types of one instance. `Ops` provides ElementA / ElementB, the mainloop's layout
// arguments MainloopLayoutA / MainloopLayoutB (a layout tag pointer, or a tuple of it and the
// scale layout), `Schedule<Config>` (the mainloop's kernel schedule), whether the operands are
// K-major (kAKMajor / kBKMajor), and kBlockScaled with the per-group scale arrays `Scales`.
template <class Operands, int OUT, int CFG, int EPI = kEpiAlpha>
struct Instance {
  using Ops = Operands;
  static constexpr bool kRowScale = EPI == kEpiRowScale;
  using ElementA = typename Ops::ElementA;
  using ElementB = typename Ops::ElementB;
  using ElementD = typename OutputOf<OUT>::type;
  using LayoutD = cutlass::layout::RowMajor;
  // 16-byte TMA rows.
  static constexpr int kAlignA = 16 / sizeof(ElementA), kAlignB = 16 / sizeof(ElementB),
                       kAlignD = 16 / sizeof(ElementD);
  using Config = TileConfig<CFG>;
  using TileShape = typename Config::TileShape;
  using ClusterShape = typename Config::ClusterShape;
  using KernelSchedule = typename Ops::template Schedule<Config>;
  using EpilogueSchedule =
      cute::conditional_t<Config::kPingpong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                          cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, LayoutD*, kAlignD, ElementD, LayoutD*, kAlignD, EpilogueSchedule,
      cute::conditional_t<kRowScale, RowScaledEpilogue<ElementD, TileShape>,
                          cutlass::epilogue::fusion::LinearCombination<ElementD, float, void,
                                                                       float>>>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      ElementA, typename Ops::MainloopLayoutA, kAlignA,
      ElementB, typename Ops::MainloopLayoutB, kAlignB, float, TileShape, ClusterShape,
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

}  // namespace sm90
}  // namespace jqffi
