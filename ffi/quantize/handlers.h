// The quantize family's handler tables for the nanobind module: one (target name, XLA_FFI_Handler*)
// per target, for each platform that was built.
#pragma once

#include <vector>

namespace jqffi {

struct Target {
  const char* name;
  void* handler;  // XLA_FFI_Handler*
};

// CPU handlers of the quantize, amax, transpose and debug targets (quantize/quantize_cpu.cc);
// always built.
std::vector<Target> cpu_targets();

#ifdef JAXQUANT_WITH_CUDA
// CUDA handlers of the same targets (quantize/quantize_cuda.cu); built when nvcc is found.
std::vector<Target> cuda_targets();
#endif

}  // namespace jqffi
