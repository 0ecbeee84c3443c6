// The handler tables the nanobind module exposes: one (target name, XLA_FFI_Handler*) per target,
// for each platform that was built.
#pragma once

#include <vector>

namespace jqffi {

struct Target {
  const char* name;
  void* handler;  // XLA_FFI_Handler*
};

// CPU handlers of every target (cpu_handlers.cc); always built.
std::vector<Target> cpu_targets();

#ifdef JAXQUANT_WITH_CUDA
// CUDA handlers of every target (cuda_kernels.cu); built when nvcc is found.
std::vector<Target> cuda_targets();
#endif

}  // namespace jqffi
