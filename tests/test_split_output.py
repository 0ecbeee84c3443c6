"""`LayerNormDense(split_output=True)`: the packed projection's parts returned by the contraction
itself (`jaxquant.layers.split_output.SplitOutput`), their gradients quantized where they lie
inside its backward (joined first without a recipe). Values, gradients and delayed-scaling state
updates are the unsplit layer's sliced, bit for bit, with every recipe and without one; the
bias gradient of a quantized layer is float32 column sums (checked against float64 sums)."""

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


def _loss_weights():
  return jax.random.normal(jax.random.key(7), (3, 2, 16, HEADS, HEAD_DIM), jnp.float32)


def _loss(module, split: bool):
  """A loss whose cotangent differs in every part (random weights a part), of the variables
  and x; returns the loss and the updated non-parameter collections."""
  weights = _loss_weights()

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
  what = f"{recipe}, fuse_producers={fuse_producers}"
  if recipe == "none":  # the parts joined: the bias gradient too is the sliced layer's
    assert_same_leaves(grads[True], grads[False], what)
    return
  # The parts quantized where they lie: the bias gradient is the kernel's float32 column sums
  # (the sliced layer reduces in bfloat16); everything else bit for bit.
  dbias = {s: np.asarray(grads[s][2]["params"].pop("bias"), np.float64) for s in grads}
  assert_same_leaves(grads[True], grads[False], what)
  weights = np.asarray(_loss_weights().astype(jnp.bfloat16), np.float64)
  exact = weights.sum(axis=(1, 2))  # each part's cotangent is its weights in bfloat16
  # The bias is promoted to bfloat16 (the module's dtype): the float32 sums rounded once, to
  # within half a bfloat16 ulp of the exact sums; the sliced layer's bfloat16 reduction drifts.
  np.testing.assert_allclose(dbias[True], exact, rtol=2.0**-8 + 1e-6, atol=1e-30)
  np.testing.assert_allclose(dbias[False], exact, rtol=2e-2, atol=0.1)


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


def test_split_output_gradient_path_is_explained():
  """The parts quantize is named where it runs (the FFI, or the reference composition), and
  a format without fused kernels (NVFP4) joins the parts, saying why."""
  x = jax.random.normal(jax.random.key(1), (2, 16, WIDTH), jnp.float32).astype(jnp.bfloat16)
  for recipe, path in ((jq.recipes.DelayedScaling(), None),
                       (jq.recipes.NVFP4BlockScaling(), "joined")):
    module = jqf.LayerNormDense((3, HEADS, HEAD_DIM), dtype=jnp.bfloat16, split_output=True,
                                recipe=recipe)
    variables = module.init(jax.random.key(0), x)
    rngs = {"quantize": jax.random.key(3)}  # NVFP4's stochastic rounding
    loss = lambda v: sum(jnp.sum(p.astype(jnp.float32)) for p in module.apply(v, x, rngs=rngs,
                                                                             mutable=True)[0])
    report = jq.explain(jax.grad(loss), variables)
    parts = [d for d in report if "parts" in d.detail]
    assert len(parts) == 1, str(report)
    if path is None:
      assert "fused column parts+quantize" in parts[0].detail, str(report)
      assert parts[0].path != "joined"
    else:
      assert parts[0].path == "joined" and "NVFP4" in parts[0].reason, str(report)


def test_fuse_producers_off_joins_the_parts(monkeypatch):
  """`JAXQUANT_FUSE_PRODUCERS=off` (the A/B switch of every fused producer) joins the parts,
  and the layer is then the sliced layer bit for bit, bias gradient included."""
  monkeypatch.setenv("JAXQUANT_FUSE_PRODUCERS", "off")
  x = jax.random.normal(jax.random.key(1), (2, 16, WIDTH), jnp.float32).astype(jnp.bfloat16)
  grads = {}
  for split in (False, True):
    module = jqf.LayerNormDense((3, HEADS, HEAD_DIM), dtype=jnp.bfloat16, split_output=split,
                                recipe=jq.recipes.DelayedScaling())
    variables = module.init(jax.random.key(0), x)
    grads[split] = jax.grad(lambda v: _loss(module, split)(v, x)[0])(variables)
    if split:
      report = jq.explain(jax.grad(lambda v: _loss(module, split)(v, x)[0]), variables)
      assert any(d.path == "joined" and "JAXQUANT_FUSE_PRODUCERS=off" in d.reason
                 for d in report), str(report)
  assert_same_leaves(grads[True], grads[False], "JAXQUANT_FUSE_PRODUCERS=off")
