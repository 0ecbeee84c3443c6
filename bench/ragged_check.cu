// The ragged-rows GEMM (ffi/grouped/sm90/sm90_ragged.cuh) outside JAX: ragged groups in both
// bfloat16 layouts (TN, NN) and per-tensor FP8 (TN, per-group alpha) against a float64 host
// reference (groups shorter than a tile, ending inside one, empty, rows of no group, which must
// read zero; every output element must be written), then its time against the pointer-array
// instance of the same tile on 64 equal groups of 256 rows (fprop NN K 2048 N 1408, dgrad TN
// K 1408 N 2048) and 8 of 2048 (K 4096, N 14336). Exit status 1 when an element is off.
//
//   nvcc -std=c++17 -O3 -DNDEBUG --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a \
//        -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED -Iffi -I<CUTLASS include> bench/ragged_check.cu -o ragged_check
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "grouped/sm90/sm90_kernel.cuh"
#include "grouped/sm90/sm90_ragged.cuh"

using namespace jqffi::sm90;
using Bf = cutlass::bfloat16_t;

// Tiles measured here only (no instances in the library).
constexpr int kCfgM256C1x1 = 100, kCfgN256C1x1 = 101;
namespace jqffi::sm90 {
template <> struct TileConfig<kCfgM256C1x1> : Tiles<256, 128, 64, 1, 1> {};
template <> struct TileConfig<kCfgN256C1x1> : Tiles<128, 256, 64, 1, 1> {};
}  // namespace jqffi::sm90

// Counts the elements of out [L, N] outside `rel` x the float64 sum of |products| of
// alpha[g] * sum_k a(r, k) b(g, n, k) for the rows of group g, 0 for rows of no group.
template <class A, class B, class Out>
long compare(const char* label, int G, int L, int N, int K, const std::vector<int32_t>& starts,
             const Out& out, A a, B b, const std::vector<float>& alpha, double rel) {
  long bad = 0;
  double worst = 0;
  std::vector<int> group(L, -1);
  for (int g = 0; g < G; ++g)
    for (int r = starts[g]; r < starts[g + 1]; ++r) group[r] = g;
  for (int r = 0; r < L; ++r)
    for (int n = 0; n < N; ++n) {
      const int g = group[r];
      double ref = 0, mag = 0;
      if (g >= 0) {
        for (int k = 0; k < K; ++k) {
          const double x = a(r, k) * b(g, n, k);
          ref += x;
          mag += std::fabs(x);
        }
        ref *= alpha[g];
        mag *= alpha[g];
      }
      const double got = out(r, n);
      const double err = std::fabs(got - ref);
      if (!(err <= rel * mag + 1e-30)) {
        if (bad < 5) printf("  row %d (group %d) n %d: got %g ref %g\n", r, g, n, got, ref);
        ++bad;
      }
      worst = std::max(worst, mag > 0 ? err / mag : err);
    }
  printf("%s check G %d L %d N %d K %d: %ld bad, worst rel %.3g\n", label, G, L, N, K, bad, worst);
  return bad;
}

std::vector<int32_t> starts_of(const std::vector<int>& sizes) {
  std::vector<int32_t> starts(sizes.size() + 1, 0);
  for (size_t g = 0; g < sizes.size(); ++g) starts[g + 1] = starts[g] + sizes[g];
  return starts;
}

