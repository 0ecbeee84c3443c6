// Handler symbols of the GEMM targets (XLA_FFI_Handler*, as void*), per platform.
#pragma once

namespace jaxquant_gemm {

void* Fp8GemmCpuHandler();      // jaxquant_gemm_fp8, CPU (gemm_cpu.cc)
void* DequantGemmCpuHandler();  // jaxquant_gemm_dequant, CPU

#ifdef JAXQUANT_GEMM_CUDA
void* Fp8GemmCudaHandler();      // cuBLASLt (gemm_cublaslt.cu)
void* DequantGemmCudaHandler();  // in-kernel dequantize + wgmma (dequant_gemm.cu)
#endif

}  // namespace jaxquant_gemm
