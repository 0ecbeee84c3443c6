"""`LayerNormDense` / `LayerNormMLP` with fused producers (`jaxquant.flax.fusion`).

The fused path (the normalization / activation kernels write the quantized copies) must keep the
unfused path's parameters and state exactly, compute the same function within the formats' own
noise (the fused values follow the spec's arithmetic instead of Flax's), differentiate through
every fusion, and say in `jaxquant.explain` which producers ran fused and why the others did not.
Random inputs come from the `rng` fixture (seed recorded); the FFI CPU handlers run where the
extension has the fused targets, else the reference composition (same bits).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
import jaxquant.flax as jf
from jaxquant.layers.dense import DenseQuantizers
from jaxquant.ops import fused as fused_ops

RECIPES = {
    "current": jq.Float8CurrentScaling(),
    "delayed": jq.DelayedScaling(),
    "mxfp8": jq.MXFP8BlockScaling(),
    "block": jq.Float8BlockScaling(),
}


def _x(rng, shape=(2, 64, 64), dtype=jnp.bfloat16):
  x = rng.standard_normal(shape).astype(np.float32) * 2 + rng.standard_normal((1, 1, shape[-1]))
  return jnp.asarray(x, dtype)


def _loss(module):
  def loss(variables, x):
    out = module.apply(variables, x, mutable=["_overwrite_with_gradient"])[0]
    out = out[0] if isinstance(out, tuple) else out
    return jnp.sum(jnp.square(out.astype(jnp.float32)))
  return loss


def _rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _apply(module, variables, x):
  """The forward outputs (delayed-scaling state updates dropped)."""
  return jax.jit(lambda v, x: module.apply(v, x, mutable=["_overwrite_with_gradient"])[0])(
      variables, x)


def _both(module_cls, rng, recipe, **kw):
  fused = module_cls(recipe=recipe, dtype=jnp.bfloat16, fuse_producers=True, **kw)
  unfused = module_cls(recipe=recipe, dtype=jnp.bfloat16, fuse_producers=False, **kw)
  x = _x(rng)
  variables = jax.jit(fused.init)(jax.random.key(0), x)
  return fused, unfused, variables, x


@pytest.mark.parametrize("module_cls,kw", [
    (jf.LayerNormDense, dict(features=96)),
    (jf.LayerNormDense, dict(features=(3, 32), norm_type="rmsnorm")),
    (jf.LayerNormMLP, dict(intermediate_dim=128)),
    (jf.LayerNormMLP, dict(intermediate_dim=128, activations="swiglu")),
])
def test_fused_and_unfused_modules_have_the_same_variables(module_cls, kw, rng):
  fused, unfused, variables, x = _both(module_cls, rng, RECIPES["delayed"], **kw)
  reference = jax.jit(unfused.init)(jax.random.key(0), x)
  assert jax.tree_util.tree_structure(variables) == jax.tree_util.tree_structure(reference)
  for a, b in zip(jax.tree_util.tree_leaves(variables), jax.tree_util.tree_leaves(reference)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm"])
def test_layernorm_dense_fused_matches_unfused_within_quantization_noise(name, norm_type, rng):
  fused, unfused, variables, x = _both(jf.LayerNormDense, rng, RECIPES[name], features=96,
                                       norm_type=norm_type, return_layernorm_output=True)
  y, ln = _apply(fused, variables, x)
  y0, ln0 = _apply(unfused, variables, x)
  assert ln.dtype == ln0.dtype and ln.shape == ln0.shape
  assert _rel(ln, ln0) < 2e-2  # bfloat16 outputs of two float32 normalizations
  assert _rel(y, y0) < 6e-2  # FP8 of (nearly) the same values
  g = jax.jit(jax.grad(_loss(fused)))(variables, x)
  g0 = jax.jit(jax.grad(_loss(unfused)))(variables, x)
  for path in (("params", "kernel"), ("params", "bias"), ("params", "scale")):
    a, b = g, g0
    for key in path:
      a, b = a[key], b[key]
    assert _rel(a, b) < 0.1, path


# Each activation under two recipes and each recipe under one or two activations (every pair
# took ~15 CPU-s more): the module hands the activation and the quantizer to the fused kernel
# independently (tests/test_fused_producers.py checks every activation and format bit for bit).
@pytest.mark.parametrize("activations,name", [("gelu", "current"), ("gelu", "block"),
                                              ("swiglu", "delayed"), ("swiglu", "mxfp8"),
                                              ("relu", "current"), ("relu", "delayed")])
def test_layernorm_mlp_fused_matches_unfused_within_quantization_noise(name, activations, rng):
  fused, unfused, variables, x = _both(jf.LayerNormMLP, rng, RECIPES[name], intermediate_dim=128,
                                       activations=activations)
  y, y0 = _apply(fused, variables, x), _apply(unfused, variables, x)
  assert _rel(y, y0) < 0.1
  g = jax.jit(jax.grad(_loss(fused)))(variables, x)
  g0 = jax.jit(jax.grad(_loss(unfused)))(variables, x)
  for layer in ("fc1", "fc2"):
    for leaf in ("kernel", "bias"):
      assert _rel(g["params"][layer][leaf], g0["params"][layer][leaf]) < 0.15, (layer, leaf)
  assert _rel(g["params"]["scale"], g0["params"]["scale"]) < 0.15


def test_delayed_scaling_states_follow_the_fused_outputs(rng):
  fused, unfused, variables, x = _both(jf.LayerNormMLP, rng, RECIPES["delayed"],
                                       intermediate_dim=128)
  g = jax.jit(jax.grad(_loss(fused)))(variables, x)["_overwrite_with_gradient"]
  g0 = jax.jit(jax.grad(_loss(unfused)))(variables, x)["_overwrite_with_gradient"]
  for layer in ("fc1", "fc2"):
    for role in ("input", "grad_output"):
      history = np.asarray(g[layer][f"{role}_amax_history"])
      history0 = np.asarray(g0[layer][f"{role}_amax_history"])
      # The step's amax sits at the end of the rolled history; both paths saw the same tensor
      # up to the fused producer's float32 rounding.
      assert history.max() > 0
      np.testing.assert_allclose(history, history0, rtol=0.05)
      assert np.asarray(g[layer][f"{role}_scale"]) > 0


REMAT_MLPS = {  # the fused producers; the gelu in fc1's GEMM epilogue (jaxquant.ops.gemm_gelu)
    "fused_swiglu": lambda: jf.LayerNormMLP(128, activations="swiglu", dtype=jnp.bfloat16,
                                            recipe=RECIPES["current"], fuse_producers=True),
    "gelu_epilogue": lambda: jf.LayerNormMLP(128, dtype=jnp.bfloat16, recipe=RECIPES["current"],
                                             fuse_gemm_activation=True),
}


@pytest.mark.parametrize("name", REMAT_MLPS)
def test_remat_recomputes_the_fused_mlp_bit_for_bit(rng, name):
  module = REMAT_MLPS[name]()
  x = _x(rng)
  variables = jax.jit(module.init)(jax.random.key(0), x)
  loss = _loss(module)
  g = jax.jit(jax.grad(loss))(variables, x)
  g_remat = jax.jit(jax.grad(jax.checkpoint(loss)))(variables, x)
  for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(g_remat)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------ explain -------------------------------------------

def _report(module, x):
  variables = jax.eval_shape(module.init, jax.random.key(0), x)
  return jq.explain(jax.grad(_loss(module)), variables, x)


def test_explain_names_the_fused_norm_and_activations(rng):
  report = _report(jf.LayerNormMLP(128, activations="swiglu", recipe=RECIPES["mxfp8"],
                                   fuse_producers=True), _x(rng))
  details = [d.detail for d in report if d.op == "quantize"]
  assert any(d.startswith("fused layernorm+quantize rowwise+columnwise: MXFP8") for d in details)
  assert any(d.startswith("fused activation silu gated+quantize") for d in details)
  assert any(d.startswith("fused activation grad silu gated+quantize") for d in details)
  assert not [d for d in report if d.op == "producer"], str(report)


def test_explain_says_why_nvfp4_is_not_fused(rng):
  nvfp4 = jq.CustomRecipe(lambda role: jq.NVFP4Quantizer())
  report = _report(jf.LayerNormDense(64, recipe=nvfp4, fuse_producers=True), _x(rng))
  unfused = [d for d in report if d.op == "producer"]
  assert len(unfused) == 1 and unfused[0].path == "unfused"
  assert unfused[0].detail == "layernorm, then quantize"
  assert "no fused kernel quantizes NVFP4Quantizer" in unfused[0].reason


def test_explain_says_why_an_activation_is_not_fused(rng):
  report = _report(jf.LayerNormMLP(128, activations="gelu_exact", recipe=RECIPES["current"],
                                   fuse_producers=True), _x(rng))
  unfused = {d.detail: d.reason for d in report if d.op == "producer"}
  assert set(unfused) == {"activation, then quantize", "activation gradient, then quantize"}
  assert all("'gelu_exact' has no fused kernel" in r for r in unfused.values())
  assert any(d.detail.startswith("fused layernorm+quantize") for d in report)


def test_fuse_producers_false_records_no_fusion(rng):
  report = _report(jf.LayerNormDense(64, recipe=RECIPES["current"], fuse_producers=False),
                   _x(rng))
  assert not [d for d in report if "fused" in d.detail or d.op == "producer"]


def test_identity_recipe_keeps_flax_arithmetic_and_records_nothing(rng):
  identity = jq.CustomRecipe(lambda role: jq.IdentityQuantizer())
  report = _report(jf.LayerNormMLP(128, recipe=identity, fuse_producers=True), _x(rng))
  assert not [d for d in report if d.op == "producer" or "fused" in d.detail]


def test_by_default_the_platform_decides(rng):
  """fuse_producers=None: as auto_fusion_reason says (unfused everywhere for now), and said."""
  report = _report(jf.LayerNormDense(64, recipe=RECIPES["current"]), _x(rng))
  reason = fused_ops.auto_fusion_reason()
  fused = [d for d in report if d.detail.startswith("fused layernorm")]
  if reason is None:
    assert fused
  else:
    assert not fused
    unfused = [d for d in report if d.op == "producer"]
    assert len(unfused) == 1 and unfused[0].reason == reason


def test_the_environment_switches_the_default(rng, monkeypatch):
  monkeypatch.setenv("JAXQUANT_FUSE_PRODUCERS", "off")
  report = _report(jf.LayerNormDense(64, recipe=RECIPES["current"]), _x(rng))
  assert [d.reason for d in report if d.op == "producer"] == ["JAXQUANT_FUSE_PRODUCERS=off"]
  monkeypatch.setenv("JAXQUANT_FUSE_PRODUCERS", "on")
  report = _report(jf.LayerNormDense(64, recipe=RECIPES["current"]), _x(rng))
  assert [d for d in report if d.detail.startswith("fused layernorm")]
  report = _report(jf.LayerNormDense(64, recipe=RECIPES["current"], fuse_producers=False),
                   _x(rng))
  assert not [d for d in report if "fused" in d.detail]  # the module's setting wins
  monkeypatch.setenv("JAXQUANT_FUSE_PRODUCERS", "norms")  # the normalizations alone
  report = _report(jf.LayerNormMLP(128, recipe=RECIPES["current"]), _x(rng))
  assert [d for d in report if d.detail.startswith("fused layernorm")]
  unfused = {d.detail: d.reason for d in report if d.op == "producer"}
  expected = {"gelu, then quantize": "JAXQUANT_FUSE_PRODUCERS=norms",
              "gelu gradient, then quantize": "JAXQUANT_FUSE_PRODUCERS=norms"}
  if fused_ops.auto_gemm_epilogue_reason() is not None:  # (CPU: the gelu stays out of the GEMM)
    expected["gelu in fc1's GEMM epilogue"] = fused_ops.auto_gemm_epilogue_reason()
  assert unfused == expected, str(report)
  report = _report(jf.LayerNormMLP(128, recipe=RECIPES["current"], fuse_producers=True), _x(rng))
  assert not [d for d in report if d.op == "producer"]  # the module's setting wins
  monkeypatch.setenv("JAXQUANT_FUSE_PRODUCERS", "sometimes")
  with pytest.raises(ValueError, match="JAXQUANT_FUSE_PRODUCERS='sometimes'"):
    _report(jf.LayerNormDense(64, recipe=RECIPES["current"]), _x(rng))


# ------------------------------------------- errors -------------------------------------------

def test_fused_norm_rejects_a_format_without_kernels(rng):
  x = _x(rng, (16, 64)).reshape(16, 64)
  with pytest.raises(ValueError, match="quantizer: no fused kernel quantizes NVFP4Quantizer"):
    fused_ops.norm_quantize(x, None, None, norm_type="layernorm", epsilon=1e-6,
                            out_dtype=jnp.bfloat16, quantizer=jq.NVFP4Quantizer())


def test_dense_rejects_x_quantized_of_another_quantizer(rng):
  x = _x(rng, (16, 64)).reshape(16, 64)
  kernel = jnp.ones((64, 32), jnp.bfloat16)
  quantizers = DenseQuantizers(jq.MXFP8Quantizer(), jq.MXFP8Quantizer(),
                                               jq.MXFP8Quantizer())
  other = jq.ops.quantize(x, jq.Float8CurrentScalingQuantizer())
  with pytest.raises(ValueError, match="x_quantized: quantized by Float8CurrentScaling"):
    jq.dense(x, kernel, None, quantizers, x_quantized=other)


# ---------------------------------- the fused norm's backward ---------------------------------

@pytest.mark.parametrize("norm_type,zero_centered", [("layernorm", False), ("layernorm", True),
                                                     ("rmsnorm", False)])
def test_fused_norm_gradients_are_the_norms_own(norm_type, zero_centered, rng):
  """`norm_quantized`'s backward (float32, from the saved statistics) against autodiff of the
  normalization written with jax.numpy (the spec's exact division and square root are integer
  code, which autodiff cannot see through), for x, the scale and the bias."""
  from jaxquant.layers.fused_norm import NormConfig, norm_quantized

  x = _x(rng, (4, 32, 96), jnp.float32)
  scale = jnp.asarray(rng.uniform(-0.5, 0.5, 96), jnp.float32)
  bias = jnp.asarray(rng.standard_normal(96), jnp.float32) if norm_type == "layernorm" else None
  dy = jnp.asarray(rng.standard_normal((4, 32, 96)), jnp.float32)
  config = NormConfig(norm_type, 1e-5, zero_centered, np.dtype(jnp.float32),
                      np.dtype(jnp.float32), jq.Float8CurrentScalingQuantizer(), write_y=True)

  def fused(x, scale, bias):
    return norm_quantized(x, scale, bias, None, config)[0]

  def plain(x, scale, bias):
    d = x - jnp.mean(x, -1, keepdims=True) if norm_type == "layernorm" else x
    y = d / jnp.sqrt(jnp.mean(jnp.square(d), -1, keepdims=True) + 1e-5)
    y = y * (scale + 1 if zero_centered else scale)
    return y if bias is None else y + bias

  args = (x, scale, bias)
  got_y, fused_vjp = jax.vjp(fused, *args)
  want_y, plain_vjp = jax.vjp(plain, *args)
  np.testing.assert_allclose(np.asarray(got_y), np.asarray(want_y), rtol=1e-5, atol=1e-5)
  for got, want in zip(fused_vjp(dy), plain_vjp(dy)):
    if want is None:
      continue
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
