// The CUTLASS Hopper grouped FP8 GEMM (jaxquant_grouped_gemm_sm90): the plain-data problem the
// FFI handler (grouped_sm90.cu, no CUTLASS) hands to the kernel instances (sm90_kernel.cuh,
// one generated translation unit per (A, B, output) type triple), and the workspace contract.
//
// Workspace (an FFI result the caller allocates, `workspace_bytes(G)`): per-group problem
// shapes, operand pointers and strides written on the device by a setup kernel from `pstarts`
// (group offsets never leave the device), followed by CUTLASS's own workspace (the per-SM TMA
// descriptors of the pointer-array kernel).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace jqgrouped {
namespace sm90 {

enum : int { kE4M3 = 0, kE5M2 = 1 };     // operand element (jqgrouped::kElemE4M3 / kElemE5M2)
enum : int { kOutBF16 = 0, kOutF32 = 2 };  // output (jqgrouped::kOutBF16 / kOutF32)

struct Problem {
  int mode = 0;              // 0: ragged rows x experts (fprop / dgrad); 1: wgrad
  int64_t G = 0, L = 0, M = 0, N = 0, K = 0;
  const int32_t* pstarts = nullptr;  // [G + 1] group starts along the token axis (device)
  const uint8_t* a = nullptr;  // mode 0: [L, K]; mode 1: [M, L]
  const uint8_t* b = nullptr;  // mode 0: [G, N, K]; mode 1: [N, L]
  const float* alpha = nullptr;  // [G] per-group scale product, or nullptr (1)
  void* out = nullptr;           // mode 0: [L, N]; mode 1: [G, M, N]
  int a_elem = kE4M3, b_elem = kE4M3, out_kind = kOutBF16;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

// Bytes of the setup arrays per group (problem shape, 3 pointers, 3 strides, padded) and the
// bound on CUTLASS's workspace (per-SM TMA descriptors: 4 x 128 B per SM, far below 1 MiB).
constexpr size_t kPerGroupBytes = 128;
constexpr size_t kFixedBytes = 4096;
constexpr size_t kCutlassBytes = size_t(1) << 20;
inline size_t workspace_bytes(int64_t G) {
  return size_t(G) * kPerGroupBytes + kFixedBytes + kCutlassBytes;
}

// One kernel instance (explicitly instantiated in the generated sm90_inst_*.cu files): returns
// "" on success, else what went wrong (CUTLASS status or CUDA error).
template <int A, int B, int OUT>
std::string run_instance(const Problem& p, cudaStream_t stream);

}  // namespace sm90
}  // namespace jqgrouped
