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
#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <type_traits>

#include "fused/fused_args.h"
#include "fused/norm_stats.cuh"
#include "fused/registrations.h"
#include "quantize/fp8_tensor.cuh"  // first: FP8Tile
#include "quantize/mxfp8.cuh"
#include "quantize/fp8_block.cuh"

namespace jqffi {
namespace {

// Calls fn(producer) with the device producer of `f` (y: the normalized output, or null). A
// normalization writes its input's type or float32; an activation keeps its input's type.
template <typename F>
ffi::Error with_producer(const char* t, const FusedArgs& f, void* y, F&& fn) {
  bool served = true;
  const bool vec_params = f.C % 8 == 0 && (!f.scale || aligned(f.scale, 16)) && (!f.bias || aligned(f.bias, 16));
  by_input_type(f.a.type, [&](auto in_tag) {
    using In = decltype(in_tag);
    const In* a = static_cast<const In*>(f.a.data);
    if (f.norm()) {
      auto make = [&](auto out_tag) {
        using O = decltype(out_tag);
        fn(NormProducer<In, O>{a, f.mean, f.rsigma, f.scale, f.bias, static_cast<O*>(y), f.R, f.C,
                               aligned(a, 16) && f.C % 8 == 0, vec_params, aligned(y, 16) && f.C % 8 == 0,
                               f.layernorm(), f.has_scale, f.has_bias});
      };
      if (f.out == jq::OutType::kF32) {
        make(float{});
      } else if constexpr (!std::is_same_v<In, float>) {
        if (out_type_of(f.a.type) == f.out) make(In{}); else served = false;
      } else {
        served = false;
      }
    } else if (f.producer == Producer::kAct) {
      fn(ActProducer<In>{a, f.R, f.C, aligned(a, 16) && f.C % 8 == 0, f.gated, f.act});
    } else {
      const In* h = static_cast<const In*>(f.b.data);
      fn(DactProducer<In>{a, h, f.R, f.C, f.N, aligned(a, 16) && aligned(h, 16) && f.N % 8 == 0, f.gated, f.act});
    }
  });
  if (!served) {
    return invalid(t, std::string("no CUDA kernel normalizes ") + out_type_name(out_type_of(f.a.type)) +
                          " into " + out_type_name(f.out) + " (the output is the input's dtype or float32)");
  }
  return ffi::Error::Success();
}

template <typename P>
int tile_smem(bool column_phase) {
  return column_phase ? FP8Tile<typename P::Out>::kSmemBytes : 0;
}

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

// --------------------------------------- fused quantize --------------------------------------

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

using Stream = ffi::PlatformStream<cudaStream_t>;

}  // namespace

#define JQ_FUSED_OPERANDS                                                                          \
  .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()        \
      .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
#define JQ_PRODUCER_ATTRS                                                                          \
  .Attr<int32_t>("producer").Attr<int32_t>("act").Attr<int32_t>("out_type").Attr<bool>("gated")   \
      .Attr<bool>("has_scale").Attr<bool>("has_bias")

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

XLA_FFI_DEFINE_HANDLER(kFusedQuantizeMxfp8Cuda, FusedQuantizeMxfp8Cuda,
                       ffi::Ffi::Bind().Ctx<Stream>() JQ_FUSED_OPERANDS.RemainingRets() JQ_PRODUCER_ATTRS
                           .Attr<bool>("write_y")
                           .Attr<bool>("col_sums")
                           .Attr<bool>("rowwise")
                           .Attr<bool>("columnwise"),
                       {ffi::Traits::kCmdBufferCompatible});

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

std::vector<Target> fused_cuda_targets() {
  return {
      {"jaxquant_norm_stats", reinterpret_cast<void*>(kNormStatsCuda)},
      {"jaxquant_fused_amax", reinterpret_cast<void*>(kFusedAmaxCuda)},
      {"jaxquant_fused_quantize_fp8", reinterpret_cast<void*>(kFusedQuantizeFp8Cuda)},
      {"jaxquant_fused_quantize_mxfp8", reinterpret_cast<void*>(kFusedQuantizeMxfp8Cuda)},
      {"jaxquant_fused_quantize_fp8_block", reinterpret_cast<void*>(kFusedQuantizeFp8BlockCuda)},
  };
}

}  // namespace jqffi
