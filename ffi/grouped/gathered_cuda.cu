// CUDA handlers of jaxquant_grouped_quantize_mxfp8 and _fp8_block: the single-tensor MXFP8 /
// Float8Block tile kernels (quantize/fp8_tiles.cuh) on the token layout gathered from x, read
// through the group offsets instead of from an XLA-gathered bfloat16 copy (issue 23: that copy
// was a full read and write of x or dy a step). Each tile row is a layout position: its group
// is found by a binary search of pstarts, once a row by one thread into shared memory before
// the tile's loads, then the row starts[g] + i of x is loaded, or zeros (padding, no group). The
// math and the outputs are the single-tensor kernel's for that [L, C] matrix, bit for bit. MXFP8
// may write its copies raw (`raw`: bfloat16 code x block scale, for the grouped GEMMs that
// read decoded operands), skipping the decode pass those GEMMs would otherwise run. Raw expert
// weights' rowwise copy may be written later over their columnwise one, in place
// (jaxquant_grouped_patch_mxfp8_rows, design decision 56).
// Group offsets stay on the device (no host sync, no allocation: command-buffer compatible).
#include <cuda_runtime.h>

#include <type_traits>
#include <vector>

#include "cuda_handler.h"
#include "grouped/grouped_amax.cuh"
#include "grouped/grouped_args.h"
#include "grouped/handlers.h"
#include "quantize/fp8_tiles.cuh"
#include "quantize/mxfp8_x_layout.cuh"

namespace jqffi {
namespace {

// The tile kernels' producer for a gathered token layout (quantize/tile.cuh's `Direct` reads x
// itself): position r holds row starts[g] + (r - pstarts[g]) of x while inside group g. The
// kernels read it through `prepare_tile` / `tile_reader` (below): each tile's source rows are
// found once. kPacked (row_packed): the rowwise codes of position r go to that source row of
// the packed copy `[T, C]` instead (none for padding), and positions starts[G] <= r < T also
// write packed row r as a row of no group (zeros); the columnwise copy keeps the layout.
template <typename In, bool kPacked = false>
struct GatheredRows {
  using Out = In;
  const In* x;
  int64_t T, C, L;
  bool vec;
  const int32_t* starts;
  const int32_t* pstarts;
  int G;

  // Position r's row of x, or -1 past L, in padding and past the groups (rows of x are int32,
  // as the offsets).
  __device__ __forceinline__ int32_t source(int64_t r) const {
    if (r >= L) return -1;
    const int g = upper_group(pstarts, G, r);
    if (g >= G) return -1;
    const int64_t local = r - __ldg(pstarts + g);
    return local < int64_t(__ldg(starts + g + 1)) - __ldg(starts + g) ? int32_t(__ldg(starts + g) + local) : -1;
  }
};

template <typename In, bool kPacked>
struct TileMinCtas<GatheredRows<In, kPacked>> : TileMinCtas<Direct<In>> {};

// The source rows of the CTA's tile (position r0 + i at [i]; -1: none), found by one thread a
// row (prepare_tile) and read by every thread of that row in the load phase and again where
// the packed rowwise copy is written. Session 21 (Nsight Compute, the 64-expert step's dy):
// each of a row's 16 threads searching the offsets in both places took ~900 of the kernel's
// ~3800 instructions a warp.
__shared__ int32_t tile_sources[FP8Tile<BF16>::TR];

template <typename In, bool kPacked>
__device__ __forceinline__ void prepare_tile(const GatheredRows<In, kPacked>& rows, int64_t r0) {
  static_assert(FP8Tile<In>::TR == FP8Tile<BF16>::TR && FP8Tile<In>::TR <= kThreads, "one row a thread");
  if (threadIdx.x < FP8Tile<In>::TR) tile_sources[threadIdx.x] = rows.source(r0 + threadIdx.x);
  __syncthreads();
}

// The reader of one tile's rows (r0 and on), from the table prepare_tile filled.
template <typename In, bool kPacked>
struct GatheredTile {
  using Out = In;
  const In* x;
  int64_t T, C, r0;
  bool vec;
  int64_t zero_from;  // kPacked: the first packed row of no group (starts[G])

