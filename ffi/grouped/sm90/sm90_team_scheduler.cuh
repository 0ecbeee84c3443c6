// The team tile order of the CUTLASS grouped GEMM (configurations kCfgTeam / kCfgBf16Team).
//
// CUTLASS's grouped scheduler (PersistentTileSchedulerSm90Group) numbers the tiles of every
// group one after another and gives each CTA every grid-size-th one. With many groups of few
// tiles each (the 64-expert wgrad: 176 tiles a group, 132 CTAs) a CTA moves to another group
// at nearly every tile, and each move costs the pointer-array kernel its problem-shape load,
// the producer's TMA descriptor rewrite and fence, and the epilogue's store descriptor rewrite
// (16-19% of that wgrad, ffi/grouped/NOTES.md, session 18).
//
// Here the clusters form T teams of about kTeamClusters clusters; team t takes groups t, t+T,
// t+2T, ... and its clusters share each group's tiles (cluster s of the team takes the team's
// tiles s, s+S, ... counted through its groups in order). A CTA then stays in one group for
// about (tiles a group) / S tiles, and only ~T groups' operands are live in L2 at once. Every
// tile is still computed once, by the same CUTLASS code: the team order only chooses the
// linear tile index CUTLASS's own group walk resolves, and each CTA's indices increase, as
// that walk requires. Teams split the tiles, not the work: groups of unequal k-loops (tokens)
// make unequal teams, so the order suits a wgrad of many similar groups.
#pragma once

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/sm90_tile_scheduler_group.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"

