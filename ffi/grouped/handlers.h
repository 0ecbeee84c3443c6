// The grouped targets' handler tables (no nanobind here: nvcc compiles the CUDA files):
//   jaxquant_grouped_quantize_fp8   per-tensor FP8 with one scale per group, both copies, one
//                                   quantize launch for all groups (current scaling: after one
//                                   amax launch; delayed: the quantize launch records the amax)
//   jaxquant_grouped_quantize_nvfp4 NVFP4 with one second-level scale per group
//   jaxquant_grouped_quantize_mxfp8 / _fp8_block  the single-tensor kernels on a token layout
//                                   read through the group offsets (no gathered copy of x)
//   jaxquant_grouped_patch_mxfp8_rows  raw MXFP8 expert weights' rowwise copy written in place
//                                   over their columnwise one (design decision 56)
//   jaxquant_grouped_decode_nvfp4   NVFP4 storages decoded to bfloat16 (the decoded GEMM route)
//   jaxquant_grouped_amax           per-group amax (block formats: their scales are block-local)
//   jaxquant_grouped_amax_gated     the same, run only while some group's delayed-scaling scale
//                                   is 0 (the just-in-time first scale); else zeros, no pass
//   jaxquant_grouped_gemm           the ragged GEMMs (forward / dgrad) and the per-group wgrad
//   jaxquant_grouped_gemm_sm90      the same on CUTLASS Hopper kernels (per-tensor FP8,
//                                   Float8Block; CUDA built with CUTLASS only)
//   jaxquant_grouped_gemm_bf16      bfloat16 operands on CUTLASS Hopper kernels (CPU handler for
//                                   tests)
#pragma once

#include <vector>

#include "targets.h"

namespace jqffi {

// Every grouped target on the CPU (grouped_cpu.cc) but jaxquant_grouped_gemm_sm90; always built.
std::vector<Target> grouped_cpu_targets();

#ifdef JAXQUANT_WITH_CUDA
std::vector<Target> grouped_quantize_cuda_targets();  // quantize_fp8, amax, amax_gated
                                                      // (grouped_quantize_cuda.cu)
std::vector<Target> grouped_nvfp4_cuda_targets();     // quantize_nvfp4 (nvfp4_cuda.cu)
std::vector<Target> grouped_gathered_cuda_targets();  // quantize_mxfp8, quantize_fp8_block,
                                                      // patch_mxfp8_rows (gathered_cuda.cu)
std::vector<Target> grouped_decode_cuda_targets();    // decode_nvfp4, _mxfp8 (decode_cuda.cu)
std::vector<Target> grouped_gemm_cuda_targets();      // gemm (grouped_gemm_cuda.cu)
#ifdef JAXQUANT_GROUPED_SM90
std::vector<Target> grouped_sm90_cuda_targets();       // gemm_sm90 (grouped_sm90.cu)
std::vector<Target> grouped_sm90_bf16_cuda_targets();  // gemm_bf16 (grouped_sm90_bf16.cu)
#endif
#endif

// The grouped targets on CUDA; empty when the module was built without nvcc.
inline std::vector<Target> grouped_cuda_targets() {
  std::vector<Target> targets;
#ifdef JAXQUANT_WITH_CUDA
  targets = join({grouped_quantize_cuda_targets(), grouped_nvfp4_cuda_targets(),
                  grouped_gathered_cuda_targets(), grouped_decode_cuda_targets(),
                  grouped_gemm_cuda_targets()});
#ifdef JAXQUANT_GROUPED_SM90
  targets = join({targets, grouped_sm90_cuda_targets(), grouped_sm90_bf16_cuda_targets()});
#endif
#endif
  return targets;
}

}  // namespace jqffi
