// The CUTLASS Hopper grouped GEMM instances for Float8Block operands (sm_90a): the
// pointer-array grouped kernel of sm90_instance.cuh with CUTLASS's blockwise-scaled FP8 mainloop
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
// Float8Block scales row-major ([rows, K-blocks]). The setup kernel (sm90_launch.cuh, with this
// policy's repack_scales) therefore repacks every scale once into the workspace, in the order
// CUTLASS reads:
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
#include "grouped/sm90/sm90_launch.cuh"

namespace jqffi {
namespace sm90 {

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

// E4M3 x E4M3, both K-major, A with 1 x 128 blocks, B with B_ROWS x 128 blocks. The blockwise
// mainloop keeps a float32 accumulator next to the wgmma one, so the configurations are
// cooperative with float32 promotion (TileConfig's 128 x 128 x 128 tiles; the scale
// granularity along M and N must divide the tile: 1 and B_ROWS <= 128 do).
template <int B_ROWS>
struct BlockScaledOperands {
  using ElementA = cutlass::float_e4m3_t;
  using ElementB = cutlass::float_e4m3_t;
  static constexpr bool kAKMajor = true, kBKMajor = true;
  // M/N-major scale arrays (the order the setup kernel writes).
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, B_ROWS, int(kBlockK)>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
  using MainloopLayoutA = cute::tuple<cutlass::layout::RowMajor*, LayoutSFA*>;
  using MainloopLayoutB = cute::tuple<cutlass::layout::ColumnMajor*, LayoutSFB*>;
  template <class Config>
  using Schedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8BlockScaledAccum;
  // mode 1: a group's first token must open a scale block (and be 16-byte aligned for TMA).
  static constexpr int64_t kTokenAlign = kBlockK;

  static constexpr bool kBlockScaled = true;
  static constexpr size_t kScaleBytesPerGroup =
      2 * sizeof(void*) + sizeof(LayoutSFA) + sizeof(LayoutSFB);
  struct Scales {
    const float** ptr_sfa;
    const float** ptr_sfb;
    LayoutSFA* layout_sfa;
    LayoutSFB* layout_sfb;
    float* sfa;  // repacked A scales
    float* sfb;  // repacked B scales
  };

  // The scale arrays, after the per-group arrays (`take(bytes)` hands out aligned workspace).
  template <class Take>
  static Scales carve_scales(Take& take, const Problem& p) {
    Scales s;
    const int64_t G = p.G;
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
    return s;
  }

  // Group g's scale pointers and layouts (setup kernel, block 0): its rows [lo, ..) and its
  // problem shape (m, n, k).
  static __device__ void set_group_scales(const Problem& p, const Scales& s, int64_t g,
                                          int64_t lo, int m, int n, int k) {
    if (p.mode == 0) {
      const int64_t KB = div_up(p.K, kBlockK);
      s.ptr_sfa[g] = s.sfa + lo * KB;
      s.ptr_sfb[g] = s.sfb + g * div_up(p.N, p.b_block_rows) * KB;
    } else {
      s.ptr_sfa[g] = s.sfa + (lo / kBlockK) * p.M;
      s.ptr_sfb[g] = s.sfb + (lo / kBlockK) * p.N;
    }
    s.layout_sfa[g] = ScaleConfig::tile_atom_to_shape_SFA(cute::make_shape(m, n, k, 1));
    s.layout_sfb[g] = ScaleConfig::tile_atom_to_shape_SFB(cute::make_shape(m, n, k, 1));
  }

  // Every scale once into the workspace in CUTLASS's order (setup kernel, all blocks), with
  // 32-bit index arithmetic where every index fits (`repack<int32_t>`: a 64-bit division is a
  // ~70-instruction subroutine a scale; the 64-expert forward's and dgrad's setups 7.7 -> 5.5
  // us, the wgrad's ~16 us either way, bench/RESULTS.md session 29).
  static __device__ void repack_scales(const Problem& p, const Scales& s, int64_t tid,
                                       int64_t threads) {
    const int64_t KB = div_up(p.mode == 0 ? p.K : p.L, kBlockK);  // K-blocks (mode 1: all tokens)
    const int64_t most = p.mode == 0 ? max(p.L, p.G * div_up(p.N, p.b_block_rows)) * KB
                                     : max(p.M, p.N) * KB;
    if (most < (int64_t{1} << 31) && threads < (int64_t{1} << 31)) {
      repack<int32_t>(p, s, int32_t(tid), int32_t(threads), int32_t(KB));
    } else {
      repack<int64_t>(p, s, tid, threads, KB);
    }
  }

  template <typename I>
  static __device__ void repack(const Problem& p, const Scales& s, I tid, I threads, I KB) {
    if (p.mode == 0) {
      // A: a thread a token row (its group found once), its KB scales to sfa[lo KB + kb rows +
      // (r - lo)]: a warp's stores of one kb are consecutive rows.
      const I tail = I(clamp_start(p.pstarts, p.G, p.L));
      for (I r = tid; r < tail; r += threads) {
        const I g = I(group_of_row(p.pstarts, p.G, p.L, r));
        const I lo = I(clamp_start(p.pstarts, g, p.L));
        const I rows = I(clamp_start(p.pstarts, g + 1, p.L)) - lo;
        float* dst = s.sfa + lo * KB + (r - lo);
        const float* src = p.a_scale + r * KB;
        for (I kb = 0; kb < KB; ++kb) dst[kb * rows] = src[kb];
      }
      const I SR = I(div_up(p.N, p.b_block_rows));  // B scale rows
      // sfb[g SR KB + kb SR + r] = b_scale[g SR KB + r KB + kb]
      const I per_expert = SR * KB;
      for (I j = tid; j < I(p.G) * per_expert; j += threads) {
        const I g = j / per_expert, rem = j - g * per_expert;
        const I kb = rem / SR, r = rem - kb * SR;
        s.sfb[j] = p.b_scale[g * per_expert + r * KB + kb];
      }
    } else {
      // Indexed by destination (coalesced writes): sfa[kb M + m] = a_scale[m KB + kb].
      const I M = I(p.M), N = I(p.N);
      for (I j = tid; j < M * KB; j += threads) {
        const I kb = j / M;
        s.sfa[j] = p.a_scale[(j - kb * M) * KB + kb];
      }
      for (I j = tid; j < N * KB; j += threads) {
        const I kb = j / N;
        s.sfb[j] = p.b_scale[(j - kb * N) * KB + kb];
      }
    }
  }
};

template <int B_ROWS, int OUT, int CFG>
std::string run_block_instance(const Problem& p, cudaStream_t stream) {
  static_assert(!TileConfig<CFG>::kFast && !TileConfig<CFG>::kPingpong,
                "Float8Block instances are cooperative with float32 promotion");
  if (!p.block_scaled || p.b_block_rows != B_ROWS) return "Float8Block instance mismatch";
  return launch<Instance<BlockScaledOperands<B_ROWS>, OUT, CFG>>(p, stream);
}

}  // namespace sm90
}  // namespace jqffi

// Explicit instantiation, used by the generated sm90_block_inst_*.cu files.
#define JQ_SM90_BLOCK_INSTANTIATE(B_ROWS, OUT, CFG)                              \
  template std::string jqffi::sm90::run_block_instance<B_ROWS, OUT, CFG>(        \
      const jqffi::sm90::Problem&, cudaStream_t);
