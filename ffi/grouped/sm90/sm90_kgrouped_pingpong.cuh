// The k-grouped wgrad's pingpong kernel (design decision 52): two consumer warpgroups take a
// CTA's tiles in turn, each a whole tile, so one's epilogue (the output store, most of a
// short-contraction tile's time) runs under the other's k-loop.
//
// CUTLASS's own pingpong kernel cannot run the k-grouped problem: every tile there has the same
// k-block count, and a warpgroup moves its read position in the shared pipeline past its
// partner's tile by that count. Here each tile has its group's count (KTiles), so after its own
// tile a warpgroup asks the scheduler for the partner's tile (the CTA's next one) and skips
// exactly its blocks. Everything else is CUTLASS's: the kernel derives from its pingpong
// GemmUniversal (shared memory, parameters, launch, grid), and calls its pipelines, order
// barrier, collective mainloop (KGroupedMainloop) and TMA epilogue as that kernel does. Static
// persistent scheduling (KGroupedScheduler), no C operand.
#pragma once

#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/pipeline/pipeline.hpp"

namespace jqffi {
namespace sm90 {

template <class ProblemShape, class Mainloop, class Epilogue, class SchedulerTag>
class KGroupedPingpongKernel
    : public cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue, SchedulerTag> {
  using Base = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue, SchedulerTag>;
  static_assert(cute::is_base_of_v<cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                                   typename Mainloop::DispatchPolicy::Schedule>,
                "the pingpong k-grouped kernel takes a pingpong mainloop");
  static_assert(!Base::IsSchedDynamicPersistent, "static persistent scheduling only");

 public:
  using typename Base::Params;
  using typename Base::SharedStorage;
  using typename Base::TileScheduler;
  using typename Base::TileShape;
  using typename Base::ClusterShape;
  using typename Base::TiledMma;
  using typename Base::MathWarpGroupOrderBarrier;

  CUTLASS_DEVICE void operator()(Params const& params, char* smem_buf) {
    using namespace cute;
    using MainloopPipeline = typename Mainloop::MainloopPipeline;
    using EpiLoadPipeline = typename Epilogue::LoadPipeline;
    using EpiStorePipeline = typename Epilogue::StorePipeline;
    constexpr int kWarpGroupThreads = cutlass::NumThreadsPerWarpGroup;

    SharedStorage& shared = *reinterpret_cast<SharedStorage*>(smem_buf);
    const int warp_idx = cutlass::canonical_warp_idx_sync();
    const int warp_group = cutlass::canonical_warp_group_idx();  // 0 loads, 1 and 2 compute
    const int warp_group_thread = int(threadIdx.x) % kWarpGroupThreads;
    const bool loader = warp_group == 0;
    const bool load_warp = loader && warp_idx % cutlass::NumWarpsPerWarpGroup == 0;
    const uint32_t rank_in_cluster = cute::block_rank_in_cluster();

    if (warp_idx == 0 && cute::elect_one_sync()) {
      Mainloop::prefetch_tma_descriptors(params.mainloop);
      Epilogue::prefetch_tma_descriptors(params.epilogue);
    }

    // The operand pipeline: the load warp produces, each computing warpgroup consumes.
    typename MainloopPipeline::Params mainloop_params;
    if (load_warp) mainloop_params.role = MainloopPipeline::ThreadCategory::Producer;
    if (!loader) mainloop_params.role = MainloopPipeline::ThreadCategory::Consumer;
    mainloop_params.is_leader = warp_group_thread == 0;
    mainloop_params.num_consumers = kWarpGroupThreads;
    mainloop_params.num_producers = Base::NumProducerThreads;
    mainloop_params.transaction_bytes = params.mainloop.tma_transaction_bytes;
    MainloopPipeline mainloop_pipeline(shared.pipelines.mainloop, mainloop_params, ClusterShape{});

    // The epilogue's pipelines: no C is ever loaded, so the load pipeline only has consumers.
    typename EpiLoadPipeline::Params epi_load_params;
    if (!loader) epi_load_params.role = EpiLoadPipeline::ThreadCategory::Consumer;
    epi_load_params.dst_blockid = rank_in_cluster;
    epi_load_params.producer_arv_count = cutlass::NumThreadsPerWarp;
    epi_load_params.consumer_arv_count = kWarpGroupThreads;
    if constexpr (Epilogue::RequiresTransactionBytes) {
      epi_load_params.transaction_bytes = params.epilogue.tma_transaction_bytes;
    }
    EpiLoadPipeline epi_load_pipeline(shared.pipelines.epi_load, epi_load_params);
    typename EpiStorePipeline::Params epi_store_params;
    epi_store_params.always_wait = true;
    EpiStorePipeline epi_store_pipeline(epi_store_params);

    // The two computing warpgroups' turns: k-loops in tile order, epilogues in tile order.
    typename MathWarpGroupOrderBarrier::Params order_params;
    order_params.group_id = warp_group - 1;
    order_params.group_size = kWarpGroupThreads;
    MathWarpGroupOrderBarrier order(shared.pipelines.math_wg_order, order_params);

    typename Mainloop::PipelineState read_state;
    typename Epilogue::LoadPipelineState epi_load_state;
    auto write_state = cutlass::make_producer_start_state<MainloopPipeline>();
    auto epi_store_state = cutlass::make_producer_start_state<EpiStorePipeline>();

    // Every CTA of the cluster sees the pipelines initialized before any uses them.
    if constexpr (size(ClusterShape{}) > 1) {
      cute::cluster_arrive_relaxed();
      cute::cluster_wait();
    } else {
      __syncthreads();
    }

    auto problem_shape = append<4>(params.problem_shape, Int<1>{});  // (M, N, tokens, G)
    Mainloop mainloop;
    Epilogue epilogue(params.epilogue, shared.tensors.epilogue);
    auto load_inputs = mainloop.load_init(problem_shape, params.mainloop);
    const auto c_tiles = Epilogue::get_load_pipe_increment(TileShape{});
    const auto d_tiles = Epilogue::get_store_pipe_increment(TileShape{});
    TileScheduler scheduler{params.scheduler};
    auto work = scheduler.initial_work_tile_info(ClusterShape{});
    auto coord_of = [](auto const& w) { return make_coord(int(w.M_idx), int(w.N_idx), _, int(w.L_idx)); };

    if (loader) {
      cutlass::arch::warpgroup_reg_dealloc<Base::LoadRegisterRequirement>();
      if (load_warp) {  // every tile of the CTA, both warpgroups', in order
        const int lane = cutlass::canonical_lane_idx();
        while (work.is_valid()) {
          mainloop.load(params.mainloop, mainloop_pipeline, write_state, load_inputs, coord_of(work), 0,
                        work.k, lane, rank_in_cluster, shared.tensors.mainloop);
          write_state.advance(work.k.count);
          scheduler.advance_to_next_work();
          work = scheduler.get_current_work();
        }
        mainloop.load_tail(mainloop_pipeline, write_state);
      }
      return;
    }

    cutlass::arch::warpgroup_reg_alloc<Base::MmaRegisterRequirement>();
    if (warp_group == 2) {  // the second warpgroup starts at the CTA's second tile
      if (work.is_valid()) read_state.advance(work.k.count);
      epi_load_state.advance(c_tiles);
      epi_store_state.advance(d_tiles);
      scheduler.advance_to_next_work();
      work = scheduler.get_current_work();
    }
    TiledMma tiled_mma;
    while (work.is_valid()) {
      Tensor accumulators = partition_fragment_C(tiled_mma, take<0, 2>(TileShape{}));
      order.wait();
      mainloop.mma(mainloop_pipeline, read_state, accumulators, work.k, warp_group_thread,
                   shared.tensors.mainloop, params.mainloop);
      order.arrive();  // the partner's k-loop may start
      mainloop.mma_tail(mainloop_pipeline, read_state, work.k);

      // Past this tile's blocks and the partner's tile's (the CTA's next tile), whatever
      // their groups' counts.
      TileScheduler partner = scheduler;
      partner.advance_to_next_work();
      const auto partner_work = partner.get_current_work();
      read_state.advance(work.k.count + (partner_work.is_valid() ? partner_work.k.count : 0));

      order.wait();
      auto [load_next, store_next] = epilogue.store(
          epi_load_pipeline, epi_load_state, epi_store_pipeline, epi_store_state, problem_shape,
          TileShape{}, coord_of(work), accumulators, tiled_mma, warp_group_thread,
          shared.tensors.epilogue);
      // The stores must land before the partner's epilogue reuses their shared memory.
      auto [load_after, store_after] =
          epilogue.store_tail(epi_load_pipeline, load_next, epi_store_pipeline, store_next);
      epi_load_state = load_after;
      epi_store_state = store_after;
      epi_load_state.advance(c_tiles);  // past the partner's tile
      epi_store_state.advance(d_tiles);
      order.arrive();  // the partner's epilogue may start

      scheduler.advance_to_next_work(2);
      work = scheduler.get_current_work();
    }
  }
};

}  // namespace sm90
}  // namespace jqffi
