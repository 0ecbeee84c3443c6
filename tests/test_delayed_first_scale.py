"""Delayed scaling's first step: a state with no scale yet (`first_scale="current"`, the
default) quantizes with the scale of the tensor's own amax, so step 1 equals current scaling bit
for bit (quantize, `jaxquant.dense`, the Flax modules, `quantize_dense`, grouped experts);
`first_scale="one"` keeps TransformerEngine's scale-1 start. After step 1 the history and scale
follow docs/design.md §5 "Numerics" unchanged."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
import jaxquant.flax as jf
import jaxquant.grouped as jg
import oracle
from helpers import assert_same_leaves, data_codes, quantize

pytestmark = pytest.mark.usefixtures("core_backend")

DELAYED = jq.Float8DelayedScalingQuantizer
CURRENT = jq.Float8CurrentScalingQuantizer
M, K, N = 32, 48, 24


def _x(rng, shape=(M, K)):
  return jnp.asarray(rng.standard_normal(shape) * rng.uniform(0.01, 300.0), jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_first_quantization_equals_current_scaling(rng, dtype):
  x = _x(rng)
  q = DELAYED(dtype, amax_history_len=4)
  got = quantize(x, q, state=jq.init_state(q))
  want = quantize(x, CURRENT(dtype))
  for direction in ("rowwise", "columnwise"):
    g, w = getattr(got, direction), getattr(want, direction)
    assert_same_leaves((g.data, g.scale_inv, g.amax), (w.data, w.scale_inv, w.amax), direction)


def test_first_scale_one_quantizes_with_scale_one(rng):
  x = _x(rng)
  q = DELAYED(amax_history_len=4, first_scale="one")
  t = quantize(x, q, columnwise=False, state=jq.init_state(q)).rowwise
  assert float(t.scale_inv) == 1.0
  np.testing.assert_array_equal(data_codes(t), oracle.cast_codes(oracle.f32(x), oracle.E4M3))


def test_margin_divides_the_first_scale_too(rng):
  x = _x(rng)
  q = DELAYED(amax_history_len=4, margin=3)
  t = quantize(x, q, columnwise=False, state=jq.init_state(q)).rowwise
  scale = np.float32(np.float32(448.0) / np.float32(jnp.max(jnp.abs(x)))) / np.float32(8.0)
  assert float(t.scale_inv) == float(np.float32(1.0) / scale)


@pytest.mark.parametrize("history", [1, 3])
def test_only_the_first_step_is_just_in_time(rng, history):
  """After one usable amax the stored scale is used, also for a history of length 1 (which is
  empty again after every update, so emptiness cannot mark a fresh state)."""
  q = DELAYED(amax_history_len=history)

  @jax.jit
  def step(state, x):
    qt = jq.ops.quantize(x, q, columnwise=False, state=state)
    return jq.update_state(q, state, qt), qt.rowwise

  x1, x2 = _x(rng), _x(rng) * 7.0
  state, t1 = step(jq.init_state(q), x1)
  a1 = np.float32(jnp.max(jnp.abs(x1)))
  assert float(state.scale) == float(np.float32(448.0) / a1)
  _, t2 = step(state, x2)
  assert float(t2.scale_inv) == float(np.float32(1.0) / (np.float32(448.0) / a1))


def test_a_state_without_a_usable_amax_stays_just_in_time(rng):
  """All-zero tensors record amax 0: no scale is stored, so the next step is still quantized
  with its own amax's scale."""
  q = DELAYED(amax_history_len=4)
  state = jq.init_state(q)
  zeros = jnp.zeros((M, K), jnp.float32)
  state = jq.update_state(q, state, quantize(zeros, q, state=state))
  assert float(state.scale) == 0.0
  x = _x(rng)
  got = quantize(x, q, columnwise=False, state=state).rowwise
  want = quantize(x, CURRENT(), columnwise=False).rowwise
  assert_same_leaves((got.data, got.scale_inv), (want.data, want.scale_inv))


@pytest.mark.parametrize("make", [
    lambda: DELAYED(first_scale="scale_one"),
    lambda: jq.DelayedScaling(first_scale="first"),
    lambda: jq.factories.delayed_scaling(None, first_scale=1.0),
])
def test_first_scale_is_validated(make):
  with pytest.raises(ValueError, match="first_scale=.*expected 'current'.*or 'one'"):
    make()


def _dense_grads(recipe, x, kernel, bias, c):
  quantizers = jq.DenseQuantizers.from_recipe(recipe, "linear", "fc")
  states = quantizers.init_states()

  def loss(x, kernel, bias, states):
    y = jq.dense(x, kernel, bias, quantizers, states=states)
    return jnp.sum(y * c), y

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
      x, kernel, bias, states)


def test_dense_step_one_equals_current_scaling(rng):
  x, kernel = _x(rng), _x(rng, (K, N))
  bias, c = _x(rng, (N,)), _x(rng, (M, N))
  (_, y_d), (dx_d, dk_d, db_d, new_states) = _dense_grads(jq.DelayedScaling(), x, kernel, bias, c)
  (_, y_c), (dx_c, dk_c, db_c, _) = _dense_grads(jq.Float8CurrentScaling(), x, kernel, bias, c)
  assert_same_leaves((y_d, dx_d, dk_d, db_d), (y_c, dx_c, dk_c, db_c), "delayed vs current")
  # The update after step 1 is the spec's: scale = fmax / amax, the amax at the history's end.
  for state, tensor, fmax in zip(new_states, (x, kernel, c), (448.0, 448.0, 57344.0)):
    amax = np.float32(jnp.max(jnp.abs(tensor)))
    assert float(state.scale) == float(np.float32(fmax) / amax)
    assert float(state.amax_history[-1]) == float(amax)


