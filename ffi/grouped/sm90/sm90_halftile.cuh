// Half row tiles for the pointer-array grouped GEMM (design decision 55): a cooperative 128-row
// tile holding at most 64 of its group's rows (a ragged GEMM's last row tile of a group) runs
// its MMAs in the first consumer warpgroup only (the second does one block's). The second warpgroup's 64 rows are all past
// the group: the TMA store clips them at the group's end anyway, so computing them bought
// nothing, and leaving them out lets the first warpgroup's wgmmas have the tensor cores to
// themselves (one warpgroup's wgmma stream fills them, as the pingpong kernels show), so such
// a tile costs about half a tile. On routed group sizes (64 experts x ~256 rows, a multinomial
// spread of +-16) about half the groups end in such a tile.
//
// Two pieces around CUTLASS's own pointer-array cooperative kernel (unmodified):
//   * HalfTileScheduler: CUTLASS's grouped persistent scheduler whose per-tile k-block count
//     (`get_work_k_tile_count`) also carries the rows of the group in the tile (RowTile,
//     converting to the count, which is all the kernel itself does with it). The kernel picks
//     it through the problem-shape type (HalfTileProblemShape): CUTLASS's pointer-array kernels
//     take no scheduler tag but the grouped one.
//   * HalfTileMainloop: CUTLASS's pointer-array mainloop whose `mma` lets the second warpgroup
//     of a half tile run its first block's MMAs only (they define its accumulators) and wait for
//     and release the other stages, in the order CUTLASS's k-loop releases them (its `mma_tail`
//     releases the last).
#pragma once

#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/sm90_tile_scheduler_group.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"

namespace jqffi {
namespace sm90 {

// A tile's k-block count and the rows of its group it holds (<= the tile's rows).
struct RowTile {
  int count = 0, rows = 0;
  CUTLASS_HOST_DEVICE operator int() const { return count; }
};

// CUTLASS's grouped problem shape under its own type, so the scheduler selector below picks
// HalfTileScheduler for the kernels built on it.
struct HalfTileProblemShape : cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>> {};

template <class GroupProblemShape, int Stages, int BLK_M>
class HalfTileScheduler
    : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Group<GroupProblemShape,
                                                                             Stages> {
  using Base =
      cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Group<GroupProblemShape, Stages>;

 public:
  using Base::Base;
  // `problem_shape` is the tile's group's (M, N, K, 1); M_idx its row tile in the group.
  template <class ProblemShape, class TileShape>
  CUTLASS_HOST_DEVICE static RowTile get_work_k_tile_count(
      typename Base::WorkTileInfo const& work, ProblemShape problem_shape, TileShape tile_shape) {
    const int rows = int(cute::get<0>(problem_shape)) - work.M_idx * BLK_M;
    return RowTile{int(Base::get_work_k_tile_count(work, problem_shape, tile_shape)),
                   rows < BLK_M ? rows : BLK_M};
  }
};

// CUTLASS's pointer-array mainloop `Base` with half tiles' second warpgroup idle.
template <class Base>
struct HalfTileMainloop : Base {
  using typename Base::MainloopPipeline;
  using typename Base::Params;
  using typename Base::PipelineState;
  using typename Base::TensorStorage;
  using typename Base::TiledMma;
  static constexpr int kBlkM = cute::size<0>(typename Base::TileShape{});
  static_assert(cute::size(TiledMma{}) == 2 * cutlass::NumThreadsPerWarpGroup && kBlkM == 128,
                "two consumer warpgroups of 64 rows each (the cooperative 128-row tile)");

  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read,
                          FrgTensorC& accum, RowTile tile, int thread_idx,
                          TensorStorage& shared_tensors, Params const& params) {
    const int warp_group =
        __shfl_sync(0xFFFFFFFF, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
    if (warp_group == 0 || tile.rows > kBlkM / 2) {
      Base::mma(pipeline, smem_pipe_read, accum, tile.count, thread_idx, shared_tensors, params);
      return;
    }
    // One block's MMAs still define the accumulators (if no wgmma did, ptxas would serialize
    // every wgmma of the kernel); the other blocks are waited for and released as Base::mma's
    // k-loop releases them (stage j once stage j + K_PIPE_MMAS is in), mma_tail the last.
    Base::mma(pipeline, smem_pipe_read, accum, 1, thread_idx, shared_tensors, params);
    cute::warpgroup_wait<0>();
    PipelineState smem_pipe_release = smem_pipe_read;
    ++smem_pipe_read;
    CUTLASS_PRAGMA_NO_UNROLL
    for (int j = 1; j < tile.count; ++j) {
      auto token = pipeline.consumer_try_wait(smem_pipe_read);
      pipeline.consumer_wait(smem_pipe_read, token);
      if (j >= Base::K_PIPE_MMAS) {
        pipeline.consumer_release(smem_pipe_release);
        ++smem_pipe_release;
      }
      ++smem_pipe_read;
    }
  }
};

}  // namespace sm90
}  // namespace jqffi

namespace cutlass::gemm::kernel::detail {
template <class TileShape, class ClusterShape, uint32_t Stages>
struct TileSchedulerSelector<GroupScheduler, arch::Sm90, TileShape, ClusterShape, Stages,
                             jqffi::sm90::HalfTileProblemShape> {
  using Scheduler = jqffi::sm90::HalfTileScheduler<jqffi::sm90::HalfTileProblemShape, Stages,
                                                   cute::size<0>(TileShape{})>;
};
}  // namespace cutlass::gemm::kernel::detail
