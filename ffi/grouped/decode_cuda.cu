// CUDA handlers of jaxquant_grouped_decode_nvfp4 / _mxfp8: NVFP4 and MXFP8 storages decoded to
// bfloat16 for the grouped GEMMs on decoded operands (jaxquant/backends/ffi/grouped/decoded.py).
// XLA's fused decodes ran below the copy rate on an H100 (packed float4 at 1.6 TB/s, four
// values a thread; MXFP8 at ~2.5 TB/s); each kernel gives a thread 16 values of one block. NVFP4:
// an 8-byte load of codes, one scale, two 16-byte stores; values jq::nvfp4_raw
// (ffi/jaxquant_numerics.h), exact in float32 and bfloat16, converted as XLA converts on the
// device (cvt.rn.bf16x2.f32). MXFP8: below.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <vector>

#include "cuda_handler.h"
#include "grouped/grouped_args.h"
#include "grouped/handlers.h"
#include "jaxquant_numerics.h"
#include "quantize/mxfp8_raw.cuh"
#include "quantize/nvfp4_raw.cuh"

namespace jqffi {
namespace {

constexpr int kDecodeThreads = 256;

// Block i of the [B * R, C / 16] grid: its 16 codes, its scale, its 32 output bytes.
__global__ void __launch_bounds__(kDecodeThreads)
    decode_nvfp4_kernel(const uint2* __restrict__ data, const uint8_t* __restrict__ scale,
                        uint4* __restrict__ out, uint32_t blocks, uint32_t blocks_per_row,
                        uint32_t R, uint32_t scale_rows, int row_shift) {
  const uint32_t i = blockIdx.x * kDecodeThreads + threadIdx.x;
  if (i >= blocks) return;
  const uint32_t row = i / blocks_per_row, cb = i - row * blocks_per_row;
  const uint32_t b = row / R, r = row - b * R;
  const uint32_t si = (b * scale_rows + (r >> row_shift)) * blocks_per_row + cb;
  const __nv_bfloat162 s = __float2bfloat162_rn(jq::decode_e4m3(__ldg(scale + si)));
  const uint2 codes = __ldg(data + i);
  uint32_t v[8];
  raw4(codes.x, s, v);
  raw4(codes.x >> 16, s, v + 2);
  raw4(codes.y, s, v + 4);
  raw4(codes.y >> 16, s, v + 6);
  out[2 * size_t(i)] = make_uint4(v[0], v[1], v[2], v[3]);
  out[2 * size_t(i) + 1] = make_uint4(v[4], v[5], v[6], v[7]);
}

// MXFP8: chunk i (16 values of one 32-block) of the [B * R, C / 16] grid: 16 codes to float32
// (exact: through float16), times 2^(e - 127) in float32, rounded once to bfloat16: XLA's decode
// (quantize/mxfp8_raw.cuh, shared with the quantize kernel's raw output).
__global__ void __launch_bounds__(kDecodeThreads)
    decode_mxfp8_kernel(const uint4* __restrict__ data, const uint8_t* __restrict__ scale,
                        uint4* __restrict__ out, uint32_t chunks, uint32_t chunks_per_row,
                        uint32_t scale_cols, bool e5m2) {
  const uint32_t i = blockIdx.x * kDecodeThreads + threadIdx.x;
  if (i >= chunks) return;
  const uint32_t row = i / chunks_per_row, cc = i - row * chunks_per_row;
  const float s = jq::decode_e8m0(__ldg(scale + size_t(row) * scale_cols + cc / 2));
  const uint4 codes = __ldg(data + i);
  const uint32_t words[4] = {codes.x, codes.y, codes.z, codes.w};
  uint32_t v[8];
  mxfp8_raw_words<4>(words, s, e5m2, v);
  out[2 * size_t(i)] = make_uint4(v[0], v[1], v[2], v[3]);
  out[2 * size_t(i) + 1] = make_uint4(v[4], v[5], v[6], v[7]);
}

ffi::Error GroupedDecodeMxfp8Cuda(cudaStream_t stream, ffi::AnyBuffer data, ffi::AnyBuffer scale,
                                  ffi::Result<ffi::AnyBuffer> out) {
  const char* t = "jaxquant_grouped_decode_mxfp8";
  Mxfp8DecodeParams p;
  JQ_RETURN_IF_ERROR(decode_mxfp8_decode(t, data, scale, out, &p));
  const uint32_t chunks = uint32_t(p.B * p.R * (p.C / 16));
  if (chunks == 0) return ffi::Error::Success();
  decode_mxfp8_kernel<<<(chunks + kDecodeThreads - 1) / kDecodeThreads, kDecodeThreads, 0,
                        stream>>>(reinterpret_cast<const uint4*>(p.data), p.scale,
                                  reinterpret_cast<uint4*>(p.out), chunks, uint32_t(p.C / 16),
                                  uint32_t(p.scale_cols), p.e5m2);
  return launch_status(t, cudaGetLastError());
}

ffi::Error GroupedDecodeNvfp4Cuda(cudaStream_t stream, ffi::AnyBuffer data, ffi::AnyBuffer scale,
                                  ffi::Result<ffi::AnyBuffer> out, int64_t block_rows) {
  const char* t = "jaxquant_grouped_decode_nvfp4";
  Nvfp4DecodeParams p;
  JQ_RETURN_IF_ERROR(decode_nvfp4_decode(t, data, scale, out, block_rows, &p));
  const uint32_t blocks = uint32_t(p.B * p.R * (p.C / 16));
  if (blocks == 0) return ffi::Error::Success();
  decode_nvfp4_kernel<<<(blocks + kDecodeThreads - 1) / kDecodeThreads, kDecodeThreads, 0,
                        stream>>>(reinterpret_cast<const uint2*>(p.data), p.scale,
                                  reinterpret_cast<uint4*>(p.out), blocks, uint32_t(p.C / 16),
                                  uint32_t(p.R), uint32_t(p.scale_rows),
                                  p.block_rows == 16 ? 4 : 0);
  return launch_status(t, cudaGetLastError());
}

}  // namespace

JQ_DEFINE_CUDA_HANDLER(kGroupedDecodeNvfp4Cuda, GroupedDecodeNvfp4Cuda, BindGroupedDecodeNvfp4);
JQ_DEFINE_CUDA_HANDLER(kGroupedDecodeMxfp8Cuda, GroupedDecodeMxfp8Cuda, BindGroupedDecodeMxfp8);

std::vector<Target> grouped_decode_cuda_targets() {
  return {target("jaxquant_grouped_decode_nvfp4", kGroupedDecodeNvfp4Cuda),
          target("jaxquant_grouped_decode_mxfp8", kGroupedDecodeMxfp8Cuda)};
}

}  // namespace jqffi
