// The one launcher of every CUTLASS Hopper grouped GEMM instance (sm90_instance.cuh; operand
// policies in sm90_kernel.cuh and sm90_block_kernel.cuh):
//   1. the workspace is carved into the per-group arrays (problem shapes, operand and output
//      pointers and strides, and the policy's scale arrays), each 256-byte aligned, then
//      CUTLASS's own workspace;
//   2. one setup kernel writes those arrays from the device-side group offsets `pstarts` (they
//      never reach the host), repacks the policy's scales, and writes the zeros no GEMM tile
//      writes (mode 0: rows past the last group; mode 1: the outputs of empty groups, which get
//      a 0 x N x 0 problem the tile scheduler skips);
//   3. CUTLASS's can_implement / initialize / run on the same stream, with the epilogue
//      D = alpha[g] * acc and the persistent scheduler's tile order.
// The two modes differ only in the per-group pointers and strides:
//   mode 0 (ragged rows x experts): group g = rows [pstarts[g], pstarts[g+1]) of a [L, K] times
//     b[g] ([N, K] K-major, or [K, N] N-major for bf16 kLayoutNN) -> the same rows of out [L, N];
//   mode 1 (wgrad): the tokens [pstarts[g], pstarts[g+1]) of a and b (K-major: a [M, L] and
//     b [N, L], row stride L; bf16 kLayoutNT: a [L, M] and b [L, N], the tokens themselves)
//     -> out[g] [M, N].
// No host sync and no allocation (the workspace is an FFI result), so the handlers stay
// command-buffer compatible.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "grouped/sm90/sm90_instance.cuh"

