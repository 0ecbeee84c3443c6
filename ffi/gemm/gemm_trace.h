// JAXQUANT_GEMM_TRACE for the GEMM targets' CUDA handlers: "1" prints one stderr line per
// handler call (target, shape, whether the FFI stream is being captured into a CUDA graph, and
// for cuBLASLt the heuristic rank of the algorithm in use) plus one line per autotuned plan
// (each candidate's time); "autotune" the autotuning lines only. For tests (did XLA record the
// call into a command buffer?), benchmarks and debugging.
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>
#include <string>

namespace jqffi {

// 0 off, 1 autotuning lines, 2 call lines too (read once per process).
inline int gemm_trace_level() {
  static const int level = [] {
    const char* v = std::getenv("JAXQUANT_GEMM_TRACE");
    const std::string s = v ? v : "";
    return s == "1" ? 2 : (s == "autotune" ? 1 : 0);
  }();
  return level;
}

inline bool gemm_trace_calls() { return gemm_trace_level() >= 2; }

// "yes" while `stream` is being captured into a CUDA graph, "no" otherwise.
inline const char* capture_state(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) return "unknown";
  return status == cudaStreamCaptureStatusNone ? "no" : "yes";
}

}  // namespace jqffi
