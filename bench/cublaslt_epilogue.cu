// Which cuBLASLt epilogues an FP8 GEMM of the LayerNormMLP's fc1 / fc2 shapes can take, and
// what each costs against the plain bias GEMM: the measurement before any layer is built on
// them (bench/RESULTS.md, issue 24, session 35's lead).
//
// The modules model's delayed step runs, per layer, XLA's gelu fusion (~218 us on an H200 at
// [16384, 8192]) and the quantize kernel of its output (~145 us) between fc1's GEMM and fc2's.
// If fc1's GEMM wrote gelu(h + b) directly as FP8 with the delayed scale (D in E4M3, its amax
// beside it) and h + b as a bfloat16 aux for the backward, only a byte transpose of D (fc2's
// columnwise copy) would be left there. Likewise fc2's dgrad with a DGELU(+BGRAD) epilogue
// would fold the gelu gradient (and fc1's bias gradient) into the GEMM. Whether cuBLASLt
// serves those with FP8 operands, and at what cost, is what this measures.
//
// Standalone: no JAX, no jaxquant. Build and run on a GPU machine (bench/jobs/s36c.txt):
//   CU=$(python -c "import nvidia.cu13; print(nvidia.cu13.__path__[0])")
//   nvcc -O2 -std=c++17 -gencode=arch=compute_90a,code=sm_90a bench/cublaslt_epilogue.cu -I$CU/include -L$CU/lib \
//     -l:libcublasLt.so.13 -o /tmp/epi && LD_LIBRARY_PATH=$CU/lib /tmp/epi
// Operands hold small random values (their contents do not change a GEMM's time); every case
// is timed as the median of 5 rounds of 20 launches after a warm-up.

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cuda_check.h"

namespace {

#define CHECK_CUDA(x) BENCH_CHECK_CUDA(x)

// A cuBLASLt status that is not success: the case is reported as unsupported, not fatal.
#define TRY_LT(x)                                                                      \
  do {                                                                                 \
    cublasStatus_t s_ = (x);                                                           \
    if (s_ != CUBLAS_STATUS_SUCCESS) return std::string(#x) + " -> " + std::to_string(s_); \
  } while (0)

// Fills n bytes with small pseudo-random finite codes (FP8) or bfloat16 values in [-1, 1).
__global__ void fill_kernel(uint8_t* p, size_t n, uint32_t seed, int bf16) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 0x9E3779B1u ^ seed;
    h ^= h >> 15;
    h *= 0x85EBCA77u;
    h ^= h >> 13;
    if (bf16) {
      if (i % 2 == 0 && i + 1 < n) {
        const float v = (h & 0xFFFF) / 32768.0f - 1.0f;
        const __nv_bfloat16 b = __float2bfloat16(v);
        std::memcpy(p + i, &b, 2);
      }
    } else {
      p[i] = uint8_t((h & 0x77) | ((h >> 8) & 0x80));  // exponent field below its top: finite
    }
  }
}

struct Buffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  explicit Buffer(size_t n, uint32_t seed, bool bf16 = false) : bytes(n) {
    CHECK_CUDA(cudaMalloc(&ptr, n));
    fill_kernel<<<1024, 256>>>(static_cast<uint8_t*>(ptr), n, seed, bf16 ? 1 : 0);
    CHECK_CUDA(cudaGetLastError());
  }
  ~Buffer() { cudaFree(ptr); }
};

// One GEMM in cuBLASLt's column-major terms: D[m, n] = epilogue(op(A)[m, k] op(B)[k, n]),
// A stored [k, m] (TRANSA = T), B stored [k, n] (TRANSB = N): our y[T, N] = x[T, K] W[K, N]
// with m = N, n = T, k = K (the convention of ffi/gemm/gemm_cublaslt.cu).
struct Case {
  const char* name;
  int64_t m, n, k;
  cudaDataType_t a_type, b_type, c_type, d_type;
  cublasLtEpilogue_t epilogue;
  bool fast_accum;
  cudaDataType_t aux_type;  // for the AUX / DGELU epilogues
  bool d_scale_amax;        // an FP8 D: its scale and amax pointers
  // Block scaling (Float8Block): cuBLASLt's A (our weight) in 128x128 tiles and B (our x) in
  // 1x128 blocks, as jaxquant's cublaslt-fp8-block path; false: per-tensor scales.
  bool block_scales = false;
};

