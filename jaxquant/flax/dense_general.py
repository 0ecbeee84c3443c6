"""`jaxquant.flax.DenseGeneral`: `flax.linen.DenseGeneral` with a quantized contraction.

`dense_general_contraction(module, inputs)` is the module's body as a function of any module
with `flax.linen.DenseGeneral`'s attributes, so `quantize_dense` runs it for an unmodified
`nn.DenseGeneral` (same parameters, same initialization).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence, Union

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxquant.flax.quantization import (logical_init, module_key, module_quantizers,
                                        module_sharding, module_states, module_weight)
from jaxquant.layers.dense import dense, prepare_weight, runs_unquantized
from jaxquant.recipes import Recipe

default_kernel_init = nn.initializers.lecun_normal()


def _as_tuple(value: Union[int, Sequence[int]], name: str) -> tuple[int, ...]:
  if isinstance(value, (int, np.integer)):
    return (int(value),)
  try:
    return tuple(int(v) for v in value)
  except TypeError:
    raise TypeError(f"{name}: expected an int or a sequence of ints, got {value!r}") from None


def _normalize_axes(axes: tuple[int, ...], ndim: int, name: str) -> tuple[int, ...]:
  for ax in axes:
    if not -ndim <= ax < ndim:
      raise ValueError(f"{name}={axes}: axis {ax} is out of range for an input of rank {ndim}")
  normalized = tuple(sorted(ax % ndim for ax in axes))  # sorted, as Flax: fixes kernel layout
  if len(set(normalized)) != len(normalized):
    raise ValueError(f"{name}={axes}: repeated axes")
  return normalized


def _flat_init(init, n_batch: int, n_axis: int, n_features: int):
  """Initialize as a 2-D matrix `[batch * contracted, features]` (or a vector `[batch *
  features]` when `n_axis` is None) and reshape, exactly as Flax's DenseGeneral does, so the
  same rng gives the same parameters (fan-in and fan-out of the flattened matrix)."""

  def wrapped(rng, shape, dtype=jnp.float32):
    batch = int(np.prod(shape[:n_batch]))
    feats = int(np.prod(shape[len(shape) - n_features:]))
    if n_axis is None:
      flat_shape = (batch * feats,)
    else:
      flat_shape = (batch * int(np.prod(shape[n_batch:n_batch + n_axis])), feats)
    value = init(rng, flat_shape, dtype)
    if isinstance(value, nn.meta.AxisMetadata):
      return nn.meta.replace_boxed(value, jnp.reshape(value.unbox(), shape))
    return jnp.reshape(value, shape)

  return wrapped


def _strip_batch(sharding, n_batch: int):
  """The per-element `DenseSharding` of a vmapped contraction: the specs without their
  `batch_dims` entries, which must be unsharded."""
  if sharding is None or not n_batch:
    return sharding
  specs = {}
  for field in ("x", "kernel"):
    spec = getattr(sharding, field)
    if spec is None:
      specs[field] = None
      continue
    entries = tuple(spec) + (None,) * max(0, n_batch - len(tuple(spec)))
    if any(e is not None for e in entries[:n_batch]):
      raise ValueError(f"DenseGeneral: the batch_dims axes of the {field} map to mesh axes "
                       f"{entries[:n_batch]}; each batch element is its own GEMM, so these "
                       "axes must stay unsharded (map their logical names to None)")
    specs[field] = jax.sharding.PartitionSpec(*entries[n_batch:])
  return dataclasses.replace(sharding, **specs)


class DenseGeneral(nn.Module):
  """A linear transformation over any input axes, quantized by a recipe.

  Same attributes and parameter tree as `flax.linen.DenseGeneral` (`kernel [batch..., axis...,
  features...]`, `bias [batch..., features...]`, initialized the same way), so checkpoints load into
  either. The contracted `axis` are moved to the end and flattened into the GEMM's contraction (in
  increasing axis order, as Flax lays out the kernel); the remaining non-batch axes become its rows.
  Each `batch_dims` element is its own quantized GEMM (`jax.vmap`): own per-tensor scales, own
  delayed-scaling state.

  Example::

    layer = jaxquant.flax.DenseGeneral((heads, head_dim), recipe=jaxquant.MXFP8BlockScaling())
    variables = layer.init(jax.random.key(0), x)  # x: [batch, seq, hidden]
    qkv = layer.apply(variables, x)               # [batch, seq, heads, head_dim]

  Attributes:
    features: int or tuple of output features.
    axis: int or tuple of input axes to contract.
    batch_dims: leading input axes (consecutive from 0) with one kernel per element.
    use_bias: whether to add a bias.
    dtype: computation dtype (None: inferred from inputs and params).
    param_dtype: dtype of the parameters.
    kernel_init: initializer of the kernel (called on the flattened 2-D shape).
    bias_init: initializer of the bias (called on the flattened 1-D shape).
    precision: precision of high-precision (Identity) contractions.
    recipe: quantization recipe; None: the innermost `jaxquant.autocast`, or no quantization.
    kernel_axes: logical names of the kernel's axes `(batch..., axis..., features...)`, as
      `jaxquant.flax.Dense`'s (the kernel is boxed with them; the bias takes the batch and
      feature names).
    input_axes: logical names of the input's axes (one per input axis), as `Dense`'s: under a
      mesh the input keeps that spec and FSDP axes are told apart. `batch_dims` axes must map
      to no mesh axis (each batch element is its own vmapped GEMM).
    reduce_dtype: dtype of the partial-sum reductions of K-sharded GEMMs under a mesh, as
      `Dense`'s.
  """

  features: Union[int, Sequence[int]]
  axis: Union[int, Sequence[int]] = -1
  batch_dims: Sequence[int] = ()
  use_bias: bool = True
  dtype: Optional[Any] = None
  param_dtype: Any = jnp.float32
  kernel_init: Any = default_kernel_init
  bias_init: Any = nn.initializers.zeros_init()
  precision: Any = None
  recipe: Optional[Recipe] = None
  kernel_axes: tuple = ()
  input_axes: tuple = ()
  reduce_dtype: Optional[Any] = None

  @nn.compact
  def __call__(self, inputs: jax.Array) -> jax.Array:
    return dense_general_contraction(self, inputs)


def dense_general_contraction(module: nn.Module, inputs: jax.Array, *,
                              recipe: Optional[Recipe] = None,
                              promote_dtype: Callable = nn.dtypes.promote_dtype) -> jax.Array:
  """`flax.linen.DenseGeneral.__call__` of `module` (any module with its attributes), with the
  contraction quantized by `recipe` (default: the module's `recipe` attribute, else the
  innermost `jaxquant.autocast`; none, or an all-Identity recipe without a sharding plan:
  Flax's own contraction, see `jaxquant.layers.dense.runs_unquantized`). Call it inside the
  module's scope (from its `__call__` or an interceptor): parameters are created there. The
  sharding attributes (`kernel_axes`, `input_axes`, `reduce_dtype`) are read where the module
  has them."""
  features = _as_tuple(module.features, "features")
  ndim = inputs.ndim
  axis = _normalize_axes(_as_tuple(module.axis, "axis"), ndim, "axis")
  batch_dims = _normalize_axes(_as_tuple(module.batch_dims, "batch_dims"), ndim, "batch_dims")
  if set(batch_dims) != set(range(len(batch_dims))):
    raise ValueError(f"batch_dims={tuple(module.batch_dims)} must be consecutive leading axes "
                     "starting from 0")
  if set(axis) & set(batch_dims):
    raise ValueError(f"axis={tuple(module.axis)} and batch_dims={tuple(module.batch_dims)} "
                     "overlap; an axis is either contracted or a batch axis")
  n_batch, n_axis, n_features = len(batch_dims), len(axis), len(features)
  batch_shape = tuple(inputs.shape[ax] for ax in batch_dims)
  kernel_axes = tuple(getattr(module, "kernel_axes", ()) or ())
  input_axes = tuple(getattr(module, "input_axes", ()) or ())
  if kernel_axes and len(kernel_axes) != n_batch + n_axis + n_features:
    raise ValueError(f"kernel_axes={kernel_axes}: expected {n_batch + n_axis + n_features} "
                     "names (batch_dims, axis, features)")
  if input_axes and len(input_axes) != ndim:
    raise ValueError(f"input_axes={input_axes}: expected {ndim} names, one per input axis")
  kernel = module.param("kernel", logical_init(
      _flat_init(module.kernel_init, n_batch, n_axis, n_features), kernel_axes),
                        batch_shape + tuple(inputs.shape[ax] for ax in axis) + features,
                        module.param_dtype)
  bias = None
  if module.use_bias:
    bias_axes = kernel_axes[:n_batch] + kernel_axes[len(kernel_axes) - n_features:]
    bias = module.param("bias", logical_init(
        _flat_init(module.bias_init, n_batch, None, n_features), bias_axes),
                        batch_shape + features, module.param_dtype)
  param_kernel = kernel  # quantized weights are read in the parameter dtype (jaxquant.dense)
  inputs, kernel, bias = promote_dtype(inputs, kernel, bias, dtype=module.dtype)

  quantizers = module_quantizers(module, recipe=recipe)
  # Batch axes first, then the rows of the GEMM, then the contracted axes (sorted):
  # the output [batch..., rows..., features...] is laid out as dot_general's.
  free = tuple(ax for ax in range(ndim) if ax not in axis and ax not in batch_dims)
  order = batch_dims + free + axis
  sharding = None
  if quantizers is not None:
    input_names = tuple(input_axes[ax] for ax in order) if input_axes else None
    sharding = _strip_batch(module_sharding(module, kernel.shape, kernel.dtype, input_names),
                            n_batch)
  if runs_unquantized(quantizers, sharding, what="DenseGeneral"):  # Flax's own contraction
    out = jax.lax.dot_general(inputs, kernel,
                              ((axis, tuple(range(n_batch, n_batch + n_axis))),
                               (batch_dims, tuple(range(n_batch)))), precision=module.precision)
    if bias is not None:
      bias_shape = tuple(inputs.shape[ax] if ax in batch_dims else 1
                         for ax in range(ndim) if ax not in axis)
      out = out + jnp.reshape(bias, bias_shape + features)
    return out

  inputs = jnp.transpose(inputs, order)
  key = module_key(module, quantizers)
  states = module_states(module, quantizers, batch_shape=batch_shape)

  def prepare(x, w, k, s):
    return prepare_weight(x, w, quantizers, state=None if s is None else s[1], key=k,
                          contracting_dims=n_axis, sharding=sharding)

  def contract(x, w, b, k, s, weight):
    return dense(x, w, b, quantizers, key=k, states=s, contracting_dims=n_axis,
                 precision=module.precision, sharding=sharding, weight=weight)

  if n_batch:
    key = None if key is None else jax.random.split(key, batch_shape)
    for _ in range(n_batch):
      prepare, contract = jax.vmap(prepare), jax.vmap(contract)
  weight = module_weight(module, lambda: prepare(inputs, param_kernel, key, states))
  return contract(inputs, param_kernel, bias, key, states, weight)
