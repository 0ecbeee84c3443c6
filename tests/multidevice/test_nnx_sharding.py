"""A sharded Flax NNX model (`nnx.with_partitioning` on its kernels, built under
`jax.set_mesh`) quantized with `jaxquant.nnx.quantize_model`: parameters keep their sharding and
metadata, a jitted `nnx.Optimizer` step matches one device, and each swapped module's values and
gradients match one device under the mesh."""

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
import sharded

D, HEADS, HEAD_DIM, HIDDEN = 64, 2, 32, 128  # every shard holds whole 32-blocks


def _init(names):
  return nnx.with_partitioning(nnx.initializers.lecun_normal(), names)


class Block(nnx.Module):
  """Gemma-style: per-head einsums sharded over heads ("tp"), an MLP column- then row-parallel,
  every kernel's model axis FSDP-sharded."""

  def __init__(self, rngs: nnx.Rngs):
    self.qkv_einsum = nnx.Einsum("BTD,SNDH->SBTNH", (3, HEADS, D, HEAD_DIM),
                                 kernel_init=_init((None, "tp", "fsdp", None)), rngs=rngs)
    self.attn_vec_einsum = nnx.Einsum("BTNH,NHD->BTD", (HEADS, HEAD_DIM, D),
                                      kernel_init=_init(("tp", None, "fsdp")), rngs=rngs)
    self.up = nnx.Linear(D, HIDDEN, kernel_init=_init(("fsdp", "tp")), rngs=rngs)
    self.down = nnx.Linear(HIDDEN, D, kernel_init=_init(("tp", "fsdp")), rngs=rngs)

  def __call__(self, x):
    q, k, v = self.qkv_einsum(x)
    probs = jax.nn.softmax(jnp.einsum("BTNH,BSNH->BNTS", q, k) / np.sqrt(HEAD_DIM))
    x = x + self.attn_vec_einsum(jnp.einsum("BNTS,BSNH->BTNH", probs, v))
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
  float32 reduction order (the layouts, transposes and kernel constraints are exact)."""
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


@pytest.mark.parametrize("recipe_name", ["fp8_current", "mxfp8"])
def test_quantized_swapped_modules_match_one_device_under_the_mesh(devices, rng, recipe_name):
  """Each swapped module of the sharded model, on the same input and output gradient: values
  and gradients match one device up to float32 reduction order. (Whole-model gradients are
  not compared: an input one ulp apart can land on the other side of an FP8 rounding boundary,
  and a model amplifies such flips to percent-level differences.)"""
  mesh = sharded.make_mesh(devices, "fsdp")
  model, single, _ = _sharded_model(mesh, jq.BUILTIN_RECIPES[recipe_name]())
  for name, shape in INPUTS.items():
    module, reference = getattr(model.layers[0], name), getattr(single.layers[0], name)
    x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    c = jnp.asarray(rng.standard_normal(jax.eval_shape(reference, x).shape), jnp.float32)
    forward = nnx.jit(lambda m, x: m(x))
    grads = nnx.jit(nnx.grad(lambda m, x: jnp.sum(m(x) * c), argnums=(0, 1)))
    want_y, (want_grads, want_gx) = forward(reference, x), grads(reference, x)
    with jax.set_mesh(mesh):
      xs = jax.device_put(x, NamedSharding(mesh, P(("dp", "fsdp"))))
      got_y, (got_grads, got_gx) = forward(module, xs), grads(module, xs)
    assert _rel(got_y, want_y) <= 1e-5, name
    assert _rel(got_gx, want_gx) <= 1e-5, name
    assert _rel(got_grads["kernel"][...], want_grads["kernel"][...]) <= 1e-5, name
