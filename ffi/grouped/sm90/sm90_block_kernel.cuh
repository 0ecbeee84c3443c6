// The CUTLASS Hopper grouped GEMM instances for Float8Block operands (sm_90a): the
// pointer-array grouped kernel of sm90_kernel.cuh with CUTLASS's blockwise-scaled FP8 mainloop
// (KernelPtrArrayTmaWarpSpecializedCooperativeFP8BlockScaledAccum): for every 128-deep K-block
// the wgmma partial sums of a 128 x 128 tile are multiplied by the A scale of their row and the
// B scale of their column and added to float32 accumulators (the scale block along K, 128,
// equals the tile depth, so a K-tile never straddles two scale blocks).
//
// Scale granularity (M, N, K) = (1, B_ROWS, 128): A always has 1 x 128 blocks (one scale per
// row per K-block: tokens rowwise in mode 0, the columnwise copy of tokens in mode 1); B has
// 128 x 128 tiles (B_ROWS = 128, expert weights) or 1 x 128 blocks (B_ROWS = 1).
//
// CUTLASS 4.2's grouped mainloop reads each group's scales from a dense M/N-major array it
// derives from the group's problem shape alone (ScaleConfig::tile_atom_to_shape_SF*: element
// (mn_block, k_block) at mn_block + k_block * ceil(MN / granularity)), while jaxquant stores
// Float8Block scales row-major ([rows, K-blocks]). The setup kernel therefore repacks every
// scale once into the workspace, in the order CUTLASS reads:
//   mode 0 A (tokens [L, KB]): group g's rows [lo, hi) -> sfa[lo KB + kb (hi - lo) + (r - lo)];
//   mode 0 B (experts [G, SR, KB], SR = ceil(N / B_ROWS)) -> sfb[g SR KB + kb SR + r];
//   mode 1 A ([M, LB], LB = L / 128) -> sfa[kb M + m], group g's base (lo / 128) M;
//   mode 1 B ([N, LB]) -> sfb[kb N + n], group g's base (lo / 128) N.
// Mode 1 contracts over each group's token range, so a group must start on a 128-token block
// (the Float8Block 1 x 128 columnwise copy's token layout pads every group to 128 positions);
// the setup kernel traps on a misaligned start rather than pair a K-tile with the wrong scale.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "grouped/sm90/sm90_kernel.cuh"

