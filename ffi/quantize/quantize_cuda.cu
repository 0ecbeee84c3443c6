// CUDA handlers of the quantize, amax and transpose targets (sm_90a; see CMakeLists.txt).
// The kernels are in the headers beside this file, one per format.
//
// Design (ffi/NOTES.md has the reasoning and the measurements):
//  * Quantize is one pass over x per call: a CTA loads a TR x TC tile with 16-byte loads, makes
//    the rowwise output from registers (block reductions by warp shuffles), keeps the tile in a
//    swizzled shared-memory buffer and makes the transposed columnwise output from it: a thread
//    owns a 16-row chunk of one column (one NVFP4 block / RHT chunk, half an MXFP8 block, an
//    eighth of a 1x128 block, reduced across lanes by shuffles) and the lanes of a warp cover
//    consecutive chunks, so each warp store writes a few output rows with 64-128 contiguous
//    bytes each (writing 32 different output rows per store ran at half the bandwidth).
//  * Per-tensor amax (and the per-row / per-column amax of row-scaled NVFP4) is a separate
//    kernel (`jaxquant_amax`) whose result feeds the quantize call, so a sharded caller can
//    insert a pmax in between. Formats whose scales don't depend on the tensor amax (MXFP8,
//    Float8Block, delayed FP8) fold the amax output into the quantize pass with atomicMax on
//    the float bits (|x| bits order like the floats and put NaN above inf: NaN-propagating).
//  * Handlers use only the FFI stream, no host syncs and no allocations (outputs that are
//    reduced with atomics are cleared with cudaMemsetAsync), so they are marked
//    command-buffer compatible.
//  * NVFP4 data is written straight into XLA's packed float4_e2m1fn layout. An output whose
//    row length is odd (rows then share bytes) takes a simple two-kernel path (scales, then one
//    thread per output byte).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "cuda_handler.h"
#include "quantize/handlers.h"
#include "quantize/quantize_args.h"
#include "quantize/amax.cuh"
#include "quantize/fp8_tiles.cuh"
#include "quantize/nvfp4.cuh"
#include "quantize/transpose.cuh"
#include "quantize/delayed_update.cuh"
#include "quantize/encoder_check.cuh"

namespace jqffi {
namespace {

// ============================================================================================
// Handlers.
// ============================================================================================

// Clears the outputs of `a` (reduced with atomics) and enqueues the amax kernel; with a `gate`
// (device float) the kernel reduces only while the gate is 0.
ffi::Error amax_kernels(cudaStream_t stream, const AmaxArgs& a, const float* gate) {
  JQ_RETURN_IF_ERROR(clear(stream, a.tensor, 4));
  JQ_RETURN_IF_ERROR(clear(stream, a.tensor_rht, 4));
  JQ_RETURN_IF_ERROR(clear(stream, a.rows, 4 * a.x.rows));
  JQ_RETURN_IF_ERROR(clear(stream, a.cols, 4 * a.x.cols));
  JQ_RETURN_IF_ERROR(clear(stream, a.cols_rht, 4 * a.x.cols));
  by_input_type(a.x.type, [&](auto tag) {
    using T = decltype(tag);
    constexpr int strip = 32 * (16 / sizeof(T));
    const int64_t nstrips = ceil_div(a.x.cols, strip);
    const int64_t chunks = ceil_div(a.x.rows, 128);  // a CTA step is 8 warps x 16 rows
    const int64_t groups = std::max<int64_t>(1, std::min<int64_t>(chunks, ceil_div(1056, nstrips)));
    AmaxParams p{a.x.data, a.x.rows, a.x.cols, ceil_div(chunks, groups) * 128,
                 aligned(a.x.data, 16) && a.x.cols % (16 / sizeof(T)) == 0,
                 a.tensor, a.tensor_rht, a.rows, a.cols, a.cols_rht, gate};
    const int64_t ngroups = ceil_div(a.x.rows, p.rows_per_cta);
    amax_kernel<T><<<unsigned(nstrips * ngroups), kThreads, 0, stream>>>(p);
  });
  return ffi::Error::Success();
}

ffi::Error AmaxLaunch(cudaStream_t stream, ffi::AnyBuffer x, const float* gate, ffi::RemainingRets rets,
                      int32_t outputs) {
  AmaxArgs a;
  JQ_RETURN_IF_ERROR(decode_amax(x, rets, outputs, &a));
  JQ_RETURN_IF_ERROR(amax_kernels(stream, a, gate));
  return launch_status(gate ? "jaxquant_amax_gated" : "jaxquant_amax");
}

ffi::Error AmaxCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::RemainingRets rets, int32_t outputs) {
  return AmaxLaunch(stream, x, nullptr, rets, outputs);
}

ffi::Error AmaxGatedCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer gate, ffi::RemainingRets rets,
                         int32_t outputs) {
  const float* g = nullptr;
  JQ_RETURN_IF_ERROR(decode_gate(gate, &g));
  return AmaxLaunch(stream, x, g, rets, outputs);
}

