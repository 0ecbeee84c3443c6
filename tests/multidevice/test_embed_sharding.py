"""`jaxquant.flax.Embed` under a mesh: the table sharded over its vocabulary or its features and
the ids over the batch give one device's lookup bit for bit, and its gradient within float32
summation order (the shards' partial sums meet in a different order), sharded as `nn.Embed`'s
gradient is in the same program."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxquant.flax as jf
import sharded

VOCAB, FEATURES = 64, 32


@jax.jit
def _grad_and_values(table, ids, dy):
  """(d table, lookup) of `jaxquant.flax.Embed`, then of `nn.Embed`, for the cotangent dy."""
  out = []
  for module in (jf.Embed(VOCAB, FEATURES, dtype=jnp.bfloat16),
                 nn.Embed(VOCAB, FEATURES, dtype=jnp.bfloat16)):
    def loss(t):
      y = module.apply({"params": {"embedding": t}}, ids).astype(jnp.float32)
      return jnp.sum(y * dy.astype(jnp.float32)), y
    out.append(jax.grad(loss, has_aux=True)(table))
  return out


@pytest.mark.parametrize("table_spec", [P("tp", None), P(None, "tp")], ids=["vocab", "features"])
def test_sharded_embed_matches_one_device(devices, rng, table_spec):
  mesh = sharded.make_mesh(devices, "tp")
  ids = jnp.asarray(np.minimum(rng.geometric(0.1, (8, 32)) - 1, VOCAB - 1), jnp.int32)
  dy = jnp.asarray(rng.standard_normal((8, 32, FEATURES)), jnp.bfloat16)
  table = jnp.asarray(rng.standard_normal((VOCAB, FEATURES)), jnp.float32)
  (want_grad, want_y), _ = _grad_and_values(table, ids, dy)
  (got_grad, got_y), (flax_grad, _) = _grad_and_values(
      jax.device_put(table, NamedSharding(mesh, table_spec)),
      jax.device_put(ids, NamedSharding(mesh, P(("dp", "fsdp"), None))), dy)

  np.testing.assert_array_equal(np.asarray(got_y), np.asarray(want_y))
  rows = np.asarray(ids).reshape(-1)
  magnitude = np.zeros((VOCAB, FEATURES))
  np.add.at(magnitude, rows, np.abs(np.asarray(dy, np.float64)).reshape(len(rows), -1))
  count = np.bincount(rows, minlength=VOCAB)[:, None]
  err = np.abs(np.asarray(got_grad, np.float64) - np.asarray(want_grad, np.float64))
  assert np.all(err <= 2 * (count + 1) * 2.0**-24 * magnitude)
  assert np.abs(np.asarray(want_grad)).max() > 0
  assert got_grad.sharding.is_equivalent_to(flax_grad.sharding, 2), (got_grad.sharding,
                                                                      flax_grad.sharding)
