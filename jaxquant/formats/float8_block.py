"""Float8Block (DeepSeek-V3 style): FP8 with a float32 scale per (1, 128) block or
(128, 128) tile, power-of-two scales by default. A 128x128-tiled columnwise copy shares the
rowwise tile scales (transposed)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxquant.formats.base import (Format, QuantizeContext, block_amax, expand_blocks,
                                   pad_to_blocks, register, tensor_amax)
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


register(Float8BlockQuantizer, Format("fp8-block", quantize, dequantize_raw,
                                         blocks=lambda q: tuple(q.block)))
