// CUDA handlers of the fused producer targets (sm_90a; ffi/fused/NOTES.md).
//
//  * jaxquant_norm_stats: one warp per row, the spec's fixed-order sums (fused/norm_stats.cuh),
//    the row held in registers where it fits.
//  * jaxquant_fused_quantize_{fp8,mxfp8,fp8_block}: the quantize targets' tile kernels
//    (quantize/*.cuh), reading their values from a producer (fused/producers.cuh) instead of x:
//    one pass over the producer's inputs writes the rowwise and transposed columnwise copies, the
//    amax, and optionally the normalized output (y) and the per-tile column sums (dbias).
//  * jaxquant_fused_amax: the amax of an activation's output (current scaling needs it first).
// As the quantize handlers: the FFI stream only, no host syncs, no allocations (atomic outputs
// cleared with cudaMemsetAsync), command-buffer compatible.
#include "fused/fused_cuda.cuh"

namespace jqffi {
namespace {

// ------------------------------------- norm statistics ---------------------------------------

ffi::Error NormStatsCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer scale, ffi::AnyBuffer bias,
                         ffi::AnyBuffer gate, ffi::RemainingRets rets, bool rmsnorm, float epsilon, int32_t amax,
                         int32_t out_type, bool has_scale, bool has_bias) {
  NormStatsArgs a;
  JQ_RETURN_IF_ERROR(decode_norm_stats(x, scale, bias, gate, rets, rmsnorm, epsilon, amax, out_type, has_scale,
                                       has_bias, &a));
  JQ_RETURN_IF_ERROR(clear(stream, a.amax, 4));
  const bool vec = vec_input(a.x) && (!a.scale || aligned(a.scale, 16)) && (!a.bias || aligned(a.bias, 16));
  NormStatsParams p{a.x.data, a.x.rows, a.x.cols, vec, a.layernorm, a.has_scale, a.has_bias, a.epsilon, a.out,
                    a.scale, a.bias, a.amax_mode == 2 ? a.gate : nullptr, a.mean, a.rsigma, a.amax};
  const unsigned blocks = unsigned(ceil_div(a.x.rows, kThreads / 32));
  by_input_type(a.x.type, [&](auto tag) { launch_norm_stats<decltype(tag)>(stream, p, blocks); });
  return launch_status("jaxquant_norm_stats");
}

// ---------------------------------------- producer amax --------------------------------------

ffi::Error FusedAmaxCuda(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer mean,
                         ffi::AnyBuffer rsigma, ffi::AnyBuffer scale, ffi::AnyBuffer bias, ffi::AnyBuffer gate,
                         ffi::RemainingArgs more, ffi::Result<ffi::AnyBuffer> amax, int32_t producer, int32_t act, int32_t out_type, bool gated,
                         bool has_scale, bool has_bias, bool gated_amax) {
  const char* t = "jaxquant_fused_amax";
  FusedAmaxArgs d;
  JQ_RETURN_IF_ERROR(decode_fused_amax({a, b, mean, rsigma, scale, bias, &more}, gate, amax,
                                       {producer, act, out_type, gated, has_scale, has_bias}, gated_amax, &d));
  JQ_RETURN_IF_ERROR(clear(stream, d.amax, 4));
  const int64_t total = d.f.R * ceil_div(d.f.C, 8);
  const unsigned blocks = unsigned(std::max<int64_t>(1, std::min<int64_t>(ceil_div(total, kThreads), 2048)));
  JQ_RETURN_IF_ERROR(with_producer(t, d.f, nullptr, [&](const auto& prod) {
    using P = std::decay_t<decltype(prod)>;
    producer_amax_kernel<P><<<blocks, kThreads, 0, stream>>>(prod, d.f.R, d.f.C, d.gate, d.amax);
  }));
  return launch_status(t);
}

}  // namespace

JQ_DEFINE_CUDA_HANDLER(kNormStatsCuda, NormStatsCuda, BindNormStats);
JQ_DEFINE_CUDA_HANDLER(kFusedAmaxCuda, FusedAmaxCuda, BindFusedAmax);

std::vector<Target> fused_stats_cuda_targets() {
  return {target("jaxquant_norm_stats", kNormStatsCuda), target("jaxquant_fused_amax", kFusedAmaxCuda)};
}

}  // namespace jqffi
