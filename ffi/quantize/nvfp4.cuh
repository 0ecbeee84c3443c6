// NVFP4 quantize kernels (tiled, and the odd-row-length generic path).
#pragma once

#include "quantize/nvfp4_raw.cuh"
#include "quantize/tile.cuh"

namespace jqffi {
namespace {
// ============================================================================================
// NVFP4: E2M1 payload, E4M3 scale per 1x16 block or 16x16 tile, FP32 global scale from the
// given amax (per tensor or per row), RHT on the columnwise copy, stochastic rounding.
// Tile 64x128; a column-phase thread owns one 16-row chunk = one NVFP4 block (= one RHT chunk).
// ============================================================================================

// The groups of a grouped quantize (`nvfp4_kernel<In, true>`): the R x C matrix is a token
// layout of R positions over the T rows of x (ffi/grouped/grouped_args.h): position `pos` of
// group g holds row starts[g] + (pos - pstarts[g]) of x while that is inside the group, else
// zeros (padding, or no group). Every 16-position chunk and 16x16 tile of a columnwise or 2-D
// copy lies inside one group (the layout's block is a multiple of 16 there).
struct Nvfp4Groups {
  const int32_t* starts = nullptr;   // [G + 1] packed group starts in x
  const int32_t* pstarts = nullptr;  // [G + 1] group starts in the layout
  int64_t G = 0, T = 0;              // groups; rows of x
  int64_t expert_rows = 0;           // > 0: expert weights, group g = rows g E .. g E + E - 1
                                     // (E = expert_rows; the offsets are not read) and the
                                     // columnwise copy is [G, C, E]
  bool speculate = false;            // load row `pos` of x before the group lookup (a packed
                                     // layout: the source row is the position or none)
  bool row_packed = false;           // the rowwise copy is [T, C], packed: position pos's row
                                     // goes to its source row of x (none for padding), and
                                     // rows starts[G] .. T - 1 are zero rows, each written by
                                     // the position of the same index (R >= T)
};

// Single tensor: row_amax / col_amax are the tensor amax (or per row / column when row_scaled)
// and the keys two words each. Grouped: both amaxes and the keys are per group ([G], [G, 2]).
struct Nvfp4Params {
  const void* x;
  int64_t R, C;
  bool vec_in, vec_row, vec_col, do_row, do_col, row_scaled, block_2d, rht, sr;
  const float *row_amax, *col_amax;
  const uint32_t *row_key, *col_key;
  uint8_t *row, *row_scale, *col, *col_scale;
  Nvfp4Groups groups = {};
  // Both copies as bfloat16 raw values (code x block scale: `row` a bfloat16 [R, C], `col` a
  // bfloat16 [C, R] or [G, C, E]) instead of codes, for grouped GEMMs that read decoded
  // operands; the block scales are still written.
  bool raw = false;
};

// Per tile row of a grouped quantize: source row of x (-1: zeros), group (G: none), index in
// the group, and the group's second-level encode scale of each direction (1 for no group, as
// the reference's per-position fill). Empty for the single-tensor kernel.
template <bool GROUPED, int TR>
struct Nvfp4TileRows {};

template <int TR>
struct Nvfp4TileRows<true, TR> {
  int32_t src[TR];  // a row of x (< starts[G], an int32) or -1
  int32_t group[TR], local[TR];
  float s_row[TR], s_col[TR];
  uint2 k_row[TR], k_col[TR];  // stochastic rounding: the words of the row's group

