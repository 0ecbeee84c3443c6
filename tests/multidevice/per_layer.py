"""Each quantized layer of a sharded Flax (linen) model against one device, on the same input
and output gradient.

A whole quantized model is not compared end to end: a sharded sum that differs from one
device's in its last bits may put a value on the other side of an FP8 rounding boundary in the
next layer's quantize, a whole FP8 step (2^-3 relative for E4M3), and the layers after carry
that on; no bound on the sums says how far. Each layer alone multiplies the same quantized
operands on both sides, so its values and gradients obey `bounds.py`'s bound. The layers are
taken from the model itself (the same attributes, logical axes and parameters), and applied
under the same mesh and `nn.logical_axis_rules`.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxquant as jq
import jaxquant.flax as jf
import bounds

# Layers linear in their input and kernel: one quantized contraction each.
LINEAR = (jf.Dense, jf.DenseGeneral)


def layers(model: nn.Module, variables, x, types=LINEAR) -> dict[tuple[str, ...], tuple]:
  """`{path: (layer, input)}` of every submodule of `types` that `model.apply` calls (traced
  abstractly), with `layer` an unbound copy and `input` the shape and dtype it was called on."""
  found = {}

  def record(next_fun, args, kwargs, context):
    if isinstance(context.module, types) and context.method_name == "__call__":
      found[context.module.scope.path] = (context.module.clone(parent=None),
                                          jax.ShapeDtypeStruct(args[0].shape, args[0].dtype))
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(record):
    jax.eval_shape(model.apply, variables, x)
  return found


def assert_layers_match_single_device(model: nn.Module, boxed, x, mesh, rules,
                                      rng: np.random.Generator, types=LINEAR) -> dict:
  """`assert_matches_single_device` for every layer of `types` in `model` (parameters `boxed`
  as `init` returned them, input `x`), on fresh random inputs and output gradients of the
  shapes and dtypes the layer sees; returns what `layers` found."""
  found = layers(model, nn.meta.unbox(boxed), x, types)
  assert found, f"no layer of {types} in {type(model).__name__}"
  for path, (layer, like) in found.items():
    params = subtree(boxed["params"], path)
    inputs = (exactly_normalizable(rng, like) if isinstance(layer, jf.LayerNormDense)
              else random_like(rng, like))
    out = jax.eval_shape(layer.apply, {"params": nn.meta.unbox(params)}, inputs)
    assert_matches_single_device(layer, params, inputs, random_like(rng, out), mesh, rules,
                                 "/".join(path))
  return found


def subtree(tree, path):
  for name in path:
    tree = tree[name]
  return tree


def _input_spec(layer, rules) -> P:
  if getattr(layer, "input_axes", ()):
    return nn.logical_to_mesh_axes(tuple(layer.input_axes), rules)
  return P(("dp", "fsdp"))


def assert_matches_single_device(layer: nn.Module, boxed_params, x, cotangent, mesh, rules,
                                 name: str) -> None:
  """`layer`'s output and its input, kernel and bias gradients, sharded on `mesh` by its own
  logical axes, within `bounds.py`'s bound of the same on one device.

  Args:
    layer: an unbound `jf.Dense` / `jf.DenseGeneral` (`layers` finds them) or
      `jf.LayerNormDense`. For a `LayerNormDense`, `x` must normalize exactly in float32 in any
      summation order (`exactly_normalizable`), so both sides quantize the same values; its
      input and norm-parameter gradients run the contraction's gradient through the
      normalization's backward, which no sum bound covers, and are not compared.
    boxed_params: its parameters as `init` returned them (boxed with logical names).
    x, cotangent: its input and output gradient (on the host).
    mesh, rules: the mesh and the logical axis rules of the sharded run.
    name: the layer's name in failure messages.
  """
  params = nn.meta.unbox(boxed_params)
  apply = lambda p, x: layer.apply({"params": p}, x)

  def f(p, x, c):
    y, vjp = jax.vjp(apply, p, x)
    return y, vjp(c)

  single = jax.jit(f)
  want = single(params, x, cotangent)
  single_report = jq.explain(f, params, x, cotangent)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed_params), mesh, rules)
    p = jax.device_put(params, nn.meta.unbox(shardings))
    spec = NamedSharding(mesh, _input_spec(layer, rules))
    xs = jax.device_put(x, spec)
    cs = jax.device_put(cotangent, NamedSharding(mesh, P(*spec.spec[:-1])))
    sharded_report = jq.explain(f, p, xs, cs)
    got = jax.jit(f)(p, xs, cs)

  normalized = isinstance(layer, jf.LayerNormDense)
  kernel, bias = params["kernel"], params.get("bias")
  if normalized:  # M of its contraction: a DenseGeneral like it, on the normalized input
    _, contracted = layer.clone(return_layernorm_output=True).apply({"params": params}, x)
    contraction = jf.DenseGeneral(kernel.shape[1:], axis=-1, use_bias=bias is not None,
                                  dtype=layer.dtype, recipe=layer.recipe, name=layer.name)
    m_y, (m_params, m_x) = bounds.linear_magnitudes(
        lambda p, x: contraction.apply({"params": p}, x),
        {k: v for k, v in params.items() if k in ("kernel", "bias")}, contracted, cotangent)
  else:
    m_y, (m_params, m_x) = bounds.linear_magnitudes(apply, params, x, cotangent)

  rows, k = math.prod(x.shape[:-1]), x.shape[-1]
  sums = bounds.gemm_sums(single_report, sharded_report, mesh,
                          {"fprop": k, "dgrad": math.prod(kernel.shape[1:]), "wgrad": rows})
  (y_got, (g_got, dx_got)), (y_want, (g_want, dx_want)) = jax.device_get((got, want))
  checks = [("y", y_got, y_want, m_y, sums["fprop"], _bias_magnitude(bias, y_want)),
            ("kernel gradient", g_got["kernel"], g_want["kernel"], m_params["kernel"],
             sums["wgrad"], 0.0)]
  if not normalized:
    checks.append(("input gradient", dx_got, dx_want, m_x, sums["dgrad"], 0.0))
  if bias is not None and np.dtype(cotangent.dtype) == np.dtype(np.float32):
    # db: XLA's float32 sum of the output gradient's rows (a bf16 one has no useful bound).
    checks.append(("bias gradient", g_got["bias"], g_want["bias"], m_params["bias"],
                   bounds.Sum(rows), 0.0))
  # The GEMMs round to the layer's computation dtype (a parameter's gradient is cast after).
  dtype = layer.dtype or jnp.result_type(x.dtype, kernel.dtype)
  for what, g, w, m, how, b in checks:
    bounds.assert_within(g, w, m, how, f"{name}: {what}", bias_magnitude=b, out_dtype=dtype)


def _bias_magnitude(bias, y) -> Any:
  if bias is None:
    return 0.0
  return np.broadcast_to(np.abs(np.asarray(bias, np.float64)).reshape(
      (1,) * (y.ndim - bias.ndim) + bias.shape), y.shape)


def random_like(rng: np.random.Generator, like) -> jax.Array:
  """Standard normal values of `like`'s shape and dtype."""
  return jnp.asarray(rng.standard_normal(like.shape), like.dtype)


def exactly_normalizable(rng: np.random.Generator, like) -> jax.Array:
  """Rows of small integers summing to zero (width a power of two): a LayerNorm's mean (0) and
  variance (a sum of squares below 2^24, divided by the width) are exact in any order."""
  shape = like.shape
  assert shape[-1] & (shape[-1] - 1) == 0, shape
  half = rng.integers(-8, 9, shape[:-1] + (shape[-1] // 2,))
  rows = np.concatenate([half, -half], axis=-1)
  return jnp.asarray(rng.permuted(rows, axis=-1), like.dtype)
