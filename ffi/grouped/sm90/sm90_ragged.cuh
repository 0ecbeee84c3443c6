// The ragged-rows GEMM (mode 0: fprop / dgrad; bfloat16 operands of layout TN or NN, per-tensor
// FP8 of layout TN): rows [pstarts[g], pstarts[g+1]) of a [L, K] times b[g] -> the same rows of
// out [L, N], on CUTLASS's batched (not pointer-array) Hopper kernel with one TMA descriptor per
// operand (design decision 51): a as one [L, K] tensor, b as [G, N, K] (or [G, K, N]) with the
// group as the batch coordinate. No per-group pointer arrays, no setup kernel, no descriptor
// rewrites when a CTA moves to another group (the pointer-array kernel's cost at 64 small
// groups, session 25's measurement behind the k-grouped wgrad).
//
// A row tile starts at its group's first row plus a multiple of the tile height, so the last
// tile of a group reads rows of the next group (or TMA's zeros past L). What makes that safe is
// the epilogue: it stores only the tile's rows of its own group (a TMA store cannot be masked,
// so it stores from registers, two columns a thread-store).
//
// Three pieces on top of CUTLASS's own cooperative kernel (GemmUniversal, unmodified):
//   * RaggedRowsScheduler: CUTLASS's static persistent scheduler over a bound on the row tiles,
//     each CTA mapping its (non-decreasing, tiles ordered along N) row-tile index to a group by
//     walking the group starts once; the two CTAs of a 2 x 1 cluster always share a group (they
//     share b's tile), a group's odd last tile pairing with one that stores nothing. The rows of
//     no group (after pstarts[G]) are group G: no k-blocks, zeros stored.
//   * RaggedRowsMainloop: CUTLASS's TMA + wgmma mainloop (for FP8 with its float32 promotion)
//     loading a at the tile's first row and b at its group.
//   * RaggedRowsEpilogue: D = alpha[g] * acc for the tile's rows of its group.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "cutlass/epilogue/collective/detail.hpp"
#include "cutlass/gemm/kernel/sm90_tile_scheduler.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"
#include "grouped/sm90/sm90_launch.cuh"
#include "grouped/sm90/sm90_multicast.cuh"

namespace jqffi {
namespace sm90 {

// Rows [lo, hi) of group g of `groups` (g == groups: the rows of no group, up to `rows`).
struct GroupRows {
  int lo = 0, hi = 0;
};
__device__ __forceinline__ GroupRows group_rows(const int32_t* pstarts, int g, int groups,
                                                int rows) {
  const int lo = int(clamp_start(pstarts, g, rows));
  const int hi = g == groups ? rows : cute::max(lo, int(clamp_start(pstarts, g + 1, rows)));
  return {lo, hi};
}

// The tag that selects RaggedRowsScheduler in GemmUniversal's TileSchedulerSelector.
struct RaggedRowsSchedulerTag {};

// A work tile: M_idx is the tile's first row (not a tile index), L_idx its group (G: rows of
// no group), k_tiles its k-blocks (0 for group G).
template <int BLK_M, int CLUSTER_M>
class RaggedRowsScheduler : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90 {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;

 public:
  struct Arguments : Base::Arguments {
    const int32_t* pstarts = nullptr;  // [G + 1] group starts along the rows (device)
  };
  struct Params : Base::Params {
    const int32_t* pstarts = nullptr;
    int rows = 0, groups = 0, k_tiles = 0;  // L, G, K's k-blocks
  };
  struct WorkTileInfo : Base::WorkTileInfo {
    int k_tiles = 0;
  };

  // The scheduler's tile space: (M, N, K, G) -> row tiles enough for every group's own (each
  // group adds at most one partial tile, rounded up to the cluster), one batch.
  template <class ProblemShapeMNKL>
  static auto bound_shape(ProblemShapeMNKL const& problem) {
    auto [M, N, K, G] = problem;
    const int tiles = (M + BLK_M - 1) / BLK_M + (G + 1) * CLUSTER_M;
    return cute::make_shape(tiles * BLK_M, N, K, 1);
  }