  // Thread i < TR: row i of the tile at r0 (position pos = r0 + i): its source row, group and
  // index, into shared memory; returns the group. Expert weights (expert_rows E > 0, groups of
  // E rows at e * E in both x and the layout): group pos / E, source pos, no lookup. Tokens:
  // the largest g <= G with pstarts[g] <= pos, a binary search of the G + 1 layout starts read
  // through the read-only cache (a few lines every CTA of the SM reads: L1 hits), nothing
  // staged, no barrier. The caller synchronizes before reading another thread's row.
  __device__ __forceinline__ int locate(const Nvfp4Params& p, int64_t r0) {
    const Nvfp4Groups& q = p.groups;
    const int G = int(q.G);
    const int i = threadIdx.x;
    const int64_t pos = r0 + i;
    int g = G;
    int64_t source = -1, index = 0;
    if (pos < p.R) {
      if (q.expert_rows > 0) {  // pos < R = G * E < 2^31: 32-bit division
        g = int(int32_t(pos) / int32_t(q.expert_rows));
        index = pos - g * q.expert_rows;
        source = pos;
      } else {
        int lo = 0, hi = G;  // the group whose extent holds pos (G: none; see group_of)
        while (lo < hi) {
          const int mid = (lo + hi + 1) >> 1;
          if (int64_t(__ldg(q.pstarts + mid)) <= pos) lo = mid; else hi = mid - 1;
        }
        g = lo;
        index = pos - __ldg(q.pstarts + g);  // past the last group: pos - pstarts[G]
        if (g < G) {
          const int64_t begin = __ldg(q.starts + g);
          if (index < int64_t(__ldg(q.starts + g + 1)) - begin) source = begin + index;
        }
      }
    }
    src[i] = int32_t(source);
    group[i] = g;
    local[i] = int32_t(index);
    return g;
  }

  // Thread i < TR: row i's second-level encode scales and stochastic-rounding words (zeros
  // for no group, as the reference) from its group `g` (locate's); called after the row's
  // loads are issued, so these reads and the division overlap them.
  __device__ __forceinline__ void scales(const Nvfp4Params& p, int g) {
    const int i = threadIdx.x;
    const bool own = g < p.groups.G;
    s_row[i] = p.do_row && own ? jq::nvfp4_global_encode_scale(p.row_amax[g]) : 1.0f;
    s_col[i] = p.do_col && own ? jq::nvfp4_global_encode_scale(p.col_amax[g]) : 1.0f;
    if (p.sr) {
      k_row[i] = p.do_row && own ? make_uint2(p.row_key[2 * g], p.row_key[2 * g + 1]) : make_uint2(0u, 0u);
      k_col[i] = p.do_col && own ? make_uint2(p.col_key[2 * g], p.col_key[2 * g + 1]) : make_uint2(0u, 0u);
    }
  }

  // What tile position i draws from its group for the rowwise (`rowwise`) or the columnwise
  // copy: the second-level encode scale, the position's index in its group (the SR coordinate)
  // and, with stochastic rounding (`sr`), the group's key words.
  __device__ __forceinline__ void draw(int i, bool rowwise, bool sr, float* s_enc, uint32_t* index,
                                       uint32_t* k0, uint32_t* k1) const {
    *s_enc = rowwise ? s_row[i] : s_col[i];
    *index = uint32_t(local[i]);
    if (sr) {
      const uint2 k = rowwise ? k_row[i] : k_col[i];
      *k0 = k.x;
      *k1 = k.y;
    }
  }
};

struct Nvfp4Block {
  uint32_t code;  // E4M3 code of S_dec_b
  float s_enc_b;
};

__device__ __forceinline__ Nvfp4Block nvfp4_block(uint32_t amax_bits, float s_enc) {
  const uint32_t code = jq::nvfp4_block_decode_code(__uint_as_float(amax_bits), s_enc);
  return {code, jq::nvfp4_block_encode_scale(jq::decode_e4m3(code), s_enc)};
}

// Eight bfloat16 values (four words, the first value in the low half of words[0]) to `dst`:
// one 16-byte store where `vec` (dst 16-byte aligned), else the first `n` one at a time.
__device__ __forceinline__ void store_raw8(uint16_t* dst, const uint32_t* words, int n, bool vec) {
  if (vec && n == 8) {
    *reinterpret_cast<uint4*>(dst) = make_uint4(words[0], words[1], words[2], words[3]);
    return;
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) {  // unrolled: `words` stays in registers
    if (i < n) dst[i] = uint16_t(words[i / 2] >> (16 * (i % 2)));
  }
}

// Eight E2M1 codes of v * s, packed low nibble first; SR draws at (row hash, col0 + i).
// `s` is the block's encode scale S_enc_b, NaN whenever some v[i] is (a NaN makes the block amax,
// hence S_dec_b and S_enc_b, NaN), and otherwise finite and >= 0, so a product is NaN exactly
// when `s` is: round to nearest checks NaN once per eight codes (every code 0x7, as
// encode_e2m1 gives NaN) and takes each sign from the product's sign bit.
__device__ __forceinline__ uint32_t e2m1x8(const float* v, float s, bool sr, uint32_t row_hash,
                                           uint32_t k1, uint32_t col0) {
  uint32_t packed = 0;
  if (sr) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float y = v[i] * s;
      packed |= jq::encode_e2m1_stochastic(y, jq::sr_uniform(row_hash, k1, col0 + i)) << (4 * i);
    }
    return packed;
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float y = v[i] * s;
    const uint32_t code = jq::e2m1_magnitude_code(jq::abs_f(y)) | ((jq::bits_of(y) >> 31) << 3);
    packed |= code << (4 * i);
  }
  return jq::is_nan(s) ? 0x77777777u : packed;
}

