// CUDA handlers of the grouped FP8 quantize and the grouped amax (sm_90), one launch sequence
// for all groups whatever G:
//   jaxquant_grouped_quantize_fp8:
//   1. amax (current scaling only): grouped_amax_kernel (grouped_amax.cuh), an atomicMax of |x|
//      bits into amax[group] (NaN above inf, as the reference's segment max);
//   2. quantize: a CTA owns 128 token positions x 128 features of the output layout, on the
//      single-tensor FP8 kernels' tile (quantize/tile.cuh: all loads issued up front, a
//      swizzled tile in shared memory, 16-row chunks in the column phase). One thread a tile row
//      first finds its group and source row (or padding / no group: zeros) and its group's scale
//      (from the amax, or the delayed-scaling state); the rows are then loaded through that
//      mapping, the rowwise bytes written, and the columnwise bytes written transposed from the
//      tile (for expert weights the columnwise copy is [G, C, rows]). With `row_packed` the
//      rowwise bytes go to the source row of the packed layout instead (the rows of no group
//      as zeros), so a packed rowwise copy and a padded columnwise one come from one read of x.
//      Delayed scaling has its scales before the launch, so there is no amax pass: the load
//      phase (which runs for either copy and reads every element of every group's rows exactly
//      once, the layout holding each group's rows at its positions) also reduces each group's
//      amax, the state's history entry: the rows of the tile's first group reduced in the CTA
//      (one atomicMax a CTA), those of later groups by warp (warp_group_amax).
//   jaxquant_grouped_amax: the amax kernel alone.
//   jaxquant_grouped_amax_gated (the just-in-time first scale of delayed scaling): the amax
//   kernel, exiting at once unless some group's scale is still 0.
// Group offsets never leave the device: no host sync, no allocation, command-buffer compatible.
#include <cuda_runtime.h>

#include <type_traits>
#include <vector>

#include "cuda_handler.h"
#include "grouped/grouped_amax.cuh"
#include "grouped/grouped_args.h"
#include "grouped/handlers.h"
#include "quantize/tile.cuh"

