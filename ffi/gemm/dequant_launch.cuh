// Definition of launch_dequant_gemm<EA, EB>, included by the dequant_inst_*.cu files.
#pragma once

#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled

#include <atomic>
#include <mutex>

#include "gemm/dequant_kernel.cuh"
#include "gemm/dequant_launch.h"

namespace jqffi {
namespace dequant {

// cuTensorMapEncodeTiled through the runtime's driver entry point (no libcuda link needed).
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult status;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                         &status) == cudaSuccess &&
        status == cudaDriverEntryPointSuccess) {
      fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
    }
  });
  return fn;
}

// The payload of `op` as a 2-D uint8 tensor [rows, row_bytes], boxes of box_rows x box_bytes
// (one operand's share of a k-tile), zero fill outside.
inline bool encode_payload_map(CUtensorMap* map, const DequantOperand& op, uint32_t box_rows,
                               uint32_t box_bytes) {
  auto encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(op.row_bytes),
                              static_cast<cuuint64_t>(op.rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(op.row_bytes)};
  const cuuint32_t box[2] = {box_bytes, box_rows};
  const cuuint32_t elem_strides[2] = {1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<uint8_t*>(op.data), dims,
                strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace dequant

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
  CUtensorMap map_a, map_b;
  if (!dequant::encode_payload_map(&map_a, p.a, dequant::kBM, dequant::Traits<EA>::kRowBytes) ||
      !dequant::encode_payload_map(&map_b, p.b, dequant::kBN, dequant::Traits<EB>::kRowBytes)) {
    return cudaErrorInvalidValue;
  }
  const int tiles = ((p.M + dequant::kBM - 1) / dequant::kBM) *
                    ((p.N + dequant::kBN - 1) / dequant::kBN);
  kernel<<<tiles, dequant::kThreads, L::kSmemBytes, stream>>>(p, map_a, map_b);
  return cudaGetLastError();
}

}  // namespace jqffi

// The three instantiations with A payload EA (one dequant_inst_*.cu file each, compiled in
// parallel).
#define JQ_DEQUANT_INSTANTIATE_A(EA)                                                   \
  template cudaError_t jqffi::launch_dequant_gemm<EA, jqffi::Elem::kE4M3>(             \
      const jqffi::DequantParams&, cudaStream_t);                                      \
  template cudaError_t jqffi::launch_dequant_gemm<EA, jqffi::Elem::kE5M2>(             \
      const jqffi::DequantParams&, cudaStream_t);                                      \
  template cudaError_t jqffi::launch_dequant_gemm<EA, jqffi::Elem::kE2M1>(             \
      const jqffi::DequantParams&, cudaStream_t);