// Eight E2M1 codes `packed` of row `r` from column c (block scale `b`) into the rowwise copy:
// raw (the codes decoded, raw4: the decode kernel's bits) or as codes; the even thread of the
// block's pair writes its scale.
__device__ __forceinline__ void store_row8(const Nvfp4Params& p, int64_t r, int64_t c,
                                           int64_t row_nb, const Nvfp4Block& b, uint32_t packed,
                                           int tid, int lr) {
  if (p.raw) {
    uint32_t words[4];
    const __nv_bfloat162 s = __float2bfloat162_rn(jq::decode_e4m3(b.code));
    raw4(packed, s, words);
    raw4(packed >> 16, s, words + 2);
    store_raw8(reinterpret_cast<uint16_t*>(p.row) + r * p.C + c, words, int(min64(8, p.C - c)), p.vec_row);
  } else {
    store_bytes4(p.row + (r * p.C + c) / 2, packed, int(min64(8, p.C - c)) / 2, p.vec_row);
  }
  if ((tid & 1) == 0) {
    if (!p.block_2d) {
      p.row_scale[r * row_nb + c / 16] = uint8_t(b.code);
    } else if (lr == 0) {
      p.row_scale[(r / 16) * row_nb + c / 16] = uint8_t(b.code);
    }
  }
}

template <typename In>
using NVFP4Tile = Geometry<In, 64, 128>;

