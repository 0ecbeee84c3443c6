// CUDA handler of jaxquant_fused_quantize_fp8 (ffi/fused/NOTES.md): a producer's output quantized
// to per-tensor FP8 by that format's tile kernel reading from the producer.
#include "fused/fused_cuda.cuh"

namespace jqffi {
namespace {

ffi::Error FusedQuantizeFp8Cuda(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer mean,
                                ffi::AnyBuffer rsigma, ffi::AnyBuffer scale, ffi::AnyBuffer bias, ffi::AnyBuffer s,
                                ffi::RemainingRets rets, int32_t producer, int32_t act, int32_t out_type, bool gated,
                                bool has_scale, bool has_bias, bool write_y, bool col_sums, bool rowwise,
                                bool columnwise, bool delayed, bool pow2_scale, float amax_epsilon) {
  const char* t = "jaxquant_fused_quantize_fp8";
  FusedArgs f;
  JQ_RETURN_IF_ERROR(decode_producer(t, a, b, mean, rsigma, scale, bias,
                                     {producer, act, out_type, gated, has_scale, has_bias}, &f));
  JQ_RETURN_IF_ERROR(need_direction(t, rowwise, columnwise));
  JQ_RETURN_IF_ERROR(expect(t, delayed ? "scale" : "amax", s, {ffi::DataType::F32}, {}));
  Fp8TensorArgs q;
  q.rowwise = rowwise; q.columnwise = columnwise; q.delayed = delayed;
  FusedOutputs o;
  RetReader r(t, rets);
  JQ_RETURN_IF_ERROR(read_y(t, r, f, write_y, &o));
  JQ_RETURN_IF_ERROR(read_fp8_tensor_results(t, r, f.R, f.C, &q));
  JQ_RETURN_IF_ERROR(read_col_sums(t, r, f, col_sums, &o));
  JQ_RETURN_IF_ERROR(r.done());
  JQ_RETURN_IF_ERROR(clear(stream, q.amax, 4));
  const Fp8TensorParams p{f.R, f.C, aligned(q.row_data, 8) && f.C % 8 == 0, aligned(q.col_data, 16) && f.R % 16 == 0,
                          rowwise, columnwise, delayed, pow2_scale, amax_epsilon, q.fmt,
                          static_cast<const float*>(s.untyped_data()), q.row_data, q.col_data, q.scale_inv, q.amax,
                          o.col_sums};
  cudaError_t e = cudaSuccess;
  JQ_RETURN_IF_ERROR(with_producer(t, f, o.y, [&](const auto& prod) {
    using P = std::decay_t<decltype(prod)>;
    e = launch_tiles(fp8_tensor_kernel<P>, num_tiles(f.R, f.C, 128, 128), tile_smem<P>(columnwise || col_sums),
                     stream, p, prod);
  }));
  return launch_status(t, e);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kFusedQuantizeFp8Cuda, FusedQuantizeFp8Cuda,
                       ffi::Ffi::Bind().Ctx<Stream>() JQ_FUSED_OPERANDS.Arg<ffi::AnyBuffer>()
                           .RemainingRets() JQ_PRODUCER_ATTRS.Attr<bool>("write_y")
                           .Attr<bool>("col_sums")
                           .Attr<bool>("rowwise")
                           .Attr<bool>("columnwise")
                           .Attr<bool>("delayed")
                           .Attr<bool>("pow2_scale")
                           .Attr<float>("amax_epsilon"),
                       {ffi::Traits::kCmdBufferCompatible});

Target fused_quantize_fp8_cuda_target() { return {"jaxquant_fused_quantize_fp8", reinterpret_cast<void*>(kFusedQuantizeFp8Cuda)}; }

}  // namespace jqffi
