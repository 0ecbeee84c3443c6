// The k-grouped wgrad (mode 1; bfloat16 operands of layout NT or TN, per-tensor FP8 of layout
// TN): out[g] = the product of a's and b's columns of g's tokens, on CUTLASS's batched (not
// pointer-array) Hopper kernel, the group being the batch coordinate (design decision 50). Every
// group's operands are token ranges of the same two matrices and every output a slice of one
// [G, M, N] tensor, so one TMA descriptor per operand serves all groups: no per-group pointer
// arrays, no setup kernel, no descriptor rewrites when a CTA moves to another group (what the
// pointer-array kernel pays at nearly every tile of 64 small groups).
//
// Contract: a K-major operand's groups start on 16-byte boundaries (the wgrad copies' token
// layouts: block 8 for bfloat16, 16 for FP8); M/N-major ones (NT) start anywhere.
//
// Three pieces on top of CUTLASS's own cooperative kernel (GemmUniversal, unmodified), or on
// top of its pingpong kernel with the one change sm90_kgrouped_pingpong.cuh makes (each consumer
// warpgroup skipping its partner's tile by that tile's block count; design decision 52):
//   * KGroupedScheduler: the persistent scheduler's tiles over (M, N, G), each carrying its
//     group's contraction range (`KTiles`: first token, 64-token blocks, rows of the last block)
//     read from the device-side group starts; the kernel passes that range to the mainloop as
//     its k-tile count.
//   * KGroupedMainloop: CUTLASS's TMA + wgmma mainloop (for FP8 with its float32 promotion),
//     loading each group's blocks from its first token and, for a last block that runs past the
//     group, zeroing the rows beyond it in shared memory before the MMAs read them (the rows of
//     the next group, or TMA's zero fill past the last token). An empty group takes one block
//     with every row zeroed, so its MMAs write the zeros it stores.
//   * launch_kgrouped: the arguments (one descriptor per operand, D as [G, M, N]) and the run.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "cutlass/arch/barrier.h"
#include "cutlass/gemm/kernel/sm90_tile_scheduler.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"
#include "grouped/sm90/sm90_kgrouped_pingpong.cuh"
#include "grouped/sm90/sm90_launch.cuh"

namespace jqffi {
namespace sm90 {

// One tile's contraction: `count` blocks of BLK_K tokens from token `start`; the last block
// holds `last_rows` of the group's tokens (BLK_K when the group fills it). Converts to the block
// count, which is all the kernel itself does with it (pipeline state advances).
struct KTiles {
  int start = 0, count = 0, last_rows = 0;
  CUTLASS_HOST_DEVICE operator int() const { return count; }
};

// The tag that selects KGroupedScheduler in GemmUniversal's TileSchedulerSelector.
struct KGroupedSchedulerTag {};

// CUTLASS's static persistent scheduler over (M, N, G) tiles, plus each tile's KTiles.
template <int BLK_K>
class KGroupedScheduler : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90 {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;

 public:
  struct Arguments : Base::Arguments {
    const int32_t* pstarts = nullptr;  // [G + 1] group starts along the tokens (device)
  };
  struct Params : Base::Params {
    const int32_t* pstarts = nullptr;
    int tokens = 0;  // L, the problem's K: starts are clamped to [0, L] (clamp_start)
  };
  struct WorkTileInfo : Base::WorkTileInfo {
    KTiles k;
  };

  template <class ProblemShapeMNKL, class TileShape, class ClusterShape>
  static Params to_underlying_arguments(ProblemShapeMNKL problem_shape_mnkl, TileShape tile_shape,
                                        ClusterShape cluster_shape,
                                        cutlass::KernelHardwareInfo const& hw_info,
                                        Arguments const& args, void* workspace = nullptr,
                                        const uint32_t epilogue_subtile = 1,
                                        uint32_t ktile_start_alignment_count = 1u) {
    Params params;
    static_cast<Base::Params&>(params) = Base::to_underlying_arguments(
        problem_shape_mnkl, tile_shape, cluster_shape, hw_info, args, workspace, epilogue_subtile,
        ktile_start_alignment_count);
    params.pstarts = args.pstarts;
    params.tokens = cute::get<2>(problem_shape_mnkl);
    return params;
  }

