// nanobind module exposing jaxquant's XLA FFI handlers as capsules, per platform.
#include <nanobind/nanobind.h>

namespace nb = nanobind;

NB_MODULE(_jaxquant_ffi, m) {
  m.def("registrations", []() {
    nb::dict platforms;
    platforms["cpu"] = nb::dict();
    return platforms;
  });
  m.def("has_cuda", []() { return false; });
}