// Runs the FP8-format tile kernel of `p` over x (its amax output already cleared).
template <typename Args, typename Params>
ffi::Error tiles_over_x(const char* target, cudaStream_t stream, const Args& a, const Params& p) {
  cudaError_t e = cudaSuccess;
  by_input_type(a.x.type, [&](auto tag) {
    using T = decltype(tag);
    const Direct<T> x{static_cast<const T*>(a.x.data), a.x.rows, a.x.cols, vec_input(a.x)};
    e = launch_fp8_tiles(stream, p, x);
  });
  return launch_status(target, e);
}

// Clears `a`'s amax (reduced with atomics) and runs the FP8-format tile kernel of `p` over x.
template <typename Args, typename Params>
ffi::Error quantize_x(const char* target, cudaStream_t stream, const Args& a, const Params& p) {
  JQ_RETURN_IF_ERROR(clear(stream, a.amax, 4));
  return tiles_over_x(target, stream, a, p);
}

ffi::Error QuantizeFp8Cuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer s, ffi::RemainingRets rets,
                           bool rowwise, bool columnwise, bool delayed, bool pow2_scale, float amax_epsilon) {
  Fp8TensorArgs a;
  JQ_RETURN_IF_ERROR(decode_fp8_tensor(x, s, rets, rowwise, columnwise, delayed, pow2_scale, amax_epsilon, &a));
  return quantize_x("jaxquant_quantize_fp8", stream, a, fp8_tensor_params(a, a.x.rows, a.x.cols));
}

ffi::Error QuantizeFp8DelayedCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer s,
                                  ffi::AnyBuffer first_amax, ffi::RemainingRets rets, bool rowwise,
                                  bool columnwise, int32_t margin) {
  Fp8TensorArgs a;
  JQ_RETURN_IF_ERROR(decode_fp8_delayed(x, s, first_amax, rets, rowwise, columnwise, margin, &a));
  return quantize_x("jaxquant_quantize_fp8_delayed", stream, a, fp8_tensor_params(a, a.x.rows, a.x.cols));
}

// The gated amax pass reduces into the call's amax result (cleared first), which the tile
// kernel then reads as its first amax and reduces into again (same values: unchanged).
ffi::Error QuantizeFp8DelayedGatedCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer s,
                                       ffi::RemainingRets rets, bool rowwise, bool columnwise,
                                       int32_t margin) {
  const char* t = "jaxquant_quantize_fp8_delayed_gated";
  Fp8TensorArgs a;
  JQ_RETURN_IF_ERROR(decode_fp8_delayed_gated(x, s, rets, rowwise, columnwise, margin, &a));
  AmaxArgs pass;
  pass.x = a.x;
  pass.tensor = a.amax;
  JQ_RETURN_IF_ERROR(amax_kernels(stream, pass, a.s));
  return tiles_over_x(t, stream, a, fp8_tensor_params(a, a.x.rows, a.x.cols));
}

