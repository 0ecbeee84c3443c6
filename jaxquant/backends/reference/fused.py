"""The fused producers' reference composition: the producer in the spec's exact arithmetic
(`jaxquant.numerics.normalization` / `activations`), rounded to its output dtype, then the
format's reference quantize. The FFI kernels (`jaxquant.backends.ffi.fused`) equal it bit for
bit; it takes the same arguments and returns the same `Fused` results.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxquant.backends.producers import Fused, Inputs, Producer
from jaxquant.backends.reference.ops import quantize_single
from jaxquant.formats.base import tensor_amax
from jaxquant.numerics import activations as act
from jaxquant.numerics.normalization import norm_apply, norm_statistics
from jaxquant.numerics.reductions import column_tile_sums
from jaxquant.quantizers import Quantizer


def produce(producer: Producer, inputs: Inputs) -> jax.Array:
  """The producer's output `[rows, C]` in `producer.out_dtype`."""
  if producer.kind == "parts":  # the values as they are, side by side
    return jnp.concatenate([inputs.a, *inputs.more], axis=1).astype(producer.out_dtype)
  a = jnp.asarray(inputs.a, jnp.float32)
  if producer.norm:
    values = norm_apply(a, inputs.mean, inputs.rsigma, inputs.scale, inputs.bias)
  elif producer.kind == "activation":
    if producer.gated:
      cols = a.shape[1] // 2
      values = act.gated_activation(producer.activation, a[:, :cols], a[:, cols:])
    else:
      values = act.activation(producer.activation, a)
  elif producer.gated:
    n = a.shape[1]
    h = jnp.asarray(inputs.b, jnp.float32)
    dh0, dh1 = act.gated_activation_backward(producer.activation, a, h[:, :n], h[:, n:])
    values = jnp.concatenate([dh0, dh1], axis=1)
  else:
    values = act.activation_backward(producer.activation, a, inputs.b)
  # The barrier keeps the rounding to the output dtype: XLA:GPU (xla_allow_excess_precision,
  # on by default) removes a convert to bfloat16 and back inside a fusion, so the quantize below
  # would read the unrounded float32 value (1-4% of the FP8 codes one step off on an H100).
  return jax.lax.optimization_barrier(values.astype(producer.out_dtype))


def norm_stats(x2d: jax.Array, scale: Optional[jax.Array], bias: Optional[jax.Array],
               producer: Producer, *, amax: int = 0, gate: Optional[jax.Array] = None):
  """`jaxquant.backends.ffi.fused.norm_stats`'s results: (mean or None, rsigma, amax or None)."""
  mean, rsigma = norm_statistics(x2d, norm_type=producer.kind, epsilon=producer.epsilon)
  value = None
  if amax:
    y = produce(producer, Inputs(x2d, mean=mean, rsigma=rsigma, scale=scale, bias=bias))
    value = tensor_amax(y)
    if amax == 2:
      value = jnp.where(jnp.asarray(gate, jnp.float32).reshape(()) == 0, value, jnp.float32(0))
  return mean, rsigma, value


def producer_amax(producer: Producer, inputs: Inputs,
                  gate: Optional[jax.Array] = None) -> jax.Array:
  value = tensor_amax(produce(producer, inputs))
  if gate is not None:
    value = jnp.where(jnp.asarray(gate, jnp.float32).reshape(()) == 0, value, jnp.float32(0))
  return value


def fused_quantize(producer: Producer, inputs: Inputs, quantizer: Quantizer, *, rowwise: bool,
                   columnwise: bool, orig_dtype: Any, state: Any = None, write_y: bool = False,
                   col_sums: bool = False, amax: Optional[jax.Array] = None) -> Fused:
  """The reference composition: produce, then quantize (and the column sums of the output).
  `amax` (the FFI path's precomputed amax) is not needed: the reference quantize takes it."""
  del amax
  y = produce(producer, inputs)
  row, col = quantize_single(y, quantizer, rowwise=rowwise, columnwise=columnwise,
                             orig_dtype=orig_dtype, state=state)
  return Fused(row, col, y if write_y else None, column_tile_sums(y) if col_sums else None)
