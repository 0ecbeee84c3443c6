// The standalone CUDA benchmarks' check of a CUDA runtime call: on an error, the call, its
// place and the error's text on stderr, then exit status 2.
#pragma once

#include <cstdio>
#include <cstdlib>

#include <cuda_runtime.h>

#define BENCH_CHECK_CUDA(x)                                                         \
  do {                                                                              \
    cudaError_t e_ = (x);                                                           \
    if (e_ != cudaSuccess) {                                                        \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x,                \
                   cudaGetErrorString(e_));                                         \
      std::exit(2);                                                                 \
    }                                                                               \
  } while (0)
