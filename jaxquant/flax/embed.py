"""`jaxquant.flax.Embed`: `flax.linen.Embed` whose table gradient is summed in float32."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxquant.layers.embedding import check_gradient, embedding_lookup


class Embed(nn.Embed):
  """`flax.linen.Embed` with the table's gradient summed in float32.

  The same attributes, parameter tree (`embedding [num_embeddings, features]`), forward values
  and `attend` as `flax.linen.Embed`, so checkpoints and code move between the two. Only the
  backward differs: `nn.Embed`'s gradient is a scatter-add in the compute dtype (bfloat16
  compare-and-swap loops on a GPU, slow and lossy where tokens repeat); this one sums in
  float32 (`jaxquant.layers.embedding`). Not a quantized layer: it takes no recipe.

  Example::

    x = jaxquant.flax.Embed(vocab, d_model, dtype=jnp.bfloat16, name="embed")(tokens)

  Attributes (besides `nn.Embed`'s):
    gradient: "scatter" (a float32 scatter-add, the default) or "one-hot" (a GEMM with a float32
      accumulator: deterministic, for small vocabularies).
  """

  gradient: str = "scatter"

  def __call__(self, inputs: jax.Array) -> jax.Array:
    """`inputs` (integers, any shape) embedded along a new last axis of `features`."""
    if not jnp.issubdtype(inputs.dtype, jnp.integer):
      raise ValueError(f"Embed: inputs must be an integer array (token ids); got dtype "
                       f"{inputs.dtype}")
    check_gradient(self.gradient)
    if self.num_embeddings == 1:  # nn.Embed broadcasts its single row
      return super().__call__(inputs)
    (promoted,) = self.promote_dtype(self.embedding, dtype=self.dtype, inexact=False)
    # Flax's own promotion is a cast: look up in the parameter itself so that its gradient is
    # the float32 sum, rounded once to the parameter's dtype. A custom promotion is kept, and
    # the sum is rounded once to its dtype.
    table = self.embedding if self.promote_dtype is nn.Embed.promote_dtype else promoted
    return embedding_lookup(table, inputs, jnp.dtype(promoted.dtype), self.gradient)
