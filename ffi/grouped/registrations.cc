#include "grouped/registrations.h"

void jqgrouped::RegisterGroupedTargets(nanobind::dict& cpu, nanobind::dict& cuda) {
  jqffi::add_capsules<nanobind::capsule>(cpu, jqffi::grouped_cpu_targets());
  jqffi::add_capsules<nanobind::capsule>(cuda, jqffi::grouped_cuda_targets());
}
