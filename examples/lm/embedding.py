"""Token embedding whose gradient is a one-hot GEMM instead of a scatter-add.

`nn.Embed`'s gradient is XLA's scatter-add of every token's cotangent row into a bfloat16 copy
of the table. With a small vocabulary (the 256 byte tokens here) thousands of tokens share a
row, and on a GPU the atomic adds into one row serialize: on an H100 that scatter took 12 ms of
a 102 ms MoE step and only fell to 7.8 ms at ep=4 with a quarter of the tokens per GPU
(bench/RESULTS.md), so it was one of the step's largest kernels and it barely scaled. The same
gradient written as `one_hot(tokens)^T @ dy` is a small GEMM (2 x tokens x vocab x features
FLOPs), accumulated in float32 rather than bfloat16, deterministic, and it shards like any
contraction over the batch. The forward pass is `nn.Embed`'s bit for bit, and so are the
parameter tree and `attend` (tied output projection).
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

EMBEDDING_GRADIENTS = ("auto", "one-hot", "scatter")
ONE_HOT_MAX_VOCAB = 4096  # "auto": one-hot up to here (the one-hot operand is tokens x vocab)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def take_with_one_hot_gradient(table: jax.Array, tokens: jax.Array, dtype: Any) -> jax.Array:
  """`jnp.take(table.astype(dtype), tokens, axis=0)` (nn.Embed's forward), differentiated as
  `one_hot(tokens)^T @ dy` with float32 accumulation."""
  return jnp.take(table.astype(dtype), tokens, axis=0)


def _take_fwd(table, tokens, dtype):
  # An empty [vocab, 0] array carries the table's row count and dtype to the backward pass.
  table_like = jnp.zeros((table.shape[0], 0), table.dtype)
  return take_with_one_hot_gradient(table, tokens, dtype), (tokens, table_like)


def _take_bwd(dtype, residuals, rows_grad):
  tokens, table_like = residuals
  one_hot = jax.nn.one_hot(tokens, table_like.shape[0], dtype=rows_grad.dtype)
  # HIGHEST: a float32 cotangent is summed as float32, not rounded to TF32 on GPUs.
  table_grad = jnp.einsum("...v,...d->vd", one_hot, rows_grad, precision=jax.lax.Precision.HIGHEST,
                          preferred_element_type=jnp.float32)
  return table_grad.astype(table_like.dtype), None


take_with_one_hot_gradient.defvjp(_take_fwd, _take_bwd)


class TokenEmbed(nn.Module):
  """`nn.Embed` (same parameter `embedding[vocab, features]`, forward and `attend`) whose table
  gradient is a one-hot GEMM for small vocabularies.

  Attributes:
    vocab: number of token ids.
    features: embedding width.
    dtype: dtype of the looked-up rows (the table is cast to it first, as `nn.Embed` does).
    gradient: "one-hot", "scatter" (`nn.Embed`'s scatter-add), or "auto": one-hot for
      vocabularies up to `ONE_HOT_MAX_VOCAB`, scatter above.
  """

  vocab: int
  features: int
  dtype: Any = jnp.float32
  gradient: str = "auto"
  embedding_init: Any = nn.initializers.normal(0.02)

  def setup(self):
    if self.gradient not in EMBEDDING_GRADIENTS:
      raise ValueError(f"gradient={self.gradient!r}; expected one of {EMBEDDING_GRADIENTS}")
    self.embedding = self.param("embedding", self.embedding_init, (self.vocab, self.features),
                                jnp.float32)

  @property
  def uses_one_hot(self) -> bool:
    return self.gradient == "one-hot" or (self.gradient == "auto"
                                          and self.vocab <= ONE_HOT_MAX_VOCAB)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise TypeError(f"tokens must be integer ids; got dtype {tokens.dtype}")
    if self.uses_one_hot:
      return take_with_one_hot_gradient(self.embedding, tokens, jnp.dtype(self.dtype))
    return jnp.take(self.embedding.astype(self.dtype), tokens, axis=0)

  def attend(self, query: jax.Array) -> jax.Array:
    """`query @ embedding.T` in `dtype`: the tied output projection, as `nn.Embed.attend`."""
    query, embedding = nn.dtypes.promote_dtype(query, self.embedding, dtype=self.dtype)
    return jnp.dot(query, embedding.T)
