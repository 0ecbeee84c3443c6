// The FP8-format tile kernels (per tensor, MXFP8, Float8Block) and their one launch, shared by
// the quantize targets (quantize_cuda.cu: the values of x) and the fused ones (ffi/fused: a
// producer's values). A format is chosen by its parameter type.
#pragma once

#include <type_traits>

#include "quantize/fp8_block.cuh"
#include "quantize/fp8_block_128x128.cuh"
#include "quantize/fp8_block_1x128.cuh"
#include "quantize/fp8_tensor.cuh"
#include "quantize/fp8_tensor_bf16.cuh"
#include "quantize/fp8_tensor_f32.cuh"
#include "quantize/mxfp8.cuh"

namespace jqffi {
namespace {

// The tile kernel of each format's parameters, reading producer type P (kExperts: MXFP8 /
// Float8Block expert weights, `expert_rows` > 0, whose columnwise copy each expert writes on
// its own: a separate instance, so the others keep their registers).
// kRaw: MXFP8's raw bfloat16 copies (`Mxfp8Params::raw`), instantiated only where a launch
// asks for them (the grouped gathered target), so the other launches build no raw instance.
template <bool kExperts, bool kRaw, typename P>
auto tile_kernel_of(const Fp8TensorParams&, const P&) {
  static_assert(!kExperts, "per-tensor FP8 expert weights take the grouped FP8 kernel");
  static_assert(!kRaw, "only MXFP8 writes raw copies");
  return fp8_tensor_kernel<P>;
}
template <bool kExperts, bool kRaw, typename P>
auto tile_kernel_of(const Mxfp8Params&, const P&) { return mxfp8_kernel<P, kExperts, kRaw>; }
template <bool kExperts, bool kRaw, typename P>
auto tile_kernel_of(const Fp8BlockParams& p, const P&) {
  static_assert(!kRaw, "only MXFP8 writes raw copies");
  return p.block_2d ? fp8_block_kernel<P, kExperts, true> : fp8_block_kernel<P, kExperts, false>;
}

// A Float8Block whole-tile kernel (a training step's activations and gradients, and an MLP's
// gelu: fp8_block_1x128.cuh; its weights: fp8_block_128x128.cuh) and its dynamic shared memory,
// where one serves the call; else a null kernel.
template <typename P>
struct WholeTileKernel {
  void (*kernel)(Fp8BlockParams, P) = nullptr;
  int smem = 0;
};
template <typename P>
WholeTileKernel<P> whole_tile_kernel(const Fp8BlockParams& p, const P& prod) {
  if constexpr (TileWords<P>::kServed) {
    if (fp8_block_1x128_fast(p, prod)) return {fp8_block_1x128_bf16_kernel<P>, FP8Tile<BF16>::kSmemBytes};
  }
  if constexpr (std::is_same_v<P, Direct<BF16>> || std::is_same_v<P, Direct<float>>) {
    if (fp8_block_128x128_fast(p, prod)) return {fp8_block_128x128_kernel<typename P::Out>, 0};
  }
  return {};
}

// Launches the tile kernel of `p`'s format over the matrix `prod` produces, with the tile's
// shared memory when it has a column phase.
template <bool kExperts = false, bool kRaw = false, typename Params, typename P>
cudaError_t launch_fp8_tiles(cudaStream_t stream, const Params& p, const P& prod) {
  using G = FP8Tile<typename P::Out>;
  const unsigned tiles = num_tiles(p.R, p.C, G::TR, G::TC);
  if constexpr (std::is_same_v<Params, Fp8BlockParams> && !kExperts) {
    const WholeTileKernel<P> whole = whole_tile_kernel(p, prod);
    if (whole.kernel) return launch_tiles(whole.kernel, tiles, whole.smem, stream, p, prod);
  }
  if constexpr (std::is_same_v<Params, Fp8TensorParams> && TileWords<P>::kServed) {
    if (fp8_tensor_bf16_fast(p, prod)) {
      return launch_tiles(fp8_tensor_bf16_kernel<P>, tiles, FP8Tile<BF16>::kSmemBytes, stream, p, prod);
    }
  }
  if constexpr (std::is_same_v<Params, Fp8TensorParams> && std::is_same_v<P, Direct<float>>) {
    if (fp8_tensor_f32_fast(p, prod)) return launch_tiles(fp8_tensor_f32_kernel, tiles, 0, stream, p, prod);
  }
  return launch_tiles(tile_kernel_of<kExperts, kRaw>(p, prod), tiles, keeps_tile(p) ? G::kSmemBytes : 0,
                      stream, p, prod);
}

}  // namespace
}  // namespace jqffi
