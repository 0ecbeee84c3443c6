"""The fixed-size exchange: one `jax.lax.all_to_all` of per-(sender, receiver) buffers.

Each device sorts its own token-expert assignments by expert and writes each into the buffer of
its expert's device: `capacity` rows per (sender, receiver) pair (every assignment of the
sender when dropless, at the price of `ep` times the rows in the buffers, or `capacity_factor`
times an even share). Assignments past the capacity are **dropped** (their output is zero, as
in GShard/Switch) and counted. The receiver sorts what it got by local expert: rows of expert 0,
then 1, ..., then the empty slots. `combine` applies the inverse permutation and the same
`all_to_all`. It runs on every platform (XLA:CPU has no `ragged_all_to_all`); these are the
per-device bodies that `jaxquant.expert_parallel.exchange` runs in `shard_map`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jaxquant.expert_parallel.layout import ExpertSharding


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Dispatched:
  """What `combine` needs: per assignment its buffer slot (`ep * capacity` = dropped), per
  received row its position in the expert-sorted rows. Arrays of all shards, sharded over the
  token axes."""

  slot: jax.Array  # [T * k] int32
  perm: jax.Array  # [shards * ep * capacity] int32
  dropped: jax.Array  # [shards] int32: assignments past the capacity, per token shard


def local_dispatch(x, chosen, *, layout: ExpertSharding, capacity: int):
  """One device: `(rows, group_sizes, Dispatched)` of its tokens `x` and choices `chosen`."""
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


def local_combine(y, weights, dispatched: Dispatched, *, layout: ExpertSharding):
  """One device: its tokens' outputs `[T, N]` from the expert outputs `y` in dispatch order."""
  back = jnp.zeros_like(y).at[dispatched.perm].set(y)
  if layout.ep > 1:
    back = lax.all_to_all(back, layout.expert_axis, 0, 0, tiled=True)
  out = back.at[dispatched.slot].get(mode="fill", fill_value=0)
  out = out.reshape(*weights.shape, y.shape[-1])
  return jnp.sum(out * weights[..., None].astype(out.dtype), axis=1)
