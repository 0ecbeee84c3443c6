"""The activation producer of the grouped FP8 quantize (`jaxquant.grouped.quantize(...,
activation=, activation_input=)`, `grouped_dense(..., input_activation=)`).

The per-tensor FP8 grouped kernel computes `act(x)` (an MoE's fc2 input) or `act'(h) * dy`
(fc1's output gradient) on its loads, rounded to x's dtype, instead of quantizing a copy XLA
wrote first. Checked: every byte, scale and amax equal the reference composition (the spec's
activation rounded to x's dtype, then the grouped quantize) for every activation, both dtypes,
current and delayed scaling (a just-in-time first scale included: the gated amax runs the
producer too), ragged / empty groups and rows of no group, packed and padded layouts; the
amax also against float64 math; formats without the fused kernel take the composition and
`explain` says so; `grouped_dense(..., input_activation=)` against the unfused layer; the
argument errors. The CPU handlers run in CI, the CUDA kernels under `-m gpu`.
"""

from __future__ import annotations

import contextlib
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
import jaxquant.grouped as jg
from helpers import assert_same_leaves
from jaxquant.backends.ffi.grouped import support as kernels
from jaxquant.numerics import activations as act

pytestmark = pytest.mark.skipif(
    kernels.QUANTIZE_FP8_TARGET not in kernels._targets("cpu") | kernels._targets("cuda"),
    reason="jaxquant FFI extension without jaxquant_grouped_quantize_fp8")

FFI_PATH = "ffi-cuda" if jax.default_backend() == "gpu" else "ffi-cpu"
CURRENT = jq.Float8CurrentScalingQuantizer()
DELAYED = jq.Float8DelayedScalingQuantizer(amax_history_len=4)


@contextlib.contextmanager
def _backend(name: str):
  old = os.environ.get("JAXQUANT_BACKEND")
  os.environ["JAXQUANT_BACKEND"] = name
  try:
    yield
  finally:
    if old is None:
      del os.environ["JAXQUANT_BACKEND"]
    else:
      os.environ["JAXQUANT_BACKEND"] = old


def _on(backend: str, fn, *args):
  with _backend(backend):
    return jax.jit(lambda *a: fn(*a))(*args)  # a fresh function: no trace shared


def _sizes(rng, tokens: int, groups: int, spare: int) -> np.ndarray:
  """Ragged sizes summing to `tokens - spare`, some groups empty."""
  weights = rng.uniform(0.2, 1.0, groups) * (rng.uniform(size=groups) > 0.3)
  if not weights.any():
    weights[-1] = 1.0
  sizes = np.floor(weights / weights.sum() * (tokens - spare)).astype(np.int32)
  sizes[np.argmax(weights)] += tokens - spare - sizes.sum()
  return sizes


def _inputs(rng, tokens: int, features: int, dtype):
  """x (the activation's input or the gradient) and h, over the range where the activations
  bend (|v| up to ~8) with a few large and tiny values."""
  x = rng.standard_normal((tokens, features)) * np.exp2(rng.uniform(-3, 3, (tokens, features)))
  h = rng.standard_normal((tokens, features)) * 2.5
  return jnp.asarray(x, dtype), jnp.asarray(h, dtype)


def _state(rng, groups: int, fresh: bool):
  state = jg.init_state(DELAYED, groups)
  scale = rng.uniform(0.5, 40.0, groups).astype(np.float32)
  if fresh:
    scale[::3] = 0.0  # the just-in-time first scale of these groups (the gated amax)
  return jq.DelayedScalingState(jnp.asarray(scale), state.amax_history)


def _f64_activation(name: str, v: np.ndarray) -> np.ndarray:
  v = v.astype(np.float64)
  sig = lambda z: 1.0 / (1.0 + np.exp(-z))
  if name == "gelu":
    return 0.5 * v * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v ** 3)))
  if name == "silu":
    return v * sig(v)
  if name == "quick_gelu":
    return v * sig(1.702 * v)
  if name == "relu":
    return np.maximum(v, 0.0)
  return np.maximum(v, 0.0) ** 2


