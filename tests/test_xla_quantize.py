"""The XLA-fused per-tensor FP8 quantize (`jaxquant.backends.xla`) against the reference, bit for
bit, and how the dispatch selects and reports it.

Each check quantizes fresh random inputs (the `rng` fixture records its seed) with the XLA-fused
path and with `ops.reference.quantize_single` in one jitted program and compares data bytes,
scale_inv and amax. The cast is also checked on every rounding tie of E4M3/E5M2, the float32
neighbours of each tie, and special values. CPU always; the same tests on the GPU with `-m gpu`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from helpers import assert_same_leaves
from jaxquant.backends import xla as xla_backend
from jaxquant.backends.xla import quantize as xla_quantize
from jaxquant.numerics.minifloat import E4M3, E5M2, cast_sat
from jaxquant.backends.reference import ops as reference
from jaxquant.ops import dispatch

PLATFORMS = ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)]

QUANTIZERS = {
    "current_e4m3": jq.Float8CurrentScalingQuantizer(),
    "current_e5m2": jq.Float8CurrentScalingQuantizer(jnp.float8_e5m2),
    "current_pow2_eps": jq.Float8CurrentScalingQuantizer(pow2_scale=True, amax_epsilon=0.5),
    "delayed_e4m3": jq.Float8DelayedScalingQuantizer(amax_history_len=4),
    "delayed_e5m2": jq.Float8DelayedScalingQuantizer(jnp.float8_e5m2, amax_history_len=4),
}
SHAPES = [(100, 72), (37, 33), (1, 48)]
GPU_SHAPES = [(1000, 1536), (4096, 520)]


def _device(platform: str):
  if platform == "gpu" and jax.default_backend() != "gpu":
    pytest.skip("no GPU")
  return jax.devices(platform)[0]


def _matrix(rng, shape, dtype, special: bool) -> np.ndarray:
  x = rng.standard_normal(shape).astype(np.float32)
  x *= np.exp2(rng.integers(-8, 9, size=shape)).astype(np.float32)
  if special:
    tiny = 3e-6 if np.dtype(dtype) == np.dtype(np.float16) else 1e-39
    values = np.array([0.0, -0.0, tiny, -tiny, np.inf, -np.inf, np.nan, -np.nan, 448.0, -6.0,
                       5e4, 3e4], np.float32)
    flat = x.reshape(-1)
    idx = rng.choice(flat.size, size=min(flat.size, 2 * values.size), replace=False)
    flat[idx] = np.resize(values, idx.size)
  return x.astype(dtype)


def _state(q, rng):
  if not isinstance(q, jq.Float8DelayedScalingQuantizer):
    return None
  return jq.DelayedScalingState(jnp.asarray(np.float32(rng.uniform(0.01, 300.0))),
                                jnp.zeros((q.amax_history_len,), jnp.float32))


@functools.partial(jax.jit, static_argnames=("quantizer", "rowwise", "columnwise"))
def _both(x, state, *, quantizer, rowwise, columnwise):
  kw = dict(rowwise=rowwise, columnwise=columnwise, orig_dtype=x.dtype, state=state)
  return (reference.quantize_single(x, quantizer, **kw),
          xla_quantize.quantize_single(x, quantizer, **kw))


def _check(platform, rng, name, shape, dtype=jnp.bfloat16, special=False, rowwise=True,
           columnwise=True):
  q = QUANTIZERS[name]
  device = _device(platform)
  x = jax.device_put(_matrix(rng, shape, dtype, special), device)
  with jax.default_device(device):
    ref, got = _both(x, _state(q, rng), quantizer=q, rowwise=rowwise, columnwise=columnwise)
  assert_same_leaves(ref, got, f"{name} {shape} {np.dtype(dtype).name} on {platform}")


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("name", QUANTIZERS)
def test_both_directions_match_reference(platform, name, rng):
  shapes = SHAPES + (GPU_SHAPES if platform == "gpu" else [])
  for shape in shapes:
    _check(platform, rng, name, shape)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("name", QUANTIZERS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_special_values_match_reference(platform, name, dtype, rng):
  _check(platform, rng, name, (67, 160), dtype=dtype, special=True)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("direction", ["rowwise", "columnwise"])
def test_one_direction_matches_reference(platform, direction, rng):
  _check(platform, rng, "current_e4m3", (33, 130), rowwise=direction == "rowwise",
         columnwise=direction == "columnwise")


def _grid_probes(spec, rng) -> np.ndarray:
  """Every finite value of the format, the midpoints between neighbours (the RNE ties), the
  float32 neighbours of each tie, values past fmax, random float32 bit patterns and specials."""
  codes = np.arange(256, dtype=np.uint8)
  grid = np.asarray(jnp.asarray(codes).view(spec.dtype).astype(jnp.float32))
  grid = np.unique(grid[np.isfinite(grid)])
  ties = ((grid[1:].astype(np.float64) + grid[:-1]) / 2).astype(np.float32)
  near = np.concatenate([grid, ties, np.nextafter(ties, np.float32(np.inf)),
                         np.nextafter(ties, np.float32(-np.inf))])
  beyond = np.float32(spec.fmax) * np.array([1.0 + 2.0**-10, 1.03, 1.0625, 1.07, 2.0, 1e30],
                                            np.float32)
  bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
  specials = np.array([np.inf, -np.inf, np.nan, -np.nan, 1e-45, 3.4e38, 0.0, -0.0], np.float32)
  return np.concatenate([near, -near, beyond, -beyond, bits, specials]).astype(np.float32)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("spec", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_cast_matches_reference_on_ties_and_specials(platform, spec, rng):
  device = _device(platform)
  v = jax.device_put(_grid_probes(spec, rng), device)
  codes = jax.jit(lambda v: (jax.lax.bitcast_convert_type(cast_sat(v, spec), jnp.uint8),
                             jax.lax.bitcast_convert_type(xla_quantize.cast_sat(v, spec),
                                                          jnp.uint8)))
  with jax.default_device(device):
    want, got = (np.asarray(c) for c in codes(v))
  bad = np.nonzero(want != got)[0]
  examples = [(float(np.asarray(v)[i]), hex(got[i]), hex(want[i])) for i in bad[:5]]
  assert bad.size == 0, f"{spec.name} on {platform}: {bad.size} codes differ, e.g. {examples}"


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("mode", xla_quantize.COLUMNWISE_MODES)
@pytest.mark.parametrize("name", ["current_e4m3", "delayed_e5m2"])
def test_ops_quantize_on_xla_path_matches_reference(platform, mode, name, monkeypatch, rng):
  """`ops.quantize` under JAXQUANT_BACKEND=xla (each way of making the columnwise copy) gives
  the reference's storages."""
  q = QUANTIZERS[name]
  device = _device(platform)
  x = jax.device_put(_matrix(rng, (96, 136), jnp.bfloat16, True), device)
  state = _state(q, rng)
  results = {}
  for backend in ("reference", "xla"):
    monkeypatch.setenv("JAXQUANT_BACKEND", backend)
    monkeypatch.setenv("JAXQUANT_XLA_COLUMNWISE", mode)
    fn = jax.jit(lambda x, s: jq.ops.quantize(x, q, state=s))  # a new function: traced afresh
    with jax.default_device(device), jq.explain_recording() as report:
      results[backend] = fn(x, state)
    assert report.paths("quantize") == {"reference" if backend == "reference" else "xla-fused"}
  assert_same_leaves(results["reference"], results["xla"], f"{name} {mode} on {platform}")


