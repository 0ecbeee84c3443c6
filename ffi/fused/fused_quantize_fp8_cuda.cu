// CUDA handler of jaxquant_fused_quantize_fp8 (ffi/fused/NOTES.md): a producer's output quantized
// to per-tensor FP8 by that format's tile kernel reading from the producer.
#include "fused/fused_cuda.cuh"

namespace jqffi {
namespace {

ffi::Error FusedQuantizeFp8Cuda(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer mean,
                                ffi::AnyBuffer rsigma, ffi::AnyBuffer scale, ffi::AnyBuffer bias, ffi::AnyBuffer s,
                                ffi::RemainingArgs more, ffi::RemainingRets rets, int32_t producer, int32_t act, int32_t out_type, bool gated,
                                bool has_scale, bool has_bias, bool write_y, bool col_sums, bool rowwise,
                                bool columnwise, bool delayed, bool pow2_scale, float amax_epsilon) {
  FusedQuantizeArgs<Fp8TensorArgs> d;
  JQ_RETURN_IF_ERROR(decode_fused_fp8({a, b, mean, rsigma, scale, bias, &more}, s, rets,
                                      {producer, act, out_type, gated, has_scale, has_bias}, write_y, col_sums,
                                      rowwise, columnwise, delayed, pow2_scale, amax_epsilon, &d));
  return quantize_produced(stream, d, fp8_tensor_params(d.q, d.f.R, d.f.C, d.o.col_sums));
}

}  // namespace

JQ_DEFINE_CUDA_HANDLER(kFusedQuantizeFp8Cuda, FusedQuantizeFp8Cuda, BindFusedQuantizeFp8);

std::vector<Target> fused_quantize_fp8_cuda_targets() { return {target("jaxquant_fused_quantize_fp8", kFusedQuantizeFp8Cuda)}; }

}  // namespace jqffi
