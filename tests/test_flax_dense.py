"""`jaxquant.flax.Dense` / `DenseGeneral`: drop-in equality with Flax, hybrid per-direction
semantics, what the forward saves for the backward, recipe resolution and bad input.

Equality with Flax is bit-for-bit under `jax.jit` (how modules run): eagerly, every primitive is
compiled on its own and XLA:CPU may pick another dot kernel for a transposed operand.
"""

from __future__ import annotations

import flax.linen as nn
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals

import jaxquant as jq
import jaxquant.flax as jf
from jaxquant.layers.dense import RESIDUAL_NAMES

IDENTITY = jq.CustomRecipe(lambda role: jq.IdentityQuantizer())
FP8 = jq.Float8CurrentScalingQuantizer()  # E4M3, per-tensor current scaling


def _array(rng, shape, dtype=jnp.float32):
  return jnp.asarray(rng.standard_normal(shape), dtype)


def _assert_bitwise_equal(a, b):
  leaves_a, tree_a = jax.tree_util.tree_flatten(a)
  leaves_b, tree_b = jax.tree_util.tree_flatten(b)
  assert tree_a == tree_b
  for u, v in zip(leaves_a, leaves_b):
    assert u.dtype == v.dtype and u.shape == v.shape
    np.testing.assert_array_equal(np.asarray(u).view(np.uint8), np.asarray(v).view(np.uint8))


def _value_and_grads(module, variables, x, c, rngs=None):
  """Jitted `y = module(x)` and the gradients of `sum(y * c)` w.r.t. variables and x."""

  def loss(v, x):
    return jnp.sum(module.apply(v, x, rngs=rngs) * c)

  y = jax.jit(lambda v, x: module.apply(v, x, rngs=rngs))(variables, x)
  return y, jax.jit(jax.grad(loss, argnums=(0, 1)))(variables, x)


# ---------------------------------------------------------------------------------------------
# Drop-in equality with flax.linen


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("recipe", [None, IDENTITY], ids=["no_recipe", "identity_recipe"])
def test_dense_equals_flax_dense_bitwise(rng, recipe, dtype):
  x = _array(rng, (3, 8, 24), dtype)
  c = _array(rng, (3, 8, 16), dtype)
  ref, ours = nn.Dense(16, dtype=dtype), jf.Dense(16, dtype=dtype, recipe=recipe)
  variables = jax.jit(ref.init)(jax.random.key(1), x)
  _assert_bitwise_equal(_value_and_grads(ours, variables, x, c),
                        _value_and_grads(ref, variables, x, c))


DENSE_GENERAL_CONFIGS = [
    ((4, 6, 8), dict(features=5)),
    ((3, 4, 8), dict(features=5, axis=0)),
    ((2, 6, 8), dict(features=5, batch_dims=(0,))),
    ((2, 3, 6, 8), dict(features=5, axis=-1, batch_dims=(0, 1))),
    ((4, 6, 8), dict(features=(3, 5), axis=(1, -1))),
    ((2, 6, 8), dict(features=(2, 4), batch_dims=(0,))),
    ((2, 3, 6, 8), dict(features=5, axis=(2, 3), batch_dims=(0,))),
    ((2, 6, 3, 8), dict(features=5, axis=(-2, -1), batch_dims=(0,))),
]
# A float32 cast of float32 operands quantizes nothing, but is not the all-Identity recipe: the
# contraction runs through `jaxquant.dense`'s TN layout and custom backward.
CAST_F32 = jq.CustomRecipe(lambda role: jq.IdentityQuantizer(jnp.float32))


def _config_id(config):
  shape, kwargs = config
  return f"{shape}-" + ",".join(f"{k}={v}" for k, v in kwargs.items())


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("config", DENSE_GENERAL_CONFIGS, ids=_config_id)
def test_dense_general_identity_equals_flax_dense_general_bitwise(rng, config, dtype):
  """An all-Identity recipe runs Flax's own `dot_general`, differentiated by JAX: values and
  gradients bit for bit, whatever kernel XLA:CPU picks for a batched multi-axis dot."""
  shape, kwargs = config
  x = _array(rng, shape, dtype)
  ref = nn.DenseGeneral(**kwargs, dtype=dtype)
  ours = jf.DenseGeneral(**kwargs, dtype=dtype, recipe=IDENTITY)
  variables = jax.jit(ref.init)(jax.random.key(1), x)
  c = _array(rng, jax.eval_shape(ref.apply, variables, x).shape, dtype)
  _assert_bitwise_equal(_value_and_grads(ours, variables, x, c),
                        _value_and_grads(ref, variables, x, c))
  report = jq.explain(ours.apply, variables, x)
  assert [(d.op, d.path) for d in report] == [("quantize", "high-precision")] * 3 + [
      ("gemm", "high-precision")]


