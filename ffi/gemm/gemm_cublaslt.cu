// CUDA handlers of jaxquant_gemm_fp8 and jaxquant_gemm_fp8_gelu: cuBLASLt FP8 matmul on the TN
// convention (per-tensor scales, or Hopper's VEC128_32F / BLK128x128_32F block scales; the gelu
// target: per-tensor scales and cuBLASLt's GELU_AUX(_BIAS) epilogue, gelu(h) to out, h to aux).
// Our C[M, N] = a[M, K] b[N, K]^T is cuBLASLt's column-major D[N, M] = op(A) B with A = b
// (TRANSA = T), B = a (TRANSB = N). The cuBLASLt handle (one per device) and, per problem
// (shape, dtypes, scale modes, bias, epilogue, fast-accum, workspace), the matmul descriptor,
// layouts and up to 8 heuristic algorithms are created once and cached; a call only sets the
// scale / bias / aux pointers and enqueues the matmul on the FFI stream with the workspace XLA
// passes as an output buffer (no allocation, no sync).
// Autotuning (opt-in, JAXQUANT_GEMM_AUTOTUNE=1; it measured no gain): the first call of a plan
// that is not being captured into a CUDA graph times each heuristic candidate on the call's own
// buffers (a one-time host sync) and keeps the fastest if it beats the first heuristic by > 3%;
// under capture the first heuristic serves until such a call comes. The default, cuBLASLt's
// first heuristic, is bitwise reproducible from process to process (a timed choice need not be).
//
// CUDA graphs (kCmdBufferCompatible): a call enqueues the matmul only. Creating the cuBLASLt
// handle (host resources only) and a plan (host-side heuristic queries) is legal under stream
// capture; the timing, which synchronizes, is skipped there.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "cuda_handler.h"
#include "gemm/gemm_args.h"
#include "gemm/gemm_trace.h"
#include "gemm/handlers.h"

