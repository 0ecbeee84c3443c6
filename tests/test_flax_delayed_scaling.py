"""Delayed scaling in Flax: `scale`/`amax_history` live in `"_overwrite_with_gradient"` and come
back as their gradient, so `TrainState.apply_gradients` and `jaxquant.flax.apply_gradients`
(a plain optax loop) both advance them; after N jitted steps they hold the values computed by
hand from the amaxes of the tensors each step saw (docs/design.md §5 "Numerics", delayed
scaling).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import jaxquant as jq
import jaxquant.flax as jf

M, K, N = 16, 32, 8
HISTORY = 4
STEPS = 5  # more than HISTORY, so the window rolls past its length
FMAX = {"input": np.float32(448.0), "weight": np.float32(448.0),
        "grad_output": np.float32(57344.0)}  # HYBRID: E4M3 forward, E5M2 gradients
RECIPE = jq.DelayedScaling(amax_history_len=HISTORY)


def _hand_state(amaxes, fmax):
  """docs/design.md §5 "Numerics": hist[0] = amax; a = max(hist); scale = fmax / a if a is
  finite and > 0; roll
  the history by -1 and zero hist[0]. Float32 arithmetic, as the spec."""
  hist, scale = np.zeros(HISTORY, np.float32), np.float32(1.0)
  for amax in amaxes:
    hist[0] = amax
    a = hist.max()
    if np.isfinite(a) and a > 0:
      scale = np.float32(fmax / a)
    hist = np.roll(hist, -1)
    hist[0] = 0.0
  return scale, hist


def _batches(rng):
  """Per step: x and the loss weights c (loss = sum(y * c), so dy = c exactly); magnitudes
  vary between steps so the history's max is not always the latest amax."""
  scales = rng.uniform(0.5, 4.0, STEPS)
  return [(jnp.asarray(rng.standard_normal((M, K)) * s, jnp.float32),
           jnp.asarray(rng.standard_normal((M, N)) * s, jnp.float32)) for s in scales]


def _loss(module, variables, x, c):
  return jnp.sum(module.apply(variables, x) * c)


def _assert_state_matches_hand(state_vars, batches, kernels):
  amaxes = {"input": [np.abs(np.asarray(x)).max() for x, _ in batches],
            "weight": [np.abs(k).max() for k in kernels],
            "grad_output": [np.abs(np.asarray(c)).max() for _, c in batches]}
  for tensor, values in amaxes.items():
    scale, hist = _hand_state(values, FMAX[tensor])
    np.testing.assert_array_equal(np.asarray(state_vars[f"{tensor}_amax_history"]), hist,
                                  err_msg=tensor)
    np.testing.assert_array_equal(np.asarray(state_vars[f"{tensor}_scale"]), scale,
                                  err_msg=tensor)


def test_trainstate_apply_gradients_advances_the_state_like_the_spec(rng):
  batches = _batches(rng)
  module = jf.Dense(N, recipe=RECIPE)
  variables = module.init(jax.random.key(0), batches[0][0])
  assert set(variables) == {"params", jf.OVERWRITE_WITH_GRADIENT}
  state = train_state.TrainState.create(apply_fn=module.apply, params=variables,
                                        tx=optax.sgd(0.05))

  @jax.jit
  def step(state, x, c):
    grads = jax.grad(lambda v: _loss(module, v, x, c))(state.params)
    return state.apply_gradients(grads=grads)

  kernels = []
  for x, c in batches:
    kernels.append(np.asarray(state.params["params"]["kernel"]))  # what this step quantizes
    state = step(state, x, c)
  assert not np.array_equal(kernels[0], kernels[-1])  # the optimizer did update the params
  _assert_state_matches_hand(state.params[jf.OVERWRITE_WITH_GRADIENT], batches, kernels)


def test_optax_apply_gradients_helper_advances_the_state_like_the_spec(rng):
  batches = _batches(rng)
  module = jf.Dense(N, recipe=RECIPE)
  variables = module.init(jax.random.key(0), batches[0][0])
  tx = optax.adam(1e-2)
  opt_state = jf.init_optimizer(tx, variables)

  @jax.jit
  def step(variables, opt_state, x, c):
    grads = jax.grad(lambda v: _loss(module, v, x, c))(variables)
    return jf.apply_gradients(tx, variables, grads, opt_state)

  kernels = []
  for x, c in batches:
    kernels.append(np.asarray(variables["params"]["kernel"]))
    variables, opt_state = step(variables, opt_state, x, c)
  assert not np.array_equal(kernels[0], kernels[-1])
  _assert_state_matches_hand(variables[jf.OVERWRITE_WITH_GRADIENT], batches, kernels)


def test_dense_general_batch_elements_keep_their_own_state(rng):
  x = jnp.asarray(rng.standard_normal((3, M, K)) * rng.uniform(0.5, 4.0, (3, 1, 1)),
                  jnp.float32)
  module = jf.DenseGeneral(N, batch_dims=(0,), recipe=RECIPE)
  variables = module.init(jax.random.key(0), x)
  grads = jax.jit(jax.grad(lambda v: jnp.sum(module.apply(v, x))))(variables)
  history = np.asarray(grads[jf.OVERWRITE_WITH_GRADIENT]["input_amax_history"])
  assert history.shape == (3, HISTORY)
  np.testing.assert_array_equal(history[:, -1], np.abs(np.asarray(x)).max(axis=(1, 2)))


def test_apply_gradients_refuses_grads_of_params_only(rng):
  module = jf.Dense(N, recipe=RECIPE)
  x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
  variables = module.init(jax.random.key(0), x)
  tx = optax.sgd(0.1)
  grads = {"params": jax.tree_util.tree_map(jnp.zeros_like, variables["params"])}
  with pytest.raises(ValueError, match="_overwrite_with_gradient"):
    jf.apply_gradients(tx, variables, grads, jf.init_optimizer(tx, variables))
