#include "gemm/registrations.h"

#include "gemm/handlers.h"

namespace jaxquant_gemm {

namespace nb = nanobind;

void RegisterGemmTargets(nb::dict& cpu, nb::dict& cuda) {
  cpu["jaxquant_gemm_fp8"] = nb::capsule(Fp8GemmCpuHandler());
  cpu["jaxquant_gemm_dequant"] = nb::capsule(DequantGemmCpuHandler());
#ifdef JAXQUANT_GEMM_CUDA
  cuda["jaxquant_gemm_fp8"] = nb::capsule(Fp8GemmCudaHandler());
  cuda["jaxquant_gemm_dequant"] = nb::capsule(DequantGemmCudaHandler());
#else
  (void)cuda;
#endif
}

}  // namespace jaxquant_gemm
