"""Grouped quantization per format: each format's reference (`jaxquant.formats`) applied to a
token layout whose groups must not share anything a format computes per tensor.

One table entry per quantizer class says
- which blocks its scales use (`blocks`), hence the token-layout block a direction needs
  (`token_block`): blocks along the token axis must not straddle two groups;
- how to quantize a layout matrix (`quantize`): block-local formats (MXFP8, Float8Block) run
  their reference unchanged on the padded layout; per-tensor FP8 and NVFP4 take one amax per
  group (so one scale, or one second-level scale, per group), NVFP4's stochastic rounding draws
  each group's bits from that group's key at the token's index *within the group*.
The result is bit-for-bit what `jaxquant.ops.quantize` gives each group on its own.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from jaxquant.formats import QuantizeContext, format_of
from jaxquant.formats import float8_tensor, mxfp8, nvfp4
from jaxquant.formats.base import abs_max, pad_to_blocks
from jaxquant.grouped.layout import abs_bits, per_position, segment_amax
from jaxquant.grouped.tensors import GroupedScaledTensor, along_tokens, positions
from jaxquant.numerics import (nvfp4_global_encode_scale, scale_from_amax, spec_for_dtype,
                               stochastic_round_bits)
from jaxquant.numerics.division import ieee_div
from jaxquant.ops.reference import uses_rht
from jaxquant.quantizers import (Float8BlockQuantizer, Float8CurrentScalingQuantizer,
                                 Float8DelayedScalingQuantizer, IdentityQuantizer,
                                 MXFP8Quantizer, NVFP4Quantizer, Quantizer)
from jaxquant.state import DelayedScalingState, quantize_scale
from jaxquant.tensors import ScaledTensor


@dataclasses.dataclass(frozen=True)
class GroupedContext:
  """Per-call inputs of a grouped quantize besides the layout matrix and the quantizer.

  Attributes:
    orig_dtype: dtype of the tensor being quantized.
    token_axis: the axis of the matrix that runs over token positions (0 or 1).
    groups: `G`.
    group: int32 `[L]` group of each token position (`G` for positions of no group).
    local: int32 `[L]` index of each position within its group.
    words: uint32 `[G, 2]` stochastic-rounding words of each group for this direction, or None.
    state: per-group state (`DelayedScalingState` with a leading `[G]` axis), or None.
    rht: whether the matrix has been through the Hadamard transform.
  """

  orig_dtype: Any
  token_axis: int
  groups: int
  group: jax.Array
  local: jax.Array
  words: Optional[jax.Array] = None
  state: Any = None
  rht: bool = False

  def along_tokens(self, values: jax.Array, fill) -> jax.Array:
    per_pos = per_position(values, self.group, fill)
    return per_pos[:, None] if self.token_axis == 0 else per_pos[None, :]

  def group_amax(self, mat: jax.Array) -> jax.Array:
    """float32 `[G]`: each group's max |x| (0 for an empty group; NaN propagates)."""
    lines = jnp.max(abs_bits(mat), axis=1 - self.token_axis)
    return segment_amax(lines, self.group, self.groups)


Quantize = Callable[[jax.Array, Quantizer, GroupedContext], tuple]


@dataclasses.dataclass(frozen=True)
class GroupedFormat:
  quantize: Quantize  # (layout matrix, quantizer, context) -> (data, scale_inv, amax)
  blocks: Callable[[Quantizer], Optional[tuple[int, int]]] = lambda q: None
  per_group_scale: bool = False  # scale_inv is [G] (per-tensor FP8)


# --------------------------------------- per-tensor FP8 ---------------------------------------

def _fp8_with_scale(mat, q, ctx: GroupedContext, scale, amax):
  t = float8_tensor.quantize_with_scale(mat, ctx.along_tokens(scale, 1.0), amax, q,
                                        QuantizeContext(ctx.orig_dtype))
  return t.data, ieee_div(jnp.float32(1.0), scale), amax


def _fp8_current(mat, q: Float8CurrentScalingQuantizer, ctx: GroupedContext):
  amax = ctx.group_amax(mat)
  scale = scale_from_amax(amax, spec_for_dtype(q.dtype).fmax, pow2_scale=q.pow2_scale,
                          amax_epsilon=q.amax_epsilon)
  return _fp8_with_scale(mat, q, ctx, scale, amax)


def _fp8_delayed(mat, q: Float8DelayedScalingQuantizer, ctx: GroupedContext):
  state = ctx.state
  if not isinstance(state, DelayedScalingState) or state.scale.shape != (ctx.groups,):
    got = (f"{type(state).__name__} with scale shape {tuple(state.scale.shape)}"
           if isinstance(state, DelayedScalingState) else type(state).__name__)
    raise ValueError(f"state: grouped Float8DelayedScalingQuantizer needs one "
                     f"DelayedScalingState per group (scale [{ctx.groups}], amax_history "
                     f"[{ctx.groups}, {q.amax_history_len}]; jaxquant.grouped.init_state); "
                     f"got {got}")
  amax = ctx.group_amax(mat)
  return _fp8_with_scale(mat, q, ctx, quantize_scale(state.scale, amax, q), amax)