  CUTLASS_HOST_DEVICE KGroupedScheduler() {}
  CUTLASS_DEVICE explicit KGroupedScheduler(Params const& params)
      : Base(params), pstarts_(params.pstarts), tokens_(params.tokens) {}

  template <class ClusterShape>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(ClusterShape) {
    return with_k(Base::get_current_work());
  }
  CUTLASS_DEVICE WorkTileInfo get_current_work() const { return with_k(Base::get_current_work()); }
  template <class... Rest>
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo const&, Rest&&...) {
    Base::advance_to_next_work();
    return cute::make_tuple(get_current_work(), true);
  }

  template <class ProblemShape, class TileShape>
  CUTLASS_HOST_DEVICE static KTiles get_work_k_tile_count(WorkTileInfo const& work, ProblemShape,
                                                          TileShape) {
    return work.k;
  }
  CUTLASS_HOST_DEVICE static uint32_t get_work_k_tile_start(WorkTileInfo const&) { return 0u; }

 private:
  CUTLASS_DEVICE WorkTileInfo with_k(Base::WorkTileInfo base) const {
    WorkTileInfo work;
    static_cast<Base::WorkTileInfo&>(work) = base;
    if (base.is_valid()) {  // the setup kernel's clamp (L < 2^31: launch_kgrouped checks)
      const int lo = int(clamp_start(pstarts_, base.L_idx, tokens_));
      const int hi = cute::max(lo, int(clamp_start(pstarts_, base.L_idx + 1, tokens_)));
      // An empty group still takes one block, all of whose rows are zeroed: its MMAs write
      // the zeros it stores (no other instruction may write the accumulators, or ptxas
      // serializes every wgmma).
      const int count = cute::max(1, (hi - lo + BLK_K - 1) / BLK_K);
      work.k = KTiles{lo, count, hi - lo - (count - 1) * BLK_K};
    }
    return work;
  }

  const int32_t* pstarts_ = nullptr;
  int tokens_ = 0;
};

}  // namespace sm90
}  // namespace jqffi

namespace cutlass::gemm::kernel::detail {
template <class ArchTag, class TileShape, class ClusterShape, uint32_t Stages>
struct TileSchedulerSelector<jqffi::sm90::KGroupedSchedulerTag, ArchTag, TileShape, ClusterShape,
                             Stages> {
  using Scheduler = jqffi::sm90::KGroupedScheduler<cute::size<2>(TileShape{})>;
};
}  // namespace cutlass::gemm::kernel::detail

namespace jqffi {
namespace sm90 {

// CUTLASS's TMA warp-specialized mainloop (`Base`, from its builder) reading each tile's group
// by KTiles: loads from the group's first token and zeroes the rows past the group in its last
// block (all of them for an empty group's one block).
template <class Base>
struct KGroupedMainloop : Base {
  using typename Base::MainloopPipeline;
  using typename Base::Params;
  using typename Base::PipelineState;
  using typename Base::SmemLayoutA;
  using typename Base::SmemLayoutB;
  using typename Base::StrideA;
  using typename Base::StrideB;
  using typename Base::TensorStorage;
  using typename Base::TileShape;
  using typename Base::TiledMma;
  using DispatchPolicy = typename Base::DispatchPolicy;
  using GmemTiledCopyA = typename Base::GmemTiledCopyA;
  using GmemTiledCopyB = typename Base::GmemTiledCopyB;
  static constexpr int kBlkM = cute::size<0>(TileShape{});
  static constexpr int kBlkN = cute::size<1>(TileShape{});
  static constexpr int kBlkK = cute::size<2>(TileShape{});
  static constexpr int kMmaThreads = cute::size(TiledMma{});
  // Under any GMMA swizzle, 16 consecutive bytes along an operand's contiguous axis (8 bfloat16
  // or 16 FP8 values) are one 16-byte chunk of shared memory: a token row of an M/N-major
  // operand (bfloat16 layout NT) is zeroed in whole chunks, the tokens past a group in a K-major
  // one (layout TN) in whole chunks after at most one partial chunk a row.
  static constexpr bool kAMnMajor = cutlass::gemm::detail::is_major<0, StrideA>();
  static constexpr bool kBMnMajor = cutlass::gemm::detail::is_major<0, StrideB>();
  // FP8 operands: CUTLASS's two-level accumulation (the tensor cores' partial sums added to the
  // float32 accumulators every `mma_promotion_interval` MMAs), as its FP8 mainloop does.
  // wgmma instructions a block (BLK_K over the atom's K), what CUTLASS counts promotions in.
  static constexpr int kMmasPerBlock =
      kBlkK / cute::size<2>(typename TiledMma::AtomShape_MNK{});
  static constexpr bool kPromote = sizeof(typename TiledMma::ValTypeA) == 1 &&
                                   !cute::is_same_v<typename DispatchPolicy::Schedule,
                                       cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8FastAccum>;
  // The named barrier the consumers meet at after zeroing (user ids follow CUTLASS's reserved).
  static constexpr uint32_t kZeroBarrier = 0;

