// Host-side launch of the in-kernel-dequantize GEMM, one instantiation per (A, B) payload type
// (dequant_inst_*.cu, compiled in parallel).
#pragma once

#include <cuda_runtime.h>

#include "gemm/dequant_params.h"

namespace jqffi {

template <Elem EA, Elem EB>
cudaError_t launch_dequant_gemm(const DequantParams& p, cudaStream_t stream);

#define JQ_DECLARE_DEQUANT(EA, EB) \
  extern template cudaError_t launch_dequant_gemm<EA, EB>(const DequantParams&, cudaStream_t);
JQ_DECLARE_DEQUANT(Elem::kE4M3, Elem::kE4M3)
JQ_DECLARE_DEQUANT(Elem::kE4M3, Elem::kE5M2)
JQ_DECLARE_DEQUANT(Elem::kE4M3, Elem::kE2M1)
JQ_DECLARE_DEQUANT(Elem::kE5M2, Elem::kE4M3)
JQ_DECLARE_DEQUANT(Elem::kE5M2, Elem::kE5M2)
JQ_DECLARE_DEQUANT(Elem::kE5M2, Elem::kE2M1)
JQ_DECLARE_DEQUANT(Elem::kE2M1, Elem::kE4M3)
JQ_DECLARE_DEQUANT(Elem::kE2M1, Elem::kE5M2)
JQ_DECLARE_DEQUANT(Elem::kE2M1, Elem::kE2M1)
#undef JQ_DECLARE_DEQUANT

}  // namespace jqffi
