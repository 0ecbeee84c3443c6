// The k-grouped wgrad (ffi/grouped/sm90/sm90_kgrouped.cuh; cooperative and pingpong) outside
// JAX: ragged groups in both layouts (NT, TN) against a float64 host reference (groups ending
// inside a 64-token block, shorter than one, empty, rows of no group; every output element must
// be written), then its time on random data: 64 equal groups of 256 tokens, 128 of 128 and 8 of
// 2048. Exit status 1 when an element is off.
//
//   nvcc -std=c++17 -O3 -DNDEBUG --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a \
//        -Iffi -I<CUTLASS include> bench/kgrouped_check.cu -o kgrouped_check
#include <cuda_runtime.h>
#include <cstdio>
#include <cmath>
#include <vector>
#include <random>
#include <algorithm>
#include "grouped/sm90/sm90_kernel.cuh"
#include "grouped/sm90/sm90_kgrouped.cuh"

using namespace jqffi::sm90;
using Bf = cutlass::bfloat16_t;
template <int LAYOUT, int CFG> using Inst = Instance<DenseOperands<kBF16, kBF16, LAYOUT>, jqffi::kOutF32, CFG>;



// Counts the elements of out [G, M, N] outside `rel` x the float64 sum of |products| of the
// exact group sums alpha[g] * sum_t a(m, t) b(n, t); prints the first few and the worst.
template <class A, class B>
long compare(const char* label, int G, int M, int N, const std::vector<int32_t>& starts,
             const std::vector<float>& out, A a, B b, const std::vector<float>& alpha, double rel) {
  long bad = 0;
  double worst = 0;
  for (int g = 0; g < G; ++g)
    for (int m = 0; m < M; ++m)
      for (int n = 0; n < N; ++n) {
        double ref = 0, mag = 0;
        for (int t = starts[g]; t < starts[g + 1]; ++t) {
          const double x = a(m, t) * b(n, t);
          ref += x;
          mag += std::fabs(x);
        }
        ref *= alpha[g];
        mag *= alpha[g];
        const double got = out[(size_t(g) * M + m) * N + n];
        const double err = std::fabs(got - ref);
        if (!(err <= rel * mag + 1e-30)) {
          if (bad < 5) printf("  g %d m %d n %d: got %g ref %g\n", g, m, n, got, ref);
          ++bad;
        }
        worst = std::max(worst, mag > 0 ? err / mag : err);
      }
  printf("%s check G %d M %d N %d: %ld bad, worst rel %.3g\n", label, G, M, N, bad, worst);
  return bad;
}