  __device__ __forceinline__ int32_t source(int64_t r) const { return tile_sources[r - r0]; }

  // Position r's row, read as zeros where it has no source row.
  __device__ __forceinline__ void load8(int64_t r, int64_t c, In* out) const {
    const int32_t src = source(r);
    jqffi::load8(x, src >= 0 ? T : 0, C, src >= 0 ? src : 0, c, vec, out);  // R = 0: zeros
  }
};

template <typename In, bool kPacked>
__device__ __forceinline__ GatheredTile<In, kPacked> tile_reader(const GatheredRows<In, kPacked>& rows,
                                                                 int64_t r0) {
  return {rows.x, rows.T, rows.C, r0, rows.vec, kPacked ? int64_t(__ldg(rows.starts + rows.G)) : 0};
}

// The packed rowwise copy's rows (quantize/tile.cuh's `row_destination`).
template <typename In>
__device__ __forceinline__ RowDestination row_destination(const GatheredTile<In, true>& reader, int64_t r) {
  return {reader.source(r), r < reader.T && r >= reader.zero_from};
}

// Whether a launch writes MXFP8 raw expert weights' columnwise copy in their own layout.
inline bool in_x_layout(const Mxfp8Params& p) { return p.col_in_x_layout; }
inline bool in_x_layout(const Fp8BlockParams&) { return false; }
inline bool x_layout_flags(const Mxfp8Params& p) { return p.row_flags != nullptr; }
inline bool x_layout_flags(const Fp8BlockParams&) { return false; }

// kRaw: MXFP8 copies written as bfloat16 raw values (`Mxfp8Params::raw`).
template <bool kRaw, typename Args, typename Params>
ffi::Error quantize_gathered(const char* target, cudaStream_t stream, const Args& a,
                             const GroupedRows& rows, const Params& p) {
  JQ_RETURN_IF_ERROR(clear(stream, a.amax, 4));
  cudaError_t e = cudaSuccess;
  by_input_type(a.x.type, [&](auto tag) {
    using T = decltype(tag);
    const bool vec = aligned(a.x.data, 16) && rows.C % 8 == 0;
    if (p.expert_rows) {  // position r is row r: read x directly, not through the offsets
      const Direct<T> w{static_cast<const T*>(a.x.data), rows.T, rows.C, vec};
      if constexpr (kRaw && std::is_same_v<Params, Mxfp8Params> && std::is_same_v<T, BF16>) {
        if (in_x_layout(p)) {  // bfloat16 only (the handler checks)
          e = x_layout_flags(p)
                  ? launch_tiles(mxfp8_x_layout_kernel<Direct<T>, true>,
                                 num_tiles(p.R, p.C, 128, 128), 0, stream, p, w)
                  : launch_tiles(mxfp8_x_layout_kernel<Direct<T>>, num_tiles(p.R, p.C, 128, 128), 0, stream, p, w);
          return;
        }
      }
      e = launch_fp8_tiles<true, kRaw>(stream, p, w);
    } else if (rows.row_packed) {
      const GatheredRows<T, true> x{static_cast<const T*>(a.x.data), rows.T, rows.C, rows.L, vec,
                                    rows.starts, rows.pstarts, int(rows.G)};
      e = launch_fp8_tiles<false, kRaw>(stream, p, x);
    } else {
      const GatheredRows<T> x{static_cast<const T*>(a.x.data), rows.T, rows.C, rows.L, vec,
                              rows.starts, rows.pstarts, int(rows.G)};
      e = launch_fp8_tiles<false, kRaw>(stream, p, x);
    }
  });
  return launch_status(target, e);
}

ffi::Error GroupedQuantizeMxfp8Cuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer starts,
                                    ffi::AnyBuffer pstarts, ffi::RemainingRets rets, bool rowwise,
                                    bool columnwise, int64_t length, int64_t expert_rows,
                                    bool row_packed, bool raw, bool raw_e5m2,
                                    bool col_in_x_layout, bool row_flags) {
  const char* t = "jaxquant_grouped_quantize_mxfp8";
  Mxfp8Args a;
  GroupedRows rows;
  JQ_RETURN_IF_ERROR(decode_gathered_mxfp8(x, starts, pstarts, rets, rowwise, columnwise, length,
                                           expert_rows, row_packed, raw, raw_e5m2,
                                           col_in_x_layout, row_flags, &a, &rows));
  Mxfp8Params p = mxfp8_params(a, a.x.rows, a.x.cols);
  p.expert_rows = rows.expert_rows;
  return raw ? quantize_gathered<true>(t, stream, a, rows, p)
             : quantize_gathered<false>(t, stream, a, rows, p);
}

ffi::Error GroupedQuantizeFp8BlockCuda(cudaStream_t stream, ffi::AnyBuffer x,
                                       ffi::AnyBuffer starts, ffi::AnyBuffer pstarts,
                                       ffi::RemainingRets rets, bool rowwise, bool columnwise,
                                       bool block_2d, bool pow2_scale, float amax_epsilon,
                                       int64_t length, int64_t expert_rows, bool row_packed) {
  Fp8BlockArgs a;
  GroupedRows rows;
  JQ_RETURN_IF_ERROR(decode_gathered_fp8_block(x, starts, pstarts, rets, rowwise, columnwise,
                                               block_2d, pow2_scale, amax_epsilon, length,
                                               expert_rows, row_packed, &a, &rows));
  Fp8BlockParams p = fp8_block_params(a, a.x.rows, a.x.cols);
  p.expert_rows = rows.expert_rows;
  return quantize_gathered<false>("jaxquant_grouped_quantize_fp8_block", stream, a, rows, p);
}

// The rowwise copy written over the columnwise one in place (design decision 56): the flagged
// row blocks only (mxfp8_patch_rows_kernel, a grid-stride loop of a warp block's flags a thread).
ffi::Error GroupedPatchMxfp8RowsCuda(cudaStream_t stream, ffi::AnyBuffer w, ffi::AnyBuffer flags,
                                     ffi::AnyBuffer copy, ffi::AnyBuffer after,
                                     ffi::Result<ffi::AnyBuffer> out, bool raw_e5m2) {
  const char* t = "jaxquant_grouped_patch_mxfp8_rows";
  PatchRowsArgs a;
  JQ_RETURN_IF_ERROR(decode_patch_mxfp8_rows(w, flags, copy, out, raw_e5m2, &a));
  if (a.out != a.copy &&  // XLA aliases them; a copy keeps the contract if it did not
      cudaMemcpyAsync(a.out, a.copy, size_t(a.R * a.C) * 2, cudaMemcpyDeviceToDevice, stream) != cudaSuccess) {
    return launch_status("cudaMemcpyAsync");
  }
  const int64_t words = x_layout_flag_count(a.R, a.C) / 8;
  if (words == 0) return ffi::Error::Success();
  const unsigned blocks = unsigned(std::min<int64_t>(ceil_div(words, kThreads), 4096));
  mxfp8_patch_rows_kernel<<<blocks, kThreads, 0, stream>>>(a.w, reinterpret_cast<const uint2*>(a.flags),
                                                           a.out, a.R, a.C, a.fmt);
  return launch_status(t, cudaGetLastError());
}

}  // namespace

JQ_DEFINE_CUDA_HANDLER(kGroupedPatchMxfp8RowsCuda, GroupedPatchMxfp8RowsCuda,
                       BindGroupedPatchMxfp8Rows);
JQ_DEFINE_CUDA_HANDLER(kGroupedQuantizeMxfp8Cuda, GroupedQuantizeMxfp8Cuda,
                       BindGroupedQuantizeMxfp8);
JQ_DEFINE_CUDA_HANDLER(kGroupedQuantizeFp8BlockCuda, GroupedQuantizeFp8BlockCuda,
                       BindGroupedQuantizeFp8Block);

std::vector<Target> grouped_gathered_cuda_targets() {
  return {target("jaxquant_grouped_quantize_mxfp8", kGroupedQuantizeMxfp8Cuda),
          target("jaxquant_grouped_patch_mxfp8_rows", kGroupedPatchMxfp8RowsCuda),
          target("jaxquant_grouped_quantize_fp8_block", kGroupedQuantizeFp8BlockCuda)};
}

}  // namespace jqffi
