// A target family's handler table: {target name, XLA_FFI_Handler*} per target, one table per
// platform, built from the lists the family's handler files define (no nanobind here: nvcc
// compiles those files); ffi/module.cc turns the tables into capsules.
#pragma once

#include <initializer_list>
#include <vector>

namespace jqffi {

// One FFI target of one platform.
struct Target {
  const char* name;
  void* handler;  // XLA_FFI_Handler*
};

// The table entry of handler `handler` (an XLA_FFI_DEFINE_HANDLER symbol) under `name`.
template <typename Handler>
Target target(const char* name, Handler* handler) {
  return {name, reinterpret_cast<void*>(handler)};
}

// The lists, one after the other.
inline std::vector<Target> join(std::initializer_list<std::vector<Target>> lists) {
  std::vector<Target> all;
  for (const std::vector<Target>& list : lists) all.insert(all.end(), list.begin(), list.end());
  return all;
}

// Adds `table` to one of the nanobind module's {target name: capsule} dicts (Dict, Capsule:
// nanobind::dict and nanobind::capsule; template parameters, so this header needs no nanobind).
template <class Capsule, class Dict>
void add_capsules(Dict& dict, const std::vector<Target>& table) {
  for (const Target& t : table) dict[t.name] = Capsule(t.handler);
}

}  // namespace jqffi
