// Definition of launch_dequant_gemm<EA, EB>, included by the dequant_inst_*.cu files.
#pragma once

#include <atomic>

#include "gemm/dequant_kernel.cuh"
#include "gemm/dequant_launch.h"

namespace jaxquant_gemm {

template <Elem EA, Elem EB>
cudaError_t launch_dequant_gemm(const DequantParams& p, cudaStream_t stream) {
  using L = dequant::Layout<EA, EB>;
  auto kernel = dequant::dequant_gemm_kernel<EA, EB>;
  // The dynamic shared-memory limit is a per-device function attribute: set it once per device.
  static std::atomic<uint64_t> configured{0};
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  const uint64_t bit = uint64_t(1) << (device & 63);
  if (!(configured.load(std::memory_order_acquire) & bit)) {
    if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             L::kSmemBytes);
        e != cudaSuccess) {
      return e;
    }
    configured.fetch_or(bit, std::memory_order_release);
  }
  const int tiles = ((p.M + dequant::kBM - 1) / dequant::kBM) *
                    ((p.N + dequant::kBN - 1) / dequant::kBN);
  kernel<<<tiles, dequant::kThreads, L::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace jaxquant_gemm