// bfloat16 a [L, K] x b (TN: [G, N, K]; NN: [G, K, N]) -> OUT, configuration CFG.
template <int LAYOUT, int OUT, int CFG>
int check(int N, int K, std::vector<int> sizes, int tail, unsigned seed) {
  using D = typename OutputOf<OUT>::type;
  const int G = int(sizes.size());
  const std::vector<int32_t> starts = starts_of(sizes);
  const int L = starts[G] + tail;
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::vector<Bf> a(size_t(L) * K), b(size_t(G) * N * K);
  for (auto& v : a) v = Bf(nd(rng));
  for (auto& v : b) v = Bf(nd(rng));
  Bf *da, *db;
  D* dout;
  int32_t* dstarts;
  void* ws;
  cudaMalloc(&da, a.size() * 2);
  cudaMalloc(&db, b.size() * 2);
  cudaMalloc(&dout, size_t(L) * N * sizeof(D));
  cudaMalloc(&dstarts, (G + 1) * 4);
  cudaMalloc(&ws, 1 << 20);
  cudaMemcpy(da, a.data(), a.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(db, b.data(), b.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dstarts, starts.data(), (G + 1) * 4, cudaMemcpyHostToDevice);
  cudaMemset(dout, 0xFF, size_t(L) * N * sizeof(D));  // NaN: every element must be written
  Problem p;
  p.mode = 0; p.G = G; p.L = L; p.N = N; p.K = K; p.pstarts = dstarts;
  p.a = (const uint8_t*)da; p.b = (const uint8_t*)db; p.layout = LAYOUT; p.out = dout;
  p.a_elem = p.b_elem = kBF16; p.out_kind = OUT; p.workspace = ws; p.workspace_bytes = 1 << 20;
  std::string err = launch_ragged<Instance<DenseOperands<kBF16, kBF16, LAYOUT>, OUT, CFG>>(p, 0);
  cudaError_t e = cudaDeviceSynchronize();
  if (!err.empty() || e != cudaSuccess) {
    printf("launch: %s / %s\n", err.c_str(), cudaGetErrorString(e));
    return 1;
  }
  std::vector<D> out(size_t(L) * N);
  cudaMemcpy(out.data(), dout, out.size() * sizeof(D), cudaMemcpyDeviceToHost);
  char label[64];
  snprintf(label, sizeof label, "bf16 %s -> %s cfg %d", LAYOUT == kLayoutTN ? "TN" : "NN",
           OUT == jqffi::kOutF32 ? "f32" : "bf16", CFG);
  // bfloat16 output: one rounding (2^-8 relative) on top of the float32 sum
  const double rel = OUT == jqffi::kOutF32 ? 1e-5 : 0x1p-8;
  const long bad = compare(
      label, G, L, N, K, starts, [&](int r, int n) { return double(float(out[size_t(r) * N + n])); },
      [&](int r, int k) { return double(float(a[size_t(r) * K + k])); },
      [&](int g, int n, int k) {
        return double(float(LAYOUT == kLayoutTN ? b[(size_t(g) * N + n) * K + k]
                                                : b[(size_t(g) * K + k) * N + n]));
      },
      std::vector<float>(G, 1.0f), rel);
  cudaFree(da); cudaFree(db); cudaFree(dout); cudaFree(dstarts); cudaFree(ws);
  return bad != 0;
}

// Per-tensor FP8 (TN: a [L, K] E4M3, b [G, N, K] E4M3) with a per-group alpha -> float32.
int check_fp8(int N, int K, std::vector<int> sizes, int tail, unsigned seed) {
  using E = cutlass::float_e4m3_t;
  const int G = int(sizes.size());
  const std::vector<int32_t> starts = starts_of(sizes);
  const int L = starts[G] + tail;
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::vector<E> a(size_t(L) * K), b(size_t(G) * N * K);
  for (auto& v : a) v = E(4.0f * nd(rng));
  for (auto& v : b) v = E(4.0f * nd(rng));
  std::vector<float> alpha(G);
  for (auto& v : alpha) v = 0.25f + std::fabs(nd(rng));
  E *da, *db;
  float *dout, *dalpha;
  int32_t* dstarts;
  void* ws;
  cudaMalloc(&da, a.size()); cudaMalloc(&db, b.size()); cudaMalloc(&dalpha, G * 4);
  cudaMalloc(&dout, size_t(L) * N * 4); cudaMalloc(&dstarts, (G + 1) * 4); cudaMalloc(&ws, 1 << 20);
  cudaMemcpy(da, a.data(), a.size(), cudaMemcpyHostToDevice);
  cudaMemcpy(db, b.data(), b.size(), cudaMemcpyHostToDevice);
  cudaMemcpy(dalpha, alpha.data(), G * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(dstarts, starts.data(), (G + 1) * 4, cudaMemcpyHostToDevice);
  cudaMemset(dout, 0xFF, size_t(L) * N * 4);
  Problem p;
  p.mode = 0; p.G = G; p.L = L; p.N = N; p.K = K; p.pstarts = dstarts;
  p.a = (const uint8_t*)da; p.b = (const uint8_t*)db; p.layout = kLayoutTN; p.out = dout;
  p.alpha = dalpha; p.a_elem = p.b_elem = kE4M3; p.out_kind = jqffi::kOutF32;
  p.workspace = ws; p.workspace_bytes = 1 << 20;
  std::string err = launch_ragged<Instance<DenseOperands<kE4M3, kE4M3, kLayoutTN>, jqffi::kOutF32,
                                           kCfgC2x1>>(p, 0);
  cudaError_t e = cudaDeviceSynchronize();
  if (!err.empty() || e != cudaSuccess) {
    printf("fp8 launch: %s / %s\n", err.c_str(), cudaGetErrorString(e));
    return 1;
  }
  std::vector<float> out(size_t(L) * N);
  cudaMemcpy(out.data(), dout, out.size() * 4, cudaMemcpyDeviceToHost);
  const long bad = compare(
      "FP8 e4m3 TN -> f32", G, L, N, K, starts,
      [&](int r, int n) { return double(out[size_t(r) * N + n]); },
      [&](int r, int k) { return double(float(a[size_t(r) * K + k])); },
      [&](int g, int n, int k) { return double(float(b[(size_t(g) * N + n) * K + k])); }, alpha,
      0x1p-10);
  cudaFree(da); cudaFree(db); cudaFree(dout); cudaFree(dalpha); cudaFree(dstarts); cudaFree(ws);
  return bad != 0;
}

// Random operand bytes: bfloat16 values in [-1, 1), or FP8 codes with the top exponent bit
// cleared (finite, |v| < 2). Random rather than constant data: the tensor cores' power (and so
// the clock) depends on the bits they switch.
__global__ void fill_random(uint8_t* p, size_t n, int elem_bytes, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n / elem_bytes;
       i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 15; h *= 2246822519u; h ^= h >> 13; h *= 3266489917u; h ^= h >> 16;
    if (elem_bytes == 2) {
      reinterpret_cast<Bf*>(p)[i] = Bf(float(h >> 8) * 0x1p-23f - 1.0f);
    } else {
      p[i] = uint8_t(h) & 0xBF;
    }
  }
}

// Mean time of 50 runs of `run(p)` on G equal groups of T rows, a [G T, K], b [G, K, N] or
// [G, N, K] (random values).
template <class Run>
void timing(const char* name, int elem_bytes, int G, int T, int K, int N, int layout, int elem,
            Run run) {
  const int L = G * T;
  std::vector<int32_t> starts(G + 1);
  for (int g = 0; g <= G; ++g) starts[g] = g * T;
  void *da, *db, *dout, *ws;
  int32_t* dstarts;
  cudaMalloc(&da, size_t(L) * K * elem_bytes); cudaMalloc(&db, size_t(G) * N * K * elem_bytes);
  cudaMalloc(&dout, size_t(L) * N * 2); cudaMalloc(&dstarts, (G + 1) * 4);
  cudaMalloc(&ws, 4 << 20);
  fill_random<<<1024, 256>>>((uint8_t*)da, size_t(L) * K * elem_bytes, elem_bytes, 1);
  fill_random<<<1024, 256>>>((uint8_t*)db, size_t(G) * N * K * elem_bytes, elem_bytes, 2);
  cudaMemcpy(dstarts, starts.data(), (G + 1) * 4, cudaMemcpyHostToDevice);
  Problem p;
  p.mode = 0; p.G = G; p.L = L; p.N = N; p.K = K; p.pstarts = dstarts;
  p.a = (const uint8_t*)da; p.b = (const uint8_t*)db; p.layout = layout; p.out = dout;
  p.a_elem = p.b_elem = elem; p.out_kind = jqffi::kOutBF16;
  p.workspace = ws; p.workspace_bytes = 4 << 20;
  std::string err;
  for (int i = 0; i < 5; ++i) err += run(p);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0); cudaEventCreate(&e1);
  cudaEventRecord(e0);
  for (int i = 0; i < 50; ++i) run(p);
  cudaEventRecord(e1);
  cudaEventSynchronize(e1);
  float ms;
  cudaEventElapsedTime(&ms, e0, e1);
  printf("%-44s G %d x %d rows, K %d N %d: %7.1f us (%s%s)\n", name, G, T, K, N, 1000 * ms / 50,
         cudaGetErrorString(cudaGetLastError()), err.c_str());
  cudaFree(da); cudaFree(db); cudaFree(dout); cudaFree(dstarts); cudaFree(ws);
}

