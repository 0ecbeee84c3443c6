// CUDA handler of jaxquant_fused_quantize_fp8_block (ffi/fused/NOTES.md): a producer's output quantized
// to Float8Block by that format's tile kernel reading from the producer.
#include "fused/fused_cuda.cuh"

namespace jqffi {
namespace {

ffi::Error FusedQuantizeFp8BlockCuda(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer mean,
                                     ffi::AnyBuffer rsigma, ffi::AnyBuffer scale, ffi::AnyBuffer bias,
                                     ffi::RemainingArgs more, ffi::RemainingRets rets, int32_t producer, int32_t act, int32_t out_type,
                                     bool gated, bool has_scale, bool has_bias, bool write_y, bool col_sums,
                                     bool rowwise, bool columnwise, bool block_2d, bool pow2_scale,
                                     float amax_epsilon) {
  FusedQuantizeArgs<Fp8BlockArgs> d;
  JQ_RETURN_IF_ERROR(decode_fused_fp8_block({a, b, mean, rsigma, scale, bias, &more}, rets,
                                            {producer, act, out_type, gated, has_scale, has_bias}, write_y,
                                            col_sums, rowwise, columnwise, block_2d, pow2_scale, amax_epsilon, &d));
  return quantize_produced(stream, d, fp8_block_params(d.q, d.f.R, d.f.C, d.o.col_sums));
}

}  // namespace

JQ_DEFINE_CUDA_HANDLER(kFusedQuantizeFp8BlockCuda, FusedQuantizeFp8BlockCuda, BindFusedQuantizeFp8Block);

std::vector<Target> fused_quantize_fp8_block_cuda_targets() { return {target("jaxquant_fused_quantize_fp8_block", kFusedQuantizeFp8BlockCuda)}; }

}  // namespace jqffi
