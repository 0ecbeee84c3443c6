"""`jaxquant.nnx.Linear`: `flax.nnx.Linear`'s parameters and init, linen `Dense`'s quantized
numbers, delayed-scaling state through the gradient, and stochastic rounding from the
`"quantize"` stream."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxquant as jq
import jaxquant.flax as jf
import jaxquant.nnx as jnnx


def _x(rng, shape=(16, 32)):
  return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def _assert_bitwise_equal(a, b):
  a, b = np.atleast_1d(np.asarray(a)), np.atleast_1d(np.asarray(b))
  assert a.dtype == b.dtype
  np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def test_same_rngs_give_flax_nnx_linear_parameters():
  # two layers from one Rngs: the second's keys depend on what the first drew
  rngs_ref, rngs_ours = nnx.Rngs(params=3, quantize=4), nnx.Rngs(params=3, quantize=4)
  ref = [nnx.Linear(32, 16, rngs=rngs_ref), nnx.Linear(16, 8, rngs=rngs_ref)]
  ours = [jnnx.Linear(32, 16, rngs=rngs_ours), jnnx.Linear(16, 8, rngs=rngs_ours)]
  for a, b in zip(ref, ours):
    assert set(nnx.state(b, nnx.Param)) == {"kernel", "bias"}
    _assert_bitwise_equal(a.kernel[...], b.kernel[...])
    _assert_bitwise_equal(a.bias[...], b.bias[...])


@pytest.mark.parametrize("recipe", [None, jq.CustomRecipe(lambda role: jq.IdentityQuantizer())],
                         ids=["no_recipe", "identity_recipe"])
def test_without_quantization_equals_flax_nnx_linear(rng, recipe):
  x, c = _x(rng), _x(rng, (16, 8))
  ref = nnx.Linear(32, 8, rngs=nnx.Rngs(0))
  ours = jnnx.Linear(32, 8, recipe=recipe, rngs=nnx.Rngs(0))

  @nnx.jit
  def value_and_grads(model, x):
    return nnx.value_and_grad(lambda m, x: jnp.sum(m(x) * c), argnums=(0, 1))(model, x)

  (loss_ref, (g_ref, gx_ref)), (loss, (g, gx)) = value_and_grads(ref, x), value_and_grads(ours, x)
  _assert_bitwise_equal(loss, loss_ref)
  _assert_bitwise_equal(gx, gx_ref)
  _assert_bitwise_equal(g["kernel"][...], g_ref["kernel"][...])
  _assert_bitwise_equal(g["bias"][...], g_ref["bias"][...])


def test_fp8_linear_matches_linen_dense_with_the_same_params(rng):
  x, c = _x(rng), _x(rng, (16, 8))
  recipe = jq.Float8CurrentScaling()
  ours = jnnx.Linear(32, 8, recipe=recipe, name="Dense", rngs=nnx.Rngs(0))
  params = {"params": {"kernel": ours.kernel[...], "bias": ours.bias[...]}}
  linen = jf.Dense(8, recipe=recipe)

  loss_nnx, (g_nnx, gx_nnx) = nnx.jit(
      nnx.value_and_grad(lambda m, x: jnp.sum(m(x) * c), argnums=(0, 1)))(ours, x)
  loss_linen, (g_linen, gx_linen) = jax.jit(jax.value_and_grad(
      lambda v, x: jnp.sum(linen.apply(v, x) * c), argnums=(0, 1)))(params, x)
  _assert_bitwise_equal(loss_nnx, loss_linen)
  _assert_bitwise_equal(gx_nnx, gx_linen)
  _assert_bitwise_equal(g_nnx["kernel"][...], g_linen["params"]["kernel"])
  _assert_bitwise_equal(g_nnx["bias"][...], g_linen["params"]["bias"])
  y_plain = jax.jit(jf.Dense(8).apply)(params, x)
  assert not np.array_equal(np.asarray(jnp.sum(y_plain * c)), np.asarray(loss_nnx))


def test_roles_use_the_name_argument(rng):
  seen = []

  def factory(role):
    seen.append(role)
    return jq.IdentityQuantizer()

  layer = jnnx.Linear(32, 8, recipe=jq.CustomRecipe(factory), name="fc1", rngs=nnx.Rngs(0))
  nnx.grad(lambda m, x: jnp.sum(m(x)))(layer, _x(rng))
  assert {(r.module_type, r.tensor_type, r.name) for r in seen} == {
      ("linear", t, "fc1") for t in ("input", "weight", "grad_output")}


def test_autocast_reaches_a_linear_without_recipe_and_the_attribute_wins(rng):
  seen_outer, seen_attr = [], []
  outer = jq.CustomRecipe(lambda r: seen_outer.append(r) or jq.IdentityQuantizer())
  attribute = jq.CustomRecipe(lambda r: seen_attr.append(r) or jq.IdentityQuantizer())
  x = _x(rng)
  with jq.autocast(outer):
    jnnx.Linear(32, 8, rngs=nnx.Rngs(0))(x)
    assert {r.tensor_type for r in seen_outer} == {"input", "weight", "grad_output"}
    asked_outer = len(seen_outer)
    jnnx.Linear(32, 8, recipe=attribute, rngs=nnx.Rngs(0))(x)
  assert len(seen_outer) == asked_outer
  assert {r.tensor_type for r in seen_attr} == {"input", "weight", "grad_output"}


def test_delayed_scaling_state_advances_through_the_gradient(rng):
  history, steps = 3, 4
  model = jnnx.Linear(32, 8, recipe=jq.DelayedScaling(amax_history_len=history),
                      rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, x, c):
    grads = nnx.grad(lambda m: jnp.sum(m(x) * c), argnums=jnnx.diff_state(0))(model)
    jnnx.apply_gradients(optimizer, model, grads)

  kernel0 = np.asarray(model.kernel[...])
  amaxes = {"input": [], "weight": [], "grad_output": []}
  for s in rng.uniform(0.5, 4.0, steps):
    x, c = _x(rng) * s, _x(rng, (16, 8)) * s  # loss sum(y * c): dy = c
    amaxes["input"].append(np.abs(np.asarray(x)).max())
    amaxes["weight"].append(np.abs(np.asarray(model.kernel[...])).max())
    amaxes["grad_output"].append(np.abs(np.asarray(c)).max())
    step(model, optimizer, x, c)

  fmax = {"input": 448.0, "weight": 448.0, "grad_output": 57344.0}
  for tensor, values in amaxes.items():  # docs/design.md §5 "Numerics", by hand
    hist, scale = np.zeros(history, np.float32), np.float32(1.0)
    for amax in values:
      hist[0] = amax
      scale = np.float32(np.float32(fmax[tensor]) / hist.max())
      hist = np.roll(hist, -1)
      hist[0] = 0.0
    np.testing.assert_array_equal(getattr(model, f"{tensor}_amax_history")[...], hist)
    np.testing.assert_array_equal(getattr(model, f"{tensor}_scale")[...], scale)
  assert not np.array_equal(np.asarray(model.kernel[...]), kernel0)  # the optimizer stepped


def test_delayed_scaling_needs_the_recipe_at_construction(rng):
  model = jnnx.Linear(32, 8, rngs=nnx.Rngs(0))
  with jq.autocast(jq.DelayedScaling()), pytest.raises(ValueError, match="not created at "
                                                       "construction"):
    model(_x(rng))


def _nvfp4_kernel_grad(model, x):
  c = jnp.cos(jnp.arange(x.shape[0] * model.out_features, dtype=jnp.float32) * 0.37)
  c = c.reshape(x.shape[0], model.out_features)  # dy = c: not exactly representable in E2M1
  return nnx.grad(lambda m: jnp.sum(m(x) * c))(model)["kernel"][...]


def test_stochastic_rounding_draws_from_the_quantize_stream(rng):
  x = _x(rng)  # NVFP4BlockScaling rounds grad_output stochastically
  recipe = jq.NVFP4BlockScaling()

  def model(seed):
    return jnnx.Linear(32, 16, recipe=recipe, rngs=nnx.Rngs(params=0, quantize=seed))

  same = [_nvfp4_kernel_grad(model(1), x) for _ in range(2)]
  _assert_bitwise_equal(same[0], same[1])  # reproducible from the stream's seed
  other = _nvfp4_kernel_grad(model(2), x)
  assert not np.array_equal(np.asarray(same[0]), np.asarray(other))
  layer = model(1)
  first, second = _nvfp4_kernel_grad(layer, x), _nvfp4_kernel_grad(layer, x)
  _assert_bitwise_equal(first, same[0])
  assert not np.array_equal(np.asarray(first), np.asarray(second))  # the stream advances


def test_stochastic_rounding_without_a_quantize_stream_is_a_clear_error(rng):
  layer = jnnx.Linear(32, 16, recipe=jq.NVFP4BlockScaling(), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="needs the nnx.Rngs stream 'quantize'"):
    _nvfp4_kernel_grad(layer, _x(rng))
  # a stream given to the call works
  grad = nnx.grad(lambda m: jnp.sum(m(_x(rng), rngs=nnx.Rngs(quantize=5))))(layer)
  assert np.all(np.isfinite(np.asarray(grad["kernel"][...])))


def test_recipe_of_the_wrong_type_is_a_type_error():
  with pytest.raises(TypeError, match=r"Linear\(recipe\): expected a jaxquant Recipe"):
    jnnx.Linear(4, 4, recipe="fp8", rngs=nnx.Rngs(0))
