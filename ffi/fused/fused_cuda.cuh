// What the CUDA handlers of the fused producer targets share (ffi/fused/NOTES.md): the device
// producer of a call's arguments and the launch of a quantize tile kernel over it. Each
// quantize target's handler is its own translation unit (fused_cuda.cu: statistics and amax;
// fused_quantize_{fp8,mxfp8,fp8_block}_cuda.cu), so their kernels compile in parallel.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <type_traits>

#include "cuda_handler.h"
#include "fused/fused_args.h"
#include "fused/handlers.h"
#include "fused/norm_stats.cuh"
#include "quantize/fp8_tiles.cuh"

namespace jqffi {
namespace {

static_assert(kMaxProducerParts == kMaxParts, "producers.cuh and fused_args.h hold as many parts");

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
    } else if (f.producer == Producer::kParts) {
      PartsProducer<In> parts{{}, f.R, f.C, f.N, f.N % 8 == 0};
      for (int k = 0; k < f.nparts; ++k) {
        parts.part[k] = static_cast<const In*>(f.parts[k]);
        parts.vec = parts.vec && aligned(f.parts[k], 16);
      }
      fn(parts);
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

// Clears the call's amax (reduced with atomics) and runs the tile kernel of `p` (the format's
// parameters for `d`) over the producer of `d`.
template <typename Q, typename Params>
ffi::Error quantize_produced(cudaStream_t stream, const FusedQuantizeArgs<Q>& d, const Params& p) {
  const char* t = d.target;
  JQ_RETURN_IF_ERROR(clear(stream, d.q.amax, 4));
  cudaError_t e = cudaSuccess;
  JQ_RETURN_IF_ERROR(
      with_producer(t, d.f, d.o.y, [&](const auto& prod) { e = launch_fp8_tiles(stream, p, prod); }));
  return launch_status(t, e);
}

}  // namespace
}  // namespace jqffi