# ------------------------------------ block-local formats -------------------------------------

def _block_local(mat, q, ctx: GroupedContext):
  """MXFP8 and Float8Block: every scale depends on its own block only, and the layout keeps
  blocks inside groups, so the single-matrix reference is already the grouped one."""
  t = format_of(q).quantize(mat, q, QuantizeContext(ctx.orig_dtype, rht=ctx.rht))
  return t.data, t.scale_inv, ctx.group_amax(mat)


# --------------------------------------------- NVFP4 ------------------------------------------

def _draws(shape: tuple[int, int], ctx: GroupedContext) -> jax.Array:
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


def _nvfp4(mat, q: NVFP4Quantizer, ctx: GroupedContext):
  rows, cols = mat.shape
  block_rows, block_cols = nvfp4.block_shape(q)
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
  draws = _draws(x.shape, ctx) if q.stochastic_rounding else None
  data, scale_inv = nvfp4.encode_blocks(x, q, s_enc, draws)
  return data[:rows, :cols], scale_inv, amax


def _identity(mat, q: IdentityQuantizer, ctx: GroupedContext):
  return mat.astype(q.dtype if q.dtype is not None else ctx.orig_dtype), None, None


_REGISTRY: dict[type, GroupedFormat] = {
    Float8CurrentScalingQuantizer: GroupedFormat(_fp8_current, per_group_scale=True),
    Float8DelayedScalingQuantizer: GroupedFormat(_fp8_delayed, per_group_scale=True),
    MXFP8Quantizer: GroupedFormat(_block_local, lambda q: (1, mxfp8.BLOCK)),
    Float8BlockQuantizer: GroupedFormat(_block_local, lambda q: tuple(q.block)),
    NVFP4Quantizer: GroupedFormat(_nvfp4, nvfp4.block_shape),
    IdentityQuantizer: GroupedFormat(_identity),
}


def grouped_format(quantizer: Quantizer) -> GroupedFormat:
  try:
    return _REGISTRY[type(quantizer)]
  except KeyError:
    raise TypeError(f"quantizer: grouped quantization has no entry for "
                    f"{type(quantizer).__name__}; expected one of "
                    f"{sorted(t.__name__ for t in _REGISTRY)}") from None


# ----------------------------------------- properties -----------------------------------------

def scale_blocks(quantizer: Quantizer) -> Optional[tuple[int, int]]:
  """`(block_rows, block_cols)` of the format's scales, or None (per tensor, Identity)."""
  return grouped_format(quantizer).blocks(quantizer)


def row_scaled(quantizer: Quantizer) -> bool:
  return isinstance(quantizer, NVFP4Quantizer) and quantizer.row_scaled


def token_block(quantizer: Quantizer, direction: str) -> int:
  """The token-layout block `direction`'s copy needs: the scale block along the token axis
  (rows of a rowwise copy, columns of a columnwise copy), at least 16 under RHT."""
  blocks = scale_blocks(quantizer)
  block = 1 if blocks is None else blocks[0 if direction == "rowwise" else 1]
  return max(block, 16) if uses_rht(quantizer, direction) else block


def quantize(mat: jax.Array, quantizer: Quantizer, ctx: GroupedContext):
  return grouped_format(quantizer).quantize(mat, quantizer, ctx)


# ------------------------------------------ decoding ------------------------------------------

def _view(t: GroupedScaledTensor, scale_inv=None, amax=None) -> ScaledTensor:
  return ScaledTensor(t.data, scale_inv, amax, t.quantizer, t.orig_dtype, t.rht)


def raw(t: GroupedScaledTensor) -> jax.Array:
  """float32 blocks times block scales (per-group scales for per-tensor FP8), without NVFP4's
  second-level factor: what the GEMM multiplies."""
  scale_inv = t.scale_inv
  if scale_inv is not None and grouped_format(t.quantizer).per_group_scale:
    scale_inv = along_tokens(t, scale_inv, 1.0)
  return format_of(t.quantizer).dequantize_raw(_view(t, scale_inv))


def factor(t: GroupedScaledTensor) -> Optional[jax.Array]:
  """NVFP4's second-level factor `amax / (6 * 448)` in `t.amax`'s shape (`[G]`, `[rows]` or
  `[G, rows]`), or None for formats without one."""
  if t.amax is None:
    return None
  return format_of(t.quantizer).gemm_factor(_view(t, t.scale_inv, t.amax))


def token_factor(t: GroupedScaledTensor) -> Optional[jax.Array]:
  """`[L]` factor per token position of a rowwise copy (token_axis 0), or None."""
  f = factor(t)
  if f is None or row_scaled(t.quantizer):
    return f
  group, _, _ = positions(t)
  return per_position(f, group, 1.0)


def elementwise_factor(t: GroupedScaledTensor) -> Optional[jax.Array]:
  """The factor broadcastable to `t.data` (for dequantization), or None."""
  f = factor(t)
  if f is None:
    return None
  if t.token_axis == 0:
    return token_factor(t)[:, None]
  if row_scaled(t.quantizer):  # [G, rows] -> [rows, L]
    group, _, _ = positions(t)
    return per_position(f, group, 1.0).T
  return along_tokens(t, f, 1.0)
