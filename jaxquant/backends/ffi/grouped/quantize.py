"""Grouped quantize through the FFI: the same storages as `jaxquant.grouping.formats`, bit for bit.

- per-tensor FP8 (current / delayed scaling): `jaxquant_grouped_quantize_fp8`, one quantize
  launch for all groups, both copies from one read of `x` when they share a token layout;
  current scaling runs an amax launch first; delayed scaling none (the quantize launch records
  each group's amax), except the gated `jaxquant_grouped_amax_gated` for a just-in-time first
  scale, whose grid exits at once when every group has a scale;
- NVFP4 with one second-level scale per group (tokens) or expert (weights):
  `jaxquant_grouped_quantize_nvfp4`, the per-group amax launch(es) and one quantize launch
  that reads x through the group offsets (no gathered layout), RHT and stochastic rounding
  included; both copies of tokens from one call (`row_packed`: the rowwise copy packed beside
  the columnwise one's padded layout), whose amax launch also reads x once for both;
- MXFP8, Float8Block and the rowwise copy of row-scaled NVFP4: the single-tensor kernel
  (`jaxquant.backends.ffi.quantize`) quantizes the token layout in one launch (blocks never
  straddle groups in that layout, so this *is* the grouped quantize), and
  `jaxquant_grouped_amax` gives each group's amax. For MXFP8 and Float8Block the kernel reads
  the layout's rows from x through the group offsets (`jaxquant_grouped_quantize_mxfp8` /
  `_fp8_block`); row-scaled NVFP4 quantizes an XLA-gathered copy. The packed rowwise copy of
  a format with one-row blocks needs no layout: x is quantized as it is and the rows of no
  group take a zero row's codes and scales (`_packed_rows`).
Group offsets are computed by XLA from the traced sizes and stay on the device.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant.backends.ffi import calls
from jaxquant.backends.ffi import registry
from jaxquant.backends.ffi import quantize as single
from jaxquant.backends.ffi.grouped import support
from jaxquant.backends.platform import current_platform
from jaxquant.formats import format_of
from jaxquant.formats.base import tensor_amax
from jaxquant.grouping.layout import TokenLayout
from jaxquant.grouping.tensors import GroupedScaledTensor, PendingRowwise, TransposedExperts
from jaxquant.quantizers import NVFP4Quantizer, Quantizer
from jaxquant.state import DelayedScalingState, needs_current_amax, quantize_scale
from jaxquant.tensors import QuantizedTensor, ScaledTensor


def _row_scaled(leaf: Quantizer) -> bool:
  """Whether `leaf`'s amax is per row (row-scaled NVFP4): the kernel's rows are the result."""
  return format_of(leaf).amax_layout(leaf) == "row"


def _offsets(sizes: jax.Array) -> jax.Array:
  return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(sizes.astype(jnp.int32))])


def _sds(shape, dtype) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(tuple(int(s) for s in shape), np.dtype(dtype))


def _delayed_scale(quantizer, state, groups: int, x2d: jax.Array, starts: jax.Array) -> jax.Array:
  """Each group's scale from its state; a group whose state has no scale yet takes it from its
  own amax over rows `starts[g]:starts[g+1]` of `x2d`. That amax comes from
  `jaxquant_grouped_amax_gated`, gated on the scales: it reads x only while some scale is 0,
  else gives zeros, which `quantize_scale` never reads (it uses the amax only where the scale
  is 0), so later steps pay one empty launch instead of an amax pass."""
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
  amax = calls.call(support.AMAX_GATED_TARGET, [_sds((groups,), np.float32)], x2d, starts,
                    scale)[0]
  return quantize_scale(scale, amax, quantizer)


def _fp8_call(x2d, starts, pstarts, quantizer, state, groups: int, length: int, rowwise: bool,
              columnwise: bool, expert_rows: int = 0, row_packed: bool = False):
  """(row data, col data, scale_inv [G], amax [G]) from `jaxquant_grouped_quantize_fp8`.
  `row_packed`: the rowwise copy in the packed layout (`[T, C]`) while the columnwise one takes
  `pstarts`' layout of `length` positions."""
  delayed = format_of(quantizer).stateful(quantizer)  # scales from the state
  s = (_delayed_scale(quantizer, state, groups, x2d, starts) if delayed
       else jnp.zeros((1,), jnp.float32))
  cols = x2d.shape[1]
  results = []
  if rowwise:
    results.append(_sds((x2d.shape[0] if row_packed else length, cols), quantizer.dtype))
  if columnwise:
    shape = (groups, cols, expert_rows) if expert_rows else (cols, length)
    results.append(_sds(shape, quantizer.dtype))
  results += [_sds((groups,), np.float32), _sds((groups,), np.float32)]
  outs = calls.call(support.QUANTIZE_FP8_TARGET, results, x2d, starts, pstarts, s,
                    rowwise=rowwise, columnwise=columnwise, delayed=delayed,
                    pow2_scale=False if delayed else quantizer.pow2_scale, row_packed=row_packed,
                    amax_epsilon=0.0 if delayed else float(quantizer.amax_epsilon),
                    length=np.int64(length), expert_rows=np.int64(expert_rows))
  row = outs.pop(0) if rowwise else None
  col = outs.pop(0) if columnwise else None
  return row, col, outs[0], outs[1]


