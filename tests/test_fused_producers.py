"""The fused producer kernels against the reference composition, bit for bit.

Each case runs a producer (LayerNorm / RMSNorm statistics and output, an activation, an
activation gradient with its per-tile column sums) and the format's quantize through the FFI
targets (`jaxquant.backends.ffi.fused`) and through the reference composition (the spec's exact
arithmetic, rounded to the output dtype, then the reference quantize) in one jitted program, on
fresh random inputs (the `rng` fixture records its seed), over awkward shapes (rows not a
multiple of 16/32/128, columns not a multiple of 8, one row) and special values. The CPU handlers
run everywhere; the same tests run the CUDA kernels with `-m gpu` on a GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from jaxquant.backends.ffi import calls, registry
from jaxquant.backends.ffi import fused as ffi_fused
from jaxquant.backends.producers import Inputs, Producer
from jaxquant.backends.reference import fused as ref_fused
from jaxquant.numerics import activations as act

pytestmark = pytest.mark.skipif(
    not registry.extension_built() or "jaxquant_fused_quantize_fp8" not in
    registry.registered_targets("cpu"),
    reason="jaxquant FFI extension (with fused targets) not built")

PLATFORMS = ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)]

QUANTIZERS = {
    "fp8_current": jq.Float8CurrentScalingQuantizer(),
    "fp8_current_e5m2_pow2": jq.Float8CurrentScalingQuantizer(jnp.float8_e5m2, pow2_scale=True),
    "fp8_delayed": jq.Float8DelayedScalingQuantizer(amax_history_len=4),
    "fp8_delayed_first_step": jq.Float8DelayedScalingQuantizer(amax_history_len=4),
    "mxfp8": jq.MXFP8Quantizer(),
    "mxfp8_e5m2": jq.MXFP8Quantizer(jnp.float8_e5m2),
    "block_1x128": jq.Float8BlockQuantizer(),
    "block_128x128": jq.Float8BlockQuantizer(block=(128, 128)),
}

SHAPES = [(100, 72), (37, 33), (130, 257), (1, 8)]
# The GPU statistics kernel holds a row in registers when its 8-column chunks pad to 32, 64,
# 128, 256 or 512 (16-bit inputs): 136, 392, 520, 1536 and 2056 / 4096 columns take each.
GPU_SHAPES = [(1000, 1536), (4096, 520), (80, 4096), (257, 2056), (64, 136), (33, 392)]


def _device(platform: str):
  if platform == "gpu" and jax.default_backend() != "gpu":
    pytest.skip("no GPU")
  return jax.devices(platform)[0]


def _shapes(platform):
  # On the CPU (CI) the three with odd and partial tiles and one row (100 x 72 adds rows not a
  # multiple of 16/32/128, as 37 x 33 does: ~20 CPU-s over the formats).
  return SHAPES + GPU_SHAPES if platform == "gpu" else SHAPES[1:]


def _state(name, q, rng):
  if not isinstance(q, jq.Float8DelayedScalingQuantizer):
    return None
  if name.endswith("first_step"):
    return jq.init_state(q)  # scale 0: the kernels take the output's amax first
  return jq.init_state(q).__class__(jnp.asarray(np.float32(rng.uniform(0.5, 40.0))),
                                    jnp.zeros((q.amax_history_len,), jnp.float32))


def _matrix(rng, shape, dtype, special=False):
  x = rng.standard_normal(shape).astype(np.float32)
  x = x * np.exp2(rng.integers(-4, 5, size=(shape[0], 1))).astype(np.float32)
  x = x + rng.standard_normal((shape[0], 1)).astype(np.float32)  # rows with a mean
  if special and shape[0] > 3:
    x[1] = 0.0  # a constant row: variance 0
    x[2, 0] = np.inf  # a row with inf, a row with NaN
    x[3, -1] = np.nan
  return x.astype(dtype)


def _bits(a):
  a = np.asarray(a)
  return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(f"u{a.dtype.itemsize}")


def assert_bitwise(ref, got, what):
  """Same tree, dtypes and shapes; every byte equal (float NaNs: any NaN equals any NaN)."""
  lr, tr = jax.tree_util.tree_flatten(ref)
  lg, tg = jax.tree_util.tree_flatten(got)
  assert tr == tg, f"{what}: trees differ:\n{tr}\n{tg}"
  for i, (r, g) in enumerate(zip(lr, lg)):
    r, g = np.asarray(r), np.asarray(g)
    assert (r.dtype, r.shape) == (g.dtype, g.shape), (f"{what}: leaf {i} {g.dtype}{g.shape}, "
                                                      f"expected {r.dtype}{r.shape}")
    same = _bits(r) == _bits(g)
    if jnp.issubdtype(r.dtype, jnp.floating) and r.dtype.itemsize >= 2:
      same |= np.isnan(r.astype(np.float32)) & np.isnan(g.astype(np.float32))
    if not same.all():
      bad = np.argwhere(~same)
      first = tuple(bad[0])
      raise AssertionError(f"{what}: leaf {i} ({r.dtype}{r.shape}) differs at {len(bad)} "
                           f"places, first {first}: got {g[first]!r}, expected {r[first]!r}")


# ------------------------------------------ norms ---------------------------------------------

def _norm_both(x, scale, bias, state, *, producer, quantizer, rowwise, columnwise, write_y):
  out = []
  for impl in (ref_fused, ffi_fused):
    mode = {jq.Float8CurrentScalingQuantizer: 1}.get(type(quantizer), 0)
    gate = None
    if isinstance(quantizer, jq.Float8DelayedScalingQuantizer):
      mode, gate = 2, state.scale
    mean, rsigma, amax = impl.norm_stats(x, scale, bias, producer, amax=mode, gate=gate)
    fused = impl.fused_quantize(producer, Inputs(x, mean=mean, rsigma=rsigma, scale=scale,
                                                 bias=bias), quantizer, rowwise=rowwise,
                                columnwise=columnwise, orig_dtype=producer.out_dtype,
                                state=state, write_y=write_y, amax=amax)
    out.append((mean, rsigma, amax, fused.rowwise, fused.columnwise, fused.y))
  return out


_norm_jit = jax.jit(_norm_both, static_argnames=("producer", "quantizer", "rowwise",
                                                 "columnwise", "write_y"))


def check_norm(platform, rng, norm_type, name, shape, *, dtype=jnp.bfloat16, out_dtype=None,
               has_scale=True, has_bias=True, rowwise=True, columnwise=True, write_y=True,
               special=False, zero_centered=False):
  q = QUANTIZERS[name]
  device = _device(platform)
  x = _matrix(rng, shape, dtype, special)
  k = shape[1]
  scale = rng.uniform(0.5, 1.5, k).astype(np.float32) if has_scale else None
  if scale is not None and zero_centered:
    scale = np.float32(1.0) + (scale - np.float32(1.0))  # the module adds 1 before the call
  bias = rng.standard_normal(k).astype(np.float32) if has_bias else None
  producer = Producer(norm_type, out_dtype or dtype, epsilon=1e-5, has_scale=has_scale,
                      has_bias=has_bias and norm_type == "layernorm")
  if not producer.has_bias:
    bias = None
  put = lambda v: None if v is None else jax.device_put(v, device)
  with jax.default_device(device):
    ref, got = _norm_jit(put(x), put(scale), put(bias), _state(name, q, rng), producer=producer,
                         quantizer=q, rowwise=rowwise, columnwise=columnwise, write_y=write_y)
  assert_bitwise(ref, got, f"{norm_type} {name} {shape} {np.dtype(dtype).name} on {platform}")


# On the CPU (CI) RMSNorm takes the formats test_norm_one_direction_without_y_matches_reference
# does not: the norm's statistics do not depend on the format, and each format meets LayerNorm
# here (the GPU runs every pair).
RMSNORM_ON_CPU = ("fp8_delayed", "block_128x128")


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("name", QUANTIZERS)
@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm"])
def test_norm_quantize_matches_reference(platform, norm_type, name, rng):
  if platform == "cpu" and norm_type == "rmsnorm" and name not in RMSNORM_ON_CPU:
    pytest.skip(f"rmsnorm on the CPU takes {RMSNORM_ON_CPU} (the rest: layernorm, and rmsnorm "
                "in test_norm_one_direction_without_y_matches_reference)")
  for shape in _shapes(platform):
    check_norm(platform, rng, norm_type, name, shape)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype,out_dtype", [(jnp.float32, jnp.float32),
                                             (jnp.bfloat16, jnp.float32),
                                             (jnp.float16, jnp.float16)])
@pytest.mark.parametrize("name", ["fp8_current", "mxfp8", "block_1x128"])
def test_norm_quantize_dtypes_match_reference(platform, dtype, out_dtype, name, rng):
  for shape in [(64, 200)] + ([(1024, 1040)] if platform == "gpu" else []):
    check_norm(platform, rng, "layernorm", name, shape, dtype=dtype, out_dtype=out_dtype)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("has_scale,has_bias", [(False, False), (True, False), (False, True)])
def test_norm_without_scale_or_bias_matches_reference(platform, has_scale, has_bias, rng):
  check_norm(platform, rng, "layernorm", "fp8_delayed", (130, 96), has_scale=has_scale,
             has_bias=has_bias)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("direction", ["rowwise", "columnwise"])
@pytest.mark.parametrize("name", ["fp8_current", "mxfp8", "block_1x128"])
def test_norm_one_direction_without_y_matches_reference(platform, direction, name, rng):
  check_norm(platform, rng, "rmsnorm", name, (33, 130), rowwise=direction == "rowwise",
             columnwise=direction == "columnwise", write_y=False)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("name", ["fp8_current", "fp8_delayed", "mxfp8", "block_1x128"])
def test_norm_special_values_match_reference(platform, name, rng):
  check_norm(platform, rng, "layernorm", name, (100, 72), special=True)


# --------------------------------------- activations ------------------------------------------

def _act_both(h, dy, state, *, producer, quantizer, rowwise, columnwise):
  out = []
  inputs = Inputs(h) if producer.kind == "activation" else Inputs(dy, b=h)
  for impl in (ref_fused, ffi_fused):
    fused = impl.fused_quantize(producer, inputs, quantizer, rowwise=rowwise,
                                columnwise=columnwise, orig_dtype=producer.out_dtype,
                                state=state, col_sums=producer.kind == "activation_grad")
    out.append((fused.rowwise, fused.columnwise, fused.col_sums))
  return out


_act_jit = jax.jit(_act_both, static_argnames=("producer", "quantizer", "rowwise", "columnwise"))


def check_activation(platform, rng, kind, activation, gated, name, shape, *, dtype=jnp.bfloat16,
                     rowwise=True, columnwise=True):
  q = QUANTIZERS[name]
  device = _device(platform)
  rows, cols = shape
  h = _matrix(rng, (rows, 2 * cols if gated else cols), dtype) * np.asarray(3, dtype)
  dy = _matrix(rng, (rows, cols), dtype) if kind == "activation_grad" else None
  producer = Producer(kind, dtype, activation=activation, gated=gated)
  put = lambda v: None if v is None else jax.device_put(v, device)
  with jax.default_device(device):
    ref, got = _act_jit(put(h), put(dy), _state(name, q, rng), producer=producer, quantizer=q,
                        rowwise=rowwise, columnwise=columnwise)
  assert_bitwise(ref, got, f"{kind} {activation} gated={gated} {name} {shape} on {platform}")


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("activation", act.ACTIVATIONS)
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("kind", ["activation", "activation_grad"])
def test_activation_quantize_matches_reference(platform, kind, activation, gated, rng):
  # Each activation's arithmetic on one odd shape on the CPU (CI; 100 x 72 too took ~30 CPU-s);
  # test_activation_formats_match_reference takes other shapes (130 x 96, one row).
  shapes = [(37, 33)] if platform == "cpu" else [(100, 72), (37, 33), (1000, 1536), (130, 2056)]
  for shape in shapes:
    check_activation(platform, rng, kind, activation, gated, "fp8_delayed", shape)


# Quantizers that differ from another only in each element's arithmetic (E5M2, power-of-two
# scales), which the norm tests take with every format: on the CPU the activations take the
# others (~15 CPU-s less); the GPU takes every one.
ELEMENT_VARIANTS = ("fp8_current_e5m2_pow2", "mxfp8_e5m2")


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("name", QUANTIZERS)
@pytest.mark.parametrize("kind", ["activation", "activation_grad"])
def test_activation_formats_match_reference(platform, kind, name, rng):
  if platform == "cpu" and name in ELEMENT_VARIANTS:
    pytest.skip(f"{name}: another quantizer's layouts (its arithmetic: the norm tests)")
  for shape in [(130, 96), (1, 40)] + ([(4096, 520)] if platform == "gpu" else []):
    check_activation(platform, rng, kind, "gelu", True, name, shape)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_activation_input_dtypes_match_reference(platform, dtype, rng):
  for kind in ("activation", "activation_grad"):
    check_activation(platform, rng, kind, "silu", True, "mxfp8", (64, 200), dtype=dtype)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_activation_gradient_columnwise_only_keeps_column_sums(platform, rng):
  check_activation(platform, rng, "activation_grad", "gelu", False, "block_1x128", (300, 72),
                   rowwise=True, columnwise=False)


# ------------------------------------------ errors --------------------------------------------

def _raw_call(target, results, *operands, **attrs):
  return jax.jit(lambda *a: calls.targets.call(target, results, *a, **attrs))(*operands)


PRODUCER_ATTRS = dict(act=np.int32(0), out_type=np.int32(0), gated=False, has_scale=False,
                      has_bias=False)
F32 = lambda shape: jax.ShapeDtypeStruct(shape, np.float32)
P = lambda: jnp.zeros((), jnp.float32)


def test_gated_activation_with_odd_columns_is_an_error():
  h = jnp.ones((8, 7), jnp.bfloat16)
  results = [jax.ShapeDtypeStruct((8, 3), jnp.float8_e4m3fn), F32(())]
  with pytest.raises(Exception, match=r"jaxquant_fused_quantize_fp8: a gated activation's input "
                                      r"holds two halves \[h0 \| h1\]; got 7 columns"):
    _raw_call("jaxquant_fused_quantize_fp8", results, h, P(), P(), P(), P(), P(), P(),
              **dict(PRODUCER_ATTRS, gated=True), producer=np.int32(3), write_y=False,
              col_sums=False, rowwise=True, columnwise=False, delayed=False, pow2_scale=False,
              amax_epsilon=np.float32(0))


def test_activation_gradient_with_mismatched_h_is_an_error():
  dy = jnp.ones((8, 16), jnp.bfloat16)
  h = jnp.ones((8, 16), jnp.bfloat16)  # gated needs [8, 32]
  results = [jax.ShapeDtypeStruct((8, 32), jnp.float8_e4m3fn), F32(()), F32(())]
  with pytest.raises(Exception, match=r"h is bfloat16\(8, 16\); expected bfloat16\(8, 32\)"):
    _raw_call("jaxquant_fused_quantize_fp8", results, dy, h, P(), P(), P(), P(), P(),
              **dict(PRODUCER_ATTRS, gated=True), producer=np.int32(4), write_y=False,
              col_sums=False, rowwise=True, columnwise=False, delayed=True, pow2_scale=False,
              amax_epsilon=np.float32(0))


def test_norm_with_a_wrong_rsigma_is_an_error():
  x = jnp.ones((8, 16), jnp.bfloat16)
  results = [jax.ShapeDtypeStruct((8, 16), jnp.float8_e4m3fn), F32(())]
  with pytest.raises(Exception, match=r"rsigma is float32\(4,\); expected float32\(8,\)"):
    _raw_call("jaxquant_fused_quantize_fp8", results, x, P(), P(), jnp.ones((4,), jnp.float32),
              P(), P(), P(), **PRODUCER_ATTRS, producer=np.int32(2), write_y=False,
              col_sums=False, rowwise=True, columnwise=False, delayed=False, pow2_scale=False,
              amax_epsilon=np.float32(0))


def test_write_y_for_an_activation_is_an_error():
  h = jnp.ones((8, 16), jnp.bfloat16)
  results = [jax.ShapeDtypeStruct((8, 16), jnp.bfloat16),
             jax.ShapeDtypeStruct((8, 16), jnp.float8_e4m3fn), F32(())]
  with pytest.raises(Exception, match=r"write_y: only a normalization writes its "
                                      r"high-precision output"):
    _raw_call("jaxquant_fused_quantize_fp8", results, h, P(), P(), P(), P(), P(), P(),
              **PRODUCER_ATTRS, producer=np.int32(3), write_y=True, col_sums=False,
              rowwise=True, columnwise=False, delayed=False, pow2_scale=False,
              amax_epsilon=np.float32(0))


def test_unsupported_cases_are_named():
  h = jnp.ones((8, 16), jnp.bfloat16)
  nvfp4 = ffi_fused.unsupported(Producer("activation", jnp.bfloat16), Inputs(h),
                                jq.NVFP4Quantizer(), "cpu")
  assert "no fused kernel quantizes NVFP4Quantizer" in nvfp4
  cast = ffi_fused.unsupported(Producer("activation", jnp.float32), Inputs(h),
                               jq.MXFP8Quantizer(), "cpu")
  assert "an activation keeps its input's dtype" in cast
