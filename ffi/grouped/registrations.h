// The grouped (mixture-of-experts) targets' entry point for the nanobind module (ffi/module.cc
// calls it): adds the tables of grouped/handlers.h to the module's per-platform
// {target name: capsule} dicts.
#pragma once

#include <nanobind/nanobind.h>

#include "grouped/handlers.h"

namespace jqgrouped {

void RegisterGroupedTargets(nanobind::dict& cpu, nanobind::dict& cuda);

}  // namespace jqgrouped