def test_dense_with_first_scale_one_differs_from_current_scaling(rng):
  x, kernel = _x(rng), _x(rng, (K, N))
  bias, c = _x(rng, (N,)), _x(rng, (M, N))
  (_, y_one), _ = _dense_grads(jq.DelayedScaling(first_scale="one"), x, kernel, bias, c)
  (_, y_c), _ = _dense_grads(jq.Float8CurrentScaling(), x, kernel, bias, c)
  assert not np.array_equal(np.asarray(y_one), np.asarray(y_c))


class _PlainMLP(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(N, name="fc2")(nn.gelu(nn.Dense(2 * N, name="fc1")(x)))


class _JaxquantMLP(nn.Module):
  recipe: jq.Recipe

  @nn.compact
  def __call__(self, x):
    x = jf.Dense(2 * N, name="fc1", recipe=self.recipe)(x)
    return jf.Dense(N, name="fc2", recipe=self.recipe)(nn.gelu(x))


def _init(init, *args):
  """`init` as one compiled program (a fresh function, traced here: inside the caller's
  `quantize_dense`); eagerly it ran the quantized forward op by op (~10 CPU-s over this file)."""
  return jax.jit(lambda key, *args: init(key, *args))(jax.random.key(0), *args)


def _flax_step_one(apply, variables, x, c):
  def loss(v):
    y = apply(v, x)
    return jnp.sum(y * c), y

  (_, y), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(variables)
  return y, grads["params"]


@pytest.mark.parametrize("build", ["jaxquant.flax.Dense", "quantize_dense"])
def test_flax_step_one_equals_current_scaling(rng, build):
  x, c = _x(rng), _x(rng, (M, N))
  results = {}
  for name, recipe in (("delayed", jq.DelayedScaling()), ("current", jq.Float8CurrentScaling())):
    if build == "quantize_dense":
      model = _PlainMLP()
      with jf.quantize_dense(recipe):
        results[name] = _flax_step_one(model.apply, _init(model.init, x), x, c)
    else:
      model = _JaxquantMLP(recipe)
      results[name] = _flax_step_one(model.apply, _init(model.init, x), x, c)
  assert_same_leaves(results["delayed"], results["current"], build)


def test_grouped_dense_step_one_equals_current_scaling_per_expert(rng):
  """Every expert's first step takes its own amax (one state per expert)."""
  groups, tokens = 4, 64
  sizes = jnp.asarray([20, 0, 28, 16], jnp.int32)
  x = _x(rng, (tokens, K)) * jnp.repeat(jnp.asarray([1.0, 1.0, 9.0, 0.1]), sizes,
                                        total_repeat_length=tokens)[:, None]
  c = _x(rng, (tokens, N))
  results = {}
  for name, recipe in (("delayed", jq.DelayedScaling()), ("current", jq.Float8CurrentScaling())):
    model = jf.GroupedDense(N, num_groups=groups, recipe=recipe)
    variables = _init(model.init, x, sizes)
    results[name] = _flax_step_one(lambda v, x: model.apply(v, x, sizes), variables, x, c)
  if jax.default_backend() == "cpu":
    assert_same_leaves(results["delayed"], results["current"], "grouped")
    return
  # On a GPU the bias gradient (an atomic float32 segment sum) is not reproducible bit for bit,
  # so each leaf is held within a few float32 ulps of its largest element (on an H100 the output
  # and the kernel gradient came out identical, the bias gradient 2.6e-7 apart); a step-1 scale
  # of its own would move every value by far more.
  for path, got in jax.tree_util.tree_leaves_with_path(results["delayed"]):
    want = np.asarray(dict(jax.tree_util.tree_leaves_with_path(results["current"]))[path])
    got = np.asarray(got)
    bound = 2.0**-20 * np.abs(want).max()
    print(f"{jax.tree_util.keystr(path)}: max |delayed - current| = "
          f"{np.abs(got - want).max():.3g} (bound {bound:.3g})")
    np.testing.assert_allclose(got, want, rtol=0, atol=bound, err_msg=jax.tree_util.keystr(path))


def test_grouped_quantize_mixes_fresh_and_stored_scales_per_group(rng):
  """Groups whose state has no scale yet take their own amax's; the others their stored one."""
  q = DELAYED(jnp.float8_e5m2, amax_history_len=4)
  sizes = jnp.asarray([10, 0, 30, 24], jnp.int32)
  x = _x(rng, (64, K))
  state = jg.init_state(q, 4)
  stored = np.float32(rng.uniform(0.5, 40.0))
  state = jq.DelayedScalingState(state.scale.at[2].set(stored), state.amax_history)
  qt = jax.jit(lambda x, s, st: jg.quantize(x, s, q, columnwise=False, state=st))(
      x, sizes, state)
  scale_inv = np.asarray(qt.rowwise.scale_inv)
  for g, rows in ((0, slice(0, 10)), (3, slice(40, 64))):
    want = np.float32(1.0) / (np.float32(57344.0) / np.float32(jnp.max(jnp.abs(x[rows]))))
    assert scale_inv[g] == want, g
  assert scale_inv[1] == 1.0  # empty group: amax 0 gives scale 1, as current scaling
  assert scale_inv[2] == np.float32(1.0) / stored
