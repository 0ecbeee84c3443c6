"""Grouped GEMM operands decoded exactly to bfloat16, with the factors the GEMM applies after.

A grouped GEMM of quantized operands (`jaxquant.backends.reference.grouped`) multiplies each
operand's raw values (payload times block scale) in float32 and applies the second-level
factors to the float32 sums. Those raw values are exact in bfloat16 for the formats whose
payload and block scale have few significant bits: MXFP8 (E4M3 / E5M2 times an E8M0 power of
two), NVFP4 (E2M1 times an E4M3 scale: at most 6 significant bits, magnitudes 2^-10..2688) and
Float8Block with power-of-two scales; per-tensor FP8 payloads are exact on their own (the scale
becomes a per-group factor). So a bfloat16 GEMM with float32 accumulation of the decoded values
computes the reference's sums (up to float32 summation order), and the factors follow:

  `group`  float32 `[G]`: per-tensor FP8 scale_inv, NVFP4's per-tensor second level (one per
           group or expert): the GEMM's per-group alpha;
  `rows`   row-scaled NVFP4's per-row factors: `[L]` for token rows, `[G, rows]` for the
           feature rows of a columnwise copy or of expert weights: applied to the float32 GEMM
           output, as the reference's epilogue does (by the GEMM's epilogue or by XLA: the
           backend's choice).

(MXFP8 / Float8Block scales below 2^-124 would push decoded values under bfloat16's subnormal
range and lose bits; the amax-derived scales of real data are nowhere near.) Which operands may
take this path is the backend's choice (`jaxquant.backends.ffi.grouped.decoded`); XLA fuses the
decode into one pass over each operand, unless the backend passes a `RawDecoder` (a kernel
writing the same bits: NVFP4's and MXFP8's).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Union

import jax
import jax.numpy as jnp

from jaxquant.formats import format_of
from jaxquant.grouping.tensors import (GroupedScaledTensor, factor, per_group_scale, raw,
                                       row_scaled)
from jaxquant.tensors import ScaledTensor


# A backend's decode of a storage's raw values to bfloat16 (the same bits), or None where XLA's
# decode below serves it.
RawDecoder = Callable[[Union[GroupedScaledTensor, ScaledTensor]], Optional[jax.Array]]


def _raw_bf16(storage, xla_raw, decoder: Optional[RawDecoder]) -> jax.Array:
  if format_of(storage.quantizer).stores_raw(storage):  # decoded by its quantize kernel
    return storage.data
  values = decoder(storage) if decoder is not None else None
  return xla_raw().astype(jnp.bfloat16) if values is None else values


@dataclasses.dataclass(frozen=True)
class Decoded:
  """One GEMM operand in bfloat16 (its storage's layout) and the factors of its products."""
  values: jax.Array
  group: Optional[jax.Array] = None  # float32 [G]
  rows: Optional[jax.Array] = None   # float32 [L] (token rows) or [G, rows]


def _split(values: jax.Array, f: Optional[jax.Array], quantizer) -> Decoded:
  if f is None:
    return Decoded(values)
  f = f.astype(jnp.float32)
  return Decoded(values, rows=f) if row_scaled(quantizer) else Decoded(values, group=f)


def tokens(t: GroupedScaledTensor, decoder: Optional[RawDecoder] = None) -> Decoded:
  """A grouped token matrix (either copy) decoded; Identity storages as they are. `decoder`
  may decode block-scaled raw values (a kernel's same bits)."""
  if t.scale_inv is None:
    return Decoded(t.data)
  if per_group_scale(t.quantizer):
    return Decoded(t.data.astype(jnp.bfloat16), group=t.scale_inv.astype(jnp.float32))
  return _split(_raw_bf16(t, lambda: raw(t), decoder), factor(t), t.quantizer)


def experts(b: Union[ScaledTensor, jax.Array], decoder: Optional[RawDecoder] = None) -> Decoded:
  """Expert matrices `[G, N, K]` (a `ScaledTensor` with a leading expert axis, or an array);
  `decoder` as for `tokens`."""
  if not isinstance(b, ScaledTensor):
    return Decoded(b)
  if b.scale_inv is None:
    return Decoded(b.data)
  if per_group_scale(b.quantizer):
    return Decoded(b.data.astype(jnp.bfloat16), group=b.scale_inv.astype(jnp.float32))
  fmt = format_of(b.quantizer)
  values = _raw_bf16(b, lambda: jax.vmap(fmt.dequantize_raw)(b), decoder)
  return _split(values, None if b.amax is None else fmt.gemm_factor(b), b.quantizer)


def group_alpha(*decoded: Decoded) -> Optional[jax.Array]:
  """The product of the operands' per-group factors (None when neither has one)."""
  alpha = None
  for d in decoded:
    if d.group is not None:
      alpha = d.group if alpha is None else alpha * d.group
  return alpha