// The gated amax pass (or a cleared amax), the tile kernel, then the state's update kernel,
// which reads the amax the tile kernel reduced and writes history' / scale' (aliases).
ffi::Error QuantizeFp8DelayedUpdateCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer s,
                                        ffi::AnyBuffer history, ffi::RemainingRets rets,
                                        bool rowwise, bool columnwise, int32_t margin, bool gated,
                                        bool most_recent, float fmax) {
  const char* t = "jaxquant_quantize_fp8_delayed_update";
  Fp8TensorArgs a;
  DelayedUpdateArgs u;
  JQ_RETURN_IF_ERROR(decode_fp8_delayed_update(x, s, history, rets, rowwise, columnwise, margin,
                                               gated, fmax, &a, &u));
  if (gated) {
    AmaxArgs pass;
    pass.x = a.x;
    pass.tensor = a.amax;
    JQ_RETURN_IF_ERROR(amax_kernels(stream, pass, a.s));
  } else {
    JQ_RETURN_IF_ERROR(clear(stream, a.amax, 4));
  }
  JQ_RETURN_IF_ERROR(tiles_over_x(t, stream, a, fp8_tensor_params(a, a.x.rows, a.x.cols)));
  DelayedUpdateParams p{u.history, u.scale, u.amax, u.new_history, u.new_scale, u.length,
                        fmax, margin, most_recent};
  delayed_update_kernel<<<1, kThreads, 0, stream>>>(p);
  return launch_status(t);
}

ffi::Error DelayedUpdateCuda(cudaStream_t stream, ffi::AnyBuffer history, ffi::AnyBuffer scale,
                             ffi::AnyBuffer amax, ffi::Result<ffi::AnyBuffer> new_history,
                             ffi::Result<ffi::AnyBuffer> new_scale, float fmax, int32_t margin,
                             bool most_recent) {
  DelayedUpdateArgs a;
  JQ_RETURN_IF_ERROR(decode_delayed_update(history, scale, amax, new_history, new_scale, fmax,
                                           margin, &a));
  if (a.batch == 0) return ffi::Error::Success();
  DelayedUpdateParams p{a.history, a.scale, a.amax, a.new_history, a.new_scale, a.length,
                        fmax, margin, most_recent};
  delayed_update_kernel<<<unsigned(a.batch), kThreads, 0, stream>>>(p);
  return launch_status("jaxquant_delayed_update");
}

ffi::Error QuantizeMxfp8Cuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::RemainingRets rets, bool rowwise,
                             bool columnwise) {
  Mxfp8Args a;
  JQ_RETURN_IF_ERROR(decode_mxfp8(x, rets, rowwise, columnwise, &a));
  return quantize_x("jaxquant_quantize_mxfp8", stream, a, mxfp8_params(a, a.x.rows, a.x.cols));
}

ffi::Error QuantizeFp8BlockCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::RemainingRets rets, bool rowwise,
                                bool columnwise, bool block_2d, bool pow2_scale, float amax_epsilon) {
  Fp8BlockArgs a;
  JQ_RETURN_IF_ERROR(decode_fp8_block(x, rets, rowwise, columnwise, block_2d, pow2_scale, amax_epsilon, &a));
  return quantize_x("jaxquant_quantize_fp8_block", stream, a, fp8_block_params(a, a.x.rows, a.x.cols));
}

template <typename T>
void launch_nvfp4_generic(cudaStream_t stream, const Nvfp4Args& a, bool transposed) {
  Nvfp4GenericParams g{a.x.data, a.x.rows, a.x.cols,
                       transposed ? a.x.cols : a.x.rows, transposed ? a.x.rows : a.x.cols,
                       transposed, a.row_scaled, a.block_2d, a.stochastic,
                       transposed ? a.col_amax : a.row_amax, transposed ? a.col_key : a.row_key,
                       transposed ? a.col_data : a.row_data, transposed ? a.col_scale : a.row_scale};
  const int64_t nblocks = ceil_div(g.mrows, a.block_2d ? 16 : 1) * ceil_div(g.mcols, 16);
  const int64_t nbytes = ceil_div(g.mrows * g.mcols, 2);
  nvfp4_generic_scales_kernel<T><<<unsigned(std::min<int64_t>(ceil_div(nblocks, kThreads), 4096)), kThreads, 0, stream>>>(g);
  nvfp4_generic_data_kernel<T><<<unsigned(std::min<int64_t>(ceil_div(nbytes, kThreads), 8192)), kThreads, 0, stream>>>(g);
}

