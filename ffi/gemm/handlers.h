// The GEMM targets' handler tables (no nanobind here: nvcc compiles the CUDA files):
//   jaxquant_gemm_fp8      per-tensor FP8 / Float8Block (cuBLASLt on CUDA)
//   jaxquant_gemm_fp8_gelu per-tensor FP8 with gelu in the epilogue (cuBLASLt on CUDA)
//   jaxquant_gemm_dequant  MXFP8 / NVFP4 (in-kernel dequantize + wgmma on CUDA)
#pragma once

#include <vector>

#include "targets.h"

namespace jqffi {

// The targets on the CPU (gemm_cpu.cc); always built.
std::vector<Target> gemm_cpu_targets();

#ifdef JAXQUANT_GEMM_CUDA
std::vector<Target> gemm_fp8_cuda_targets();      // jaxquant_gemm_fp8(_gelu) (gemm_cublaslt.cu)
std::vector<Target> gemm_dequant_cuda_targets();  // jaxquant_gemm_dequant (dequant_gemm.cu)
#endif

// The targets on CUDA; empty unless the module was built with nvcc and JAXQUANT_GEMM
// (JAXQUANT_GEMM_CUDA, set by gemm.cmake).
inline std::vector<Target> gemm_cuda_targets() {
#ifdef JAXQUANT_GEMM_CUDA
  return join({gemm_fp8_cuda_targets(), gemm_dequant_cuda_targets()});
#else
  return {};
#endif
}

}  // namespace jqffi