  template <class ProblemShapeMNKL, class TileShape, class ClusterShape>
  static Params to_underlying_arguments(ProblemShapeMNKL problem_shape_mnkl, TileShape tile_shape,
                                        ClusterShape cluster_shape,
                                        cutlass::KernelHardwareInfo const& hw_info,
                                        Arguments const& args, void* workspace = nullptr,
                                        const uint32_t epilogue_subtile = 1,
                                        uint32_t ktile_start_alignment_count = 1u) {
    Params params;
    static_cast<Base::Params&>(params) = Base::to_underlying_arguments(
        bound_shape(problem_shape_mnkl), tile_shape, cluster_shape, hw_info, args, workspace,
        epilogue_subtile, ktile_start_alignment_count);
    params.pstarts = args.pstarts;
    params.rows = cute::get<0>(problem_shape_mnkl);
    params.groups = cute::get<3>(problem_shape_mnkl);
    params.k_tiles = (cute::get<2>(problem_shape_mnkl) + cute::size<2>(tile_shape) - 1) /
                     cute::size<2>(tile_shape);
    return params;
  }

  template <class ProblemShapeMNKL, class BlockShape, class ClusterShape>
  static dim3 get_grid_shape(Params const& params, ProblemShapeMNKL problem_shape_mnk,
                             BlockShape cta_shape, ClusterShape cluster_shape,
                             cutlass::KernelHardwareInfo hw_info, Arguments arguments = Arguments{},
                             bool truncate_by_problem_size = true) {
    return Base::get_grid_shape(params, bound_shape(problem_shape_mnk), cta_shape, cluster_shape,
                                hw_info, arguments, truncate_by_problem_size);
  }

  CUTLASS_HOST_DEVICE RaggedRowsScheduler() {}
  CUTLASS_DEVICE explicit RaggedRowsScheduler(Params const& params)
      : Base(params), params_(params) {}

  template <class ClusterShape>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(ClusterShape) {
    work_ = locate(Base::get_current_work());
    return work_;
  }
  CUTLASS_DEVICE WorkTileInfo get_current_work() const { return work_; }
  template <class... Rest>
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo const&, Rest&&...) {
    Base::advance_to_next_work();
    work_ = locate(Base::get_current_work());
    return cute::make_tuple(work_, true);
  }

  template <class ProblemShape, class TileShape>
  CUTLASS_HOST_DEVICE static int get_work_k_tile_count(WorkTileInfo const& work, ProblemShape,
                                                       TileShape) {
    return work.k_tiles;
  }
  CUTLASS_HOST_DEVICE static uint32_t get_work_k_tile_start(WorkTileInfo const&) { return 0u; }

 private:
  // The group of the base scheduler's tile (its row-tile index `M_idx`, non-decreasing along a
  // CTA's tiles when they are ordered along N): advances the walk over the groups' cluster
  // units (a unit: CLUSTER_M row tiles of one group) to it.
  CUTLASS_DEVICE WorkTileInfo locate(Base::WorkTileInfo base) {
    WorkTileInfo work;
    static_cast<Base::WorkTileInfo&>(work) = base;
    if (!base.is_valid()) return work;
    const int unit = base.M_idx / CLUSTER_M;
    while (unit >= unit_end_) {
      if (++group_ > params_.groups) {  // past the last unit: this CTA's tiles are done
        work.is_valid_tile = false;
        return work;
      }
      const GroupRows r = group_rows(params_.pstarts, group_, params_.groups, params_.rows);
      unit_begin_ = unit_end_;
      unit_end_ += ((r.hi - r.lo + BLK_M - 1) / BLK_M + CLUSTER_M - 1) / CLUSTER_M;
      group_lo_ = r.lo;
    }
    const int tile = (unit - unit_begin_) * CLUSTER_M + base.M_idx % CLUSTER_M;
    work.M_idx = group_lo_ + tile * BLK_M;
    work.L_idx = group_;
    work.k_tiles = group_ == params_.groups ? 0 : params_.k_tiles;
    return work;
  }

