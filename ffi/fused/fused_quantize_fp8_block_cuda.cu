// CUDA handler of jaxquant_fused_quantize_fp8_block (ffi/fused/NOTES.md): a producer's output quantized
// to Float8Block by that format's tile kernel reading from the producer.
#include "fused/fused_cuda.cuh"

namespace jqffi {
namespace {

ffi::Error FusedQuantizeFp8BlockCuda(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer mean,
                                     ffi::AnyBuffer rsigma, ffi::AnyBuffer scale, ffi::AnyBuffer bias,
                                     ffi::RemainingRets rets, int32_t producer, int32_t act, int32_t out_type,
                                     bool gated, bool has_scale, bool has_bias, bool write_y, bool col_sums,
                                     bool rowwise, bool columnwise, bool block_2d, bool pow2_scale,
                                     float amax_epsilon) {
  const char* t = "jaxquant_fused_quantize_fp8_block";
  FusedArgs f;
  JQ_RETURN_IF_ERROR(decode_producer(t, a, b, mean, rsigma, scale, bias,
                                     {producer, act, out_type, gated, has_scale, has_bias}, &f));
  JQ_RETURN_IF_ERROR(need_direction(t, rowwise, columnwise));
  Fp8BlockArgs q;
  q.rowwise = rowwise; q.columnwise = columnwise; q.block_2d = block_2d;
  FusedOutputs o;
  RetReader r(t, rets);
  JQ_RETURN_IF_ERROR(read_y(t, r, f, write_y, &o));
  JQ_RETURN_IF_ERROR(read_fp8_block_results(t, r, f.R, f.C, &q));
  JQ_RETURN_IF_ERROR(read_col_sums(t, r, f, col_sums, &o));
  JQ_RETURN_IF_ERROR(r.done());
  JQ_RETURN_IF_ERROR(clear(stream, q.amax, 4));
  const Fp8BlockParams p{f.R, f.C, aligned(q.row_data, 8) && f.C % 8 == 0, aligned(q.col_data, 16) && f.R % 16 == 0,
                         rowwise, columnwise, block_2d, pow2_scale, amax_epsilon, q.fmt, q.row_data, q.col_data,
                         q.row_scale, q.col_scale, q.amax, o.col_sums};
  cudaError_t e = cudaSuccess;
  JQ_RETURN_IF_ERROR(with_producer(t, f, o.y, [&](const auto& prod) {
    using P = std::decay_t<decltype(prod)>;
    e = launch_tiles(fp8_block_kernel<P>, num_tiles(f.R, f.C, 128, 128), tile_smem<P>(columnwise || col_sums),
                     stream, p, prod);
  }));
  return launch_status(t, e);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kFusedQuantizeFp8BlockCuda, FusedQuantizeFp8BlockCuda,
                       ffi::Ffi::Bind().Ctx<Stream>() JQ_FUSED_OPERANDS.RemainingRets() JQ_PRODUCER_ATTRS
                           .Attr<bool>("write_y")
                           .Attr<bool>("col_sums")
                           .Attr<bool>("rowwise")
                           .Attr<bool>("columnwise")
                           .Attr<bool>("block_2d")
                           .Attr<bool>("pow2_scale")
                           .Attr<float>("amax_epsilon"),
                       {ffi::Traits::kCmdBufferCompatible});

Target fused_quantize_fp8_block_cuda_target() { return {"jaxquant_fused_quantize_fp8_block", reinterpret_cast<void*>(kFusedQuantizeFp8BlockCuda)}; }

}  // namespace jqffi
