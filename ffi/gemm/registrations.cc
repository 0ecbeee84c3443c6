#include "gemm/registrations.h"

void jaxquant_gemm::RegisterGemmTargets(nanobind::dict& cpu, nanobind::dict& cuda) {
  jqffi::add_capsules<nanobind::capsule>(cpu, jqffi::gemm_cpu_targets());
  jqffi::add_capsules<nanobind::capsule>(cuda, jqffi::gemm_cuda_targets());
}
