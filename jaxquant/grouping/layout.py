"""Where each token of a grouped matrix lives: the packed and the block-padded token layouts.

Tokens `x[T, C]` arrive sorted by group (expert): group `g` owns the rows
`[start_g, start_g + n_g)` with `start_g = n_0 + ... + n_{g-1}` (the *packed* layout, block 1,
which is `jax.lax.ragged_dot`'s). Rows from `sum(n)` to `T` belong to no group.

A quantized copy whose scale blocks run along the token axis (the columnwise copies the wgrad
GEMM contracts over tokens; rowwise copies with 2-D blocks) uses the *padded* layout of block
`b` instead: every group starts at a multiple of `b` and its `n_g` tokens are followed by zeros
up to `round_up(n_g, b)`, so no block ever holds tokens of two groups. `group_sizes` is traced
under `jit`, so the padded length must be static: `sum_g round_up(n_g, b) <= T + G (b - 1)`,
rounded down to a multiple of `b` (`TokenLayout.length`); positions past the last group are
zeros. Zeros change no block's amax and contribute nothing to a GEMM, which is what makes a
group in the padded layout quantize exactly as the group alone would (docs/design.md §3
"Storage convention": formats pad partial blocks with zeros).

Group sizes are normalized once (`clip_sizes`): negative sizes count as 0 and groups that run
past row `T` are cut at `T`, as `jax.lax.ragged_dot` cuts them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


def clip_sizes(group_sizes: jax.Array, tokens: int) -> jax.Array:
  """int32 `[G]` sizes with negative entries as 0 and the groups cut at `tokens` rows."""
  sizes = jnp.maximum(jnp.asarray(group_sizes).astype(jnp.int32), 0)
  ends = jnp.minimum(jnp.cumsum(sizes), tokens)
  return ends - jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])


def _exclusive_cumsum(sizes: jax.Array) -> jax.Array:
  return jnp.concatenate([jnp.zeros((1,), sizes.dtype), jnp.cumsum(sizes)[:-1]])


@dataclasses.dataclass(frozen=True)
class TokenLayout:
  """A static description of how `tokens` rows of `groups` groups are laid out.

  Attributes:
    tokens: `T`, the packed token count (rows of `x`).
    groups: `G`, the number of groups (experts).
    block: `1` for the packed layout, else the padding multiple `b` of every group.
  """

  tokens: int
  groups: int
  block: int = 1

  def __post_init__(self):
    if self.groups < 1:
      raise ValueError(f"TokenLayout: groups={self.groups}; expected at least one group")
    if self.block < 1 or self.block & (self.block - 1):
      raise ValueError(f"TokenLayout: block={self.block}; expected a power of two")

  @property
  def padded(self) -> bool:
    return self.block > 1

  @property
  def length(self) -> int:
    """Static number of token positions: `T` packed, else `b * floor((T + G (b - 1)) / b)`."""
    if not self.padded:
      return self.tokens
    b = self.block
    return b * ((self.tokens + self.groups * (b - 1)) // b)

  def extents(self, sizes: jax.Array) -> jax.Array:
    """Positions each group occupies: `round_up(n_g, b)` (the sizes ragged GEMMs use)."""
    b = self.block
    return sizes if b == 1 else (sizes + (b - 1)) // b * b

  def starts(self, sizes: jax.Array) -> jax.Array:
    return _exclusive_cumsum(self.extents(sizes))

  def positions(self, sizes: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per position: (group `[L]` int32, `G` past the last group; index within the group;
    whether the position holds a token rather than padding)."""
    extents = self.extents(sizes)
    ends = jnp.cumsum(extents)
    pos = jnp.arange(self.length, dtype=jnp.int32)
    group = jnp.searchsorted(ends, pos, side="right").astype(jnp.int32)
    starts = jnp.concatenate([_exclusive_cumsum(extents), ends[-1:]])
    local = pos - starts[group]
    valid = local < jnp.concatenate([sizes, jnp.zeros((1,), sizes.dtype)])[group]
    return group, local, valid

  def gather(self, x: jax.Array, sizes: jax.Array) -> jax.Array:
    """Packed `x[T, ...]` -> this layout `[L, ...]` (padding and rows of no group are zero)."""
    group, local, valid = self.positions(sizes)
    source = jnp.concatenate([_exclusive_cumsum(sizes), jnp.zeros((1,), sizes.dtype)])[group]
    rows = jnp.take(x, jnp.clip(source + local, 0, max(self.tokens - 1, 0)), axis=0)
    mask = valid.reshape(valid.shape + (1,) * (x.ndim - 1))
    return jnp.where(mask, rows, jnp.zeros((), x.dtype))

  def to_packed(self, y: jax.Array, sizes: jax.Array) -> jax.Array:
    """This layout's `y[L, ...]` -> packed `[T, ...]` (rows of no group are zero)."""
    packed = TokenLayout(self.tokens, self.groups)
    if not self.padded:
      return y
    group, local, valid = packed.positions(sizes)
    starts = jnp.concatenate([self.starts(sizes), jnp.zeros((1,), sizes.dtype)])[group]
    rows = jnp.take(y, jnp.clip(starts + local, 0, self.length - 1), axis=0)
    mask = valid.reshape(valid.shape + (1,) * (y.ndim - 1))
    return jnp.where(mask, rows, jnp.zeros((), y.dtype))

  def group_slices(self, sizes) -> list[tuple[int, int]]:
    """(start, extent) of every group for concrete `sizes` (eager: tests and debugging)."""
    sizes = np.asarray(sizes, np.int64)
    b = self.block
    extents = (sizes + b - 1) // b * b
    starts = np.concatenate([[0], np.cumsum(extents)[:-1]])
    return [(int(s), int(e)) for s, e in zip(starts, extents)]


def per_position(values: jax.Array, group: jax.Array, fill) -> jax.Array:
  """`values[G, ...]` indexed by each position's group (`fill` for positions of no group)."""
  pad = jnp.full((1,) + values.shape[1:], fill, values.dtype)
  return jnp.concatenate([values, pad])[group]


def segment_amax(bits: jax.Array, group: jax.Array, groups: int) -> jax.Array:
  """Per-group max of non-negative float32 bit patterns `bits[L, ...]` (NaN sorts above inf),
  returned as float32 `[G, ...]`; an empty group has amax 0."""
  seg = jax.ops.segment_max(bits, group, num_segments=groups + 1, indices_are_sorted=True)
  seg = jnp.maximum(seg[:groups], jnp.uint32(0))
  return jax.lax.bitcast_convert_type(seg, jnp.float32)


def abs_bits(x: jax.Array) -> jax.Array:
  """`|x|` as float32 bit patterns (the uint32 order is the float order; NaN above inf)."""
  return jax.lax.bitcast_convert_type(jnp.abs(x.astype(jnp.float32)), jnp.uint32)
