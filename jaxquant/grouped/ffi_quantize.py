"""Grouped quantize through the FFI: the same storages as `jaxquant.grouped.formats`, bit for bit.

- per-tensor FP8 (current / delayed scaling): `jaxquant_grouped_quantize_fp8`, one amax launch
  and one quantize launch for all groups, both copies from one read of `x` when they share a
  token layout;
- MXFP8, Float8Block and the rowwise copy of row-scaled NVFP4: XLA gathers the token layout,
  the single-tensor kernel (`jaxquant.kernels.quantize`) quantizes it in one launch (blocks never
  straddle groups in that layout, so this *is* the grouped quantize), and
  `jaxquant_grouped_amax` gives each group's amax.
Group offsets are computed by XLA from the traced sizes and stay on the device.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant.formats.base import tensor_amax
from jaxquant.grouped import kernels
from jaxquant.grouped.layout import TokenLayout
from jaxquant.grouped.tensors import GroupedScaledTensor
from jaxquant.kernels import calls
from jaxquant.kernels import quantize as single
from jaxquant.quantizers import Float8DelayedScalingQuantizer, Quantizer
from jaxquant.state import DelayedScalingState, needs_current_amax, quantize_scale
from jaxquant.tensors import QuantizedTensor, ScaledTensor


def _offsets(sizes: jax.Array) -> jax.Array:
  return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(sizes.astype(jnp.int32))])


def _sds(shape, dtype) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(tuple(int(s) for s in shape), np.dtype(dtype))


def _delayed_scale(quantizer, state, groups: int, x2d: jax.Array, starts: jax.Array) -> jax.Array:
  """Each group's scale from its state; a group whose state has no scale yet takes it from its
  own amax over rows `starts[g]:starts[g+1]` of `x2d` (one `jaxquant_grouped_amax` launch)."""
  if not isinstance(state, DelayedScalingState) or state.scale.shape != (groups,):
    got = (f"{type(state).__name__} with scale shape {tuple(state.scale.shape)}"
           if isinstance(state, DelayedScalingState) else type(state).__name__)
    raise ValueError(f"state: grouped Float8DelayedScalingQuantizer needs one "
                     f"DelayedScalingState per group (scale [{groups}], amax_history "
                     f"[{groups}, {quantizer.amax_history_len}]; jaxquant.grouped.init_state); "
                     f"got {got}")
  scale = state.scale.astype(jnp.float32)
  if not needs_current_amax(quantizer):
    return scale
  amax = calls.call(kernels.AMAX_TARGET, [_sds((groups,), np.float32)], x2d, starts)[0]
  return quantize_scale(scale, amax, quantizer)


def _fp8_call(x2d, starts, pstarts, quantizer, state, groups: int, length: int, rowwise: bool,
              columnwise: bool, expert_rows: int = 0):
  """(row data, col data, scale_inv [G], amax [G]) from `jaxquant_grouped_quantize_fp8`."""
  delayed = isinstance(quantizer, Float8DelayedScalingQuantizer)
  s = (_delayed_scale(quantizer, state, groups, x2d, starts) if delayed
       else jnp.zeros((1,), jnp.float32))
  cols = x2d.shape[1]
  results = []
  if rowwise:
    results.append(_sds((length, cols), quantizer.dtype))
  if columnwise:
    shape = (groups, cols, expert_rows) if expert_rows else (cols, length)
    results.append(_sds(shape, quantizer.dtype))
  results += [_sds((groups,), np.float32), _sds((groups,), np.float32)]
  outs = calls.call(kernels.QUANTIZE_FP8_TARGET, results, x2d, starts, pstarts, s,
                    rowwise=rowwise, columnwise=columnwise, delayed=delayed,
                    pow2_scale=False if delayed else quantizer.pow2_scale,
                    amax_epsilon=0.0 if delayed else float(quantizer.amax_epsilon),
                    length=np.int64(length), expert_rows=np.int64(expert_rows))
  row = outs.pop(0) if rowwise else None
  col = outs.pop(0) if columnwise else None
  return row, col, outs[0], outs[1]


def group_amax(x: jax.Array, sizes: jax.Array) -> jax.Array:
  """float32 `[G]`: each group's max |x| over its rows (`jaxquant_grouped_amax`)."""
  return calls.call(kernels.AMAX_TARGET, [_sds(sizes.shape, np.float32)], x, _offsets(sizes))[0]


def _make(data, scale_inv, amax, sizes, leaf, orig_dtype, direction, layout, rht=False):
  return GroupedScaledTensor(data, scale_inv, amax, sizes, leaf, orig_dtype, rht,
                             0 if direction == "rowwise" else 1, layout)


def quantize_token_pair(x: jax.Array, sizes: jax.Array, leaf: Quantizer, layout: TokenLayout,
                        state: Any, orig_dtype) -> tuple[GroupedScaledTensor, GroupedScaledTensor]:
  """Both copies of per-tensor FP8 tokens in one layout, from one call (one read of x)."""
  row, col, scale_inv, amax = _fp8_call(x, _offsets(sizes), _offsets(layout.extents(sizes)),
                                        leaf, state, layout.groups, layout.length, True, True)
  return (_make(row, scale_inv, amax, sizes, leaf, orig_dtype, "rowwise", layout),
          _make(col, scale_inv, amax, sizes, leaf, orig_dtype, "columnwise", layout))


