"""What a format needs to quantize a grouped token layout (`Format.grouped_quantize`).

Tokens sorted by group (expert) are laid out by `jaxquant.grouping.layout`; a grouped quantize
must give every group bit-for-bit what `jaxquant.ops.quantize` gives that group alone. Block-local
formats (every scale depends on its own block only) get that from their single-matrix reference
on the padded layout (`block_local`); formats with a per-tensor quantity (an amax, a scale, a
second-level scale) take it per group from `GroupedContext`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxquant.formats.base import QuantizeContext
from jaxquant.grouping.layout import abs_bits, per_position, segment_amax


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


def block_local(fmt, mat: jax.Array, quantizer, ctx: GroupedContext) -> tuple:
  """Grouped quantize of a format whose every scale depends on its own block only (MXFP8,
  Float8Block): the layout keeps blocks inside groups, so the single-matrix reference is
  already the grouped one; the amax is per group."""
  t = fmt.quantize(mat, quantizer, QuantizeContext(ctx.orig_dtype, rht=ctx.rht))
  return t.data, t.scale_inv, ctx.group_amax(mat)