ffi::Error QuantizeNvfp4Cuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer row_amax,
                             ffi::AnyBuffer col_amax, ffi::AnyBuffer row_key, ffi::AnyBuffer col_key,
                             ffi::RemainingRets rets, bool rowwise, bool columnwise, bool row_scaled,
                             bool block_2d, bool rht, bool stochastic) {
  Nvfp4Args a;
  JQ_RETURN_IF_ERROR(decode_nvfp4(x, row_amax, col_amax, row_key, col_key, rets, rowwise, columnwise,
                                  row_scaled, block_2d, rht, stochastic, &a));
  // The tiled kernel needs byte-aligned output rows (even row length); odd ones go generic.
  const bool tiled_row = rowwise && a.x.cols % 2 == 0;
  const bool tiled_col = columnwise && a.x.rows % 2 == 0;  // rht implies rows % 16 == 0
  cudaError_t e = cudaSuccess;
  by_input_type(a.x.type, [&](auto tag) {
    using T = decltype(tag);
    using G = NVFP4Tile<T>;
    if (tiled_row || tiled_col) {
      Nvfp4Params p{a.x.data, a.x.rows, a.x.cols, vec_input(a.x),
                    aligned(a.row_data, 4) && a.x.cols % 8 == 0, aligned(a.col_data, 8) && a.x.rows % 16 == 0,
                    tiled_row, tiled_col, row_scaled, block_2d, rht, stochastic,
                    a.row_amax, a.col_amax, a.row_key, a.col_key, a.row_data, a.row_scale, a.col_data, a.col_scale};
      e = launch_tiles(nvfp4_kernel<T>, num_tiles(a.x.rows, a.x.cols, G::TR, G::TC),
                       tiled_col ? G::kSmemBytes : 0, stream, p);
      if (e != cudaSuccess) return;
    }
    if (rowwise && !tiled_row) launch_nvfp4_generic<T>(stream, a, false);
    if (columnwise && !tiled_col) launch_nvfp4_generic<T>(stream, a, true);
  });
  return launch_status("jaxquant_quantize_nvfp4", e);
}

ffi::Error TransposeFp8Cuda(cudaStream_t stream, ffi::AnyBuffer in, ffi::Result<ffi::AnyBuffer> out) {
  TransposeArgs a;
  JQ_RETURN_IF_ERROR(decode_transpose(in, out, &a));
  TransposeParams p{a.in, a.out, a.rows, a.cols, aligned(a.in, 16) && a.cols % 16 == 0,
                    aligned(a.out, 16) && a.rows % 16 == 0};
  transpose_kernel<<<num_tiles(a.rows, a.cols, 128, 128), kThreads, 0, stream>>>(p);
  return launch_status("jaxquant_transpose_fp8");
}

ffi::Error RawBytesCuda(cudaStream_t stream, ffi::AnyBuffer in, ffi::Result<ffi::AnyBuffer> out) {
  if (out->element_type() != ffi::DataType::U8 || out->dimensions().size() != 1) {
    return invalid("jaxquant_debug_raw_bytes", "the result must be a 1-D uint8 array");
  }
  cudaMemcpyAsync(out->untyped_data(), in.untyped_data(), out->element_count(), cudaMemcpyDeviceToDevice, stream);
  return launch_status("jaxquant_debug_raw_bytes");
}