constexpr int kVec128 = 1, kBlk128 = 2;

// Floats a scale mode needs for a [rows, K] operand (cuBLASLt's layouts, as
// ffi/gemm/gemm_args.h::scale_shape).
size_t scale_floats(int mode, int64_t rows, int64_t k) {
  const int64_t kb = (k + 127) / 128;
  if (mode == kVec128) return size_t(kb) * size_t((rows + 3) / 4 * 4);
  return size_t((rows + 127) / 128) * size_t((kb + 3) / 4 * 4);
}

__global__ void fill_ones(float* p, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    p[i] = 1.0f;
  }
}

size_t type_bytes(cudaDataType_t t) { return t == CUDA_R_16BF ? 2 : t == CUDA_R_32F ? 4 : 1; }

bool has_aux(cublasLtEpilogue_t e) {
  return e == CUBLASLT_EPILOGUE_GELU_AUX || e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS ||
         e == CUBLASLT_EPILOGUE_DGELU || e == CUBLASLT_EPILOGUE_DGELU_BGRAD;
}

bool has_bias(cublasLtEpilogue_t e) {
  return e == CUBLASLT_EPILOGUE_BIAS || e == CUBLASLT_EPILOGUE_GELU_BIAS ||
         e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS || e == CUBLASLT_EPILOGUE_DGELU_BGRAD;
}

