// CUDA handlers of the fused producer targets (sm_90a; ffi/fused/NOTES.md).
//
//  * jaxquant_norm_stats: one warp per row, the spec's fixed-order sums (fused/norm_stats.cuh).
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
  by_input_type(a.x.type, [&](auto tag) { norm_stats_kernel<decltype(tag)><<<blocks, kThreads, 0, stream>>>(p); });
  return launch_status("jaxquant_norm_stats");
}

// ---------------------------------------- producer amax --------------------------------------

ffi::Error FusedAmaxCuda(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer mean,
                         ffi::AnyBuffer rsigma, ffi::AnyBuffer scale, ffi::AnyBuffer bias, ffi::AnyBuffer gate,
                         ffi::Result<ffi::AnyBuffer> amax, int32_t producer, int32_t act, int32_t out_type, bool gated,
                         bool has_scale, bool has_bias, bool gated_amax) {
  const char* t = "jaxquant_fused_amax";
  FusedArgs f;
  JQ_RETURN_IF_ERROR(decode_producer(t, a, b, mean, rsigma, scale, bias,
                                     {producer, act, out_type, gated, has_scale, has_bias}, &f));
  JQ_RETURN_IF_ERROR(expect(t, "gate", gate, {ffi::DataType::F32}, {}));
  JQ_RETURN_IF_ERROR(expect(t, "amax", *amax, {ffi::DataType::F32}, {}));
  float* out = static_cast<float*>(amax->untyped_data());
  JQ_RETURN_IF_ERROR(clear(stream, out, 4));
  const float* g = gated_amax ? static_cast<const float*>(gate.untyped_data()) : nullptr;
  const int64_t total = f.R * ceil_div(f.C, 8);
  const unsigned blocks = unsigned(std::max<int64_t>(1, std::min<int64_t>(ceil_div(total, kThreads), 2048)));
  JQ_RETURN_IF_ERROR(with_producer(t, f, nullptr, [&](const auto& prod) {
    using P = std::decay_t<decltype(prod)>;
    producer_amax_kernel<P><<<blocks, kThreads, 0, stream>>>(prod, f.R, f.C, g, out);
  }));
  return launch_status(t);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kNormStatsCuda, NormStatsCuda,
                       ffi::Ffi::Bind()
                           .Ctx<Stream>()
                           .Arg<ffi::AnyBuffer>()
                           .Arg<ffi::AnyBuffer>()
                           .Arg<ffi::AnyBuffer>()
                           .Arg<ffi::AnyBuffer>()
                           .RemainingRets()
                           .Attr<bool>("rmsnorm")
                           .Attr<float>("epsilon")
                           .Attr<int32_t>("amax")
                           .Attr<int32_t>("out_type")
                           .Attr<bool>("has_scale")
                           .Attr<bool>("has_bias"),
                       {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER(kFusedAmaxCuda, FusedAmaxCuda,
                       ffi::Ffi::Bind().Ctx<Stream>() JQ_FUSED_OPERANDS.Arg<ffi::AnyBuffer>()
                           .Ret<ffi::AnyBuffer>() JQ_PRODUCER_ATTRS.Attr<bool>("gated_amax"),
                       {ffi::Traits::kCmdBufferCompatible});

std::vector<Target> fused_cuda_targets() {
  return {
      {"jaxquant_norm_stats", reinterpret_cast<void*>(kNormStatsCuda)},
      {"jaxquant_fused_amax", reinterpret_cast<void*>(kFusedAmaxCuda)},
      fused_quantize_fp8_cuda_target(),
      fused_quantize_mxfp8_cuda_target(),
      fused_quantize_fp8_block_cuda_target(),
  };
}

}  // namespace jqffi
