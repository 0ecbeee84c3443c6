"""A sharded Flax NNX model (`nnx.with_partitioning` on its kernels, built under
`jax.set_mesh`) quantized with `jaxquant.nnx.quantize_model`: parameters keep their sharding and
metadata, a jitted `nnx.Optimizer` step matches one device, and each swapped module's values and
gradients match one device under the mesh.

Every contraction of the model asks for `Precision.HIGHEST`: at the default precision a GPU
runs a float32 contraction on TF32 tensor cores, which round its inputs to 10-bit mantissas, so
a last-bit difference between the two programs' upstream sums flips a TF32 rounding (2^-11
relative) and the flips grow through the model, as FP8 ones do (the Identity step failed on
2 H100s at `attn_vec_einsum`'s kernel gradient). At HIGHEST both multiply in float32 and differ
only in the order of float32 additions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxquant as jq
import jaxquant.nnx as jnnx
import bounds
import sharded

D, HEADS, HEAD_DIM, HIDDEN = 64, 2, 32, 128  # every shard holds whole 32-blocks
HIGHEST = jax.lax.Precision.HIGHEST


def _init(names):
  return nnx.with_partitioning(nnx.initializers.lecun_normal(), names)


class Block(nnx.Module):
  """Gemma-style: per-head einsums sharded over heads ("tp"), an MLP column- then row-parallel,
  every kernel's model axis FSDP-sharded."""

  def __init__(self, rngs: nnx.Rngs):
    self.qkv_einsum = nnx.Einsum("BTD,SNDH->SBTNH", (3, HEADS, D, HEAD_DIM),
                                 kernel_init=_init((None, "tp", "fsdp", None)),
                                 precision=HIGHEST, rngs=rngs)
    self.attn_vec_einsum = nnx.Einsum("BTNH,NHD->BTD", (HEADS, HEAD_DIM, D),
                                      kernel_init=_init(("tp", None, "fsdp")),
                                      precision=HIGHEST, rngs=rngs)
    self.up = nnx.Linear(D, HIDDEN, kernel_init=_init(("fsdp", "tp")), precision=HIGHEST,
                         rngs=rngs)
    self.down = nnx.Linear(HIDDEN, D, kernel_init=_init(("tp", "fsdp")), precision=HIGHEST,
                           rngs=rngs)

  def __call__(self, x):
    q, k, v = self.qkv_einsum(x)
    scores = jnp.einsum("BTNH,BSNH->BNTS", q, k, precision=HIGHEST)
    probs = jax.nn.softmax(scores / np.sqrt(HEAD_DIM))
    x = x + self.attn_vec_einsum(jnp.einsum("BNTS,BSNH->BTNH", probs, v, precision=HIGHEST))
    return x + self.down(jax.nn.gelu(self.up(x)))