template <int LAYOUT, int CFG>
int check(int G, int M, int N, std::vector<int> sizes, unsigned seed) {
  // K-major operands (TN): every group starts on a 16-byte boundary, as the library's token
  // layouts (block 8) guarantee: sizes rounded up to 8 tokens.
  if (LAYOUT == kLayoutTN) for (int& s : sizes) s = (s + 7) / 8 * 8;
  int L = 0; for (int s : sizes) L += s;
  L += 37;  // rows of no group after the last
  L = (L + 7) / 8 * 8;  // K-major rows of 16 bytes
  std::vector<int32_t> starts(G + 1, 0);
  for (int g = 0; g < G; ++g) starts[g + 1] = starts[g] + sizes[g];
  std::mt19937 rng(seed); std::normal_distribution<float> nd;
  std::vector<Bf> a(size_t(L) * M), b(size_t(L) * N);
  for (auto& v : a) v = Bf(nd(rng));
  for (auto& v : b) v = Bf(nd(rng));
  Bf *da, *db; float* dout; int32_t* dstarts; void* ws;
  cudaMalloc(&da, a.size() * 2); cudaMalloc(&db, b.size() * 2);
  cudaMalloc(&dout, size_t(G) * M * N * 4); cudaMalloc(&dstarts, (G + 1) * 4); cudaMalloc(&ws, 1 << 20);
  if (LAYOUT == kLayoutTN) {  // a [M, L], b [N, L]
    std::vector<Bf> at(a.size()), bt(b.size());
    for (int t = 0; t < L; ++t) {
      for (int m = 0; m < M; ++m) at[size_t(m) * L + t] = a[size_t(t) * M + m];
      for (int n = 0; n < N; ++n) bt[size_t(n) * L + t] = b[size_t(t) * N + n];
    }
    cudaMemcpy(da, at.data(), a.size() * 2, cudaMemcpyHostToDevice);
    cudaMemcpy(db, bt.data(), b.size() * 2, cudaMemcpyHostToDevice);
  } else {
    cudaMemcpy(da, a.data(), a.size() * 2, cudaMemcpyHostToDevice);
    cudaMemcpy(db, b.data(), b.size() * 2, cudaMemcpyHostToDevice);
  }
  cudaMemcpy(dstarts, starts.data(), (G + 1) * 4, cudaMemcpyHostToDevice);
  cudaMemset(dout, 0xFF, size_t(G) * M * N * 4);  // NaN: every element must be written
  Problem p; p.mode = 1; p.G = G; p.L = L; p.M = M; p.N = N; p.K = 0; p.pstarts = dstarts;
  p.a = (const uint8_t*)da; p.b = (const uint8_t*)db; p.layout = LAYOUT; p.out = dout;
  p.a_elem = kBF16; p.b_elem = kBF16; p.out_kind = jqffi::kOutF32; p.workspace = ws; p.workspace_bytes = 1 << 20;
  std::string err = launch_kgrouped<Inst<LAYOUT, CFG>>(p, 0);
  cudaError_t e = cudaDeviceSynchronize();
  if (!err.empty() || e != cudaSuccess) { printf("launch: %s / %s\n", err.c_str(), cudaGetErrorString(e)); return 1; }
  std::vector<float> out(size_t(G) * M * N);
  cudaMemcpy(out.data(), dout, out.size() * 4, cudaMemcpyDeviceToHost);
  const char* label = CFG == kCfgKGroupedPingpong ? (LAYOUT == kLayoutTN ? "pingpong bf16 TN" : "pingpong bf16 NT")
                                                 : (LAYOUT == kLayoutTN ? "bf16 TN" : "bf16 NT");
  const long bad = compare(label, G, M, N, starts, out,
      [&](int m, int t) { return double(float(a[size_t(t) * M + m])); },
      [&](int n, int t) { return double(float(b[size_t(t) * N + n])); },
      std::vector<float>(G, 1.0f), 1e-5);
  cudaFree(da); cudaFree(db); cudaFree(dout); cudaFree(dstarts); cudaFree(ws);
  return bad != 0;
}

