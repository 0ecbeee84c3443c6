"""Recipes and factories: `CustomRecipe(factories.X)` equals the built-in recipe X bit for bit;
the built-ins give TransformerEngine's default quantizer per role; the zoo factories build the
hybrids their docstrings describe; `autocast` scopes a recipe."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
import oracle
from helpers import assert_same_leaves, quantize
from jaxquant import factories, recipes

pytestmark = pytest.mark.usefixtures("core_backend")

LINEAR = {t: jq.QuantizerRole("linear", t, "fc1") for t in ("input", "weight", "grad_output")}
E4M3, E5M2 = np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)

# (built-in recipe, the same recipe through CustomRecipe(reference factory))
EQUIVALENT = {
    "fp8_current": (recipes.Float8CurrentScaling(), factories.float8_current_scaling),
    "fp8_delayed": (recipes.DelayedScaling(), factories.delayed_scaling),
    "mxfp8": (recipes.MXFP8BlockScaling(), factories.mxfp8_block_scaling),
    "fp8_block": (recipes.Float8BlockScaling(), factories.float8_block_scaling),
    "nvfp4": (recipes.NVFP4BlockScaling(), factories.nvfp4_block_scaling),
}
VARIANTS = [
    (recipes.Float8CurrentScaling("E4M3", pow2_scale=True, amax_epsilon=1e-3),
     dict(fp8_format="E4M3", pow2_scale=True, amax_epsilon=1e-3), "float8_current_scaling"),
    (recipes.DelayedScaling("E5M2", margin=1, amax_history_len=16,
                            amax_compute_algo="most_recent"),
     dict(fp8_format="E5M2", margin=1, amax_history_len=16, amax_compute_algo="most_recent"),
     "delayed_scaling"),
    (recipes.MXFP8BlockScaling("E5M2"), dict(fp8_format="E5M2"), "mxfp8_block_scaling"),
    (recipes.Float8BlockScaling(w_block_scaling_dim=1, pow2_scale=False),
     dict(w_block_scaling_dim=1, pow2_scale=False), "float8_block_scaling"),
    (recipes.NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True,
                               row_scaled_activation=True),
     dict(disable_rht=True, disable_stochastic_rounding=True, row_scaled_activation=True),
     "nvfp4_block_scaling"),
    (recipes.NVFP4BlockScaling(disable_2d_quantization=True), dict(disable_2d_quantization=True),
     "nvfp4_block_scaling"),
]


def test_every_builtin_recipe_has_a_reference_factory():
  assert set(jq.BUILTIN_RECIPES) == set(EQUIVALENT)
  for name, cls in jq.BUILTIN_RECIPES.items():
    assert isinstance(EQUIVALENT[name][0], cls)


@pytest.mark.parametrize("name", list(EQUIVALENT))
@pytest.mark.parametrize("tensor_type", ["input", "weight", "grad_output"])
def test_custom_recipe_of_reference_factory_is_bit_identical(rng, prng_key, name, tensor_type):
  builtin, factory = EQUIVALENT[name]
  role = LINEAR[tensor_type]
  q_builtin = builtin.quantizer(role)
  q_custom = jq.CustomRecipe(factory).quantizer(role)
  assert q_builtin == q_custom and hash(q_builtin) == hash(q_custom)
  x = jnp.asarray(oracle.random_matrix(rng, (32, 48), jnp.bfloat16))
  state = jq.init_state(q_builtin)
  a = quantize(x, q_builtin, key=prng_key, state=state)
  b = quantize(x, q_custom, key=prng_key, state=jq.init_state(q_custom))
  assert_same_leaves(a, b, f"{name}/{tensor_type}")


@pytest.mark.parametrize("builtin,kwargs,factory_name", VARIANTS,
                         ids=[f"{v[2]}-{i}" for i, v in enumerate(VARIANTS)])
def test_custom_recipe_matches_builtin_with_non_default_options(builtin, kwargs, factory_name):
  custom = jq.CustomRecipe(functools.partial(getattr(factories, factory_name), **kwargs))
  roles = list(LINEAR.values()) + [jq.QuantizerRole("grouped_linear", "input", "experts"), None]
  for role in roles:
    assert builtin.quantizer(role) == custom.quantizer(role), role


@pytest.mark.parametrize("name", list(EQUIVALENT))
def test_builtin_recipes_handle_the_none_role(name):
  builtin, factory = EQUIVALENT[name]
  assert isinstance(builtin.quantizer(None), jq.Quantizer)
  assert builtin.quantizer(None) == jq.CustomRecipe(factory).quantizer(None)


def test_float8_current_scaling_defaults_are_te_hybrid():
  r = recipes.Float8CurrentScaling()
  assert r.quantizer(LINEAR["input"]) == jq.Float8CurrentScalingQuantizer(E4M3, False, 0.0)
  assert r.quantizer(LINEAR["weight"]) == jq.Float8CurrentScalingQuantizer(E4M3, False, 0.0)
  assert r.quantizer(LINEAR["grad_output"]) == jq.Float8CurrentScalingQuantizer(E5M2, False, 0.0)
  e4m3_only = recipes.Float8CurrentScaling("E4M3")
  assert e4m3_only.quantizer(LINEAR["grad_output"]).dtype == E4M3
  assert recipes.Float8CurrentScaling("E5M2").quantizer(LINEAR["input"]).dtype == E5M2


def test_delayed_scaling_defaults_are_te_hybrid_history_1024_max_margin_0():
  r = recipes.DelayedScaling()
  for tensor_type, dtype in (("input", E4M3), ("weight", E4M3), ("grad_output", E5M2)):
    assert r.quantizer(LINEAR[tensor_type]) == jq.Float8DelayedScalingQuantizer(
        dtype, amax_history_len=1024, amax_compute_algo="max", margin=0)


def test_mxfp8_defaults_are_e4m3_everywhere():
  r = recipes.MXFP8BlockScaling()
  for role in LINEAR.values():
    assert r.quantizer(role) == jq.MXFP8Quantizer(E4M3)


def test_float8_block_scaling_defaults_are_1x128_activations_128x128_weights_pow2():
  r = recipes.Float8BlockScaling()
  assert r.quantizer(LINEAR["input"]) == jq.Float8BlockQuantizer((1, 128), E4M3, True, 0.0)
  assert r.quantizer(LINEAR["weight"]) == jq.Float8BlockQuantizer((128, 128), E4M3, True, 0.0)
  assert r.quantizer(LINEAR["grad_output"]) == jq.Float8BlockQuantizer((1, 128), E4M3, True, 0.0)


def test_nvfp4_defaults_are_2d_weights_rht_on_wgrad_operands_sr_on_gradients():
  r = recipes.NVFP4BlockScaling()
  assert r.quantizer(LINEAR["weight"]) == jq.NVFP4Quantizer(block_2d=True)
  assert r.quantizer(LINEAR["input"]) == jq.NVFP4Quantizer(rht=True)
  assert r.quantizer(LINEAR["grad_output"]) == jq.NVFP4Quantizer(rht=True,
                                                                 stochastic_rounding=True)
  switched = recipes.NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True,
                                       disable_2d_quantization=True)
  for role in LINEAR.values():
    assert switched.quantizer(role) == jq.NVFP4Quantizer()


# ------------------------------------------------------------------------------------------------
# CustomRecipe and the zoo


def test_custom_recipe_rejects_a_factory_result_that_is_not_a_quantizer_naming_the_role():
  recipe = jq.CustomRecipe(lambda role: "fp8")
  with pytest.raises(TypeError, match=r"role QuantizerRole\(module_type='linear', "
                     r"tensor_type='weight', name='fc1'"):
    recipe.quantizer(LINEAR["weight"])
  with pytest.raises(TypeError, match="role None"):
    recipe.quantizer(None)


def test_custom_recipe_rejects_a_non_callable_factory():
  with pytest.raises(TypeError, match="qfactory=.*not callable"):
    jq.CustomRecipe(42)


def test_reference_factories_reject_unknown_options():
  with pytest.raises(ValueError, match="fp8_format='E3M4'"):
    factories.float8_current_scaling(LINEAR["input"], fp8_format="E3M4")
  with pytest.raises(ValueError, match="block scaling dim 3"):
    factories.float8_block_scaling(LINEAR["weight"], w_block_scaling_dim=3)


ALL_ROLES = [jq.QuantizerRole(m, t, "fc1") for m in ("linear", "grouped_linear")
             for t in ("input", "weight", "grad_output")] + [None]


@pytest.mark.parametrize("name", list(factories.ZOO))
def test_zoo_factories_return_a_quantizer_for_every_role_and_none(name):
  for role in ALL_ROLES:
    assert isinstance(jq.CustomRecipe(factories.ZOO[name]).quantizer(role), jq.Quantizer), role


def test_zoo_mxfp8_forward_nvfp4_backward():
  f = factories.mxfp8_forward_nvfp4_backward
  assert f(LINEAR["input"]) == jq.HybridQuantizer(jq.MXFP8Quantizer(),
                                                  jq.NVFP4Quantizer(rht=True))
  assert f(LINEAR["weight"]) == jq.HybridQuantizer(jq.MXFP8Quantizer(),
                                                   jq.NVFP4Quantizer(block_2d=True))
  assert f(LINEAR["grad_output"]) == jq.NVFP4Quantizer(rht=True, stochastic_rounding=True)


def test_zoo_moe_row_scaled_nvfp4_forward_mxfp8_backward_for_grouped_linear_only():
  f = factories.moe_nvfp4_forward_mxfp8_backward
  experts = lambda t: jq.QuantizerRole("grouped_linear", t, "experts")
  assert f(experts("input")) == jq.HybridQuantizer(jq.NVFP4Quantizer(row_scaled=True),
                                                   jq.MXFP8Quantizer())
  assert f(experts("weight")) == jq.HybridQuantizer(jq.NVFP4Quantizer(), jq.MXFP8Quantizer())
  assert f(experts("grad_output")) == jq.MXFP8Quantizer()
  assert f(LINEAR["input"]) == jq.MXFP8Quantizer()


def test_zoo_high_precision_backward_uses_identity_columnwise():
  f = factories.high_precision_backward
  assert f(LINEAR["grad_output"]) == jq.IdentityQuantizer()
  for t in ("input", "weight"):
    assert f(LINEAR[t]) == jq.HybridQuantizer(jq.Float8CurrentScalingQuantizer(),
                                              jq.IdentityQuantizer())


def test_zoo_backward_sees_forward_error_uses_rowwise_dequantized_source():
  q = factories.nvfp4_forward_backward_sees_forward_error(LINEAR["weight"])
  assert q.columnwise_source == "rowwise_dequantized" and q.rowwise == jq.NVFP4Quantizer(
      block_2d=True)


def test_keep_layers_in_high_precision_only_touches_named_layers():
  f = factories.keep_layers_in_high_precision(["lm_head"], factories.mxfp8_block_scaling)
  assert f(jq.QuantizerRole("linear", "input", "lm_head")) == jq.IdentityQuantizer()
  assert f(LINEAR["input"]) == jq.MXFP8Quantizer()
  assert f(None) == jq.MXFP8Quantizer()
  assert factories.first_and_last_layers_bf16(
      jq.QuantizerRole("linear", "weight", "embed_proj")) == jq.IdentityQuantizer()


# ------------------------------------------------------------------------------------------------
# autocast


def test_autocast_scopes_and_nests_the_recipe():
  outer, inner = recipes.MXFP8BlockScaling(), recipes.Float8CurrentScaling()
  assert jq.current_recipe() is None
  with jq.autocast(outer):
    assert jq.current_recipe() is outer
    with jq.autocast(inner):
      assert jq.current_recipe() is inner
    with jq.autocast(None):
      assert jq.current_recipe() is None
    assert jq.current_recipe() is outer
  assert jq.current_recipe() is None


def test_autocast_rejects_a_non_recipe():
  with pytest.raises(TypeError, match="recipe: expected a jaxquant Recipe"):
    with jq.autocast(factories.mxfp8_block_scaling):
      pass


def test_recipe_set_by_autocast_is_part_of_the_jit_cache_key():
  @jax.jit
  def which(x):
    recipe = jq.current_recipe()
    return x + (0.0 if recipe is None else float(len(type(recipe).__name__)))

  x = jnp.zeros(())
  with jq.autocast(recipes.MXFP8BlockScaling()):
    a = float(which(x))
  with jq.autocast(recipes.Float8CurrentScaling()):
    b = float(which(x))
  assert (a, b) == (len("MXFP8BlockScaling"), len("Float8CurrentScaling"))
