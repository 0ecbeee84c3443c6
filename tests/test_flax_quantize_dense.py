"""`jaxquant.flax.quantize_dense(recipe)`: the `nn.Dense` layers of an unmodified model are
quantized, keep their parameter tree, are named after themselves, and the model trains."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxquant as jq
import jaxquant.flax as jf


class _Recorder:

  def __init__(self):
    self.roles = []

  def __call__(self, role):
    self.roles.append(role)
    return jq.IdentityQuantizer()


class PlainMLP(nn.Module):
  """A model written with plain flax.linen layers only."""

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(32)(x))
    x = nn.LayerNorm()(x)
    x = nn.relu(nn.Dense(32, name="hidden")(x))
    return nn.Dense(4, name="head")(x)


class QuantizedMLP(nn.Module):
  """The same model written with jaxquant.flax.Dense."""

  recipe: jq.Recipe

  @nn.compact
  def __call__(self, x):
    x = nn.relu(jf.Dense(32, recipe=self.recipe)(x))
    x = nn.LayerNorm()(x)
    x = nn.relu(jf.Dense(32, name="hidden", recipe=self.recipe)(x))
    return jf.Dense(4, name="head", recipe=self.recipe)(x)


def _x(rng, shape=(16, 24)):
  return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def test_every_dense_is_swapped_and_named_after_itself(rng):
  x, recorder = _x(rng), _Recorder()
  model = PlainMLP()
  with jf.quantize_dense(jq.CustomRecipe(recorder)):
    variables = jax.eval_shape(model.init, jax.random.key(0), x)
    jax.eval_shape(jax.grad(lambda v: jnp.sum(model.apply(v, x))), variables)
  assert {(r.module_type, r.tensor_type, r.name) for r in recorder.roles} == {
      ("linear", t, n) for n in ("Dense_0", "hidden", "head")
      for t in ("input", "weight", "grad_output")}


def test_explain_reports_the_quantized_gemms_of_the_swapped_layers(rng):
  x, model = _x(rng), PlainMLP()
  variables = jax.jit(model.init)(jax.random.key(0), x)
  with jf.quantize_dense(jq.Float8CurrentScaling()):
    report = jq.explain(model.apply, variables, x)
  gemms = {str(d.role): d.detail for d in report if d.op == "gemm"}
  assert gemms == {f"linear/{n}/fprop": "Float8CurrentScaling x Float8CurrentScaling"
                   for n in ("Dense_0", "hidden", "head")}
  assert len(jq.explain(model.apply, variables, x)) == 0  # outside the block: plain Flax


def test_parameter_tree_and_initial_values_are_unchanged(rng):
  x, model = _x(rng), PlainMLP()
  plain = jax.jit(model.init)(jax.random.key(0), x)
  with jf.quantize_dense(jq.Float8CurrentScaling()):
    swapped = jax.jit(model.init)(jax.random.key(0), x)
  assert jax.tree_util.tree_structure(swapped) == jax.tree_util.tree_structure(plain)
  for a, b in zip(jax.tree_util.tree_leaves(swapped), jax.tree_util.tree_leaves(plain)):
    np.testing.assert_array_equal(a, b)


def test_swapped_model_computes_what_jaxquant_dense_computes(rng):
  x, recipe = _x(rng), jq.Float8CurrentScaling()
  model = PlainMLP()
  variables = jax.jit(model.init)(jax.random.key(0), x)

  def loss(module):
    return lambda v: jnp.sum(module.apply(v, x) ** 2)

  with jf.quantize_dense(recipe):
    y, grads = jax.jit(jax.value_and_grad(loss(model)))(variables)
  y_ref, grads_ref = jax.jit(jax.value_and_grad(loss(QuantizedMLP(recipe))))(variables)
  np.testing.assert_array_equal(y, y_ref)
  for a, b in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(grads_ref)):
    np.testing.assert_array_equal(a, b)
  y_plain = jax.jit(loss(model))(variables)
  assert y_plain != y  # and the plain model (outside the block) is not quantized


def test_swapped_model_trains(rng):
  x = _x(rng, (64, 24))
  target = jnp.tanh(x[:, :4] * 2 - x[:, 4:8])
  model, tx = PlainMLP(), optax.adam(3e-3)
  with jf.quantize_dense(jq.Float8CurrentScaling()):
    variables = jax.jit(model.init)(jax.random.key(0), x)
    opt_state = tx.init(variables["params"])

    @jax.jit
    def step(params, opt_state):
      loss, grads = jax.value_and_grad(
          lambda p: jnp.mean((model.apply({"params": p}, x) - target) ** 2))(params)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    params, losses = variables["params"], []
    for _ in range(8):
      params, opt_state, loss = step(params, opt_state)
      losses.append(float(loss))
  assert losses[-1] < 0.7 * losses[0] and all(np.isfinite(losses)), losses


def test_dense_with_a_custom_dot_general_is_left_alone(rng):
  x, recorder = _x(rng), _Recorder()

  class Model(nn.Module):

    @nn.compact
    def __call__(self, x):
      return nn.Dense(4, dot_general=jax.lax.dot_general, name="custom")(nn.Dense(8)(x))

  with jf.quantize_dense(jq.CustomRecipe(recorder)):
    jax.eval_shape(Model().init, jax.random.key(0), x)
  assert {r.name for r in recorder.roles} == {"Dense_0"}


def test_quantize_dense_rejects_a_non_recipe():
  with pytest.raises(TypeError, match=r"quantize_dense\(recipe\): expected a jaxquant Recipe"):
    with jf.quantize_dense("fp8"):
      pass
