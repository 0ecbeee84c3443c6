"""A dense layer's output returned as separate parts: the q, k and v of a packed projection.

A packed projection (one `[K, 3, H, D]` kernel, one GEMM) is sliced into q, k and v by the model,
and autodiff joins their gradients back into `d(qkv)` outside the contraction: an XLA copy of
the whole gradient that the output-gradient quantize then reads again. With `SplitOutput` as
the epilogue of `jaxquant.dense` the contraction itself returns the parts, so their cotangents
reach its backward apart, where `gradient` quantizes them where they lie
(`jaxquant.ops.fused.parts_quantize`: the kernels read each tile from its part) with the bias
gradient as the kernel's column sums, docs/design.md decision 64. Where that cannot serve (a
format without fused kernels, a sharded layer, `JAXQUANT_FUSE_PRODUCERS=off`: the A/B switch of
every fused producer) `join` stacks them and the dense quantizes the joined gradient, recorded
for `jaxquant.explain`. Values and gradients are the unsplit layer's, bit for bit, but for the
bias gradient of the parts path: float32 column sums in the kernels' fixed order (as the fused
MLP's), where the unsplit layer reduces in dy's dtype.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from jaxquant.explain import Decision, record
from jaxquant.ops import fused as fused_ops
from jaxquant.quantizers import Quantizer
from jaxquant.settings import env_choice
from jaxquant.tensors import QuantizedTensor


def _materialized(cotangents, part_shape: tuple[int, ...], dtype) -> list[jax.Array]:
  """The parts' cotangents as arrays of `dtype` (a symbolic zero: zeros)."""
  return [jnp.zeros(part_shape, dtype) if isinstance(c, SymbolicZero) or c is None
          else c.astype(dtype) for c in cotangents]


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
    if len(cotangents) != shape[axis]:
      raise ValueError(f"cotangents: expected {shape[axis]} parts, got {len(cotangents)}")
    parts = _materialized(cotangents, shape[:axis] + shape[axis + 1:], dtype)
    return jnp.stack(parts, axis=axis)

  @staticmethod
  def gradient(cotangents, shape: tuple[int, ...], feature_ndim: int, dtype,
               quantizer: Quantizer, state: Any, *, rowwise: bool, columnwise: bool,
               dbias: bool, sharded: bool,
               role=None) -> Optional[tuple[QuantizedTensor, Optional[jax.Array]]]:
    """(the output's gradient `[rows, prod(features)]` quantized from the parts where they
    lie, its float32 column sums `[prod(features)]` or None), or None where the parts quantize
    does not serve (recorded, with why): the caller then joins them (`join`)."""
    axis = len(shape) - feature_ndim
    reason = fused_ops.fusion_unsupported(quantizer)
    if reason is None and env_choice("JAXQUANT_FUSE_PRODUCERS", ("auto", "on", "norms", "off"),
                                     "auto") == "off":
      reason = "JAXQUANT_FUSE_PRODUCERS=off"
    if reason is None and sharded:
      reason = "the parts are quantized where they lie on unsharded dense layers only"
    if reason is not None:
      record(Decision("quantize", role, f"output gradient's {shape[axis]} parts joined, then "
                      "quantized", "joined", reason))
      return None
    rows = math.prod(shape[:axis])
    parts = [p.reshape(rows, -1)
             for p in _materialized(cotangents, shape[:axis] + shape[axis + 1:], dtype)]
    return fused_ops.parts_quantize(parts, quantizer=quantizer,
                                    rowwise=rowwise or not columnwise, columnwise=columnwise,
                                    state=state, dbias=dbias, role=role)
