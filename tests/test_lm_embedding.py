"""`examples/lm`'s token embedding: `nn.Embed`'s forward, parameters and `attend` bit for bit,
with the table gradient formed in float32 (a one-hot GEMM, or a float32 scatter-add) by
`jaxquant.layers.embedding` instead of nn.Embed's bfloat16 scatter-add."""

from __future__ import annotations


import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm.embedding import ONE_HOT_MAX_VOCAB, TokenEmbed  # examples/lm (pytest pythonpath)
from lm.model import LMConfig

VOCAB, FEATURES = 256, 48


def _pair(dtype, gradient="auto"):
  init = nn.initializers.normal(0.02)
  return (nn.Embed(VOCAB, FEATURES, dtype=dtype, embedding_init=init),
          TokenEmbed(VOCAB, FEATURES, dtype=dtype, gradient=gradient, embedding_init=init))


def _tokens(rng, shape=(8, 256)):
  # skewed ids (many repeats of a few rows, as byte text has) plus every id once
  ids = np.minimum(rng.geometric(0.05, size=shape) - 1, VOCAB - 1)
  ids.reshape(-1)[:VOCAB] = rng.permutation(VOCAB)
  return jnp.asarray(ids, jnp.int32)


def _loss_and_grad(module, variables, tokens, cotangent):
  loss = lambda v: jnp.sum(module.apply(v, tokens).astype(jnp.float32) * cotangent)
  return jax.jit(jax.value_and_grad(loss))(variables)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_forward_and_parameters_are_nn_embeds(dtype, rng):
  reference, ours = _pair(dtype)
  tokens = _tokens(rng)
  key = jax.random.key(int(rng.integers(1 << 30)))
  ref_vars, our_vars = reference.init(key, tokens), ours.init(key, tokens)
  assert jax.tree.structure(ref_vars) == jax.tree.structure(our_vars)
  np.testing.assert_array_equal(ref_vars["params"]["embedding"], our_vars["params"]["embedding"])
  got, want = ours.apply(our_vars, tokens), reference.apply(ref_vars, tokens)
  assert got.dtype == want.dtype == dtype
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  query = jnp.asarray(rng.standard_normal((5, FEATURES)), dtype)
  np.testing.assert_array_equal(
      np.asarray(ours.apply(our_vars, query, method="attend"), np.float32),
      np.asarray(reference.apply(ref_vars, query, method="attend"), np.float32))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_one_hot_gradient_is_the_float64_row_sums(dtype, rng):
  """Each table row's gradient is the sum of its tokens' cotangent rows (in `dtype`), summed in
  float32: within n * 2^-24 * sum|terms| of the float64 sum, n the row's token count."""
  _, ours = _pair(dtype, "one-hot")
  tokens = _tokens(rng)
  variables = ours.init(jax.random.key(1), tokens)
  cotangent = jnp.asarray(rng.standard_normal((*tokens.shape, FEATURES)), jnp.float32)
  _, grads = _loss_and_grad(ours, variables, tokens, cotangent)
  got = np.asarray(grads["params"]["embedding"], np.float64)
  terms = np.asarray(cotangent.astype(dtype), np.float64).reshape(-1, FEATURES)
  one_hot = np.eye(VOCAB)[np.asarray(tokens).reshape(-1)]
  want, magnitude = one_hot.T @ terms, one_hot.T @ np.abs(terms)
  counts = one_hot.sum(0)[:, None]
  assert np.all(np.abs(got - want) <= counts * 2.0**-24 * magnitude + 1e-30)
  assert counts.max() > 50  # the skewed draw really stacks many tokens on some rows


def test_scatter_gradient_is_nn_embeds_bit_for_bit(rng):
  reference, ours = _pair(jnp.bfloat16, "scatter")
  tokens = _tokens(rng)
  variables = reference.init(jax.random.key(2), tokens)
  cotangent = jnp.asarray(rng.standard_normal((*tokens.shape, FEATURES)), jnp.float32)
  want = _loss_and_grad(reference, variables, tokens, cotangent)
  got = _loss_and_grad(ours, variables, tokens, cotangent)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_float32_scatter_gradient_is_the_one_hot_gradient_within_float32_order(rng):
  """The two float32 forms of the gradient sum the same terms, in different orders: within
  2 n 2^-24 sum|terms| of each other, n the row's token count."""
  _, one_hot = _pair(jnp.bfloat16, "one-hot")
  _, scatter = _pair(jnp.bfloat16, "float32-scatter")
  tokens = _tokens(rng)
  variables = one_hot.init(jax.random.key(3), tokens)
  cotangent = jnp.asarray(rng.standard_normal((*tokens.shape, FEATURES)), jnp.float32)
  got = np.asarray(_loss_and_grad(scatter, variables, tokens, cotangent)[1]["params"]["embedding"],
                   np.float64)
  want = np.asarray(_loss_and_grad(one_hot, variables, tokens, cotangent)[1]["params"]["embedding"],
                    np.float64)
  terms = np.abs(np.asarray(cotangent.astype(jnp.bfloat16), np.float64)).reshape(-1, FEATURES)
  one = np.eye(VOCAB)[np.asarray(tokens).reshape(-1)]
  assert np.all(np.abs(got - want) <= 2 * one.sum(0)[:, None] * 2.0**-24 * (one.T @ terms))
  assert np.abs(want).max() > 0


def test_auto_takes_one_hot_for_small_vocabularies_only():
  assert TokenEmbed(ONE_HOT_MAX_VOCAB, 8).uses_one_hot
  assert not TokenEmbed(ONE_HOT_MAX_VOCAB + 1, 8).uses_one_hot
  assert not TokenEmbed(16, 8, gradient="scatter").uses_one_hot
  assert TokenEmbed(1 << 20, 8, gradient="one-hot").uses_one_hot


def test_bad_settings_are_refused(rng):
  tokens = _tokens(rng)
  with pytest.raises(ValueError, match="gradient='sparse'.*one-hot"):
    TokenEmbed(VOCAB, 8, gradient="sparse").init(jax.random.key(0), tokens)
  with pytest.raises(TypeError, match="integer ids.*float32"):
    TokenEmbed(VOCAB, 8).init(jax.random.key(0), tokens.astype(jnp.float32))
  with pytest.raises(ValueError, match="embedding_gradient='dense'"):
    LMConfig(embedding_gradient="dense")