  // The kernel's problem shape is (M, N, L, G); the descriptors cover the tokens once (one batch).
  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const& problem_shape,
                                                  typename Base::Arguments const& args,
                                                  void* workspace) {
    auto [M, N, K, L] = problem_shape;
    return Base::to_underlying_arguments(cute::make_shape(M, N, K, 1), args, workspace);
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem_shape,
                            typename Base::Arguments const& args) {
    auto [M, N, K, L] = problem_shape;
    return Base::can_implement(cute::make_shape(M, N, K, 1), args);
  }

  // CUTLASS's tiled views (the kernel reads their tile counts) and the untiled (M, L) / (N, L)
  // coordinate tensors the loads offset to a group's first token.
  template <class ProblemShape_MNKL>
  CUTLASS_DEVICE auto load_init(ProblemShape_MNKL const& problem_shape_MNKL,
                                Params const& params) const {
    auto [M, N, K, L] = problem_shape_MNKL;
    auto tiled = Base::load_init(problem_shape_MNKL, params);
    cute::Tensor mA = params.tma_load_a.get_tma_tensor(cute::make_shape(M, K, 1));
    cute::Tensor mB = params.tma_load_b.get_tma_tensor(cute::make_shape(N, K, 1));
    return cute::make_tuple(cute::get<0>(tiled), cute::get<1>(tiled), mA, mB);
  }

  // Producer: the tile's blocks from the group's first token, as CUTLASS's load (multicast in a
  // cluster) but at token offsets.
  template <class LoadInputs, class BlockCoord, class KTileIterator>
  CUTLASS_DEVICE void load(Params const& params, MainloopPipeline pipeline,
                           PipelineState smem_pipe_write, LoadInputs const& load_inputs,
                           BlockCoord const& blk_coord, KTileIterator, KTiles k, int,
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

    const auto m_coord = get<0>(blk_coord);
    const auto n_coord = get<1>(blk_coord);
    Tensor mA = domain_offset(make_coord(_0{}, k.start, _0{}), get<2>(load_inputs));
    Tensor mB = domain_offset(make_coord(_0{}, k.start, _0{}), get<3>(load_inputs));
    Tensor gA = local_tile(mA(_, _, 0), select<0, 2>(TileShape{}), make_coord(m_coord, _));
    Tensor gB = local_tile(mB(_, _, 0), select<1, 2>(TileShape{}), make_coord(n_coord, _));
    Tensor tAgA = block_tma_a.partition_S(gA);  // (TMA, TMA_M, TMA_K, k)
    Tensor tAsA = block_tma_a.partition_D(sA);  // (TMA, TMA_M, TMA_K, PIPE)
    Tensor tBgB = block_tma_b.partition_S(gB);
    Tensor tBsB = block_tma_b.partition_D(sB);

    uint16_t mcast_a = 0, mcast_b = 0;
    auto block_layout = Layout<ClusterShape>{};  // (m, n) -> block id
    if constexpr (cute::is_same_v<GmemTiledCopyA, SM90_TMA_LOAD_MULTICAST>) {
      for (int n = 0; n < size<1>(block_layout); ++n) {
        mcast_a |= uint16_t(1) << block_layout(in_cluster.x, n, Int<0>{});
      }
    }
    if constexpr (cute::is_same_v<GmemTiledCopyB, SM90_TMA_LOAD_MULTICAST>) {
      for (int m = 0; m < size<0>(block_layout); ++m) {
        mcast_b |= uint16_t(1) << block_layout(m, in_cluster.y, Int<0>{});
      }
    }
    CUTLASS_PRAGMA_NO_UNROLL
    for (int j = 0; j < k.count; ++j) {
      pipeline.producer_acquire(smem_pipe_write);
      auto* bar = pipeline.producer_get_barrier(smem_pipe_write);
      const int stage = smem_pipe_write.index();
      copy(params.tma_load_a.with(*bar, mcast_a), tAgA(_, _, _, j), tAsA(_, _, _, stage));
      copy(params.tma_load_b.with(*bar, mcast_b), tBgB(_, _, _, j), tBsB(_, _, _, stage));
      ++smem_pipe_write;
    }
  }