namespace jqffi {
namespace {

constexpr const char* kTarget = "jaxquant_gemm_fp8";
constexpr const char* kGeluTarget = "jaxquant_gemm_fp8_gelu";

// The FFI target a GEMM with this epilogue was called through (for error messages).
const char* target_name(int epilogue) {
  return epilogue == kEpilogueGeluAux ? kGeluTarget : kTarget;
}

const char* cublas_status_name(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    default: return "cuBLAS error";
  }
}

// A cuBLAS status other than success returns an error naming the FFI target: `target` in the
// calling scope (`target_name` of the call's epilogue).
#define JQ_CUBLAS(call)                                                                   \
  do {                                                                                    \
    cublasStatus_t st_ = (call);                                                          \
    if (st_ != CUBLAS_STATUS_SUCCESS) {                                                   \
      return ffi::Error::Internal(std::string(target) + ": " + #call + " -> " +           \
                                  cublas_status_name(st_));                               \
    }                                                                                     \
  } while (0)

cudaDataType_t cuda_type(int kind) {
  return kind == kOutBF16 ? CUDA_R_16BF : (kind == kOutF16 ? CUDA_R_16F : CUDA_R_32F);
}

struct PlanKey {
  int device;
  int64_t M, N, K;
  bool a_e5m2, b_e5m2;
  int a_mode, b_mode, out_kind, bias_kind, epilogue;
  bool fast_accum;
  bool autotune;  // JAXQUANT_GEMM_AUTOTUNE at the call (tuned, untuned plans side by side)
  size_t workspace;
  bool operator==(const PlanKey& o) const { return std::memcmp(this, &o, sizeof(*this)) == 0; }
};

struct PlanKeyHash {
  size_t operator()(const PlanKey& k) const {
    const unsigned char* p = reinterpret_cast<const unsigned char*>(&k);
    size_t h = 1469598103934665603ull;
    for (size_t i = 0; i < sizeof(k); ++i) h = (h ^ p[i]) * 1099511628211ull;
    return h;
  }
};

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;  // cuBLASLt's A (= our b), B, D
  cublasLtMatmulAlgo_t algo{};                   // the one in use
  std::vector<cublasLtMatmulAlgo_t> candidates;  // heuristic order, candidates[0] first
  int chosen = 0;                                // candidates[chosen] == algo
  bool tuned = false;                            // algo chosen by timing (or nothing to time)
  std::mutex mu;  // the descriptor's pointer attributes are set per call
  ~Plan() {
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

ffi::Error lt_handle(int device, cublasLtHandle_t* out) {
  const char* target = kTarget;  // (the handle serves both targets)
  static std::mutex mu;
  static std::unordered_map<int, cublasLtHandle_t> handles;  // live for the process
  std::lock_guard<std::mutex> lock(mu);
  auto it = handles.find(device);
  if (it == handles.end()) {
    cublasLtHandle_t h = nullptr;
    JQ_CUBLAS(cublasLtCreate(&h));
    it = handles.emplace(device, h).first;
  }
  *out = it->second;
  return ffi::Error::Success();
}

constexpr int kAutotuneCandidates = 8;  // heuristic results kept per plan (and timed)
constexpr int kAutotuneRounds = 3;      // round-robin rounds; a candidate's time: the median
constexpr float kAutotuneWindowMs = 4.0f;  // launches per candidate and round fill >= this
constexpr float kAutotuneWarmMs = 25.0f;   // candidate 0 runs this long first (clocks up)
constexpr float kAutotuneMargin = 0.97f;   // another candidate must beat candidate 0 by 3%

// JAXQUANT_GEMM_AUTOTUNE: "1" times the candidates once per plan; unset or "0" keeps cuBLASLt's
// first heuristic. Off by default because it measured no gain (H100, bench/RESULTS.md: the
// first heuristic was the fastest candidate for 12 of 13 timed plans, and the benchmarks ran
// no faster with tuning on).
ffi::Error autotune_enabled(bool* enabled) {
  const char* value = std::getenv("JAXQUANT_GEMM_AUTOTUNE");  // per call: part of the plan key
  const std::string v = value ? value : "";
  if (v == "1") {
    *enabled = true;
  } else if (v.empty() || v == "0") {
    *enabled = false;
  } else {
    return ffi::Error::InvalidArgument(std::string(kTarget) + ": JAXQUANT_GEMM_AUTOTUNE=" + v +
                                       "; expected 0 (cuBLASLt's first heuristic; the default) "
                                       "or 1 (time the heuristic candidates once per problem)");
  }
  return ffi::Error::Success();
}

// Times every candidate of `plan` on this call's buffers and keeps the fastest in plan->algo.
// Outside stream capture only (it synchronizes). Measured so that clock ramp-up and drift
// do not pick a slower algorithm (a first version, one 3-launch burst per candidate in order,
// chose algorithms 9-18% slower than the first heuristic at 16384x8192x8192 and
// 8192x28672x8192 on an H100): candidate 0 first runs ~25 ms to bring the clocks up, then the
// candidates are timed round-robin, kAutotuneRounds times, each over >= 4 ms of back-to-back
// launches; a candidate's time is its median, and the heuristic's first choice is kept unless
// another is more than 3% faster. A candidate that fails to launch drops out.
ffi::Error autotune(cublasLtHandle_t handle, Plan* plan, const Fp8Gemm& g, void* ws,
                    size_t ws_bytes, cudaStream_t stream) {
  const int n = static_cast<int>(plan->candidates.size());
  std::vector<cudaEvent_t> events(2 * (kAutotuneRounds * n + 1), nullptr);
  auto cleanup = [&] {
    for (cudaEvent_t e : events) {
      if (e) cudaEventDestroy(e);
    }
  };
  for (cudaEvent_t& e : events) {
    if (cudaError_t err = cudaEventCreate(&e); err != cudaSuccess) {
      cleanup();
      return cuda_error(kTarget, "autotuning (cudaEventCreate)", err);
    }
  }
  const float alpha = 1.0f, beta = 0.0f;
  auto run = [&](int c, int times) {
    for (int i = 0; i < times; ++i) {
      if (cublasLtMatmul(handle, plan->desc, &alpha, g.b.data, plan->a, g.a.data, plan->b, &beta,
                         g.out, plan->d, g.out, plan->d, &plan->candidates[c], ws, ws_bytes,
                         stream) != CUBLAS_STATUS_SUCCESS) {
        return false;
      }
    }
    return true;
  };
  auto elapsed = [&](int pair, float* ms) {
    return cudaEventElapsedTime(ms, events[2 * pair], events[2 * pair + 1]) == cudaSuccess;
  };
  // One launch of candidate 0 sizes the windows.
  cudaEventRecord(events[0], stream);
  const bool first_ok = run(0, 1);
  cudaEventRecord(events[1], stream);
  if (cudaError_t err = cudaEventSynchronize(events[1]); err != cudaSuccess) {
    cleanup();
    return cuda_error(kTarget, "autotuning (cudaEventSynchronize)", err);
  }
  float once = 0.0f;
  if (!first_ok || !elapsed(0, &once)) {  // keep the first heuristic; a real error shows later
    cleanup();
    plan->tuned = true;
    return ffi::Error::Success();
  }
  once = std::max(once, 1e-3f);
  const int launches = std::min(256, std::max(2, static_cast<int>(kAutotuneWindowMs / once) + 1));
  const int warm = std::min(4096, std::max(3, static_cast<int>(kAutotuneWarmMs / once) + 1));
  run(0, warm);
  std::vector<bool> usable(n, true);
  for (int r = 0; r < kAutotuneRounds; ++r) {
    for (int c = 0; c < n; ++c) {
      if (!usable[c]) continue;
      const int pair = 1 + r * n + c;
      cudaEventRecord(events[2 * pair], stream);
      usable[c] = run(c, launches);
      cudaEventRecord(events[2 * pair + 1], stream);
    }
  }
  if (cudaError_t err = cudaStreamSynchronize(stream); err != cudaSuccess) {
    cleanup();
    return cuda_error(kTarget, "autotuning (cudaStreamSynchronize)", err);
  }
  std::vector<float> median(n, 0.0f);
  for (int c = 0; c < n; ++c) {
    float t[kAutotuneRounds];
    for (int r = 0; r < kAutotuneRounds && usable[c]; ++r) {
      usable[c] = elapsed(1 + r * n + c, &t[r]);
    }
    if (!usable[c]) continue;
    std::sort(t, t + kAutotuneRounds);
    median[c] = t[kAutotuneRounds / 2] / launches;
  }
  cleanup();
  int best = 0;
  if (usable[0]) {
    for (int c = 1; c < n; ++c) {
      if (usable[c] && median[c] < kAutotuneMargin * median[0] && median[c] < median[best]) {
        best = c;
      }
    }
  }
  if (gemm_trace_level() >= 1) {
    std::fprintf(stderr, "[jaxquant gemm] autotune M=%lld N=%lld K=%lld fast_accum=%d:",
                 static_cast<long long>(g.M), static_cast<long long>(g.N),
                 static_cast<long long>(g.K), g.fast_accum ? 1 : 0);
    for (int c = 0; c < n; ++c) {
      std::fprintf(stderr, usable[c] ? " %.4f" : " -", median[c]);
    }
    std::fprintf(stderr, " ms -> %d\n", best);
  }
  plan->algo = plan->candidates[best];
  plan->chosen = best;
  plan->tuned = true;
  return ffi::Error::Success();
}

// The call's pointer attributes: the scales (cuBLASLt's A is our b), the bias and the aux.
ffi::Error set_pointers(cublasLtMatmulDesc_t desc, const Fp8Gemm& g) {
  const char* target = target_name(g.epilogue);
  const void* sa = g.b.scale;
  const void* sb = g.a.scale;
  JQ_CUBLAS(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa,
                                           sizeof(sa)));
  JQ_CUBLAS(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb,
                                           sizeof(sb)));
  if (g.bias_kind != kOutNone) {
    JQ_CUBLAS(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g.bias,
                                             sizeof(g.bias)));
  }
  if (g.epilogue == kEpilogueGeluAux) {
    JQ_CUBLAS(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                                             &g.aux, sizeof(g.aux)));
  }
  return ffi::Error::Success();
}

