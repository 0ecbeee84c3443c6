"""Grouped GEMMs on the bfloat16 CUTLASS kernel: quantized operands decoded to bfloat16 by XLA
(`jaxquant.grouping.decode`), high-precision (Identity) bfloat16 operands as they are.

This is the route `support.gemm_kernel` takes for MXFP8, NVFP4 (row-scaled, 2-D, RHT included),
power-of-two Float8Block and per-tensor FP8 pairs the FP8 CUTLASS instances do not serve (mixed
formats, a bias, E5M2 x E5M2, ...), and for GEMMs with high-precision operands. The decode is
exact, the kernel sums in float32 and multiplies each group's sums by the product of the
per-group factors (per-tensor FP8 scales, NVFP4's per-tensor second level); the epilogue then
multiplies by row-scaled tokens' per-row factors (in float32, then the one rounding:
`rows_in_epilogue`); other per-row / per-(group, column) NVFP4 factors and the bias are applied
by XLA to a float32 output, in the reference's order (factors, then bias), then cast; two
high-precision operands give a bfloat16 output first, as the reference's ragged_dot does.
Results equal `jaxquant.backends.reference.grouped` within float32 summation order (and one
bfloat16 rounding where that rounds).

`JAXQUANT_GROUPED_GEMM_KERNEL=mma_sync` (read when the GEMM is traced) sends quantized pairs
to the mma.sync kernel (`jaxquant_grouped_gemm`, in-kernel decode) instead, so both can be timed
in one process; the default ("auto") decodes.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant.backends.ffi.grouped import bf16, decode_kernel
from jaxquant.formats import format_of
from jaxquant.grouping import decode
from jaxquant.grouping.layout import per_position
from jaxquant.grouping.tensors import GroupedScaledTensor, positions, row_scaled
from jaxquant.tensors import ScaledTensor
from jaxquant.settings import env_choice

KERNEL_ENV = "JAXQUANT_GROUPED_GEMM_KERNEL"
KERNEL_CHOICES = ("auto", "mma_sync")


def kernel_choice() -> str:
  """`JAXQUANT_GROUPED_GEMM_KERNEL` ("auto" when unset); an unknown value is an error."""
  return env_choice(KERNEL_ENV, KERNEL_CHOICES, "auto")


def high_precision(operand) -> bool:
  return not isinstance(operand, (ScaledTensor, GroupedScaledTensor)) or \
      operand.scale_inv is None


def _dtype(operand):
  """The dtype the kernel would read: bfloat16 for decoded operands, else the data's."""
  data = operand.data if isinstance(operand, (ScaledTensor, GroupedScaledTensor)) else operand
  return np.dtype(data.dtype) if high_precision(operand) else np.dtype(jnp.bfloat16)


def _has_rows(o) -> bool:
  return (not high_precision(o) and getattr(o, "amax", None) is not None
          and row_scaled(o.quantizer))


def rows_in_epilogue(a, b, out_dtype, bias=None, b_k_major: bool = True) -> bool:
  """Whether the kernel's epilogue applies `a`'s per-row (per-token) factors: row-scaled tokens
  times experts without per-column factors, no bias, an output the row-scaled instances write
  (`bf16.row_scale_reason`). Else XLA applies them to a float32 output."""
  return (a.token_axis == 0 and _has_rows(a) and not _has_rows(b) and bias is None
          and bf16.row_scale_reason(0, out_dtype, b_k_major=b_k_major) is None)


def _kernel_out(a, b, out_dtype, bias, b_k_major: bool = True):
  """The kernel's output dtype: bfloat16 for two high-precision operands (the reference's
  ragged_dot rounds to their dtype, then adds the bias and casts), else `out_dtype` unless XLA
  finishes the output (per-row factors the epilogue does not apply, a bias, an output the
  kernel lacks: float32)."""
  if high_precision(a) and high_precision(b):
    return np.dtype(jnp.bfloat16)
  if rows_in_epilogue(a, b, out_dtype, bias, b_k_major):
    return np.dtype(out_dtype)
  rows = _has_rows(a) or _has_rows(b)
  if rows or bias is not None or np.dtype(out_dtype) not in bf16.OUT_DTYPES:
    return np.dtype(np.float32)
  return np.dtype(out_dtype)


