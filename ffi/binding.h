// Pieces of an XLA FFI signature, so each target's signature is written once for both platforms:
// a target family's `Bind<Target>(binding)` template (gemm/gemm_args.h, grouped/grouped_args.h)
// receives `ffi::Ffi::Bind()` from the CPU handler and `ffi::Ffi::Bind().Ctx<Stream>()` from the
// CUDA handler, and appends the buffers and attributes with these helpers:
//
//   auto buffers = Rets<1>(Args<3>(std::move(binding)));      // 3 AnyBuffer args, 1 result
//   return Attrs<bool>(std::move(buffers), "rowwise", "columnwise");
//
// A Binding can only be moved from inside XLA's own class, so the helpers take it by reference
// and return the prvalue its member calls make (C++17 guaranteed elision; no copy, no move).
#pragma once

#include <cstddef>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jqffi {

// `binding` followed by N ffi::AnyBuffer results (kResults) or arguments.
template <size_t N, bool kResults, typename Binding>
auto Buffers(Binding&& binding) {
  static_assert(N > 0, "no buffer to add");
  auto one_more = [&] {
    if constexpr (kResults) {
      return std::move(binding).template Ret<xla::ffi::AnyBuffer>();
    } else {
      return std::move(binding).template Arg<xla::ffi::AnyBuffer>();
    }
  };
  if constexpr (N == 1) {
    return one_more();
  } else {
    return Buffers<N - 1, kResults>(one_more());
  }
}

template <size_t N, typename Binding>
auto Args(Binding&& binding) {
  return Buffers<N, false>(std::forward<Binding>(binding));
}

template <size_t N, typename Binding>
auto Rets(Binding&& binding) {
  return Buffers<N, true>(std::forward<Binding>(binding));
}

// `binding` followed by one attribute of type T per name, in order.
template <typename T, typename Binding, typename... Names>
auto Attrs(Binding&& binding, const char* name, Names... more) {
  if constexpr (sizeof...(more) == 0) {
    return std::move(binding).template Attr<T>(name);
  } else {
    return Attrs<T>(std::move(binding).template Attr<T>(name), more...);
  }
}

}  // namespace jqffi
