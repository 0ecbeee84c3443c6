"""The reference grouped GEMMs (the specification the grouped kernels must match).

Both are `jax.lax.ragged_dot` semantics on the TN storage convention:
- `ragged_gemm`: rows of `a[L, K]` belong to groups, `b[G, N, K]` holds one matrix per group;
  `out[r, n] = sum_k a[r, k] b[group(r), n, k]`. Forward and data-gradient GEMMs.
- `per_group_gemm`: `a[M, L]` and `b[N, L]` share a token layout along the contraction axis;
  `out[g, m, n] = sum over positions l of group g of a[m, l] b[n, l]`. Weight-gradient GEMM.
As in `jaxquant.backends.reference.ops.gemm`: quantized operands are decoded exactly (blocks times
block scales, per-group scales for per-tensor FP8), products accumulate in float32, NVFP4's
second-level factors (per group, per token, or per group and feature) multiply the accumulator, and
two high-precision operands take a plain ragged dot in their own dtype.
"""

from __future__ import annotations

from typing import Optional, Union

import jax
import jax.numpy as jnp
from jax import lax

from jaxquant.formats import format_of
from jaxquant.grouping.layout import per_position
from jaxquant.grouping.tensors import GroupedScaledTensor, factor, positions, raw, token_factor
from jaxquant.tensors import ScaledTensor

Experts = Union[ScaledTensor, jax.Array]  # [G, N, K]: a leading expert axis

_PER_GROUP_DNUMS = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [1]), ([], [])), lhs_ragged_dimensions=[1],
    rhs_group_dimensions=[])


def high_precision(operand) -> bool:
  return not isinstance(operand, (ScaledTensor, GroupedScaledTensor)) or \
      operand.scale_inv is None


def _data(operand) -> jax.Array:
  return operand.data if isinstance(operand, (ScaledTensor, GroupedScaledTensor)) else operand


def _same_dtype(lhs, rhs):
  dtype = jnp.promote_types(lhs.dtype, rhs.dtype)
  return lhs.astype(dtype), rhs.astype(dtype)


def expert_raw(b: Experts) -> jax.Array:
  """float32 `[G, N, K]`: each expert decoded without its NVFP4 factor."""
  if not isinstance(b, ScaledTensor):
    return b.astype(jnp.float32)
  return jax.vmap(format_of(b.quantizer).dequantize_raw)(b)


def expert_factor(b: Experts) -> Optional[jax.Array]:
  """NVFP4 factor of each expert: `[G]`, or `[G, N]` when row-scaled; None otherwise."""
  if not isinstance(b, ScaledTensor) or b.amax is None:
    return None
  return format_of(b.quantizer).gemm_factor(b)


def ragged_gemm(a: GroupedScaledTensor, b: Experts, *, out_dtype,
                bias: Optional[jax.Array] = None, precision=None) -> jax.Array:
  """`[L, N]` in `a`'s layout (+ `bias[group(r)]`); rows of no group are zero."""
  sizes = a.layout.extents(a.group_sizes)
  group, _, _ = positions(a)
  bias_rows = None if bias is None else per_position(bias, group, 0)
  if high_precision(a) and high_precision(b):
    lhs, rhs = _same_dtype(_data(a), _data(b))
    out = lax.ragged_dot(lhs, jnp.swapaxes(rhs, 1, 2), sizes, precision=precision)
    if bias_rows is not None:
      out = out + bias_rows.astype(out.dtype)
    return out.astype(out_dtype)
  lhs, rhs = lax.optimization_barrier((raw(a), expert_raw(b)))
  acc = lax.ragged_dot(lhs, jnp.swapaxes(rhs, 1, 2), sizes, precision=lax.Precision.HIGHEST,
                       preferred_element_type=jnp.float32)
  lhs_factor = token_factor(a)
  if lhs_factor is not None:
    acc = acc * lhs_factor[:, None]
  rhs_factor = expert_factor(b)
  if rhs_factor is not None:
    rhs_factor = per_position(rhs_factor, group, 1.0)
    acc = acc * (rhs_factor[:, None] if rhs_factor.ndim == 1 else rhs_factor)
  if bias_rows is not None:
    acc = acc + bias_rows.astype(jnp.float32)
  return acc.astype(out_dtype)


def per_group_gemm(a: GroupedScaledTensor, b: GroupedScaledTensor, *, out_dtype,
                   precision=None) -> jax.Array:
  """`[G, M, N]`: one product per group over its token positions (empty groups give 0)."""
  sizes = a.layout.extents(a.group_sizes)
  if high_precision(a) and high_precision(b):
    lhs, rhs = _same_dtype(a.data, b.data)
    out = lax.ragged_dot_general(lhs, rhs, sizes, _PER_GROUP_DNUMS, precision=precision)
    return out.astype(out_dtype)
  lhs, rhs = lax.optimization_barrier((raw(a), raw(b)))
  acc = lax.ragged_dot_general(lhs, rhs, sizes, _PER_GROUP_DNUMS,
                               precision=lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)
  lhs_factor = factor(a)
  if lhs_factor is not None:
    acc = acc * (lhs_factor[:, None, None] if lhs_factor.ndim == 1 else lhs_factor[:, :, None])
  rhs_factor = factor(b)
  if rhs_factor is not None:
    acc = acc * (rhs_factor[:, None, None] if rhs_factor.ndim == 1 else rhs_factor[:, None, :])
  return acc.astype(out_dtype)
