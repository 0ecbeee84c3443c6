// Stress test of the wgmma-dequant GEMM kernel outside JAX (repeated launches, fresh inputs).
//
// The kernel's float32 accumulation order is fixed, so every launch on the same inputs must give
// the same bits; a launch that differs, or an element outside the float32 accumulation-order
// tolerance of a float64 reference, is a race (or a decode bug). Also small enough to run under
// compute-sanitizer (racecheck / synccheck / memcheck).
//
//   nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -Iffi bench/dequant_stress.cu \
//        -o dequant_stress
//   ./dequant_stress M N K ROUNDS LAUNCHES [pair: mx-nv | mx-mx | nv-nv] [seed]
//
// Prints one line per round and a summary; exit status 1 when any launch or element is off.
// Build with -I<dir> pointing at another copy of ffi/gemm (e.g. an older kernel) to compare.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gemm/dequant_launch.cuh"
#include "cuda_check.h"

using jqffi::DequantOperand;
using jqffi::DequantParams;
using jqffi::Elem;

namespace jqffi {
template cudaError_t launch_dequant_gemm<Elem::kE5M2, Elem::kE2M1>(const DequantParams&,
                                                                   cudaStream_t);
template cudaError_t launch_dequant_gemm<Elem::kE4M3, Elem::kE4M3>(const DequantParams&,
                                                                   cudaStream_t);
template cudaError_t launch_dequant_gemm<Elem::kE2M1, Elem::kE2M1>(const DequantParams&,
                                                                   cudaStream_t);
}  // namespace jqffi

#define CK(x) BENCH_CHECK_CUDA(x)

