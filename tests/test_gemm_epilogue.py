"""fc1's GEMM with the gelu in its epilogue: `jaxquant.ops.gemm_gelu` (target
jaxquant_gemm_fp8_gelu) and `LayerNormMLP(fuse_gemm_activation=...)`.

The op returns `(gelu(h), h)` with `h = a b^T + bias` computed in float32 and each output
rounded once to bfloat16. Checked:
  * on CPU (the target's handler) bit for bit against the same handler's plain float32 GEMM
    followed by the spec's gelu (`jaxquant.numerics.activations`), the composition the handler
    promises;
  * on a GPU (cuBLASLt's GELU_AUX_BIAS epilogue) against float64 math:
      |h - h64| <= tol_acc * (|A| @ |B|^T) + 4 * 2^-24 * (|A| @ |B|^T + |bias|) + ulp(h64)
      |a - a64| <= 1.13 * that + 2^-10 * |h64| + ulp(a64)
    with tol_acc = 2 K 2^-24 + 2^-9 (split accumulation, as tests/test_ffi_gemm.py states for
    cuBLASLt FP8), 1.13 the largest |gelu'|, and 2^-10 |h| for cuBLASLt's own tanh (its gelu is
    not the spec's arithmetic, only the same function);
  * in the layer: the epilogue path's loss and gradients against the unfused module's (FP8
    rounding of a slightly different `a`), what `jaxquant.explain` records, and where the
    epilogue does not apply, why.
Inputs are fresh random matrices from the seeded `rng` fixture.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
import jaxquant.flax as jf
import helpers
import oracle
from jaxquant import ops
from jaxquant.backends.ffi import gemm as ffi_gemm
from jaxquant.backends.ffi import targets
from jaxquant.layers.fused_activation import ActivationEpilogue, gelu_gradient
from jaxquant.numerics import activations
from jaxquant.ops import fused as fused_ops

M, N, K = 48, 64, 256
E4M3 = jq.Float8CurrentScalingQuantizer()
E5M2 = jq.Float8CurrentScalingQuantizer(jnp.float8_e5m2)


def _has_target(platform: str) -> bool:
  from jaxquant.backends.ffi import registry
  return ffi_gemm.GELU_TARGET in registry.registered_targets(platform)


def _cpu_or_skip():
  if jax.default_backend() != "cpu":
    pytest.skip("the CPU handler is exercised on CPU-only machines (CI)")
  if not _has_target("cpu"):
    pytest.skip("the jaxquant extension has no jaxquant_gemm_fp8_gelu target")


def _gpu_or_skip():
  if jax.default_backend() != "gpu":
    pytest.skip("no GPU")
  if not _has_target("cuda"):
    pytest.skip("the jaxquant extension has no CUDA jaxquant_gemm_fp8_gelu target")


def _operands(rng, quantizer_b=E4M3, bias=True, m=M, n=N, k=K):
  x = jnp.asarray(oracle.random_matrix(rng, (m, k), spread=False), jnp.bfloat16)
  w = jnp.asarray(oracle.random_matrix(rng, (n, k), spread=False) / np.sqrt(k), jnp.bfloat16)
  qa = ops.quantize(x, E4M3, columnwise=False).rowwise
  qb = ops.quantize(w, quantizer_b, columnwise=False).rowwise
  b = (jnp.asarray(rng.standard_normal(n), jnp.float32) * 0.5).astype(jnp.bfloat16)
  return qa, qb, (b if bias else None)


def _f64(x) -> np.ndarray:
  return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def _gelu64(h: np.ndarray) -> np.ndarray:
  return 0.5 * h * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (h + 0.044715 * h**3)))


def _ulp_bf16(v: np.ndarray) -> np.ndarray:
  return np.exp2(np.floor(np.log2(np.maximum(np.abs(v), 2.0**-126))) - 7)


# ------------------------------------------- CPU ----------------------------------------------

@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("b_format", ["e4m3", "e5m2"])
def test_cpu_handler_is_its_gemm_then_the_spec_gelu(rng, bias, b_format):
  _cpu_or_skip()
  a, b, bvec = _operands(rng, E4M3 if b_format == "e4m3" else E5M2, bias)
  act, h = jax.jit(lambda a, b, c: ops.gemm_gelu(a, b, bias=c))(a, b, bvec)
  h32 = jax.jit(lambda a, b, c: ops.gemm(a, b, out_dtype=jnp.float32, bias=c))(a, b, bvec)
  assert act.dtype == h.dtype == jnp.bfloat16 and act.shape == h.shape == (M, N)
  np.testing.assert_array_equal(np.asarray(h), np.asarray(h32.astype(jnp.bfloat16)))
  want = activations.activation("gelu", h32).astype(jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(act), np.asarray(want))
  assert np.abs(_f64(act)).max() > 0  # a real activation, not zeros


def test_explain_names_the_path_and_why_a_pair_is_not_served(rng):
  _cpu_or_skip()
  a, b, bias = _operands(rng)
  report = jq.explain(lambda: ops.gemm_gelu(a, b, bias=bias, role="linear/fc1/fprop"))
  assert [(d.op, d.path) for d in report] == [("gemm", "ffi-cpu gemm-fp8-gelu")]
  mx = ops.quantize(jnp.asarray(oracle.random_matrix(rng, (N, K)), jnp.bfloat16),
                    jq.MXFP8Quantizer(), columnwise=False).rowwise
  reason = ops.gemm_gelu_unsupported(a, mx, out_dtype=jnp.bfloat16)
  assert "cublaslt-fp8 path" in reason
  report = jq.explain(lambda: ops.gemm_gelu(a, mx))
  assert report[0].path == "reference" and "cublaslt-fp8 path" in report[0].reason
  assert "bfloat16 outputs" in ops.gemm_gelu_unsupported(a, b, out_dtype=jnp.float32)
  assert "bfloat16 bias" in ops.gemm_gelu_unsupported(a, b, out_dtype=jnp.bfloat16,
                                                      bias=bias.astype(jnp.float32))


def test_reference_path_is_float32_h_then_the_spec_gelu(rng, monkeypatch):
  a, b, bias = _operands(rng)
  monkeypatch.setenv("JAXQUANT_BACKEND", "reference")
  act, h = ops.gemm_gelu(a, b, bias=bias)
  h64 = _f64(a.dequantize()) @ _f64(b.dequantize()).T + _f64(bias)
  tol_h = 2 * K * 2.0**-24 * (np.abs(_f64(a.dequantize())) @ np.abs(_f64(b.dequantize())).T)
  assert np.all(np.abs(_f64(h) - h64) <= tol_h + _ulp_bf16(h64))
  # The spec's gelu is within a few float32 ulps of the float64 tanh formula.
  assert np.all(np.abs(_f64(act) - _gelu64(h64)) <= 1.13 * (tol_h + 2.0**-20 * np.abs(h64))
                + _ulp_bf16(_gelu64(h64)) + 1e-30)


def test_bad_arguments_name_what_is_wrong(rng):
  a, b, bias = _operands(rng)
  with pytest.raises(ValueError, match=r"bias: expected shape \(64,\)"):
    ops.gemm_gelu(a, b, bias=bias[:32])
  short = ops.quantize(jnp.ones((N, 128), jnp.bfloat16), E4M3, columnwise=False).rowwise
  with pytest.raises(ValueError, match="contraction lengths differ"):
    ops.gemm_gelu(a, short)
  with pytest.raises(ValueError, match="in_gemm: the GEMM's epilogue applies gelu"):
    ActivationEpilogue("silu", in_gemm=True)


def test_the_target_rejects_block_scales_and_a_mismatched_aux(rng):
  _cpu_or_skip()
  a, b, bias = _operands(rng)
  results = [jax.ShapeDtypeStruct((M, N), jnp.bfloat16)] * 2 + [
      jax.ShapeDtypeStruct((0,), jnp.uint8)]
  args = (a.data, a.scale_inv, b.data, b.scale_inv, bias)
  with pytest.raises(Exception, match="jaxquant_gemm_fp8_gelu.*per-tensor scales only"):
    jax.block_until_ready(targets.call(ffi_gemm.GELU_TARGET, results, *args,
                                       a_scale_mode=np.int64(1), b_scale_mode=np.int64(1),
                                       fast_accum=False))
  bad = [results[0], jax.ShapeDtypeStruct((M, N), jnp.float32), results[2]]
  with pytest.raises(Exception, match="aux is float32.*expected out's dtype and shape"):
    jax.block_until_ready(targets.call(ffi_gemm.GELU_TARGET, bad, *args,
                                       a_scale_mode=np.int64(0), b_scale_mode=np.int64(0),
                                       fast_accum=False))


# ------------------------------------------- GPU ----------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("shape", [(M, N, K), (384, 512, 1024)], ids=["small", "larger"])
def test_cublaslt_epilogue_against_float64(rng, bias, shape):
  _gpu_or_skip()
  m, n, k = shape
  a, b, bvec = _operands(rng, bias=bias, m=m, n=n, k=k)
  path = jq.explain(lambda: ops.gemm_gelu(a, b, bias=bvec))[0].path
  assert path == "cublaslt-fp8-gelu"
  act, h = jax.jit(lambda a, b, c: ops.gemm_gelu(a, b, bias=c))(a, b, bvec)
  A, B = _f64(a.dequantize()), _f64(b.dequantize())
  h64 = A @ B.T + (0.0 if bvec is None else _f64(bvec))
  mag = np.abs(A) @ np.abs(B).T
  bias_mag = 0.0 if bvec is None else np.abs(_f64(bvec))
  tol_h = (2 * k * 2.0**-24 + 2.0**-9) * mag + 4 * 2.0**-24 * (mag + bias_mag)
  err_h = np.abs(_f64(h) - h64)
  assert np.all(err_h <= tol_h + _ulp_bf16(h64)), float(np.max(err_h / (tol_h + _ulp_bf16(h64))))
  a64 = _gelu64(h64)
  tol_a = 1.13 * tol_h + 2.0**-10 * np.abs(h64) + _ulp_bf16(a64) + 1e-30
  err_a = np.abs(_f64(act) - a64)
  assert np.all(err_a <= tol_a), float(np.max(err_a / tol_a))
  assert np.abs(_f64(act)).max() > 0


# ------------------------------------------ layer ---------------------------------------------

def _x(rng, shape=(2, 16, 64)):
  return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)


_loss, _grads = helpers.module_loss, helpers.module_grads


@pytest.mark.parametrize("recipe", [jq.Float8CurrentScaling(), jq.DelayedScaling()],
                         ids=["current", "delayed"])
def test_mlp_with_the_epilogue_trains_like_the_unfused_mlp(rng, recipe):
  if not (_has_target("cpu") or _has_target("cuda")):
    pytest.skip("the jaxquant extension has no jaxquant_gemm_fp8_gelu target")
  x = _x(rng)
  common = dict(recipe=recipe, dtype=jnp.bfloat16)
  fused = jf.LayerNormMLP(128, fuse_gemm_activation=True, **common)
  report = jq.explain(jax.grad(_loss(fused)), jax.eval_shape(fused.init, jax.random.key(0), x),
                      x)
  assert [d.path for d in report if d.detail.endswith("gelu epilogue")] in (
      ["ffi-cpu gemm-fp8-gelu"], ["cublaslt-fp8-gelu"])
  # Same parameters and variables; values within FP8 rounding of the unfused module's (the
  # epilogue rounds gelu(h) from float32 h, the unfused gelu reads h rounded to bfloat16, and
  # fc2's FP8 quantization can round the two to neighbouring codes).
  helpers.assert_trains_alike(
      _grads(fused, x), _grads(jf.LayerNormMLP(128, fuse_gemm_activation=False, **common), x))


def _gemm_record(module, x):
  report = jq.explain(jax.grad(_loss(module)), jax.eval_shape(module.init, jax.random.key(0), x),
                      x)
  return {d.detail: (d.path, d.reason) for d in report
          if "GEMM epilogue" in d.detail or d.detail.endswith("gelu epilogue")}


def test_where_the_epilogue_does_not_apply_explain_says_why(rng):
  x = _x(rng)
  current = jq.Float8CurrentScaling()
  # A candidate (gelu, per-tensor FP8) kept apart by the module: said.
  got = _gemm_record(jf.LayerNormMLP(128, recipe=current, dtype=jnp.bfloat16), x)
  auto = fused_ops.auto_gemm_epilogue_reason()
  if auto is not None:
    assert got == {"gelu in fc1's GEMM epilogue": ("unfused", auto)}
  # The forward activation fused into fc2's quantize instead (fuse_producers=True).
  got = _gemm_record(jf.LayerNormMLP(128, recipe=current, dtype=jnp.bfloat16,
                                     fuse_producers=True, fuse_gemm_activation=True), x)
  assert got == {}
  # Asked for where it cannot apply: said why.
  for kw, why in ((dict(activations="swiglu", recipe=current), "gelu (the tanh approximation)"),
                  (dict(activations="gelu_exact", recipe=current), "gelu (the tanh approximation)"),
                  (dict(recipe=jq.MXFP8BlockScaling()), "per-tensor FP8 GEMM's")):
    got = _gemm_record(jf.LayerNormMLP(128, fuse_gemm_activation=True, **kw), x)
    assert list(got) == ["gelu in fc1's GEMM epilogue"], got
    assert got["gelu in fc1's GEMM epilogue"][0] == "unfused" and why in str(got)
  # Neither asked for nor a candidate: nothing to say.
  assert _gemm_record(jf.LayerNormMLP(128, activations="swiglu", recipe=current), x) == {}


def test_fuse_gemm_activation_false_wins_over_the_environment(rng, monkeypatch):
  """`JAXQUANT_GEMM_EPILOGUE=on` turns the epilogue on for the default module; a module's
  `fuse_gemm_activation=False` keeps the unfused arithmetic bit for bit (the default module
  with the switch off), and the epilogue's result differs from it."""
  if not (_has_target("cpu") or _has_target("cuda")):
    pytest.skip("the jaxquant extension has no jaxquant_gemm_fp8_gelu target")
  x = _x(rng)
  common = dict(recipe=jq.Float8CurrentScaling(), dtype=jnp.bfloat16)
  monkeypatch.setenv("JAXQUANT_GEMM_EPILOGUE", "off")
  plain = _grads(jf.LayerNormMLP(128, **common), x)
  monkeypatch.setenv("JAXQUANT_GEMM_EPILOGUE", "on")
  off = _grads(jf.LayerNormMLP(128, fuse_gemm_activation=False, **common), x)
  on = _grads(jf.LayerNormMLP(128, **common), x)
  for a, b in zip(jax.tree_util.tree_leaves(off), jax.tree_util.tree_leaves(plain)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert any(not np.array_equal(np.asarray(a), np.asarray(b))
             for a, b in zip(jax.tree_util.tree_leaves(on), jax.tree_util.tree_leaves(plain)))

def test_gemm_epilogue_setting_is_checked(monkeypatch, rng):
  monkeypatch.setenv("JAXQUANT_GEMM_EPILOGUE", "off")
  assert fused_ops.auto_gemm_epilogue_reason() == "JAXQUANT_GEMM_EPILOGUE=off"
  monkeypatch.setenv("JAXQUANT_GEMM_EPILOGUE", "on")
  assert fused_ops.auto_gemm_epilogue_reason() is None
  monkeypatch.setenv("JAXQUANT_GEMM_EPILOGUE", "always")
  with pytest.raises(ValueError, match="JAXQUANT_GEMM_EPILOGUE='always'"):
    fused_ops.auto_gemm_epilogue_reason()


def test_a_pair_the_epilogue_cannot_serve_takes_the_unfused_arithmetic_visibly(rng):
  """float32 compute (`dtype=None`): the GEMM writes float32, which the epilogue does not; fc1
  then runs its plain GEMM and JAX's gelu, said in `explain`, with the unfused module's values
  and gradients."""
  if not (_has_target("cpu") or _has_target("cuda")):
    pytest.skip("the jaxquant extension has no jaxquant_gemm_fp8_gelu target")
  x = _x(rng).astype(jnp.float32)
  common = dict(recipe=jq.Float8CurrentScaling())
  asked = jf.LayerNormMLP(128, fuse_gemm_activation=True, **common)
  got = _gemm_record(asked, x)
  assert list(got) == ["gelu in fc1's GEMM epilogue"], got
  path, reason = got["gelu in fc1's GEMM epilogue"]
  assert path == "unfused" and "bfloat16 outputs" in reason
  (loss, grads), (loss0, grads0) = (_grads(asked, x), _grads(
      jf.LayerNormMLP(128, fuse_gemm_activation=False, **common), x))
  np.testing.assert_allclose(float(loss), float(loss0), rtol=1e-6)
  for a, b in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(grads0)):
    np.testing.assert_allclose(_f64(a), _f64(b), rtol=1e-5, atol=1e-7)


