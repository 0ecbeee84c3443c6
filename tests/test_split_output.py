"""`LayerNormDense(split_output=True)`: the packed projection's parts returned by the contraction
itself (`jaxquant.layers.split_output.SplitOutput`), their gradients joined inside its backward.
Values, gradients and delayed-scaling state updates are the unsplit layer's sliced, bit for bit,
with every recipe and without one."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
import jaxquant.flax as jqf
from jaxquant.layers.split_output import SplitOutput
from helpers import assert_same_leaves

HEADS, HEAD_DIM, WIDTH = 2, 128, 128
RECIPES = {"none": None, "current": jq.recipes.Float8CurrentScaling(),
           "delayed": jq.recipes.DelayedScaling(),
           "block": jq.recipes.Float8BlockScaling(), "mxfp8": jq.recipes.MXFP8BlockScaling()}


def _loss(module, split: bool):
  """A loss whose cotangent differs in every part (random weights a part), of the variables
  and x; returns the loss and the updated non-parameter collections."""
  weights = jax.random.normal(jax.random.key(7), (3, 2, 16, HEADS, HEAD_DIM), jnp.float32)

  def loss(variables, x):
    out, updated = module.apply(variables, x, mutable=[k for k in variables if k != "params"])
    parts = out if split else tuple(out[:, :, i] for i in range(3))
    total = sum(jnp.sum(p.astype(jnp.float32) * w) for p, w in zip(parts, weights))
    return total, updated
  return loss


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("fuse_producers", [None, True], ids=["unfused", "fused-norm"])
def test_split_output_matches_the_sliced_layer(recipe, fuse_producers):
  x = jax.random.normal(jax.random.key(1), (2, 16, WIDTH), jnp.float32).astype(jnp.bfloat16)
  grads = {}
  for split in (False, True):
    module = jqf.LayerNormDense((3, HEADS, HEAD_DIM), dtype=jnp.bfloat16, split_output=split,
                                recipe=RECIPES[recipe], fuse_producers=fuse_producers)
    variables = jax.jit(module.init)(jax.random.key(0), x)
    step = jax.jit(jax.value_and_grad(_loss(module, split), argnums=(0, 1), has_aux=True))
    (value, updated), (g_vars, g_x) = step(variables, x)
    out, _ = jax.jit(lambda v, x: module.apply(v, x, mutable=True))(variables, x)
    parts = out if split else tuple(out[:, :, i] for i in range(3))
    grads[split] = (value, updated, g_vars, g_x, parts)
  assert isinstance(grads[True][4], tuple) and len(grads[True][4]) == 3
  assert grads[True][4][0].shape == (2, 16, HEADS, HEAD_DIM)
  assert float(jnp.max(jnp.abs(grads[True][3].astype(jnp.float32)))) > 0  # x's gradient
  assert_same_leaves(grads[True], grads[False], f"{recipe}, fuse_producers={fuse_producers}")


def test_split_output_rejects_one_feature_axis():
  x = jnp.ones((2, 8, WIDTH), jnp.bfloat16)
  with pytest.raises(ValueError, match="split_output: features=.*one axis"):
    jqf.LayerNormDense(3 * WIDTH, split_output=True).init(jax.random.key(0), x)


def test_split_output_needs_several_output_axes():
  x = jax.random.normal(jax.random.key(0), (4, WIDTH), jnp.bfloat16)
  kernel = jax.random.normal(jax.random.key(1), (WIDTH, 3, 64), jnp.float32)
  with pytest.raises(ValueError, match=r"SplitOutput splits the first of several output axes"):
    jq.dense(x, kernel.reshape(WIDTH, 192), epilogue=SplitOutput())
  parts = jq.dense(x, kernel, epilogue=SplitOutput())
  assert len(parts) == 3
  np.testing.assert_array_equal(np.asarray(parts[2], np.float32),
                                np.asarray(jq.dense(x, kernel)[:, 2], np.float32))