  Params params_;
  WorkTileInfo work_;
  int group_ = -1, unit_begin_ = 0, unit_end_ = 0, group_lo_ = 0;
};

}  // namespace sm90
}  // namespace jqffi

namespace cutlass::gemm::kernel::detail {
template <class ArchTag, class TileShape, class ClusterShape, uint32_t Stages>
struct TileSchedulerSelector<jqffi::sm90::RaggedRowsSchedulerTag, ArchTag, TileShape,
                             ClusterShape, Stages> {
  using Scheduler = jqffi::sm90::RaggedRowsScheduler<cute::size<0>(TileShape{}),
                                                     cute::size<0>(ClusterShape{})>;
};
}  // namespace cutlass::gemm::kernel::detail

namespace jqffi {
namespace sm90 {

// CUTLASS's TMA warp-specialized mainloop (`Base`, from its builder) with a as one [L, K]
// tensor loaded from the tile's first row and b as [G, ...] loaded at the tile's group.
template <class Base>
struct RaggedRowsMainloop : Base {
  using typename Base::MainloopPipeline;
  using typename Base::Params;
  using typename Base::PipelineState;
  using typename Base::SmemLayoutA;
  using typename Base::SmemLayoutB;
  using typename Base::TensorStorage;
  using typename Base::TileShape;
  using DispatchPolicy = typename Base::DispatchPolicy;
  using GmemTiledCopyA = typename Base::GmemTiledCopyA;
  using GmemTiledCopyB = typename Base::GmemTiledCopyB;

  // The kernel's problem shape is (L, N, K, G): a's descriptor covers [L, K] once (one batch),
  // b's the G groups.
  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const& problem_shape,
                                                  typename Base::Arguments const& args,
                                                  void* workspace) {
    auto [M, N, K, G] = problem_shape;
    Params params = Base::to_underlying_arguments(cute::make_shape(M, N, K, 1), args, workspace);
    params.tma_load_b =
        Base::to_underlying_arguments(cute::make_shape(M, N, K, G), args, workspace).tma_load_b;
    return params;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem_shape,
                            typename Base::Arguments const& args) {
    auto [M, N, K, G] = problem_shape;
    return Base::can_implement(cute::make_shape(M, N, K, 1), args) &&
           Base::can_implement(cute::make_shape(M, N, K, G), args);
  }

  // CUTLASS's tiled views (the kernel reads their tile counts) and the untiled a (L, K, 1) and
  // b (N, K, G) coordinate tensors the loads index.
  template <class ProblemShape_MNKL>
  CUTLASS_DEVICE auto load_init(ProblemShape_MNKL const& problem_shape_MNKL,
                                Params const& params) const {
    auto [M, N, K, G] = problem_shape_MNKL;
    auto tiled = Base::load_init(problem_shape_MNKL, params);
    cute::Tensor mA = params.tma_load_a.get_tma_tensor(cute::make_shape(M, K, 1));
    cute::Tensor mB = params.tma_load_b.get_tma_tensor(cute::make_shape(N, K, G));
    return cute::make_tuple(cute::get<0>(tiled), cute::get<1>(tiled), mA, mB);
  }

