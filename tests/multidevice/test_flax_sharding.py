"""Flax modules sharded the Flax way: logical axis names on the kernel (a `kernel_axes`
attribute, or `nn.with_logical_partitioning` on `kernel_init`) and on the input (`input_axes`),
mapped to mesh axes by `nn.logical_axis_rules`; and `examples/train_lm.py --mesh`."""

from __future__ import annotations

from typing import Optional

import importlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxquant as jq
import jaxquant.flax as jf
import per_layer
import sharded

RULES = (("batch", ("dp", "fsdp")), ("length", None), ("act_embed", None), ("act_mlp", "tp"),
         ("embed", "fsdp"), ("mlp", "tp"))


class MLP(nn.Module):
  """fc1 column-parallel (kernel_axes), fc2 row-parallel (a boxed kernel_init); both FSDP."""

  recipe: jq.Recipe

  @nn.compact
  def __call__(self, x):
    h = jf.Dense(256, kernel_axes=("embed", "mlp"), input_axes=("batch", "length", "act_embed"),
                 recipe=self.recipe, name="fc1")(x)
    h = nn.gelu(h)
    init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("mlp", "embed"))
    return jf.Dense(256, kernel_init=init, input_axes=("batch", "length", "act_mlp"),
                    recipe=self.recipe, name="fc2")(h)


def test_logically_partitioned_mlp_matches_single_device(devices, rng):
  mesh = sharded.make_mesh(devices, "fsdp")
  model = MLP(jq.Float8CurrentScaling())
  x = jnp.asarray(rng.standard_normal((8, 64, 256)), jnp.float32)
  loss = lambda v, x: jnp.mean(jnp.square(model.apply(v, x)))
  grad_fn = jax.jit(jax.value_and_grad(loss))

  boxed = jax.jit(model.init)(jax.random.key(0), x)
  assert boxed["params"]["fc1"]["kernel"].names == ("embed", "mlp")
  assert boxed["params"]["fc2"]["kernel"].names == ("mlp", "embed")

  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    sharded_vars, xs = sharded.place_flax(boxed, x, mesh, RULES)
    report = jq.explain(jax.value_and_grad(loss), sharded_vars, xs)
    got_loss, got_grads = grad_fn(sharded_vars, xs)

  for value, spec in ((sharded_vars["params"]["fc1"]["kernel"], P("fsdp", "tp")),
                      (got_grads["params"]["fc2"]["kernel"], P("tp", "fsdp"))):
    assert value.sharding.is_equivalent_to(NamedSharding(mesh, spec), 2), value.sharding
  fsdp = [(str(d.role), d.path) for d in report if d.op == "fsdp-gather"]
  if mesh.shape["fsdp"] > 1:
    assert [p for _, p in fsdp] == ["quantized", "quantized"], fsdp
  assert np.isfinite(float(got_loss))
  # Values and gradients: each layer on its own (per_layer.py says why not the whole model).
  found = per_layer.assert_layers_match_single_device(model, boxed, x, mesh, RULES, rng)
  assert set(found) == {("fc1",), ("fc2",)}, found


def test_train_lm_trains_on_a_mesh(devices, tmp_path):
  train_lm = importlib.import_module("train_lm")
  mesh = {8: "dp=2,fsdp=2,tp=2", 4: "dp=2,tp=2", 2: "dp=2"}[len(devices)]
  result = train_lm.main(["--mesh", mesh, "--recipe", "fp8_current", "--steps", "8",
                          "--eval-every", "8", "--lr", "1e-2", "--warmup", "2",
                          "--d-model", "64", "--layers", "1", "--heads", "2", "--seq", "32",
                          "--batch", "8", "--data-mb", "0.3", "--eval-batches", "1",
                          "--no-progress", "--out", str(tmp_path), "--backend", "ffi"])
  (history,) = result["histories"]
  first, last = history.rows[0], history.rows[-1]
  assert last["train_loss"] < first["train_loss"] - 0.3, history.rows
  assert np.isfinite(history.step_losses).all()


