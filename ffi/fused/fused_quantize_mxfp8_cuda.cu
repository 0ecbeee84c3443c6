// CUDA handler of jaxquant_fused_quantize_mxfp8 (ffi/fused/NOTES.md): a producer's output quantized
// to MXFP8 by that format's tile kernel reading from the producer.
#include "fused/fused_cuda.cuh"

namespace jqffi {
namespace {

ffi::Error FusedQuantizeMxfp8Cuda(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer mean,
                                  ffi::AnyBuffer rsigma, ffi::AnyBuffer scale, ffi::AnyBuffer bias,
                                  ffi::RemainingArgs more, ffi::RemainingRets rets, int32_t producer, int32_t act, int32_t out_type,
                                  bool gated, bool has_scale, bool has_bias, bool write_y, bool col_sums,
                                  bool rowwise, bool columnwise) {
  FusedQuantizeArgs<Mxfp8Args> d;
  JQ_RETURN_IF_ERROR(decode_fused_mxfp8({a, b, mean, rsigma, scale, bias, &more}, rets,
                                        {producer, act, out_type, gated, has_scale, has_bias}, write_y, col_sums,
                                        rowwise, columnwise, &d));
  return quantize_produced(stream, d, mxfp8_params(d.q, d.f.R, d.f.C, d.o.col_sums));
}

}  // namespace

JQ_DEFINE_CUDA_HANDLER(kFusedQuantizeMxfp8Cuda, FusedQuantizeMxfp8Cuda, BindFusedQuantizeMxfp8);

std::vector<Target> fused_quantize_mxfp8_cuda_targets() { return {target("jaxquant_fused_quantize_mxfp8", kFusedQuantizeMxfp8Cuda)}; }

}  // namespace jqffi