class Model(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.layers = nnx.List([Block(rngs) for _ in range(2)])

  def __call__(self, x):
    for layer in self.layers:
      x = layer(x)
    return x


def _loss(model, x):
  return jnp.mean(jnp.square(model(x)))


INPUTS = {"qkv_einsum": (8, 32, D), "attn_vec_einsum": (8, 32, HEADS, HEAD_DIM), "up": (8, 32, D),
          "down": (8, 32, HIDDEN)}


def _identity():
  return jq.CustomRecipe(lambda role: jq.IdentityQuantizer())


def _sharded_model(mesh, recipe):
  with jax.set_mesh(mesh):
    model = Model(nnx.Rngs(0))
  shardings = {path: v.get_value().sharding
               for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  jnnx.quantize_model(model, recipe)
  for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    assert v.get_value().sharding == shardings[path], path  # sharding kept
  graphdef, state = nnx.split(model)  # one device: the same swapped model, gathered to the host
  return model, nnx.merge(graphdef, jax.device_get(state)), shardings


def _rel(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return np.linalg.norm(got - want) / np.linalg.norm(want)


def test_identity_swapped_sharded_model_steps_like_one_device(devices, rng):
  """Every swapped contraction in place, Identity: the sharded step equals one device up to
  float32 reduction order (the layouts, transposes and kernel constraints are exact). Nothing is
  quantized, so no rounding flip amplifies a reordered sum: each contraction moves by a few
  float32 ulps, relative norms ~1e-7 on 8 host devices; 1e-5 (168 u) leaves room for the
  step's chained contractions and still fails a TF32-rounded one (2^-11) or a wrong sum."""
  mesh = sharded.make_mesh(devices, "fsdp")
  model, single, shardings = _sharded_model(mesh, _identity())
  assert model.layers[0].qkv_einsum.kernel.get_value().sharding.is_equivalent_to(
      NamedSharding(mesh, P(None, "tp", "fsdp", None)), 4)
  x = jnp.asarray(rng.standard_normal((8, 32, D)), jnp.float32)
  want_loss, want_grads = nnx.jit(nnx.value_and_grad(_loss))(single, x)
  with jax.set_mesh(mesh):
    xs = jax.device_put(x, NamedSharding(mesh, P(("dp", "fsdp"))))
    optimizer = nnx.Optimizer(model, optax.sgd(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x):
      loss, grads = nnx.value_and_grad(_loss)(model, x)
      optimizer.update(model, grads)
      return loss, grads

    got_loss, got_grads = step(model, optimizer, xs)
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
  got = dict(nnx.to_flat_state(got_grads))
  for path, want in nnx.to_flat_state(want_grads):
    assert _rel(got[path].get_value(), want.get_value()) <= 1e-5, path
  for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):  # annotated kernels kept
    if path[-1] == "kernel":  # their layout through the step (biases are unannotated)
      assert v.get_value().sharding.is_equivalent_to(shardings[path], v.ndim), path


def _functional(module):
  """`f(params, x, c) = (y, (d params, d x))` of an NNX module, and its parameters."""
  graphdef, params, rest = nnx.split(module, nnx.Param, ...)
  apply = lambda p, x: nnx.merge(graphdef, p, rest)(x)

  def f(p, x, c):
    y, vjp = jax.vjp(apply, p, x)
    return y, vjp(c)

  return f, apply, params


@pytest.mark.parametrize("recipe_name", ["fp8_current", "mxfp8"])
def test_quantized_swapped_modules_match_one_device_under_the_mesh(devices, rng, recipe_name):
  """Each swapped module of the sharded model, on the same input and output gradient: values
  and gradients within `bounds.py`'s reordered-sum bound of one device's. (Whole-model
  gradients are not compared: an input one ulp apart can land on the other side of an FP8
  rounding boundary, and a model amplifies such flips to percent-level differences.)"""
  mesh = sharded.make_mesh(devices, "fsdp")
  model, single, _ = _sharded_model(mesh, jq.BUILTIN_RECIPES[recipe_name]())
  for name, shape in INPUTS.items():
    module, reference = getattr(model.layers[0], name), getattr(single.layers[0], name)
    x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    c = jnp.asarray(rng.standard_normal(jax.eval_shape(reference, x).shape), jnp.float32)
    f_single, apply_single, p_single = _functional(reference)
    f_sharded, _, p_sharded = _functional(module)
    want = jax.jit(f_single)(p_single, x, c)
    single_report = jq.explain(f_single, p_single, x, c)
    with jax.set_mesh(mesh):
      xs = jax.device_put(x, NamedSharding(mesh, P(("dp", "fsdp"))))
      got = jax.jit(f_sharded)(p_sharded, xs, c)
      sharded_report = jq.explain(f_sharded, p_sharded, xs, c)
    (y_got, (p_got, dx_got)), (y_want, (p_want, dx_want)) = jax.device_get((got, want))
    m_y, (m_p, m_x) = bounds.linear_magnitudes(apply_single, p_single, x, c)
    rows = shape[0] * shape[1]  # [B, T, ...]
    sums = bounds.gemm_sums(single_report, sharded_report, mesh,
                            {"fprop": x.size // rows, "dgrad": y_want.size // rows,
                             "wgrad": rows})
    b = 0.0 if "bias" not in p_want else np.abs(np.asarray(p_want["bias"][...], np.float64))
    bounds.assert_within(y_got, y_want, m_y, sums["fprop"], f"{name}: y", bias_magnitude=b)
    bounds.assert_within(dx_got, dx_want, m_x, sums["dgrad"], f"{name}: input gradient")
    bounds.assert_within(p_got["kernel"][...], p_want["kernel"][...], m_p["kernel"][...],
                         sums["wgrad"], f"{name}: kernel gradient")
    if "bias" in p_want:  # float32 rows of the output gradient, summed by XLA
      bounds.assert_within(p_got["bias"][...], p_want["bias"][...], m_p["bias"][...],
                           bounds.Sum(rows), f"{name}: bias gradient")
