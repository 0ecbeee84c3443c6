"""`jaxquant.nnx.Embed`: `flax.nnx.Embed` whose table gradient is summed in float32."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
from flax import nnx

from jaxquant.layers.embedding import check_gradient, embedding_lookup

# nnx.Embed's own promotion (a cast), read from its signature: its module path moves between
# Flax versions.
_FLAX_PROMOTE = inspect.signature(nnx.Embed.__init__).parameters["promote_dtype"].default


class Embed(nnx.Embed):
  """`flax.nnx.Embed` with the table's gradient summed in float32 (design decision 61).

  The same constructor, `embedding` parameter, forward values and `attend` as `nnx.Embed`; its
  backward, a bfloat16 scatter-add under a bfloat16 `dtype`, becomes a float32 one
  (`gradient="scatter"`) or a one-hot GEMM with a float32 accumulator (`"one-hot"`), as
  `jaxquant.flax.Embed`. Not a quantized layer: `quantize_model` leaves `nnx.Embed` alone.

  Example::

    embed = jaxquant.nnx.Embed(vocab, d_model, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  """

  def __init__(self, num_embeddings: int, features: int, *, gradient: str = "scatter",
               **kwargs):
    super().__init__(num_embeddings, features, **kwargs)
    self.gradient = check_gradient(gradient)

  def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
    """`inputs` (integers, any shape) embedded along a new last axis of `features`."""
    if not jnp.issubdtype(inputs.dtype, jnp.integer):
      raise ValueError(f"Embed: inputs must be an integer array (token ids); got dtype "
                       f"{inputs.dtype}")
    if self.num_embeddings == 1:  # nnx.Embed broadcasts its single row
      return super().__call__(inputs, out_sharding=out_sharding)
    param = self.embedding[...]
    (promoted,) = self.promote_dtype((param,), dtype=self.dtype, inexact=False)
    # Flax's own promotion is a cast: look up in the parameter so that its gradient is the
    # float32 sum rounded once to the parameter's dtype (jaxquant.flax.Embed does the same).
    table = param if self.promote_dtype is _FLAX_PROMOTE else promoted
    take = lambda t, ids: embedding_lookup(t, ids, jnp.dtype(promoted.dtype), self.gradient)
    if out_sharding is not None:  # as nnx.Embed: jnp.take takes no out_sharding
      take = jax.sharding.auto_axes(out_sharding=out_sharding)(take)
    return take(table, inputs)