ffi::Error EncoderMismatchesCuda(cudaStream_t stream, ffi::Result<ffi::AnyBuffer> out, int64_t start,
                                 int64_t count, int64_t stride) {
  JQ_RETURN_IF_ERROR(expect("jaxquant_debug_encoder_mismatches", "the result", *out, {ffi::DataType::U32}, {6}));
  JQ_RETURN_IF_ERROR(clear(stream, out->untyped_data(), 24));
  encoder_check_kernel<<<1024, kThreads, 0, stream>>>(static_cast<uint32_t*>(out->untyped_data()), start, count, stride);
  return launch_status("jaxquant_debug_encoder_mismatches");
}

}  // namespace

JQ_DEFINE_CUDA_HANDLER(kAmaxCuda, AmaxCuda, BindAmax);
JQ_DEFINE_CUDA_HANDLER(kAmaxGatedCuda, AmaxGatedCuda, BindAmaxGated);
JQ_DEFINE_CUDA_HANDLER(kQuantizeFp8Cuda, QuantizeFp8Cuda, BindQuantizeFp8);
JQ_DEFINE_CUDA_HANDLER(kQuantizeFp8DelayedCuda, QuantizeFp8DelayedCuda, BindQuantizeFp8Delayed);
JQ_DEFINE_CUDA_HANDLER(kQuantizeFp8DelayedGatedCuda, QuantizeFp8DelayedGatedCuda,
                       BindQuantizeFp8DelayedGated);
JQ_DEFINE_CUDA_HANDLER(kQuantizeFp8DelayedUpdateCuda, QuantizeFp8DelayedUpdateCuda,
                       BindQuantizeFp8DelayedUpdate);
JQ_DEFINE_CUDA_HANDLER(kDelayedUpdateCuda, DelayedUpdateCuda, BindDelayedUpdate);
JQ_DEFINE_CUDA_HANDLER(kQuantizeMxfp8Cuda, QuantizeMxfp8Cuda, BindQuantizeMxfp8);
JQ_DEFINE_CUDA_HANDLER(kQuantizeFp8BlockCuda, QuantizeFp8BlockCuda, BindQuantizeFp8Block);
JQ_DEFINE_CUDA_HANDLER(kQuantizeNvfp4Cuda, QuantizeNvfp4Cuda, BindQuantizeNvfp4);
JQ_DEFINE_CUDA_HANDLER(kTransposeFp8Cuda, TransposeFp8Cuda, BindBufferToBuffer);
JQ_DEFINE_CUDA_HANDLER(kRawBytesCuda, RawBytesCuda, BindBufferToBuffer);
// Not command-buffer compatible: a test probe of 2^32 inputs, never part of a model's program.
XLA_FFI_DEFINE_HANDLER(kEncoderMismatchesCuda, EncoderMismatchesCuda,
                       BindEncoderMismatches(ffi::Ffi::Bind().Ctx<Stream>()));

std::vector<Target> quantize_cuda_targets() {
  return {target("jaxquant_amax", kAmaxCuda),
          target("jaxquant_amax_gated", kAmaxGatedCuda),
          target("jaxquant_quantize_fp8", kQuantizeFp8Cuda),
          target("jaxquant_quantize_fp8_delayed", kQuantizeFp8DelayedCuda),
          target("jaxquant_quantize_fp8_delayed_gated", kQuantizeFp8DelayedGatedCuda),
          target("jaxquant_quantize_fp8_delayed_update", kQuantizeFp8DelayedUpdateCuda),
          target("jaxquant_delayed_update", kDelayedUpdateCuda),
          target("jaxquant_quantize_mxfp8", kQuantizeMxfp8Cuda),
          target("jaxquant_quantize_fp8_block", kQuantizeFp8BlockCuda),
          target("jaxquant_quantize_nvfp4", kQuantizeNvfp4Cuda),
          target("jaxquant_transpose_fp8", kTransposeFp8Cuda),
          target("jaxquant_debug_raw_bytes", kRawBytesCuda),
          target("jaxquant_debug_encoder_mismatches", kEncoderMismatchesCuda)};
}

}  // namespace jqffi
