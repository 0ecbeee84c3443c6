"""`jaxquant.flax.Embed`: `nn.Embed`'s parameters, values and `attend` bit for bit, with the
table gradient summed in float32 (a float32 scatter-add, or a one-hot GEMM).

The gradient is checked against float64 sums (`np.add.at`) of the same bfloat16 `dy`: each
element within (count + 1) * 2^-24 * sum|dy| of its row (float32 summation of `count` terms,
then the one rounding to the float32 parameter), or within one bfloat16 rounding of the float64
sum for a bfloat16 parameter. `nn.Embed`'s own gradient, summed in bfloat16, misses that bound
on the same inputs, which shows the check can fail. Ids are fresh random draws, skewed so that
rows repeat (as tokens do), with negative ids (counted from the end, as `jnp.take`) among them.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant.flax as jqf
from jaxquant.layers.embedding import embedding_lookup

VOCAB, FEATURES = 97, 48


def _ids(rng, shape=(4, 64)):
  ids = np.minimum(rng.geometric(0.08, shape) - 1, VOCAB - 1)  # skewed: low ids repeat
  flip = rng.random(shape) < 0.1
  return jnp.asarray(np.where(flip, ids - VOCAB, ids), jnp.int32)


def _dy(rng, ids, features=FEATURES):
  return jnp.asarray(rng.standard_normal(ids.shape + (features,)), jnp.bfloat16)


def _table_grad(module, variables, ids, dy):
  def loss(params):
    y = module.apply({"params": params}, ids)
    return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))
  return jax.jit(jax.grad(loss))(variables["params"])["embedding"]


def _sum64(ids, dy, vocab=VOCAB):
  rows = np.asarray(ids).reshape(-1) % vocab
  values = np.asarray(dy.astype(jnp.float32), np.float64).reshape(len(rows), -1)
  total, magnitude = np.zeros((vocab, values.shape[1])), np.zeros((vocab, values.shape[1]))
  np.add.at(total, rows, values)
  np.add.at(magnitude, rows, np.abs(values))
  return total, magnitude, np.bincount(rows, minlength=vocab)[:, None]


@pytest.mark.parametrize("dtype", [None, jnp.bfloat16, jnp.float32], ids=str)
def test_parameters_values_and_attend_are_nn_embed_s(rng, dtype):
  ids = _ids(rng)
  ours, theirs = jqf.Embed(VOCAB, FEATURES, dtype=dtype), nn.Embed(VOCAB, FEATURES, dtype=dtype)
  variables = ours.init(jax.random.key(int(rng.integers(1 << 30))), ids)
  want = theirs.init(jax.random.key(0), ids)
  assert jax.tree_util.tree_structure(variables) == jax.tree_util.tree_structure(want)
  assert variables["params"]["embedding"].shape == (VOCAB, FEATURES)
  y, y0 = ours.apply(variables, ids), theirs.apply(variables, ids)
  assert y.dtype == y0.dtype
  np.testing.assert_array_equal(np.asarray(y), np.asarray(y0))
  query = jnp.asarray(rng.standard_normal((5, FEATURES)), jnp.float32)
  np.testing.assert_array_equal(np.asarray(ours.apply(variables, query, method="attend")),
                                np.asarray(theirs.apply(variables, query, method="attend")))


@pytest.mark.parametrize("gradient", ["scatter", "one-hot"])
def test_gradient_is_the_float32_sum(rng, gradient):
  ids = _ids(rng)
  dy = _dy(rng, ids)
  module = jqf.Embed(VOCAB, FEATURES, dtype=jnp.bfloat16, gradient=gradient)
  variables = module.init(jax.random.key(0), ids)
  got = np.asarray(_table_grad(module, variables, ids, dy), np.float64)
  total, magnitude, count = _sum64(ids, dy)
  bound = (count + 1) * 2.0**-24 * magnitude
  assert np.all(np.abs(got - total) <= bound)
  assert np.abs(total).max() > 0 and count.max() > 8  # rows do repeat
  # nn.Embed's gradient (a bfloat16 scatter-add) misses the bound on the same inputs.
  flax_grad = np.asarray(_table_grad(nn.Embed(VOCAB, FEATURES, dtype=jnp.bfloat16), variables,
                                     ids, dy), np.float64)
  assert np.any(np.abs(flax_grad - total) > bound)


def test_bfloat16_table_gradient_is_rounded_once(rng):
  ids = _ids(rng)
  dy = _dy(rng, ids)
  module = jqf.Embed(VOCAB, FEATURES, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  variables = module.init(jax.random.key(0), ids)
  got = _table_grad(module, variables, ids, dy)
  assert got.dtype == jnp.bfloat16
  total, magnitude, count = _sum64(ids, dy)
  ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(total), 2.0**-126))) - 7)
  err = np.abs(np.asarray(got.astype(jnp.float32), np.float64) - total)
  assert np.all(err <= ulp / 2 + (count + 1) * 2.0**-24 * magnitude)


@pytest.mark.parametrize("gradient", ["scatter", "one-hot"])
def test_out_of_range_ids_give_nan_rows_and_no_gradient(rng, gradient):
  ids = _ids(rng, (2, 16)).at[0, 3].set(VOCAB + 5)
  dy = _dy(rng, ids)
  module = jqf.Embed(VOCAB, FEATURES, dtype=jnp.bfloat16, gradient=gradient)
  variables = module.init(jax.random.key(0), ids)
  y = module.apply(variables, ids)
  assert np.isnan(np.asarray(y[0, 3], np.float32)).all()
  assert not np.isnan(np.asarray(y.at[0, 3].set(0), np.float32)).any()
  got = np.asarray(_table_grad(module, variables, ids, dy), np.float64)
  keep = np.ones(ids.shape, bool)
  keep[0, 3] = False
  total, magnitude, count = _sum64(np.asarray(ids)[keep], np.asarray(dy)[keep])
  assert np.all(np.abs(got - total) <= (count + 1) * 2.0**-24 * magnitude)


def test_one_row_table_broadcasts_like_nn_embed(rng):
  ids = jnp.zeros((3, 5), jnp.int32)
  module = jqf.Embed(1, FEATURES)
  variables = module.init(jax.random.key(int(rng.integers(1 << 30))), ids)
  np.testing.assert_array_equal(np.asarray(module.apply(variables, ids)),
                                np.asarray(nn.Embed(1, FEATURES).apply(variables, ids)))


def test_bad_inputs_and_settings_are_rejected():
  module = jqf.Embed(VOCAB, FEATURES)
  with pytest.raises(ValueError, match="integer array.*float32"):
    module.init(jax.random.key(0), jnp.zeros((2, 3), jnp.float32))
  with pytest.raises(ValueError, match="gradient='dense'.*'scatter', 'one-hot'"):
    jqf.Embed(VOCAB, FEATURES, gradient="dense").init(jax.random.key(0),
                                                     jnp.zeros((2, 3), jnp.int32))


def test_a_custom_promotion_is_kept(rng):
  """A module's own `promote_dtype` still promotes the table; the gradient then reaches the
  parameter through it (here a cast to float16), summed in float32 and rounded once."""
  def to_half(*arrays, dtype=None, inexact=True):
    del dtype, inexact
    return tuple(a.astype(jnp.float16) for a in arrays)
  ids = _ids(rng)
  dy = jnp.asarray(rng.standard_normal(ids.shape + (FEATURES,)) * 0.1, jnp.float16)
  module = jqf.Embed(VOCAB, FEATURES, promote_dtype=to_half)
  variables = module.init(jax.random.key(0), ids)
  assert module.apply(variables, ids).dtype == jnp.float16
  got = np.asarray(_table_grad(module, variables, ids, dy), np.float64)
  total, magnitude, count = _sum64(ids, dy)
  ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(total), 2.0**-14))) - 10)
  assert np.all(np.abs(got - total) <= ulp / 2 + (count + 1) * 2.0**-24 * magnitude)


def test_lookup_is_differentiable_in_the_table_only(rng):
  ids = _ids(rng, (8,))
  table = jnp.asarray(rng.standard_normal((VOCAB, 4)), jnp.float32)
  dtable, dids = jax.grad(lambda t, i: embedding_lookup(t, i, jnp.bfloat16).astype(
      jnp.float32).sum(), argnums=(0, 1), allow_int=True)(table, ids)
  assert dtable.dtype == jnp.float32 and dids.dtype == jax.dtypes.float0
  np.testing.assert_array_equal(np.asarray(dtable.sum(1)),
                                4.0 * np.bincount(np.asarray(ids) % VOCAB, minlength=VOCAB))


# ------------------------------------------- NNX ----------------------------------------------

@pytest.mark.parametrize("gradient", ["scatter", "one-hot"])
def test_nnx_embed_is_nnx_embed_forward_with_the_float32_gradient(rng, gradient):
  from flax import nnx  # noqa: PLC0415
  import jaxquant.nnx as jqn  # noqa: PLC0415
  ids = _ids(rng)
  dy = _dy(rng, ids)
  seed = int(rng.integers(1 << 30))
  ours = jqn.Embed(VOCAB, FEATURES, dtype=jnp.bfloat16, gradient=gradient, rngs=nnx.Rngs(seed))
  theirs = nnx.Embed(VOCAB, FEATURES, dtype=jnp.bfloat16, rngs=nnx.Rngs(seed))
  np.testing.assert_array_equal(np.asarray(ours.embedding[...]),
                                np.asarray(theirs.embedding[...]))
  np.testing.assert_array_equal(np.asarray(ours(ids)), np.asarray(theirs(ids)))

  def grad_of(module):
    loss = lambda m: jnp.sum(m(ids).astype(jnp.float32) * dy.astype(jnp.float32))
    return np.asarray(nnx.grad(loss)(module).embedding[...], np.float64)

  total, magnitude, count = _sum64(ids, dy)
  bound = (count + 1) * 2.0**-24 * magnitude
  assert np.all(np.abs(grad_of(ours) - total) <= bound)
  assert np.any(np.abs(grad_of(theirs) - total) > bound)  # nnx.Embed's bfloat16 sums
  with pytest.raises(ValueError, match="gradient='sparse'"):
    jqn.Embed(VOCAB, FEATURES, gradient="sparse", rngs=nnx.Rngs(0))


def test_the_lookup_checks_its_gradient_setting_without_differentiation(rng):
  with pytest.raises(ValueError, match="gradient='dense'"):
    embedding_lookup(jnp.zeros((4, 2)), _ids(rng, (3,)) % 4, jnp.float32, "dense")
