// What one TMA descriptor per operand is worth on the 64-expert wgrad (session 25): CUTLASS's
// batched (not pointer-array) Hopper GEMM in several tiles and schedules, the group as the batch
// coordinate, on equal groups (G = 64 x 256 tokens, M 2048, N 1408 by default):
// D[g] (M x N) = A[g] (M x tokens, M-major) * B[g] (tokens x N, N-major), bfloat16, fp32 sums.
// Its rows are the mark for the grouped wgrads (bench/small_groups.py times those).
//
//   nvcc -std=c++17 -O3 -DNDEBUG --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a \
//        -I<CUTLASS include> -I<CUTLASS tools/util/include> bench/cutlass_batched_wgrad.cu \
//        -o cutlass_batched_wgrad && ./cutlass_batched_wgrad [G tokens]
#include <cuda_runtime.h>
#include <cstdio>
#include <vector>
#include <random>
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

using namespace cute;
using Bf16 = cutlass::bfloat16_t;

template <int TM, int TN, int TK, int CM, int CN, bool PP, int STAGES = 0>
struct Run {
  using TileShape = Shape<Int<TM>, Int<TN>, Int<TK>>;
  using ClusterShape = Shape<Int<CM>, Int<CN>, _1>;
  using LayoutA = cutlass::layout::ColumnMajor;
  using LayoutB = cutlass::layout::RowMajor;
  using LayoutD = cutlass::layout::RowMajor;
  using EpiSched = cute::conditional_t<PP, cutlass::epilogue::TmaWarpSpecialized,
                                       cutlass::epilogue::TmaWarpSpecializedCooperative>;
  using KSched = cute::conditional_t<PP, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                                     cutlass::gemm::KernelTmaWarpSpecializedCooperative>;
  using Epi = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD, 8, Bf16,
      LayoutD, 8, EpiSched>::CollectiveOp;
  using Stages = cute::conditional_t<STAGES == 0,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epi::SharedStorage))>,
      cutlass::gemm::collective::StageCount<STAGES>>;
  using Main = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Bf16, LayoutA, 8, Bf16, LayoutB, 8, float,
      TileShape, ClusterShape, Stages, KSched>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Main, Epi>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static void go(const char* name, int M, int N, int K, int L, Bf16* a, Bf16* b, Bf16* d) {
    typename Kernel::StrideA sa = cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, {M, K, L});
    typename Kernel::StrideB sb = cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, {N, K, L});
    typename Kernel::StrideD sd = cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, {M, N, L});
    typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm, {M, N, K, L},
                                  {a, sa, b, sb}, {{1.f, 0.f}, nullptr, sd, d, sd}};
    Gemm gemm;
    size_t ws = Gemm::get_workspace_size(args);
    void* w = nullptr;
    cudaMalloc(&w, ws + 1);
    if (gemm.can_implement(args) != cutlass::Status::kSuccess) { printf("%s: cannot\n", name); return; }
    if (gemm.initialize(args, w) != cutlass::Status::kSuccess) { printf("%s: init failed\n", name); return; }
    for (int i = 0; i < 5; ++i) gemm.run();
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0); cudaEventCreate(&e1);
    const int iters = 50;
    cudaEventRecord(e0);
    for (int i = 0; i < iters; ++i) gemm.run();
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms = 0; cudaEventElapsedTime(&ms, e0, e1);
    double us = 1000.0 * ms / iters;
    printf("%-34s %8.1f us  %6.1f TFLOP/s  stages %d  smem %d  %s\n", name, us,
           2.0 * M * N * double(K) * L / us * 1e-6, int(Main::DispatchPolicy::Stages),
           int(sizeof(typename Kernel::SharedStorage)), cudaGetErrorString(cudaGetLastError()));
    cudaFree(w);
  }
};

int main(int argc, char** argv) {
  int G = 64, T = 256, M = 2048, N = 1408;
  if (argc > 2) { G = atoi(argv[1]); T = atoi(argv[2]); }
  size_t na = size_t(G) * T * M, nb = size_t(G) * T * N, nd = size_t(G) * M * N;
  std::vector<Bf16> h(std::max(na, nb));
  std::mt19937 rng(1);
  std::normal_distribution<float> nd01;
  for (auto& v : h) v = Bf16(nd01(rng));
  Bf16 *a, *b, *d;
  cudaMalloc(&a, na * 2); cudaMalloc(&b, nb * 2); cudaMalloc(&d, nd * 2);
  cudaMemcpy(a, h.data(), na * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(b, h.data(), nb * 2, cudaMemcpyHostToDevice);
  printf("batched wgrad: G %d, tokens %d, M %d, N %d\n", G, T, M, N);
  Run<256, 128, 64, 2, 1, false>::go("coop 256x128x64 c2x1", M, N, T, G, a, b, d);
  Run<128, 256, 64, 1, 2, false>::go("coop 128x256x64 c1x2", M, N, T, G, a, b, d);
  Run<128, 128, 64, 1, 2, false>::go("coop 128x128x64 c1x2", M, N, T, G, a, b, d);
  Run<128, 128, 64, 1, 2, true>::go("pingpong 128x128x64 c1x2", M, N, T, G, a, b, d);
  Run<128, 128, 64, 2, 1, true>::go("pingpong 128x128x64 c2x1", M, N, T, G, a, b, d);
  Run<128, 128, 64, 1, 1, true>::go("pingpong 128x128x64 c1x1", M, N, T, G, a, b, d);
  Run<128, 128, 64, 1, 2, true, 6>::go("pingpong 128x128x64 c1x2 s6", M, N, T, G, a, b, d);
  Run<64, 256, 64, 1, 2, true>::go("pingpong 64x256x64 c1x2", M, N, T, G, a, b, d);
  return 0;
}