  // Zeroes tokens [rows, BLK_K) of `stage` in one operand's shared memory `s` ((MN, K, PIPE),
  // MN_TILE rows), shared out over the consumer threads.
  template <bool MnMajor, int MN_TILE, class SmemTensor>
  CUTLASS_DEVICE static void zero_tokens(SmemTensor& s, int stage, int rows, int thread_idx) {
    using namespace cute;
    using Element = cute::remove_cvref_t<decltype(s(0, 0, 0))>;
    constexpr int per_chunk = 16 / sizeof(Element);  // values of a 16-byte chunk
    const uint4 zero = make_uint4(0, 0, 0, 0);
    auto chunk = [&](int mn, int k) -> uint4& {
      return *reinterpret_cast<uint4*>(raw_pointer_cast(&s(mn, k, stage)));
    };
    if constexpr (MnMajor) {  // a token is MN_TILE / per_chunk whole chunks
      constexpr int chunks = MN_TILE / per_chunk;
      for (int i = thread_idx; i < (kBlkK - rows) * chunks; i += kMmaThreads) {
        chunk((i % chunks) * per_chunk, rows + i / chunks) = zero;
      }
    } else {  // a row's tokens run along chunks of per_chunk
      const int whole_from = (rows + per_chunk - 1) / per_chunk;
      for (int i = thread_idx; i < MN_TILE * (kBlkK / per_chunk - whole_from);
           i += kMmaThreads) {
        chunk(i % MN_TILE, per_chunk * (whole_from + i / MN_TILE)) = zero;
      }
      for (int i = thread_idx; i < MN_TILE * (per_chunk * whole_from - rows); i += kMmaThreads) {
        s(i % MN_TILE, rows + i / MN_TILE, stage) = Element(0);
      }
    }
  }

