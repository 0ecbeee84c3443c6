// Instantiations of the in-kernel-dequantize GEMM with A payload E4M3 (one file per A type so
// nvcc compiles them in parallel).
#include "gemm/dequant_launch.cuh"

JQ_DEQUANT_INSTANTIATE_A(jqffi::Elem::kE4M3)
