"""Delayed scaling's first step on a sharded tensor (`first_scale="current"`, a state with no
scale yet): the scale comes from the amax of the whole tensor, not of a shard.

One device quantizes with `jaxquant_quantize_fp8_delayed_gated`, whose amax pass is inside the
call; where x is sharded that pass would see one shard, so the partitioned call runs the gated
amax on each shard, `pmax`es it and quantizes with `jaxquant_quantize_fp8_delayed`
(`Layout.sharded`). The shards' rows here are scaled so their amaxes differ by orders of
magnitude: a shard-local first scale changes the bytes.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxquant as jq
from jaxquant.backends.ffi import registry
from helpers import assert_same_leaves

pytestmark = pytest.mark.skipif(not registry.extension_built(),
                                reason="jaxquant FFI extension not built")


def _targets(compiled_text: str) -> set[str]:
  return set(re.findall(r'custom_call_target="(jaxquant_\w+)"', compiled_text))


@pytest.mark.parametrize("stored_scale", [0.0, 0.5])
@pytest.mark.parametrize("spec", [P("d", None), P(None, "d")], ids=["rows", "cols"])
def test_a_sharded_first_step_takes_the_whole_tensors_amax(devices, rng, monkeypatch, spec,
                                                           stored_scale):
  monkeypatch.setenv("JAXQUANT_BACKEND", "ffi")
  mesh = Mesh(np.array(devices), ("d",))
  n = len(devices)
  q = jq.Float8DelayedScalingQuantizer(amax_history_len=4)
  state = jq.DelayedScalingState(jnp.float32(stored_scale), jnp.zeros((4,), jnp.float32))
  values = rng.standard_normal((16 * n, 32 * n))
  # Each shard (of rows or of columns) at its own magnitude, 1e-3 .. 1e3.
  factors = 10.0 ** np.linspace(-3, 3, n)
  values *= (np.repeat(factors, 16)[:, None] if spec[0] else np.repeat(factors, 32)[None, :])
  x = jnp.asarray(values, jnp.bfloat16)

  quantize = jax.jit(lambda x, s: jq.ops.quantize(x, q, state=s))
  single_x = jax.device_put(x, devices[0])
  sharded_x = jax.device_put(x, NamedSharding(mesh, spec))

  def fields(t):
    return [(d.data, d.scale_inv, d.amax) for d in (t.rowwise, t.columnwise)]

  want = jax.device_get(fields(quantize(single_x, state)))
  got = jax.device_get(fields(quantize(sharded_x, state)))
  assert_same_leaves(got, want, f"{spec}, stored scale {stored_scale}")

  single_targets = _targets(quantize.lower(single_x, state).compile().as_text())
  sharded_targets = _targets(quantize.lower(sharded_x, state).compile().as_text())
  assert single_targets == {"jaxquant_quantize_fp8_delayed_gated"}, single_targets
  assert sharded_targets == {"jaxquant_amax_gated", "jaxquant_quantize_fp8_delayed"}, (
      sharded_targets)


@pytest.mark.parametrize("first_scale", ["current", "one"])
@pytest.mark.parametrize("stored_scale", [0.0, 0.5])
def test_a_sharded_quantize_and_update_takes_the_global_amax(devices, rng, monkeypatch,
                                                             stored_scale, first_scale):
  """`jaxquant.ops.quantize_and_update` (one call on one device,
  `jaxquant_quantize_fp8_delayed_update`) on a row-sharded x: the quantize, the amax's pmax and
  the state's update as separate calls, the state equal to one device's."""
  monkeypatch.setenv("JAXQUANT_BACKEND", "ffi")
  mesh = Mesh(np.array(devices), ("d",))
  n = len(devices)
  q = jq.Float8DelayedScalingQuantizer(amax_history_len=8, first_scale=first_scale)
  history = np.abs(rng.standard_normal(8)).astype(np.float32)
  state = jq.DelayedScalingState(jnp.float32(stored_scale), jnp.asarray(history))
  values = rng.standard_normal((16 * n, 32)) * np.repeat(10.0 ** np.linspace(-3, 3, n), 16)[:, None]
  x = jnp.asarray(values, jnp.bfloat16)

  def step(x, s):
    t, new_state = jq.ops.quantize_and_update(x, q, state=s)
    return [(d.data, d.scale_inv, d.amax) for d in (t.rowwise, t.columnwise)], new_state

  step = jax.jit(step)
  single_x = jax.device_put(x, devices[0])
  sharded_x = jax.device_put(x, NamedSharding(mesh, P("d", None)))
  assert_same_leaves(jax.device_get(step(sharded_x, state)),
                     jax.device_get(step(single_x, state)), f"{first_scale} {stored_scale}")
  single_targets = _targets(step.lower(single_x, state).compile().as_text())
  sharded_targets = _targets(step.lower(sharded_x, state).compile().as_text())
  assert single_targets == {"jaxquant_quantize_fp8_delayed_update"}, single_targets
  quantize = ({"jaxquant_amax_gated", "jaxquant_quantize_fp8_delayed"}
              if first_scale == "current" else {"jaxquant_quantize_fp8"})
  assert sharded_targets == quantize | {"jaxquant_delayed_update"}, sharded_targets