  // Zeroes tokens [rows, BLK_K) of `stage` in A and B (all consumer threads), then makes the
  // stores visible to the wgmma (async proxy) before any consumer issues it.
  CUTLASS_DEVICE static void zero_rows(TensorStorage& shared_tensors, int stage, int rows,
                                       int thread_idx) {
    using namespace cute;
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});
    zero_tokens<kAMnMajor, kBlkM>(sA, stage, rows, thread_idx);
    zero_tokens<kBMnMajor, kBlkN>(sB, stage, rows, thread_idx);
    cutlass::arch::fence_view_async_shared();
    cutlass::arch::NamedBarrier::sync(kMmaThreads, kZeroBarrier);
  }

  // Consumers: one wgmma batch a block, at most one in flight while the next block is waited
  // for (CUTLASS's K_PIPE_MMAS = 1); the previous block's stage is released once its batch is
  // done. FP8: the batches accumulate into CUTLASS's promotion buffer, added to `accum` every
  // `mma_promotion_interval` MMAs and at the end.
  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read,
                          FrgTensorC& accum, KTiles k, int thread_idx,
                          TensorStorage& shared_tensors, Params const& params) {
    if constexpr (kPromote) {
      using namespace cute;
      cutlass::gemm::collective::GmmaFP8Accumulation promoted(
          accum, params.mma_promotion_interval, kMmasPerBlock);
      mma_blocks(pipeline, smem_pipe_read, promoted(), k, thread_idx, shared_tensors,
                 [&] { return promoted.prepare_if_needed(); },
                 [&] { promoted.promote_if_needed(); });
      promoted.promote_residue_if_needed();
      warpgroup_fence_operand(promoted());
    } else {
      mma_blocks(pipeline, smem_pipe_read, accum, k, thread_idx, shared_tensors,
                 [] { return false; }, [] {});
    }
  }

  // The k-loop of `mma` on accumulators `accum` (the wgmma's own: FP8's promotion buffer).
  // `reset()`: whether the next batch starts them from zero (after a promotion); `promote()`
  // after each batch is issued (and, past the first, waited for).
  template <class FrgTensorC, class Reset, class Promote>
  CUTLASS_DEVICE void mma_blocks(MainloopPipeline pipeline, PipelineState smem_pipe_read,
                                 FrgTensorC& accum, KTiles k, int thread_idx,
                                 TensorStorage& shared_tensors, Reset reset, Promote promote) {
    using namespace cute;
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});
    constexpr int warp_groups = kMmaThreads / cutlass::NumThreadsPerWarpGroup;
    Layout warp_group_layout = make_layout(Int<warp_groups>{}, Int<cutlass::NumThreadsPerWarpGroup>{});
    const int warp_group = __shfl_sync(0xFFFFFFFF, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
    TiledMma tiled_mma;
    auto thread_mma = tiled_mma.get_slice(warp_group_layout(warp_group));
    Tensor tCrA = thread_mma.make_fragment_A(thread_mma.partition_A(sA));  // (MMA, M, K, PIPE)
    Tensor tCrB = thread_mma.make_fragment_B(thread_mma.partition_B(sB));
    static_assert(decltype(size<2>(tCrA))::value == kMmasPerBlock, "one wgmma a k-block");

    warpgroup_fence_operand(accum);
    tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
    PipelineState smem_pipe_release = smem_pipe_read;
    CUTLASS_PRAGMA_NO_UNROLL
    for (int j = 0; j < k.count; ++j) {
      auto token = pipeline.consumer_try_wait(smem_pipe_read);
      pipeline.consumer_wait(smem_pipe_read, token);
      const int stage = smem_pipe_read.index();
      if (j == k.count - 1 && k.last_rows < kBlkK) {
        zero_rows(shared_tensors, stage, k.last_rows, thread_idx);
      }
      if (reset()) tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
      warpgroup_fence_operand(accum);
      warpgroup_arrive();
      CUTLASS_PRAGMA_UNROLL
      for (int kb = 0; kb < size<2>(tCrA); ++kb) {
        cute::gemm(tiled_mma, tCrA(_, _, kb, stage), tCrB(_, _, kb, stage), accum);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      if (j > 0) {
        warpgroup_wait<1>();
        warpgroup_fence_operand(accum);
      }
      promote();
      if (j > 0) {
        pipeline.consumer_release(smem_pipe_release);
        ++smem_pipe_release;
      }
      ++smem_pipe_read;
    }
    warpgroup_fence_operand(accum);
  }

  // Waits for the last batch and releases its stage (the others went in `mma`).
  CUTLASS_DEVICE void mma_tail(MainloopPipeline pipeline, PipelineState smem_pipe_release,
                               KTiles k) {
    smem_pipe_release.advance(k.count - 1);
    cute::warpgroup_wait<0>();
    pipeline.consumer_release(smem_pipe_release);
  }
};