# ------------------------------------- the gelu gradient ---------------------------------------

def test_gelu_gradient_against_float64(rng):
  """`gelu_gradient` (the epilogue's backward) is da * gelu'(h) rounded once to bfloat16 from
  float32 arithmetic: within 2^-7 * 1.13 |da| of float64 math (1.13 the largest |gelu'|), over
  h in [-8, 8] where gelu' moves most and its tails."""
  h = jnp.asarray(rng.standard_normal((64, 96)) * 3, jnp.bfloat16)
  da = jnp.asarray(rng.standard_normal((64, 96)), jnp.bfloat16)
  got = _f64(jax.jit(gelu_gradient)(da, h))
  x, g = _f64(h), _f64(da)
  c, k = np.sqrt(2 / np.pi), 0.044715
  t = np.tanh(c * (x + k * x**3))
  want = g * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * k * x * x))
  assert np.all(np.abs(got - want) <= 2.0**-7 * 1.13 * np.abs(g) + 1e-30)
  assert jax.jit(gelu_gradient)(da, h).dtype == jnp.bfloat16


@pytest.mark.parametrize("dbias", [True, False])
def test_the_epilogue_backward_is_gelu_gradient_then_the_quantize(rng, dbias):
  """`ActivationEpilogue(in_gemm=True, fused_gradient=False).gradient`: `gelu_gradient`, then
  the quantizer's pass, and the bias gradient reduced over the rows in dh's dtype, bit for bit."""
  h = jnp.asarray(rng.standard_normal((2, 24, 64)) * 2, jnp.bfloat16)
  da = jnp.asarray(rng.standard_normal((2, 24, 64)), jnp.bfloat16)
  epilogue = ActivationEpilogue("gelu", in_gemm=True, fused_gradient=False)
  qdh, db = jax.jit(lambda a, b: epilogue.gradient((a, None), b, E4M3, None, rowwise=True,
                                                   columnwise=True, dbias=dbias))(da, h)
  # (both under jit: XLA's CPU fusions may contract the float32 arithmetic differently eagerly)
  want = jax.jit(lambda a, b: ops.quantize(gelu_gradient(a, b).reshape(-1, 64), E4M3,
                                           rowwise=True, columnwise=True))(da, h)
  for got_leaf, want_leaf in zip(jax.tree_util.tree_leaves(qdh), jax.tree_util.tree_leaves(want)):
    np.testing.assert_array_equal(np.asarray(got_leaf), np.asarray(want_leaf))
  if dbias:
    want_db = jax.jit(lambda a, b: jax.lax.reduce(gelu_gradient(a, b), jnp.zeros((), b.dtype),
                                                  jax.lax.add, (0, 1)).astype(jnp.float32))(da, h)
    np.testing.assert_array_equal(np.asarray(db), np.asarray(want_db))
  else:
    assert db is None
