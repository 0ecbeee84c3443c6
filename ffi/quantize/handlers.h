// The quantize targets' handler tables (no nanobind here: nvcc compiles the CUDA file):
// jaxquant_amax[_gated], jaxquant_quantize_{fp8,fp8_delayed,mxfp8,fp8_block,nvfp4},
// jaxquant_delayed_update, jaxquant_transpose_fp8 and the two jaxquant_debug_* targets.
#pragma once

#include <vector>

#include "targets.h"

namespace jqffi {

// On the CPU (quantize_cpu.cc); always built.
std::vector<Target> quantize_cpu_targets();

#ifdef JAXQUANT_WITH_CUDA
// On CUDA (quantize_cuda.cu); built when nvcc is found.
std::vector<Target> quantize_cuda_targets();
#endif

}  // namespace jqffi
