"""Float8Block (DeepSeek-V3 style): FP8 with a float32 scale per (1, 128) block or
(128, 128) tile, power-of-two scales by default. A 128x128-tiled columnwise copy shares the
rowwise tile scales (transposed). Scales are block-local, so a grouped copy is the single-matrix
reference on the padded token layout."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import numpy as np

from jaxquant.formats.base import (Format, QuantizeContext, block_amax, expand_blocks,
                                   pad_to_blocks, register, tensor_amax)
from jaxquant.formats.grouped import block_local
from jaxquant.numerics import scale_from_amax, spec_for_dtype
from jaxquant.numerics.division import ieee_div
from jaxquant.numerics.minifloat import cast_sat, decode
from jaxquant.quantizers import Float8BlockQuantizer
from jaxquant.tensors import ScaledTensor


def quantize(mat: jax.Array, quantizer: Float8BlockQuantizer,
             ctx: QuantizeContext) -> ScaledTensor:
  spec = spec_for_dtype(quantizer.dtype)
  block_rows, block_cols = quantizer.block
  rows, cols = mat.shape
  x = pad_to_blocks(mat.astype(jnp.float32), block_rows, block_cols)
  scale = scale_from_amax(block_amax(x, block_rows, block_cols), spec.fmax,
                          pow2_scale=quantizer.pow2_scale, amax_epsilon=quantizer.amax_epsilon)
  data = cast_sat(x * expand_blocks(scale, block_rows, block_cols), spec)[:rows, :cols]
  scale_inv = ieee_div(jnp.float32(1.0), scale)
  return ScaledTensor(data, scale_inv, tensor_amax(mat), quantizer, ctx.orig_dtype, ctx.rht)


def dequantize_raw(t: ScaledTensor) -> jax.Array:
  rows, cols = t.shape
  block_rows, block_cols = t.quantizer.block
  scale_inv = expand_blocks(t.scale_inv, block_rows, block_cols)[:rows, :cols]
  return decode(t.data) * scale_inv


class Float8BlockFormat(Format):
  name = "fp8-block"

  def quantize(self, mat, quantizer, ctx):
    return quantize(mat, quantizer, ctx)

  def dequantize_raw(self, t):
    return dequantize_raw(t)

  def grouped_quantize(self, mat, quantizer, ctx):
    return block_local(self, mat, quantizer, ctx)

  def blocks(self, quantizer: Float8BlockQuantizer) -> tuple[int, int]:
    return tuple(quantizer.block)

  def scale_layout(self, quantizer) -> str:
    return "block"

  def amax_layout(self, quantizer) -> str:
    return "tensor"

  def scale_dtype(self, quantizer) -> np.dtype:
    return np.dtype(np.float32)

  def exact_in_bf16(self, quantizer: Float8BlockQuantizer) -> bool:
    return quantizer.pow2_scale  # a decoded value is a payload times a power of two

  def quantize_kernel(self, quantizer) -> str:
    return "fp8-block"

  def gemm_family(self, quantizer) -> str:
    return "fp8-block"

  def grouped_quantize_kernel(self, quantizer, direction: str):
    return "single", None

  def expert_rows_multiple(self, quantizer: Float8BlockQuantizer, direction: str) -> int:
    block = quantizer.block
    return block[0] if direction == "rowwise" else block[1] if block[0] == 1 else max(block)

  def grouped_gemm_scaling(self, quantizer: Float8BlockQuantizer):
    if not quantizer.pow2_scale:  # exact in bf16 only with 2^k scales
      return None
    return 5 if tuple(quantizer.block) == (128, 128) else 4

  def grouped_gemm_operand(self, quantizer: Float8BlockQuantizer) -> str:
    name = type(quantizer).__name__
    if not quantizer.pow2_scale:
      name += " with pow2_scale=False (its decoded values are not exact in bfloat16)"
    return name

  def variants(self):
    return (Float8BlockQuantizer(), Float8BlockQuantizer((128, 128)),
            Float8BlockQuantizer(dtype=jnp.float8_e5m2, pow2_scale=False))


register(Float8BlockQuantizer, Float8BlockFormat())
