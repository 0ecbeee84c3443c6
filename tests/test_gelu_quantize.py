"""The gelu in Float8Block's fc2 input quantize (docs/design.md decision 62).

`Producer(approximate=True)` (act code 5): the CUDA kernels compute the gelu with the hardware's
exp2 and reciprocal approximations, so their codes are checked against float64 gelu quantized by
the reference (a tolerance class, as the GEMM epilogue's gelu); the CPU handler computes the
spec's gelu, bit for bit the reference composition. `LayerNormMLP` takes it for a Float8Block
1x128 fc2 input (`fuse_gemm_activation`), and `explain` says where it does not.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import jaxquant as jq
import jaxquant.flax as jf
from jaxquant.backends.ffi import fused as ffi_fused
from jaxquant.backends.ffi import registry
from jaxquant.backends.producers import Inputs, Producer
from jaxquant.backends.reference import fused as ref_fused
from jaxquant.backends.reference import ops as reference
from jaxquant.ops import fused as fused_ops

pytestmark = pytest.mark.skipif(not registry.extension_built(),
                                reason="jaxquant FFI extension not built")

GELU = Producer("activation", jnp.bfloat16, activation="gelu", approximate=True)
BLOCK = jq.Float8BlockQuantizer()


def _device(platform: str):
  if platform == "gpu" and jax.default_backend() != "gpu":
    pytest.skip("no GPU")
  return jax.devices(platform)[0]


def _h(rng, shape, special=False) -> np.ndarray:
  """fc1-like outputs: rows of different magnitudes (binades -3 .. 3), both signs."""
  h = rng.standard_normal(shape).astype(np.float32)
  h *= np.exp2(rng.integers(-3, 4, size=(shape[0], 1))).astype(np.float32)
  if special:
    h[0, :6] = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e30]
  return np.asarray(jnp.asarray(h, jnp.bfloat16))


def _gelu64(h: np.ndarray) -> np.ndarray:
  h = h.astype(np.float64)
  with np.errstate(over="ignore", invalid="ignore"):
    return 0.5 * h * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (h + 0.044715 * h**3)))


def _quantize(fn, h, device):
  with jax.default_device(device):
    out = jax.jit(fn)(jax.device_put(h, device))
  return jax.tree_util.tree_map(np.asarray, out)


def _ffi(h, producer=GELU):
  fused = ffi_fused.fused_quantize(producer, Inputs(h), BLOCK, rowwise=True, columnwise=True,
                                   orig_dtype=jnp.bfloat16)
  return fused.rowwise, fused.columnwise


def _codes(t) -> np.ndarray:
  return np.asarray(t.data).view(np.uint8)


def test_cpu_handler_is_the_spec_gelu_then_the_quantize(rng):
  """On the CPU, approximate changes nothing: the spec's gelu, then the quantize, bit for bit."""
  device = _device("cpu")
  h = _h(rng, (130, 256), special=True)
  exact = Producer("activation", jnp.bfloat16, activation="gelu")

  def ref(h):
    fused = ref_fused.fused_quantize(exact, Inputs(h), BLOCK, rowwise=True, columnwise=True,
                                     orig_dtype=jnp.bfloat16)
    return fused.rowwise, fused.columnwise

  want, got = _quantize(ref, h, device), _quantize(_ffi, h, device)
  for w, g in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got)):
    w, g = np.asarray(w), np.asarray(g)
    assert w.dtype == g.dtype and w.shape == g.shape
    same = w.view(f"u{w.dtype.itemsize}") == g.view(f"u{g.dtype.itemsize}")
    if w.dtype == np.float32:
      same |= np.isnan(w) & np.isnan(g)
    assert same.all(), f"{int((~same).sum())} of {same.size} differ"


# Whole tiles (the whole-tile kernel) and a shape with partial tiles (the general kernel, whose
# producer computes the same approximate gelu).
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1024, 1536), (384, 4096), (200, 384)])
def test_cuda_gelu_is_float64_gelu_within_fp8_rounding(rng, shape):
  """The codes and scales of the approximate gelu against float64 gelu, rounded to bfloat16 and
  quantized by the reference: the same block scales, codes equal but where the two bfloat16
  values round to neighbouring codes (at most one step, at most 1 in 10^3), and every value
  within FP8 rounding of float64 gelu."""
  h = _h(rng, shape, special=True)
  got = _quantize(_ffi, h, _device("gpu"))
  g64 = _gelu64(h)
  exact_bf16 = np.asarray(jnp.asarray(g64.astype(np.float32), jnp.bfloat16))
  want = _quantize(lambda a: reference.quantize_single(a, BLOCK, rowwise=True, columnwise=True,
                                                       orig_dtype=jnp.bfloat16),
                   exact_bf16, _device("cpu"))
  for direction, (g, w) in enumerate(zip(got, want)):
    g_scale, w_scale = np.asarray(g.scale_inv), np.asarray(w.scale_inv)
    np.testing.assert_array_equal(g_scale, w_scale, err_msg=f"direction {direction}: scales")
    gc, wc = _codes(g), _codes(w)
    differ = gc != wc
    assert differ.mean() <= 1e-3, f"direction {direction}: {differ.mean():.2e} of the codes differ"
    same_sign = (gc[differ] & 0x80) == (wc[differ] & 0x80)
    steps = np.abs((gc[differ] & 0x7F).astype(int) - (wc[differ] & 0x7F).astype(int))
    assert same_sign.all() and (steps <= 1).all(), f"direction {direction}: steps {steps.max()}"
  # Every dequantized rowwise value within FP8 rounding of float64 gelu: E4M3's half step
  # (2^-4 relative, 2^-10 of the block scale among subnormals) and bfloat16's (2^-9).
  rows = np.asarray(got[0].data).astype(np.float32).astype(np.float64)
  scale_inv = np.repeat(np.asarray(got[0].scale_inv, np.float64), 128, axis=1)[:, :shape[1]]
  values = rows * scale_inv
  finite = np.isfinite(g64) & (np.abs(g64) < 448 * scale_inv)
  err = np.abs(values - g64)[finite]
  bound = (2.0**-4 + 2.0**-8) * np.abs(g64[finite]) + 2.0**-10 * scale_inv[finite]
  assert (err <= bound).all(), f"worst {np.max(err / bound):.3f} of the bound"


