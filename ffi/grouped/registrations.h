// Registration entry point of the grouped (mixture-of-experts) targets, called by ffi/module.cc:
//   jaxquant_grouped_quantize_fp8  per-tensor FP8 with one scale per group, both copies, one
//                                  amax launch + one quantize launch for all groups
//   jaxquant_grouped_amax          per-group amax (block formats: their scales are block-local)
//   jaxquant_grouped_gemm          the ragged GEMMs (forward / dgrad) and the per-group wgrad
#pragma once

#include <nanobind/nanobind.h>

#include "grouped/cuda_targets.h"

namespace jqgrouped {

void RegisterGroupedTargets(nanobind::dict& cpu, nanobind::dict& cuda);


}  // namespace jqgrouped
