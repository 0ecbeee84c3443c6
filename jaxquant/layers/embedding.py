"""The embedding lookup with its table gradient summed in float32.

`flax.linen.Embed` gathers from the table promoted to the compute dtype, so its gradient is
XLA's scatter-add of `dy` into a bfloat16 table. On a GPU that scatter adds bfloat16 values by
compare-and-swap loops, which collide wherever a token repeats: 25-27 ms for 16384 byte-pair
tokens into a [32000, 2048] table on an H200, with 3% error from the bfloat16 sums
(bench/embed_grad.py, bench/RESULTS.md "Session 37"). `embedding_lookup` gathers the same
values and forms the gradient in float32, one of two ways (`EMBEDDING_GRADIENTS`):

  "scatter"  `dy` cast to float32, scatter-added into a float32 table (native float32 atomics):
             0.19 ms there.
  "one-hot"  `one_hot(ids)^T @ dy`, a GEMM of 2 x tokens x vocab x features FLOPs with a float32
             accumulator: deterministic, and cheap for small vocabularies (3.8 ms at vocab 32000
             there, but a fraction of the scatter's time at the 256 byte tokens of
             examples/lm, where every row repeats thousands of times).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

EMBEDDING_GRADIENTS = ("scatter", "one-hot")


def check_gradient(gradient: str) -> str:
  if gradient not in EMBEDDING_GRADIENTS:
    raise ValueError(f"gradient={gradient!r}: the embedding gradient is one of "
                     f"{EMBEDDING_GRADIENTS}")
  return gradient


def _accumulation_dtype(table_dtype) -> jnp.dtype:
  return jnp.promote_types(table_dtype, jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def embedding_lookup(table: jax.Array, ids: jax.Array, dtype, gradient: str = "scatter"
                     ) -> jax.Array:
  """`table[ids]` in `dtype` (`jnp.take(table.astype(dtype), ids, axis=0)`, as `nn.Embed`).

  Args:
    table: `[num_embeddings, features]`, any float dtype (the parameter).
    ids: integer array of any shape; out-of-range ids give NaN rows, as `jnp.take`'s default.
    dtype: the output dtype (the compute dtype).
    gradient: how the table's gradient is formed: "scatter" or "one-hot" (module docstring).

  Returns:
    `[*ids.shape, features]` in `dtype`. Its gradient with respect to `table` is `dy` summed
    into each id's row in float32 (or the table's dtype where wider), then cast to the table's
    dtype; out-of-range ids receive nothing.
  """
  check_gradient(gradient)
  return jnp.take(table.astype(dtype), ids, axis=0)


def _fwd(table, ids, dtype, gradient):
  # An empty [vocab, 0] array carries the table's row count and dtype to the backward pass.
  table_like = jnp.zeros((table.shape[0], 0), table.dtype)
  return embedding_lookup(table, ids, dtype, gradient), (table_like, ids)


def _bwd(dtype, gradient, residuals, dy):
  del dtype
  table_like, ids = residuals
  acc = _accumulation_dtype(table_like.dtype)
  rows = dy.reshape(-1, dy.shape[-1])
  flat_ids = ids.reshape(-1)
  if gradient == "one-hot":  # out-of-range ids give all-zero one-hot rows
    num = table_like.shape[0]
    hot = jax.nn.one_hot(jnp.where(flat_ids < 0, flat_ids + num, flat_ids), num, dtype=rows.dtype)
    # HIGHEST: a float32 cotangent is summed as float32, not rounded to TF32 on GPUs.
    dtable = jnp.einsum("tv,td->vd", hot, rows, precision=jax.lax.Precision.HIGHEST,
                        preferred_element_type=acc)
  else:
    dtable = jnp.zeros((table_like.shape[0], rows.shape[-1]), acc).at[flat_ids].add(
        rows.astype(acc), mode="drop")
  return dtable.astype(table_like.dtype), np.zeros(ids.shape, jax.dtypes.float0)


embedding_lookup.defvjp(_fwd, _bwd)