def test_approximate_is_an_ungated_gelu_only():
  for kw in (dict(activation="silu"), dict(gated=True), dict()):
    kind = "activation_grad" if not kw else "activation"
    with pytest.raises(ValueError, match="approximate is an ungated gelu activation's"):
      Producer(kind, jnp.bfloat16, approximate=True, **kw)


# ------------------------------------------ layer ---------------------------------------------

def _records(module, x) -> dict:
  report = jq.explain(jax.grad(helpers.module_loss(module)),
                      jax.eval_shape(module.init, jax.random.key(0), x), x)
  return {d.detail: (d.path, d.reason) for d in report
          if "gelu in fc2's input quantize" in d.detail or "(approximate)" in d.detail}


def test_mlp_with_the_quantize_gelu_trains_like_the_unfused_mlp(rng):
  """`fuse_gemm_activation=True` with a Float8Block recipe (forced on the CPU, whose handler
  computes the spec's gelu): fc2's input comes from the fused gelu + quantize, fc1's gradient
  from `gelu_gradient`; same parameters, and values within FP8 rounding of the unfused MLP's."""
  x = jnp.asarray(rng.standard_normal((2, 64, 64)), jnp.bfloat16)  # 128 rows: whole tiles
  common = dict(recipe=jq.Float8BlockScaling(), dtype=jnp.bfloat16)
  fused = jf.LayerNormMLP(128, fuse_gemm_activation=True, **common)
  records = _records(fused, x)
  paths = [path for detail, (path, _) in records.items() if "(approximate)" in detail]
  assert len(paths) == 1 and paths[0] not in ("unfused", "reference"), records
  helpers.assert_trains_alike(
      helpers.module_grads(fused, x),
      helpers.module_grads(jf.LayerNormMLP(128, fuse_gemm_activation=False, **common), x))


def test_where_the_quantize_gelu_does_not_apply_explain_says_why(rng):
  block = jq.Float8BlockScaling()
  # Rows not a multiple of 128 (2 x 16 tokens): the whole-tile kernel cannot take fc1's output.
  x = jnp.asarray(rng.standard_normal((2, 16, 64)), jnp.bfloat16)
  got = _records(jf.LayerNormMLP(128, recipe=block, dtype=jnp.bfloat16,
                                 fuse_gemm_activation=True), x)
  assert got == {"gelu in fc2's input quantize": (
      "unfused", "the quantize kernel's gelu takes whole 128 x 128 tiles; fc1's output is "
      "32 x 128")}, got
  # float32 compute: the kernel reads bfloat16.
  x = jnp.asarray(rng.standard_normal((2, 64, 64)), jnp.float32)
  got = _records(jf.LayerNormMLP(128, recipe=block, fuse_gemm_activation=True), x)
  assert got["gelu in fc2's input quantize"][0] == "unfused"
  assert "reads bfloat16, not float32" in got["gelu in fc2's input quantize"][1]
  # The default module off CUDA: the automatic choice says why.
  x = x.astype(jnp.bfloat16)
  auto = fused_ops.auto_quantize_gelu_reason()
  got = _records(jf.LayerNormMLP(128, recipe=block, dtype=jnp.bfloat16), x)
  if auto is not None:
    assert got == {"gelu in fc2's input quantize": ("unfused", auto)}, got
  # A 128 x 128 fc2 input, or another activation: not a candidate, nothing said.
  recipe = jq.CustomRecipe(lambda role: jq.Float8BlockQuantizer(block=(128, 128)))
  assert _records(jf.LayerNormMLP(128, recipe=recipe, dtype=jnp.bfloat16), x) == {}
  assert _records(jf.LayerNormMLP(128, recipe=block, dtype=jnp.bfloat16,
                                  activations="silu"), x) == {}