// Per-tensor FP8 (TN: a [M, L] E4M3, b [N, L] E4M3 or E5M2) with a per-group alpha, float32 out.
template <class EB>
int check_fp8(int G, int M, int N, std::vector<int> sizes, unsigned seed) {
  using EA = cutlass::float_e4m3_t;
  for (int& s : sizes) s = (s + 15) / 16 * 16;  // FP8 group starts on 16 bytes (token block 16)
  int L = 0; for (int s : sizes) L += s;
  L = (L + 37 + 15) / 16 * 16;
  std::vector<int32_t> starts(G + 1, 0);
  for (int g = 0; g < G; ++g) starts[g + 1] = starts[g] + sizes[g];
  std::mt19937 rng(seed); std::normal_distribution<float> nd;
  std::vector<EA> a(size_t(L) * M); std::vector<EB> b(size_t(L) * N);  // [M, L], [N, L]
  for (auto& v : a) v = EA(4.0f * nd(rng));
  for (auto& v : b) v = EB(4.0f * nd(rng));
  std::vector<float> alpha(G);
  for (auto& v : alpha) v = 0.25f + std::fabs(nd(rng));
  EA* da; EB* db; float *dout, *dalpha; int32_t* dstarts; void* ws;
  cudaMalloc(&da, a.size()); cudaMalloc(&db, b.size()); cudaMalloc(&dalpha, G * 4);
  cudaMalloc(&dout, size_t(G) * M * N * 4); cudaMalloc(&dstarts, (G + 1) * 4); cudaMalloc(&ws, 1 << 20);
  cudaMemcpy(da, a.data(), a.size(), cudaMemcpyHostToDevice);
  cudaMemcpy(db, b.data(), b.size(), cudaMemcpyHostToDevice);
  cudaMemcpy(dalpha, alpha.data(), G * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(dstarts, starts.data(), (G + 1) * 4, cudaMemcpyHostToDevice);
  cudaMemset(dout, 0xFF, size_t(G) * M * N * 4);
  Problem p; p.mode = 1; p.G = G; p.L = L; p.M = M; p.N = N; p.pstarts = dstarts;
  p.a = (const uint8_t*)da; p.b = (const uint8_t*)db; p.layout = kLayoutTN; p.out = dout;
  p.alpha = dalpha; p.out_kind = jqffi::kOutF32; p.workspace = ws; p.workspace_bytes = 1 << 20;
  constexpr int kB = std::is_same_v<EB, cutlass::float_e5m2_t> ? kE5M2 : kE4M3;
  p.a_elem = kE4M3; p.b_elem = kB;
  std::string err = launch_kgrouped<Instance<DenseOperands<kE4M3, kB, kLayoutTN>, jqffi::kOutF32,
                                             kCfgKGroupedFp8>>(p, 0);
  cudaError_t e = cudaDeviceSynchronize();
  if (!err.empty() || e != cudaSuccess) { printf("fp8 launch: %s / %s\n", err.c_str(), cudaGetErrorString(e)); return 1; }
  std::vector<float> out(size_t(G) * M * N);
  cudaMemcpy(out.data(), dout, out.size() * 4, cudaMemcpyDeviceToHost);
  // FP8 wgmma sums: the library tests' bound (2^-10)
  const long bad = compare(kB == kE5M2 ? "FP8 e4m3 x e5m2" : "FP8 e4m3 x e4m3", G, M, N, starts,
      out, [&](int m, int t) { return double(float(a[size_t(m) * L + t])); },
      [&](int n, int t) { return double(float(b[size_t(n) * L + t])); }, alpha, 0x1p-10);
  cudaFree(da); cudaFree(db); cudaFree(dout); cudaFree(dalpha); cudaFree(dstarts); cudaFree(ws);
  return bad != 0;
}

// Normal random bfloat16 values (a 1 Mi-value block drawn on the host, repeated): timing on
// constants would understate the tensor cores' power draw.
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

template <class I>
void timing(const char* name, int G, int T, int M, int N) {
  int L = G * T;
  std::vector<int32_t> starts(G + 1);
  for (int g = 0; g <= G; ++g) starts[g] = g * T;
  Bf *da, *db; void *dout; int32_t* dstarts; void* ws;
  cudaMalloc(&da, size_t(L) * M * 2); cudaMalloc(&db, size_t(L) * N * 2);
  cudaMalloc(&dout, size_t(G) * M * N * 4); cudaMalloc(&dstarts, (G + 1) * 4); cudaMalloc(&ws, 4 << 20);
  fill_random(da, size_t(L) * M); fill_random(db, size_t(L) * N);
  cudaMemcpy(dstarts, starts.data(), (G + 1) * 4, cudaMemcpyHostToDevice);
  Problem p; p.mode = 1; p.G = G; p.L = L; p.M = M; p.N = N; p.pstarts = dstarts;
  p.a = (const uint8_t*)da; p.b = (const uint8_t*)db; p.layout = I::kLayout; p.out = dout;
  p.a_elem = p.b_elem = I::kElem; p.out_kind = I::kOut; p.workspace = ws; p.workspace_bytes = 4 << 20;
  for (int i = 0; i < 5; ++i) I::run(p);
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  cudaEventRecord(e0);
  for (int i = 0; i < 50; ++i) I::run(p);
  cudaEventRecord(e1); cudaEventSynchronize(e1);
  float ms; cudaEventElapsedTime(&ms, e0, e1);
  printf("%-40s G %d x %d tokens, M %d N %d: %.1f us (%s)\n", name, G, T, M, N, 1000 * ms / 50,
         cudaGetErrorString(cudaGetLastError()));
  cudaFree(da); cudaFree(db); cudaFree(dout); cudaFree(dstarts); cudaFree(ws);
}

template <int OUT, int CFG, int LAYOUT = kLayoutNT> struct T {
  static constexpr int kLayout = LAYOUT;
  static constexpr int kElem = kBF16;
  using K = Instance<DenseOperands<kBF16, kBF16, LAYOUT>, OUT, CFG>;
  static std::string run(const Problem& p) { return launch_kgrouped<K>(p, 0); }
  static constexpr int kOut = OUT;
};

// FP8 E4M3 x E4M3 -> bf16 of configuration CFG (k-grouped or pointer-array) for `timing`.
template <int CFG> struct F {
  static constexpr int kLayout = kLayoutTN;
  static constexpr int kOut = jqffi::kOutBF16;
  static constexpr int kElem = kE4M3;
  static std::string run(const Problem& p) {
    return run_instance<kE4M3, kE4M3, jqffi::kOutBF16, CFG, kLayoutTN, kEpiAlpha>(p, 0);
  }
};

int main() {
  int bad = 0;
  for (int layout = 0; layout < 2; ++layout) {
    auto run = [&](int G, int M, int N, std::vector<int> sizes, unsigned seed) {
      bad += layout == 0 ? check<kLayoutNT, kCfgKGrouped>(G, M, N, sizes, seed)
                         : check<kLayoutTN, kCfgKGrouped>(G, M, N, sizes, seed);
      bad += layout == 0 ? check<kLayoutNT, kCfgKGroupedPingpong>(G, M, N, sizes, seed)
                         : check<kLayoutTN, kCfgKGroupedPingpong>(G, M, N, sizes, seed);
    };
    run(5, 256, 128, {100, 0, 64, 1, 300}, 1);
    run(4, 512, 256, {129, 63, 0, 0}, 2);
    run(3, 256, 384, {0, 0, 0}, 3);
    run(7, 768, 128, {65, 127, 128, 191, 5, 64, 250}, 4);
    run(6, 136, 200, {33, 7, 64, 70, 0, 100}, 5);
  }
  bad += check_fp8<cutlass::float_e4m3_t>(5, 256, 128, {100, 0, 64, 1, 300}, 11);
  bad += check_fp8<cutlass::float_e5m2_t>(7, 384, 256, {65, 127, 128, 191, 5, 64, 250}, 12);
  bad += check_fp8<cutlass::float_e5m2_t>(3, 136, 200, {0, 17, 0}, 13);
  for (int round = 0; round < 2; ++round) {
    timing<T<jqffi::kOutBF16, kCfgKGrouped>>("kgrouped NT -> bf16", 64, 256, 2048, 1408);
    timing<T<jqffi::kOutBF16, kCfgKGroupedPingpong>>("pingpong NT -> bf16", 64, 256, 2048, 1408);
    timing<T<jqffi::kOutBF16, kCfgKGrouped, kLayoutTN>>("kgrouped TN -> bf16", 64, 256, 2048, 1408);
    timing<T<jqffi::kOutBF16, kCfgKGroupedPingpong, kLayoutTN>>("pingpong TN -> bf16", 64, 256, 2048, 1408);
    timing<T<jqffi::kOutF32, kCfgKGrouped>>("kgrouped NT -> f32", 64, 256, 2048, 1408);
    timing<T<jqffi::kOutF32, kCfgKGroupedPingpong>>("pingpong NT -> f32", 64, 256, 2048, 1408);
    timing<T<jqffi::kOutBF16, kCfgKGrouped>>("kgrouped NT -> bf16", 128, 128, 2048, 1408);
    timing<T<jqffi::kOutBF16, kCfgKGroupedPingpong>>("pingpong NT -> bf16", 128, 128, 2048, 1408);
    timing<T<jqffi::kOutBF16, kCfgKGrouped>>("kgrouped NT -> bf16", 8, 2048, 4096, 14336);
    timing<T<jqffi::kOutBF16, kCfgKGroupedPingpong>>("pingpong NT -> bf16", 8, 2048, 4096, 14336);
  }
  timing<F<kCfgKGroupedFp8>>("kgrouped FP8 TN -> bf16", 64, 256, 2048, 1408);
  timing<F<kCfgC2x1>>("pointer-array c2x1 FP8 TN -> bf16", 64, 256, 2048, 1408);
  timing<F<kCfgDefault>>("pointer-array default FP8 TN -> bf16", 64, 256, 2048, 1408);
  timing<F<kCfgKGroupedFp8>>("kgrouped FP8 TN -> bf16", 8, 2048, 4096, 14336);
  timing<F<kCfgC2x1>>("pointer-array c2x1 FP8 TN -> bf16", 8, 2048, 4096, 14336);
  printf(bad ? "FAILED\n" : "ALL OK\n");
  return bad != 0;
}
