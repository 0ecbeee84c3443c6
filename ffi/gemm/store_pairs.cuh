// float32 accumulator pairs stored as the GEMM output dtype (bfloat16 / float16 with round to
// nearest even, or float32), one vector store a pair: the output stores of both GEMM kernels
// that write from registers (gemm/dequant_kernel.cuh, grouped/grouped_gemm_cuda.cu).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace jqffi {

template <typename T> struct Pack2;
template <> struct Pack2<float> {
  using V = float2;
  static __device__ __forceinline__ V pack(float a, float b) { return make_float2(a, b); }
  static __device__ __forceinline__ float one(float a) { return a; }
};
template <> struct Pack2<__nv_bfloat16> {
  using V = __nv_bfloat162;
  static __device__ __forceinline__ V pack(float a, float b) { return __floats2bfloat162_rn(a, b); }
  static __device__ __forceinline__ __nv_bfloat16 one(float a) { return __float2bfloat16_rn(a); }
};
template <> struct Pack2<__half> {
  using V = __half2;
  static __device__ __forceinline__ V pack(float a, float b) { return __floats2half2_rn(a, b); }
  static __device__ __forceinline__ __half one(float a) { return __float2half_rn(a); }
};

// v0 and v1 at o[0], o[1] (one store; o 2-element aligned) when `pair`, else v0 at o[0].
template <typename T>
__device__ __forceinline__ void store_pair(T* o, float v0, float v1, bool pair) {
  if (pair) {
    *reinterpret_cast<typename Pack2<T>::V*>(o) = Pack2<T>::pack(v0, v1);
  } else {
    o[0] = Pack2<T>::one(v0);
  }
}

}  // namespace jqffi
