// Half row tiles (ffi/grouped/sm90/sm90_halftile.cuh, kCfgBf16HalfTile) outside JAX: ragged
// groups in both layouts (TN: b [G, N, K]; NN: b [G, K, N]) and both outputs against a float64
// host reference and bit for bit against kCfgBf16 (the same tile and k-order: every stored
// row's sums are the same instructions), groups of 0, 1, 63,
// 64, 65, 127, 128, 129 rows, rows past the last group (must be zero), an alpha per group; then
// its time against kCfgBf16 on random data: 64 groups of multinomially drawn sizes over 16384
// rows (the forward: K 2048, N 1408; the dgrad: K 1408, N 2048), equal groups, and 8 groups of
// 2048 rows (K 4096, N 14336). Exit status 1 when an element is off.
//
//   nvcc -std=c++17 -O3 -DNDEBUG --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a \
//        -Iffi -I<CUTLASS include> bench/halftile_check.cu -o halftile_check
#include <cuda_runtime.h>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>
#include "grouped/sm90/sm90_kernel.cuh"

using namespace jqffi::sm90;
using Bf = cutlass::bfloat16_t;

template <int LAYOUT, int OUT, int CFG>
std::string run(const Problem& p) {
  return run_instance<kBF16, kBF16, OUT, CFG, LAYOUT, kEpiAlpha>(p, 0);
}

constexpr size_t kWorkspace = size_t(8) << 20;

struct Case {
  int G, K, N;
  std::vector<int> sizes;
  int tail;  // rows past the last group
};