  // Producer: the tile's k-blocks of a from its first row (blk_coord's m) and of b[g] (its l),
  // as CUTLASS's load (multicast in a cluster).
  template <class LoadInputs, class BlockCoord, class KTileIterator>
  CUTLASS_DEVICE void load(Params const& params, MainloopPipeline pipeline,
                           PipelineState smem_pipe_write, LoadInputs const& load_inputs,
                           BlockCoord const& blk_coord, KTileIterator, int k_tiles, int,
                           uint32_t block_rank_in_cluster, TensorStorage& shared_tensors) {
    using namespace cute;
    if (!cute::elect_one_sync()) return;
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});
    using ClusterShape = typename DispatchPolicy::ClusterShape;
    constexpr uint32_t cluster_x = size<0>(ClusterShape{});
    const uint2 in_cluster = {block_rank_in_cluster % cluster_x,
                              block_rank_in_cluster / cluster_x};
    auto block_tma_a = params.tma_load_a.get_slice(in_cluster.y);
    auto block_tma_b = params.tma_load_b.get_slice(in_cluster.x);

    const int first_row = get<0>(blk_coord);
    Tensor mA = domain_offset(make_coord(first_row, _0{}, _0{}), get<2>(load_inputs));
    Tensor gA = local_tile(mA(_, _, 0), select<0, 2>(TileShape{}), make_coord(0, _));
    Tensor gB = local_tile(get<3>(load_inputs)(_, _, get<3>(blk_coord)), select<1, 2>(TileShape{}),
                           make_coord(get<1>(blk_coord), _));
    Tensor tAgA = block_tma_a.partition_S(gA);  // (TMA, TMA_M, TMA_K, k)
    Tensor tAsA = block_tma_a.partition_D(sA);  // (TMA, TMA_M, TMA_K, PIPE)
    Tensor tBgB = block_tma_b.partition_S(gB);
    Tensor tBsB = block_tma_b.partition_D(sB);
    const MulticastMasks mcast =
        multicast_masks<ClusterShape, GmemTiledCopyA, GmemTiledCopyB>(in_cluster);
    CUTLASS_PRAGMA_NO_UNROLL
    for (int j = 0; j < k_tiles; ++j) {
      pipeline.producer_acquire(smem_pipe_write);
      auto* bar = pipeline.producer_get_barrier(smem_pipe_write);
      const int stage = smem_pipe_write.index();
      copy(params.tma_load_a.with(*bar, mcast.a), tAgA(_, _, _, j), tAsA(_, _, _, stage));
      copy(params.tma_load_b.with(*bar, mcast.b), tBgB(_, _, _, j), tBsB(_, _, _, stage));
      ++smem_pipe_write;
    }
  }

  // Consumers: CUTLASS's own k-loop; the rows of no group (0 k-blocks) run none.
  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read,
                          FrgTensorC& accum, int k_tiles, int thread_idx,
                          TensorStorage& shared_tensors, Params const& params) {
    if (k_tiles > 0) {
      Base::mma(pipeline, smem_pipe_read, accum, k_tiles, thread_idx, shared_tensors, params);
    }
  }
  CUTLASS_DEVICE void mma_tail(MainloopPipeline pipeline, PipelineState smem_pipe_release,
                               int k_tiles) {
    if (k_tiles > 0) Base::mma_tail(pipeline, smem_pipe_release, k_tiles);
  }
};

// D = alpha[g] * acc, or (alpha[g] * acc) * row_scale[r] (kEpiRowScale: float32 products
// rounded once, as the pointer-array instances' epilogue), for the rows of the tile's group
// (zeros for group G, the rows of no group), stored from the accumulator registers: each thread's pairs of adjacent columns as one
// store, rows past the group or columns past N not stored. Wrapped by CUTLASS's adapter into the
// warp-specialized epilogue interface (no shared memory, no TMA).
template <class ElementD_, class TileShape>
class RaggedRowsEpilogue {
 public:
  using ElementC = void;
  using ElementD = ElementD_;
  using ElementOutput = ElementD_;
  using ElementAccumulator = float;
  using ElementCompute = float;
  using ElementScalar = float;
  // What CUTLASS's device adapter reads its types from (the stores are this class's own).
  using ThreadEpilogueOp = cutlass::epilogue::thread::LinearCombination<ElementD_, 2, float, float>;
  using StrideC = cute::Stride<int64_t, cute::_1, int64_t>;
  using StrideD = StrideC;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;
  using EpilogueSchedule = cutlass::epilogue::NoSmemWarpSpecialized;
  using DispatchPolicy = EpilogueSchedule;
  static constexpr int kBlkM = cute::size<0>(TileShape{});
  static constexpr int kBlkN = cute::size<1>(TileShape{});
  struct SharedStorage {};
  using TensorStorage = SharedStorage;