// GROUPED: the rows are token-layout positions (`Nvfp4Groups`), each with its group's
// second-level scales and stochastic-rounding words and its index within the group (the SR
// coordinate), and the columnwise copy of expert weights is written as [G, C, expert_rows].
// Occupancy: the single-tensor kernel fits 64 registers (4 CTAs an SM; 3 at least); the grouped
// one is held to the same 4 (at 69 registers, 3 CTAs an SM, it measured 0.81-0.87 of the
// single-tensor bandwidth, bench/RESULTS.md).
template <typename In, bool GROUPED = false>
__global__ void __launch_bounds__(kThreads, GROUPED ? 4 : 3) nvfp4_kernel(const Nvfp4Params p) {
  using G = NVFP4Tile<In>;
  static_assert(G::RPP == 16, "a load pass is one row of 16x16 tiles");
  In* tile = shared_tile<In>();
  __shared__ uint32_t part2d[G::NP][16][G::TC / 16];  // per (row, 16-block) amax, block_2d
  __shared__ uint32_t tile2d[G::NP][G::TC / 16];      // 16x16 tile amax, block_2d
  const In* x = static_cast<const In*>(p.x);
  const int tid = threadIdx.x;
  const TileIndex t = tile_index(p.C, G::TR, G::TC);
  const int64_t row_nb = (p.C + 15) / 16, col_nb = (p.R + 15) / 16;
  const int lr = tid / G::TPR, lc = (tid % G::TPR) * 8;
  __shared__ Nvfp4TileRows<GROUPED, G::TR> rows;
  alignas(16) In raw[G::NP][8];
  if constexpr (GROUPED) {
    // Each tile row is read from its source row of x: found first, then loaded (one barrier
    // between), or, in a packed layout (`speculate`: the source row is the position or none),
    // loaded at the position while the lookup runs and reloaded where the source differs.
    // The rows' scales are computed while the loads are in flight.
    const int64_t T = p.groups.T;
    const bool speculate = p.groups.speculate;
    if (speculate) {
#pragma unroll
      for (int pp = 0; pp < G::NP; ++pp) load8(x, T, p.C, t.r0 + pp * G::RPP + lr, t.c0 + lc, p.vec_in, raw[pp]);
    }
    const int g = tid < G::TR ? rows.locate(p, t.r0) : 0;
    if (!speculate) {
      __syncthreads();
#pragma unroll
      for (int pp = 0; pp < G::NP; ++pp) {
        const int64_t src = rows.src[pp * G::RPP + lr];
        load8(x, T, p.C, src >= 0 ? src : T, t.c0 + lc, p.vec_in, raw[pp]);
      }
    }
    if (tid < G::TR) rows.scales(p, g);
    __syncthreads();
    if (speculate) {
#pragma unroll
      for (int pp = 0; pp < G::NP; ++pp) {
        const int64_t src = rows.src[pp * G::RPP + lr];
        if (src != t.r0 + pp * G::RPP + lr) load8(x, T, p.C, src >= 0 ? src : T, t.c0 + lc, p.vec_in, raw[pp]);
      }
    }
  } else {
#pragma unroll
    for (int pp = 0; pp < G::NP; ++pp) load8(x, p.R, p.C, t.r0 + pp * G::RPP + lr, t.c0 + lc, p.vec_in, raw[pp]);
  }
  uint32_t blk[G::NP];
#pragma unroll
  for (int pp = 0; pp < G::NP; ++pp) {
    if (p.do_col) tile_store8<G>(tile, pp * G::RPP + lr, lc, raw[pp]);
    uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) m = max(m, jq::abs_bits(to_float(raw[pp][i])));
    m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, 1));  // 2 threads = one 16-wide block
    blk[pp] = m;
    if (p.block_2d && (tid & 1) == 0) part2d[pp][lr][lc / 16] = m;
  }
  if (p.block_2d) {
    __syncthreads();
    if (tid < G::NP * (G::TC / 16)) {
      const int pp = tid / (G::TC / 16), j = tid % (G::TC / 16);
      uint32_t m = 0;
#pragma unroll
      for (int i = 0; i < 16; ++i) m = max(m, part2d[pp][i][j]);
      tile2d[pp][j] = m;
    }
    __syncthreads();
#pragma unroll
    for (int pp = 0; pp < G::NP; ++pp) blk[pp] = tile2d[pp][lc / 16];
  }
  if (p.do_row) {
    static_assert(G::NP % 2 == 0, "the row phase's passes go in pairs");
    const float tensor_s_enc = GROUPED || p.row_scaled ? 0.0f : jq::nvfp4_global_encode_scale(*p.row_amax);
    const uint32_t k0 = !GROUPED && p.sr ? p.row_key[0] : 0u, k1 = !GROUPED && p.sr ? p.row_key[1] : 0u;
    // Threads tid and tid ^ 1 hold the two halves of each pass's 16-value block: of a pair of
    // passes, the even thread computes the first block's scale and the odd one the second's,
    // and they exchange them (the block scale is ~60 instructions; the pass's own row's
    // second-level scale, 1 for a row past R, which writes nothing).
    const bool odd = (tid & 1) != 0;
    Nvfp4Block pair_block[2];
    const auto row_s_enc = [&](int q) -> float {
      if constexpr (GROUPED) {
        return rows.s_row[q * G::RPP + lr];
      } else {
        const int64_t r = t.r0 + q * G::RPP + lr;
        return p.row_scaled ? (r < p.R ? jq::nvfp4_global_encode_scale(p.row_amax[r]) : 1.0f) : tensor_s_enc;
      }
    };
#pragma unroll
    for (int pp = 0; pp < G::NP; ++pp) {
      if (pp % 2 == 0) {  // this pair of passes' block scales, one computed here, one by the partner
        const Nvfp4Block mine = nvfp4_block(odd ? blk[pp + 1] : blk[pp], row_s_enc(pp + int(odd)));
        const Nvfp4Block theirs = {__shfl_xor_sync(0xFFFFFFFFu, mine.code, 1),
                                   __shfl_xor_sync(0xFFFFFFFFu, mine.s_enc_b, 1)};
        pair_block[0] = odd ? theirs : mine;
        pair_block[1] = odd ? mine : theirs;
      }
      const int64_t r = t.r0 + pp * G::RPP + lr, c = t.c0 + lc;
      if (r >= p.R || c >= p.C) continue;
      uint32_t sr_row = uint32_t(r), sr_k0 = k0, sr_k1 = k1;
      if constexpr (GROUPED) {
        float s_enc;  // (in the pair's block scale already)
        rows.draw(pp * G::RPP + lr, true, p.sr, &s_enc, &sr_row, &sr_k0, &sr_k1);
      }
      const Nvfp4Block b = pair_block[pp % 2];
      float v[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = to_float(raw[pp][i]);
      const uint32_t row_hash = p.sr ? jq::sr_row_hash(sr_k0, sr_row) : 0u;
      const uint32_t packed = e2m1x8(v, b.s_enc_b, p.sr, row_hash, sr_k1, uint32_t(c));
      // Where the row goes: position r, or (row_packed) its source row of x, none for padding;
      // a packed row of no group is a zero row's codes and scale (a position of no group's:
      // what the packed layout's own launch writes there), stored by the position r.
      int64_t to = r;
      bool zero_row = false;
      if constexpr (GROUPED) {
        if (p.groups.row_packed) {
          to = rows.src[pp * G::RPP + lr];
          zero_row = r < p.groups.T && r >= __ldg(p.groups.starts + p.groups.G);
        }
      }
      if (to >= 0) store_row8(p, to, c, row_nb, b, packed, tid, lr);
      if (zero_row) store_row8(p, r, c, row_nb, nvfp4_block(0u, 1.0f), 0u, tid, lr);
    }
  }
  if (!p.do_col) return;
  __syncthreads();
  const float tensor_s_enc = GROUPED || p.row_scaled ? 0.0f : jq::nvfp4_global_encode_scale(*p.col_amax);
  const uint32_t k0 = !GROUPED && p.sr ? p.col_key[0] : 0u, k1 = !GROUPED && p.sr ? p.col_key[1] : 0u;
#pragma unroll
  for (int it = 0; it < G::ITERS; ++it) {
    const ColumnSlot<G> slot(it);
    const int64_t c = t.c0 + slot.cl, rr = t.r0 + 16 * slot.j;
    if (c >= p.C || rr >= p.R) continue;
    float w[16];
    tile_column16<G>(tile, 16 * slot.j, slot.cl, w);
    if (p.rht) jq::rht16(w);
    uint32_t m;
    if (p.block_2d) {
      m = tile2d[slot.j][slot.cl / 16];
    } else {
      m = 0;
#pragma unroll
      for (int i = 0; i < 16; ++i) m = max(m, jq::abs_bits(w[i]));
    }
    float s_enc = p.row_scaled ? jq::nvfp4_global_encode_scale(p.col_amax[c]) : tensor_s_enc;
    uint32_t sr_col = uint32_t(rr), sr_k0 = k0, sr_k1 = k1;
    // Grouped: the chunk's 16 positions are one group's.
    if constexpr (GROUPED) rows.draw(16 * slot.j, false, p.sr, &s_enc, &sr_col, &sr_k0, &sr_k1);
    const Nvfp4Block b = nvfp4_block(m, s_enc);
    const uint32_t row_hash = p.sr ? jq::sr_row_hash(sr_k0, uint32_t(c)) : 0u;
    const uint32_t lo = e2m1x8(w, b.s_enc_b, p.sr, row_hash, sr_k1, sr_col);
    const uint32_t hi = e2m1x8(w + 8, b.s_enc_b, p.sr, row_hash, sr_k1, sr_col + 8u);
    // Output row (c, or c / 16 for 2-D scales) and column (position) of the transposed copy;
    // expert weights: expert e's [C, E] matrix at e * C * E (scales likewise).
    int64_t base = 0, out_len = p.R, out_pos = rr, scale_len = col_nb;
    int64_t scale_rows = p.block_2d ? (p.C + 15) / 16 : p.C;
    if constexpr (GROUPED) {
      if (p.groups.expert_rows > 0) {  // the chunk's expert and row in it (locate's)
        const int64_t E = p.groups.expert_rows;
        out_len = E;
        out_pos = rows.local[16 * slot.j];
        scale_len = E / 16;
        base = rows.group[16 * slot.j];
      }
    }
    uint8_t* col_scale = p.col_scale + base * scale_rows * scale_len;
    if (p.raw) {  // the sixteen codes decoded, 32 bytes of output row c
      uint32_t words[8];
      const __nv_bfloat162 s = __float2bfloat162_rn(jq::decode_e4m3(b.code));
      raw4(lo, s, words);
      raw4(lo >> 16, s, words + 2);
      raw4(hi, s, words + 4);
      raw4(hi >> 16, s, words + 6);
      uint16_t* col = reinterpret_cast<uint16_t*>(p.col) + (base * p.C + c) * out_len + out_pos;
      const int n = int(min64(16, out_len - out_pos));
      store_raw8(col, words, min(n, 8), p.vec_col);
      if (n > 8) store_raw8(col + 8, words + 4, n - 8, p.vec_col);
    } else {
      uint8_t* col = p.col + (base * p.C * out_len) / 2;
      store_bytes8(col + (c * out_len + out_pos) / 2, lo, hi, int(min64(16, out_len - out_pos)) / 2, p.vec_col);
    }
    if (!p.block_2d) {
      col_scale[c * scale_len + out_pos / 16] = uint8_t(b.code);
    } else if (slot.cl % 16 == 0) {
      col_scale[(c / 16) * scale_len + out_pos / 16] = uint8_t(b.code);
    }
  }
}

