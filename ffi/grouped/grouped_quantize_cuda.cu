// CUDA handlers of the grouped FP8 quantize and the grouped amax (sm_90), one launch sequence
// for all groups whatever G:
//   jaxquant_grouped_quantize_fp8:
//   1. amax (current scaling only): launch_grouped_amax (grouped_amax.cuh), an atomicMax of |x|
//      bits into amax[group] (NaN above inf, as the reference's segment max);
//   2. quantize: a CTA owns 128 token positions x 128 features of the output layout; each position
//      finds its group and source row (or is padding / no group: code 0), scales by its group's
//      scale (from the amax, or the delayed-scaling state), writes the rowwise bytes, keeps the
//      codes in shared memory and writes them transposed as the columnwise bytes (both copies
//      scale a position by its group's scale, so their codes are the same; for expert weights
//      the columnwise copy is [G, C, rows]). With `row_packed` the rowwise bytes go to
//      the source row of the packed layout instead (the rows of no group as zeros), so a packed
//      rowwise copy and a padded columnwise one come from one read of x. Delayed scaling has its scales before the
//      launch, so there is no amax pass: the load phase (which runs for either copy and reads
//      every element of every group's rows exactly once, the layout holding each group's rows
//      at its positions) also reduces each group's amax, the state's history entry: each row's
//      16 lanes into a shared word, then after the barrier the columnwise phase needs anyway
//      one lane a row, a warp of one group's rows with one atomicMax (a warp across a group
//      boundary by lane; no barrier of its own).
//   jaxquant_grouped_amax: the amax kernel alone.
//   jaxquant_grouped_amax_gated (the just-in-time first scale of delayed scaling): the amax
//   kernel, exiting at once unless some group's scale is still 0.
// Group offsets never leave the device: no host sync, no allocation, command-buffer compatible.
#include <cuda_runtime.h>

#include <vector>

#include "cuda_handler.h"
#include "grouped/grouped_amax.cuh"
#include "grouped/grouped_args.h"
#include "grouped/handlers.h"
#include "quantize/tile.cuh"  // store_bytes8