template <int LAYOUT, int CFG>
std::string ragged_bf16(const Problem& p) {
  return launch_ragged<Instance<DenseOperands<kBF16, kBF16, LAYOUT>, jqffi::kOutBF16, CFG>>(p, 0);
}
template <int LAYOUT, int CFG>
std::string pointer_bf16(const Problem& p) {
  return run_instance<kBF16, kBF16, jqffi::kOutBF16, CFG, LAYOUT, kEpiAlpha>(p, 0);
}
template <int CFG>
std::string ragged_fp8(const Problem& p) {
  return launch_ragged<Instance<DenseOperands<kE4M3, kE4M3, kLayoutTN>, jqffi::kOutBF16, CFG>>(p, 0);
}
template <int CFG>
std::string pointer_fp8(const Problem& p) {
  return run_instance<kE4M3, kE4M3, jqffi::kOutBF16, CFG, kLayoutTN, kEpiAlpha>(p, 0);
}

int main(int argc, char** argv) {
  int bad = 0;
#ifdef RAGGED_QUICK  // one case from the command line (N K tail sizes...), for debugging
  if (argc > 4) {
    std::vector<int> sizes;
    for (int i = 4; i < argc; ++i) sizes.push_back(atoi(argv[i]));
    bad += check<kLayoutTN, jqffi::kOutF32, kCfgBf16C2x1>(atoi(argv[1]), atoi(argv[2]), sizes,
                                                          atoi(argv[3]), 1);
  }
  printf(bad ? "FAILED\n" : "ALL OK\n");
  return bad != 0;
#endif
  const std::vector<int> ragged = {100, 0, 128, 1, 300, 129, 0, 255, 77};
  const std::vector<int> tiny = {5, 0, 3};
  bad += check<kLayoutTN, jqffi::kOutF32, kCfgBf16C2x1>(264, 192, ragged, 37, 1);
  bad += check<kLayoutNN, jqffi::kOutF32, kCfgBf16C2x1>(264, 192, ragged, 37, 2);
  bad += check<kLayoutNN, jqffi::kOutBF16, kCfgBf16C2x1>(136, 200, ragged, 0, 3);
  bad += check<kLayoutTN, jqffi::kOutBF16, kCfgBf16>(520, 72, ragged, 300, 4);
  bad += check<kLayoutNN, jqffi::kOutF32, kCfgBf16M256>(256, 128, ragged, 1, 5);
  bad += check<kLayoutTN, jqffi::kOutF32, kCfgBf16C2x1>(64, 64, tiny, 0, 6);
  bad += check<kLayoutNN, jqffi::kOutF32, kCfgBf16C2x1>(64, 64, {0, 0}, 50, 7);
  bad += check_fp8(264, 256, ragged, 37, 11);
  bad += check_fp8(128, 384, tiny, 130, 12);

  // 64 experts (Qwen-MoE-like): fprop NN K 2048 N 1408, dgrad TN K 1408 N 2048
  for (int rep = 0; rep < 2; ++rep) {
    timing("ragged bf16 NN c2x1 128x256", 2, 64, 256, 2048, 1408, kLayoutNN, kBF16, ragged_bf16<kLayoutNN, kCfgBf16C2x1>);
    timing("ragged bf16 NN c1x1 256x128", 2, 64, 256, 2048, 1408, kLayoutNN, kBF16, ragged_bf16<kLayoutNN, kCfgM256C1x1>);
    timing("ragged bf16 NN c1x1 128x256", 2, 64, 256, 2048, 1408, kLayoutNN, kBF16, ragged_bf16<kLayoutNN, kCfgN256C1x1>);
    timing("pointer-array bf16 NN c2x1 128x256", 2, 64, 256, 2048, 1408, kLayoutNN, kBF16, pointer_bf16<kLayoutNN, kCfgBf16C2x1>);
    timing("ragged bf16 TN c2x1 128x256", 2, 64, 256, 1408, 2048, kLayoutTN, kBF16, ragged_bf16<kLayoutTN, kCfgBf16C2x1>);
    timing("ragged bf16 TN c1x1 256x128", 2, 64, 256, 1408, 2048, kLayoutTN, kBF16, ragged_bf16<kLayoutTN, kCfgM256C1x1>);
    timing("pointer-array bf16 TN c2x1 128x256", 2, 64, 256, 1408, 2048, kLayoutTN, kBF16, pointer_bf16<kLayoutTN, kCfgBf16C2x1>);
    timing("ragged FP8 TN c2x1 128x128", 1, 64, 256, 2048, 1408, kLayoutTN, kE4M3, ragged_fp8<kCfgC2x1>);
    timing("ragged FP8 TN c1x1 128x128", 1, 64, 256, 2048, 1408, kLayoutTN, kE4M3, ragged_fp8<kCfgC1x1>);
    timing("pointer-array FP8 TN n176", 1, 64, 256, 2048, 1408, kLayoutTN, kE4M3, pointer_fp8<kCfgN176>);
  }
  printf(bad ? "FAILED\n" : "ALL OK\n");
  return bad != 0;
}
