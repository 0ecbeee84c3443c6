// The FP8-format tile kernels (per tensor, MXFP8, Float8Block) and their one launch, shared by
// the quantize targets (quantize_cuda.cu: the values of x) and the fused ones (ffi/fused: a
// producer's values). A format is chosen by its parameter type.
#pragma once

#include "quantize/fp8_block.cuh"
#include "quantize/fp8_tensor.cuh"
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

// Launches the tile kernel of `p`'s format over the matrix `prod` produces, with the tile's
// shared memory when it has a column phase.
template <bool kExperts = false, bool kRaw = false, typename Params, typename P>
cudaError_t launch_fp8_tiles(cudaStream_t stream, const Params& p, const P& prod) {
  using G = FP8Tile<typename P::Out>;
  return launch_tiles(tile_kernel_of<kExperts, kRaw>(p, prod), num_tiles(p.R, p.C, G::TR, G::TC),
                      keeps_tile(p) ? G::kSmemBytes : 0, stream, p, prod);
}

}  // namespace
}  // namespace jqffi