namespace jqffi {
namespace sm90 {

// The problem shape of a team-ordered instance: a GroupProblemShape of its own type, the only
// hook the pointer-array kernels leave (their scheduler tag must be GroupScheduler), read by
// the TileSchedulerSelector specialization below.
struct TeamProblemShape : cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>> {};

constexpr uint32_t kTeamClusters = 8;  // clusters a team (about)
constexpr uint32_t kMaxTeams = 32;     // one group a lane when a team moves on

template <int Stages>
class TeamScheduler
    : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Group<TeamProblemShape,
                                                                             Stages> {
  using Base =
      cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Group<TeamProblemShape, Stages>;

 public:
  using typename Base::Params;
  using typename Base::RasterOrder;
  using typename Base::SchedulerResponse;
  using typename Base::WorkTileInfo;

  TeamScheduler() = default;
  CUTLASS_DEVICE TeamScheduler(Params const& params, SchedulerResponse* response)
      : Base(params, response) {}

  // This CTA's first tile (every thread calls it, before the warps take their roles).
  template <class ClusterShape>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(ClusterShape) {
    const Params& p = this->scheduler_params;
    const uint32_t linear = p.raster_order_ == RasterOrder::AlongN
                                ? blockIdx.x + blockIdx.y * gridDim.x
                                : blockIdx.x * gridDim.y + blockIdx.y;
    const uint32_t size = cluster_size();
    const uint32_t clusters = gridDim.x * gridDim.y * gridDim.z / size;
    const uint32_t cluster = linear / size;
    const uint32_t groups = uint32_t(p.problem_shapes_.groups());
    teams_ = clusters / kTeamClusters;
    teams_ = teams_ < 1 ? 1 : teams_;
    teams_ = teams_ > groups ? (groups > 0 ? groups : 1) : teams_;
    teams_ = teams_ > kMaxTeams ? kMaxTeams : teams_;
    const uint32_t team = cluster % teams_;
    rank_ = linear % size;
    stride_ = (clusters - team + teams_ - 1) / teams_;  // the clusters of this team
    item_ = cluster / teams_;
    group_ = team;
    start_ = tiles_of(0, team);
    return settle();
  }

  // The scheduler warp's next tile, pushed to the other warps as CUTLASS's scheduler does.
  template <class SchedulerPipeline, class SchedulerPipelineState>
  CUTLASS_DEVICE auto advance_to_next_work(SchedulerPipeline& pipeline,
                                           SchedulerPipelineState state,
                                           uint32_t advance_count = 1) {
    item_ += stride_ * advance_count;
    WorkTileInfo work = settle();
    pipeline.producer_acquire(state);
    if (cute::elect_one_sync()) {
      this->response_ptr_[state.index()] = work;
      cutlass::arch::fence_view_async_shared();
      pipeline.producer_commit(state);
    }
    return cute::make_tuple(work, true);
  }

 private:
  uint32_t group_ = 0;   // the team's current group
  uint32_t start_ = 0;   // its first tile in CUTLASS's linear order (CTA tiles of the groups before)
  uint32_t item_ = 0;    // this cluster's next tile of the team, counted from group_'s first
  uint32_t stride_ = 1;  // clusters of the team
  uint32_t teams_ = 1;
  uint32_t rank_ = 0;    // this CTA's place in its cluster (its offset in the linear order)

  CUTLASS_DEVICE uint32_t cluster_size() const {
    const Params& p = this->scheduler_params;
    return uint32_t(p.cluster_shape_.m() * p.cluster_shape_.n());
  }

  // CTA tiles of group g as CUTLASS's group walk counts them (rounded to the cluster and the
  // swizzle); 0 past the last group.
  CUTLASS_DEVICE uint32_t cta_tiles(uint32_t g) const {
    const Params& p = this->scheduler_params;
    if (g >= uint32_t(p.problem_shapes_.groups())) return 0;
    const auto shape = p.problem_shapes_.get_problem_shape(int32_t(g));
    const uint32_t swizzle = 1u << p.log_swizzle_size_;
    const uint32_t round_m = swizzle * uint32_t(p.cluster_shape_.m());
    const uint32_t round_n = swizzle * uint32_t(p.cluster_shape_.n());
    const uint32_t m = (uint32_t(cute::get<0>(shape)) + p.cta_shape_.m() - 1) / p.cta_shape_.m();
    const uint32_t n = (uint32_t(cute::get<1>(shape)) + p.cta_shape_.n() - 1) / p.cta_shape_.n();
    return ((m + round_m - 1) / round_m * round_m) * ((n + round_n - 1) / round_n * round_n);
  }

  // CTA tiles of groups [first, first + count), count <= 32: one group a lane, summed over the
  // warp (every lane takes part).
  CUTLASS_DEVICE uint32_t tiles_of(uint32_t first, uint32_t count) const {
    const uint32_t lane = cutlass::canonical_lane_idx();
    uint32_t tiles = lane < count ? cta_tiles(first + lane) : 0;
    CUTLASS_PRAGMA_UNROLL
    for (int offset = 16; offset > 0; offset >>= 1) {
      tiles += __shfl_xor_sync(0xffffffff, tiles, offset);
    }
    return tiles;
  }

  // Moves the team on to the group that holds item_ and returns that tile (or no tile).
  CUTLASS_DEVICE WorkTileInfo settle() {
    const uint32_t groups = uint32_t(this->scheduler_params.problem_shapes_.groups());
    const uint32_t size = cluster_size();
    while (group_ < groups) {
      const uint32_t items = cta_tiles(group_) / size;
      if (item_ < items) {
        return Base::get_current_work_for_linear_idx(uint64_t(start_) + uint64_t(item_) * size +
                                                     rank_);
      }
      item_ -= items;
      start_ += tiles_of(group_, teams_);
      group_ += teams_;
    }
    return WorkTileInfo::invalid_work_tile();
  }
};

}  // namespace sm90
}  // namespace jqffi

namespace cutlass::gemm::kernel::detail {

// A team-ordered instance's scheduler (selected by its problem shape type).
template <class TileShape, class ClusterShape, uint32_t SchedulerPipelineStageCount>
struct TileSchedulerSelector<GroupScheduler, arch::Sm90, TileShape, ClusterShape,
                             SchedulerPipelineStageCount, jqffi::sm90::TeamProblemShape> {
  using Scheduler = jqffi::sm90::TeamScheduler<int(SchedulerPipelineStageCount)>;
};

}  // namespace cutlass::gemm::kernel::detail