def test_forced_xla_backend_is_reported(monkeypatch, rng):
  monkeypatch.setenv("JAXQUANT_BACKEND", "xla")
  x = jnp.asarray(_matrix(rng, (32, 64), jnp.bfloat16, False))
  report = jq.explain(lambda x: jq.ops.quantize(x, QUANTIZERS["current_e4m3"]), x)
  assert report.paths("quantize") == {"xla-fused"}
  assert "JAXQUANT_BACKEND=xla" in str(report)
  if dispatch.ffi_module() is not None:  # the columnwise copy: the FFI byte transpose
    assert report.paths("transpose") == {dispatch.ffi_module().path_name()}


def test_forced_xla_backend_refuses_block_formats(monkeypatch, rng):
  monkeypatch.setenv("JAXQUANT_BACKEND", "xla")
  x = jnp.asarray(_matrix(rng, (32, 64), jnp.bfloat16, False))
  with pytest.raises(RuntimeError, match="JAXQUANT_BACKEND=xla, but the XLA-fused path cannot "
                                         "serve this quantize: no XLA-fused form for "
                                         "MXFP8Quantizer"):
    jax.eval_shape(lambda x: jq.ops.quantize(x, jq.MXFP8Quantizer()), x)


def test_auto_takes_xla_where_the_table_says_and_reports_why(monkeypatch, rng):
  monkeypatch.delenv("JAXQUANT_BACKEND", raising=False)
  monkeypatch.setattr(dispatch, "current_platform", lambda: "cuda")
  why = "measured faster here"
  monkeypatch.setitem(xla_quantize._AUTO, "cuda", {jq.Float8CurrentScalingQuantizer: why})
  x = jnp.asarray(_matrix(rng, (32, 64), jnp.bfloat16, False))
  q = QUANTIZERS["current_e4m3"]
  report = jq.explain(lambda x: jq.ops.quantize(x, q, columnwise=False), x)
  assert [(d.path, d.reason) for d in report] == [("xla-fused", why)]
  report = jq.explain(lambda x: jq.ops.quantize(x, jq.Float8BlockQuantizer()), x)
  assert "xla-fused" not in report.paths("quantize")


