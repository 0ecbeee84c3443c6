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

#include "fused/registrations.h"
#include "gemm/registrations.h"
#include "grouped/registrations.h"
#include "quantize/handlers.h"

namespace nb = nanobind;

namespace {

nb::dict table(const std::vector<jqffi::Target>& targets) {
  nb::dict d;
  for (const jqffi::Target& t : targets) d[t.name] = nb::capsule(t.handler);
  return d;
}

void add(nb::dict& d, const std::vector<jqffi::Target>& targets) {
  for (const jqffi::Target& t : targets) d[t.name] = nb::capsule(t.handler);
}

}  // namespace

NB_MODULE(_jaxquant_ffi, m) {
  m.def("registrations", []() {
    nb::dict platforms;
    nb::dict cpu = table(jqffi::cpu_targets()), cuda;
    add(cpu, jqffi::fused_cpu_targets());  // ffi/fused
#ifdef JAXQUANT_WITH_CUDA
    cuda = table(jqffi::cuda_targets());
    add(cuda, jqffi::fused_cuda_targets());
#endif
    jaxquant_gemm::RegisterGemmTargets(cpu, cuda);  // ffi/gemm
    jqgrouped::RegisterGroupedTargets(cpu, cuda);   // ffi/grouped
    platforms["cpu"] = cpu;
#ifdef JAXQUANT_WITH_CUDA
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
