"""The embedding lookup with its table gradient summed in float32.

`flax.linen.Embed` gathers from the table promoted to the compute dtype, so its gradient is
XLA's scatter-add of `dy` into a bfloat16 table. On a GPU that scatter adds bfloat16 values by
compare-and-swap loops, which collide wherever a token repeats: 25-27 ms for 16384 byte-pair
tokens into a [32000, 2048] table on an H200, with 3% error from the bfloat16 sums
(bench/embed_grad.py, bench/RESULTS.md "Session 37"). `embedding_lookup` gathers the same
values but scatters `dy` cast to float32 into a float32 table (native float32 atomics): 0.19 ms
there, within float32 summation of the float64 sum.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def _accumulation_dtype(table_dtype) -> jnp.dtype:
  return jnp.promote_types(table_dtype, jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def embedding_lookup(table: jax.Array, ids: jax.Array, dtype) -> jax.Array:
  """`table[ids]` in `dtype` (`jnp.take(table.astype(dtype), ids, axis=0)`, as `nn.Embed`).

  Args:
    table: `[num_embeddings, features]`, any float dtype (the parameter).
    ids: integer array of any shape; out-of-range ids give NaN rows, as `jnp.take`'s default.
    dtype: the output dtype (the compute dtype).

  Returns:
    `[*ids.shape, features]` in `dtype`. Its gradient with respect to `table` is `dy` summed
    into each id's row in float32 (or the table's dtype where wider), then cast to the table's
    dtype; out-of-range ids receive nothing.
  """
  return jnp.take(table.astype(dtype), ids, axis=0)


def _fwd(table, ids, dtype):
  return embedding_lookup(table, ids, dtype), (table, ids)


def _bwd(dtype, residuals, dy):
  del dtype
  table, ids = residuals
  acc = _accumulation_dtype(table.dtype)
  rows = dy.reshape(-1, table.shape[-1]).astype(acc)
  dtable = jnp.zeros(table.shape, acc).at[ids.reshape(-1)].add(rows, mode="drop")
  return dtable.astype(table.dtype), np.zeros(ids.shape, jax.dtypes.float0)


embedding_lookup.defvjp(_fwd, _bwd)