// Runs one case: "" and its median time per GEMM in *ms, or why cuBLASLt refused it.
std::string run_case(cublasLtHandle_t lt, const Case& c, float* ms) {
  Buffer a(size_t(c.k) * c.m * type_bytes(c.a_type), 1);
  Buffer b(size_t(c.k) * c.n * type_bytes(c.b_type), 2);
  Buffer d(size_t(c.m) * c.n * type_bytes(c.d_type), 3);
  Buffer aux(has_aux(c.epilogue) ? size_t(c.m) * c.n * type_bytes(c.aux_type) : 16, 4,
             c.aux_type == CUDA_R_16BF);
  Buffer bias(size_t(c.m) * 2, 5, true);
  // The a, b and d scales and D's amax, each at its own 256-byte boundary: cuBLASLt 13.1
  // refused every launch (status 15) with the four packed into 16 bytes, and with no A / B
  // scale pointer it ran, as it does from jaxquant's own (separate, aligned) buffers.
  constexpr int kStride = 64;  // floats
  Buffer scales(4 * kStride * sizeof(float), 6);
  std::vector<float> values(4 * kStride, 0.0f);
  values[0] = values[kStride] = values[2 * kStride] = 1.0f;
  CHECK_CUDA(cudaMemcpy(scales.ptr, values.data(), values.size() * sizeof(float),
                        cudaMemcpyHostToDevice));
  float* sc = static_cast<float*>(scales.ptr);
  const size_t ws_bytes = size_t(32) << 20;
  Buffer ws(ws_bytes, 7);

  cublasLtMatmulDesc_t desc = nullptr;
  TRY_LT(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  TRY_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  TRY_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  const int8_t fast = c.fast_accum ? 1 : 0;
  TRY_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast,
                                        sizeof(fast)));
  const void* sa = sc;
  const void* sb = sc + kStride;
  // Block scales: their own buffers of ones (A = our weight in 128x128 tiles, B = our x in
  // 1x128 blocks), and the scale modes that say so.
  const size_t a_floats = scale_floats(kBlk128, c.m, c.k), b_floats = scale_floats(kVec128, c.n, c.k);
  Buffer a_blocks(c.block_scales ? a_floats * sizeof(float) : 16, 9);
  Buffer b_blocks(c.block_scales ? b_floats * sizeof(float) : 16, 10);
  if (c.block_scales) {
    fill_ones<<<256, 256>>>(static_cast<float*>(a_blocks.ptr), a_floats);
    fill_ones<<<256, 256>>>(static_cast<float*>(b_blocks.ptr), b_floats);
    CHECK_CUDA(cudaGetLastError());
    sa = a_blocks.ptr;
    sb = b_blocks.ptr;
    const int32_t mode_a = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    const int32_t mode_b = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    TRY_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode_a,
                                          sizeof(mode_a)));
    TRY_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode_b,
                                          sizeof(mode_b)));
  }
  TRY_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa,
                                        sizeof(sa)));
  TRY_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb,
                                        sizeof(sb)));
  if (c.d_scale_amax) {
    const void* sd = sc + 2 * kStride;
    void* amax = sc + 3 * kStride;
    TRY_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_D_SCALE_POINTER, &sd,
                                          sizeof(sd)));
    TRY_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, &amax,
                                          sizeof(amax)));
  }
  TRY_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &c.epilogue,
                                        sizeof(c.epilogue)));
  if (has_bias(c.epilogue)) {
    const int32_t bias_type = CUDA_R_16BF;
    TRY_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type,
                                          sizeof(bias_type)));
    TRY_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias.ptr,
                                          sizeof(bias.ptr)));
  }
  if (has_aux(c.epilogue)) {
    const int64_t ld = c.m;
    const int32_t aux_type = c.aux_type;
    TRY_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                                          &aux.ptr, sizeof(aux.ptr)));
    TRY_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld,
                                          sizeof(ld)));
    TRY_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE,
                                          &aux_type, sizeof(aux_type)));
  }
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr, ld = nullptr;
  TRY_LT(cublasLtMatrixLayoutCreate(&la, c.a_type, c.k, c.m, c.k));
  TRY_LT(cublasLtMatrixLayoutCreate(&lb, c.b_type, c.k, c.n, c.k));
  TRY_LT(cublasLtMatrixLayoutCreate(&lc, c.c_type, c.m, c.n, c.m));
  TRY_LT(cublasLtMatrixLayoutCreate(&ld, c.d_type, c.m, c.n, c.m));
  cublasLtMatmulPreference_t pref = nullptr;
  TRY_LT(cublasLtMatmulPreferenceCreate(&pref));
  TRY_LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                              &ws_bytes, sizeof(ws_bytes)));
  cublasLtMatmulHeuristicResult_t result = {};
  int found = 0;
  TRY_LT(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, ld, pref, 1, &result, &found));
  if (found == 0) return "no algorithm (heuristic found none)";
  if (result.state != CUBLAS_STATUS_SUCCESS) return "heuristic state " + std::to_string(result.state);

  // C has its own buffer (its type differs from an FP8 D's); with beta = 0 it is not read.
  Buffer cbuf(size_t(c.m) * c.n * type_bytes(c.c_type), 8);
  const void* cptr = cbuf.ptr;
  const float alpha = 1.0f, beta = 0.0f;
  auto launch = [&]() {
    return cublasLtMatmul(lt, desc, &alpha, a.ptr, la, b.ptr, lb, &beta, cptr, lc, d.ptr, ld,
                          &result.algo, ws.ptr, ws_bytes, nullptr);
  };
  for (int i = 0; i < 3; ++i) TRY_LT(launch());
  CHECK_CUDA(cudaDeviceSynchronize());
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<float> rounds;
  for (int r = 0; r < 5; ++r) {
    CHECK_CUDA(cudaEventRecord(start));
    for (int i = 0; i < 20; ++i) TRY_LT(launch());
    CHECK_CUDA(cudaEventRecord(stop));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float t = 0;
    CHECK_CUDA(cudaEventElapsedTime(&t, start, stop));
    rounds.push_back(t / 20);
  }
  std::sort(rounds.begin(), rounds.end());
  *ms = rounds[2];
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(lc);
  cublasLtMatrixLayoutDestroy(ld);
  cublasLtMatmulDescDestroy(desc);
  return "";
}

}  // namespace