def _check(rng, name: str, grad: bool, quantizer, tokens: int, features: int, groups: int,
           dtype, spare: int, fresh: bool = False, **copies):
  """The FFI result equals the reference composition bit for bit, and took the kernel."""
  x, h = _inputs(rng, tokens, features, dtype)
  sizes = jnp.asarray(_sizes(rng, tokens, groups, spare))
  state = _state(rng, groups, fresh) if quantizer.stateful else None
  pre = h if grad else None
  fn = lambda x, s, st, pre: jg.quantize(x, s, quantizer, state=st, activation=name,
                                         activation_input=pre, **copies)
  with _backend("ffi"):
    report = jq.explain(fn, x, sizes, state, pre)
  assert report.paths() == {FFI_PATH}, str(report)
  wanted = f"of {act.canonical(name)}'(h) * dy" if grad else f"of {act.canonical(name)}(x)"
  assert all(wanted in d.detail for d in report if d.op == "grouped_quantize"), str(report)
  got = _on("ffi", fn, x, sizes, state, pre)
  want = _on("reference", fn, x, sizes, state, pre)
  assert_same_leaves(got, want, f"{name} grad={grad} G={groups} {np.dtype(dtype).name} {copies}")
  if not grad:  # the amax against float64 math: within the rounding of x's dtype (and exp's)
    values = np.abs(_f64_activation(act.canonical(name), np.asarray(x, np.float64)))
    ends = np.cumsum(np.asarray(sizes))
    copy = got.rowwise if got.rowwise is not None else got.columnwise
    for g, (lo, hi) in enumerate(zip(ends - np.asarray(sizes), ends)):
      expected = values[lo:hi].max() if hi > lo else 0.0
      np.testing.assert_allclose(float(copy.amax[g]), expected, rtol=2 ** -7, atol=1e-30)
  return got


# ------------------------------------ CPU (CI) and any backend --------------------------------

@pytest.mark.parametrize("name", act.ACTIVATIONS)
@pytest.mark.parametrize("grad", [False, True], ids=["act", "act_grad"])
def test_grouped_quantize_of_an_activation_is_the_composition(rng, name, grad):
  """Both copies in one call (packed rowwise, padded columnwise), current scaling, bfloat16
  and float32 (a partial feature tile: 40 columns)."""
  for dtype in (jnp.bfloat16, jnp.float32):
    _check(rng, name, grad, CURRENT, 90, 40, 5, dtype, spare=6, col_block=16)


@pytest.mark.parametrize("grad", [False, True], ids=["act", "act_grad"])
def test_delayed_grouped_quantize_of_an_activation_records_its_amax(rng, grad):
  """Delayed scaling: the quantize kernel's amax is the produced values'; the groups without a
  scale take it from the gated amax, which runs the producer too. Each copy alone as well."""
  _check(rng, "gelu", grad, DELAYED, 90, 40, 5, jnp.bfloat16, spare=4, fresh=True)
  _check(rng, "silu", grad, DELAYED, 90, 40, 3, jnp.float32, spare=0, fresh=False,
         columnwise=False)
  _check(rng, "gelu", grad, DELAYED, 90, 40, 3, jnp.bfloat16, spare=2, fresh=True,
         rowwise=False, col_block=32)


def test_formats_without_the_fused_kernel_quantize_the_composition(rng):
  """MXFP8 (and a hybrid) quantize `act(x)` from memory: bit for bit the quantize of the
  reference composition, and `explain` records the unfused producer and why."""
  x, h = _inputs(rng, 64, 64, jnp.bfloat16)
  sizes = jnp.asarray([20, 0, 30], jnp.int32)
  for q in (jq.MXFP8Quantizer(), jq.HybridQuantizer(CURRENT, jq.MXFP8Quantizer())):
    for pre in (None, h):
      fused = lambda x, s, pre: jg.quantize(x, s, q, activation="gelu", activation_input=pre)
      report = jq.explain(fused, x, sizes, pre)
      producers = [d for d in report if d.op == "producer"]
      assert len(producers) == 1 and producers[0].path == "unfused", str(report)
      assert "per-tensor FP8" in producers[0].reason, producers[0].reason
      produced = (act.activation_backward("gelu", x.astype(jnp.float32), h.astype(jnp.float32))
                  if pre is not None else act.activation("gelu", x.astype(jnp.float32)))
      plain = lambda v, s: jg.quantize(v, s, q)
      assert_same_leaves(jax.jit(fused)(x, sizes, pre),
                         jax.jit(plain)(produced.astype(jnp.bfloat16), sizes), f"{q} {pre is None}")


def test_activation_argument_errors():
  x = jnp.ones((16, 8), jnp.bfloat16)
  sizes = jnp.asarray([8, 8], jnp.int32)
  with pytest.raises(ValueError, match="activation_input is given without activation"):
    jg.quantize(x, sizes, CURRENT, activation_input=x)
  with pytest.raises(ValueError, match="gated unit halves the features"):
    jg.quantize(x, sizes, CURRENT, activation="swiglu")
  with pytest.raises(ValueError, match="no fused kernel"):
    jg.quantize(x, sizes, CURRENT, activation="tanh")
  with pytest.raises(ValueError, match=r"activation_input: expected the activation's input"):
    jg.quantize(x, sizes, CURRENT, activation="gelu", activation_input=x[:8])
  with pytest.raises(ValueError, match=r"activation_input: expected the activation's input"):
    jg.quantize(x, sizes, CURRENT, activation="gelu", activation_input=x.astype(jnp.float32))
  kernel = jnp.ones((2, 8, 4), jnp.float32)
  with pytest.raises(ValueError, match="input_activation='geglu'"):
    jq.grouped_dense(x, kernel, sizes, input_activation="geglu")


