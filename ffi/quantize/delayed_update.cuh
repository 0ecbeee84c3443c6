// Delayed-scaling state update (`jaxquant_delayed_update`): one CTA per state.
#pragma once

#include "quantize/tile.cuh"

namespace jqffi {
namespace {

struct DelayedUpdateParams {
  const float *history, *scale, *amax;
  float *new_history, *new_scale;
  int64_t length;
  float fmax;
  int32_t margin;
  bool most_recent;
};

// state.delayed_scaling_update: hist[0] = amax; a = max |hist| (NaN-propagating, by the float
// bits) or amax; scale' = delayed_scale(a, fmax, margin, scale); history' = hist rolled by -1,
// first entry zeroed. The outputs may be the inputs' buffers (the call aliases them, an update
// in place): the amax pass reads the history before the CTA's barriers, the roll goes in
// chunks of kThreads entries, each read before a barrier and written after it (a chunk's reads
// reach one entry into the next chunk, which is written only after its own barrier), and the
// scale is read and written by thread 0.
__global__ void __launch_bounds__(kThreads) delayed_update_kernel(const DelayedUpdateParams p) {
  __shared__ uint32_t red[kThreads / 32];
  const int64_t b = blockIdx.x, L = p.length;
  const float* h = p.history + b * L;
  float* out = p.new_history + b * L;
  const float am = p.amax[b];
  uint32_t m = threadIdx.x == 0 ? jq::abs_bits(am) : 0u;
  for (int64_t j = 1 + threadIdx.x; j < L; j += kThreads) m = max(m, jq::abs_bits(h[j]));
  m = cta_max(m, red);
  if (threadIdx.x == 0) {
    p.new_scale[b] = jq::delayed_scale(p.most_recent ? am : jq::float_of(m), p.fmax, p.margin, p.scale[b]);
  }
  for (int64_t base = 0; base < L; base += kThreads) {
    const int64_t i = base + threadIdx.x;
    const float v = i >= L ? 0.0f : i == 0 ? 0.0f : (i + 1 == L ? am : h[i + 1]);
    __syncthreads();
    if (i < L) out[i] = v;
  }
}

}  // namespace
}  // namespace jqffi
