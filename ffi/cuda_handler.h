// What the CUDA handlers of every target family share (host code compiled by nvcc): the
// platform stream their FFI signatures take as context, the handler definition, and CUDA errors
// as an ffi::Error that names the target.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "xla/ffi/api/ffi.h"

namespace jqffi {

// The context of a CUDA handler's signature: `BindX(ffi::Ffi::Bind().Ctx<Stream>())`.
using Stream = xla::ffi::PlatformStream<cudaStream_t>;

// Defines the XLA_FFI_Handler `name` running `impl` with the signature `signature(binding)`
// (the family's template for both platforms) after the stream context. A CUDA handler only
// enqueues work on that stream (no host sync, no allocation), so XLA may record it into a CUDA
// graph.
#define JQ_DEFINE_CUDA_HANDLER(name, impl, signature)                          \
  XLA_FFI_DEFINE_HANDLER(name, impl, signature(ffi::Ffi::Bind().Ctx<Stream>()), \
                         {ffi::Traits::kCmdBufferCompatible})

// "<target>: <what>: <CUDA's message>" as an internal error.
inline xla::ffi::Error cuda_error(const char* target, const char* what, cudaError_t e) {
  return xla::ffi::Error::Internal(std::string(target) + ": " + what + ": " +
                                   cudaGetErrorString(e));
}

// The outcome of a handler's launches: `e` when it is an error, else the last launch error
// (cudaGetLastError), else success.
inline xla::ffi::Error launch_status(const char* target, cudaError_t e = cudaSuccess) {
  if (e == cudaSuccess) e = cudaGetLastError();
  if (e != cudaSuccess) return cuda_error(target, "CUDA error", e);
  return xla::ffi::Error::Success();
}

}  // namespace jqffi