def test_train_step_keeps_the_state_shardings_on_an_fsdp_mesh(devices):
  """bf16 on fsdp=4 with scanned, rematerialized blocks: left to itself, XLA returns the updated
  LayerNorm parameters sharded over `fsdp` although they came in replicated, so an ahead-of-time
  compiled step (`bench/scaling.py`) rejected the second call ("compiled for input shardings
  that disagree") and a plain jitted one compiled a second program. `make_steps(model, state)`
  pins the new state to the first state's shardings."""
  if len(jax.devices()) < 4:
    pytest.skip(f"needs 4 devices for fsdp=4, found {len(jax.devices())}")
  lm_sharding = importlib.import_module("lm.sharding")
  training = importlib.import_module("lm.training")
  model_lib = importlib.import_module("lm.model")
  config = model_lib.LMConfig(seq=32, d_model=64, layers=2, heads=2, mlp_ratio=4,
                              dtype=jnp.bfloat16, remat=True, scan_layers=True)
  model = model_lib.GPT(config, None)
  tokens = np.random.default_rng(0).integers(0, 256, (8, config.seq + 1)).astype(np.int32)
  mesh = lm_sharding.make_mesh({"fsdp": 4})
  with lm_sharding.active(mesh):
    state = training.create_state(model, tokens, training.TrainConfig(steps=2), mesh)
    before = [(jax.tree_util.keystr(path), a.sharding, a.ndim)
              for path, a in jax.tree_util.tree_leaves_with_path(state)]
    train_step, _ = training.make_steps(model, state)
    batch = lm_sharding.put_batches(mesh, tokens)
    compiled = train_step.lower(state, batch, jax.random.key(0)).compile()
    for step in range(2):  # the second call takes the first call's output state
      state, loss = compiled(state, batch, jax.random.key(step))
      assert np.isfinite(float(loss))
  after = [a.sharding for a in jax.tree_util.tree_leaves(state)]
  assert len(after) == len(before)
  mismatched = [(path, str(x), str(y)) for (path, x, ndim), y in zip(before, after)
                if not x.is_equivalent_to(y, ndim)]
  assert not mismatched, mismatched


class LNBlock(nn.Module):
  """`LayerNormMLP` (fc1 column-, fc2 row-parallel) and a `LayerNormDense` and `DenseGeneral`
  head, all sharded through `input_axes` / `kernel_axes`; `fuse_producers` as the modules'."""

  recipe: jq.Recipe
  fuse_producers: Optional[bool] = None

  @nn.compact
  def __call__(self, x):
    x = x + jf.LayerNormMLP(512, activations="swiglu", recipe=self.recipe,
                            fuse_producers=self.fuse_producers,
                            input_axes=("batch", "length", "act_embed"),
                            hidden_axes=("batch", "length", "act_mlp"),
                            kernel_axes_1=("embed", "mlp"), kernel_axes_2=("mlp", "embed"),
                            name="mlp")(x)
    h = jf.LayerNormDense(256, recipe=self.recipe, input_axes=("batch", "length", "act_embed"),
                          fuse_producers=self.fuse_producers,
                          kernel_axes=("embed", "mlp"), name="ln_dense")(x)
    return jf.DenseGeneral((2, 64), axis=-1, recipe=self.recipe,
                           input_axes=("batch", "length", "act_mlp"),
                           kernel_axes=("mlp", None, "embed"), name="head")(h)