def route_reason(a: GroupedScaledTensor, b, out_dtype, bias=None,
                 exact: bool = True) -> Optional[str]:
  """Why this GEMM cannot run decoded on the bfloat16 kernel (None: it can). `exact`: whether
  the quantized operands decode exactly to bfloat16 (the caller's format check)."""
  choice = kernel_choice()  # validated for every GEMM, not only quantized ones
  if choice == "mma_sync" and not (high_precision(a) and high_precision(b)):
    return f"{KERNEL_ENV}=mma_sync"
  if not exact:
    return "an operand does not decode exactly to bfloat16"
  reason = bf16.device_reason()
  if reason is not None:
    return reason
  kernel_out = _kernel_out(a, b, out_dtype, bias)
  block = a.layout.block if a.token_axis == 1 else None
  return bf16.shape_reason(a.token_axis, a.shape, b.shape, a_dtype=_dtype(a), b_dtype=_dtype(b),
                           out_dtype=kernel_out, token_block=block)


def n_major_reason(a: GroupedScaledTensor, stored_kn: ScaledTensor, out_dtype,
                   bias=None) -> Optional[str]:
  """Why the forward GEMM of `a` (rows) with experts held as their `[G, K, N]` copy
  `stored_kn` cannot read that copy's decoded values along N (None: it can): the NN instances
  write bfloat16 only, and per-(group, feature) factors would need the other layout."""
  if a.token_axis != 0:
    return "not a ragged-rows GEMM"
  fmt = format_of(stored_kn.quantizer)
  if not (fmt.stores_raw(stored_kn) or fmt.columnwise_is_transposed_rowwise(stored_kn.quantizer)):
    return (f"{stored_kn.quantizer}'s blocks run along K in the [G, N, K] copy: decoding the "
            "[G, K, N] one as stored would read them along N")
  if getattr(stored_kn, "amax", None) is not None and row_scaled(stored_kn.quantizer):
    return "row-scaled experts: their factors run along the [G, N, K] copy's rows"
  kernel_out = _kernel_out(a, stored_kn, out_dtype, bias, b_k_major=False)
  return bf16.shape_reason(0, a.shape, stored_kn.shape, a_dtype=_dtype(a),
                           b_dtype=_dtype(stored_kn), out_dtype=kernel_out, b_k_major=False)


def kernel_label(a: GroupedScaledTensor, b, out_dtype, bias=None, b_k_major: bool = True) -> str:
  """What `jaxquant.explain` names the kernel of a GEMM `route_reason` accepts (`b_k_major`
  False: experts read along N from their `[G, K, N]` copy)."""
  label = bf16.kernel_label(a.token_axis, a.shape, a.groups,
                            _kernel_out(a, b, out_dtype, bias, b_k_major), b_k_major=b_k_major,
                            row_scaled=rows_in_epilogue(a, b, out_dtype, bias, b_k_major),
                            b_shape=b.shape)
  if high_precision(a) and high_precision(b):
    return label
  return label + " on operands decoded to bfloat16"


def gemm(a: GroupedScaledTensor, b, *, out_dtype, bias: Optional[jax.Array] = None,
         b_k_major: bool = True) -> jax.Array:
  """`jaxquant.grouped.gemm` of a pair `route_reason` accepts; `b_k_major=False`: experts `b`
  given as their `[G, K, N]` copy (`n_major_reason` accepts it), decoded as stored and read
  along N."""
  starts = bf16.group_starts(a.layout.extents(a.group_sizes))
  da = decode.tokens(a, decode_kernel.raw_bf16)
  db = (decode.experts(b, decode_kernel.raw_bf16) if a.token_axis == 0
        else decode.tokens(b, decode_kernel.raw_bf16))
  kernel_out = _kernel_out(a, b, out_dtype, bias, b_k_major)
  epilogue_rows = rows_in_epilogue(a, b, out_dtype, bias, b_k_major)
  out = bf16.gemm(da.values, db.values, starts, mode=a.token_axis, out_dtype=kernel_out,
                  alpha=decode.group_alpha(da, db), b_k_major=b_k_major,
                  row_scale=da.rows if epilogue_rows else None)
  if epilogue_rows or (da.rows is None and db.rows is None and bias is None):
    return out.astype(out_dtype)
  if a.token_axis == 0:
    group, _, _ = positions(a)
    if da.rows is not None:  # [L]
      out = out * da.rows[:, None]
    if db.rows is not None:  # [G, N]
      out = out * per_position(db.rows, group, 1.0)
    if bias is not None:  # in the output's dtype (float32; bfloat16 for two bf16 operands)
      out = out + per_position(bias, group, 0).astype(out.dtype)
  else:
    if da.rows is not None:  # [G, M]
      out = out * da.rows[:, :, None]
    if db.rows is not None:  # [G, N]
      out = out * db.rows[:, None, :]
  return out.astype(out_dtype)
