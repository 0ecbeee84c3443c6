"""The ragged exchange: `jax.lax.ragged_all_to_all` moves only the real rows (dropless).

Each device sorts its `A = T * k` token-expert assignments by expert and counts them per expert
(`counts[E]`); one `all_gather` of those counts over the expert axis gives every device the whole
matrix `counts[s, e]` (sender `s`, expert `e`; `ep * E` integers). From it each device computes
the four `[E]` arrays of `ragged_all_to_all` (`send_plan`): slice `i` of a sender holds its
rows of expert `i` and goes to expert `i`'s device (`i // E_loc`), where it is written at

    output_offset(s, e) = sum_{e' < e local} sum_{s'} counts[s', e'] + sum_{s' < s} counts[s', e]

so the receiver's rows come out grouped by local expert (expert 0's rows from sender 0, 1, ...,
then expert 1's, ...), exactly the order of the fixed-size exchange after its sort, with no
permutation on the receiving side, and `group_sizes[e] = sum_s counts[s, e]`. The receiving
buffer has the static worst case of `ep * A` rows (every device sends all of its assignments
here); rows past `sum(group_sizes)` stay zero and belong to no group. `combine` sends every
row back by the mirrored plan (`return_plan`) into an `[A, N]` buffer in the sender's sorted
order. JAX's transpose of `ragged_all_to_all` is the mirrored exchange, so the backward moves
real rows only too.

XLA:CPU does not compile `ragged-all-to-all` (XLA's GPU and TPU backends do); these are the
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
class RaggedDispatched:
  """What the ragged `combine` needs, arrays of all shards sharded over the token axes."""

  position: jax.Array  # [T * k] int32: each assignment's row in its sender's sorted rows
  counts: jax.Array  # [shards * ep, E] int32: each shard's all-gathered counts[sender, expert]
  dropped: jax.Array  # [shards] int32: always 0 (dropless)


def _exclusive_cumsum(x: jax.Array, axis: int) -> jax.Array:
  return jnp.cumsum(x, axis=axis) - x


def _columns_of(counts: jax.Array, device, local: int) -> jax.Array:
  """`counts[:, device * local : (device + 1) * local]`, `[ep, local]` (device may be traced)."""
  return lax.dynamic_slice_in_dim(counts, device * local, local, axis=1)


def received_group_sizes(counts: jax.Array, device, local: int) -> jax.Array:
  """`[local]` rows of each of `device`'s experts, over all senders, from `counts[ep, E]`."""
  return jnp.sum(_columns_of(counts, device, local), axis=0).astype(jnp.int32)


def write_offsets(counts: jax.Array, local: int) -> jax.Array:
  """`[ep, ep, local]`: where sender `s`'s rows of receiver `r`'s local expert `e` start on `r`
  (`[s, r, e]`): after all of `r`'s rows of its experts before `e`, and after the rows of
  expert `e` of the senders before `s`."""
  ep = counts.shape[0]
  by_receiver = counts.reshape(ep, ep, local)  # [s, r, e]
  expert_start = _exclusive_cumsum(jnp.sum(by_receiver, axis=0), 1)  # [r, e]
  return expert_start[None] + _exclusive_cumsum(by_receiver, 0)


def send_plan(counts: jax.Array, device, local: int) -> tuple[jax.Array, ...]:
  """The dispatch's `(input_offsets, send_sizes, output_offsets, recv_sizes)` of `device`.

  Args:
    counts: `[ep, E]` int: `counts[s, e]` assignments of expert-axis device `s` to expert `e`
      (the same matrix on every device).
    device: this device's index along the expert axis (an int, or traced `axis_index`).
    local: experts per device, `E / ep`.

  Returns:
    Four `[E]` int32 arrays. Slice `i` is this device's rows of expert `i` (its rows sorted by
    expert), sent to device `i // local`; `recv_sizes[s * local + e]` is what sender `s` sends
    of this device's local expert `e`.
  """
  counts = jnp.asarray(counts, jnp.int32)
  experts = counts.shape[1]
  mine = counts[device]  # [E]
  input_offsets = _exclusive_cumsum(mine, 0)
  output_offsets = write_offsets(counts, local)[device].reshape(experts)
  recv_sizes = _columns_of(counts, device, local).reshape(experts)
  return input_offsets, mine, output_offsets, recv_sizes


def return_plan(counts: jax.Array, device, local: int) -> tuple[jax.Array, ...]:
  """The combine's `(input_offsets, send_sizes, output_offsets, recv_sizes)` of `device`: the
  mirror of `send_plan` (slice `s * local + e` = the rows of this device's local expert `e`
  that came from sender `s`, sent back to `s` at the start of expert `device * local + e` in
  `s`'s sorted rows)."""
  counts = jnp.asarray(counts, jnp.int32)
  experts = counts.shape[1]
  input_offsets = write_offsets(counts, local)[:, device].reshape(experts)
  send_sizes = _columns_of(counts, device, local).reshape(experts)
  output_offsets = _columns_of(_exclusive_cumsum(counts, 1), device, local).reshape(experts)
  return input_offsets, send_sizes, output_offsets, counts[device]


def local_dispatch(x, chosen, *, layout: ExpertSharding):
  """One device: `(rows[ep * A, D], group_sizes[E_loc], RaggedDispatched)` of its tokens `x`
  and choices `chosen`."""
  tokens, top_k = chosen.shape
  ep, local, axis = layout.ep, layout.local_experts, layout.expert_axis
  assignments = tokens * top_k
  expert = chosen.reshape(-1).astype(jnp.int32)
  order = jnp.argsort(expert, stable=True).astype(jnp.int32)
  counts = jnp.sum(expert[:, None] == jnp.arange(layout.experts, dtype=jnp.int32)[None, :],
                   axis=0).astype(jnp.int32)
  all_counts = lax.all_gather(counts, axis)  # [ep, E]
  device = lax.axis_index(axis)
  received = jnp.zeros((ep * assignments, x.shape[-1]), x.dtype)
  rows = lax.ragged_all_to_all(x[order // top_k], received, *send_plan(all_counts, device, local),
                               axis_name=axis)
  position = jnp.zeros_like(order).at[order].set(jnp.arange(assignments, dtype=jnp.int32))
  dispatched = RaggedDispatched(position, all_counts, jnp.zeros((1,), jnp.int32))
  return rows, received_group_sizes(all_counts, device, local), dispatched


def local_combine(y, weights, dispatched: RaggedDispatched, *, layout: ExpertSharding):
  """One device: its tokens' outputs `[T, N]` from the expert outputs `y` in dispatch order."""
  axis = layout.expert_axis
  plan = return_plan(dispatched.counts, lax.axis_index(axis), layout.local_experts)
  back = lax.ragged_all_to_all(y, jnp.zeros((weights.size, y.shape[-1]), y.dtype), *plan,
                               axis_name=axis)
  out = back[dispatched.position].reshape(*weights.shape, y.shape[-1])
  return jnp.sum(out * weights[..., None].astype(out.dtype), axis=1)
