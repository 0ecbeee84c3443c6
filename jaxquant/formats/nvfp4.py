"""NVFP4: E2M1 payload with an E4M3 scale per 1x16 block (or 16x16 tile) and a float32
second-level scale derived from the tensor's amax (or each row's amax when `row_scaled`).

The second level is not folded into the payload: `dequantize_raw` gives `q * S_dec_b` and the
GEMM multiplies its accumulator by `amax / (6 * 448)` of each operand (`gemm_factor`), which is
how a row-scaled operand's per-row factor becomes an outer-product epilogue. A grouped copy
takes one second-level scale per group (per token for a row-scaled rowwise copy, per group and
feature for a row-scaled columnwise copy), and stochastic rounding draws each group's bits at the
token's index within the group.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import numpy as np

from jaxquant.formats.base import (Format, QuantizeContext, abs_max, block_amax,
                                   expand_blocks, pad_to_blocks, register, tensor_amax)
from jaxquant.formats.grouped import GroupedContext
from jaxquant.grouping.layout import abs_bits, per_position, segment_amax
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


def stores_raw(t: ScaledTensor) -> bool:
  """Whether `t.data` holds the raw values (E2M1 code x E4M3 block scale, exact in bfloat16)
  rather than the codes: bfloat16 data, a rowwise copy the grouped FFI kernel wrote for the
  GEMMs that read decoded operands. The second level stays apart (`gemm_factor`)."""
  return np.dtype(t.data.dtype) == np.dtype(jnp.bfloat16)


def dequantize_raw(t: ScaledTensor) -> jax.Array:
  if stores_raw(t):
    return t.data.astype(jnp.float32)
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


def _grouped_draws(shape: tuple[int, int], ctx: GroupedContext) -> jax.Array:
  """Stochastic-rounding uniforms: each group's words at (row, col) *within the group*, which
  are the bits `jaxquant.ops.quantize` draws for the group alone."""
  if ctx.words is None:
    raise ValueError("key: NVFP4Quantizer(stochastic_rounding=True) needs a PRNG key")
  words = per_position(ctx.words, ctx.group, 0)
  rows, cols = shape
  if ctx.token_axis == 0:
    return jax.vmap(lambda w, i: stochastic_round_bits(w, 1, cols, i, 0)[0])(words, ctx.local)
  return jax.vmap(lambda w, i: stochastic_round_bits(w, rows, 1, 0, i)[:, 0],
                  out_axes=1)(words, ctx.local)


def grouped_quantize(mat: jax.Array, q: NVFP4Quantizer, ctx: GroupedContext):
  """(data, scale_inv, amax) of a token layout, one second-level scale per group (see the
  module docstring for the row-scaled cases)."""
  rows, cols = mat.shape
  block_rows, block_cols = block_shape(q)
  x = pad_to_blocks(mat.astype(jnp.float32), block_rows, block_cols)
  block_group = ctx.group[::(block_rows, block_cols)[ctx.token_axis]]  # group of each block
  if q.row_scaled and ctx.token_axis == 0:  # a row is a token: its own scale, as for a matrix
    amax = abs_max(x, axis=1)
    s_enc = nvfp4_global_encode_scale(amax)[:, None]
  elif q.row_scaled:  # a row is a feature: one scale per (group, feature)
    amax = segment_amax(abs_bits(x).T, ctx.group, ctx.groups)  # [G, rows]
    s_enc = per_position(nvfp4_global_encode_scale(amax), block_group, 1.0).T
  else:
    amax = ctx.group_amax(mat)
    s_line = per_position(nvfp4_global_encode_scale(amax), block_group, 1.0)
    s_enc = s_line[:, None] if ctx.token_axis == 0 else s_line[None, :]
  draws = _grouped_draws(x.shape, ctx) if q.stochastic_rounding else None
  data, scale_inv = encode_blocks(x, q, s_enc, draws)
  return data[:rows, :cols], scale_inv, amax


class NVFP4Format(Format):
  name = "nvfp4"

  def quantize(self, mat, quantizer, ctx):
    return quantize(mat, quantizer, ctx)

  def dequantize_raw(self, t):
    return dequantize_raw(t)

  def stores_raw(self, t) -> bool:
    return stores_raw(t)

  def gemm_factor(self, t):
    return gemm_factor(t)

  def grouped_quantize(self, mat, quantizer, ctx):
    return grouped_quantize(mat, quantizer, ctx)

  def blocks(self, quantizer: NVFP4Quantizer) -> tuple[int, int]:
    return block_shape(quantizer)

  def scale_layout(self, quantizer) -> str:
    return "block"

  def amax_layout(self, quantizer: NVFP4Quantizer) -> str:
    return "row" if quantizer.row_scaled else "tensor"

  def scale_dtype(self, quantizer) -> np.dtype:
    return np.dtype(jnp.float8_e4m3fn)

  def uses_rht(self, quantizer: NVFP4Quantizer, direction: str) -> bool:
    return quantizer.rht and direction == "columnwise"  # the wgrad operands only

  def needs_key(self, quantizer: NVFP4Quantizer) -> bool:
    return quantizer.stochastic_rounding

  def columnwise_is_transposed_rowwise(self, quantizer: NVFP4Quantizer) -> bool:
    # 16x16 tiles give both copies one scale per tile; one amax per tensor (not per row)
    return (quantizer.block_2d and not quantizer.row_scaled
            and self.copies_swap_with_transpose(quantizer))

  def elements_per_byte(self, quantizer) -> int:
    return 2

  def quantize_kernel(self, quantizer) -> str:
    return "nvfp4"

  def gemm_family(self, quantizer) -> str:
    return "nvfp4"

  def grouped_quantize_kernel(self, quantizer: NVFP4Quantizer, direction: str):
    if not quantizer.row_scaled:
      return "nvfp4", None
    if direction == "columnwise":
      return None, ("row-scaled NVFP4's columnwise copy has one second-level scale per (group, "
                    "feature); no grouped kernel computes those amaxes yet, the reference "
                    "quantizes all groups in one program")
    if quantizer.stochastic_rounding:
      return None, ("row-scaled NVFP4 with stochastic rounding draws each group's bits from "
                    "its own key; the row-scaled route runs the single-tensor kernel with one "
                    "key, so the reference quantizes all groups in one program")
    if quantizer.block_2d:
      return None, "row-scaled NVFP4 with 16x16 blocks has no grouped kernel path"
    return "single", None

  def expert_rows_multiple(self, quantizer: NVFP4Quantizer, direction: str):
    if (quantizer.row_scaled and direction == "rowwise"
        and not (quantizer.stochastic_rounding or quantizer.block_2d or quantizer.rht)):
      return 1  # every row its own amax and 1x16 blocks
    return None

  def grouped_gemm_scaling(self, quantizer: NVFP4Quantizer) -> int:
    return 3 if quantizer.block_2d else 2

  def variants(self):
    return (NVFP4Quantizer(), NVFP4Quantizer(row_scaled=True), NVFP4Quantizer(block_2d=True),
            NVFP4Quantizer(rht=True), NVFP4Quantizer(stochastic_rounding=True),
            NVFP4Quantizer(row_scaled=True, rht=True, stochastic_rounding=True))


register(NVFP4Quantizer, NVFP4Format())