@pytest.mark.parametrize("config", DENSE_GENERAL_CONFIGS, ids=_config_id)
def test_dense_general_tn_contraction_matches_flax_up_to_summation_order(rng, config):
  """The TN layout and custom backward of `jaxquant.dense` (here with operands that a float32
  cast leaves unchanged) against Flax: values bitwise; gradients within the float32 bound of
  two summation orders (XLA:CPU gives Flax's batched multi-axis dot and its autodiff other
  kernels than our flattened GEMMs for some configs): each sum of n products is within
  gamma_n * sum|a*b| of the exact one (Higham, gamma_n = n*eps/(1-n*eps)), so two of them differ
  by at most 2 * gamma_n * sum|a*b|, n being the contraction length."""
  shape, kwargs = config
  x = _array(rng, shape)
  ref, ours = nn.DenseGeneral(**kwargs), jf.DenseGeneral(**kwargs, recipe=CAST_F32)
  variables = jax.jit(ref.init)(jax.random.key(1), x)
  c = _array(rng, jax.eval_shape(ref.apply, variables, x).shape)
  (y_ours, (gv_ours, gx_ours)) = _value_and_grads(ours, variables, x, c)
  (y_ref, (gv_ref, gx_ref)) = _value_and_grads(ref, variables, x, c)
  assert {d.op for d in jq.explain(ours.apply, variables, x)} == {"quantize", "gemm"}
  _assert_bitwise_equal(y_ours, y_ref)
  _assert_bitwise_equal(gv_ours["params"]["bias"], gv_ref["params"]["bias"])
  # the same gradients from |c| and |x|, |W|: sum|a*b| of every output element
  abs_ref = nn.DenseGeneral(**kwargs, use_bias=False)
  abs_vars = {"params": {"kernel": jnp.abs(variables["params"]["kernel"])}}
  abs_gv, abs_gx = jax.jit(jax.grad(lambda v, x: jnp.sum(abs_ref.apply(v, x) * jnp.abs(c)),
                                    argnums=(0, 1)))(abs_vars, jnp.abs(x))
  eps = np.finfo(np.float32).eps
  n = c.size  # no contraction (over rows for dW, over features for dx) is longer
  for got, want, magnitude in ((gv_ours["params"]["kernel"], gv_ref["params"]["kernel"],
                                abs_gv["params"]["kernel"]), (gx_ours, gx_ref, abs_gx)):
    bound = 2 * n * eps / (1 - n * eps) * np.asarray(magnitude, np.float64)
    assert np.all(np.abs(np.asarray(got, np.float64) - np.asarray(want)) <= bound)


@pytest.mark.parametrize("config", [((3, 24), ("Dense", dict(features=16)))]
                         + [(s, ("DenseGeneral", k)) for s, k in DENSE_GENERAL_CONFIGS[1:4]],
                         ids=lambda c: f"{c[1][0]}-{c[0]}-{c[1][1]}")
def test_checkpoint_loads_into_either_module(rng, config):
  shape, (kind, kwargs) = config
  x = _array(rng, shape)
  ref, ours = getattr(nn, kind)(**kwargs), getattr(jf, kind)(**kwargs)
  ref_vars = jax.jit(ref.init)(jax.random.key(7), x)
  our_vars = jax.jit(ours.init)(jax.random.key(7), x)
  _assert_bitwise_equal(ref_vars, our_vars)  # same tree, shapes and initial values
  # a serialized checkpoint of either restores into the other's variables
  restored = flax.serialization.from_bytes(our_vars, flax.serialization.to_bytes(ref_vars))
  _assert_bitwise_equal(restored, ref_vars)
  restored = flax.serialization.from_bytes(ref_vars, flax.serialization.to_bytes(our_vars))
  _assert_bitwise_equal(restored, our_vars)
  _assert_bitwise_equal(jax.jit(ours.apply)(ref_vars, x), jax.jit(ref.apply)(our_vars, x))


# ---------------------------------------------------------------------------------------------
# Hybrid per-direction semantics


def _hybrid_forward_only(role):
  if role is not None and role.tensor_type == "grad_output":
    return jq.IdentityQuantizer()
  return jq.HybridQuantizer(rowwise=FP8, columnwise=jq.IdentityQuantizer())


def test_hybrid_fp8_forward_identity_backward(rng):
  """FP8 rowwise for x and W, Identity columnwise and Identity dy: y is the FP8 GEMM, while dx
  and dW are exactly the unquantized gradients."""
  x, c = _array(rng, (32, 64)), _array(rng, (32, 48))
  ours = jf.Dense(48, recipe=jq.CustomRecipe(_hybrid_forward_only))
  variables = jax.jit(nn.Dense(48).init)(jax.random.key(3), x)
  y, (gv, gx) = _value_and_grads(ours, variables, x, c)
  _, (gv_ref, gx_ref) = _value_and_grads(nn.Dense(48), variables, x, c)
  _assert_bitwise_equal((gv, gx), (gv_ref, gx_ref))

  @jax.jit
  def fp8_reference(x, kernel, bias):
    qx = jq.ops.quantize(x, FP8, columnwise=False)
    qw = jq.ops.quantize(kernel.T, FP8, columnwise=False)
    return jq.ops.gemm(qx.rowwise, qw.rowwise, out_dtype=jnp.float32, bias=bias)

  params = variables["params"]
  _assert_bitwise_equal(y, fp8_reference(x, params["kernel"], params["bias"]))
  unquantized = jax.jit(nn.Dense(48).apply)(variables, x)
  assert not np.array_equal(np.asarray(y), np.asarray(unquantized))  # FP8 did happen


