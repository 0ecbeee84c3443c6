// The one launch sequence of every CUTLASS Hopper grouped GEMM instance (sm90_kernel.cuh:
// per-tensor FP8 and bfloat16; sm90_block_kernel.cuh: Float8Block). An instance differs from
// another only in its mainloop arguments and in the setup kernel that writes its per-group
// arrays into the workspace; the rest is here once: the epilogue (D = alpha[g] * acc, no C), the
// persistent scheduler's tile order, the workspace check, the setup launch, then CUTLASS's
// can_implement / initialize / run on the same stream. No host sync and no allocation (the
// workspace is an FFI result), so the handlers stay command-buffer compatible.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "cutlass/cutlass.h"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "grouped/sm90/sm90_gemm.h"

namespace jqgrouped {
namespace sm90 {

using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;  // (M, N, K)

inline size_t align256(size_t n) { return (n + 255) & ~size_t(255); }

// A group's start along the token axis, clamped to [0, L].
__device__ __forceinline__ int64_t clamp_start(const int32_t* pstarts, int64_t g, int64_t L) {
  const int64_t v = pstarts[g];
  return v < 0 ? 0 : v > L ? L : v;
}

inline int sm_count_of(int device) {
  static int cached[64] = {};
  if (device >= 0 && device < 64 && cached[device] > 0) return cached[device];
  int n = 0;
  cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device);
  if (device >= 0 && device < 64) cached[device] = n;
  return n;
}

// Blocks of a setup kernel: enough to zero-fill the untouched outputs at memory speed.
inline unsigned setup_blocks(int sm_count) {
  return unsigned(std::max(1, std::min(2 * sm_count, 1024)));
}

// The per-group arrays every instance's setup kernel writes (its own setup may add more):
// problem shapes, the output pointers and strides; `bytes` of workspace used before CUTLASS's.
template <class Gemm>
struct GroupArrays {
  typename ProblemShape::UnderlyingProblemShape* shapes;
  typename Gemm::GemmKernel::ElementD** ptr_d;
  typename Gemm::GemmKernel::InternalStrideD* stride_d;
  size_t bytes;
};

// Runs one grouped GEMM: `mainloop` holds the instance's operand pointers / strides (and scale
// arrays), all in the workspace; `launch_setup(blocks)` launches the instance's setup kernel,
// which fills them from the device-side group offsets. Returns "" or what went wrong.
template <class Gemm, class LaunchSetup>
std::string launch(const Problem& p, cudaStream_t stream, const GroupArrays<Gemm>& arrays,
                   const typename Gemm::GemmKernel::MainloopArguments& mainloop,
                   LaunchSetup launch_setup) {
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return cudaGetErrorString(e);

  typename Gemm::Arguments args;
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {int(p.G), arrays.shapes, nullptr};  // shapes live on the device only
  args.mainloop = mainloop;
  auto& fusion = args.epilogue.thread;
  fusion.alpha = 1.0f;
  fusion.beta = 0.0f;
  fusion.alpha_ptr = p.alpha;  // alpha[g] per group (stride 1 along groups) or the literal 1
  fusion.dAlpha = {cute::_0{}, cute::_0{}, p.alpha ? 1 : 0};
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = nullptr;
  args.epilogue.ptr_D = arrays.ptr_d;
  args.epilogue.dD = arrays.stride_d;
  args.hw_info.device_id = device;
  args.hw_info.sm_count = sm_count_of(device);
  // Along M (default): a group's B tile reused along its rows; along N on request.
  using Raster = decltype(args.scheduler.raster_order);
  args.scheduler.raster_order = p.raster_along_n ? Raster::AlongN : Raster::AlongM;

  const size_t need = arrays.bytes + Gemm::get_workspace_size(args);
  if (need > p.workspace_bytes) {
    return "workspace of " + std::to_string(p.workspace_bytes) + " bytes; this GEMM needs " +
           std::to_string(need);
  }
  launch_setup(setup_blocks(args.hw_info.sm_count));
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return cudaGetErrorString(e);

  Gemm gemm;
  cutlass::Status st = gemm.can_implement(args);
  if (st != cutlass::Status::kSuccess) {
    return std::string("CUTLASS can_implement: ") + cutlassGetStatusString(st);
  }
  st = gemm.initialize(args, static_cast<char*>(p.workspace) + arrays.bytes, stream);
  if (st != cutlass::Status::kSuccess) {
    return std::string("CUTLASS initialize: ") + cutlassGetStatusString(st);
  }
  st = gemm.run(stream);
  if (st != cutlass::Status::kSuccess) {
    return std::string("CUTLASS run: ") + cutlassGetStatusString(st);
  }
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return cudaGetErrorString(e);
  return "";
}

}  // namespace sm90
}  // namespace jqgrouped
