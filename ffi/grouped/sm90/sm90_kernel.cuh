// The CUTLASS Hopper grouped FP8 GEMM instances behind jaxquant_grouped_gemm_sm90 (sm_90a).
//
// One CUTLASS 3.x/4.x pointer-array grouped GEMM (GroupProblemShape, persistent,
// warp-specialized cooperative: TMA producer warp, two wgmma consumer warpgroups with the FP8
// two-level accumulation that promotes the tensor-core partial sums to float32 every 4 k-blocks,
// TMA-store epilogue D = alpha[g] * acc). Both layouts of jaxquant_grouped_gemm are "TN" GEMMs
// (A and B contiguous along K), so one kernel serves them; only the per-group pointers and
// strides differ:
//   mode 0 (ragged rows x experts): group g = rows [pstarts[g], pstarts[g+1]) of a [L, K] times
//     b[g] [N, K]^T -> the same rows of out [L, N];
//   mode 1 (wgrad): columns [pstarts[g], pstarts[g+1]) of a [M, L] and b [N, L] (row stride L)
//     -> out[g] [M, N].
// A setup kernel writes every group's problem shape, pointers and strides from the device-side
// `pstarts` into the workspace (no host sync: CUDA-graph compatible) and writes the zeros the
// GEMM never touches (mode 0: rows past the last group; mode 1: the outputs of empty groups,
// which get a 0 x N x 0 problem so the tile scheduler skips them).
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

