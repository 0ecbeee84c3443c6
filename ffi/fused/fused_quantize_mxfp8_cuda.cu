// CUDA handler of jaxquant_fused_quantize_mxfp8 (ffi/fused/NOTES.md): a producer's output quantized
// to MXFP8 by that format's tile kernel reading from the producer.
#include "fused/fused_cuda.cuh"

namespace jqffi {
namespace {

ffi::Error FusedQuantizeMxfp8Cuda(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer mean,
                                  ffi::AnyBuffer rsigma, ffi::AnyBuffer scale, ffi::AnyBuffer bias,
                                  ffi::RemainingRets rets, int32_t producer, int32_t act, int32_t out_type,
                                  bool gated, bool has_scale, bool has_bias, bool write_y, bool col_sums,
                                  bool rowwise, bool columnwise) {
  const char* t = "jaxquant_fused_quantize_mxfp8";
  FusedArgs f;
  JQ_RETURN_IF_ERROR(decode_producer(t, a, b, mean, rsigma, scale, bias,
                                     {producer, act, out_type, gated, has_scale, has_bias}, &f));
  JQ_RETURN_IF_ERROR(need_direction(t, rowwise, columnwise));
  Mxfp8Args q;
  q.rowwise = rowwise; q.columnwise = columnwise;
  FusedOutputs o;
  RetReader r(t, rets);
  JQ_RETURN_IF_ERROR(read_y(t, r, f, write_y, &o));
  JQ_RETURN_IF_ERROR(read_mxfp8_results(t, r, f.R, f.C, &q));
  JQ_RETURN_IF_ERROR(read_col_sums(t, r, f, col_sums, &o));
  JQ_RETURN_IF_ERROR(r.done());
  JQ_RETURN_IF_ERROR(clear(stream, q.amax, 4));
  const Mxfp8Params p{f.R, f.C, aligned(q.row_data, 8) && f.C % 8 == 0, aligned(q.col_data, 16) && f.R % 16 == 0,
                      rowwise, columnwise, q.fmt, q.row_data, q.row_scale, q.col_data, q.col_scale, q.amax,
                      o.col_sums};
  cudaError_t e = cudaSuccess;
  JQ_RETURN_IF_ERROR(with_producer(t, f, o.y, [&](const auto& prod) {
    using P = std::decay_t<decltype(prod)>;
    e = launch_tiles(mxfp8_kernel<P>, num_tiles(f.R, f.C, 128, 128), tile_smem<P>(columnwise || col_sums), stream,
                     p, prod);
  }));
  return launch_status(t, e);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kFusedQuantizeMxfp8Cuda, FusedQuantizeMxfp8Cuda,
                       ffi::Ffi::Bind().Ctx<Stream>() JQ_FUSED_OPERANDS.RemainingRets() JQ_PRODUCER_ATTRS
                           .Attr<bool>("write_y")
                           .Attr<bool>("col_sums")
                           .Attr<bool>("rowwise")
                           .Attr<bool>("columnwise"),
                       {ffi::Traits::kCmdBufferCompatible});

Target fused_quantize_mxfp8_cuda_target() { return {"jaxquant_fused_quantize_mxfp8", reinterpret_cast<void*>(kFusedQuantizeMxfp8Cuda)}; }

}  // namespace jqffi