@pytest.mark.parametrize("fuse", [False, True], ids=["unfused", "fused"])
def test_layernorm_mlp_dense_general_take_input_axes(devices, rng, fuse):
  """Both paths of the modules (fused producers: CPU handlers on CPU, the kernels on GPUs)."""
  mesh = sharded.make_mesh(devices, "tp")
  model = LNBlock(jq.Float8CurrentScaling(), fuse_producers=fuse)
  x = jnp.asarray(rng.standard_normal((8, 64, 256)), jnp.float32)
  loss = lambda v, x: jnp.mean(jnp.square(model.apply(v, x)))
  grad_fn = jax.jit(jax.value_and_grad(loss))
  boxed = jax.jit(model.init)(jax.random.key(0), x)
  assert boxed["params"]["mlp"]["fc1"]["kernel"].names == ("embed", None, "mlp")
  assert boxed["params"]["head"]["kernel"].names == ("mlp", None, "embed")
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    sharded_vars, xs = sharded.place_flax(boxed, x, mesh, RULES)
    report = jq.explain(jax.value_and_grad(loss), sharded_vars, xs)
    hlo = grad_fn.lower(sharded_vars, xs).compile().as_text()
    got_loss = grad_fn(sharded_vars, xs)[0]
  # Every dense of the block got its sharding: FSDP gathers (where the mesh has an fsdp axis:
  # the (2, 2, 2) mesh of 8 devices, not the tp-only mesh of 2-4 GPUs), K-sharded reductions.
  layers = {"fc1", "fc2", "ln_dense", "head"}
  has_fsdp = mesh.shape["fsdp"] > 1
  layer = lambda d: str(d.role).rsplit("/", 2)[-2]  # ".../<layer>/<tensor or GEMM>"
  fsdp = {layer(d) for d in report if d.op == "fsdp-gather"}
  assert fsdp == (layers if has_fsdp else set()), fsdp
  reduced = {layer(d) for d in report if d.op == "reduce"}
  assert layers <= reduced, reduced
  # Only the FP8 weight bytes are gathered (and FSDP-sharded biases); never an activation.
  gathers = [c for c in sharded.collectives(hlo) if c.op == "all-gather" and c.elements > 4096]
  assert bool(gathers) == has_fsdp, gathers
  assert {t for c in gathers for t, _ in c.arrays} <= {"u8"}, gathers
  # The gated fc1 kernel [K, 2, N] is sharded on its inner axis N: the GEMM reads it shard-major
  # (jaxquant/layers/shard_major.py), so nothing is re-laid between devices.
  moved = [c for c in sharded.collectives(hlo)
           if c.op in ("all-to-all", "collective-permute") and c.elements > 4096]
  assert not moved, moved
  assert np.isfinite(float(got_loss))
  # Values and gradients of each quantized layer on its own, as in the MLP test above: the
  # unfused LayerNormMLP's fc1 and fc2 are Dense layers; the fused one contracts its parameters
  # itself (its sharded values: test_fused_sharding.py).
  found = per_layer.assert_layers_match_single_device(
      model, boxed, x, mesh, RULES, rng, per_layer.LINEAR + (jf.LayerNormDense,))
  mlp = set() if fuse else {("mlp", "fc1"), ("mlp", "fc2")}
  assert set(found) == mlp | {("ln_dense",), ("head",)}, found


class PackedQKV(nn.Module):
  """A packed `(3, heads, head_dim)` projection returning its parts itself (`split_output`) or
  sliced by the model; `kernel_axes` as `LayerNormDense`'s."""

  split: bool
  kernel_axes: tuple

  @nn.compact
  def __call__(self, x):
    out = jf.LayerNormDense((3, 4, 32), recipe=jq.DelayedScaling(), split_output=self.split,
                            input_axes=("batch", "length", "act_embed"),
                            kernel_axes=self.kernel_axes, name="qkv")(x)
    return out if self.split else tuple(out[:, :, i] for i in range(3))


@pytest.mark.parametrize("kernel_axes", [("embed", None, None, None), ("embed", None, "mlp", None)],
                         ids=["fsdp", "heads-tp"])
def test_split_output_sharded_matches_the_sliced_projection(devices, rng, kernel_axes):
  """Under a mesh the parts' gradients give the sliced projection's loss, gradients and
  delayed-scaling states bit for bit: joined in the contraction's backward (the kernel sharded
  over its input axis), or by autodiff after the shard-major contraction (heads sharded: an
  inner output axis, `jaxquant.layers.shard_major`)."""
  mesh = sharded.make_mesh(devices, "tp")
  x = jnp.asarray(rng.standard_normal((8, 32, 128)), jnp.float32)
  weights = jnp.asarray(rng.standard_normal((3, 8, 32, 4, 32)), jnp.float32)
  results = []
  for split in (False, True):
    model = PackedQKV(split, kernel_axes)

    def loss(variables, x, model=model):  # (the states' "gradients" are their updates)
      parts = model.apply(variables, x)
      return sum(jnp.sum(p.astype(jnp.float32) * w) for p, w in zip(parts, weights))

    boxed = jax.jit(model.init)(jax.random.key(0), x)
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
      variables, xs = sharded.place_flax(boxed, x, mesh, RULES)
      results.append(jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(variables, xs))
  got, want = jax.device_get(results[1]), jax.device_get(results[0])
  assert float(jnp.max(jnp.abs(got[1][1]))) > 0  # x's gradient
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
