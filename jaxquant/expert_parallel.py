"""Expert parallelism: routed tokens sent to the devices that hold their experts, and back.

Under a mesh, a mixture-of-experts layer keeps its tokens sharded over the token (batch) mesh
axes and its experts sharded over an expert axis (`ep`, one of the token axes): the device at
`ep` index `d` holds experts `[d * E_loc, (d + 1) * E_loc)`. Each device

1. `dispatch`: sorts its own token-expert assignments by expert and sends each to the device of
   its expert with one `all_to_all` over the expert axis. Buffers have a fixed `capacity` of
   rows per (sender, receiver) pair (XLA:CPU has no `ragged_all_to_all`; a fixed-size
   `all_to_all` runs everywhere): by default every assignment of the sender (dropless, at the
   price of `ep` times the rows in the buffers), or `capacity_factor` times an even share.
   Assignments past the capacity are **dropped** (their output is zero, as in GShard/Switch);
   `dispatch` returns how many. The receiver sorts what it got by local expert: rows of expert
   0, then 1, ..., then the empty slots, with `group_sizes` per local expert, ready for
   `jaxquant.grouped_dense` on its own experts (`jaxquant.flax.GroupedDense` with
   `input_axes`).
2. `combine`: the inverse permutation and the same `all_to_all` bring each output row home, and
   the top-k outputs of a token are summed with their router weights.

Without an expert axis (or with one of size 1) nothing is sent: each data shard groups its own
tokens and runs every expert on them (data-parallel MoE with replicated experts). Rows go to
their expert in the order the sender sorted them; a receiver holds all the rows of its experts
(when nothing is dropped), so per-expert scales equal one device's. With a data axis beside
`ep` each data shard's copy of an expert sees that shard's tokens only, and a per-tensor scale
(FP8 current scaling) follows their amax, not the amax of all of the expert's tokens.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxquant import sharding as _sharding


@dataclasses.dataclass(frozen=True)
class ExpertSharding:
  """Where the tokens and the experts of a MoE layer live.

  Attributes:
    mesh: the mesh (or abstract mesh of `jax.set_mesh`).
    token_axes: mesh axes sharding the tokens (the batch axes, the expert axis among them).
    expert_axis: mesh axis sharding the experts (None: experts replicated).
    experts: number of experts E.
    capacity_factor: None: dropless (a buffer slot for every local assignment); else each
      (sender, receiver) pair gets `ceil(capacity_factor * assignments / ep)` rows.
  """

  mesh: Any
  token_axes: tuple[str, ...]
  expert_axis: Optional[str]
  experts: int
  capacity_factor: Optional[float] = None

  def __post_init__(self):
    names = tuple(self.mesh.axis_names)
    for axis in self.token_axes + ((self.expert_axis,) if self.expert_axis else ()):
      if axis not in names:
        raise ValueError(f"ExpertSharding: mesh axis {axis!r} is not in the mesh {names}")
    if self.expert_axis and self.ep > 1 and self.expert_axis not in self.token_axes:
      raise ValueError(f"ExpertSharding: the expert axis {self.expert_axis!r} must also shard "
                       f"the tokens (token axes {self.token_axes}): each expert device routes "
                       "its own tokens")
    if self.experts % self.ep:
      raise ValueError(f"experts={self.experts} is not divisible by the {self.ep} devices of "
                       f"the expert axis {self.expert_axis!r}: every device must hold the same "
                       f"number of experts (use a multiple of {self.ep} experts, or a smaller "
                       "expert axis)")
    if self.capacity_factor is not None and not self.capacity_factor > 0:
      raise ValueError(f"capacity_factor={self.capacity_factor}: expected None (dropless) or "
                       "a positive number")

  @property
  def ep(self) -> int:
    """Devices along the expert axis (1 without one)."""
    return self.mesh.shape[self.expert_axis] if self.expert_axis else 1

  @property
  def local_experts(self) -> int:
    return self.experts // self.ep

  @property
  def shards(self) -> int:
    """Token shards (devices holding different tokens)."""
    return _sharding.axis_size(self.mesh, self.token_axes)

  def capacity(self, assignments: int) -> int:
    """Rows per (sender, receiver) pair for `assignments` local token-expert assignments."""
    if self.capacity_factor is None or self.ep == 1:
      return assignments
    return min(assignments, math.ceil(self.capacity_factor * assignments / self.ep))

  @property
  def token_spec(self) -> P:
    return P(_sharding.spec_entry(self.token_axes))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Dispatched:
  """What `combine` needs: per assignment its buffer slot (`ep * capacity` = dropped), per
  received row its position in the expert-sorted rows. Arrays of all shards, sharded over the
  token axes."""

  slot: jax.Array  # [T * k] int32
  perm: jax.Array  # [shards * ep * capacity] int32
  dropped: jax.Array  # [shards] int32: assignments past the capacity, per token shard


def _local_dispatch(x, chosen, *, layout: ExpertSharding, capacity: int):
  tokens, top_k = chosen.shape
  ep, local = layout.ep, layout.local_experts
  expert = chosen.reshape(-1).astype(jnp.int32)
  dest = expert // local
  order = jnp.argsort(expert, stable=True)
  counts = jnp.sum(dest[:, None] == jnp.arange(ep, dtype=jnp.int32)[None, :], axis=0)
  start = jnp.cumsum(counts) - counts
  index = jnp.arange(expert.shape[0], dtype=jnp.int32)
  pos = jnp.zeros_like(index).at[order].set(index - start[dest[order]])
  keep = pos < capacity
  slot = jnp.where(keep, dest * capacity + pos, ep * capacity)
  rows = ep * capacity
  send = jnp.zeros((rows, x.shape[-1]), x.dtype).at[slot].set(x[index // top_k], mode="drop")
  send_expert = jnp.full((rows,), local, jnp.int32).at[slot].set(expert % local, mode="drop")
  if ep > 1:
    send = lax.all_to_all(send, layout.expert_axis, 0, 0, tiled=True)
    send_expert = lax.all_to_all(send_expert, layout.expert_axis, 0, 0, tiled=True)
  perm = jnp.argsort(send_expert, stable=True).astype(jnp.int32)
  group_sizes = jnp.sum(send_expert[:, None] == jnp.arange(local, dtype=jnp.int32)[None, :],
                        axis=0).astype(jnp.int32)
  dropped = jnp.sum(~keep).astype(jnp.int32).reshape(1)
  return send[perm], group_sizes, Dispatched(slot.astype(jnp.int32), perm, dropped)


def dispatch(x: jax.Array, chosen: jax.Array, layout: ExpertSharding):
  """Send every token-expert assignment to its expert's device.

  Args:
    x: `[T, D]` tokens, sharded over `layout.token_axes`.
    chosen: `[T, k]` int expert index (in `[0, E)`) of each token's k choices, sharded alike.
    layout: the `ExpertSharding`.

  Returns:
    `(rows, group_sizes, dispatched)`: `rows[shards * ep * capacity, D]` (each shard's rows
    sorted by its local experts, empty slots last, zeros), `group_sizes[shards * E_loc]` (each
    shard's rows per local expert) and the `Dispatched` bookkeeping for `combine`; all sharded
    over the token axes.
  """
  tokens, top_k = chosen.shape
  shards = layout.shards
  if tokens % shards:
    raise ValueError(f"dispatch: {tokens} tokens do not divide over the {shards} token shards "
                     f"of {layout.token_axes}")
  capacity = layout.capacity((tokens // shards) * top_k)
  spec = layout.token_spec
  fn = jax.shard_map(
      lambda x, c: _local_dispatch(x, c, layout=layout, capacity=capacity),
      mesh=layout.mesh, in_specs=(spec, spec),
      out_specs=(spec, spec, Dispatched(spec, spec, spec)), check_vma=False)
  return fn(x, chosen)


def _local_combine(y, weights, dispatched: Dispatched, *, layout: ExpertSharding):
  back = jnp.zeros_like(y).at[dispatched.perm].set(y)
  if layout.ep > 1:
    back = lax.all_to_all(back, layout.expert_axis, 0, 0, tiled=True)
  out = back.at[dispatched.slot].get(mode="fill", fill_value=0)
  out = out.reshape(*weights.shape, y.shape[-1])
  return jnp.sum(out * weights[..., None].astype(out.dtype), axis=1)


def combine(y: jax.Array, weights: jax.Array, dispatched: Dispatched,
            layout: ExpertSharding) -> jax.Array:
  """The inverse of `dispatch`, then each token's outputs summed with its router weights.

  Args:
    y: `[shards * ep * capacity, N]` expert outputs, in `dispatch`'s row order.
    weights: `[T, k]` router weights of the choices.
    dispatched: from `dispatch`.
    layout: the same `ExpertSharding`.

  Returns:
    `[T, N]` in `y`'s dtype, sharded over the token axes (a dropped assignment adds nothing).
  """
  spec = layout.token_spec
  fn = jax.shard_map(lambda y, w, d: _local_combine(y, w, d, layout=layout),
                     mesh=layout.mesh, in_specs=(spec, spec, Dispatched(spec, spec, spec)),
                     out_specs=spec, check_vma=False)
  return fn(y, weights, dispatched)
