"""The fused producers under a mesh: the normalization kernels are partitioned over the rows
(the sharded batch, bit for bit with one device), the quantized copies come out sharded like
the unfused quantize's, a normalized axis that is sharded takes the unfused path (said in
explain), and a sharded MLP's activations run unfused (said too)."""

from __future__ import annotations

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
from jaxquant.ops import fused as fused_ops
from jaxquant.state import init_state

RULES = (("batch", ("dp", "fsdp")), ("length", None), ("act_embed", None), ("act_mlp", "tp"),
         ("embed", "fsdp"), ("mlp", "tp"))


class FusedBlock(nn.Module):
  """A `LayerNormMLP` and a `LayerNormDense`, sharded through `input_axes` / `kernel_axes`,
  with the fused producers asked for (`fuse_producers=True`: CPU handlers in CI)."""

  recipe: jq.Recipe
  embed_axis: str = "act_embed"

  @nn.compact
  def __call__(self, x):
    axes = ("batch", "length", self.embed_axis)
    x = x + jf.LayerNormMLP(512, activations="swiglu", recipe=self.recipe, input_axes=axes,
                            hidden_axes=("batch", "length", "act_mlp"),
                            kernel_axes_1=("embed", "mlp"), kernel_axes_2=("mlp", "embed"),
                            fuse_producers=True, name="mlp")(x)
    return jf.LayerNormDense(256, recipe=self.recipe, input_axes=axes,
                             kernel_axes=("embed", "mlp"), fuse_producers=True,
                             name="ln_dense")(x)


RECIPES = {"current": jq.Float8CurrentScaling, "mxfp8": jq.MXFP8BlockScaling}


@pytest.mark.parametrize("recipe_name", RECIPES)
def test_fused_norms_partition_over_the_batch(devices, rng, recipe_name):
  mesh = sharded.make_mesh(devices, "fsdp")
  model = FusedBlock(RECIPES[recipe_name]())
  x = jnp.asarray(rng.standard_normal((8, 64, 256)), jnp.float32)
  loss = lambda v, x: jnp.mean(jnp.square(model.apply(v, x)))
  grad_fn = jax.jit(jax.value_and_grad(loss))
  boxed = jax.jit(model.init)(jax.random.key(0), x)
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    sharded_vars, xs = sharded.place_flax(boxed, x, mesh, RULES)
    report = jq.explain(jax.value_and_grad(loss), sharded_vars, xs)
    got_loss, got_grads = grad_fn(sharded_vars, xs)
  fused = [d.detail for d in report if d.detail.startswith("fused layernorm+quantize")]
  assert len(fused) == 2, str(report)  # the MLP's fc1 input and the LayerNormDense input
  unfused = {d.detail: d.reason for d in report if d.op == "producer"}
  assert set(unfused) == {"silu, then quantize", "silu gradient, then quantize"}, unfused
  assert all("sharded LayerNormMLP" in r for r in unfused.values())
  assert np.isfinite(float(got_loss))
  assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree.leaves(got_grads))
  # Values: a whole quantized block is not compared (a reordered float32 sum can flip a later
  # FP8 rounding by a step, docs/design.md 7.3). The fused norms are row-local and compared
  # bit for bit below; the LayerNormDense (fused norm + one contraction) on its own within the
  # bound of tests/multidevice/bounds.py.
  found = per_layer.assert_layers_match_single_device(model, boxed, x, mesh, RULES, rng,
                                                      (jf.LayerNormDense,))
  assert set(found) == {("ln_dense",)}, found


