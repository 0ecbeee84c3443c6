// CUDA handler of jaxquant_gemm_dequant: the in-kernel-dequantize wgmma kernel
// (dequant_kernel.cuh, sm_90a; one instantiation per (A, B) payload type in dequant_inst_*.cu).
//
// CUDA graphs (kCmdBufferCompatible): a call only enqueues the kernel on the FFI stream; the
// shared-memory attribute is set once per device and the tensor maps are __grid_constant__
// kernel parameters, so nothing is allocated or synchronized.
#include <cuda_runtime.h>

#include <cstdio>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>

#include "cuda_handler.h"
#include "gemm/dequant_launch.h"
#include "gemm/gemm_args.h"
#include "gemm/gemm_trace.h"
#include "gemm/handlers.h"

namespace jqffi {
namespace {

constexpr const char* kTarget = "jaxquant_gemm_dequant";

// Compute capability of the current device (cached per device ordinal).
ffi::Error device_capability(int* major, int* minor) {
  static std::mutex mu;
  static std::unordered_map<int, std::pair<int, int>> cache;
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) {
    return cuda_error(kTarget, "cudaGetDevice", e);
  }
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(device);
  if (it == cache.end()) {
    int mj = 0, mn = 0;
    cudaDeviceGetAttribute(&mj, cudaDevAttrComputeCapabilityMajor, device);
    cudaDeviceGetAttribute(&mn, cudaDevAttrComputeCapabilityMinor, device);
    it = cache.emplace(device, std::make_pair(mj, mn)).first;
  }
  *major = it->second.first;
  *minor = it->second.second;
  return ffi::Error::Success();
}

template <Elem EA>
cudaError_t launch_for_b(const DequantParams& p, cudaStream_t s) {
  switch (p.b.elem) {
    case Elem::kE4M3: return launch_dequant_gemm<EA, Elem::kE4M3>(p, s);
    case Elem::kE5M2: return launch_dequant_gemm<EA, Elem::kE5M2>(p, s);
    default: return launch_dequant_gemm<EA, Elem::kE2M1>(p, s);
  }
}

ffi::Error DequantGemmCuda(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer a_scale,
                           ffi::AnyBuffer a_factor, ffi::AnyBuffer b, ffi::AnyBuffer b_scale,
                           ffi::AnyBuffer b_factor, ffi::AnyBuffer bias,
                           ffi::Result<ffi::AnyBuffer> out, int64_t k, int64_t a_scale_tile_rows,
                           int64_t b_scale_tile_rows) {
  DequantParams p;
  JQ_RETURN_IF_ERROR(decode_dequant_gemm(kTarget, a, a_scale, a_factor, b, b_scale, b_factor, bias,
                                         *out, k, a_scale_tile_rows, b_scale_tile_rows, &p));
  int major = 0, minor = 0;
  JQ_RETURN_IF_ERROR(device_capability(&major, &minor));
  if (major != 9 || minor != 0) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      std::string(kTarget) + ": the kernel is built for sm_90a (Hopper) only; "
                      "this device is sm_" + std::to_string(major) + std::to_string(minor) +
                      " (use the dequant-bf16 path)");
  }
  cudaError_t e;
  switch (p.a.elem) {
    case Elem::kE4M3: e = launch_for_b<Elem::kE4M3>(p, stream); break;
    case Elem::kE5M2: e = launch_for_b<Elem::kE5M2>(p, stream); break;
    default: e = launch_for_b<Elem::kE2M1>(p, stream); break;
  }
  if (e != cudaSuccess) return cuda_error(kTarget, "kernel launch", e);
  if (gemm_trace_calls()) {
    std::fprintf(stderr, "[jaxquant gemm] %s M=%d N=%d K=%d capturing=%s\n", kTarget, p.M, p.N,
                 p.K, capture_state(stream));
  }
  return ffi::Error::Success();
}

}  // namespace

JQ_DEFINE_CUDA_HANDLER(kDequantGemmCuda, DequantGemmCuda, BindGemmDequant);

std::vector<Target> gemm_dequant_cuda_targets() { return {target(kTarget, kDequantGemmCuda)}; }

}  // namespace jqffi