// Host decoders (the numerical spec of the payload formats).
static double e4m3(uint8_t b) {
  const int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
  const double v = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1 + m / 8.0, e - 7);
  return s ? -v : v;
}
static double e5m2(uint8_t b) {
  const int s = b >> 7, e = (b >> 2) & 31, m = b & 3;
  const double v = e == 0 ? std::ldexp(m / 4.0, -14) : std::ldexp(1 + m / 4.0, e - 15);
  return s ? -v : v;
}
static double e2m1(uint8_t nib) {
  static const double mag[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  return (nib & 8) ? -mag[nib & 7] : mag[nib & 7];
}

// One operand: device payload + scales, and its host-decoded float64 values [rows, K].
struct Operand {
  Elem elem;
  int rows, K;
  std::vector<uint8_t> data, scale;
  std::vector<double> dec;
  uint8_t *d_data = nullptr, *d_scale = nullptr;
  float* d_factor = nullptr;

  void fill(std::mt19937_64& g) {
    const bool fp4 = elem == Elem::kE2M1;
    const int row_bytes = fp4 ? K / 2 : K;
    const int blocks = fp4 ? K / 16 : K / 32;
    data.resize(size_t(rows) * row_bytes);
    scale.resize(size_t(rows) * blocks);
    dec.resize(size_t(rows) * K);
    for (auto& b : data) {
      uint8_t v = uint8_t(g());
      if (elem == Elem::kE5M2 && (v & 0x7C) == 0x7C) v ^= 0x40;  // no Inf / NaN codes
      if (elem == Elem::kE4M3 && (v & 0x7F) == 0x7F) v ^= 0x08;  // no NaN code
      b = v;
    }
    for (auto& s : scale) {
      s = fp4 ? uint8_t(0x20 + g() % 0x40)   // E4M3 scale, positive normal
              : uint8_t(120 + g() % 15);     // E8M0 2^-7 .. 2^7
    }
    for (int r = 0; r < rows; ++r) {
      for (int k = 0; k < K; ++k) {
        double q, s;
        if (fp4) {
          const uint8_t byte = data[size_t(r) * row_bytes + k / 2];
          q = e2m1(k % 2 ? byte >> 4 : byte & 15);
          s = e4m3(scale[size_t(r) * blocks + k / 16]);
        } else {
          const uint8_t byte = data[size_t(r) * row_bytes + k];
          q = elem == Elem::kE5M2 ? e5m2(byte) : e4m3(byte);
          s = std::ldexp(1.0, int(scale[size_t(r) * blocks + k / 32]) - 127);
        }
        dec[size_t(r) * K + k] = q * s;
      }
    }
    if (!d_data) {
      CK(cudaMalloc(&d_data, data.size()));
      CK(cudaMalloc(&d_scale, scale.size()));
      CK(cudaMalloc(&d_factor, sizeof(float)));
      const float one = 1.0f;
      CK(cudaMemcpy(d_factor, &one, sizeof(float), cudaMemcpyHostToDevice));
    }
    CK(cudaMemcpy(d_data, data.data(), data.size(), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_scale, scale.data(), scale.size(), cudaMemcpyHostToDevice));
  }

  DequantOperand view() const {
    DequantOperand o;
    const bool fp4 = elem == Elem::kE2M1;
    o.data = d_data;
    o.row_bytes = fp4 ? K / 2 : K;
    o.scale = d_scale;
    o.scale_stride = fp4 ? K / 16 : K / 32;
    o.scale_row_shift = 0;
    o.factor = d_factor;
    o.factor_kind = fp4 ? 1 : 0;
    o.rows = rows;
    o.elem = elem;
    return o;
  }
};

// Float64 reference and |A| @ |B|^T (32 x 32 output tiles, operands staged in shared memory).
__global__ void reference_kernel(const double* a, const double* b, int M, int N, int K,
                                 double* ref, double* mag) {
  __shared__ double ta[32][33], tb[32][33];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int m = blockIdx.y * 32 + ty, n = blockIdx.x * 32 + tx, nl = blockIdx.x * 32 + ty;
  double acc = 0, am = 0;
  for (int k0 = 0; k0 < K; k0 += 32) {
    ta[ty][tx] = m < M && k0 + tx < K ? a[int64_t(m) * K + k0 + tx] : 0.0;
    tb[ty][tx] = nl < N && k0 + tx < K ? b[int64_t(nl) * K + k0 + tx] : 0.0;
    __syncthreads();
    for (int kk = 0; kk < 32; ++kk) {
      const double p = ta[ty][kk] * tb[tx][kk];
      acc += p;
      am += std::fabs(p);
    }
    __syncthreads();
  }
  if (m < M && n < N) {
    ref[int64_t(m) * N + n] = acc;
    mag[int64_t(m) * N + n] = am;
  }
}

static cudaError_t launch(const DequantParams& p, cudaStream_t s) {
  using jqffi::launch_dequant_gemm;
  if (p.a.elem == Elem::kE5M2) return launch_dequant_gemm<Elem::kE5M2, Elem::kE2M1>(p, s);
  if (p.a.elem == Elem::kE4M3) return launch_dequant_gemm<Elem::kE4M3, Elem::kE4M3>(p, s);
  return launch_dequant_gemm<Elem::kE2M1, Elem::kE2M1>(p, s);
}

int main(int argc, char** argv) {
  if (argc < 6) {
    std::fprintf(stderr, "usage: %s M N K ROUNDS LAUNCHES [mx-nv|mx-mx|nv-nv] [seed]\n", argv[0]);
    return 2;
  }
  const int M = std::atoi(argv[1]), N = std::atoi(argv[2]), K = std::atoi(argv[3]);
  const int rounds = std::atoi(argv[4]), launches = std::atoi(argv[5]);
  const std::string pair = argc > 6 ? argv[6] : "mx-nv";
  const uint64_t seed = argc > 7 ? std::strtoull(argv[7], nullptr, 10) : std::random_device{}();
  Operand a, b;
  a.elem = pair == "mx-nv" ? Elem::kE5M2 : (pair == "mx-mx" ? Elem::kE4M3 : Elem::kE2M1);
  b.elem = pair == "mx-mx" ? Elem::kE4M3 : Elem::kE2M1;
  a.rows = M, b.rows = N, a.K = b.K = K;
  std::printf("dequant_stress %dx%dx%d pair %s rounds %d launches %d seed %llu\n", M, N, K,
              pair.c_str(), rounds, launches, (unsigned long long)seed);
  std::mt19937_64 g(seed);
  float* d_out = nullptr;
  double *d_a, *d_b, *d_ref, *d_mag;
  const size_t mn = size_t(M) * N;
  CK(cudaMalloc(&d_out, mn * sizeof(float)));
  CK(cudaMalloc(&d_a, size_t(M) * K * sizeof(double)));
  CK(cudaMalloc(&d_b, size_t(N) * K * sizeof(double)));
  CK(cudaMalloc(&d_ref, mn * sizeof(double)));
  CK(cudaMalloc(&d_mag, mn * sizeof(double)));
  std::vector<float> first(mn), got(mn);
  std::vector<double> ref(mn), mag(mn);
  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  long bad_launches = 0, bad_elements_total = 0, off_ref_total = 0;
  for (int round = 0; round < rounds; ++round) {
    a.fill(g);
    b.fill(g);
    CK(cudaMemcpy(d_a, a.dec.data(), a.dec.size() * sizeof(double), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_b, b.dec.data(), b.dec.size() * sizeof(double), cudaMemcpyHostToDevice));
    reference_kernel<<<dim3((N + 31) / 32, (M + 31) / 32), dim3(32, 32), 0, stream>>>(
        d_a, d_b, M, N, K, d_ref, d_mag);
    CK(cudaGetLastError());
    CK(cudaMemcpyAsync(ref.data(), d_ref, mn * sizeof(double), cudaMemcpyDeviceToHost, stream));
    CK(cudaMemcpyAsync(mag.data(), d_mag, mn * sizeof(double), cudaMemcpyDeviceToHost, stream));
    DequantParams p;
    p.a = a.view();
    p.b = b.view();
    p.out = d_out;
    p.out_kind = jqffi::kOutF32;
    p.M = M, p.N = N, p.K = K;
    int round_bad_launches = 0;
    long round_bad = 0, round_off = 0;
    for (int l = 0; l < launches; ++l) {
      CK(cudaMemsetAsync(d_out, 0xFF, mn * sizeof(float), stream));  // NaN: unwritten shows
      CK(launch(p, stream));
      CK(cudaMemcpyAsync(l == 0 ? first.data() : got.data(), d_out, mn * sizeof(float),
                         cudaMemcpyDeviceToHost, stream));
      CK(cudaStreamSynchronize(stream));
      if (l == 0) {
        const double tol_acc = 2.0 * K * std::ldexp(1.0, -24);
        for (size_t i = 0; i < mn; ++i) {
          const double err = std::fabs(double(first[i]) - ref[i]);
          const double tol = tol_acc * mag[i] + std::ldexp(std::fabs(ref[i]), -23) + 1e-30;
          if (!(err <= tol)) {
            if (round_off < 5) {
              std::printf("  round %d: C[%zu, %zu] = %.9g, reference %.9g (|A||B| %.3g)\n",
                          round, i / N, i % N, first[i], ref[i], mag[i]);
            }
            ++round_off;
          }
        }
      } else if (std::memcmp(first.data(), got.data(), mn * sizeof(float)) != 0) {
        long diff = 0;
        for (size_t i = 0; i < mn; ++i) diff += std::memcmp(&first[i], &got[i], 4) != 0;
        ++round_bad_launches;
        round_bad += diff;
      }
    }
    std::printf("round %d: launches differing from the first %d of %d (%ld elements), "
                "elements off the float64 reference %ld\n",
                round, round_bad_launches, launches - 1, round_bad, round_off);
    std::fflush(stdout);
    bad_launches += round_bad_launches;
    bad_elements_total += round_bad;
    off_ref_total += round_off;
  }
  std::printf("SUMMARY %s %dx%dx%d: %ld differing launches (%ld elements), %ld elements off the "
              "reference\n",
              pair.c_str(), M, N, K, bad_launches, bad_elements_total, off_ref_total);
  return bad_launches || off_ref_total ? 1 : 0;
}
