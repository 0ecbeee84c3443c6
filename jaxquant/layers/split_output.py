"""A dense layer's output returned as separate parts: the q, k and v of a packed projection.

A packed projection (one `[K, 3, H, D]` kernel, one GEMM) is sliced into q, k and v by the model,
and autodiff joins their gradients back into `d(qkv)` outside the contraction: an XLA copy of
the whole gradient that the output-gradient quantize then reads again. With `SplitOutput` as
the epilogue of `jaxquant.dense` the contraction itself returns the parts, so their cotangents
reach its backward apart (`join` stacks them there, today; a quantize that reads the parts
where they are is the planned next step, docs/design.md's decision 64). The values and
gradients are the unsplit layer's, bit for bit.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero


@dataclasses.dataclass(frozen=True)
class SplitOutput:
  """`jaxquant.dense`'s epilogue returning the output's first feature axis (of the kernel's
  output axes, at least two) as separate arrays, each keeping the other feature axes."""

  in_gemm = False  # (read by jaxquant.layers.dense: no GEMM epilogue)

  @staticmethod
  def outputs(y: jax.Array, feature_ndim: int) -> tuple[jax.Array, ...]:
    """The parts of `y` (its last `feature_ndim` axes the features) along its first feature
    axis."""
    axis = y.ndim - feature_ndim
    return tuple(jax.lax.index_in_dim(y, i, axis, keepdims=False) for i in range(y.shape[axis]))

  @staticmethod
  def join(cotangents, shape: tuple[int, ...], feature_ndim: int, dtype) -> jax.Array:
    """The output's cotangent `[*shape]` from the parts' (a symbolic zero: zeros)."""
    axis = len(shape) - feature_ndim
    part_shape = shape[:axis] + shape[axis + 1:]
    parts = [jnp.zeros(part_shape, dtype) if isinstance(c, SymbolicZero) or c is None
             else c.astype(dtype) for c in cotangents]
    if len(parts) != shape[axis]:
      raise ValueError(f"cotangents: expected {shape[axis]} parts, got {len(parts)}")
    return jnp.stack(parts, axis=axis)
