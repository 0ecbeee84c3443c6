// The grouped targets' CUDA handlers, listed by grouped_cuda.cu (a header free of nanobind, so
// nvcc never compiles nanobind).
#pragma once

#include <vector>

namespace jqgrouped {

#ifdef JAXQUANT_WITH_CUDA
struct CudaTarget {
  const char* name;
  void* handler;  // XLA_FFI_Handler*
};
std::vector<CudaTarget> GroupedCudaTargets();
std::vector<CudaTarget> GroupedNvfp4CudaTargets();  // nvfp4_cuda.cu
#ifdef JAXQUANT_GROUPED_SM90
std::vector<CudaTarget> GroupedSm90Targets();  // grouped_sm90.cu (CUTLASS)
CudaTarget GroupedSm90Bf16Target();            // grouped_sm90_bf16.cu (CUTLASS, bfloat16)
#endif
#endif

}  // namespace jqgrouped
