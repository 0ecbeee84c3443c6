"""Delayed scaling's quantize and state update in one call (`jaxquant.ops.quantize_and_update`,
`jaxquant_quantize_fp8_delayed_update`, design decision 36): bit for bit the reference's
`quantize` then `update_state`, on the CPU handlers and on a GPU, for fresh and stored scales,
margins, "most_recent", histories of 1 to 1024 entries and x holding an inf or a NaN; one
command a tensor in the compiled program, the state updated in place.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from jaxquant.backends.ffi import quantize as ffi_quantize
from jaxquant.backends.ffi import registry
from helpers import assert_same_leaves
from test_delayed_kernels import QUANTIZERS as KERNEL_QUANTIZERS

pytestmark = pytest.mark.skipif(not registry.extension_built(),
                                reason="jaxquant FFI extension not built")

PLATFORMS = ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)]

# test_delayed_kernels' quantizers (fresh and stored scales, margins, "most_recent", length 1)
# and a history of several 256-entry chunks, and TransformerEngine's scale-1 start.
QUANTIZERS = dict(KERNEL_QUANTIZERS,
                  length1024=jq.Float8DelayedScalingQuantizer(amax_history_len=1024),
                  scale_one_start=jq.Float8DelayedScalingQuantizer(amax_history_len=7,
                                                                   first_scale="one"))
DIRECTIONS = {"both": (True, True), "rowwise": (True, False), "columnwise": (False, True)}


def _device(platform: str):
  if platform == "gpu" and jax.default_backend() != "gpu":
    pytest.skip("no GPU")
  return jax.devices(platform)[0]


def _canonical_nans(tree):
  """NaNs as one payload (a NaN amax's payload is not specified: the kernels widen bf16 by its
  bits, XLA's GPU convert gives 0x7FFFFFFF); every other value keeps its bits."""
  return jax.tree_util.tree_map(
      lambda v: np.where(np.isnan(v), np.float32(np.nan), v)
      if np.issubdtype(np.asarray(v).dtype, np.floating) and np.asarray(v).dtype.itemsize == 4
      else np.asarray(v), jax.device_get(tree))


def _random_state(rng, q, stored: float) -> jq.DelayedScalingState:
  length = q.amax_history_len
  history = np.abs(rng.standard_normal(length) * 10.0 ** rng.uniform(-2, 2)).astype(np.float32)
  return jq.DelayedScalingState(jnp.float32(stored), jnp.asarray(history))


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("name", sorted(QUANTIZERS))
@pytest.mark.parametrize("directions", sorted(DIRECTIONS))
def test_one_call_equals_quantize_then_update(rng, monkeypatch, platform, name, directions):
  """For a stored scale of 0 (the just-in-time first scale) and 0.75, and x finite or with one
  inf or NaN: the two programs are compiled once and run on each of the six inputs (the
  values are data, not part of the program)."""
  device = _device(platform)
  q = QUANTIZERS[name]
  rowwise, columnwise = DIRECTIONS[directions]

  def fields(t, new_state):
    copies = [(d.data, d.scale_inv, d.amax) for d in (t.rowwise, t.columnwise) if d is not None]
    return copies, new_state

  def two_steps(x, s):
    t = jq.ops.quantize(x, q, rowwise=rowwise, columnwise=columnwise, state=s)
    return fields(t, jq.ops.update_state(q, s, t))

  inputs = []
  for stored in (0.0, 0.75):
    for special in (None, np.inf, np.nan):
      state = _random_state(rng, q, stored)
      values = rng.standard_normal((48, 80)) * rng.uniform(0.01, 300.0)
      if special is not None:
        values[rng.integers(0, 48), rng.integers(0, 80)] = special
      inputs.append((f"stored={stored} special={special}",
                     jax.device_put((jnp.asarray(values, jnp.bfloat16), state), device)))

  # Each program is traced once, under its backend (read when a function is traced).
  monkeypatch.setenv("JAXQUANT_BACKEND", "ffi")
  one_call = jax.jit(lambda x, s: fields(*jq.ops.quantize_and_update(
      x, q, rowwise=rowwise, columnwise=columnwise, state=s)))
  text = one_call.lower(*inputs[0][1]).as_text()
  assert set(re.findall(r"custom_call @(jaxquant_\w+)", text)) == {
      "jaxquant_quantize_fp8_delayed_update"}, text
  got = [one_call(*args) for _, args in inputs]
  monkeypatch.setenv("JAXQUANT_BACKEND", "reference")
  two_calls = jax.jit(two_steps)
  for (what, args), result in zip(inputs, got):
    assert_same_leaves(_canonical_nans(result), _canonical_nans(two_calls(*args)),
                       f"{name} {directions} {what}")

@pytest.mark.parametrize("platform", PLATFORMS)
def test_the_state_is_updated_in_place(rng, monkeypatch, platform):
  """History' and scale' alias the state's buffers: a donated state needs no copy."""
  device = _device(platform)
  monkeypatch.setenv("JAXQUANT_BACKEND", "ffi")
  q = QUANTIZERS["length1024"]
  x = jax.device_put(jnp.asarray(rng.standard_normal((64, 96)), jnp.bfloat16), device)
  state = jax.device_put(_random_state(rng, q, 0.5), device)
  step = jax.jit(lambda s, x: jq.ops.quantize_and_update(x, q, state=s)[1], donate_argnums=0)
  hlo = step.lower(state, x).compile().as_text()
  assert " copy(" not in hlo and "copy-start" not in hlo, hlo
  want = jax.jit(lambda s, x: jq.update_state(q, s, jq.ops.quantize(x, q, state=s)))(state, x)
  assert_same_leaves(step(jax.tree_util.tree_map(jnp.copy, state), x), want)


def test_explain_says_where_the_update_ran(monkeypatch):
  monkeypatch.setenv("JAXQUANT_BACKEND", "ffi")
  q = QUANTIZERS["e4m3"]
  report = jq.explain(lambda x, s: jq.ops.quantize_and_update(x, q, state=s),
                      jnp.ones((32, 64), jnp.bfloat16), jq.init_state(q))
  updates = [d for d in report if d.op == "state-update"]
  assert len(updates) == 1 and "inside the quantize call" in updates[0].reason, updates


def test_other_quantizers_take_the_two_calls(monkeypatch):
  """Current scaling keeps no state; a batch of delayed states (leading axes) is updated by its
  own call: both are `quantize` then `update_state`, as before."""
  monkeypatch.setenv("JAXQUANT_BACKEND", "ffi")
  x = jnp.ones((32, 64), jnp.bfloat16)
  current = jq.Float8CurrentScalingQuantizer()
  t, state = jq.ops.quantize_and_update(x, current)
  assert state is None and t.rowwise is not None
  q = QUANTIZERS["e4m3"]
  batch = jax.tree_util.tree_map(lambda a: jnp.stack([a, a]), jq.init_state(q))
  reason = ffi_quantize.update_in_quantize_reason(q, batch)
  assert "batch of states" in reason, reason


def test_a_delayed_dense_step_has_one_command_per_forward_tensor(rng, monkeypatch):
  """`jq.dense` forward + backward under delayed scaling: x and W each quantized and updated by
  one call; dy (quantized in the backward) by the gated quantize and its update."""
  monkeypatch.setenv("JAXQUANT_BACKEND", "ffi")
  quantizers = jq.DenseQuantizers.from_recipe(jq.DelayedScaling(amax_history_len=16), "linear",
                                              "layer")
  states = quantizers.init_states()
  x = jnp.asarray(rng.standard_normal((32, 64)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((64, 48)), jnp.bfloat16)

  def step(x, w, states):  # the states' cotangents are the updated states
    y, vjp = jax.vjp(lambda x, w, s: jq.dense(x, w, None, quantizers, states=s), x, w, states)
    return vjp(jnp.ones_like(y))

  text = jax.jit(step).lower(x, w, states).as_text()
  found = re.findall(r"custom_call @(jaxquant_(?:quantize|delayed|amax)\w*)", text)
  assert sorted(found) == sorted(["jaxquant_quantize_fp8_delayed_update"] * 2
                                 + ["jaxquant_quantize_fp8_delayed_gated",
                                    "jaxquant_delayed_update"]), found
