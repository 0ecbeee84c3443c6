// Entry point of the GEMM targets for the nanobind module (ffi/module.cc): adds
//   jaxquant_gemm_fp8      per-tensor FP8 / Float8Block (cuBLASLt on CUDA)
//   jaxquant_gemm_dequant  MXFP8 / NVFP4 (in-kernel dequantize + wgmma on CUDA)
// to the per-platform {target name: capsule} dicts. CUDA handlers exist when the module was
// built with nvcc (JAXQUANT_GEMM_CUDA, set by ffi/gemm/gemm.cmake).
#pragma once

#include <nanobind/nanobind.h>

namespace jaxquant_gemm {

void RegisterGemmTargets(nanobind::dict& cpu, nanobind::dict& cuda);

}  // namespace jaxquant_gemm