// The epilogue of a plan: bias and / or gelu with the pre-activation to aux (cuBLASLt's D is
// our out^T, [N, M] column-major, so the aux's leading dimension is N).
ffi::Error set_epilogue(cublasLtMatmulDesc_t desc, const PlanKey& key) {
  const char* target = target_name(key.epilogue);
  const bool gelu = key.epilogue == kEpilogueGeluAux, bias = key.bias_kind != kOutNone;
  if (!gelu && !bias) return ffi::Error::Success();
  const cublasLtEpilogue_t epi = gelu ? (bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS
                                              : CUBLASLT_EPILOGUE_GELU_AUX)
                                      : CUBLASLT_EPILOGUE_BIAS;
  JQ_CUBLAS(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi,
                                           sizeof(epi)));
  if (bias) {
    const int32_t bias_type = cuda_type(key.bias_kind);
    JQ_CUBLAS(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                                             &bias_type, sizeof(bias_type)));
  }
  if (gelu) {
    const int64_t ld = key.N;
    const int32_t aux_type = cuda_type(key.out_kind);
    JQ_CUBLAS(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld,
                                             sizeof(ld)));
    JQ_CUBLAS(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE,
                                             &aux_type, sizeof(aux_type)));
  }
  return ffi::Error::Success();
}

