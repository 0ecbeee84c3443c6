// CUDA handler of jaxquant_grouped_quantize_nvfp4: NVFP4 tokens (or expert weights) with one
// second-level scale per group, in at most three launches for all groups, whatever G:
//   1. amax: `launch_grouped_amax` (the rowwise copy's, and the columnwise copy's without RHT),
//      `grouped_rht_amax_kernel` (the columnwise copy's after the RHT; with a rowwise copy too,
//      both amaxes from its one read of x);
//   2. quantize: the single-tensor NVFP4 tile kernel (quantize/nvfp4.cuh) instantiated for a
//      token layout (`nvfp4_kernel<In, true>`): each tile row is a layout position that reads its
//      source row of x (or zeros), takes its group's second-level scale and stochastic-rounding
//      words, and rounds at its index within the group; the math is the single-tensor kernel's.
//      With `raw` (design decision 53) every copy is written as bfloat16 code x block scale.
// Group offsets stay on the device (no host sync, no allocation: command-buffer compatible).
#include <cuda_runtime.h>

#include <type_traits>
#include <vector>

#include "cuda_handler.h"
#include "grouped/grouped_amax.cuh"
#include "grouped/grouped_args.h"
#include "grouped/handlers.h"
#include "quantize/nvfp4.cuh"

namespace jqffi {
namespace {

constexpr const char* kTarget = "jaxquant_grouped_quantize_nvfp4";

// The per-group amaxes: plain for the rowwise copy (and a columnwise one without RHT, copied),
// after the RHT for an rht columnwise copy; both copies with RHT: one launch for the two.
cudaError_t group_amaxes(const Nvfp4QuantizeParams& n, cudaStream_t stream) {
  QuantizeParams p;
  static_cast<GroupedRows&>(p) = n;
  for (float* a : {n.row_amax, n.col_amax}) {
    if (a == nullptr) continue;
    if (cudaError_t e = cudaMemsetAsync(a, 0, 4 * n.G, stream); e != cudaSuccess) return e;
  }
  const bool plain_col = n.columnwise && !n.rht;
  by_type(n.in_type, [&](auto tag) {
    constexpr int TYPE = decltype(tag)::value;
    if (n.columnwise && n.rht && n.rowwise) {
      p.amax = n.col_amax;
      grouped_rht_amax_kernel<TYPE, true><<<unsigned(n.L / 16), 256, 0, stream>>>(p, n.row_amax);
      return;
    }
    if (n.rowwise || plain_col) {
      p.amax = n.rowwise ? n.row_amax : n.col_amax;
      launch_grouped_amax<TYPE>(p, stream);
    }
    if (n.columnwise && n.rht) {
      p.amax = n.col_amax;
      grouped_rht_amax_kernel<TYPE><<<unsigned(n.L / 16), 256, 0, stream>>>(p);
    }
  });
  if (n.rowwise && plain_col) {
    return cudaMemcpyAsync(n.col_amax, n.row_amax, 4 * n.G, cudaMemcpyDeviceToDevice, stream);
  }
  return cudaGetLastError();
}

ffi::Error GroupedQuantizeNvfp4Cuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer starts,
                                    ffi::AnyBuffer pstarts, ffi::AnyBuffer row_key, ffi::AnyBuffer col_key,
                                    ffi::RemainingRets rets, bool rowwise, bool columnwise, bool block_2d,
                                    bool rht, bool stochastic, int64_t length, int64_t expert_rows,
                                    bool raw, bool row_packed) {
  Nvfp4QuantizeParams n;
  JQ_RETURN_IF_ERROR(decode_grouped_quantize_nvfp4(kTarget, x, starts, pstarts, row_key, col_key,
                                                   rets, rowwise, columnwise, block_2d, rht,
                                                   stochastic, length, expert_rows, raw,
                                                   row_packed, &n));
  if (cudaError_t e = group_amaxes(n, stream); e != cudaSuccess) return launch_status(kTarget, e);
  Nvfp4Params p{n.x, n.L, n.C,
                aligned(n.x, 16) && n.C % 8 == 0,
                rowwise && aligned(n.row, raw ? 16 : 4) && n.C % 8 == 0,
                columnwise && aligned(n.col, raw ? 16 : 8) && (expert_rows > 0 ? expert_rows : n.L) % 16 == 0,
                rowwise, columnwise, /*row_scaled=*/false, block_2d, rht, stochastic,
                n.row_amax, n.col_amax, n.row_key, n.col_key, n.row, n.row_scale, n.col, n.col_scale};
  // A packed layout (expert weights; tokens of a 1x16 copy whose layout is as long as x) reads
  // row `pos` while it looks the groups up; any other layout looks up first.
  const bool speculate = expert_rows > 0 || (!columnwise && !block_2d && n.L == n.T);
  p.groups = {n.starts, n.pstarts, n.G, n.T, n.expert_rows, speculate, row_packed};
  p.raw = raw;
  cudaError_t e = cudaSuccess;
  by_type(n.in_type, [&](auto tag) {  // 0 bf16, 1 f16, 2 f32 (In)
    constexpr int TYPE = decltype(tag)::value;
    using T = std::conditional_t<TYPE == 0, BF16, std::conditional_t<TYPE == 1, F16, float>>;
    using G = NVFP4Tile<T>;
    e = launch_tiles(nvfp4_kernel<T, true>, num_tiles(n.L, n.C, G::TR, G::TC),
                     columnwise ? G::kSmemBytes : 0, stream, p);
  });
  return launch_status(kTarget, e);
}

}  // namespace

JQ_DEFINE_CUDA_HANDLER(kGroupedQuantizeNvfp4Cuda, GroupedQuantizeNvfp4Cuda,
                       BindGroupedQuantizeNvfp4);

std::vector<Target> grouped_nvfp4_cuda_targets() {
  return {target(kTarget, kGroupedQuantizeNvfp4Cuda)};
}

}  // namespace jqffi
