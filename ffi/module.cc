// nanobind module exposing jaxquant's XLA FFI handlers as capsules, per platform.
//
//   registrations() -> {"cpu": {target: capsule}, "CUDA": {target: capsule}}  (CUDA when built)
//   has_cuda() -> whether the CUDA kernels were compiled in
//   grouped_sm90_status() -> the CUTLASS grouped GEMM's build (CUTLASS version) or why it is absent
//   build_options() -> {"cuda": bool, "gemm": bool}: the CMake options JAXQUANT_CUDA (and nvcc
//     found) and JAXQUANT_GEMM (False: built without the CUDA GEMM kernels)
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>
#include <vector>

#include "fused/handlers.h"
#include "gemm/handlers.h"
#include "grouped/handlers.h"
#include "quantize/handlers.h"
#include "targets.h"

namespace nb = nanobind;

namespace {

// Every family's handlers on the CPU (always built).
std::vector<jqffi::Target> cpu_targets() {
  return jqffi::join({jqffi::quantize_cpu_targets(), jqffi::fused_cpu_targets(),
                      jqffi::gemm_cpu_targets(), jqffi::grouped_cpu_targets()});
}

#ifdef JAXQUANT_WITH_CUDA
// Every family's handlers on CUDA (built with nvcc; the GEMM ones also need JAXQUANT_GEMM).
std::vector<jqffi::Target> cuda_targets() {
  return jqffi::join({jqffi::quantize_cuda_targets(), jqffi::fused_cuda_targets(),
                      jqffi::gemm_cuda_targets(), jqffi::grouped_cuda_targets()});
}
#endif

}  // namespace

NB_MODULE(_jaxquant_ffi, m) {
  m.def("registrations", []() {
    nb::dict platforms, cpu;
    jqffi::add_capsules<nb::capsule>(cpu, cpu_targets());
    platforms["cpu"] = cpu;
#ifdef JAXQUANT_WITH_CUDA
    nb::dict cuda;
    jqffi::add_capsules<nb::capsule>(cuda, cuda_targets());
    platforms["CUDA"] = cuda;
#endif
    return platforms;
  });
  m.def("has_cuda", []() {
#ifdef JAXQUANT_WITH_CUDA
    return true;
#else
    return false;
#endif
  });
  // Whether the CUTLASS Hopper grouped GEMM (jaxquant_grouped_gemm_sm90) was built, and from
  // which CUTLASS, or why not (ffi/grouped/sm90/sm90.cmake).
  m.def("grouped_sm90_status", []() {
#ifdef JAXQUANT_GROUPED_SM90_STATUS
    return std::string(JAXQUANT_GROUPED_SM90_STATUS);
#else
    return std::string("not configured");
#endif
  });

  m.def("build_options", []() {
    nb::dict options;
#ifdef JAXQUANT_WITH_CUDA
    options["cuda"] = true;
#else
    options["cuda"] = false;
#endif
#ifdef JAXQUANT_GEMM_OFF
    options["gemm"] = false;
#else
    options["gemm"] = true;
#endif
    return options;
  });
  m.def("cuda_archs", []() {
#ifdef JAXQUANT_CUDA_ARCHS
    return std::string(JAXQUANT_CUDA_ARCHS);
#else
    return std::string();
#endif
  });
}