def quantize_tokens(x: jax.Array, sizes: jax.Array, leaf: Quantizer, direction: str,
                    layout: TokenLayout, words: Optional[jax.Array], state: Any,
                    orig_dtype) -> GroupedScaledTensor:
  """One copy of tokens `x[T, C]` (see `jaxquant.grouped.ops.quantize`) through the FFI."""
  route, reason = kernels.quantize_route(leaf, direction)
  if reason is not None:
    raise ValueError(f"grouped FFI quantize cannot serve {leaf} ({direction}): {reason}")
  rowwise = direction == "rowwise"
  if route == "fp8":
    row, col, scale_inv, amax = _fp8_call(x, _offsets(sizes), _offsets(layout.extents(sizes)),
                                          leaf, state, layout.groups, layout.length, rowwise,
                                          not rowwise)
    return _make(row if rowwise else col, scale_inv, amax, sizes, leaf, orig_dtype, direction,
                 layout)
  mat = layout.gather(x, sizes)
  row, col = single.quantize_single(mat, leaf, rowwise=rowwise, columnwise=not rowwise,
                                    orig_dtype=orig_dtype)
  t = row if rowwise else col
  amax = t.amax if getattr(leaf, "row_scaled", False) else group_amax(x, sizes)
  return _make(t.data, t.scale_inv, amax, sizes, leaf, orig_dtype, direction, layout, t.rht)


def quantize_experts(w: jax.Array, quantizer: Quantizer, *, rowwise: bool, columnwise: bool,
                     state: Any, orig_dtype) -> QuantizedTensor:
  """Expert weights `w[G, rows, cols]`, each expert bit-for-bit its own quantize (columnwise
  copies `[G, cols, rows]`): per-tensor FP8 both copies in one grouped call (every expert its
  own amax and scale); block formats one single-tensor launch per copy (`_experts_single`)."""
  if isinstance(quantizer, kernels._PER_TENSOR_FP8):
    return _experts_fp8(w, quantizer, rowwise, columnwise, state, orig_dtype)
  states = state if isinstance(state, tuple) else (state, state)
  expert_amax = None  # each expert's tensor amax, one pass over w shared by both copies
  copies = {}
  for index, (direction, wanted) in enumerate((("rowwise", rowwise),
                                               ("columnwise", columnwise))):
    if not wanted:
      continue
    leaf = quantizer.for_direction(direction)
    route, reason = kernels.expert_route(quantizer, direction, tuple(w.shape))
    if reason is not None:
      raise ValueError(f"FFI expert quantize cannot serve {leaf} ({direction}): {reason}")
    if route == "fp8":
      pair = _experts_fp8(w, leaf, direction == "rowwise", direction == "columnwise",
                          states[index], orig_dtype)
      copies[direction] = pair.rowwise if direction == "rowwise" else pair.columnwise
    else:
      if expert_amax is None and not getattr(leaf, "row_scaled", False):
        expert_amax = jax.vmap(tensor_amax)(w)
      copies[direction] = _experts_single(w, leaf, direction, orig_dtype, expert_amax)
  return QuantizedTensor(copies.get("rowwise"), copies.get("columnwise"), quantizer)


def _experts_fp8(w, quantizer, rowwise: bool, columnwise: bool, state, orig_dtype):
  groups, rows, cols = w.shape
  starts = jnp.arange(groups + 1, dtype=jnp.int32) * rows
  row, col, scale_inv, amax = _fp8_call(w.reshape(groups * rows, cols), starts, starts,
                                        quantizer, state, groups, groups * rows, rowwise,
                                        columnwise, expert_rows=rows)
  make = lambda d: ScaledTensor(d, scale_inv, amax, quantizer, orig_dtype, False)
  return QuantizedTensor(make(row.reshape(groups, rows, cols)) if rowwise else None,
                         make(col) if columnwise else None, quantizer)


def _experts_single(w: jax.Array, leaf: Quantizer, direction: str, orig_dtype,
                    expert_amax: Optional[jax.Array]) -> ScaledTensor:
  """One copy of block-scaled expert weights from one single-tensor kernel launch on
  `[G * rows, cols]`: `kernels.expert_route` checked that no block spans two experts, so every
  block (and, for row-scaled NVFP4, every row amax) is the expert's own. The rowwise copy is a
  reshape; the columnwise copy `[cols, G * rows]` is regrouped to `[G, cols, rows]` (data and
  block scales) by one XLA transpose; `expert_amax[G]` is each expert's own tensor amax
  (`tensor_amax`, as the reference computes it), passed in so both copies share one pass."""
  groups, rows, cols = w.shape
  rowwise = direction == "rowwise"
  row, col = single.quantize_single(w.reshape(groups * rows, cols), leaf, rowwise=rowwise,
                                    columnwise=not rowwise, orig_dtype=orig_dtype)
  t = row if rowwise else col
  if rowwise:
    regroup = lambda a: a.reshape(groups, a.shape[0] // groups, *a.shape[1:])
  else:
    regroup = lambda a: jnp.swapaxes(a.reshape(a.shape[0], groups, a.shape[1] // groups), 0, 1)
  amax = regroup(t.amax) if getattr(leaf, "row_scaled", False) else expert_amax
  return ScaledTensor(regroup(t.data), regroup(t.scale_inv), amax, leaf, orig_dtype, t.rht)
