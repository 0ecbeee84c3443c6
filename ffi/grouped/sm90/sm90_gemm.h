// The CUTLASS Hopper grouped GEMMs (jaxquant_grouped_gemm_sm90 for FP8 operands,
// jaxquant_grouped_gemm_bf16 for bfloat16 ones): the plain-data problem the FFI handlers
// (grouped_sm90.cu, grouped_sm90_bf16.cu; no CUTLASS) hand to the kernel instances, and the
// workspace contract. An instance is sm90_instance.cuh's CUTLASS kernel for one operand policy
// (sm90_kernel.cuh: per-tensor FP8 and bfloat16, one generated translation unit per (A, B,
// output, configuration, layout); sm90_block_kernel.cuh: Float8Block, one per (B scale
// granularity, output, configuration)), run by sm90_launch.cuh.
//
// Workspace (an FFI result the caller allocates, `workspace_bytes(G, block_scale_floats(...))`):
// per-group problem shapes, operand pointers and strides written on the device by a setup
// kernel from `pstarts` (group offsets never leave the device), for Float8Block the block scales
// repacked into the per-group layout CUTLASS reads, then CUTLASS's own workspace (the per-SM
// TMA descriptors of the pointer-array kernel).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "gemm/gemm_types.h"  // kOutBF16, kOutF32: the instances' output types