namespace jqgrouped {
namespace sm90 {

template <int E> struct ElementOf { using type = cutlass::float_e4m3_t; };
template <> struct ElementOf<kE5M2> { using type = cutlass::float_e5m2_t; };
template <int O> struct OutputOf { using type = cutlass::bfloat16_t; };
template <> struct OutputOf<kOutF32> { using type = float; };

using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;  // (M, N, K)

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

template <int A, int B, int OUT, int CFG = kCfgDefault>
struct Kernel {
  using ElementA = typename ElementOf<A>::type;
  using ElementB = typename ElementOf<B>::type;
  using ElementD = typename OutputOf<OUT>::type;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignA = 16, kAlignB = 16, kAlignD = 16 / sizeof(ElementD);
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

inline size_t align256(size_t n) { return (n + 255) & ~size_t(255); }

template <class K>
Setup<K> carve(void* base, int64_t G) {
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

__device__ __forceinline__ int64_t clamp_start(const int32_t* pstarts, int64_t g, int64_t L) {
  const int64_t v = pstarts[g];
  return v < 0 ? 0 : v > L ? L : v;
}

// Block 0 writes the per-group arrays; every block zero-fills what no GEMM tile writes.
template <class K>
__global__ void setup_kernel(const Problem p, Setup<K> s) {
  using ElementD = typename K::ElementD;
  if (blockIdx.x == 0) {
    for (int64_t g = threadIdx.x; g < p.G; g += blockDim.x) {
      const int64_t lo = clamp_start(p.pstarts, g, p.L);
      const int64_t hi = max(lo, clamp_start(p.pstarts, g + 1, p.L));
      // mode 1 slices the token axis: TMA needs each group's first column 16-byte aligned
      // (the caller's token layout block is a multiple of 16). Never silently wrong: trap.
      if (p.mode == 1 && hi > lo && (lo & 15) != 0) __trap();
      typename K::StrideA sa{};
      typename K::StrideB sb{};
      typename K::StrideD sd{};
      cute::get<1>(sd) = cute::Int<1>{};
      cute::get<0>(sd) = p.N;
      if (p.mode == 0) {
        s.shapes[g] = {int(hi - lo), int(p.N), int(p.K)};
        s.ptr_a[g] = reinterpret_cast<const typename K::ElementA*>(p.a + lo * p.K);
        s.ptr_b[g] = reinterpret_cast<const typename K::ElementB*>(p.b + g * p.N * p.K);
        s.ptr_d[g] = static_cast<ElementD*>(p.out) + lo * p.N;
        cute::get<0>(sa) = p.K;
        cute::get<0>(sb) = p.K;
      } else {
        s.shapes[g] = {hi > lo ? int(p.M) : 0, int(p.N), int(hi - lo)};
        s.ptr_a[g] = reinterpret_cast<const typename K::ElementA*>(p.a + lo);
        s.ptr_b[g] = reinterpret_cast<const typename K::ElementB*>(p.b + lo);
        s.ptr_d[g] = static_cast<ElementD*>(p.out) + g * p.M * p.N;
        cute::get<0>(sa) = p.L;
        cute::get<0>(sb) = p.L;
      }
      s.stride_a[g] = sa;
      s.stride_b[g] = sb;
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

inline int sm_count_of(int device) {
  static int cached[64] = {};
  if (device >= 0 && device < 64 && cached[device] > 0) return cached[device];
  int n = 0;
  cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device);
  if (device >= 0 && device < 64) cached[device] = n;
  return n;
}

// The tile order of the persistent scheduler (a runtime choice, no instance of its own).
template <class RasterOrder>
RasterOrder raster_of(const Problem& p) {
  return p.raster_along_n ? RasterOrder::AlongN : RasterOrder::AlongM;
}

template <int A, int B, int OUT, int CFG>
std::string run_instance(const Problem& p, cudaStream_t stream) {
  using K = Kernel<A, B, OUT, CFG>;
  using Gemm = typename K::Gemm;
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return cudaGetErrorString(e);
  const Setup<K> s = carve<K>(p.workspace, p.G);

  typename Gemm::Arguments args;
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {int(p.G), s.shapes, nullptr};  // shapes live on the device only
  args.mainloop = {s.ptr_a, s.stride_a, s.ptr_b, s.stride_b};
  auto& fusion = args.epilogue.thread;
  fusion.alpha = 1.0f;
  fusion.beta = 0.0f;
  fusion.alpha_ptr = p.alpha;  // alpha[g] per group (stride 1 along groups) or the literal 1
  fusion.dAlpha = {cute::_0{}, cute::_0{}, p.alpha ? 1 : 0};
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = nullptr;
  args.epilogue.ptr_D = s.ptr_d;
  args.epilogue.dD = s.stride_d;
  args.hw_info.device_id = device;
  args.hw_info.sm_count = sm_count_of(device);
  // Along M (default): a group's B tile reused along its rows.
  args.scheduler.raster_order = raster_of<decltype(args.scheduler.raster_order)>(p);

  const size_t need = s.bytes + Gemm::get_workspace_size(args);
  if (need > p.workspace_bytes) {
    return "workspace of " + std::to_string(p.workspace_bytes) + " bytes; this GEMM needs " +
           std::to_string(need);
  }
  const unsigned blocks = unsigned(std::max(1, std::min(2 * args.hw_info.sm_count, 1024)));
  setup_kernel<K><<<blocks, 256, 0, stream>>>(p, s);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return cudaGetErrorString(e);

  Gemm gemm;
  cutlass::Status st = gemm.can_implement(args);
  if (st != cutlass::Status::kSuccess) {
    return std::string("CUTLASS can_implement: ") + cutlassGetStatusString(st);
  }
  st = gemm.initialize(args, static_cast<char*>(p.workspace) + s.bytes, stream);
  if (st != cutlass::Status::kSuccess) {
    return std::string("CUTLASS initialize: ") + cutlassGetStatusString(st);
  }
  st = gemm.run(stream);
  if (st != cutlass::Status::kSuccess) {
    return std::string("CUTLASS run: ") + cutlassGetStatusString(st);
  }
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return cudaGetErrorString(e);
  return "";
}

}  // namespace sm90
}  // namespace jqgrouped

// Explicit instantiation, used by the generated sm90_inst_*.cu files.
#define JQ_SM90_INSTANTIATE(A, B, OUT, CFG)                                          \
  template std::string jqgrouped::sm90::run_instance<A, B, OUT, CFG>(                \
      const jqgrouped::sm90::Problem&, cudaStream_t);