# ---------------------------------------------------------------------------------------------
# Residuals: what the forward keeps for the backward


def _residuals(fn, *args):
  return [(aval, str(description)) for aval, description in saved_residuals(fn, *args)]


def _fp8_dense_setup(rng, m=32, k=64, n=48):
  x = _array(rng, (m, k))
  module = jf.Dense(n, recipe=jq.Float8CurrentScaling())
  return module, jax.jit(module.init)(jax.random.key(0), x), x


def test_fp8_residuals_are_the_quantized_columnwise_operands(rng):
  module, variables, x = _fp8_dense_setup(rng)
  residuals = _residuals(module.apply, variables, x)
  tensors = sorted((aval.shape, str(aval.dtype)) for aval, _ in residuals if aval.size > 1)
  # x^T [K, M] and W [K, N] in E4M3, carried as their bytes (uint8: a saved float8 residual
  # would pass through JAX remat's reduce_precision, see jaxquant/layers/operands.py): no
  # float32 copy of x or W, nothing else of size > 1
  assert tensors == [((64, 32), "uint8"), ((64, 48), "uint8")]
  for aval, description in residuals:
    assert aval.size == 1 or any(name in description for name in RESIDUAL_NAMES)


def test_frozen_input_saves_no_weight_columnwise_copy(rng):
  module, variables, x = _fp8_dense_setup(rng)
  residuals = _residuals(lambda v: module.apply(v, x), variables)
  assert not any(RESIDUAL_NAMES[1] in d for _, d in residuals)
  tensors = [(aval.shape, str(aval.dtype)) for aval, _ in residuals if aval.size > 1]
  assert tensors == [((64, 32), "uint8")]  # only x^T (E4M3 bytes), for the weight gradient


def test_frozen_weight_saves_no_input_columnwise_copy(rng):
  module, variables, x = _fp8_dense_setup(rng)
  residuals = _residuals(lambda x: module.apply(variables, x), x)
  assert not any(RESIDUAL_NAMES[0] in d for _, d in residuals)
  tensors = [(aval.shape, str(aval.dtype)) for aval, _ in residuals if aval.size > 1]
  assert tensors == [((64, 48), "uint8")]  # only W (E4M3 bytes), for the input gradient


# ---------------------------------------------------------------------------------------------
# Recipe resolution


class _Recorder:
  """A factory that records the roles it is asked about (and quantizes nothing)."""

  def __init__(self):
    self.roles = []

  def __call__(self, role):
    self.roles.append(role)
    return jq.IdentityQuantizer()


def test_autocast_recipe_reaches_a_module_without_recipe(rng):
  x = _array(rng, (4, 8))
  recorder = _Recorder()
  with jq.autocast(jq.CustomRecipe(recorder)):
    jax.eval_shape(jf.Dense(4).init, jax.random.key(0), x)
  assert {r.tensor_type for r in recorder.roles} == {"input", "weight", "grad_output"}


def test_recipe_attribute_wins_over_autocast(rng):
  x = _array(rng, (4, 8))
  outer, attribute = _Recorder(), _Recorder()
  with jq.autocast(jq.CustomRecipe(outer)):
    jax.eval_shape(jf.Dense(4, recipe=jq.CustomRecipe(attribute)).init, jax.random.key(0), x)
  assert outer.roles == [] and len(attribute.roles) == 3


# ---------------------------------------------------------------------------------------------
# Bad input


def test_stochastic_rounding_without_quantize_rng_stream_is_a_clear_error(rng):
  x = _array(rng, (16, 32))
  module = jf.Dense(16, recipe=jq.NVFP4BlockScaling())  # stochastic rounding of grad_output
  variables = jax.eval_shape(module.init, jax.random.key(0), x)  # init may omit the stream
  with pytest.raises(ValueError, match=r"RNG stream 'quantize'.*rngs=\{'quantize': key\}"):
    jax.eval_shape(module.apply, variables, x)
  jax.eval_shape(lambda v, k: module.apply(v, x, rngs={"quantize": k}), variables,
                 jax.random.key(1))


def test_recipe_attribute_of_the_wrong_type_is_a_type_error(rng):
  with pytest.raises(TypeError, match=r"Dense\.recipe: expected a jaxquant Recipe.*'fp8'"):
    jax.eval_shape(jf.Dense(4, recipe="fp8").init, jax.random.key(0), _array(rng, (2, 8)))


def test_factory_returning_a_non_quantizer_is_a_type_error_naming_the_role(rng):

  class Net(nn.Module):

    @nn.compact
    def __call__(self, x):
      return jf.Dense(4, name="proj")(x)

  recipe = jq.CustomRecipe(lambda role: "e4m3")
  with jq.autocast(recipe), pytest.raises(TypeError) as info:
    jax.eval_shape(Net().init, jax.random.key(0), _array(rng, (2, 8)))
  message = str(info.value)
  assert "'e4m3'" in message and "name='proj'" in message and "tensor_type='input'" in message