  struct Arguments {
    ElementD* ptr_D = nullptr;         // out [L, N]
    const float* alpha = nullptr;      // [G] or nullptr (1)
    const int32_t* pstarts = nullptr;  // [G + 1] group starts (device)
    const float* row_scale = nullptr;  // [L] per-row factors (kEpiRowScale), or nullptr
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args,
                                                  void*) {
    return args;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*,
                                              cudaStream_t, cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem_shape, Arguments const& args) {
    // two-column stores: N even, out aligned to two elements
    return cute::get<1>(problem_shape) % 2 == 0 &&
           reinterpret_cast<uintptr_t>(args.ptr_D) % (2 * sizeof(ElementD)) == 0;
  }

  CUTLASS_HOST_DEVICE RaggedRowsEpilogue(Params const& params, SharedStorage const& = {})
      : params_(params) {}
  CUTLASS_DEVICE bool is_source_needed() { return false; }

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine,
            class FrgLayout, class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK,
                                 BlockCoordMNKL blk_coord,
                                 cute::Tensor<FrgEngine, FrgLayout> const& accumulators,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
    using namespace cute;
    const int L = get<0>(problem_shape_mnkl), N = get<1>(problem_shape_mnkl);
    const int G = get<3>(problem_shape_mnkl);
    const int first_row = get<0>(blk_coord), n_tile = get<1>(blk_coord), g = get<3>(blk_coord);
    const GroupRows group = group_rows(params_.pstarts, g, G, L);
    const int rows = cute::min(int(kBlkM), group.hi - first_row);
    const int cols = cute::min(int(kBlkN), N - n_tile * kBlkN);
    if (rows <= 0 || cols <= 0) return;
    const bool zeros = g == G;
    const float alpha = zeros || params_.alpha == nullptr ? 1.0f : params_.alpha[g];

    Tensor gD = make_tensor(make_gmem_ptr(params_.ptr_D + int64_t(first_row) * N +
                                          int64_t(n_tile) * kBlkN),
                            make_layout(make_shape(Int<kBlkM>{}, Int<kBlkN>{}),
                                        make_stride(int64_t(N), _1{})));
    Tensor cD = make_identity_tensor(make_shape(Int<kBlkM>{}, Int<kBlkN>{}));
    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    Tensor tCgD = thr_mma.partition_C(gD);  // (VEC, MMA_M, MMA_N)
    Tensor tCcD = thr_mma.partition_C(cD);
    CUTE_STATIC_ASSERT_V(size(tCgD) == size(accumulators));
    // The wgmma accumulator's first value mode: two adjacent columns.
    static_assert(decltype(size<0, 0>(tCgD))::value == 2 &&
                      cute::is_same_v<decltype(stride<0, 0>(tCgD)), _1>,
                  "accumulator values in pairs of adjacent columns");
    using Pair = cutlass::Array<ElementD, 2>;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(accumulators); i += 2) {
      const auto coord = tCcD(i);
      const int r = get<0>(coord);
      if (r < rows && get<1>(coord) < cols) {
        float v0 = alpha * accumulators(i), v1 = alpha * accumulators(i + 1);
        if (params_.row_scale != nullptr) {
          const float f = params_.row_scale[first_row + r];
          v0 *= f;
          v1 *= f;
        }
        Pair v;
        v[0] = ElementD(zeros ? 0.0f : v0);
        v[1] = ElementD(zeros ? 0.0f : v1);
        *reinterpret_cast<Pair*>(&tCgD(i)) = v;
      }
    }
  }

 private:
  Params params_;
};