namespace jqffi {
namespace {

// A quantize CTA: 128 token positions x 128 features of the output layout, 256 threads. In the
// load phase a thread holds 8 consecutive features of one row per pass (16 rows a pass, 8
// passes) and issues a batch of passes' loads before using any: 128 bytes of x in flight a
// thread (the earlier 64 x 64 tile's 32 bytes a thread left the kernel latency-bound at
// ~2.3 TB/s, Nsight Compute in bench/RESULTS.md). A tile row is 32 words of FP8 codes, padded
// to 33 (conflict-free column loads).
constexpr int kQP = 128, kQC = 128;
constexpr int kRowsPerPass = 256 / (kQC / 8), kPasses = kQP / kRowsPerPass;
constexpr int kTileWords = kQC / 4 + 1;

__device__ __forceinline__ float group_scale(const QuantizeParams& p, int g, float fmax) {
  if (g >= p.G) return 1.0f;
  return p.delayed ? p.s[g] : jq::scale_from_amax(p.amax[g], fmax, p.pow2_scale, p.amax_epsilon);
}

// The codes of positions pos .. pos + n - 1 (n <= 4; byte i of `word`) at feature c of the
// columnwise copy, byte by byte: the rare case (a partial quad, an unaligned row, or an expert of
// rows not a multiple of 4 split by the quad).
__device__ __forceinline__ void store_column_bytes(uint8_t* col, int64_t L, int64_t C, int64_t E,
                                                   int64_t c, int64_t pos, int n, uint32_t word) {
  for (int i = 0; i < n; ++i) {  // 32-bit positions and expert rows (checked by the handler)
    const uint32_t pi = uint32_t(pos) + uint32_t(i), e = uint32_t(E);
    const uint32_t g = E == 0 ? 0u : pi / e;
    col[E == 0 ? c * L + pi : (int64_t(g) * C + c) * E + (pi - g * e)] = uint8_t(word >> (8 * i));
  }
}

__device__ __forceinline__ bool aligned8(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 7) == 0;
}

template <int TYPE>
__global__ void __launch_bounds__(256, 4) grouped_quantize_kernel(const QuantizeParams p) {
  // The tile's FP8 codes: a position's scale is its group's in both copies, so the columnwise
  // bytes are the rowwise codes transposed, encoded once and moved as bytes.
  __shared__ uint32_t codes[kQP][kTileWords];
  // Per tile row (position): its source row of x (-1: padding or no group), group (G: none),
  // scale, rowwise destination row (-1: none), whether it is a packed copy's row of no group
  // (written as zeros), and (delayed scaling) its max |x| bits.
  __shared__ int32_t row_src[kQP], row_group[kQP], row_out[kQP];
  __shared__ float row_scale[kQP];
  __shared__ bool row_zero[kQP];
  __shared__ uint32_t row_amax[kQP];
  const jq::Fp8 fmt = static_cast<jq::Fp8>(p.fmt);
  const float fmax = jq::spec_of(fmt).fmax;
  const int tid = threadIdx.x;
  // 32-bit tile and position arithmetic (positions < 2^31, checked by the handler, and fewer
  // than 2^31 tiles): a 64-bit division is a called subroutine of ~70 instructions.
  const uint32_t c_tiles = uint32_t((p.C + kQC - 1) / kQC);
  const uint32_t tile_p = blockIdx.x / c_tiles;
  const int64_t p0 = int64_t(tile_p) * kQP, c0 = int64_t(blockIdx.x - tile_p * c_tiles) * kQC;
  if (blockIdx.x == 0) {
    for (int g = tid; g < p.G; g += 256) p.scale_inv[g] = jq::rcp_f32(group_scale(p, g, fmax));
  }
  if (tid < kQP) {  // one thread a position: its group and source row, found once for the tile
    const int64_t pos = p0 + tid;
    int64_t src = -1;
    int g = int(p.G);
    if (pos < p.L && p.expert_rows > 0) {  // expert weights: row pos is expert pos / E's
      g = int(uint32_t(pos) / uint32_t(p.expert_rows));
      src = pos;
    } else if (pos < p.L) {
      g = upper_group(p.pstarts, int(p.G), pos);
      if (g < p.G) {
        const int64_t local = pos - __ldg(p.pstarts + g);
        if (local < int64_t(__ldg(p.starts + g + 1)) - __ldg(p.starts + g)) src = __ldg(p.starts + g) + local;
      }
    }
    row_src[tid] = int32_t(src);
    row_group[tid] = g;
    row_scale[tid] = group_scale(p, g, fmax);
    // The rowwise copy's row: the position, or in the packed layout (row_packed) the source row;
    // a packed row of no group (starts[G] <= pos < T) is written as zeros by position pos.
    row_out[tid] = int32_t(!p.row_packed ? (pos < p.L ? pos : -1) : src);
    row_zero[tid] = p.row_packed && pos < p.T && pos >= int64_t(__ldg(p.starts + p.G));
  }
  __syncthreads();
  {  // rowwise: thread -> (row lr of each pass, features lc .. lc + 7)
    const int lr = tid / (kQC / 8), lc = (tid % (kQC / 8)) * 8;
    const int64_t c = c0 + lc;
    const int n_valid = int(max(int64_t(0), min(int64_t(8), p.C - c)));
    const bool vec = (TYPE == 2 ? p.C % 4 == 0 : p.C % 8 == 0) && (reinterpret_cast<uintptr_t>(p.x) & 15) == 0;
    constexpr int kBatch = TYPE == 2 ? kPasses / 2 : kPasses;  // passes whose loads fly together
#pragma unroll
    for (int b0 = 0; b0 < kPasses; b0 += kBatch) {
      Raw8<TYPE> raw[kBatch];
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        const int32_t src = row_src[(b0 + k) * kRowsPerPass + lr];
        raw[k] = load_raw8<TYPE>(p.x, src >= 0 ? int64_t(src) * p.C + c : 0, src >= 0 ? n_valid : 0, vec);
      }
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        const int r = (b0 + k) * kRowsPerPass + lr;
        const float scale = row_scale[r];
        float v[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = value_of<TYPE>(raw[k], i);
        if (p.delayed) {  // the amax to record: the row's 16 lanes reduced, one word a row
          uint32_t m = 0;
#pragma unroll
          for (int i = 0; i < 8; ++i) m = max(m, jq::abs_bits(v[i]));
#pragma unroll
          for (int o = 1; o < kQC / 8; o <<= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
          if (lc == 0) row_amax[r] = m;
        }
        const uint32_t q0 = jq::encode_fp8x4(v[0] * scale, v[1] * scale, v[2] * scale, v[3] * scale, fmt);
        const uint32_t q1 = jq::encode_fp8x4(v[4] * scale, v[5] * scale, v[6] * scale, v[7] * scale, fmt);
        codes[r][lc / 4] = q0;
        codes[r][lc / 4 + 1] = q1;
        if (p.row && n_valid > 0) {
          const int32_t out_row = row_out[r];
          if (out_row >= 0) {
            uint8_t* dst = p.row + int64_t(out_row) * p.C + c;
            store_bytes8(dst, q0, q1, n_valid, aligned8(dst));
          }
          if (row_zero[r]) {
            uint8_t* dst = p.row + (p0 + r) * p.C + c;
            store_bytes8(dst, 0u, 0u, n_valid, aligned8(dst));
          }
        }
      }
    }
  }
  if (!p.col && !p.delayed) return;
  __syncthreads();
  if (p.delayed && tid < kQP) {  // one lane a row; a warp of one group's rows: one atomic
    const int g = row_src[tid] >= 0 ? row_group[tid] : -1;
    uint32_t m = g >= 0 ? row_amax[tid] : 0u;
    const unsigned any = __ballot_sync(0xFFFFFFFFu, g >= 0);
    if (any) {
      const int first = __shfl_sync(0xFFFFFFFFu, g, __ffs(any) - 1);
      if (__all_sync(0xFFFFFFFFu, g < 0 || g == first)) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
        if ((tid & 31) == 0 && m != 0u) atomicMax(reinterpret_cast<uint32_t*>(p.amax) + first, m);
      } else if (g >= 0 && m != 0u) {
        atomicMax(reinterpret_cast<uint32_t*>(p.amax) + g, m);
      }
    }
  }
  if (!p.col) return;
  // columnwise: per iteration a thread takes 4 positions x 4 features, four words of the tile
  // byte-transposed into each feature's 4 codes. A warp's 32 loads hit 32 banks (positions
  // 8 x 4, features 4) and its stores are 32 contiguous bytes of 4 feature rows.
  const int lane = tid & 31, warp = tid >> 5;
#pragma unroll 1
  for (int it = 0; it < (kQP / 4) * (kQC / 4) / 256; ++it) {
    const int blk = warp + 8 * it;  // a warp's 32 x 16 block of the tile: blk % 4 along positions
    const int pq = (lane & 7) + 8 * (blk % (kQP / 32)), fq = (lane >> 3) + 4 * (blk / (kQP / 32));
    const int64_t pos = p0 + 4 * pq, cb = c0 + 4 * fq;  // 32-bit values (checked by the handler)
    if (cb >= p.C || pos >= p.L) continue;
    const uint32_t w0 = codes[4 * pq][fq], w1 = codes[4 * pq + 1][fq];
    const uint32_t w2 = codes[4 * pq + 2][fq], w3 = codes[4 * pq + 3][fq];
    const uint32_t lo01 = __byte_perm(w0, w1, 0x5140), hi01 = __byte_perm(w0, w1, 0x7362);
    const uint32_t lo23 = __byte_perm(w2, w3, 0x5140), hi23 = __byte_perm(w2, w3, 0x7362);
    const int n = int(min(int64_t(4), p.L - pos));
    const int n_features = int(min(int64_t(4), p.C - cb));
    // Feature j's 4 codes go to base + j * stride: a position-major row of the columnwise copy
    // (an expert's [C, rows] block for expert weights).
    uint8_t* base;
    int64_t stride;
    bool whole;  // 4 positions of one row, word-aligned
    if (p.expert_rows == 0) {
      base = p.col + cb * p.L + pos;
      stride = p.L;
      whole = n == 4;
    } else {
      const uint32_t E = uint32_t(p.expert_rows), g = uint32_t(pos) / E, local = uint32_t(pos) - g * E;
      base = p.col + (int64_t(g) * p.C + cb) * E + local;
      stride = E;
      whole = n == 4 && local + 4 <= E;
    }
    whole = whole && (reinterpret_cast<uintptr_t>(base) & 3) == 0 && (stride & 3) == 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (j >= n_features) continue;
      const uint32_t word = __byte_perm(j < 2 ? lo01 : hi01, j < 2 ? lo23 : hi23,
                                        (j & 1) ? 0x7632 : 0x5410);
      if (whole) {
        *reinterpret_cast<uint32_t*>(base + j * stride) = word;
      } else {
        store_column_bytes(p.col, p.L, p.C, p.expert_rows, cb + j, pos, n, word);
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
  const int64_t tiles = ((p.L + kQP - 1) / kQP) * ((p.C + kQC - 1) / kQC);
  if (tiles >= (int64_t{1} << 31)) {  // the grid's limit, and the kernel's 32-bit tile index
    return invalid(t, "x's columns C=" + std::to_string(p.C) + " and length=" + std::to_string(p.L) +
                      " make " + std::to_string(tiles) + " 128 x 128 tiles; at most 2^31 - 1 are valid");
  }
  by_type(p.in_type, [&](auto tag) {
    constexpr int TYPE = decltype(tag)::value;
    if (!p.delayed) launch_grouped_amax<TYPE>(p, stream);
    grouped_quantize_kernel<TYPE><<<unsigned(tiles), 256, 0, stream>>>(p);
  });
  return launch_status(t);
}

// The amax pass of jaxquant_grouped_amax(_gated): clears amax[G], then one launch.
ffi::Error amax_pass(const char* t, const QuantizeParams& p, cudaStream_t stream) {
  if (cudaError_t e = cudaMemsetAsync(p.amax, 0, 4 * p.G, stream); e != cudaSuccess) {
    return launch_status(t, e);
  }
  by_type(p.in_type, [&](auto tag) {
    launch_grouped_amax<decltype(tag)::value>(p, stream);
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
