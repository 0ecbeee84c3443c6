"""The grouped GEMMs through `jaxquant_grouped_gemm` or, for per-tensor FP8 and Float8Block on
Hopper, its CUTLASS twin `jaxquant_grouped_gemm_sm90`, or, for operands decoded to bfloat16,
the bfloat16 CUTLASS kernel (`decoded`; `support.gemm_kernel` picks; one call per GEMM; the
CUTLASS kernel's configuration, `sm90_configs`, is read when the GEMM is traced).

Same contract as `jaxquant.backends.reference.grouped` (`ragged_gemm` for a rowwise `a`,
`per_group_gemm` for a columnwise one): the kernel decodes each operand exactly (payload times block
scale), sums in float32, and its epilogue multiplies the accumulator by what the reference
multiplies: per-tensor FP8 scales and NVFP4 per-tensor factors of both operands as one per-group
product, NVFP4 per-token / per-(group, feature) factors as row / column factors, then adds the bias.
Results equal the reference up to float32 accumulation order.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant.backends.ffi import calls
from jaxquant.backends.ffi.grouped import decoded, support
from jaxquant.backends.reference import grouped as reference
from jaxquant.grouping.tensors import GroupedScaledTensor, factor, token_factor

_PLACEHOLDER_U8 = np.zeros((1,), np.uint8)
_PLACEHOLDER_F32 = np.zeros((1,), np.float32)


def _scale_bytes(operand) -> jax.Array:
  """Block scales as the kernel reads them: E8M0 / E4M3 bytes, Float8Block's float32."""
  scaling = support.gemm_scaling(operand)
  if scaling == 0:
    return jnp.asarray(_PLACEHOLDER_U8)
  if scaling >= 4:
    return operand.scale_inv.astype(jnp.float32)
  return jax.lax.bitcast_convert_type(operand.scale_inv, jnp.uint8)


def _per_group(operand) -> Optional[jax.Array]:
  """The operand's per-tensor scale of each group: FP8 `scale_inv [G]`, else None."""
  if support.gemm_scaling(operand) == 0:
    return operand.scale_inv.astype(jnp.float32)
  return None


def gemm(a: GroupedScaledTensor, b, *, out_dtype, bias: Optional[jax.Array] = None,
         precision=None, stored_kn=None, accumulation: str = "split") -> jax.Array:
  """`jaxquant.grouped.gemm` on the FFI (`support.gemm_unsupported(a, b)` must be None).
  `stored_kn`: experts `b` held as their `[G, K, N]` copy (`TransposedExperts.stored`; `b` is
  its `[G, N, K]` materialization), read N-major where the decoded route takes that layout
  (`decoded.n_major_reason`). `accumulation`: the FP8 accumulation of the GEMM's direction
  (`fp8_accumulation`), which picks the CUTLASS configuration (`support.sm90_selection`)."""
  del precision  # quantized operands: exact decode; `accumulation` says how FP8 products sum
  reason = support.gemm_unsupported(a, b, out_dtype)
  if reason is not None:
    raise ValueError(f"grouped FFI GEMM cannot serve this pair: {reason}")
  if support.gemm_kernel(a, b, out_dtype, bias, accumulation)[0] == support.GEMM_BF16_TARGET:
    if stored_kn is not None and decoded.n_major_reason(a, stored_kn, out_dtype, bias) is None:
      return decoded.gemm(a, stored_kn, out_dtype=out_dtype, bias=bias, b_k_major=False)
    return decoded.gemm(a, b, out_dtype=out_dtype, bias=bias)
  groups = a.groups
  pstarts = jnp.concatenate([jnp.zeros((1,), jnp.int32),
                             jnp.cumsum(a.layout.extents(a.group_sizes).astype(jnp.int32))])
  group_factors = [f for f in (_per_group(a), _per_group(b)) if f is not None]
  row_factor = col_factor = None
  if a.token_axis == 0:
    mode, (rows, _), n = 0, a.shape, b.shape[1]
    out_shape = (rows, n)
    lhs = token_factor(a)  # [L] or None
    if lhs is not None:
      row_factor = lhs.astype(jnp.float32)
    rhs = reference.expert_factor(b)  # [G] or [G, N]
    if rhs is not None:
      if rhs.ndim == 1:
        group_factors.append(rhs)
      else:
        col_factor = rhs.reshape(-1)
  else:
    mode, m, n = 1, a.shape[0], b.shape[0]
    out_shape = (groups, m, n)
    for f, is_row in ((factor(a), True), (factor(b), False)):
      if f is None:
        continue
      if f.ndim == 1:
        group_factors.append(f)
      elif is_row:
        row_factor = f.reshape(-1)
      else:
        col_factor = f.reshape(-1)
  group_factor = None
  for f in group_factors:
    f = f.astype(jnp.float32)
    group_factor = f if group_factor is None else group_factor * f
  if bias is not None:
    bias = bias.astype(jnp.float32).reshape(-1)
  as_f32 = lambda v: jnp.asarray(_PLACEHOLDER_F32) if v is None else v.astype(jnp.float32)
  target, _ = support.gemm_kernel(a, b, out_dtype, bias, accumulation)
  results = [jax.ShapeDtypeStruct(out_shape, np.dtype(out_dtype))]
  sm90_attributes = {}
  if target == support.GEMM_SM90_TARGET:  # + its workspace (per-group arguments, TMA descriptors)
    workspace = support.sm90_workspace_bytes(groups, support.sm90_block_scale_floats(a, b))
    results.append(jax.ShapeDtypeStruct((workspace,), np.uint8))
    sm90_attributes = support.sm90_selection(a, b, out_dtype, accumulation).attributes()
  out, *_ = calls.call(
      target, results,
      a.data, _scale_bytes(a), b.data, _scale_bytes(b), pstarts, as_f32(row_factor),
      as_f32(col_factor), as_f32(group_factor), as_f32(bias),
      mode=np.int32(mode), a_scaling=np.int32(support.gemm_scaling(a)),
      b_scaling=np.int32(support.gemm_scaling(b)), has_row_factor=row_factor is not None,
      has_col_factor=col_factor is not None, has_group_factor=group_factor is not None,
      has_bias=bias is not None, **sm90_attributes)
  return out