namespace jqffi {
namespace sm90 {

// Operand element (Elem::kE4M3 / kE5M2; bfloat16 for the bf16 target).
enum : int { kE4M3 = 0, kE5M2 = 1, kBF16 = 2 };
// Float8Block B operand: one float32 scale per 1 x 128 (row, K) block or per 128 x 128 tile.
enum : int { kBlockRows1 = 1, kBlockRows128 = 128 };
constexpr int64_t kBlockK = 128;  // Float8Block scale block along the contraction

// Kernel configurations (tile, cluster, schedule, accumulation), selected per call by the
// handler's `config` attribute. kCfgDefault has an instance for every type; the others are
// alternatives to measure (bench/grouped.py --sm90-configs) with instances only where listed
// (sm90.cmake). The names and the instance table are mirrored in
// jaxquant/backends/ffi/grouped/sm90_configs.py.
enum : int {
  kCfgDefault = 0,       // 128x128x128, cluster 1x2, cooperative, FP8 float32 promotion
  kCfgC1x1 = 1,          // 128x128x128, cluster 1x1, cooperative (per-tensor and Float8Block)
  kCfgN176 = 2,          // 128x176x128, cluster 1x1, cooperative (per-tensor)
  kCfgFast = 3,          // 128x128x128, cluster 1x1, cooperative, fast accumulation (per-tensor)
  kCfgPingpongFast = 4,  // 128x128x128, cluster 1x1, pingpong, fast accumulation (per-tensor)
  kCfgC2x1 = 5,          // 128x128x128, cluster 2x1, cooperative (Float8Block, per-tensor)
  // bfloat16 operands (no FP8 promotion; 64-deep k-tiles, 128 bytes of a bf16 row):
  kCfgBf16 = 6,          // 128x256x64, cluster 1x2, cooperative (the bf16 default)
  kCfgBf16C2x1 = 7,      // 128x256x64, cluster 2x1, cooperative
  kCfgBf16Pingpong = 8,  // 64x128x128, cluster 1x1, pingpong (small groups)
  kCfgBf16M256 = 9,      // 256x128x64, cluster 2x1, cooperative (N a multiple of 128, not 256)
  // The wgrad of layout NT (mode 1) only: kCfgBf16M256's tile on CUTLASS's batched kernel, one
  // TMA descriptor per operand, the group as the batch coordinate (sm90_kgrouped.cuh).
  kCfgKGrouped = 10,     // 256x128x64, cluster 2x1, cooperative, k-grouped
  // The same for per-tensor FP8 wgrads (layout TN, float32 promotion): kCfgC2x1's tile.
  kCfgKGroupedFp8 = 11,  // 128x128x128, cluster 2x1, cooperative, k-grouped
  kCfgBf16N128 = 12,     // 128x128x64, cluster 1x1, cooperative (no column or cluster padding)
  // The bfloat16 k-grouped wgrad (layouts NT and TN) on the pingpong schedule: each consumer
  // warpgroup its own 128x128 tiles, one's epilogue under the other's k-loop
  // (sm90_kgrouped_pingpong.cuh).
  kCfgKGroupedPingpong = 13,  // 128x128x64, cluster 2x1, pingpong, k-grouped
  kCfgBf16N176 = 14,     // 128x176x64, cluster 1x2, cooperative (N = 1408: 8 whole tiles)
  // Per-tensor FP8 forward GEMMs with fast accumulation (the dense FP8 forward's convention):
  // no promotion set, so a consumer warpgroup's 64 x 256 float32 accumulator (128 registers)
  // fits a 128 x 256 tile.
  kCfgWideFast = 15,     // 128x256x128, cluster 1x2, cooperative, fast accumulation (per-tensor)
};

// Operand layouts of the bf16 instances (which operand runs contiguously along the contraction
// K, "K-major", or along its M / N axis). FP8 instances are TN only (FP8 wgmma reads K-major
// shared memory only).
//   kLayoutTN: A [.., K] and B [N, K] K-major: fprop / dgrad of quantized (decoded) operands,
//     the no-recipe dgrad (B = the kernel [G, K, N] read as [N_out = K, K_c = N]), the wgrad of
//     transposed (columnwise) copies;
//   kLayoutNN: A K-major, B [K, N] N-major: the no-recipe forward (B = the kernel [G, K, N]);
//   kLayoutNT: A [K, M] and B [K, N] both M/N-major: the no-recipe wgrad, whose operands are
//     the tokens x [T, M] and dy [T, N] themselves (contraction over each group's tokens).
enum : int { kLayoutTN = 0, kLayoutNN = 1, kLayoutNT = 2 };
__host__ __device__ constexpr bool a_k_major(int layout) { return layout != kLayoutNT; }
__host__ __device__ constexpr bool b_k_major(int layout) { return layout == kLayoutTN; }

// Epilogues: D = alpha[g] * acc (kEpiAlpha, every instance), or (alpha[g] * acc) * row_scale[m]
// (kEpiRowScale, mode 0: the per-token factors of row-scaled NVFP4 tokens, in float32 before
// the one rounding to D, the order XLA applied them to a float32 output before).
enum : int { kEpiAlpha = 0, kEpiRowScale = 1 };

struct Problem {
  int mode = 0;              // 0: ragged rows x experts (fprop / dgrad); 1: wgrad
  int64_t G = 0, L = 0, M = 0, N = 0, K = 0;
  const int32_t* pstarts = nullptr;  // [G + 1] group starts along the token axis (device)
  // Operands as bytes (FP8: one a value; bf16: two). K-major (layout kLayoutTN):
  //   mode 0: a [L, K], b [G, N, K]; mode 1: a [M, L], b [N, L].
  // N-major b (kLayoutNN, mode 0): b [G, K, N]. M/N-major a and b (kLayoutNT, mode 1): a [L, M],
  // b [L, N].
  const uint8_t* a = nullptr;
  const uint8_t* b = nullptr;
  int layout = kLayoutTN;
  const float* alpha = nullptr;  // [G] per-group scale product, or nullptr (1)
  const float* row_scale = nullptr;  // kEpiRowScale instances: [L] per-row factor (mode 0)
  void* out = nullptr;           // mode 0: [L, N]; mode 1: [G, M, N]
  int a_elem = kE4M3, b_elem = kE4M3, out_kind = kOutBF16;
  // Float8Block operands (block_scaled): float32 scales as jaxquant stores them, row-major.
  // a: 1 x 128 blocks, mode 0 [L, ceil(K/128)], mode 1 [M, L/128] (blocks along the tokens);
  // b: mode 0 [G, N / b_block_rows (ceil), ceil(K/128)], mode 1 [N, L/128] (b_block_rows 1).
  bool block_scaled = false;
  const float* a_scale = nullptr;
  const float* b_scale = nullptr;
  int b_block_rows = kBlockRows1;
  int config = kCfgDefault;     // which instance (kCfg*)
  bool raster_along_n = false;  // tile order: along N (a tile of A reused) instead of along M
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

// Bytes of the setup arrays per group (problem shape, 3 pointers, 3 strides; for Float8Block
// also 2 scale pointers and 2 scale layouts; padded), the slack for aligning each array to 256
// bytes, and the bound on CUTLASS's workspace (per-SM TMA descriptors: 4 x 128 B per SM, far
// below 1 MiB).
constexpr size_t kPerGroupBytes = 128;
constexpr size_t kFixedBytes = 4096;
constexpr size_t kCutlassBytes = size_t(1) << 20;
__host__ __device__ inline int64_t div_up(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Floats of the repacked Float8Block scales in the workspace (0 for per-tensor FP8): every
// scale of A and B once, in CUTLASS's per-group M/N-major order.
inline size_t block_scale_floats(int mode, bool block_scaled, int64_t G, int64_t L, int64_t M,
                                 int64_t N, int64_t K, int b_block_rows) {
  if (!block_scaled) return 0;
  if (mode == 0) {
    const int64_t kb = div_up(K, kBlockK);
    return size_t(L * kb + G * div_up(N, b_block_rows) * kb);
  }
  return size_t((M + N) * div_up(L, kBlockK));
}

inline size_t workspace_bytes(int64_t G, size_t scale_floats = 0) {
  return size_t(G) * kPerGroupBytes + kFixedBytes + scale_floats * sizeof(float) + kCutlassBytes;
}

// Why this device cannot run the sm_90a instances ("" when it can).
inline std::string device_reason() {
  int device = 0, major = 0, minor = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  if (major == 9 && minor == 0) return "";
  return "the device is sm_" + std::to_string(10 * major + minor) + "; the kernel is sm_90a";
}

// One kernel instance (sm90_kernel.cuh; explicitly instantiated in the generated sm90_inst_*.cu
// files): returns "" on success, else what went wrong (CUTLASS status or CUDA error). A, B:
// kE4M3 / kE5M2 with LAYOUT kLayoutTN, or kBF16 x kBF16 with any layout; OUT kOutBF16 / kOutF32;
// EPI kEpiAlpha, or kEpiRowScale (bfloat16 TN instances, mode 0).
template <int A, int B, int OUT, int CFG = kCfgDefault, int LAYOUT = kLayoutTN,
          int EPI = kEpiAlpha>
std::string run_instance(const Problem& p, cudaStream_t stream);

// One Float8Block instance (sm90_block_kernel.cuh; E4M3 x E4M3, A 1 x 128 blocks, B
// `B_ROWS` x 128), explicitly instantiated in the generated sm90_block_inst_*.cu files.
template <int B_ROWS, int OUT, int CFG = kCfgDefault>
std::string run_block_instance(const Problem& p, cudaStream_t stream);

}  // namespace sm90
}  // namespace jqffi