namespace jqgrouped {
namespace sm90 {

// Tiles and clusters of sm90_kernel.cuh's TileConfig (128 x 128 x 128 cluster 1 x 2 by
// default): the blockwise mainloop also keeps a float32 accumulator next to the wgmma one, so no
// fast-accumulation configuration and no wider tile. The scale granularity along M and N must
// divide the tile (1 and B_ROWS <= 128 do).
template <int B_ROWS, int OUT, int CFG = kCfgDefault>
struct BlockKernel {
  using ElementA = cutlass::float_e4m3_t;
  using ElementB = cutlass::float_e4m3_t;
  using ElementD = typename OutputOf<OUT>::type;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignA = 16, kAlignB = 16, kAlignD = 16 / sizeof(ElementD);
  using Config = TileConfig<CFG>;
  static_assert(!Config::kFast && !Config::kPingpong,
                "Float8Block instances are cooperative with float32 promotion");
  using TileShape = typename Config::TileShape;
  using ClusterShape = typename Config::ClusterShape;
  // M/N-major scale arrays (the order the setup kernel writes).
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, B_ROWS, int(kBlockK)>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
  using KernelSchedule =
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8BlockScaledAccum;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, LayoutD*, kAlignD, ElementD, LayoutD*, kAlignD, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      ElementA, cute::tuple<LayoutA*, LayoutSFA*>, kAlignA,
      ElementB, cute::tuple<LayoutB*, LayoutSFB*>, kAlignB, float, TileShape, ClusterShape,
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

// The per-group arrays and the repacked scales in the workspace, each 256-byte aligned.
template <class K>
struct BlockSetup {
  typename ProblemShape::UnderlyingProblemShape* shapes;
  const typename K::ElementA** ptr_a;
  const typename K::ElementB** ptr_b;
  typename K::ElementD** ptr_d;
  typename K::StrideA* stride_a;
  typename K::StrideB* stride_b;
  typename K::StrideD* stride_d;
  const float** ptr_sfa;
  const float** ptr_sfb;
  typename K::LayoutSFA* layout_sfa;
  typename K::LayoutSFB* layout_sfb;
  float* sfa;  // repacked A scales
  float* sfb;  // repacked B scales
  size_t bytes;  // bytes used (CUTLASS's workspace follows)
};

template <class K>
BlockSetup<K> carve_block(void* base, const Problem& p) {
  static_assert(sizeof(typename ProblemShape::UnderlyingProblemShape) + 3 * sizeof(void*) +
                        sizeof(typename K::StrideA) + sizeof(typename K::StrideB) +
                        sizeof(typename K::StrideD) + 2 * sizeof(void*) +
                        sizeof(typename K::LayoutSFA) + sizeof(typename K::LayoutSFB) <=
                    kPerGroupBytes,
                "per-group setup arrays exceed kPerGroupBytes");
  BlockSetup<K> s;
  char* q = static_cast<char*>(base);
  size_t off = 0;
  auto take = [&](size_t bytes) { char* r = q + off; off += align256(bytes); return r; };
  const int64_t G = p.G;
  s.shapes = reinterpret_cast<decltype(s.shapes)>(take(G * sizeof(*s.shapes)));
  s.ptr_a = reinterpret_cast<decltype(s.ptr_a)>(take(G * sizeof(*s.ptr_a)));
  s.ptr_b = reinterpret_cast<decltype(s.ptr_b)>(take(G * sizeof(*s.ptr_b)));
  s.ptr_d = reinterpret_cast<decltype(s.ptr_d)>(take(G * sizeof(*s.ptr_d)));
  s.stride_a = reinterpret_cast<decltype(s.stride_a)>(take(G * sizeof(*s.stride_a)));
  s.stride_b = reinterpret_cast<decltype(s.stride_b)>(take(G * sizeof(*s.stride_b)));
  s.stride_d = reinterpret_cast<decltype(s.stride_d)>(take(G * sizeof(*s.stride_d)));
  s.ptr_sfa = reinterpret_cast<decltype(s.ptr_sfa)>(take(G * sizeof(*s.ptr_sfa)));
  s.ptr_sfb = reinterpret_cast<decltype(s.ptr_sfb)>(take(G * sizeof(*s.ptr_sfb)));
  s.layout_sfa = reinterpret_cast<decltype(s.layout_sfa)>(take(G * sizeof(*s.layout_sfa)));
  s.layout_sfb = reinterpret_cast<decltype(s.layout_sfb)>(take(G * sizeof(*s.layout_sfb)));
  size_t a_floats, b_floats;
  if (p.mode == 0) {
    const int64_t kb = div_up(p.K, kBlockK);
    a_floats = size_t(p.L * kb);
    b_floats = size_t(p.G * div_up(p.N, p.b_block_rows) * kb);
  } else {
    const int64_t lb = div_up(p.L, kBlockK);
    a_floats = size_t(p.M * lb);
    b_floats = size_t(p.N * lb);
  }
  s.sfa = reinterpret_cast<float*>(take(a_floats * sizeof(float)));
  s.sfb = reinterpret_cast<float*>(take(b_floats * sizeof(float)));
  s.bytes = off;
  return s;
}

// The group holding token row r < pstarts[G] (clamped): the last g with start(g) <= r, which
// is non-empty (an empty group g shares its start with g + 1).
__device__ __forceinline__ int64_t group_of_row(const int32_t* pstarts, int64_t G, int64_t L,
                                                int64_t r) {
  int64_t lo = 0, hi = G - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (clamp_start(pstarts, mid, L) <= r) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Block 0 writes the per-group arrays; every block repacks scales and zero-fills what no GEMM
// tile writes.
template <class K>
__global__ void block_setup_kernel(const Problem p, BlockSetup<K> s) {
  using ElementD = typename K::ElementD;
  const int64_t KB = div_up(p.mode == 0 ? p.K : p.L, kBlockK);  // K-blocks (mode 1: all tokens)
  const int64_t SR = div_up(p.N, p.b_block_rows);               // mode 0 B scale rows
  if (blockIdx.x == 0) {
    for (int64_t g = threadIdx.x; g < p.G; g += blockDim.x) {
      const int64_t lo = clamp_start(p.pstarts, g, p.L);
      const int64_t hi = max(lo, clamp_start(p.pstarts, g + 1, p.L));
      // mode 1: a group's first token must open a scale block (and be 16-byte aligned for TMA).
      if (p.mode == 1 && hi > lo && (lo % kBlockK) != 0) __trap();
      typename K::StrideA sa{};
      typename K::StrideB sb{};
      typename K::StrideD sd{};
      cute::get<1>(sd) = cute::Int<1>{};
      cute::get<0>(sd) = p.N;
      int m, n = int(p.N), k;
      if (p.mode == 0) {
        m = int(hi - lo);
        k = int(p.K);
        s.ptr_a[g] = reinterpret_cast<const typename K::ElementA*>(p.a + lo * p.K);
        s.ptr_b[g] = reinterpret_cast<const typename K::ElementB*>(p.b + g * p.N * p.K);
        s.ptr_d[g] = static_cast<ElementD*>(p.out) + lo * p.N;
        s.ptr_sfa[g] = s.sfa + lo * KB;
        s.ptr_sfb[g] = s.sfb + g * SR * KB;
        cute::get<0>(sa) = p.K;
        cute::get<0>(sb) = p.K;
      } else {
        m = hi > lo ? int(p.M) : 0;
        k = int(hi - lo);
        s.ptr_a[g] = reinterpret_cast<const typename K::ElementA*>(p.a + lo);
        s.ptr_b[g] = reinterpret_cast<const typename K::ElementB*>(p.b + lo);
        s.ptr_d[g] = static_cast<ElementD*>(p.out) + g * p.M * p.N;
        s.ptr_sfa[g] = s.sfa + (lo / kBlockK) * p.M;
        s.ptr_sfb[g] = s.sfb + (lo / kBlockK) * p.N;
        cute::get<0>(sa) = p.L;
        cute::get<0>(sb) = p.L;
      }
      s.shapes[g] = {m, n, k};
      s.layout_sfa[g] = K::ScaleConfig::tile_atom_to_shape_SFA(cute::make_shape(m, n, k, 1));
      s.layout_sfb[g] = K::ScaleConfig::tile_atom_to_shape_SFB(cute::make_shape(m, n, k, 1));
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
    for (int64_t i = tid; i < tail * KB; i += threads) {
      const int64_t r = i / KB, kb = i % KB;
      const int64_t g = group_of_row(p.pstarts, p.G, p.L, r);
      const int64_t lo = clamp_start(p.pstarts, g, p.L);
      const int64_t rows = clamp_start(p.pstarts, g + 1, p.L) - lo;
      s.sfa[lo * KB + kb * rows + (r - lo)] = p.a_scale[i];
    }
    const int64_t per_expert = SR * KB;  // sfb[g SR KB + kb SR + r] = b_scale[g SR KB + r KB + kb]
    for (int64_t j = tid; j < p.G * per_expert; j += threads) {
      const int64_t g = j / per_expert, rem = j % per_expert;
      s.sfb[j] = p.b_scale[g * per_expert + (rem % SR) * KB + rem / SR];
    }
    for (int64_t i = tail * p.N + tid; i < p.L * p.N; i += threads) out[i] = ElementD(0);
  } else {
    // Indexed by destination (coalesced writes): sfa[kb M + m] = a_scale[m KB + kb].
    for (int64_t j = tid; j < p.M * KB; j += threads) {
      s.sfa[j] = p.a_scale[(j % p.M) * KB + j / p.M];
    }
    for (int64_t j = tid; j < p.N * KB; j += threads) {
      s.sfb[j] = p.b_scale[(j % p.N) * KB + j / p.N];
    }
    for (int64_t g = 0; g < p.G; ++g) {
      if (clamp_start(p.pstarts, g + 1, p.L) > clamp_start(p.pstarts, g, p.L)) continue;
      ElementD* o = out + g * p.M * p.N;
      for (int64_t i = tid; i < p.M * p.N; i += threads) o[i] = ElementD(0);
    }
  }
}

template <int B_ROWS, int OUT, int CFG>
std::string run_block_instance(const Problem& p, cudaStream_t stream) {
  using K = BlockKernel<B_ROWS, OUT, CFG>;
  using Gemm = typename K::Gemm;
  if (!p.block_scaled || p.b_block_rows != B_ROWS) return "Float8Block instance mismatch";
  const BlockSetup<K> s = carve_block<K>(p.workspace, p);
  const GroupArrays<Gemm> arrays{s.shapes, s.ptr_d, s.stride_d, s.bytes};
  return launch<Gemm>(
      p, stream, arrays,
      {s.ptr_a, s.stride_a, s.ptr_b, s.stride_b, s.ptr_sfa, s.layout_sfa, s.ptr_sfb,
       s.layout_sfb},
      [&](unsigned blocks) { block_setup_kernel<K><<<blocks, 256, 0, stream>>>(p, s); });
}

}  // namespace sm90
}  // namespace jqgrouped

// Explicit instantiation, used by the generated sm90_block_inst_*.cu files.
#define JQ_SM90_BLOCK_INSTANTIATE(B_ROWS, OUT, CFG)                                  \
  template std::string jqgrouped::sm90::run_block_instance<B_ROWS, OUT, CFG>(      \
      const jqgrouped::sm90::Problem&, cudaStream_t);
