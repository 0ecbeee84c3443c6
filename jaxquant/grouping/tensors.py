"""Grouped storages: one quantized direction of a token matrix whose tokens belong to groups.

`GroupedScaledTensor` follows the storage convention of `jaxquant.ScaledTensor` (docs/design.md
§3 "Storage convention": `[rows, cols]`, contraction axis last, a columnwise copy stored
transposed) with the
token axis laid out by a `TokenLayout`. What differs is what a per-tensor quantity means: it is
per *group*, exactly what each group would hold if it were quantized on its own:

- per-tensor FP8: `scale_inv` is `[G]` float32 (one scale per group), `amax` `[G]`;
- NVFP4: `amax` is `[G]` (the second-level scale of each group), or for row-scaled NVFP4 `[rows]`
  when the rows are tokens (rowwise copy: one scale per token, as for one matrix) and `[G, rows]`
  when the rows are features (columnwise copy: one scale per group and feature);
- MXFP8 and Float8Block keep their block scales in the block grid of `data` (blocks never cross a
  group in the layout), and `amax` `[G]`;
- Identity: the high-precision matrix, no scales.

Expert weights `[G, rows, cols]` need no new storage: they are `ScaledTensor`s whose leaves carry
a leading expert axis (`jax.vmap` of one expert's storage).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant.grouping import layout as layout_lib
from jaxquant.grouping.layout import TokenLayout
from jaxquant.formats import format_of
from jaxquant.numerics.hadamard import rht16_inverse
from jaxquant.quantizers import Quantizer
from jaxquant.tensors import ScaledTensor


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GroupedScaledTensor:
  """One quantized `[rows, cols]` matrix in one format whose token axis is grouped.

  Attributes:
    data: payload; rows are token positions (`token_axis == 0`, a rowwise copy) or columns are
      (`token_axis == 1`, a columnwise copy), in the order of `layout`.
    scale_inv: block scales in the block grid of `data`; `[G]` for per-tensor FP8; None for
      Identity.
    amax: per-group amax (see the module docstring for the row-scaled shapes); None for Identity.
    group_sizes: int32 `[G]` tokens per group (normalized by `layout.clip_sizes`).
    quantizer: the single-format quantizer that produced it (static).
    orig_dtype: dtype of the tensor that was quantized (static).
    rht: whether the random Hadamard transform was applied along `cols` (static).
    token_axis: 0 or 1, the axis of `data` that runs over token positions (static).
    layout: the `TokenLayout` of that axis (static).
  """

  data: jax.Array
  scale_inv: Optional[jax.Array]
  amax: Optional[jax.Array]
  group_sizes: jax.Array
  quantizer: Quantizer = dataclasses.field(metadata=dict(static=True))
  orig_dtype: Any = dataclasses.field(default=np.dtype(jnp.float32), metadata=dict(static=True))
  rht: bool = dataclasses.field(default=False, metadata=dict(static=True))
  token_axis: int = dataclasses.field(default=0, metadata=dict(static=True))
  layout: TokenLayout = dataclasses.field(default=TokenLayout(0, 1),
                                          metadata=dict(static=True))

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.data.shape)

  @property
  def ndim(self) -> int:
    return self.data.ndim

  @property
  def groups(self) -> int:
    return self.layout.groups

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """The high-precision matrix in this storage's layout (`[rows, cols]`, RHT undone)."""
    values = raw(self)
    factor = elementwise_factor(self)
    if factor is not None:
      values = values * factor
    if self.rht:
      values = rht16_inverse(values)
    return values.astype(dtype)

  def tokens(self, dtype=jnp.float32) -> jax.Array:
    """The dequantized tokens, packed `[T, features]` (rows of no group are zero)."""
    values = self.dequantize(dtype)
    if self.token_axis == 1:
      values = values.T
    return self.layout.to_packed(values, self.group_sizes)

  def group(self, g: int) -> ScaledTensor:
    """Group `g` as a `ScaledTensor` (eager; needs concrete `group_sizes`).

    The view covers the group's extent in the layout (its tokens zero-padded to the layout's
    block), so it equals `jaxquant.ops.quantize` of the group's rows zero-padded the same way.
    """
    start, extent = self.layout.group_slices(self.group_sizes)[g]
    sl = slice(start, start + extent)
    data = self.data[sl] if self.token_axis == 0 else self.data[:, sl]
    scale_inv = self.scale_inv
    blocks = scale_blocks(self.quantizer)
    if scale_inv is not None:
      if blocks is None:  # per-tensor FP8
        scale_inv = scale_inv[g]
      else:
        b = blocks[self.token_axis]
        bl = slice(start // b, (start + extent + b - 1) // b)
        scale_inv = scale_inv[bl] if self.token_axis == 0 else scale_inv[:, bl]
    amax = self.amax
    if amax is not None:
      per_token = self.token_axis == 0 and row_scaled(self.quantizer)
      amax = amax[sl] if per_token else amax[g]
    return ScaledTensor(data, scale_inv, amax, self.quantizer, self.orig_dtype, self.rht)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GroupedQuantizedTensor:
  """What grouped quantization returns: the rowwise copy (tokens are rows) and/or the
  columnwise copy (tokens are columns); for a `HybridQuantizer` they come from different
  formats, and each may use its own token layout."""

  rowwise: Optional[GroupedScaledTensor]
  columnwise: Optional[GroupedScaledTensor]
  quantizer: Quantizer = dataclasses.field(metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TransposedExperts:
  """Expert matrices `[G, N, K]` held as their transposed copy `stored` `[G, K, N]` (a
  `ScaledTensor` with a leading expert axis; `materialize()` swaps its last two axes, scales
  included). Two kinds, both read along N by the forward GEMM on operands decoded to bfloat16:
  - a quantizer whose columnwise copy is its rowwise copy transposed
    (`Format.columnwise_is_transposed_rowwise`): the same storage, read the other way.
    `jaxquant.grouped_dense` passes its dgrad copy this way: one quantized copy and one decode
    instead of two each;
  - raw values (`Format.stores_raw`: MXFP8 written raw in the weights' own layout, design
    decision 49), which decode as they are whatever their blocks' direction.
  Any other GEMM path takes `materialize()`, the `[G, N, K]` storage by an XLA transpose."""

  stored: ScaledTensor

  def materialize(self) -> ScaledTensor:
    """The `[G, N, K]` storage: payload and block scales with their last two axes swapped
    (per-expert scales and amaxes as they are)."""
    swap = lambda a: a if a is None or a.ndim < 3 else jnp.swapaxes(a, 1, 2)
    t = self.stored
    return ScaledTensor(swap(t.data), swap(t.scale_inv), t.amax, t.quantizer, t.orig_dtype,
                        t.rht)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PendingRowwise:
  """Expert weights' raw MXFP8 rowwise copy (`jaxquant.grouped_dense`'s dgrad copy) not yet
  written (design decision 56). Where a value's row and column blocks keep it a normal FP8
  value, both raw copies hold it rounded to the payload's bits, so the rowwise copy is the raw
  columnwise copy in the weights' own layout (`TransposedExperts`, the forward GEMM's operand)
  with only the 32-value row blocks set in `flags` rewritten. `jaxquant.ops.grouped.write_pending`
  rewrites them in place once the forward GEMM has read that copy: one copy of the weights
  written a step instead of two. Holds the weights `[G * rows, cols]` that call reads again,
  the flags, and the rowwise copy's scales `[G, rows, ceil(cols / 32)]` and amax."""

  weights: jax.Array
  flags: jax.Array
  scale_inv: jax.Array
  amax: jax.Array
  quantizer: Quantizer = dataclasses.field(metadata=dict(static=True))
  orig_dtype: Any = dataclasses.field(default=np.dtype(jnp.bfloat16), metadata=dict(static=True))


def positions(t: GroupedScaledTensor) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(group, index in group, holds a token) of every token position of `t`."""
  return t.layout.positions(t.group_sizes)


def along_tokens(t: GroupedScaledTensor, values: jax.Array, fill) -> jax.Array:
  """Per-group `values[G]` broadcast over `t.data`'s token axis (`[L, 1]` or `[1, L]`)."""
  group, _, _ = positions(t)
  per_pos = layout_lib.per_position(values, group, fill)
  return per_pos[:, None] if t.token_axis == 0 else per_pos[None, :]


# ------------------------------------ format properties -------------------------------------

def scale_blocks(quantizer: Quantizer) -> Optional[tuple[int, int]]:
  """`(block_rows, block_cols)` of the format's scales, or None (per tensor, Identity)."""
  return format_of(quantizer).blocks(quantizer)


def per_group_scale(quantizer: Quantizer) -> bool:
  """Whether `scale_inv` holds one scale per group (`[G]`): a per-tensor scale (FP8)."""
  return format_of(quantizer).scale_layout(quantizer) == "tensor"


def row_scaled(quantizer: Quantizer) -> bool:
  """Whether `amax` holds one amax per row (row-scaled NVFP4)."""
  return format_of(quantizer).amax_layout(quantizer) == "row"


# ------------------------------------------ decoding ------------------------------------------

def _view(t: GroupedScaledTensor, scale_inv=None, amax=None) -> ScaledTensor:
  return ScaledTensor(t.data, scale_inv, amax, t.quantizer, t.orig_dtype, t.rht)


def raw(t: GroupedScaledTensor) -> jax.Array:
  """float32 blocks times block scales (per-group scales for per-tensor FP8), without NVFP4's
  second-level factor: what the GEMM multiplies."""
  scale_inv = t.scale_inv
  if scale_inv is not None and per_group_scale(t.quantizer):
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
  return layout_lib.per_position(f, group, 1.0)


def elementwise_factor(t: GroupedScaledTensor) -> Optional[jax.Array]:
  """The factor broadcastable to `t.data` (for dequantization), or None."""
  f = factor(t)
  if f is None:
    return None
  if t.token_axis == 0:
    return token_factor(t)[:, None]
  if row_scaled(t.quantizer):  # [G, rows] -> [rows, L]
    group, _, _ = positions(t)
    return layout_lib.per_position(f, group, 1.0).T
  return along_tokens(t, f, 1.0)
