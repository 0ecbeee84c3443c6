"""Sharding of quantized storages: from the `PartitionSpec` of `x[rows, cols]` to the spec of
every leaf of its `QuantizedTensor` (DESIGN.md section 6).

Rowwise leaves follow `(rows, cols)`; the transposed columnwise copy follows `(cols, rows)`;
block-scale axes follow their data axis (a block never straddles two shards: checked by
`check_blocks_fit`); per-tensor scales and amax are replicated; a row-scaled amax follows rows.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Sequence

import jax
from jax.sharding import Mesh, PartitionSpec as P

from jaxquant.quantizers import (Float8BlockQuantizer, Float8CurrentScalingQuantizer,
                                 Float8DelayedScalingQuantizer, HybridQuantizer,
                                 IdentityQuantizer, MXFP8Quantizer, NVFP4Quantizer, Quantizer)
from jaxquant.tensors import QuantizedTensor, ScaledTensor

MeshAxes = Any  # None, a mesh axis name, or a tuple of names


def _matrix_spec(spec: Optional[P]) -> tuple[MeshAxes, MeshAxes]:
  """(rows axes, cols axes) of a spec of a `[..., cols]` array flattened to `[rows, cols]`."""
  if spec is None:
    return None, None
  entries = tuple(spec)
  if not entries:
    return None, None
  if len(entries) == 1:
    return None, entries[0]
  lead = [e for e in entries[:-1] if e is not None]
  if len(lead) > 1:
    names = []
    for e in lead:
      names.extend(e if isinstance(e, tuple) else (e,))
    rows = tuple(names)
  else:
    rows = lead[0] if lead else None
  return rows, entries[-1]


def block_shape(quantizer: Quantizer) -> tuple[int, int]:
  """(rows, cols) of one scaling block of a single-format quantizer (1, 1 when per tensor)."""
  if isinstance(quantizer, MXFP8Quantizer):
    return (1, 32)
  if isinstance(quantizer, NVFP4Quantizer):
    return (16, 16) if quantizer.block_2d else (1, 16)
  if isinstance(quantizer, Float8BlockQuantizer):
    return quantizer.block
  return (1, 1)


def _scaled_spec(quantizer: Quantizer, rows: MeshAxes, cols: MeshAxes) -> ScaledTensor:
  if isinstance(quantizer, IdentityQuantizer):
    return ScaledTensor(P(rows, cols), None, None, quantizer)
  if isinstance(quantizer, (Float8CurrentScalingQuantizer, Float8DelayedScalingQuantizer)):
    return ScaledTensor(P(rows, cols), P(), P(), quantizer)
  if isinstance(quantizer, NVFP4Quantizer) and quantizer.row_scaled:
    return ScaledTensor(P(rows, cols), P(rows, cols), P(rows), quantizer)
  return ScaledTensor(P(rows, cols), P(rows, cols), P(), quantizer)


def storage_specs(quantizer: Quantizer, x_spec: Optional[P], *, rowwise: bool = True,
                  columnwise: bool = True) -> QuantizedTensor:
  """A `QuantizedTensor` whose leaves are the `PartitionSpec`s of `quantize(x, quantizer)`.

  Args:
    quantizer: any quantizer (a Hybrid's halves each follow their own format).
    x_spec: spec of `x` (`[..., cols]`; leading axes are flattened into rows).
    rowwise, columnwise: the directions that will be produced.
  """
  rows, cols = _matrix_spec(x_spec)
  row_q, col_q = quantizer.for_direction("rowwise"), quantizer.for_direction("columnwise")
  return QuantizedTensor(_scaled_spec(row_q, rows, cols) if rowwise else None,
                         _scaled_spec(col_q, cols, rows) if columnwise else None, quantizer)


def _axis_size(mesh: Mesh, axes: MeshAxes) -> int:
  if axes is None:
    return 1
  names = axes if isinstance(axes, tuple) else (axes,)
  return math.prod(mesh.shape[n] for n in names)


def check_blocks_fit(quantizer: Quantizer, shape: Sequence[int], x_spec: Optional[P],
                     mesh: Mesh, *, name: str = "x") -> None:
  """Raise `ValueError` if a shard boundary would split a scaling block of either direction."""
  rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
  cols = shape[-1]
  row_axes, col_axes = _matrix_spec(x_spec)
  for direction, (r, c, r_axes, c_axes) in (
      ("rowwise", (rows, cols, row_axes, col_axes)),
      ("columnwise", (cols, rows, col_axes, row_axes))):
    q = quantizer.for_direction(direction)
    block_rows, block_cols = block_shape(q)
    for length, axes, block, what in ((r, r_axes, block_rows, "rows"),
                                      (c, c_axes, block_cols, "cols")):
      shards = _axis_size(mesh, axes)
      if shards > 1 and (length % shards or (length // shards) % block):
        raise ValueError(
            f"{name}: sharding {what} of the {direction} copy ({length}) over mesh axes {axes!r} "
            f"({shards} shards) would split {block}-long scaling blocks of {q}; use a shard "
            f"length that is a multiple of {block} or do not shard this axis")


def _constrain_scaled(t: Optional[ScaledTensor], spec: Optional[ScaledTensor]):
  if t is None or spec is None:
    return t
  fields = {}
  for field in ("data", "scale_inv", "amax"):
    value, field_spec = getattr(t, field), getattr(spec, field)
    fields[field] = (value if value is None or field_spec is None
                     else jax.lax.with_sharding_constraint(value, field_spec))
  return dataclasses.replace(t, **fields)


def constrain(qtensor: QuantizedTensor, specs: QuantizedTensor) -> QuantizedTensor:
  """Apply `storage_specs` to a `QuantizedTensor` (inside `jit`, under a mesh)."""
  return dataclasses.replace(qtensor,
                             rowwise=_constrain_scaled(qtensor.rowwise, specs.rowwise),
                             columnwise=_constrain_scaled(qtensor.columnwise, specs.columnwise))
