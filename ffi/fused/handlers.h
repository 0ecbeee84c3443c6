// The fused producer targets' handler tables (ffi/fused/NOTES.md; no nanobind here: nvcc
// compiles the CUDA files):
//   jaxquant_norm_stats                LayerNorm / RMSNorm statistics (mean, rsigma) and, for
//                                      per-tensor current scaling, the amax of the normalized output
//   jaxquant_fused_amax                the amax of an activation's (or its gradient's) output
//   jaxquant_fused_quantize_fp8        a producer's output quantized: per-tensor FP8
//   jaxquant_fused_quantize_mxfp8      ... MXFP8
//   jaxquant_fused_quantize_fp8_block  ... Float8Block (1x128 or 128x128)
#pragma once

#include <vector>

#include "targets.h"

namespace jqffi {

// Every fused target on the CPU (fused_cpu.cc); always built.
std::vector<Target> fused_cpu_targets();

#ifdef JAXQUANT_WITH_CUDA
std::vector<Target> fused_stats_cuda_targets();               // norm_stats, fused_amax
                                                              // (fused_cuda.cu)
std::vector<Target> fused_quantize_fp8_cuda_targets();        // fused_quantize_fp8_cuda.cu
std::vector<Target> fused_quantize_mxfp8_cuda_targets();      // fused_quantize_mxfp8_cuda.cu
std::vector<Target> fused_quantize_fp8_block_cuda_targets();  // fused_quantize_fp8_block_cuda.cu

// Every fused target on CUDA; built when nvcc is found.
inline std::vector<Target> fused_cuda_targets() {
  return join({fused_stats_cuda_targets(), fused_quantize_fp8_cuda_targets(),
               fused_quantize_mxfp8_cuda_targets(), fused_quantize_fp8_block_cuda_targets()});
}
#endif

}  // namespace jqffi