int main() {
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  CHECK_CUDA(cudaSetDevice(0));
  CHECK_CUDA(cudaFree(nullptr));  // the context before cuBLASLt's handle
  cublasLtHandle_t lt;
  if (cublasLtCreate(&lt) != CUBLAS_STATUS_SUCCESS) return 1;
  const int version = int(cublasLtGetVersion());
  std::printf("### cuBLASLt %d on %s: FP8 GEMM epilogues at the d2048 MLP's shapes\n\n", version,
              prop.name);
  const auto E4 = CUDA_R_8F_E4M3, E5 = CUDA_R_8F_E5M2, BF = CUDA_R_16BF;
  // fc1 forward: y[16384, 8192] = x[16384, 2048] W1[2048, 8192]: m = 8192, n = 16384, k = 2048.
  // fc2 dgrad: dh[16384, 8192] = dy[16384, 2048] W2^T: m = 8192, n = 16384, k = 2048 (dy E5M2).
  const Case cases[] = {
      {"bf16 x bf16 -> bf16, for reference", 8192, 16384, 2048, BF, BF, BF, BF,
       CUBLASLT_EPILOGUE_DEFAULT, false, BF, false},
      {"fc1 fwd, bias -> bf16 (today)", 8192, 16384, 2048, E4, E4, BF, BF,
       CUBLASLT_EPILOGUE_BIAS, true, BF, false},
      {"fc1 fwd, bias + gelu -> bf16", 8192, 16384, 2048, E4, E4, BF, BF,
       CUBLASLT_EPILOGUE_GELU_BIAS, true, BF, false},
      {"fc1 fwd, bias + gelu -> bf16, aux bf16", 8192, 16384, 2048, E4, E4, BF, BF,
       CUBLASLT_EPILOGUE_GELU_AUX_BIAS, true, BF, false},
      {"fc1 fwd, bias + gelu -> e4m3 (scale, amax), aux bf16", 8192, 16384, 2048, E4, E4, BF, E4,
       CUBLASLT_EPILOGUE_GELU_AUX_BIAS, true, BF, true},
      {"fc1 fwd, bias -> e4m3 (scale, amax)", 8192, 16384, 2048, E4, E4, BF, E4,
       CUBLASLT_EPILOGUE_BIAS, true, BF, true},
      {"Float8Block fc1 fwd, bias -> bf16 (today)", 8192, 16384, 2048, E4, E4, BF, BF,
       CUBLASLT_EPILOGUE_BIAS, false, BF, false, true},
      {"Float8Block fc1 fwd, bias + gelu -> bf16, aux bf16", 8192, 16384, 2048, E4, E4, BF, BF,
       CUBLASLT_EPILOGUE_GELU_AUX_BIAS, false, BF, false, true},
      {"fc2 dgrad, split -> bf16 (today)", 8192, 16384, 2048, E4, E5, BF, BF,
       CUBLASLT_EPILOGUE_DEFAULT, false, BF, false},
      {"fc2 dgrad, split, dgelu (aux bf16) -> bf16", 8192, 16384, 2048, E4, E5, BF, BF,
       CUBLASLT_EPILOGUE_DGELU, false, BF, false},
      {"fc2 dgrad, split, dgelu + bgrad -> bf16", 8192, 16384, 2048, E4, E5, BF, BF,
       CUBLASLT_EPILOGUE_DGELU_BGRAD, false, BF, false},
  };
  std::printf("| case | ms | vs its row marked today |\n|---|---:|---:|\n");
  float today = 0.0f;
  for (const Case& c : cases) {
    float ms = 0.0f;
    const std::string why = run_case(lt, c, &ms);
    if (std::strstr(c.name, "(today)") != nullptr) today = why.empty() ? ms : 0.0f;
    if (why.empty()) {
      std::printf("| %s | %.4f | %+.4f |\n", c.name, ms, today > 0 ? ms - today : 0.0f);
    } else {
      std::printf("| %s | unsupported: %s | |\n", c.name, why.c_str());
    }
    std::fflush(stdout);
  }
  cublasLtDestroy(lt);
  return 0;
}
