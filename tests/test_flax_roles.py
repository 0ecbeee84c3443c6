"""Which roles each `jaxquant.flax` module asks its recipe for, and the LayerNorm modules' math.

A recording factory sees every `(module_type, tensor_type, name)` a module asks about: one
triple per contraction and tensor, named by the module's own short name (Flax's auto-name such
as `Dense_0` when none is given), with the full path in `role.path`.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
import jaxquant.flax as jf

TENSORS = ("input", "weight", "grad_output")
IDENTITY = jq.CustomRecipe(lambda role: jq.IdentityQuantizer())


class _Recorder:
  """A factory that records the roles it is asked about (and quantizes nothing)."""

  def __init__(self):
    self.roles = []

  def __call__(self, role):
    self.roles.append(role)
    return jq.IdentityQuantizer()

  def triples(self):
    return {(r.module_type, r.tensor_type, r.name) for r in self.roles}

  def paths(self):
    return {r.name: r.path for r in self.roles}


def _linear_roles(*names):
  return {("linear", t, n) for n in names for t in TENSORS}


def _record(module, x, rngs=None):
  """Roles seen while tracing `init` and the gradient of `apply` (forward and backward); the
  factory runs at trace time, so abstract evaluation suffices (nothing is compiled)."""
  recorder = _Recorder()
  recipe = jq.CustomRecipe(recorder)
  with jq.autocast(recipe):
    variables = jax.eval_shape(module.init, jax.random.key(0), x)
    jax.eval_shape(jax.grad(lambda v: jnp.sum(module.apply(v, x, rngs=rngs))), variables)
  return recorder


def _x(rng, shape=(4, 16)):
  return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def test_dense_roles_use_auto_names_and_given_names_inside_a_parent(rng):

  class Block(nn.Module):

    @nn.compact
    def __call__(self, x):
      x = jf.Dense(16)(x)
      x = jf.Dense(16)(x)
      return jf.Dense(8, name="proj")(x)

  class Model(nn.Module):

    @nn.compact
    def __call__(self, x):
      return Block(name="block")(x)

  recorder = _record(Model(), _x(rng))
  assert recorder.triples() == _linear_roles("Dense_0", "Dense_1", "proj")
  assert recorder.paths() == {"Dense_0": "block/Dense_0", "Dense_1": "block/Dense_1",
                              "proj": "block/proj"}


def test_top_level_dense_is_named_after_its_class(rng):
  assert _record(jf.Dense(4), _x(rng)).triples() == _linear_roles("Dense")


def test_dense_general_roles(rng):

  class Model(nn.Module):

    @nn.compact
    def __call__(self, x):
      x = jf.DenseGeneral((2, 4), axis=-1)(x)  # [b, s, 2, 4]
      x = jf.DenseGeneral(8, axis=(-2, -1), name="out")(x)
      return jf.DenseGeneral(3, batch_dims=(0,))(x)

  recorder = _record(Model(), _x(rng, (2, 3, 16)))
  assert recorder.triples() == _linear_roles("DenseGeneral_0", "out", "DenseGeneral_1")


def test_layernorm_dense_roles_use_its_own_name(rng):

  class Model(nn.Module):

    @nn.compact
    def __call__(self, x):
      x = jf.LayerNormDense(16)(x)
      return jf.LayerNormDense(8, name="qkv")(x)

  assert _record(Model(), _x(rng)).triples() == _linear_roles("LayerNormDense_0", "qkv")


@pytest.mark.parametrize("activations", ["gelu", "swiglu"])
def test_layernorm_mlp_roles_are_fc1_and_fc2(rng, activations):

  class Model(nn.Module):

    @nn.compact
    def __call__(self, x):
      return jf.LayerNormMLP(32, activations=activations, name="mlp")(x)

  recorder = _record(Model(), _x(rng))
  assert recorder.triples() == _linear_roles("fc1", "fc2")
  assert recorder.paths() == {"fc1": "mlp/fc1", "fc2": "mlp/fc2"}


def test_layernorm_mlp_role_names_are_configurable(rng):
  module = jf.LayerNormMLP(32, activations="relu", fc1_name="up", fc2_name="down")
  assert _record(module, _x(rng)).triples() == _linear_roles("up", "down")


# ---------------------------------------------------------------------------------------------
# LayerNormDense / LayerNormMLP math


def _assert_bitwise_equal(a, b):
  np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm"])
def test_layernorm_dense_identity_equals_flax_norm_then_dense(rng, norm_type):
  x = _x(rng, (3, 5, 16)) * 3 + 1

  class Reference(nn.Module):

    @nn.compact
    def __call__(self, x):
      norm = nn.LayerNorm if norm_type == "layernorm" else nn.RMSNorm
      ln = norm(epsilon=1e-5, name="norm")(x)
      return nn.Dense(8, name="dense")(ln), ln

  ours = jf.LayerNormDense(8, norm_type=norm_type, epsilon=1e-5,
                           use_norm_bias=norm_type == "layernorm", return_layernorm_output=True,
                           recipe=IDENTITY)
  variables = jax.jit(ours.init)(jax.random.key(0), x)
  params = variables["params"]
  for name in ("scale", "ln_bias"):  # non-trivial norm parameters
    if name in params:
      params[name] = params[name] + jnp.asarray(rng.standard_normal(16), jnp.float32)
  ref_params = {"norm": {"scale": params["scale"]},
                "dense": {"kernel": params["kernel"], "bias": params["bias"]}}
  if "ln_bias" in params:
    ref_params["norm"]["bias"] = params["ln_bias"]
  y, ln = jax.jit(ours.apply)(variables, x)
  y_ref, ln_ref = jax.jit(Reference().apply)({"params": ref_params}, x)
  _assert_bitwise_equal(ln, ln_ref)
  _assert_bitwise_equal(y, y_ref)


def test_zero_centered_gamma_stores_gamma_minus_one(rng):
  x = _x(rng)
  plain = jf.LayerNormDense(8, use_bias=False)
  centered = jf.LayerNormDense(8, use_bias=False, zero_centered_gamma=True)
  v_plain = jax.jit(plain.init)(jax.random.key(0), x)
  v_centered = jax.jit(centered.init)(jax.random.key(0), x)
  np.testing.assert_array_equal(v_centered["params"]["scale"], np.zeros(16, np.float32))
  gamma = jnp.asarray(rng.uniform(0.5, 1.5, 16), jnp.float32)
  v_plain["params"]["scale"] = gamma
  v_centered["params"]["scale"] = gamma - 1
  np.testing.assert_allclose(jax.jit(centered.apply)(v_centered, x),
                             jax.jit(plain.apply)(v_plain, x),
                             rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("activations,gate", [
    ("gelu", lambda h: jax.nn.gelu(h[..., 0, :])),
    ("relu", lambda h: jax.nn.relu(h[..., 0, :])),
    ("silu", lambda h: jax.nn.silu(h[..., 0, :])),
    ("swiglu", lambda h: jax.nn.silu(h[..., 0, :]) * h[..., 1, :]),
    ("geglu", lambda h: jax.nn.gelu(h[..., 0, :]) * h[..., 1, :]),
])
def test_layernorm_mlp_is_norm_fc1_activation_fc2(rng, activations, gate):
  x = _x(rng, (6, 16))
  module = jf.LayerNormMLP(24, activations=activations, return_layernorm_output=True)
  variables = jax.jit(module.init)(jax.random.key(0), x)
  y, ln = jax.jit(module.apply)(variables, x)
  p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), variables["params"])
  xf = np.asarray(x, np.float64)
  ln_want = (xf - xf.mean(-1, keepdims=True)) / np.sqrt(xf.var(-1, keepdims=True) + 1e-6)
  ln_want = ln_want * p["scale"] + p["ln_bias"]
  kernel1 = p["fc1"]["kernel"].reshape(16, -1, 24)  # [in, slices, intermediate]
  h = np.einsum("mk,ksn->msn", ln_want, kernel1) + p["fc1"]["bias"].reshape(-1, 24)
  hidden = np.asarray(gate(jnp.asarray(h)), np.float64)
  y_want = hidden @ p["fc2"]["kernel"] + p["fc2"]["bias"]
  np.testing.assert_allclose(ln, ln_want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(y, y_want, rtol=1e-4, atol=1e-4)


def test_unknown_activation_is_a_value_error(rng):
  with pytest.raises(ValueError, match=r"unknown activation 'swigloo'"):
    jax.eval_shape(jf.LayerNormMLP(8, activations="swigloo").init, jax.random.key(0), _x(rng))