def test_auto_prefers_the_ffi_kernel_on_cuda_as_measured(monkeypatch):
  for q in (QUANTIZERS["current_e4m3"], QUANTIZERS["delayed_e4m3"]):
    assert xla_backend.auto_reason(q, "cuda") is None


def test_auto_keeps_the_ffi_kernel_on_cpu(monkeypatch, rng):
  monkeypatch.delenv("JAXQUANT_BACKEND", raising=False)
  x = jnp.asarray(_matrix(rng, (32, 64), jnp.bfloat16, False))
  report = jq.explain(lambda x: jq.ops.quantize(x, QUANTIZERS["current_e4m3"]), x)
  assert report.paths("quantize").isdisjoint({"xla-fused"})


def test_dense_step_on_xla_path_matches_reference(monkeypatch, rng):
  """A Dense forward + backward (current and delayed scaling) on the XLA-fused quantize gives
  the output, gradients and new state of the same step with the other quantize, bit for bit.
  The GEMMs must be the same implementation in both runs (FFI GEMMs agree with the reference
  only up to accumulation order), so the peer is the FFI path where it is built."""
  peer = "ffi" if dispatch.ffi_module() is not None else "reference"
  x = jnp.asarray(rng.standard_normal((48, 64)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((64, 32)) * 0.1, jnp.bfloat16)
  dy = jnp.asarray(rng.standard_normal((48, 32)), jnp.bfloat16)
  for recipe in (jq.Float8CurrentScaling(), jq.DelayedScaling(amax_history_len=4)):
    quantizers = jq.DenseQuantizers.from_recipe(recipe, "linear", "fc")
    states = quantizers.init_states()

    results = {}
    for backend in (peer, "xla"):
      monkeypatch.setenv("JAXQUANT_BACKEND", backend)

      def step(x, w, states):  # a new function per backend: jit traces it afresh
        y, vjp = jax.vjp(lambda x, w, s: jq.dense(x, w, None, quantizers, states=s), x, w,
                         states)
        return y, vjp(dy)

      with jq.explain_recording() as report:
        results[backend] = jax.jit(step)(x, w, states)
      assert ("xla-fused" in report.paths("quantize")) == (backend == "xla")
    assert_same_leaves(results[peer], results["xla"], type(recipe).__name__)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("first_scale", ["current", "one"])
def test_fresh_delayed_state_matches_reference(platform, first_scale, rng):
  """A state with no scale yet (first_scale="current": scale from this tensor's amax) or TE's
  scale 1 gives the reference's storages on the XLA-fused path too."""
  q = jq.Float8DelayedScalingQuantizer(amax_history_len=4, first_scale=first_scale)
  device = _device(platform)
  x = jax.device_put(_matrix(rng, (80, 96), jnp.bfloat16, False), device)
  with jax.default_device(device):
    ref, got = _both(x, jq.init_state(q), quantizer=q, rowwise=True, columnwise=True)
  assert_same_leaves(ref, got, f"fresh state, first_scale={first_scale}, {platform}")