// The kernel types of the ragged-rows GEMM for Instance K's operands, tile, cluster and output
// (cooperative schedule; a 1 x 2 cluster shares a's tile, a 2 x 1 one b's).
template <class K>
struct RaggedRowsInstance {
  static_assert(!K::Config::kPingpong, "the ragged-rows GEMM runs the cooperative schedule");
  using ElementA = typename K::ElementA;
  using ElementB = typename K::ElementB;
  using ElementD = typename K::ElementD;
  using TileShape = typename K::TileShape;
  using ClusterShape = typename K::ClusterShape;
  using Epilogue = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<
      RaggedRowsEpilogue<ElementD, TileShape>>;
  using LayoutA = cute::remove_pointer_t<typename K::Ops::MainloopLayoutA>;
  using LayoutB = cute::remove_pointer_t<typename K::Ops::MainloopLayoutB>;
  static constexpr bool kBKMajor = K::Ops::kBKMajor;
  static_assert(K::Ops::kAKMajor, "mode 0 reads a [L, K] K-major");
  using BaseMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA, K::kAlignA,
      ElementB, LayoutB, K::kAlignB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<0>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
  using Mainloop = RaggedRowsMainloop<BaseMainloop>;
  using GemmKernel =
      cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue,
                                           RaggedRowsSchedulerTag>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
};

// Runs the ragged-rows GEMM of `p` (mode 0; a [L, K]; b [G, N, K] (TN) or [G, K, N] (NN);
// out [L, N]).
template <class K>
std::string launch_ragged(const Problem& p, cudaStream_t stream) {
  using RI = RaggedRowsInstance<K>;
  using Gemm = typename RI::Gemm;
  using Kernel = typename RI::GemmKernel;
  if (p.mode != 0) return "the ragged-rows GEMM takes mode 0 (fprop or dgrad)";
  if (p.L + (p.G + 2) * 256 >= (int64_t{1} << 31) || p.N >= (int64_t{1} << 31) ||
      p.K >= (int64_t{1} << 31)) {
    return "the ragged-rows GEMM takes fewer than 2^31 - 256 (G + 2) rows and 2^31 columns";
  }
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return cudaGetErrorString(e);
  typename Kernel::StrideA da{};
  cute::get<0>(da) = p.K;  // a [L, K]
  cute::get<2>(da) = p.L * p.K;
  typename Kernel::StrideB db{};
  if constexpr (RI::kBKMajor) {
    cute::get<0>(db) = p.K;  // b [G, N, K]
  } else {
    cute::get<1>(db) = p.N;  // b [G, K, N]
  }
  cute::get<2>(db) = p.N * p.K;

  typename Gemm::Arguments args;
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = {int(p.L), int(p.N), int(p.K), int(p.G)};
  args.mainloop = {reinterpret_cast<const typename RI::ElementA*>(p.a), da,
                   reinterpret_cast<const typename RI::ElementB*>(p.b), db};
  if (K::kRowScale && p.row_scale == nullptr) return "a row-scaled instance needs row_scale";
  args.epilogue = {static_cast<typename RI::ElementD*>(p.out), p.alpha, p.pstarts,
                   K::kRowScale ? p.row_scale : nullptr};
  args.hw_info.device_id = device;
  args.hw_info.sm_count = sm_count_of(device);
  // Tiles along N: a CTA's row tiles never go back (the scheduler's walk over the groups).
  using Raster = decltype(args.scheduler.raster_order);
  args.scheduler.raster_order = Raster::AlongN;
  args.scheduler.max_swizzle_size = 1;
  args.scheduler.pstarts = p.pstarts;

  if (Gemm::get_workspace_size(args) > p.workspace_bytes) return "workspace too small";
  return run_gemm<Gemm>(args, p.workspace, stream);
}

}  // namespace sm90
}  // namespace jqffi