ffi::Error make_plan(cublasLtHandle_t handle, const PlanKey& key, const Fp8Gemm& g,
                     size_t ws_bytes, Plan* plan) {
  const char* target = target_name(key.epilogue);
  JQ_CUBLAS(cublasLtMatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  JQ_CUBLAS(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta,
                                           sizeof(ta)));
  JQ_CUBLAS(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb,
                                           sizeof(tb)));
  const int8_t fast = key.fast_accum ? 1 : 0;
  JQ_CUBLAS(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast,
                                           sizeof(fast)));
  if (key.a_mode != kPerTensor) {
    const int32_t mode_a = key.b_mode == kVec128 ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F
                                                 : CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    const int32_t mode_b = key.a_mode == kVec128 ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F
                                                 : CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    JQ_CUBLAS(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
                                             &mode_a, sizeof(mode_a)));
    JQ_CUBLAS(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
                                             &mode_b, sizeof(mode_b)));
  }
  JQ_RETURN_IF_ERROR(set_epilogue(plan->desc, key));
  // Pointers set now so the heuristic sees representative alignments; reset per call.
  JQ_RETURN_IF_ERROR(set_pointers(plan->desc, g));
  const cudaDataType_t ta_type = key.b_e5m2 ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3;
  const cudaDataType_t tb_type = key.a_e5m2 ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3;
  JQ_CUBLAS(cublasLtMatrixLayoutCreate(&plan->a, ta_type, key.K, key.N, key.K));
  JQ_CUBLAS(cublasLtMatrixLayoutCreate(&plan->b, tb_type, key.K, key.M, key.K));
  JQ_CUBLAS(cublasLtMatrixLayoutCreate(&plan->d, cuda_type(key.out_kind), key.N, key.M, key.N));

  cublasLtMatmulPreference_t pref = nullptr;
  JQ_CUBLAS(cublasLtMatmulPreferenceCreate(&pref));
  std::unique_ptr<std::remove_pointer_t<cublasLtMatmulPreference_t>,
                  decltype(&cublasLtMatmulPreferenceDestroy)>
      pref_guard(pref, cublasLtMatmulPreferenceDestroy);
  JQ_CUBLAS(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                 &ws_bytes, sizeof(ws_bytes)));
  cublasLtMatmulHeuristicResult_t results[kAutotuneCandidates];
  int found = 0;
  JQ_CUBLAS(cublasLtMatmulAlgoGetHeuristic(handle, plan->desc, plan->a, plan->b, plan->d,
                                           plan->d, pref, kAutotuneCandidates, results, &found));
  for (int i = 0; i < found; ++i) {
    if (results[i].state == CUBLAS_STATUS_SUCCESS && results[i].workspaceSize <= ws_bytes) {
      plan->candidates.push_back(results[i].algo);
    }
  }
  if (!plan->candidates.empty()) {
    plan->algo = plan->candidates[0];
    plan->tuned = plan->candidates.size() == 1;
    return ffi::Error::Success();
  }
  return ffi::Error(ffi::ErrorCode::kUnimplemented,
                    std::string(target) + ": cuBLASLt has no algorithm for M=" +
                        std::to_string(key.M) + " N=" + std::to_string(key.N) +
                        " K=" + std::to_string(key.K) + " with these dtypes / scale modes" +
                        (key.epilogue == kEpilogueGeluAux ? " and the gelu epilogue" : ""));
}