template <int LAYOUT, int OUT>
int check(const Case& c, unsigned seed, bool with_alpha) {
  using Out = typename OutputOf<OUT>::type;
  const int G = c.G, K = c.K, N = c.N;
  int L = c.tail;
  for (int s : c.sizes) L += s;
  std::vector<int32_t> starts(G + 1, 0);
  for (int g = 0; g < G; ++g) starts[g + 1] = starts[g] + c.sizes[g];
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::vector<Bf> a(size_t(L) * K), b(size_t(G) * N * K);
  for (auto& v : a) v = Bf(nd(rng));
  for (auto& v : b) v = Bf(nd(rng));
  std::vector<float> alpha(G, 1.0f);
  if (with_alpha) for (auto& v : alpha) v = 0.25f + std::fabs(nd(rng));
  // b(g, n, k): TN stores [G, N, K], NN stores [G, K, N]
  auto bidx = [&](int g, int n, int k) {
    return LAYOUT == kLayoutTN ? (size_t(g) * N + n) * K + k : (size_t(g) * K + k) * N + n;
  };
  Bf *da, *db; Out *dout, *dref; float* dalpha; int32_t* dstarts; void* ws;
  cudaMalloc(&da, a.size() * 2); cudaMalloc(&db, b.size() * 2);
  cudaMalloc(&dout, size_t(L) * N * sizeof(Out)); cudaMalloc(&dref, size_t(L) * N * sizeof(Out));
  cudaMalloc(&dalpha, G * 4); cudaMalloc(&dstarts, (G + 1) * 4); cudaMalloc(&ws, kWorkspace);
  cudaMemcpy(da, a.data(), a.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(db, b.data(), b.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dalpha, alpha.data(), G * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(dstarts, starts.data(), (G + 1) * 4, cudaMemcpyHostToDevice);
  cudaMemset(dout, 0xFF, size_t(L) * N * sizeof(Out));  // NaN: every element must be written
  cudaMemset(dref, 0xFF, size_t(L) * N * sizeof(Out));
  Problem p; p.mode = 0; p.G = G; p.L = L; p.M = 0; p.N = N; p.K = K; p.pstarts = dstarts;
  p.a = (const uint8_t*)da; p.b = (const uint8_t*)db; p.layout = LAYOUT;
  p.alpha = with_alpha ? dalpha : nullptr;
  p.a_elem = p.b_elem = kBF16; p.out_kind = OUT; p.workspace = ws; p.workspace_bytes = kWorkspace;
  p.out = dout;
  std::string err = run<LAYOUT, OUT, kCfgBf16HalfTile>(p);
  p.out = dref;
  std::string err_ref = run<LAYOUT, OUT, kCfgBf16>(p);
  cudaError_t e = cudaDeviceSynchronize();
  const char* label = LAYOUT == kLayoutTN ? (OUT == jqffi::kOutBF16 ? "TN -> bf16" : "TN -> f32")
                                          : (OUT == jqffi::kOutBF16 ? "NN -> bf16" : "NN -> f32");
  if (!err.empty() || !err_ref.empty() || e != cudaSuccess) {
    printf("%s launch: %s / %s / %s\n", label, err.c_str(), err_ref.c_str(), cudaGetErrorString(e));
    return 1;
  }
  std::vector<Out> out(size_t(L) * N), ref(size_t(L) * N);
  cudaMemcpy(out.data(), dout, out.size() * sizeof(Out), cudaMemcpyDeviceToHost);
  cudaMemcpy(ref.data(), dref, ref.size() * sizeof(Out), cudaMemcpyDeviceToHost);
  // bfloat16 output: one rounding (2^-8 relative) over float32 sums
  const double rel = OUT == jqffi::kOutBF16 ? 0x1p-8 : 0.0;
  long bad = 0, unequal = 0;
  double worst = 0;
  for (int g = 0; g <= G; ++g) {
    const int lo = g < G ? starts[g] : starts[G], hi = g < G ? starts[g + 1] : L;
    for (int r = lo; r < hi; ++r)
      for (int n = 0; n < N; ++n) {
        double want = 0, mag = 0;
        if (g < G) {
          for (int k = 0; k < K; ++k) {
            const double x = double(float(a[size_t(r) * K + k])) * double(float(b[bidx(g, n, k)]));
            want += x; mag += std::fabs(x);
          }
          want *= alpha[g]; mag *= alpha[g];
        }
        const double got = double(float(out[size_t(r) * N + n]));
        const double err2 = std::fabs(got - want);
        if (!(err2 <= rel * std::fabs(want) + 1e-5 * mag + 1e-30)) {
          if (bad < 5) printf("  g %d row %d n %d: got %g want %g\n", g, r, n, got, want);
          ++bad;
        }
        worst = std::max(worst, mag > 0 ? err2 / mag : err2);
        if (std::memcmp(&out[size_t(r) * N + n], &ref[size_t(r) * N + n], sizeof(Out)) != 0) ++unequal;
      }
  }
  printf("%s G %d K %d N %d L %d alpha %d: %ld bad, worst rel %.3g, %ld differ from kCfgBf16\n",
         label, G, K, N, L, int(with_alpha), bad, worst, unequal);
  cudaFree(da); cudaFree(db); cudaFree(dout); cudaFree(dref); cudaFree(dalpha); cudaFree(dstarts);
  cudaFree(ws);
  return bad != 0 || unequal != 0;
}

// Normal random bfloat16 values (a 1 Mi-value block drawn on the host, repeated).
void fill_random(Bf* d, size_t n) {
  static std::vector<Bf> block;
  if (block.empty()) {
    std::mt19937 rng(7); std::normal_distribution<float> nd;
    block.resize(size_t(1) << 20);
    for (auto& v : block) v = Bf(nd(rng));
  }
  for (size_t i = 0; i < n; i += block.size()) {
    cudaMemcpy(d + i, block.data(), std::min(block.size(), n - i) * 2, cudaMemcpyHostToDevice);
  }
}

// Group sizes of T rows routed uniformly at random to G groups (seeded), or equal.
std::vector<int> group_sizes(int G, int T, bool drawn, unsigned seed) {
  std::vector<int> sizes(G, drawn ? 0 : T / G);
  if (drawn) {
    std::mt19937 rng(seed);
    std::uniform_int_distribution<int> pick(0, G - 1);
    for (int t = 0; t < T; ++t) ++sizes[pick(rng)];
  }
  return sizes;
}

template <int LAYOUT, int CFG>
double time_us(const std::vector<int>& sizes, int K, int N, bool raster_n = false) {
  const int G = int(sizes.size());
  int L = 0;
  for (int s : sizes) L += s;
  std::vector<int32_t> starts(G + 1, 0);
  for (int g = 0; g < G; ++g) starts[g + 1] = starts[g] + sizes[g];
  Bf *da, *db, *dout; int32_t* dstarts; void* ws;
  cudaMalloc(&da, size_t(L) * K * 2); cudaMalloc(&db, size_t(G) * N * K * 2);
  cudaMalloc(&dout, size_t(L) * N * 2); cudaMalloc(&dstarts, (G + 1) * 4); cudaMalloc(&ws, kWorkspace);
  fill_random(da, size_t(L) * K); fill_random(db, size_t(G) * N * K);
  cudaMemcpy(dstarts, starts.data(), (G + 1) * 4, cudaMemcpyHostToDevice);
  Problem p; p.mode = 0; p.G = G; p.L = L; p.N = N; p.K = K; p.pstarts = dstarts;
  p.a = (const uint8_t*)da; p.b = (const uint8_t*)db; p.layout = LAYOUT; p.out = dout;
  p.a_elem = p.b_elem = kBF16; p.out_kind = jqffi::kOutBF16; p.workspace = ws;
  p.workspace_bytes = kWorkspace; p.raster_along_n = raster_n;
  std::string err;
  for (int i = 0; i < 5; ++i) err = run<LAYOUT, jqffi::kOutBF16, CFG>(p);
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  cudaEventRecord(e0);
  const int iters = 50;
  for (int i = 0; i < iters; ++i) run<LAYOUT, jqffi::kOutBF16, CFG>(p);
  cudaEventRecord(e1); cudaEventSynchronize(e1);
  float ms; cudaEventElapsedTime(&ms, e0, e1);
  if (!err.empty() || cudaGetLastError() != cudaSuccess) printf("  timing error: %s\n", err.c_str());
  cudaFree(da); cudaFree(db); cudaFree(dout); cudaFree(dstarts); cudaFree(ws);
  return 1000.0 * ms / iters;
}

template <int LAYOUT>
void compare_times(const char* name, const std::vector<int>& sizes, int K, int N) {
  int L = 0;
  for (int s : sizes) L += s;
  const double f = 2.0 * double(L) * K * N;
  const double ptr = time_us<LAYOUT, kCfgBf16>(sizes, K, N);
  const double half = time_us<LAYOUT, kCfgBf16HalfTile>(sizes, K, N);
  const double ptr2 = time_us<LAYOUT, kCfgBf16>(sizes, K, N);
  const double half2 = time_us<LAYOUT, kCfgBf16HalfTile>(sizes, K, N);
  printf("%-22s %s K %5d N %5d: bf16 %7.1f / %7.1f us (%4.0f TFLOP/s of routed rows), half "
         "tiles %7.1f / %7.1f us (%4.0f)\n", name, LAYOUT == kLayoutTN ? "TN" : "NN", K, N, ptr,
         ptr2, f / std::min(ptr, ptr2) * 1e-6, half, half2, f / std::min(half, half2) * 1e-6);
}

int main() {
  int bad = 0;
  const std::vector<Case> cases = {
      {5, 256, 512, {100, 0, 64, 1, 300}, 37},
      {8, 192, 264, {65, 127, 128, 129, 63, 0, 191, 250}, 0},
      {3, 128, 256, {0, 0, 0}, 20},
      {4, 512, 136, {257, 256, 320, 321}, 5},
  };
  unsigned seed = 1;
  for (const Case& c : cases) {
    bad += check<kLayoutTN, jqffi::kOutBF16>(c, seed, seed % 2 == 0);
    bad += check<kLayoutNN, jqffi::kOutBF16>(c, seed + 100, seed % 2 == 1);
    bad += check<kLayoutTN, jqffi::kOutF32>(c, seed + 200, true);
    ++seed;
  }
  for (int round = 0; round < 2; ++round) {
    const auto drawn = group_sizes(64, 16384, true, 3 + round);
    const auto equal = group_sizes(64, 16384, false, 0);
    compare_times<kLayoutTN>("64 drawn, forward", drawn, 2048, 1408);
    compare_times<kLayoutNN>("64 drawn, forward", drawn, 2048, 1408);
    compare_times<kLayoutTN>("64 drawn, dgrad", drawn, 1408, 2048);
    compare_times<kLayoutNN>("64 drawn, dgrad", drawn, 1408, 2048);
    compare_times<kLayoutTN>("64 equal, forward", equal, 2048, 1408);
    compare_times<kLayoutTN>("8 drawn, forward", group_sizes(8, 16384, true, 9), 4096, 14336);
    compare_times<kLayoutNN>("8 drawn, dgrad", group_sizes(8, 16384, true, 9), 14336, 4096);
  }
  printf(bad ? "FAILED\n" : "ALL OK\n");
  return bad != 0;
}
