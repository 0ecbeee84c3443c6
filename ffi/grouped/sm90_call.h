// What the two CUTLASS Hopper grouped GEMM handlers (grouped_sm90.cu: FP8 operands,
// grouped_sm90_bf16.cu: bfloat16 operands) share: the reasons no instance can serve a problem
// that both check, the workspace check, the sm90::Problem they hand an instance, and the call.
// Host code without CUTLASS (the instances are their own translation units, sm90/).
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "grouped/grouped_params.h"
#include "grouped/sm90/sm90_gemm.h"
#include "buffer_checks.h"

namespace jqffi {

// An instance: "" on success, else what went wrong (sm90_gemm.h).
using Sm90Runner = std::string (*)(const sm90::Problem&, cudaStream_t);

// Why the output cannot be stored by TMA (16-byte rows: N a multiple of 8 bfloat16 or 4
// float32), "" when it can.
inline std::string sm90_output_reason(const GroupedGemm& p) {
  const int64_t out_align = p.out_kind == kOutF32 ? 4 : 8;
  if (p.N % out_align) return "N must be a multiple of " + std::to_string(out_align);
  return "";
}

// The reasons every instance shares, checked last: the group count and the device.
inline std::string sm90_device_reason(const GroupedGemm& p) {
  if (p.G >= (int64_t{1} << 24)) return "too many groups";
  return sm90::device_reason();
}

// The workspace result: uint8[>= need] bytes.
inline ffi::Error check_sm90_workspace(const char* t, const ffi::AnyBuffer& workspace,
                                       size_t need) {
  const auto dims = workspace.dimensions();
  if (workspace.element_type() != ffi::DataType::U8 || dims.size() != 1 ||
      dims[0] < static_cast<int64_t>(need)) {
    return invalid(t, "workspace must be uint8[>= " + std::to_string(need) + "]; got " +
                          dtype_name(workspace.element_type()) + dims_str(dims));
  }
  return ffi::Error::Success();
}

// The problem of `p` for an instance: shape, offsets, output, per-group alpha, configuration and
// workspace; the caller adds the operands.
inline sm90::Problem sm90_problem(const GroupedGemm& p, const float* alpha,
                                  ffi::AnyBuffer workspace, int32_t config, bool raster_along_n) {
  sm90::Problem q;
  q.mode = p.mode;
  q.G = p.G;
  q.L = p.L;
  q.M = p.M;
  q.N = p.N;
  q.K = p.K;
  q.pstarts = p.pstarts;
  q.alpha = alpha;
  q.out = p.out;
  q.out_kind = p.out_kind;
  q.workspace = workspace.untyped_data();
  q.workspace_bytes = static_cast<size_t>(workspace.dimensions()[0]);
  q.config = config;
  q.raster_along_n = raster_along_n;
  return q;
}

// Runs the instance (nothing to do for an empty problem); an internal error naming the target
// when it fails.
inline ffi::Error run_sm90(const char* t, Sm90Runner run, const sm90::Problem& q,
                           cudaStream_t stream) {
  if (q.L == 0 || q.N == 0 || q.M == 0) return ffi::Error::Success();
  const std::string err = run(q, stream);
  if (!err.empty()) return ffi::Error::Internal(std::string(t) + ": " + err);
  return ffi::Error::Success();
}

}  // namespace jqffi
