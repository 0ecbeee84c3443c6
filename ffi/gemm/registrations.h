// The GEMM targets' entry point for the nanobind module (ffi/module.cc calls it): adds the
// tables of gemm/handlers.h to the module's per-platform {target name: capsule} dicts.
#pragma once

#include <nanobind/nanobind.h>

#include "gemm/handlers.h"

namespace jaxquant_gemm {

void RegisterGemmTargets(nanobind::dict& cpu, nanobind::dict& cuda);

}  // namespace jaxquant_gemm
