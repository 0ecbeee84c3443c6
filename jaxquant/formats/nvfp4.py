"""NVFP4: E2M1 payload with an E4M3 scale per 1x16 block (or 16x16 tile) and a float32
second-level scale derived from the tensor's amax (or each row's amax when `row_scaled`).

The second level is not folded into the payload: `dequantize_raw` gives `q * S_dec_b` and the
GEMM multiplies its accumulator by `amax / (6 * 448)` of each operand (`gemm_factor`), which is
how a row-scaled operand's per-row factor becomes an outer-product epilogue.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxquant.formats.base import (Format, QuantizeContext, abs_max, block_amax,
                                   expand_blocks, pad_to_blocks, register, tensor_amax)
from jaxquant.numerics import (nvfp4_block_decode_scale, nvfp4_block_encode_scale,
                               nvfp4_global_encode_scale, stochastic_round_bits)
from jaxquant.numerics.minifloat import E2M1, E4M3, decode, encode, encode_stochastic, to_storage
from jaxquant.quantizers import NVFP4Quantizer
from jaxquant.tensors import ScaledTensor

BLOCK = 16
GLOBAL_DECODE_DIVISOR = 6.0 * 448.0


def block_shape(quantizer: NVFP4Quantizer) -> tuple[int, int]:
  return (BLOCK, BLOCK) if quantizer.block_2d else (1, BLOCK)


def quantize(mat: jax.Array, quantizer: NVFP4Quantizer, ctx: QuantizeContext) -> ScaledTensor:
  rows, cols = mat.shape
  block_rows, block_cols = block_shape(quantizer)
  x = pad_to_blocks(mat.astype(jnp.float32), block_rows, block_cols)
  if quantizer.row_scaled:
    amax = abs_max(x, axis=1)  # [rows]; block_rows == 1 so no row padding
    s_enc = nvfp4_global_encode_scale(amax)[:, None]
  else:
    amax = tensor_amax(mat)
    s_enc = nvfp4_global_encode_scale(amax)
  draws = None
  if quantizer.stochastic_rounding:
    if ctx.key_words is None:
      raise ValueError("key: NVFP4Quantizer(stochastic_rounding=True) needs a PRNG key")
    draws = stochastic_round_bits(ctx.key_words, *x.shape)
  data, scale_inv = encode_blocks(x, quantizer, s_enc, draws)
  return ScaledTensor(data[:rows, :cols], scale_inv, amax, quantizer, ctx.orig_dtype, ctx.rht)


def encode_blocks(x: jax.Array, quantizer: NVFP4Quantizer, s_enc: jax.Array,
                  draws=None) -> tuple[jax.Array, jax.Array]:
  """(E2M1 payload, E4M3 block scales) of a block-padded float32 matrix `x`.

  `s_enc` is the second-level encode scale: a scalar, or an array broadcastable to the block
  grid `[rows / block_rows, cols / block_cols]` (per row when row-scaled; per group of rows or
  columns for `jaxquant.grouped`). `draws` are the stochastic-rounding uniforms (`x.shape`), or
  None for round-to-nearest-even.
  """
  block_rows, block_cols = block_shape(quantizer)
  scale_code = nvfp4_block_decode_scale(block_amax(x, block_rows, block_cols), s_enc)
  scale_inv = to_storage(scale_code, E4M3)
  block_scale = nvfp4_block_encode_scale(decode(scale_inv), s_enc)
  scaled = x * expand_blocks(block_scale, block_rows, block_cols)
  code = encode(scaled, E2M1) if draws is None else encode_stochastic(scaled, draws, E2M1)
  return to_storage(code, E2M1), scale_inv


def dequantize_raw(t: ScaledTensor) -> jax.Array:
  rows, cols = t.shape
  block_rows, block_cols = block_shape(t.quantizer)
  scale = expand_blocks(decode(t.scale_inv), block_rows, block_cols)[:rows, :cols]
  return decode(t.data) * scale


def gemm_factor(t: ScaledTensor) -> jax.Array:
  """`amax / (6 * 448)`: `()` per tensor, `[rows]` when row-scaled.

  Computed as `amax * fl(1 / 2688)` (a float32 constant): XLA rewrites a division by a constant
  into that product under `jit` but not in eager op-by-op execution, so writing the product
  keeps eager and jitted dequantization bit-identical.
  """
  return t.amax * jnp.float32(1.0 / GLOBAL_DECODE_DIVISOR)


register(NVFP4Quantizer, Format("nvfp4", quantize, dequantize_raw, gemm_factor,
                               blocks=block_shape))
