// Instantiations of the in-kernel-dequantize GEMM with A payload E4M3 (one file per A type so
// nvcc compiles them in parallel).
#include "gemm/dequant_launch.cuh"

namespace jaxquant_gemm {
template cudaError_t launch_dequant_gemm<Elem::kE4M3, Elem::kE4M3>(const DequantParams&, cudaStream_t);
template cudaError_t launch_dequant_gemm<Elem::kE4M3, Elem::kE5M2>(const DequantParams&, cudaStream_t);
template cudaError_t launch_dequant_gemm<Elem::kE4M3, Elem::kE2M1>(const DequantParams&, cudaStream_t);
}  // namespace jaxquant_gemm