// Enqueues the decoded GEMM `g` on `stream` (its plan made or found in the cache).
ffi::Error run_fp8_gemm(cudaStream_t stream, const Fp8Gemm& g) {
  const char* target = target_name(g.epilogue);
  if (g.K % 16 != 0 || g.N % 16 != 0) {
    return invalid(target, "K=" + std::to_string(g.K) + ", N=" + std::to_string(g.N) +
                                "; cuBLASLt FP8 needs K and N multiples of 16");
  }
  if (g.a.mode != kPerTensor && cublasLtGetVersion() < 120900) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      std::string(target) + ": cuBLASLt " + std::to_string(cublasLtGetVersion()) +
                          " has no Hopper block scaling (needs 12.9+)");
  }
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) {
    return cuda_error(target, "cudaGetDevice", e);
  }
  // cuBLASLt wants a 256-byte aligned workspace.
  const uintptr_t base = reinterpret_cast<uintptr_t>(g.workspace);
  const uintptr_t aligned = (base + 255) & ~uintptr_t(255);
  void* ws = reinterpret_cast<void*>(aligned);
  const size_t ws_bytes =
      g.workspace_bytes > (aligned - base) ? g.workspace_bytes - (aligned - base) : 0;
  cublasLtHandle_t handle = nullptr;
  JQ_RETURN_IF_ERROR(lt_handle(device, &handle));

  PlanKey key;
  std::memset(&key, 0, sizeof(key));  // padding bytes take part in hashing / comparison
  key.device = device;
  key.M = g.M;
  key.N = g.N;
  key.K = g.K;
  key.a_e5m2 = g.a.e5m2;
  key.b_e5m2 = g.b.e5m2;
  key.a_mode = g.a.mode;
  key.b_mode = g.b.mode;
  key.out_kind = g.out_kind;
  key.bias_kind = g.bias_kind;
  key.epilogue = g.epilogue;
  key.fast_accum = g.fast_accum;
  JQ_RETURN_IF_ERROR(autotune_enabled(&key.autotune));
  key.workspace = ws_bytes;

  static std::mutex cache_mu;
  static std::unordered_map<PlanKey, std::unique_ptr<Plan>, PlanKeyHash> cache;
  Plan* plan = nullptr;
  {
    std::lock_guard<std::mutex> lock(cache_mu);
    auto it = cache.find(key);
    if (it == cache.end()) {
      auto fresh = std::make_unique<Plan>();
      JQ_RETURN_IF_ERROR(make_plan(handle, key, g, ws_bytes, fresh.get()));
      it = cache.emplace(key, std::move(fresh)).first;
    }
    plan = it->second.get();
  }

  std::lock_guard<std::mutex> lock(plan->mu);
  JQ_RETURN_IF_ERROR(set_pointers(plan->desc, g));
  if (!plan->tuned) {
    const bool enabled = key.autotune;
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusActive;
    if (cudaError_t e = cudaStreamIsCapturing(stream, &capture); e != cudaSuccess) {
      return cuda_error(target, "cudaStreamIsCapturing", e);
    }
    if (!enabled) {
      plan->tuned = true;  // the first heuristic, for good
    } else if (capture == cudaStreamCaptureStatusNone) {
      JQ_RETURN_IF_ERROR(autotune(handle, plan, g, ws, ws_bytes, stream));
    }
  }
  const float alpha = 1.0f, beta = 0.0f;
  JQ_CUBLAS(cublasLtMatmul(handle, plan->desc, &alpha, g.b.data, plan->a, g.a.data, plan->b,
                           &beta, g.out, plan->d, g.out, plan->d, &plan->algo, ws, ws_bytes,
                           stream));
  if (gemm_trace_calls()) {
    std::fprintf(stderr,
                 "[jaxquant gemm] %s M=%lld N=%lld K=%lld capturing=%s algo=%d of %zu%s\n",
                 target, static_cast<long long>(g.M), static_cast<long long>(g.N),
                 static_cast<long long>(g.K), capture_state(stream), plan->chosen,
                 plan->candidates.size(), plan->tuned ? "" : " (untuned)");
  }
  return ffi::Error::Success();
}


ffi::Error Fp8GemmCuda(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer a_scale,
                       ffi::AnyBuffer b, ffi::AnyBuffer b_scale, ffi::AnyBuffer bias,
                       ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace,
                       int64_t a_scale_mode, int64_t b_scale_mode, bool fast_accum) {
  Fp8Gemm g;
  JQ_RETURN_IF_ERROR(decode_fp8_gemm(kTarget, a, a_scale, b, b_scale, bias, *out, *workspace,
                                     a_scale_mode, b_scale_mode, fast_accum, &g));
  return run_fp8_gemm(stream, g);
}

ffi::Error Fp8GeluGemmCuda(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer a_scale,
                           ffi::AnyBuffer b, ffi::AnyBuffer b_scale, ffi::AnyBuffer bias,
                           ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> aux,
                           ffi::Result<ffi::AnyBuffer> workspace, int64_t a_scale_mode,
                           int64_t b_scale_mode, bool fast_accum) {
  Fp8Gemm g;
  JQ_RETURN_IF_ERROR(decode_fp8_gelu_gemm(kGeluTarget, a, a_scale, b, b_scale, bias, *out, *aux,
                                          *workspace, a_scale_mode, b_scale_mode, fast_accum,
                                          &g));
  return run_fp8_gemm(stream, g);
}

}  // namespace

JQ_DEFINE_CUDA_HANDLER(kFp8GemmCuda, Fp8GemmCuda, BindGemmFp8);
JQ_DEFINE_CUDA_HANDLER(kFp8GeluGemmCuda, Fp8GeluGemmCuda, BindGemmFp8Gelu);

std::vector<Target> gemm_fp8_cuda_targets() {
  return {target(kTarget, kFp8GemmCuda), target(kGeluTarget, kFp8GeluGemmCuda)};
}

}  // namespace jqffi
