"""A kernel's output axes in shard-major order, so a sharded inner output axis flattens locally.

`dense` contracts `x[..., K] @ kernel[K, N1..Nn]` as one 2D GEMM over `N = N1 * ... * Nn`. When
an output axis other than the leading non-trivial one is sharded (a gated `fc1` kernel
`[K, 2, N]` with `N` over `tp`), the flattened `N` axis cannot carry that sharding: each device
holds a strided piece of it, and XLA's partitioner moves the whole kernel (and every output)
to re-lay it out. Here the sharded axis `Nj` is split into `(shards, Nj / shards)` and its shard
index moved in front of the output axes, so each device's part of the flat axis is its own
local block: the reshapes and transposes move no data between devices (decision 19 of
docs/design.md).

The relayout permutes whole runs of `Nj / shards * N(j+1) * ... * Nn` contiguous elements, so a
scaling block along N keeps its elements (and the numerics equal one device's) when that run is
a multiple of the block: `check_blocks` raises otherwise.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Sequence

import jax
from jax.sharding import PartitionSpec as P

from jaxquant import sharding as _sharding


@dataclasses.dataclass(frozen=True)
class ShardMajor:
  """How the output axes `features` of a kernel with `n_contract` leading axes are re-laid.

  Attributes:
    features: the output axes' extents `(N1..Nn)`.
    axis: the index (among the output axes) of the sharded axis that is moved.
    entry: that axis's `PartitionSpec` entry; `shards` the mesh size of it.
    sharding: the `DenseSharding` of the re-laid kernel `[K.., N]` (one output axis).
  """

  features: tuple[int, ...]
  axis: int
  entry: Any
  shards: int
  sharding: _sharding.DenseSharding

  @property
  def run(self) -> int:
    """Contiguous elements of the flat output axis that move together."""
    return self.features[self.axis] // self.shards * math.prod(self.features[self.axis + 1:])

  def _split(self) -> tuple[int, ...]:
    f, j = self.features, self.axis
    return f[:j] + (self.shards, f[j] // self.shards) + f[j + 1:]

  def _to_shard_major(self, value: jax.Array, lead: int) -> jax.Array:
    """`value[lead axes.., N1..Nn]` -> `[lead axes.., N]` with the shard index first."""
    split = value.reshape(value.shape[:lead] + self._split())
    order = (tuple(range(lead)) + (lead + self.axis,)
             + tuple(i for i in range(lead, split.ndim) if i != lead + self.axis))
    return split.transpose(order).reshape(value.shape[:lead] + (math.prod(self.features),))

  def kernel(self, kernel: jax.Array, n_contract: int) -> jax.Array:
    return self._to_shard_major(kernel, n_contract)

  def bias(self, bias: Optional[jax.Array]) -> Optional[jax.Array]:
    return None if bias is None else self._to_shard_major(bias, 0)

  def output(self, y: jax.Array) -> jax.Array:
    """The inverse for the contraction's output `y[rows.., N]` -> `[rows.., N1..Nn]`."""
    lead = y.ndim - 1
    split = self._split()
    moved = (split[self.axis],) + split[:self.axis] + split[self.axis + 1:]
    y = y.reshape(y.shape[:lead] + moved)
    back = list(range(lead + 1, lead + 1 + self.axis)) + [lead] + list(
        range(lead + 1 + self.axis, y.ndim))
    return y.transpose(tuple(range(lead)) + tuple(back)).reshape(
        y.shape[:lead] + self.features)

  def check_blocks(self, quantizers, mesh) -> None:
    """Raise `ValueError` when the moved runs would split a scaling block along N of the
    weight (its `[N, K]` copies) or of the output gradient (`[rows, N]`)."""
    _sharding.check_blocks_fit(quantizers.weight, (self.run * self.shards, 1),
                               P(self.entry, None), mesh,
                               name="kernel", axis_names=("output features", "inputs"))
    _sharding.check_blocks_fit(quantizers.grad_output, (1, self.run * self.shards),
                               P(None, self.entry), mesh, name="grad_output",
                               axis_names=("rows", "output features"))


def shard_major(sharding: Optional[_sharding.DenseSharding], kernel_shape: Sequence[int],
                n_contract: int) -> Optional[ShardMajor]:
  """The relayout a sharded `dense` needs, or None (no kernel spec, or the sharded output axes
  already flatten locally: none sharded, or only the leading axis of extent > 1 is).

  Raises `ValueError` for more than one sharded output axis behind a non-trivial one (not
  supported: name a single output axis in the kernel's spec)."""
  if sharding is None or sharding.kernel is None:
    return None
  features = tuple(kernel_shape[n_contract:])
  entries = tuple(sharding.kernel) + (None,) * (len(kernel_shape) - len(tuple(sharding.kernel)))
  out_entries = entries[n_contract:]
  mesh = sharding.mesh or _sharding.current_mesh()
  if mesh is None:
    return None  # `plan_dense` names the missing mesh
  sharded = [i for i, e in enumerate(out_entries) if _sharding.axis_size(mesh, e) > 1]
  if not sharded:
    return None
  axis = sharded[0]
  if all(n == 1 for n in features[:axis]):
    return None  # the sharded axis leads the flat axis: it flattens locally
  if len(sharded) > 1:
    raise ValueError(f"kernel: output axes {tuple(sharded)} of {features} are all sharded "
                     f"({sharding.kernel}) behind an unsharded axis; a dense takes at most one "
                     "such axis (shard the leading output axis, or only one)")
  shards = _sharding.axis_size(mesh, out_entries[axis])
  if features[axis] % shards:
    raise ValueError(f"kernel: output axis {n_contract + axis} of extent {features[axis]} is "
                     f"not a multiple of its {shards} shards ({out_entries[axis]})")
  kernel_spec = P(*(entries[:n_contract] + (out_entries[axis],)))
  return ShardMajor(features, axis, out_entries[axis], shards,
                    dataclasses.replace(sharding, kernel=kernel_spec))


__all__ = ["ShardMajor", "shard_major"]
