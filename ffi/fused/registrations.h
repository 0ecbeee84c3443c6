// The fused producer targets' handler tables (ffi/fused/NOTES.md), merged into the module's
// per-platform tables by ffi/module.cc:
//   jaxquant_norm_stats                LayerNorm / RMSNorm statistics (mean, rsigma) and, for
//                                      per-tensor current scaling, the amax of the normalized output
//   jaxquant_fused_amax                the amax of an activation's (or its gradient's) output
//   jaxquant_fused_quantize_fp8        a producer's output quantized: per-tensor FP8
//   jaxquant_fused_quantize_mxfp8      ... MXFP8
//   jaxquant_fused_quantize_fp8_block  ... Float8Block (1x128 or 128x128)
#pragma once

#include <vector>

#include "quantize/handlers.h"

namespace jqffi {

// CPU handlers (fused/fused_cpu.cc); always built.
std::vector<Target> fused_cpu_targets();

#ifdef JAXQUANT_WITH_CUDA
// CUDA handlers (fused/fused_cuda.cu and one file per quantize target); built when nvcc is found.
std::vector<Target> fused_cuda_targets();
Target fused_quantize_fp8_cuda_target();
Target fused_quantize_mxfp8_cuda_target();
Target fused_quantize_fp8_block_cuda_target();
#endif

}  // namespace jqffi