@pytest.mark.parametrize("recipe", ["current", "delayed", None])
def test_grouped_dense_with_an_input_activation(rng, recipe):
  """`grouped_dense(h, ..., input_activation="gelu")` = `grouped_dense(gelu(h), ...)`: the
  forward bit for bit against the layer fed the spec's gelu (the values the kernel quantizes),
  the gradients within FP8 error of the unfused layer fed JAX's gelu (the same tanh gelu in
  XLA's arithmetic), and the input gradient exactly JAX's gelu backward of the same dgrad."""
  tokens, k, n, groups = 96, 64, 48, 4
  h = jnp.asarray(rng.standard_normal((tokens, k)) * 2, jnp.bfloat16)
  kernel = jnp.asarray(rng.standard_normal((groups, k, n)) / 8, jnp.float32)
  sizes = jnp.asarray(_sizes(rng, tokens, groups, 5))
  dy = jnp.asarray(rng.standard_normal((tokens, n)), jnp.bfloat16)
  quantizers = None
  states = None
  if recipe is not None:
    q = CURRENT if recipe == "current" else DELAYED
    quantizers = jq.DenseQuantizers(q, q, q)
    states = jq.grouped_dense_states(quantizers, groups) if recipe == "delayed" else None

  def layer(h, kernel, fused: bool, spec: bool):
    if fused:
      return jq.grouped_dense(h, kernel, sizes, None, quantizers, states=states,
                              input_activation="gelu")
    a = (act.activation("gelu", h.astype(jnp.float32)).astype(h.dtype) if spec
         else jax.nn.gelu(h))
    return jq.grouped_dense(a, kernel, sizes, None, quantizers, states=states)

  def grads(fused: bool, spec: bool):
    y, vjp = jax.vjp(lambda h, w: layer(h, w, fused, spec), h, kernel)
    return (y,) + vjp(dy)

  with _backend("ffi"):
    y, dh, dw = jax.jit(lambda: grads(True, False))()
    y_spec = jax.jit(lambda: grads(False, True))()[0]
    y_jax, dh_jax, dw_jax = jax.jit(lambda: grads(False, False))()
    if quantizers is not None:
      report = jq.explain(lambda h: layer(h, kernel, True, False), h)
      details = [d.detail for d in report if d.op == "grouped_quantize"]
      assert any("of gelu(x)" in d for d in details), str(report)
  if recipe is not None:  # the fused forward is the spec-gelu layer's, bit for bit
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_spec, np.float32))
  scale = lambda a: float(np.max(np.abs(np.asarray(a, np.float64)))) + 1e-30
  tol = 0.0 if recipe is None else 0.08  # FP8 operands: a few e4m3 steps of the largest entry
  for got, want, what in ((y, y_jax, "y"), (dh, dh_jax, "dh"), (dw, dw_jax, "dw")):
    err = np.max(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64)))
    assert err <= tol * scale(want) + (0 if recipe is not None else 1e-6 * scale(want)), (
        what, err, scale(want))
  assert dw.dtype == kernel.dtype and dh.dtype == h.dtype


# --------------------------------------------- GPU --------------------------------------------

@pytest.fixture
def on_gpu():
  if jax.default_backend() != "gpu":
    pytest.skip("needs a CUDA GPU (the default JAX backend is not gpu)")


@pytest.mark.gpu
@pytest.mark.parametrize("name", act.ACTIVATIONS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_gpu_grouped_quantize_of_an_activation_is_the_composition(on_gpu, rng, name, dtype):
  """The CUDA instances with the producer (quantize and amax kernels): G = 8 and 64 with
  empty groups and rows of no group, 200 features (scalar loads) and 256 (16-byte loads),
  the forward and the gradient, current and delayed scaling (some groups' first scale)."""
  for grad in (False, True):
    for groups in (8, 64):
      tokens = 1500 + 7 * groups
      _check(rng, name, grad, CURRENT, tokens, 256, groups, dtype, spare=11, col_block=16)
      _check(rng, name, grad, DELAYED, tokens, 200, groups, dtype, spare=5, fresh=True)
  _check(rng, name, True, CURRENT, 1000, 192, 8, dtype, spare=0, rowwise=False, col_block=32)
