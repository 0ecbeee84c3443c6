"""Token embedding whose gradient is a one-hot GEMM or a float32 scatter, not `nn.Embed`'s.

`nn.Embed`'s gradient is XLA's scatter-add of every token's cotangent row into a bfloat16 copy
of the table. With a small vocabulary (the 256 byte tokens here) thousands of tokens share a
row, and on a GPU the atomic adds into one row serialize: on an H100 that scatter took 12 ms of
a 102 ms MoE step and only fell to 7.8 ms at ep=4 with a quarter of the tokens per GPU
(bench/RESULTS.md), so it was one of the step's largest kernels and it barely scaled. The
library's lookup (`jaxquant.layers.embedding`) forms the gradient in float32 instead: as
`one_hot(tokens)^T @ dy`, a small GEMM (2 x tokens x vocab x features FLOPs), deterministic,
that shards like any contraction over the batch; or, for large vocabularies, as a float32
scatter-add. The forward pass is `nn.Embed`'s bit for bit, and so are the parameter tree and
`attend` (tied output projection).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxquant.layers.embedding import embedding_lookup

# "scatter": nn.Embed's own bfloat16 scatter-add, kept for comparison runs.
EMBEDDING_GRADIENTS = ("auto", "one-hot", "float32-scatter", "scatter")
ONE_HOT_MAX_VOCAB = 4096  # "auto": one-hot up to here (the one-hot operand is tokens x vocab)


class TokenEmbed(nn.Module):
  """`nn.Embed` (same parameter `embedding[vocab, features]`, forward and `attend`) whose table
  gradient is formed in float32 by `jaxquant.layers.embedding`.

  Attributes:
    vocab: number of token ids.
    features: embedding width.
    dtype: dtype of the looked-up rows (the table is cast to it first, as `nn.Embed` does).
    gradient: "one-hot", "float32-scatter", "scatter" (`nn.Embed`'s bfloat16 scatter-add, for
      comparison runs), or "auto": one-hot for vocabularies up to `ONE_HOT_MAX_VOCAB`, the
      float32 scatter above.
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
    if self.gradient == "scatter":
      return jnp.take(self.embedding.astype(self.dtype), tokens, axis=0)
    return embedding_lookup(self.embedding, tokens, jnp.dtype(self.dtype),
                            "one-hot" if self.uses_one_hot else "scatter")

  def attend(self, query: jax.Array) -> jax.Array:
    """`query @ embedding.T` in `dtype`: the tied output projection, as `nn.Embed.attend`."""
    query, embedding = nn.dtypes.promote_dtype(query, self.embedding, dtype=self.dtype)
    return jnp.dot(query, embedding.T)
