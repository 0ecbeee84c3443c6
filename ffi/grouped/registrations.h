// Registration entry point of the grouped (mixture-of-experts) targets, called by ffi/module.cc:
//   jaxquant_grouped_quantize_fp8  per-tensor FP8 with one scale per group, both copies, one
//                                  quantize launch for all groups (current scaling: after one
//                                  amax launch; delayed: the quantize launch records the amax)
//   jaxquant_grouped_amax          per-group amax (block formats: their scales are block-local)
//   jaxquant_grouped_amax_gated    the same, run only while some group's delayed-scaling scale
//                                  is 0 (the just-in-time first scale); else zeros, no pass
//   jaxquant_grouped_gemm          the ragged GEMMs (forward / dgrad) and the per-group wgrad
#pragma once

#include <nanobind/nanobind.h>

#include "grouped/cuda_targets.h"

namespace jqgrouped {

void RegisterGroupedTargets(nanobind::dict& cpu, nanobind::dict& cuda);


}  // namespace jqgrouped
