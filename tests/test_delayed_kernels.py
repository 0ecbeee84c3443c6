"""Delayed scaling's scalar work in the kernels (issue 24, compile time): the just-in-time first
scale inside `jaxquant_quantize_fp8_delayed` and the state update `jaxquant_delayed_update`,
bit for bit against the reference (`jaxquant.state`), on the CPU handlers and on a GPU.

Histories and amaxes include the cases the spec singles out: zeros (no usable amax: the scale is
kept), inf and NaN (kept; a NaN anywhere in the history makes max() NaN), values whose scale
overflows (clamped to FLT_MAX), subnormal amaxes, margins, "most_recent", length 1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from jaxquant.backends.ffi import delayed as ffi_delayed
from jaxquant.backends.ffi import registry
from jaxquant.state import DelayedScalingState, delayed_scaling_update
from helpers import assert_same_leaves

pytestmark = pytest.mark.skipif(not registry.extension_built(),
                                reason="jaxquant FFI extension not built")

PLATFORMS = ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)]
SPECIAL = np.array([0.0, np.inf, np.nan, 1e-40, 3e38, 1.0, 448.0, 2.5e-3], np.float32)


def _device(platform: str):
  if platform == "gpu" and jax.default_backend() != "gpu":
    pytest.skip("no GPU")
  return jax.devices(platform)[0]


def _states(rng, length: int, count: int):
  """`count` (state, amax) cases: random histories with special values mixed in."""
  cases = []
  for i in range(count):
    history = np.abs(rng.standard_normal(length) * 10.0 ** rng.uniform(-3, 3)).astype(np.float32)
    if i % 3 == 1:
      history[rng.integers(0, length)] = rng.choice(SPECIAL)
    if i % 5 == 2:
      history[:] = 0.0
    scale = np.float32(rng.choice([0.0, 1.0, 0.37, 3e38]))
    amax = np.float32(rng.choice(SPECIAL) if i % 2 else abs(rng.standard_normal()) * 100)
    cases.append((DelayedScalingState(jnp.asarray(scale), jnp.asarray(history)),
                  jnp.asarray(amax)))
  return cases


QUANTIZERS = {
    "e4m3": jq.Float8DelayedScalingQuantizer(amax_history_len=7),
    "e5m2_margin2": jq.Float8DelayedScalingQuantizer(jnp.float8_e5m2, amax_history_len=7,
                                                     margin=2),
    "most_recent": jq.Float8DelayedScalingQuantizer(amax_history_len=7,
                                                    amax_compute_algo="most_recent"),
    "length1": jq.Float8DelayedScalingQuantizer(amax_history_len=1),
}


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("name", sorted(QUANTIZERS))
def test_delayed_update_kernel_equals_the_reference(rng, platform, name):
  q = QUANTIZERS[name]
  device = _device(platform)
  reference = jax.jit(lambda s, a: delayed_scaling_update(s, a, q))
  kernel = jax.jit(lambda s, a: ffi_delayed.update(s, a, q))
  for state, amax in jax.device_put(_states(rng, q.amax_history_len, 24), device):
    assert_same_leaves(kernel(state, amax), reference(state, amax), f"{name} {state} {amax}")


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("length", [1, 7, 256, 300, 1024])
def test_delayed_update_in_place_of_a_donated_state(rng, platform, length):
  """The update writes the new history and scale over the old ones (aliased outputs): with the
  state donated, the compiled program has no copy, and the kernel's chunked roll (256 entries a
  chunk, each read before any is written) gives the reference's values in place, also where a
  chunk ends inside the history (300) and across several chunks (1024)."""
  q = jq.Float8DelayedScalingQuantizer(amax_history_len=length)
  device = _device(platform)
  reference = jax.jit(lambda s, a: delayed_scaling_update(s, a, q))
  in_place = jax.jit(lambda s, a: ffi_delayed.update(s, a, q), donate_argnums=0)
  for state, amax in jax.device_put(_states(rng, length, 6), device):
    want = reference(state, amax)
    hlo = in_place.lower(state, amax).compile().as_text()
    assert " copy(" not in hlo and "copy-start" not in hlo, hlo
    got = in_place(jax.tree_util.tree_map(jnp.copy, state), amax)
    assert_same_leaves(got, want, f"length {length}")


@pytest.mark.parametrize("platform", PLATFORMS)
def test_delayed_update_kernel_takes_a_batch_of_states(rng, platform):
  """Leading axes (DenseGeneral's batch_dims keep one state per element) are one launch."""
  q = QUANTIZERS["e4m3"]
  cases = _states(rng, q.amax_history_len, 6)
  states = jax.tree_util.tree_map(lambda *a: jnp.stack(a).reshape(2, 3, *a[0].shape),
                                  *[s for s, _ in cases])
  amax = jnp.stack([a for _, a in cases]).reshape(2, 3)
  states, amax = jax.device_put((states, amax), _device(platform))
  got = jax.jit(lambda s, a: ffi_delayed.update(s, a, q))(states, amax)
  want = jax.jit(jax.vmap(jax.vmap(lambda s, a: delayed_scaling_update(s, a, q))))(states, amax)
  assert_same_leaves(got, want)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("margin", [0, 3])
@pytest.mark.parametrize("stored", [0.0, 0.75])
@pytest.mark.parametrize("special", [None, np.inf, np.nan])
def test_first_scale_in_the_quantize_kernel_equals_the_reference(rng, monkeypatch, platform,
                                                                 margin, stored, special):
  """A state with no scale yet (0) quantizes with its amax's scale, taken inside the one call
  (`jaxquant_quantize_fp8_delayed_gated`: its gated amax pass, then the kernel); a stored scale
  is used as it is. Bytes, scale_inv and amax equal the reference's, also with an inf or NaN in
  x (no usable amax: scale 1). A NaN amax is compared as NaN: its payload is not specified (the
  kernels widen bf16 by its bits, XLA's GPU convert gives 0x7FFFFFFF)."""
  device = _device(platform)
  q = jq.Float8DelayedScalingQuantizer(amax_history_len=4, margin=margin)
  state = DelayedScalingState(jnp.float32(stored), jnp.zeros((4,), jnp.float32))
  values = rng.standard_normal((48, 80)) * rng.uniform(0.01, 300.0)
  if special is not None:
    values[rng.integers(0, 48), rng.integers(0, 80)] = special
  x = jnp.asarray(values, jnp.bfloat16)

  x, state = jax.device_put((x, state), device)

  def run(backend):
    monkeypatch.setenv("JAXQUANT_BACKEND", backend)
    t = jax.jit(lambda x, s: jq.ops.quantize(x, q, state=s))(x, state)
    fields = [(d.data, d.scale_inv, d.amax) for d in (t.rowwise, t.columnwise)]
    if special is not None and np.isnan(special):
      assert all(np.isnan(np.asarray(amax)) for _, _, amax in fields), fields
      fields = [(data, scale_inv) for data, scale_inv, _ in fields]
    return fields

  assert_same_leaves(run("ffi"), run("reference"))


def test_the_ffi_path_writes_no_scale_division_in_xla(monkeypatch):
  """With the first scale and the update in the kernels, a delayed-scaling quantize + update
  lowers to a few custom calls and no integer-division (ieee_div) code."""
  monkeypatch.setenv("JAXQUANT_BACKEND", "ffi")
  q = jq.Float8DelayedScalingQuantizer(amax_history_len=16)

  def step(x, state):
    t = jq.ops.quantize(x, q, state=state)
    return t, jq.ops.update_state(q, state, t)

  text = jax.jit(step).lower(jnp.ones((32, 64), jnp.bfloat16), jq.init_state(q)).as_text()
  targets = sorted(set(__import__("re").findall(r"custom_call @(jaxquant_\w+)", text)))
  assert targets == ["jaxquant_delayed_update", "jaxquant_quantize_fp8_delayed_gated"]
  assert "stablehlo.divide" not in text and "stablehlo.remainder" not in text