def _nvfp4_key(words: Optional[jax.Array], on: bool) -> jax.Array:
  """u32 `[G, 2]` stochastic-rounding words of a direction, or the `[1, 2]` placeholder."""
  if not on:
    return jnp.zeros((1, 2), jnp.uint32)
  if words is None:
    raise ValueError("keys: NVFP4Quantizer(stochastic_rounding=True) needs one PRNG key per "
                     "group")
  return jnp.asarray(words, jnp.uint32)


def _nvfp4_call(x2d, starts, pstarts, quantizer: NVFP4Quantizer, groups: int, length: int,
                rowwise: bool, columnwise: bool, row_words=None, col_words=None,
                expert_rows: int = 0, raw: bool = False, row_packed: bool = False):
  """{direction: (data, scale_inv, amax [G])} from `jaxquant_grouped_quantize_nvfp4`; `raw`:
  the data of every copy as bfloat16 raw values (`support.nvfp4_raw_reason`); `row_packed`:
  the rowwise copy in the packed layout (x's rows), the columnwise one in the layout of
  `pstarts` / `length`."""
  cols = x2d.shape[1]
  br = 16 if quantizer.block_2d else 1
  e4m3, data = jnp.float8_e4m3fn, (jnp.bfloat16 if raw else jnp.float4_e2m1fn)
  sr = quantizer.stochastic_rounding
  results = []
  if rowwise:
    rows = x2d.shape[0] if row_packed else length
    results += [_sds((rows, cols), data), _sds((-(-rows // br), -(-cols // 16)), e4m3)]
  if columnwise:
    if expert_rows:
      results += [_sds((groups, cols, expert_rows), data),
                  _sds((groups, -(-cols // br), expert_rows // 16), e4m3)]
    else:
      results += [_sds((cols, length), data), _sds((-(-cols // br), length // 16), e4m3)]
  results += [_sds((groups,), np.float32)] * (int(rowwise) + int(columnwise))
  outs = calls.call(support.QUANTIZE_NVFP4_TARGET, results, x2d, starts, pstarts,
                    _nvfp4_key(row_words, sr and rowwise), _nvfp4_key(col_words, sr and columnwise),
                    rowwise=rowwise, columnwise=columnwise, block_2d=quantizer.block_2d,
                    rht=format_of(quantizer).uses_rht(quantizer, "columnwise") and columnwise,
                    stochastic=sr, length=np.int64(length), expert_rows=np.int64(expert_rows),
                    raw=raw, row_packed=row_packed)
  directions = [d for d, on in (("rowwise", rowwise), ("columnwise", columnwise)) if on]
  data = {d: (outs.pop(0), outs.pop(0)) for d in directions}  # (data, scale_inv) per copy,
  return {d: data[d] + (outs.pop(0),) for d in directions}   # then the amaxes in that order


def group_amax(x: jax.Array, sizes: jax.Array) -> jax.Array:
  """float32 `[G]`: each group's max |x| over its rows (`jaxquant_grouped_amax`)."""
  return calls.call(support.AMAX_TARGET, [_sds(sizes.shape, np.float32)], x, _offsets(sizes))[0]


def _make(data, scale_inv, amax, sizes, leaf, orig_dtype, direction, layout, rht=False):
  return GroupedScaledTensor(data, scale_inv, amax, sizes, leaf, orig_dtype, rht,
                             0 if direction == "rowwise" else 1, layout)


def _raw(leaf: Quantizer, decoded: bool) -> bool:
  """Whether copies of `leaf` for GEMMs that read decoded operands (`decoded`) are written raw."""
  return decoded and support.raw_copies_reason(leaf) is None


def _raw_nvfp4(leaf: Quantizer, decoded: bool, directions) -> bool:
  """Whether NVFP4 copies in `directions` for GEMMs that read decoded operands are written raw."""
  return decoded and all(support.nvfp4_raw_reason(leaf, d) is None for d in directions)


def quantize_token_pair(x: jax.Array, sizes: jax.Array, leaf: Quantizer, row_layout: TokenLayout,
                        col_layout: TokenLayout, state: Any, orig_dtype,
                        decoded: bool = False, words: Optional[dict] = None
                        ) -> tuple[GroupedScaledTensor, GroupedScaledTensor]:
  """Both copies of tokens from one call (one read of x), in one layout or the rowwise copy
  packed and the columnwise one in its padded layout (`pair_served`): per-tensor FP8 through
  the grouped FP8 kernel, NVFP4 through the grouped NVFP4 kernel, MXFP8 / Float8Block through
  the gathered kernel (`row_packed`). `decoded`: the copies feed only grouped GEMMs, so MXFP8's
  and NVFP4's may be written raw (`support.raw_copies_reason`, `support.nvfp4_raw_reason`).
  `words`: NVFP4's stochastic-rounding words by direction."""
  if not pair_served(leaf, row_layout, col_layout, tuple(x.shape)):
    raise ValueError(f"one grouped call writes both copies of {leaf} in one layout, or (formats "
                     f"with one-row blocks) a packed rowwise copy beside a padded columnwise one; "
                     f"got token blocks {row_layout.block} (rowwise) and {col_layout.block} "
                     f"(columnwise)")
  row_packed = row_layout != col_layout
  starts, pstarts = _offsets(sizes), _offsets(col_layout.extents(sizes))
  route = support.quantize_route(leaf, "rowwise")[0]
  if route == "nvfp4":
    words = words or {}
    copies = _nvfp4_call(x, starts, pstarts, leaf, col_layout.groups, col_layout.length, True,
                         True, row_words=words.get("rowwise"), col_words=words.get("columnwise"),
                         raw=_raw_nvfp4(leaf, decoded, ("rowwise", "columnwise")),
                         row_packed=row_packed)
    return tuple(_make(*copies[d], sizes, leaf, orig_dtype, d, layout,
                       format_of(leaf).uses_rht(leaf, d))
                 for d, layout in (("rowwise", row_layout), ("columnwise", col_layout)))
  if route != "fp8":
    row, col = single.quantize_gathered(x, starts, pstarts, col_layout.length, leaf,
                                        rowwise=True, columnwise=True, orig_dtype=orig_dtype,
                                        row_packed=row_packed, raw=_raw(leaf, decoded))
    amax = group_amax(x, sizes)
    return (_make(row.data, row.scale_inv, amax, sizes, leaf, orig_dtype, "rowwise", row_layout),
            _make(col.data, col.scale_inv, amax, sizes, leaf, orig_dtype, "columnwise",
                  col_layout))
  row, col, scale_inv, amax = _fp8_call(x, starts, pstarts, leaf, state, col_layout.groups,
                                        col_layout.length, True, True, row_packed=row_packed)
  return (_make(row, scale_inv, amax, sizes, leaf, orig_dtype, "rowwise", row_layout),
          _make(col, scale_inv, amax, sizes, leaf, orig_dtype, "columnwise", col_layout))


def pair_served(leaf: Quantizer, row_layout: TokenLayout, col_layout: TokenLayout,
                shape=None) -> bool:
  """Whether `quantize_token_pair` writes both copies of `leaf`'s tokens in these layouts from
  one read of x: per-tensor FP8 in the same layout or a packed rowwise layout (x's own rows)
  beside any columnwise one; NVFP4 on its grouped kernel (both directions, tokens of `shape`
  when given) likewise with 1x16 blocks, in one layout with 16x16 ones (unless
  `JAXQUANT_GROUPED_NVFP4_PAIR=off`); MXFP8 / Float8Block where this platform's extension has
  the gathered kernel, likewise when the rowwise blocks are one row tall (1x32, 1x128)."""
  packed_row = not row_layout.padded
  route = support.quantize_route(leaf, "rowwise")[0]
  if route == "fp8":
    return row_layout == col_layout or packed_row
  if route == "nvfp4":
    if support.nvfp4_pair_choice() == "off" or any(
        support.quantize_route(leaf, d, shape) != ("nvfp4", None)
        for d in ("rowwise", "columnwise")):
      return False
    return row_layout == col_layout or (packed_row and not leaf.block_2d)
  if route != "single" or not gathered_served(leaf):
    return False
  return row_layout == col_layout or (packed_row and format_of(leaf).block_shape(leaf)[0] == 1)


def quantize_tokens(x: jax.Array, sizes: jax.Array, leaf: Quantizer, direction: str,
                    layout: TokenLayout, words: Optional[jax.Array], state: Any,
                    orig_dtype, decoded: bool = False) -> GroupedScaledTensor:
  """One copy of tokens `x[T, C]` (see `jaxquant.ops.grouped.quantize`) through the FFI;
  `decoded` as for `quantize_token_pair`."""
  route, reason = support.quantize_route(leaf, direction, tuple(x.shape))
  if reason is not None:
    raise ValueError(f"grouped FFI quantize cannot serve {leaf} ({direction}): {reason}")
  rowwise = direction == "rowwise"
  if route == "nvfp4":
    (data, scale_inv, amax), = _nvfp4_call(
        x, _offsets(sizes), _offsets(layout.extents(sizes)), leaf, layout.groups, layout.length,
        rowwise, not rowwise, row_words=words if rowwise else None,
        col_words=None if rowwise else words,
        raw=_raw_nvfp4(leaf, decoded, (direction,))).values()
    return _make(data, scale_inv, amax, sizes, leaf, orig_dtype, direction, layout,
                 format_of(leaf).uses_rht(leaf, direction))
  if route == "fp8":
    row, col, scale_inv, amax = _fp8_call(x, _offsets(sizes), _offsets(layout.extents(sizes)),
                                          leaf, state, layout.groups, layout.length, rowwise,
                                          not rowwise)
    return _make(row if rowwise else col, scale_inv, amax, sizes, leaf, orig_dtype, direction,
                 layout)
  if rowwise and not layout.padded and (format_of(leaf).blocks(leaf) or (0,))[0] == 1:
    t = _packed_rows(x, sizes, leaf, orig_dtype, decoded)
  elif gathered_served(leaf):  # the kernel reads the layout's rows through the offsets
    row, col = single.quantize_gathered(x, _offsets(sizes), _offsets(layout.extents(sizes)),
                                        layout.length, leaf, rowwise=rowwise,
                                        columnwise=not rowwise, orig_dtype=orig_dtype,
                                        raw=_raw(leaf, decoded))
    t = row if rowwise else col
  else:
    row, col = single.quantize_single(layout.gather(x, sizes), leaf, rowwise=rowwise,
                                      columnwise=not rowwise, orig_dtype=orig_dtype)
    t = row if rowwise else col
  amax = t.amax if _row_scaled(leaf) else group_amax(x, sizes)
  return _make(t.data, t.scale_inv, amax, sizes, leaf, orig_dtype, direction, layout, t.rht)


def gathered_served(leaf: Quantizer) -> bool:
  """Whether the platform's extension quantizes `leaf`'s format on a token layout read through
  the group offsets (`jaxquant_grouped_quantize_mxfp8` / `_fp8_block`); else XLA gathers the
  layout (a bfloat16 copy of x) for the single-tensor kernel, the same bytes."""
  target = single.gathered_kernel(leaf)
  return target is not None and target in registry.registered_targets(current_platform())


def _packed_rows(x: jax.Array, sizes: jax.Array, leaf: Quantizer, orig_dtype,
                 decoded: bool = False) -> ScaledTensor:
  """The rowwise copy of the packed layout for a format whose blocks are one row tall (MXFP8,
  Float8Block 1x128, row-scaled NVFP4): that layout is x's own rows with the rows past
  `sum(sizes)` zeroed, and each row quantizes on its own, so x is quantized as it is and the
  rows of no group take a zero row's codes, scales and amax: bit for bit the gathered layout's
  storage, without XLA's gathered bfloat16 copy of x (read and written, twice the bytes of the
  select on the quantized rows that replaces it). MXFP8 / Float8Block take the gathered kernel
  on the packed layout (starts = pstarts), which reads the rows of no group as zeros: no select
  pass either."""
  rows, cols = x.shape
  if gathered_served(leaf):
    starts = _offsets(sizes)
    t, _ = single.quantize_gathered(x, starts, starts, rows, leaf, rowwise=True, columnwise=False,
                                    orig_dtype=orig_dtype, raw=_raw(leaf, decoded))
    return t
  t, _ = single.quantize_single(x, leaf, rowwise=True, columnwise=False, orig_dtype=orig_dtype)
  zero, _ = single.quantize_single(jnp.zeros((1, cols), x.dtype), leaf, rowwise=True,
                                   columnwise=False, orig_dtype=orig_dtype)
  valid = jnp.arange(rows, dtype=jnp.int32) < jnp.sum(sizes.astype(jnp.int32))

  def keep(a, z):  # a row-major [rows, ...] array of per-row values, z the zero row's
    if a is None or a.ndim == 0:
      return a
    if a.shape[0] != rows or z.shape[0] != 1:
      raise AssertionError(f"{leaf}: per-row storage expected, got {a.shape} / {z.shape}")
    return jnp.where(valid.reshape((rows,) + (1,) * (a.ndim - 1)), a, z)

  return dataclasses.replace(t, data=keep(t.data, zero.data),
                             scale_inv=keep(t.scale_inv, zero.scale_inv),
                             amax=keep(t.amax, zero.amax))


def quantize_experts(w: jax.Array, quantizer: Quantizer, *, rowwise: bool, columnwise: bool,
                     state: Any, orig_dtype, words=None, decoded: bool = False,
                     columnwise_along_n: bool = False,
                     rowwise_pending: bool = False) -> QuantizedTensor:
  """Expert weights `w[G, rows, cols]`, each expert bit-for-bit its own quantize (columnwise
  copies `[G, cols, rows]`): per-tensor FP8 both copies in one grouped call (every expert its
  own amax and scale); NVFP4 (one amax per expert) through the grouped NVFP4 kernel, both copies
  of one quantizer in one call; block formats one single-tensor launch per copy
  (`_experts_single`). A Hybrid whose columnwise copy comes from the `rowwise_dequantized`
  source quantizes each expert's decoded rowwise copy. `words`: per direction, the
  stochastic-rounding words of each expert (`[G, 2]`) or None. `decoded`: the copies feed only
  grouped GEMMs, so MXFP8's from the gathered kernel may be written raw.
  `columnwise_along_n` (`experts_along_n` holds): the raw columnwise copy comes back as a
  `TransposedExperts` holding it in w's own `[G, rows, cols]` layout. `rowwise_pending` (with
  it and `rowwise`): the rowwise copy comes back as a `PendingRowwise`, to be written over the
  columnwise one by `write_pending` (design decision 56)."""
  if columnwise_along_n and not (columnwise and support.experts_along_n(
      quantizer, tuple(w.shape), decoded, w.dtype)):
    raise ValueError(f"columnwise_along_n: {quantizer}'s columnwise copy of {tuple(w.shape)} is "
                     "not written in the weights' layout here (experts_along_n)")
  if rowwise_pending and not (rowwise and columnwise_along_n):
    raise ValueError("rowwise_pending: the rowwise copy is written over the columnwise one in "
                     "the weights' layout; needs rowwise and columnwise_along_n")
  fmt = format_of(quantizer)
  one_quantizer = fmt.halves(quantizer) is None  # one quantizer makes both copies
  if one_quantizer and fmt.grouped_quantize_kernel(quantizer, "rowwise")[0] == "fp8":
    return _experts_fp8(w, quantizer, rowwise, columnwise, state, orig_dtype)
  words = words or {}
  if (one_quantizer and rowwise and columnwise
      and support.expert_route(quantizer, "rowwise", tuple(w.shape))[0] == "nvfp4"):
    pair = _experts_nvfp4(w, quantizer, True, True, orig_dtype, words, decoded)
    return QuantizedTensor(pair["rowwise"], pair["columnwise"], quantizer)
  states = fmt.split_state(quantizer, state)
  from_rowwise = columnwise and fmt.columnwise_from_rowwise(quantizer)
  if (one_quantizer and rowwise and columnwise and not from_rowwise and gathered_served(quantizer)
      and all(support.expert_route(quantizer, d, tuple(w.shape))[1] is None
              for d in ("rowwise", "columnwise"))):
    # MXFP8 / Float8Block: both copies from one launch (one read of w).
    copies = _experts_gathered(w, quantizer, True, orig_dtype, jax.vmap(tensor_amax)(w),
                               _raw(quantizer, decoded), columnwise_along_n, rowwise_pending)
    return QuantizedTensor(copies["rowwise"], copies["columnwise"], quantizer)
  if rowwise_pending:
    raise AssertionError(f"rowwise_pending: {quantizer}'s copies of {tuple(w.shape)} do not come "
                         "from one gathered launch")
  expert_amax = None  # each expert's tensor amax, one pass over w shared by both copies
  copies = {}
  for index, (direction, wanted) in enumerate((("rowwise", rowwise or from_rowwise),
                                               ("columnwise", columnwise))):
    if not wanted:
      continue
    leaf = quantizer.for_direction(direction)
    route, reason = support.expert_route(quantizer, direction, tuple(w.shape))
    if reason is not None:
      raise ValueError(f"FFI expert quantize cannot serve {leaf} ({direction}): {reason}")
    source = w
    if direction == "columnwise" and from_rowwise:  # each expert's decoded rowwise copy
      source = jax.vmap(lambda t: t.dequantize(jnp.float32))(copies["rowwise"])
    if route == "fp8":
      pair = _experts_fp8(source, leaf, direction == "rowwise", direction == "columnwise",
                          states[index], orig_dtype)
      copies[direction] = pair.rowwise if direction == "rowwise" else pair.columnwise
    elif route == "nvfp4":
      copies[direction] = _experts_nvfp4(source, leaf, direction == "rowwise",
                                         direction == "columnwise", orig_dtype,
                                         words, decoded)[direction]
    else:
      if source is not w:
        amax = jax.vmap(tensor_amax)(source)
      else:
        if expert_amax is None and not _row_scaled(leaf):
          expert_amax = jax.vmap(tensor_amax)(w)
        amax = expert_amax
      copies[direction] = _experts_single(source, leaf, direction, orig_dtype, amax,
                                          _raw(leaf, decoded), columnwise_along_n)
  return QuantizedTensor(copies.get("rowwise") if rowwise else None, copies.get("columnwise"),
                         quantizer)


def _experts_nvfp4(w, leaf: NVFP4Quantizer, rowwise: bool, columnwise: bool, orig_dtype,
                   words, decoded: bool = False) -> dict:
  """NVFP4 expert weights (one amax per expert) from one `jaxquant_grouped_quantize_nvfp4`
  call: every expert a group of `rows` rows; the columnwise copy written as `[G, cols, rows]`;
  the copies raw where they feed only GEMMs on decoded operands (`decoded`)."""
  groups, rows, cols = w.shape
  starts = jnp.arange(groups + 1, dtype=jnp.int32) * rows
  copies = _nvfp4_call(w.reshape(groups * rows, cols), starts, starts, leaf, groups,
                       groups * rows, rowwise, columnwise, words.get("rowwise"),
                       words.get("columnwise"), expert_rows=rows,
                       raw=_raw_nvfp4(leaf, decoded, [d for d, on in (("rowwise", rowwise),
                                                                       ("columnwise", columnwise))
                                                      if on]))
  out = {}
  if rowwise:
    data, scale_inv, amax = copies["rowwise"]
    out["rowwise"] = ScaledTensor(data.reshape(groups, rows, cols),
                                  scale_inv.reshape(groups, -1, scale_inv.shape[1]), amax, leaf,
                                  orig_dtype, False)
  if columnwise:
    data, scale_inv, amax = copies["columnwise"]
    out["columnwise"] = ScaledTensor(data, scale_inv, amax, leaf, orig_dtype,
                                     format_of(leaf).uses_rht(leaf, "columnwise"))
  return out


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
                    expert_amax: Optional[jax.Array], raw: bool = False,
                    along_n: bool = False) -> ScaledTensor:
  """One copy of block-scaled expert weights from one kernel launch on `[G * rows, cols]`:
  `support.expert_route` checked that no block spans two experts, so every block (and, for
  row-scaled NVFP4, every row amax) is the expert's own. The rowwise copy is a reshape. The
  columnwise copy of MXFP8 / Float8Block comes from the gathered kernel with `expert_rows`,
  which writes each expert's `[cols, rows]` on its own; other formats' `[cols, G * rows]` is
  regrouped to `[G, cols, rows]` (data and block scales) by one XLA transpose.
  `expert_amax[G]` is each expert's own tensor amax (`tensor_amax`, as the reference computes
  it), passed in so both copies share one pass. `raw`: the copy written raw by the gathered
  kernel (the rowwise one on the experts' rows as they are, the same codes as the single-tensor
  kernel's). `along_n`: the columnwise copy as `_experts_gathered` gives it then."""
  groups, rows, cols = w.shape
  rowwise = direction == "rowwise"
  if not rowwise and gathered_served(leaf):
    return _experts_gathered(w, leaf, False, orig_dtype, expert_amax, raw, along_n)["columnwise"]
  if rowwise and raw:  # the gathered kernel reading the experts' rows as they are: the same codes
    starts = jnp.arange(groups + 1, dtype=jnp.int32) * rows
    row, _ = single.quantize_gathered(w.reshape(groups * rows, cols), starts, starts,
                                      groups * rows, leaf, rowwise=True, columnwise=False,
                                      orig_dtype=orig_dtype, expert_rows=rows, raw=True)
    regroup = lambda a: a.reshape(groups, rows, *a.shape[1:])
    return ScaledTensor(regroup(row.data), regroup(row.scale_inv), expert_amax, leaf,
                        orig_dtype, row.rht)
  row, col = single.quantize_single(w.reshape(groups * rows, cols), leaf, rowwise=rowwise,
                                    columnwise=not rowwise, orig_dtype=orig_dtype)
  t = row if rowwise else col
  if rowwise:
    regroup = lambda a: a.reshape(groups, a.shape[0] // groups, *a.shape[1:])
  else:
    regroup = lambda a: jnp.swapaxes(a.reshape(a.shape[0], groups, a.shape[1] // groups), 0, 1)
  amax = regroup(t.amax) if _row_scaled(leaf) else expert_amax
  return ScaledTensor(regroup(t.data), regroup(t.scale_inv), amax, leaf, orig_dtype, t.rht)


def _experts_gathered(w: jax.Array, leaf: Quantizer, rowwise: bool, orig_dtype,
                      expert_amax: jax.Array, raw: bool = False, along_n: bool = False,
                      rowwise_pending: bool = False) -> dict:
  """MXFP8 / Float8Block expert weights from one launch of the gathered kernel with
  `expert_rows`: the columnwise copy with each expert's `[cols, rows]` written on its own (no
  regrouping transpose), and with `rowwise` the rowwise copy too (a reshape), one read of `w`.
  `along_n` (raw MXFP8): the columnwise copy written in w's own layout, `[G, rows, cols]` with
  scales `[G, rows / 32, cols]`, returned as the `TransposedExperts` it is (design decision 49:
  both copies' stores whole rows; the forward GEMM reads it along N). `rowwise_pending` (with
  `along_n` and `rowwise`): the rowwise copy as a `PendingRowwise` (its values not written; the
  kernel's flags instead, design decision 56)."""
  groups, rows, cols = w.shape
  starts = jnp.arange(groups + 1, dtype=jnp.int32) * rows
  w2d = w.reshape(groups * rows, cols)
  row, col = single.quantize_gathered(w2d, starts, starts, groups * rows, leaf, rowwise=rowwise,
                                      columnwise=True, orig_dtype=orig_dtype, expert_rows=rows,
                                      raw=raw, col_in_x_layout=along_n,
                                      row_flags=rowwise_pending)
  col = ScaledTensor(col.data, col.scale_inv, expert_amax, leaf, orig_dtype, col.rht)
  out = {"columnwise": TransposedExperts(col) if along_n else col}
  if rowwise_pending:
    out["rowwise"] = PendingRowwise(w2d, row.data, row.scale_inv.reshape(groups, rows, -1),
                                    expert_amax, leaf, orig_dtype)
  elif rowwise:
    regroup = lambda a: a.reshape(groups, a.shape[0] // groups, *a.shape[1:])
    out["rowwise"] = ScaledTensor(regroup(row.data), regroup(row.scale_inv), expert_amax, leaf,
                                  orig_dtype, row.rht)
  return out


def write_pending(pending: PendingRowwise, forward: TransposedExperts,
                  after: jax.Array) -> ScaledTensor:
  """The rowwise copy `pending` stands for (design decision 56): `forward`'s raw values (the
  columnwise copy in the weights' own layout) with the flagged row blocks rewritten, in place
  where XLA can (`single.patch_mxfp8_rows`); `after` is an array computed from `forward` (the
  forward GEMM's output), so the rewrite runs after that GEMM has read it. Bit for bit the
  rowwise copy `_experts_gathered` writes without `rowwise_pending`."""
  leaf = pending.quantizer
  e5m2 = np.dtype(leaf.dtype) == np.dtype(jnp.float8_e5m2)
  data = single.patch_mxfp8_rows(pending.weights, pending.flags, forward.stored.data, after,
                                 e5m2=bool(e5m2))
  return ScaledTensor(data, pending.scale_inv, pending.amax, leaf, pending.orig_dtype, False)