// NVFP4 for an output matrix M (x, or x^T when `transposed`; never RHT'd) whose row length is
// odd, so rows share bytes: first every block scale, then one thread per output byte.
struct Nvfp4GenericParams {
  const void* x;
  int64_t R, C, mrows, mcols;
  bool transposed, row_scaled, block_2d, sr;
  const float* amax;
  const uint32_t* key;
  uint8_t *data, *scale;
};

template <typename In>
__device__ __forceinline__ float m_at(const Nvfp4GenericParams& p, int64_t mr, int64_t mc) {
  const In* x = static_cast<const In*>(p.x);
  return to_float(p.transposed ? x[mc * p.C + mr] : x[mr * p.C + mc]);
}

template <typename In>
__global__ void __launch_bounds__(kThreads) nvfp4_generic_scales_kernel(const Nvfp4GenericParams p) {
  const int bh = p.block_2d ? 16 : 1;
  const int64_t nbr = (p.mrows + bh - 1) / bh, nbc = (p.mcols + 15) / 16;
  for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i < nbr * nbc; i += int64_t(gridDim.x) * kThreads) {
    const int64_t br = i / nbc, bc = i % nbc;
    uint32_t m = 0;
    for (int64_t mr = br * bh; mr < min64(p.mrows, br * bh + bh); ++mr) {
      for (int64_t mc = bc * 16; mc < min64(p.mcols, bc * 16 + 16); ++mc) m = max(m, jq::abs_bits(m_at<In>(p, mr, mc)));
    }
    const float s_enc = jq::nvfp4_global_encode_scale(p.row_scaled ? p.amax[br] : *p.amax);
    p.scale[i] = uint8_t(jq::nvfp4_block_decode_code(__uint_as_float(m), s_enc));
  }
}