namespace jqffi {
namespace {

__device__ __forceinline__ float group_scale(const QuantizeParams& p, int g, float fmax) {
  if (g >= p.G) return 1.0f;
  return p.delayed ? p.s[g] : jq::scale_from_amax(p.amax[g], fmax, p.pow2_scale, p.amax_epsilon);
}

// The tile loads' producer (quantize/tile.cuh's Fp8TileLoad): tile row r - r0 of the layout is
// source row src[r - r0] of x, or zeros (-1: padding, no group, past the layout).
template <typename In>
struct LayoutRows {
  using Out = In;
  const In* x;
  int64_t T, C;
  bool vec;
  const int64_t* src;  // shared, one per tile row
  int64_t r0;
  __device__ __forceinline__ void load8(int64_t r, int64_t c, In* out) const {
    const int64_t s = src[r - r0];
    jqffi::load8(x, s >= 0 ? T : 0, C, s >= 0 ? s : 0, c, vec, out);  // R = 0: zeros
  }
};

// What Fp8TileLoad reads off its parameters: the matrix width and whether a column phase runs.
struct TileShape {
  int64_t C;
  bool do_col;
  float* col_sums = nullptr;
};

constexpr int kSharedGroups = 512;

// One CTA a 128-position x 128-feature tile of the output layout, on the single-tensor FP8
// kernels' tile (quantize/tile.cuh: every load issued up front, a swizzled tile in shared
// memory, the column phase reading 16-row chunks): the tile rows' source rows, groups and
// scales are found first (one thread a row), then loaded through them.
template <typename In>
__global__ void __launch_bounds__(kThreads) grouped_quantize_kernel(const QuantizeParams p) {
  using G = FP8Tile<In>;
  __shared__ int64_t src[G::TR];
  __shared__ float scales[G::TR];
  __shared__ int groups[G::TR];  // -1: the row holds no token
  __shared__ uint32_t red[kThreads / 32];
  __shared__ int32_t bounds[2][kSharedGroups + 1];  // starts, pstarts
  const jq::Fp8 fmt = static_cast<jq::Fp8>(p.fmt);
  const float fmax = jq::spec_of(fmt).fmax;
  const int tid = threadIdx.x;
  const TileIndex t = tile_index(p.C, G::TR, G::TC);
  if (blockIdx.x == 0) {
    for (int g = tid; g < p.G; g += kThreads) p.scale_inv[g] = jq::rcp_f32(group_scale(p, g, fmax));
  }
  // The group starts in shared memory (up to kSharedGroups groups): one coalesced read instead
  // of a chain of dependent global reads per tile row before the tile's loads can start.
  // Expert weights need no search: row pos is expert pos / E's, at its own place.
  const bool shared_starts = p.expert_rows == 0 && p.G <= kSharedGroups;
  if (shared_starts) {
    for (int i = tid; i <= p.G; i += kThreads) {
      bounds[0][i] = __ldg(p.starts + i);
      bounds[1][i] = __ldg(p.pstarts + i);
    }
    __syncthreads();
  }
  if (tid < G::TR) {
    const int64_t pos = t.r0 + tid;
    int64_t row = -1;
    int g = int(p.G);
    if (pos < p.L && p.expert_rows > 0) {
      g = int(pos / p.expert_rows);
      row = pos;
    } else if (pos < p.L) {
      const int32_t* starts = shared_starts ? bounds[0] : p.starts;
      const int32_t* pstarts = shared_starts ? bounds[1] : p.pstarts;
      g = shared_starts ? upper_group_generic(pstarts, int(p.G), pos) : upper_group(pstarts, int(p.G), pos);
      if (g < p.G) {
        const int64_t local = pos - pstarts[g];
        if (local < int64_t(starts[g + 1]) - starts[g]) row = starts[g] + local;
      }
    }
    src[tid] = row;
    groups[tid] = row >= 0 ? g : -1;
    scales[tid] = group_scale(p, g, fmax);
  }
  __syncthreads();
  const LayoutRows<In> rows{static_cast<const In*>(p.x), p.T, p.C,
                            (reinterpret_cast<uintptr_t>(p.x) & 15) == 0 && p.C % 8 == 0, src, t.r0};
  Fp8TileLoad<LayoutRows<In>> ld(rows, TileShape{p.C, p.col != nullptr});
  const int tile_group = groups[0];
  const bool vec_row = (reinterpret_cast<uintptr_t>(p.row) & 7) == 0 && p.C % 8 == 0;
  const int64_t packed_rows = p.row_packed ? int64_t(__ldg(p.starts + p.G)) : 0;
  uint32_t mine = 0;  // delayed: max |bits| of this thread's rows of the tile's first group
#pragma unroll
  for (int pp = 0; pp < G::NP; ++pp) {
    float v[8];
    const uint32_t m = ld.pass(pp, v);
    const int lrow = pp * G::RPP + ld.lr;
    const int64_t r = ld.row(pp), c = ld.col();
    if (p.delayed) {  // the amax to record: rows of later groups by warp (warp-uniform call)
      const int g = groups[lrow];
      if (g == tile_group) mine = max(mine, m);
      warp_group_amax(p.amax, g == tile_group ? -1 : g, m);
    }
    if (p.row == nullptr || c >= p.C) continue;
    // The rowwise copy's row: the position, or in the packed layout (row_packed) the source row;
    // a packed row of no group (starts[G] <= r < T) is written as zeros by position r.
    const int64_t out_row = !p.row_packed ? (r < p.L ? r : -1) : src[lrow];
    const int n = int(min64(8, p.C - c));
    const float scale = scales[lrow];
    if (out_row >= 0) {
      store_bytes8(p.row + out_row * p.C + c, fp8_codes4(v, scale, fmt), fp8_codes4(v + 4, scale, fmt), n, vec_row);
    }
    if (p.row_packed && r < p.T && r >= packed_rows) store_bytes8(p.row + r * p.C + c, 0u, 0u, n, vec_row);
  }
  if (p.delayed) {  // the tile's first group: one atomic a CTA
    const uint32_t m = cta_max(mine, red);
    if (tid == 0 && tile_group >= 0 && m != 0u) atomicMax(reinterpret_cast<uint32_t*>(p.amax) + tile_group, m);
  }
  if (p.col == nullptr) return;
  __syncthreads();
  const bool vec_col = (reinterpret_cast<uintptr_t>(p.col) & 15) == 0;
#pragma unroll
  for (int it = 0; it < G::ITERS; ++it) {
    const Fp8TileColumn<G> chunk(ld.tile, ld.t, it, p.C, nullptr);
    if (chunk.c >= p.C || chunk.rr >= p.L) continue;
    const int r_local = 16 * chunk.slot.j;
    float w[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) w[i] = chunk.w[i] * scales[r_local + i];  // the rowwise products
    uint32_t q[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) q[k] = fp8_codes4(w + 4 * k, 1.0f, fmt);  // x 1: exact
    const int n = int(min64(16, p.L - chunk.rr));
    if (p.expert_rows == 0) {
      store_bytes16(p.col + chunk.c * p.L + chunk.rr, q, n, vec_col && p.L % 16 == 0);
    } else {  // expert weights: [G, C, E]
      const int64_t E = p.expert_rows, e = chunk.rr / E, local = chunk.rr % E;
      if (local + 16 <= E) {
        store_bytes16(p.col + (e * p.C + chunk.c) * E + local, q, n, vec_col && E % 16 == 0);
      } else {
        for (int i = 0; i < n; ++i) {
          const int64_t pi = chunk.rr + i;
          p.col[((pi / E) * p.C + chunk.c) * E + pi % E] = uint8_t(q[i / 4] >> (8 * (i % 4)));
        }
      }
    }
  }
}

constexpr const char* kQuantizeTarget = "jaxquant_grouped_quantize_fp8";

ffi::Error GroupedQuantizeFp8Cuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer starts,
                                  ffi::AnyBuffer pstarts, ffi::AnyBuffer s, ffi::RemainingRets rets,
                                  bool rowwise, bool columnwise, bool delayed, bool pow2_scale,
                                  bool row_packed, float amax_epsilon, int64_t length,
                                  int64_t expert_rows) {
  const char* t = kQuantizeTarget;
  QuantizeParams p;
  JQ_RETURN_IF_ERROR(decode_grouped_quantize_fp8(t, x, starts, pstarts, s, rets, rowwise,
                                                 columnwise, delayed, pow2_scale, row_packed,
                                                 amax_epsilon, length, expert_rows, &p));
  if (cudaError_t e = cudaMemsetAsync(p.amax, 0, 4 * p.G, stream); e != cudaSuccess) {
    return launch_status(t, e);
  }
  cudaError_t e = cudaSuccess;
  by_type(p.in_type, [&](auto tag) {
    constexpr int TYPE = decltype(tag)::value;
    using In = std::conditional_t<TYPE == 0, BF16, std::conditional_t<TYPE == 1, F16, float>>;
    using G = FP8Tile<In>;
    if (!p.delayed) grouped_amax_kernel<TYPE><<<amax_grid(p.T), 256, 0, stream>>>(p);
    e = launch_tiles(grouped_quantize_kernel<In>, num_tiles(p.L, p.C, G::TR, G::TC),
                     p.col != nullptr ? G::kSmemBytes : 0, stream, p);
  });
  return launch_status(t, e);
}

// The amax pass of jaxquant_grouped_amax(_gated): clears amax[G], then one launch.
ffi::Error amax_pass(const char* t, const QuantizeParams& p, cudaStream_t stream) {
  if (cudaError_t e = cudaMemsetAsync(p.amax, 0, 4 * p.G, stream); e != cudaSuccess) {
    return launch_status(t, e);
  }
  by_type(p.in_type, [&](auto tag) {
    grouped_amax_kernel<decltype(tag)::value><<<amax_grid(p.T), 256, 0, stream>>>(p);
  });
  return launch_status(t);
}

ffi::Error GroupedAmaxCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer starts,
                           ffi::Result<ffi::AnyBuffer> amax) {
  const char* t = "jaxquant_grouped_amax";
  QuantizeParams p;
  JQ_RETURN_IF_ERROR(decode_grouped_amax(t, x, starts, amax, &p));
  return amax_pass(t, p, stream);
}

ffi::Error GroupedAmaxGatedCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer starts,
                                ffi::AnyBuffer gate, ffi::Result<ffi::AnyBuffer> amax) {
  const char* t = "jaxquant_grouped_amax_gated";
  QuantizeParams p;
  JQ_RETURN_IF_ERROR(decode_grouped_amax_gated(t, x, starts, gate, amax, &p));
  return amax_pass(t, p, stream);
}

}  // namespace

JQ_DEFINE_CUDA_HANDLER(kGroupedQuantizeFp8Cuda, GroupedQuantizeFp8Cuda, BindGroupedQuantizeFp8);
JQ_DEFINE_CUDA_HANDLER(kGroupedAmaxCuda, GroupedAmaxCuda, BindGroupedAmax);
JQ_DEFINE_CUDA_HANDLER(kGroupedAmaxGatedCuda, GroupedAmaxGatedCuda, BindGroupedAmaxGated);

std::vector<Target> grouped_quantize_cuda_targets() {
  return {target(kQuantizeTarget, kGroupedQuantizeFp8Cuda),
          target("jaxquant_grouped_amax", kGroupedAmaxCuda),
          target("jaxquant_grouped_amax_gated", kGroupedAmaxGatedCuda)};
}

}  // namespace jqffi