namespace jqffi {
namespace sm90 {

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

// The per-group arrays of instance K in the workspace; `bytes` of workspace used before
// CUTLASS's.
template <class K>
struct GroupArrays {
  typename ProblemShape::UnderlyingProblemShape* shapes;
  const typename K::ElementA** ptr_a;
  const typename K::ElementB** ptr_b;
  typename K::ElementD** ptr_d;
  typename K::StrideA* stride_a;
  typename K::StrideB* stride_b;
  typename K::StrideD* stride_d;
  typename K::Ops::Scales scales;  // Float8Block: scale pointers, layouts, repacked scales
  const float** ptr_row;           // kEpiRowScale: each group's first row factor
  size_t bytes;
};

template <class K>
GroupArrays<K> carve(void* base, const Problem& p) {
  static_assert(sizeof(typename ProblemShape::UnderlyingProblemShape) + 3 * sizeof(void*) +
                        sizeof(typename K::StrideA) + sizeof(typename K::StrideB) +
                        sizeof(typename K::StrideD) + K::Ops::kScaleBytesPerGroup +
                        (K::kRowScale ? sizeof(void*) : 0) <=
                    kPerGroupBytes,
                "per-group setup arrays exceed kPerGroupBytes");
  GroupArrays<K> s;
  char* q = static_cast<char*>(base);
  size_t off = 0;
  auto take = [&](size_t bytes) { char* r = q + off; off += align256(bytes); return r; };
  const int64_t G = p.G;
  s.shapes = reinterpret_cast<decltype(s.shapes)>(take(G * sizeof(*s.shapes)));
  s.ptr_a = reinterpret_cast<decltype(s.ptr_a)>(take(G * sizeof(*s.ptr_a)));
  s.ptr_b = reinterpret_cast<decltype(s.ptr_b)>(take(G * sizeof(*s.ptr_b)));
  s.ptr_d = reinterpret_cast<decltype(s.ptr_d)>(take(G * sizeof(*s.ptr_d)));
  s.stride_a = reinterpret_cast<decltype(s.stride_a)>(take(G * sizeof(*s.stride_a)));
  s.stride_b = reinterpret_cast<decltype(s.stride_b)>(take(G * sizeof(*s.stride_b)));
  s.stride_d = reinterpret_cast<decltype(s.stride_d)>(take(G * sizeof(*s.stride_d)));
  s.scales = K::Ops::carve_scales(take, p);
  s.ptr_row = K::kRowScale ? reinterpret_cast<const float**>(take(G * sizeof(float*))) : nullptr;
  s.bytes = off;
  return s;
}

// An operand's stride with the leading dimension `ld` in its dynamic mode: mode 0 (M or N) for
// a K-major operand, mode 1 (K) for an M/N-major one.
template <bool KMajor, class Stride>
__device__ __forceinline__ Stride leading(int64_t ld) {
  Stride s{};
  if constexpr (KMajor) {
    cute::get<0>(s) = ld;
  } else {
    cute::get<1>(s) = ld;
  }
  return s;
}

// Zeros out[0, count) with the grid's threads: 16-byte stores where the span allows, element
// stores for an unaligned head and the tail (an empty expert's wgrad output is its whole M x N
// weight gradient, megabytes, which element stores wrote a thread-iteration at a time).
template <class T>
__device__ void zero_fill(T* out, int64_t count, int64_t tid, int64_t threads) {
  constexpr int64_t kPerVec = 16 / sizeof(T);
  const int64_t misalign = int64_t(reinterpret_cast<uintptr_t>(out) % 16);
  const int64_t head = misalign % int64_t(sizeof(T)) != 0
                           ? count  // not element-aligned to 16 bytes: element stores only
                           : min(count, ((16 - misalign) % 16) / int64_t(sizeof(T)));
  const int64_t vecs = (count - head) / kPerVec;
  for (int64_t i = tid; i < head; i += threads) out[i] = T(0);
  uint4* body = reinterpret_cast<uint4*>(out + head);
  for (int64_t i = tid; i < vecs; i += threads) body[i] = make_uint4(0, 0, 0, 0);
  for (int64_t i = head + vecs * kPerVec + tid; i < count; i += threads) out[i] = T(0);
}

// Block 0 writes the per-group arrays; every block repacks the policy's scales and zero-fills
// what no GEMM tile writes.
template <class K>
__global__ void setup_kernel(const Problem p, GroupArrays<K> s) {
  using Ops = typename K::Ops;
  using ElementA = typename K::ElementA;
  using ElementB = typename K::ElementB;
  using ElementD = typename K::ElementD;
  const ElementA* a = reinterpret_cast<const ElementA*>(p.a);
  const ElementB* b = reinterpret_cast<const ElementB*>(p.b);
  if (blockIdx.x == 0) {
    for (int64_t g = threadIdx.x; g < p.G; g += blockDim.x) {
      const int64_t lo = clamp_start(p.pstarts, g, p.L);
      const int64_t hi = max(lo, clamp_start(p.pstarts, g + 1, p.L));
      // mode 1 slices the token axis of K-major operands: TMA needs each group's first token
      // 16-byte aligned, and Float8Block a group's first token to open a scale block (the
      // caller's token layout block guarantees it). Never silently wrong: trap. (M/N-major
      // operands start a group on a whole row: aligned by M % 8, N % 8.)
      if (p.mode == 1 && hi > lo && (Ops::kAKMajor || Ops::kBKMajor) &&
          (lo % Ops::kTokenAlign) != 0) {
        __trap();
      }
      typename K::StrideD sd{};
      cute::get<1>(sd) = cute::Int<1>{};
      cute::get<0>(sd) = p.N;
      int m, n = int(p.N), k;
      if (p.mode == 0) {
        m = int(hi - lo);
        k = int(p.K);
        s.ptr_a[g] = a + lo * p.K;
        s.ptr_b[g] = b + g * p.N * p.K;
        s.ptr_d[g] = static_cast<ElementD*>(p.out) + lo * p.N;
        s.stride_a[g] = leading<Ops::kAKMajor, typename K::StrideA>(p.K);
        s.stride_b[g] = leading<Ops::kBKMajor, typename K::StrideB>(Ops::kBKMajor ? p.K : p.N);
        if constexpr (K::kRowScale) s.ptr_row[g] = p.row_scale + lo;
      } else {
        m = hi > lo ? int(p.M) : 0;
        k = int(hi - lo);
        s.ptr_a[g] = Ops::kAKMajor ? a + lo : a + lo * p.M;
        s.ptr_b[g] = Ops::kBKMajor ? b + lo : b + lo * p.N;
        s.ptr_d[g] = static_cast<ElementD*>(p.out) + g * p.M * p.N;
        s.stride_a[g] = leading<Ops::kAKMajor, typename K::StrideA>(Ops::kAKMajor ? p.L : p.M);
        s.stride_b[g] = leading<Ops::kBKMajor, typename K::StrideB>(Ops::kBKMajor ? p.L : p.N);
      }
      s.shapes[g] = {m, n, k};
      s.stride_d[g] = sd;
      if constexpr (Ops::kBlockScaled) Ops::set_group_scales(p, s.scales, g, lo, m, n, k);
    }
  }
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t threads = int64_t(gridDim.x) * blockDim.x;
  if constexpr (Ops::kBlockScaled) Ops::repack_scales(p, s.scales, tid, threads);
  ElementD* out = static_cast<ElementD*>(p.out);
  if (p.mode == 0) {
    const int64_t tail = clamp_start(p.pstarts, p.G, p.L);
    zero_fill(out + tail * p.N, (p.L - tail) * p.N, tid, threads);
  } else {
    for (int64_t g = 0; g < p.G; ++g) {
      if (clamp_start(p.pstarts, g + 1, p.L) > clamp_start(p.pstarts, g, p.L)) continue;
      zero_fill(out + g * p.M * p.N, p.M * p.N, tid, threads);
    }
  }
}

// D = alpha[g] * acc in CUTLASS's LinearCombination arguments `fusion`: alpha[g] read per group
// (stride 1 along groups), or the literal 1 when `alpha` is null.
template <class Fusion>
void set_group_alpha(Fusion& fusion, const float* alpha) {
  fusion.alpha = 1.0f;
  fusion.beta = 0.0f;
  fusion.alpha_ptr = alpha;
  fusion.dAlpha = {cute::_0{}, cute::_0{}, alpha ? 1 : 0};
}

// CUTLASS's can_implement / initialize / run of `args` on `stream`: "" or what went wrong.
template <class Gemm>
std::string run_gemm(const typename Gemm::Arguments& args, void* workspace, cudaStream_t stream) {
  Gemm gemm;
  cutlass::Status st = gemm.can_implement(args);
  if (st != cutlass::Status::kSuccess) {
    return std::string("CUTLASS can_implement: ") + cutlassGetStatusString(st);
  }
  st = gemm.initialize(args, workspace, stream);
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

// Runs instance K on `p` (the caller checked that K is the instance `p` asks for). Returns ""
// or what went wrong.
template <class K>
std::string launch(const Problem& p, cudaStream_t stream) {
  using Gemm = typename K::Gemm;
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return cudaGetErrorString(e);
  const GroupArrays<K> arrays = carve<K>(p.workspace, p);

  typename Gemm::Arguments args;
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {int(p.G), arrays.shapes, nullptr};  // shapes live on the device only
  args.mainloop = [&]() -> typename K::GemmKernel::MainloopArguments {
    if constexpr (K::Ops::kBlockScaled) {
      const auto& sc = arrays.scales;
      return {arrays.ptr_a, arrays.stride_a, arrays.ptr_b, arrays.stride_b,
              sc.ptr_sfa,   sc.layout_sfa,   sc.ptr_sfb,   sc.layout_sfb};
    } else {
      return {arrays.ptr_a, arrays.stride_a, arrays.ptr_b, arrays.stride_b};
    }
  }();
  if constexpr (K::kRowScale) {
    if (p.mode != 0 || p.row_scale == nullptr) {
      return "a row-scaled instance needs mode 0 and row_scale";
    }
    // {{alpha, acc, alpha * acc}, row_scale, (.) * row_scale}
    auto& outer = args.epilogue.thread;
    auto& alpha = outer.op_0.op_0;
    alpha.scalars[0] = 1.0f;
    alpha.scalar_ptrs[0] = p.alpha;  // alpha[g] per group (stride 1 along groups) or the 1
    alpha.dScalar[0] = {cute::_0{}, cute::_0{}, p.alpha ? 1 : 0};
    outer.op_1.ptr_col = arrays.ptr_row;
  } else {
    set_group_alpha(args.epilogue.thread, p.alpha);
  }
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
  setup_kernel<K><<<setup_blocks(args.hw_info.sm_count), 256, 0, stream>>>(p, arrays);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return cudaGetErrorString(e);

  return run_gemm<Gemm>(args, static_cast<char*>(p.workspace) + arrays.bytes, stream);
}

}  // namespace sm90
}  // namespace jqffi