template <typename In>
__global__ void __launch_bounds__(kThreads) nvfp4_generic_data_kernel(const Nvfp4GenericParams p) {
  const int64_t n = p.mrows * p.mcols, nbytes = (n + 1) / 2, nbc = (p.mcols + 15) / 16;
  const int bh = p.block_2d ? 16 : 1;
  for (int64_t b = blockIdx.x * int64_t(kThreads) + threadIdx.x; b < nbytes; b += int64_t(gridDim.x) * kThreads) {
    uint32_t byte = 0;
    for (int e = 0; e < 2; ++e) {
      const int64_t i = 2 * b + e;
      if (i >= n) break;
      const int64_t mr = i / p.mcols, mc = i % p.mcols;
      const float s_enc = jq::nvfp4_global_encode_scale(p.row_scaled ? p.amax[mr] : *p.amax);
      const float s_dec = jq::decode_e4m3(p.scale[(mr / bh) * nbc + mc / 16]);
      const float y = m_at<In>(p, mr, mc) * jq::nvfp4_block_encode_scale(s_dec, s_enc);
      const uint32_t q = p.sr ? jq::encode_e2m1_stochastic(
                                    y, jq::sr_uniform(jq::sr_row_hash(p.key[0], uint32_t(mr)), p.key[1], uint32_t(mc)))
                              : jq::encode_e2m1(y);
      byte |= q << (4 * e);
    }
    p.data[b] = uint8_t(byte);
  }
}

}  // namespace
}  // namespace jqffi