@pytest.mark.parametrize("recipe_name", ["current", "delayed", "mxfp8"])
def test_fused_norm_quantize_is_row_local_bit_for_bit(devices, rng, recipe_name):
  """The fused layernorm+quantize with its rows over every device equals one device's, byte
  for byte: each row is normalized on its own and the per-tensor scale comes from the global
  amax (a max, exact in any order)."""
  quantizer = {"current": jq.Float8CurrentScalingQuantizer(),
               "delayed": jq.Float8DelayedScalingQuantizer(),
               "mxfp8": jq.MXFP8Quantizer()}[recipe_name]
  state = init_state(quantizer) if quantizer.stateful else None
  rows = 64 * len(devices)
  x = jnp.asarray(rng.standard_normal((rows, 256)) * 3 + 0.5, jnp.bfloat16)
  scale = jnp.asarray(rng.uniform(0.5, 1.5, 256), jnp.float32)
  bias = jnp.asarray(rng.standard_normal(256) * 0.1, jnp.float32)
  run = jax.jit(lambda x: fused_ops.norm_quantize(
      x, scale, bias, norm_type="layernorm", epsilon=1e-6, out_dtype=jnp.bfloat16,
      quantizer=quantizer, state=state).quantized)
  want = run(x)
  mesh = jax.sharding.Mesh(np.asarray(devices), ("rows",))
  got = run(jax.device_put(x, NamedSharding(mesh, P("rows"))))
  for name in ("rowwise", "columnwise"):
    for field in ("data", "scale_inv"):
      a, b = getattr(getattr(got, name), field), getattr(getattr(want, name), field)
      np.testing.assert_array_equal(np.atleast_1d(np.asarray(a)).view(np.uint8),
                                    np.atleast_1d(np.asarray(b)).view(np.uint8),
                                    err_msg=f"{name}.{field}")


def test_a_sharded_normalized_axis_takes_the_unfused_norm(devices, rng):
  mesh = sharded.make_mesh(devices, "tp")
  model = jf.LayerNormDense(256, recipe=jq.Float8CurrentScaling(), fuse_producers=True,
                            input_axes=("batch", "length", "act_mlp"),
                            kernel_axes=("mlp", "embed"))
  x = jnp.asarray(rng.standard_normal((8, 64, 256)), jnp.float32)
  boxed = jax.jit(model.init)(jax.random.key(0), x)
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    variables, xs = sharded.place_flax(boxed, x, mesh, RULES, P(("dp", "fsdp"), None, "tp"))
    report = jq.explain(lambda v, x: model.apply(v, x), variables, xs)
  unfused = [d for d in report if d.op == "producer"]
  assert len(unfused) == 1 and "the normalized axis is sharded" in unfused[0].reason


def test_gemm_gelu_partitions_over_rows_bit_for_bit(devices, rng):
  """fc1's GEMM with the gelu epilogue (`jaxquant.ops.gemm_gelu`) under a mesh: rows of a and
  of b stay local and equal one device's byte for byte (each output element is one whole dot
  product); a sharded contraction axis is gathered whole first (the gelu of a partial sum is
  not a partial sum), with the same values."""
  import dataclasses
  from jaxquant import ops
  mesh = jax.sharding.Mesh(np.asarray(devices).reshape(2, -1), ("m", "n"))
  q = jq.Float8CurrentScalingQuantizer()
  x = jnp.asarray(rng.standard_normal((64, 128)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((64, 128)) / 11.3, jnp.bfloat16)
  a = ops.quantize(x, q, columnwise=False).rowwise
  b = ops.quantize(w, q, columnwise=False).rowwise
  bias = jnp.asarray(rng.standard_normal(64) * 0.5, jnp.bfloat16)
  run = jax.jit(lambda a, b, c: ops.gemm_gelu(a, b, bias=c))
  want = run(a, b, bias)

  def put(t, spec):
    return dataclasses.replace(t, data=jax.device_put(t.data, NamedSharding(mesh, spec)))

  for a_spec, b_spec in ((P("m", None), P("n", None)), (P(None, "n"), P("m", None))):
    got = run(put(a, a_spec), put(b, b_spec), jax.device_put(bias, NamedSharding(mesh, P())))
    for g, w_ in zip(got, want):
      np.testing.assert_array_equal(np.asarray(g).view(np.uint16), np.asarray(w_).view(np.uint16))
  assert np.abs(np.asarray(want[0], np.float32)).max() > 0