// The kernel types of the k-grouped wgrad for Instance K's tile, cluster and output: CUTLASS's
// cooperative kernel (both consumer warpgroups on one tile), or for a pingpong configuration
// KGroupedPingpongKernel (each warpgroup its own tiles; bfloat16 only: FP8's promotion buffer
// would double a warpgroup's accumulators, and its 64-row form measured no better, NOTES.md).
template <class K>
struct KGroupedInstance {
  static constexpr bool kPingpong = K::Config::kPingpong;
  using ElementA = typename K::ElementA;
  using ElementB = typename K::ElementB;
  static_assert(!kPingpong || sizeof(ElementA) == 2,
                "the pingpong k-grouped wgrad is bfloat16 only");
  using ElementD = typename K::ElementD;
  using LayoutD = cutlass::layout::RowMajor;
  using TileShape = typename K::TileShape;
  using ClusterShape = typename K::ClusterShape;
  using EpilogueSchedule = cute::conditional_t<kPingpong, cutlass::epilogue::TmaWarpSpecialized,
                                               cutlass::epilogue::TmaWarpSpecializedCooperative>;
  using MainloopSchedule =
      cute::conditional_t<kPingpong, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                          cutlass::gemm::KernelTmaWarpSpecializedCooperative>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD, K::kAlignD,
      ElementD, LayoutD, K::kAlignD, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>>::CollectiveOp;
  // The operand layouts of the pointer-array instance: TN (A [M, L], B [N, L], tokens
  // contiguous) or NT (A [L, M], B [L, N]).
  using LayoutA = cute::remove_pointer_t<typename K::Ops::MainloopLayoutA>;
  using LayoutB = cute::remove_pointer_t<typename K::Ops::MainloopLayoutB>;
  static constexpr bool kAKMajor = K::Ops::kAKMajor, kBKMajor = K::Ops::kBKMajor;
  using BaseMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA,
      K::kAlignA, ElementB, LayoutB, K::kAlignB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;
  using Mainloop = KGroupedMainloop<BaseMainloop>;
  using ProblemShape = cute::Shape<int, int, int, int>;  // (M, N, tokens, G)
  using GemmKernel = cute::conditional_t<
      kPingpong, KGroupedPingpongKernel<ProblemShape, Mainloop, Epilogue, KGroupedSchedulerTag>,
      cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue, KGroupedSchedulerTag>>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
};

// Runs the k-grouped wgrad of `p` (mode 1; layout NT: a [L, M], b [L, N]; TN: a [M, L], b [N, L];
// out [G, M, N]).
template <class K>
std::string launch_kgrouped(const Problem& p, cudaStream_t stream) {
  using KG = KGroupedInstance<K>;
  using Gemm = typename KG::Gemm;
  using Kernel = typename KG::GemmKernel;
  if (p.mode != 1) return "the k-grouped wgrad takes mode 1 (a wgrad)";
  if (p.L >= (int64_t{1} << 31) || p.M >= (int64_t{1} << 31) || p.N >= (int64_t{1} << 31)) {
    return "the k-grouped wgrad takes fewer than 2^31 tokens, rows and columns";
  }
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return cudaGetErrorString(e);
  // (row, token, batch) strides: the token's (K-major: 1) and the row's, one batch.
  typename Kernel::StrideA da{};
  typename Kernel::StrideB db{};
  if constexpr (KG::kAKMajor) {
    cute::get<0>(da) = p.L;  // a [M, L]
  } else {
    cute::get<1>(da) = p.M;  // a [L, M]
  }
  if constexpr (KG::kBKMajor) {
    cute::get<0>(db) = p.L;  // b [N, L]
  } else {
    cute::get<1>(db) = p.N;  // b [L, N]
  }
  cute::get<2>(da) = p.M * p.L;
  cute::get<2>(db) = p.N * p.L;
  typename Kernel::StrideD dd{};
  cute::get<0>(dd) = p.N;  // out [G, M, N]
  cute::get<2>(dd) = p.M * p.N;

  typename Gemm::Arguments args;
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = {int(p.M), int(p.N), int(p.L), int(p.G)};
  args.mainloop = {reinterpret_cast<const typename KG::ElementA*>(p.a), da,
                   reinterpret_cast<const typename KG::ElementB*>(p.b), db};
  set_group_alpha(args.epilogue.thread, p.alpha);
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = dd;
  args.epilogue.ptr_D = static_cast<typename KG::ElementD*>(p.out);
  args.epilogue.dD = dd;
  args.hw_info.device_id = device;
  args.hw_info.sm_count = sm_count_of(device);
  using Raster = decltype(args.scheduler.raster_order);
  args.scheduler.raster_order = p.raster_along_n ? Raster::AlongN : Raster::AlongM;
  args.scheduler.pstarts = p.pstarts;

  if (Gemm::get_workspace_size(args) > p.workspace_bytes) return "workspace too small";
  return run_gemm<Gemm>(args, p.workspace, stream);
}

}  // namespace sm90
}  // namespace jqffi
