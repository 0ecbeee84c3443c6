"""FFI quantize: one wrapper per format, returning the reference's `ScaledTensor`s bit-for-bit.

Each wrapper makes at most two FFI calls: `jaxquant_amax` when the format's scales depend on the
tensor (or row) amax, then the format's fused quantize target, which reads `x` once and writes
the rowwise copy and/or the transposed columnwise copy with their scales. The amax is a separate
call on purpose: a sharded caller inserts its `pmax` between the two.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant.backends.ffi import calls, partitioning, targets
from jaxquant.backends.ffi.partitioning import Layout
from jaxquant.formats import format_of
from jaxquant.formats.base import tensor_amax
from jaxquant.numerics import spec_for_dtype
from jaxquant.quantizers import (HIGH_PRECISION_DTYPES, Float8BlockQuantizer,
                                 Float8DelayedScalingQuantizer, MXFP8Quantizer, NVFP4Quantizer,
                                 Quantizer)
from jaxquant.state import DelayedScalingState
from jaxquant.tensors import ScaledTensor
from jaxquant.settings import env_choice

Pair = tuple[Optional[ScaledTensor], Optional[ScaledTensor]]

# Where per-tensor current scaling gets its amax, `JAXQUANT_FFI_AMAX`: "xla" (a max
# reduction of |x|'s bits, `abs_max`, which XLA may fuse into the fusion producing x or run
# beside the GEMMs; under a mesh XLA makes it global) or "kernel" (the `jaxquant_amax` target,
# one more pass over x on the compute stream). Same bits either way (max is order-free). H200,
# d2048 LM step of bench/e2e.py, five same-process pairs (session 32, design decision 58):
# "xla" 1.4-3.0% faster on the unmodified model and on the modules model, with either attention
# core; session 9's H100 pair (unmodified model) had favoured "kernel" (67.4 against 68.5 ms).
AMAX_SOURCES = ("kernel", "xla")
DEFAULT_AMAX_SOURCE = "xla"


def amax_source() -> str:
  return env_choice("JAXQUANT_FFI_AMAX", AMAX_SOURCES, DEFAULT_AMAX_SOURCE)
_MAX_DIM = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class Request:
  """One quantize call: the matrix, the directions, and the per-call inputs."""

  x2d: jax.Array
  rowwise: bool
  columnwise: bool
  orig_dtype: Any
  row_key_words: Optional[jax.Array] = None
  col_key_words: Optional[jax.Array] = None
  state: Any = None
  # A token layout gathered from x2d's rows (`quantize_gathered`): (starts, pstarts, length).
  gather: Optional[tuple[jax.Array, jax.Array, int]] = None
  # > 0 with `gather`: expert weights of this many rows each, the columnwise copy written as
  # [G, cols, expert_rows] (each expert's on its own) with its scales likewise.
  expert_rows: int = 0
  # With `gather`: the rowwise copy in the packed layout (x2d's rows, those past the groups as
  # zeros) while the columnwise one takes the gathered layout.
  row_packed: bool = False
  # With `gather`, MXFP8: each copy's data as its raw values in bfloat16 (code x block scale,
  # `jaxquant.formats.mxfp8.stores_raw`), written by the kernel instead of the codes.
  raw: bool = False
  # With `raw` and `expert_rows`: the columnwise copy in the weights' own layout,
  # [G, expert_rows, cols] with scales [G, expert_rows / 32, cols] (MXFP8).
  col_in_x_layout: bool = False
  # With `col_in_x_layout` and `rowwise`: the rowwise data result is the kernel's u8 flags of the
  # row blocks whose rowwise values differ from the columnwise copy's, not the values (design
  # decision 56; `patch_mxfp8_rows` writes them later over that copy).
  row_flags: bool = False

  @property
  def shape(self) -> tuple[int, int]:
    """The quantized matrix: x2d, or the gathered layout's `[length, cols]`."""
    if self.gather is not None:
      return (self.gather[2], self.x2d.shape[1])
    return tuple(self.x2d.shape)

  @property
  def row_shape(self) -> tuple[int, int]:
    """The rowwise copy's matrix: `shape`, or x2d's own `[T, cols]` when `row_packed`."""
    return tuple(self.x2d.shape) if self.row_packed else self.shape


def _sds(shape, dtype) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype))


def _data_results(req: Request, dtype, row_scale=None, col_scale=None) -> list:
  """Result shapes in target order: [row data, row scale], [col data, col scale]."""
  rows, cols = req.shape
  out = []
  if req.rowwise:
    out.append(_sds(req.row_shape, dtype))
    if row_scale is not None:
      out.append(row_scale)
  if req.columnwise:
    out.append(_sds((cols, rows), dtype))
    if col_scale is not None:
      out.append(col_scale)
  return out


X_DIMS = (("m", 1), ("k", 1))  # x[rows, cols] and the rowwise copy
XT_DIMS = (("k", 1), ("m", 1))  # the transposed columnwise copy


def _layout(req: Request, target: str, operands, row_scale=None, col_scale=None, tail=(),
            reduce=(), keys=()) -> Layout:
  """The partitioning layout of a quantize target: results in `_data_results` order (data and
  block scales of each requested direction), then `tail` (per-tensor outputs); `reduce` names
  results by their index in `tail`."""
  results = []
  for on, data, scale in ((req.rowwise, X_DIMS, row_scale), (req.columnwise, XT_DIMS, col_scale)):
    if on:
      results.append(data)
      if scale is not None:
        results.append(scale)
  first_tail = len(results)
  return Layout(operands=tuple(operands), results=tuple(results) + tuple(tail),
                reduce=tuple((first_tail + i, axes) for i, axes in reduce), keys=tuple(keys),
                what=target)


# The grouped twin of a single-tensor target: the same results for a token layout read from x
# through group offsets (`Request.gather`).
GATHERED_TARGETS = {"jaxquant_quantize_mxfp8": "jaxquant_grouped_quantize_mxfp8",
                    "jaxquant_quantize_fp8_block": "jaxquant_grouped_quantize_fp8_block"}


def _call(req: Request, target: str, results: list, layout: Layout, gathered=None,
          **attributes) -> list:
  """`target` on `req.x2d`, or its grouped twin on the gathered layout `req.gather` (not
  partitioned: the grouped calls run per device, inside the expert-parallel shard_map), which
  also takes the attributes in `gathered`."""
  if req.gather is None:
    return calls.call(target, results, req.x2d, layout=layout, **attributes)
  starts, pstarts, length = req.gather
  if req.expert_rows:  # [cols, G E] -> [G, cols, E] (scales: [s, G E / b] -> [G, s, E / b])
    groups = length // req.expert_rows
    first = 2 if req.rowwise else 0  # the columnwise data and scales, when asked for
    if req.col_in_x_layout:  # [cols, G E] -> [G, E, cols] (scales: [G, E / b, cols])
      regroup = lambda r: _sds((groups, r.shape[1] // groups, r.shape[0]), r.dtype)
    else:
      regroup = lambda r: _sds((groups, r.shape[0], r.shape[1] // groups), r.dtype)
    results = [regroup(r) if req.columnwise and first <= i < first + 2 else r
               for i, r in enumerate(results)]
  return calls.call(GATHERED_TARGETS[target], results, req.x2d, starts, pstarts,
                    length=np.int64(length), expert_rows=np.int64(req.expert_rows),
                    row_packed=req.row_packed, **(gathered or {}), **attributes)


def _split(req: Request, outs: list, with_scales: bool):
  """Pops (row data, row scale, col data, col scale) off the front of `outs`."""
  row = row_scale = col = col_scale = None
  if req.rowwise:
    row = outs.pop(0)
    row_scale = outs.pop(0) if with_scales else None
  if req.columnwise:
    col = outs.pop(0)
    col_scale = outs.pop(0) if with_scales else None
  return row, row_scale, col, col_scale


def _pair(req: Request, quantizer, row, row_scale, row_amax, col, col_scale, col_amax,
          col_rht=False) -> Pair:
  make = lambda d, s, a, rht: ScaledTensor(d, s, a, quantizer, req.orig_dtype, rht)
  return (make(row, row_scale, row_amax, False) if req.rowwise else None,
          make(col, col_scale, col_amax, col_rht) if req.columnwise else None)


# --------------------------------------- per-tensor FP8 ---------------------------------------

def _fp8_tensor(req: Request, quantizer, *, delayed: bool) -> Pair:
  if delayed:
    if not isinstance(req.state, DelayedScalingState):
      raise ValueError("state: Float8DelayedScalingQuantizer needs its DelayedScalingState "
                       "(jaxquant.init_state(quantizer)); got "
                       f"{type(req.state).__name__}")
    s = req.state.scale.astype(jnp.float32).reshape(())
    if format_of(quantizer).needs_current_amax(quantizer):
      # the state may have no scale yet: the kernel takes it from x's amax
      return _fp8_delayed_first_scale(req, quantizer, s)
    pow2_scale, eps = False, 0.0
  else:
    (s,) = ((tensor_amax(req.x2d),) if amax_source() == "xla"
            else calls.amax(req.x2d, calls.AMAX_TENSOR))
    pow2_scale, eps = quantizer.pow2_scale, quantizer.amax_epsilon
  results = _data_results(req, quantizer.dtype) + [_sds((), np.float32)]
  if delayed:
    results.append(_sds((), np.float32))
  layout = _layout(req, "jaxquant_quantize_fp8", (X_DIMS, ()),
                   tail=((), ()) if delayed else ((),),
                   reduce=((1, ("m", "k")),) if delayed else ())
  outs = calls.call("jaxquant_quantize_fp8", results, req.x2d, s, layout=layout,
                    rowwise=req.rowwise,
                    columnwise=req.columnwise, delayed=delayed, pow2_scale=pow2_scale,
                    amax_epsilon=float(eps))
  row, _, col, _ = _split(req, outs, with_scales=False)
  scale_inv = outs.pop(0)
  amax = outs.pop(0) if delayed else s
  return _pair(req, quantizer, row, scale_inv, amax, col, scale_inv, amax)


def _fp8_delayed_first_scale(req: Request, quantizer, scale: jax.Array) -> Pair:
  """Delayed scaling whose state may have no scale yet (`first_scale="current"`): one call,
  `jaxquant_quantize_fp8_delayed_gated`, whose amax pass reads x only while the stored scale is
  0 and whose quantize kernel takes the scale that amax gives itself (`formats.delayed.
  quantize_scale`'s arithmetic, on the device): no scale math in XLA before the kernel. Where x
  is sharded, the partitioned call runs the gated amax, its pmax and `jaxquant_quantize_fp8_
  delayed` instead (`Layout.sharded`, `_sharded_gated`)."""
  # Gated on the state's scale: the amax pass runs only while the scale is 0 ("none yet");
  # once a scale is stored its grid exits at once, so later steps keep the one-pass cost. Inside
  # the quantize call it costs no command of its own (one fewer per tensor and step).
  target = "jaxquant_quantize_fp8_delayed_gated"
  results = _data_results(req, quantizer.dtype) + [_sds((), np.float32), _sds((), np.float32)]
  layout = dataclasses.replace(
      _layout(req, target, (X_DIMS, ()), tail=((), ()), reduce=((1, ("m", "k")),)),
      sharded=_sharded_gated)
  outs = calls.call(target, results, req.x2d, scale, layout=layout,
                    rowwise=req.rowwise, columnwise=req.columnwise,
                    margin=np.int32(quantizer.margin))
  row, _, col, _ = _split(req, outs, with_scales=False)
  scale_inv, amax = outs.pop(0), outs.pop(0)
  return _pair(req, quantizer, row, scale_inv, amax, col, scale_inv, amax)


def update_in_quantize_reason(quantizer, state) -> Optional[str]:
  """None when one call (`jaxquant_quantize_fp8_delayed_update`) quantizes with `quantizer` and
  updates its `state`, else why the update stays a call of its own."""
  if not isinstance(quantizer, Float8DelayedScalingQuantizer):
    return f"{type(quantizer).__name__} keeps no state the quantize call updates"
  if not isinstance(state, DelayedScalingState):
    return f"state: expected a DelayedScalingState, got {type(state).__name__}"
  if jnp.ndim(state.scale) != 0 or jnp.ndim(state.amax_history) != 1:
    return "a batch of states (leading axes) is updated by its own call"
  return None


def quantize_single_with_update(x2d, quantizer, *, rowwise: bool, columnwise: bool,
                                orig_dtype: Any, state) -> tuple[Pair, DelayedScalingState]:
  """`quantize_single` and the state's update (`jaxquant.formats.delayed.
  delayed_scaling_update` of the quantized tensor's amax) in one call: one command a tensor and
  step instead of two (design decision 36). Where x is sharded the partitioned call runs the
  quantize, the amax's `pmax` and `jaxquant_delayed_update` (`Layout.sharded`)."""
  reason = (unsupported(x2d, quantizer, rowwise=rowwise, columnwise=columnwise)
            or update_in_quantize_reason(quantizer, state))
  if reason is not None:
    raise ValueError(f"FFI quantize cannot update the state of {quantizer}: {reason}")
  req = Request(x2d, rowwise, columnwise, orig_dtype, state=state)
  history = state.amax_history.astype(jnp.float32)
  scale = state.scale.astype(jnp.float32).reshape(())
  target = "jaxquant_quantize_fp8_delayed_update"
  state_dims = ((None, 1),)  # a state is never sharded
  results = (_data_results(req, quantizer.dtype)
             + [_sds((), np.float32), _sds((), np.float32), _sds(history.shape, np.float32),
                _sds((), np.float32)])
  first_state = len(results) - 2
  layout = dataclasses.replace(
      _layout(req, target, (X_DIMS, (), state_dims), tail=((), (), state_dims, ()),
              reduce=((1, ("m", "k")),)),
      aliases=((2, first_state), (1, first_state + 1)), sharded=_sharded_update)
  outs = calls.call(target, results, req.x2d, scale, history, layout=layout,
                    rowwise=req.rowwise, columnwise=req.columnwise,
                    margin=np.int32(quantizer.margin),
                    gated=format_of(quantizer).needs_current_amax(quantizer),
                    most_recent=quantizer.amax_compute_algo == "most_recent",
                    fmax=float(spec_for_dtype(quantizer.dtype).fmax))
  row, _, col, _ = _split(req, outs, with_scales=False)
  scale_inv, amax, new_history, new_scale = outs
  return (_pair(req, quantizer, row, scale_inv, amax, col, scale_inv, amax),
          DelayedScalingState(new_scale, new_history))


def _sharded_first_amax(x, scale, mesh_axes) -> jax.Array:
  """The gated amax of a sharded x, global (`pmax` over the shards)."""
  (amax,) = targets.call("jaxquant_amax_gated", [_sds((), np.float32)], x, scale,
                         outputs=np.int32(calls.AMAX_TENSOR))
  return partitioning.pmax_nan(amax, mesh_axes)


def _sharded_gated(args, local, attrs, mesh_axes) -> list:
  """`jaxquant_quantize_fp8_delayed_gated` on a shard of x: the global gated amax, then the
  quantize that takes it (`jaxquant_quantize_fp8_delayed`), its amax made global."""
  x, scale = args
  outs = targets.call("jaxquant_quantize_fp8_delayed", local, x, scale,
                      _sharded_first_amax(x, scale, mesh_axes), **attrs)
  outs[-1] = partitioning.pmax_nan(outs[-1], mesh_axes)  # amax, the last result
  return outs


def _sharded_update(args, local, attrs, mesh_axes) -> list:
  """`jaxquant_quantize_fp8_delayed_update` on a shard of x: the quantize (after the global
  gated amax when `gated`), the global amax, then the state's update from it."""
  x, scale, history = args
  attrs = dict(attrs)
  gated, most_recent = attrs.pop("gated"), attrs.pop("most_recent")
  fmax, margin = attrs.pop("fmax"), attrs.pop("margin")
  quantized = local[:-2]
  if gated:
    outs = targets.call("jaxquant_quantize_fp8_delayed", quantized, x, scale,
                        _sharded_first_amax(x, scale, mesh_axes), margin=margin, **attrs)
  else:  # a stored scale, used as it is
    outs = targets.call("jaxquant_quantize_fp8", quantized, x, scale, delayed=np.bool_(True),
                        pow2_scale=np.bool_(False), amax_epsilon=np.float32(0.0), **attrs)
  outs[-1] = partitioning.pmax_nan(outs[-1], mesh_axes)
  new_history, new_scale = targets.call(
      "jaxquant_delayed_update", local[-2:], history, scale, outs[-1], aliases={0: 0, 1: 1},
      fmax=fmax, margin=margin, most_recent=most_recent)
  return outs + [new_history, new_scale]


def _block_scales(req: Request, quantizer: Quantizer) -> tuple:
  """(rowwise scale result, columnwise scale result, rowwise dims, columnwise dims) of a
  block-scaled format, laid out as the format says (`Format.scale_shape`, `scale_dtype`)."""
  fmt = format_of(quantizer)
  rows, cols = req.shape
  dtype = fmt.scale_dtype(quantizer)
  block_rows, block_cols = fmt.block_shape(quantizer)
  return (_sds(fmt.scale_shape(quantizer, *req.row_shape), dtype),
          _sds(fmt.scale_shape(quantizer, cols, rows), dtype),
          (("m", block_rows), ("k", block_cols)), (("k", block_rows), ("m", block_cols)))


# -------------------------------------------- MXFP8 -------------------------------------------

def _mxfp8(req: Request, quantizer: MXFP8Quantizer) -> Pair:
  if req.raw and req.gather is None:
    raise ValueError("raw MXFP8 copies come from the grouped target only (a gathered request)")
  row_scale, col_scale, row_dims, col_dims = _block_scales(req, quantizer)
  data_dtype = jnp.bfloat16 if req.raw else quantizer.dtype
  results = _data_results(req, data_dtype, row_scale, col_scale) + [_sds((), np.float32)]
  layout = _layout(req, "jaxquant_quantize_mxfp8", (X_DIMS,), row_dims, col_dims, tail=((),),
                   reduce=((0, ("m", "k")),))
  e5m2 = np.dtype(quantizer.dtype) == np.dtype(jnp.float8_e5m2)  # raw data does not say it
  if req.row_flags:  # the flags stand in for the rowwise values
    rows, cols = req.shape
    results[0] = _sds((x_layout_flag_count(rows, cols),), np.uint8)
  outs = _call(req, "jaxquant_quantize_mxfp8", results, layout, rowwise=req.rowwise,
               columnwise=req.columnwise,
               gathered=dict(raw=req.raw, raw_e5m2=req.raw and bool(e5m2),
                             col_in_x_layout=req.col_in_x_layout, row_flags=req.row_flags))
  row, row_scale, col, col_scale = _split(req, outs, with_scales=True)
  amax = outs.pop(0)
  return _pair(req, quantizer, row, row_scale, amax, col, col_scale, amax)


def x_layout_flag_count(rows: int, cols: int) -> int:
  """The flag bytes `row_flags` writes for an `[rows, cols]` matrix: 8 (64 bits, little-endian)
  a 32 x 64 block, 8 blocks a 128 x 128 tile (tiles row-major; block w at rows 32 (w // 2) and
  columns 64 (w % 2) of its tile); bit 32 h + i is row i of the block's row block h."""
  return -(-rows // 128) * -(-cols // 128) * 64


def patch_mxfp8_rows(w2d: jax.Array, flags: jax.Array, copy: jax.Array, after: jax.Array, *,
                     e5m2: bool) -> jax.Array:
  """The raw MXFP8 rowwise copy of bfloat16 expert weights `w2d[G * rows, cols]`, written over
  their raw columnwise copy in the weights' own layout `copy[G, rows, cols]` (design decision
  56): the rowwise values of the row blocks `flags` marks (from
  `quantize_gathered(row_flags=True)`), the rest of `copy` as it is (there the copies are
  equal). XLA updates `copy` in place (`jaxquant_grouped_patch_mxfp8_rows` aliases it to its
  output) when nothing reads it after this call: `after`, an array computed from `copy` (the
  forward GEMM's output), is an operand the kernel never reads, so that this call comes after
  that reader."""
  if np.dtype(w2d.dtype) != np.dtype(jnp.bfloat16) or w2d.ndim != 2:
    raise ValueError(f"w2d: expected bfloat16 [G * rows, cols] weights, got "
                     f"{np.dtype(w2d.dtype).name} {tuple(w2d.shape)}")
  if (copy.ndim != 3 or copy.shape[0] * copy.shape[1] != w2d.shape[0]
      or copy.shape[2] != w2d.shape[1] or np.dtype(copy.dtype) != np.dtype(jnp.bfloat16)):
    raise ValueError(f"copy: expected bfloat16 [G, rows, cols] with G * rows, cols = "
                     f"{tuple(w2d.shape)}, got {np.dtype(copy.dtype).name} {tuple(copy.shape)}")
  if flags.shape != (x_layout_flag_count(*w2d.shape),):
    raise ValueError(f"flags: expected [{x_layout_flag_count(*w2d.shape)}], got "
                     f"{tuple(flags.shape)}")
  (out,) = targets.call("jaxquant_grouped_patch_mxfp8_rows", [_sds(copy.shape, jnp.bfloat16)],
                        w2d, flags, copy, after, aliases={2: 0}, raw_e5m2=bool(e5m2))
  return out


# ------------------------------------------ Float8Block ---------------------------------------

def _fp8_block(req: Request, quantizer: Float8BlockQuantizer) -> Pair:
  block_2d = quantizer.block == (128, 128)
  row_scale, col_scale, row_dims, col_dims = _block_scales(req, quantizer)
  results = _data_results(req, quantizer.dtype, row_scale, col_scale) + [_sds((), np.float32)]
  layout = _layout(req, "jaxquant_quantize_fp8_block", (X_DIMS,), row_dims, col_dims,
                   tail=((),), reduce=((0, ("m", "k")),))
  outs = _call(req, "jaxquant_quantize_fp8_block", results, layout, rowwise=req.rowwise,
               columnwise=req.columnwise, block_2d=block_2d, pow2_scale=quantizer.pow2_scale,
               amax_epsilon=float(quantizer.amax_epsilon))
  row, row_scale, col, col_scale = _split(req, outs, with_scales=True)
  amax = outs.pop(0)
  return _pair(req, quantizer, row, row_scale, amax, col, col_scale, amax)


# --------------------------------------------- NVFP4 ------------------------------------------

def _nvfp4_amax(req: Request, q: NVFP4Quantizer) -> tuple[jax.Array, jax.Array]:
  """(row amax, col amax): the global-scale inputs of each requested direction, from one
  `jaxquant_amax` pass (placeholders for a direction not requested)."""
  row_bit = (calls.AMAX_ROWS if q.row_scaled else calls.AMAX_TENSOR) if req.rowwise else 0
  col_bit = 0
  if req.columnwise:
    if q.row_scaled:
      col_bit = calls.AMAX_COLS_RHT if q.rht else calls.AMAX_COLS
    else:
      col_bit = calls.AMAX_TENSOR_RHT if q.rht else calls.AMAX_TENSOR
  outs = calls.amax(req.x2d, row_bit | col_bit)
  by_bit = dict(zip([b for b in (1, 2, 4, 8, 16) if (row_bit | col_bit) & b], outs))
  placeholder = jnp.zeros((), jnp.float32)
  return by_bit.get(row_bit, placeholder), by_bit.get(col_bit, placeholder)


def _key(words: Optional[jax.Array], stochastic: bool) -> jax.Array:
  if not stochastic:
    return jnp.zeros((2,), jnp.uint32)
  if words is None:
    raise ValueError("key: NVFP4Quantizer(stochastic_rounding=True) needs a PRNG key")
  return jnp.asarray(words, jnp.uint32).reshape(2)


def _nvfp4(req: Request, q: NVFP4Quantizer) -> Pair:
  row_amax, col_amax = _nvfp4_amax(req, q)
  row_scale, col_scale, row_dims, col_dims = _block_scales(req, q)
  results = _data_results(req, jnp.float4_e2m1fn, row_scale, col_scale)
  amax_dims = lambda a, axis: ((axis, 1),) if a.ndim else ()  # per row, or per tensor
  key_dims = ((None, 1),)
  layout = _layout(req, "jaxquant_quantize_nvfp4",
                   (X_DIMS, amax_dims(row_amax, "m"), amax_dims(col_amax, "k"), key_dims,
                    key_dims),
                   row_dims, col_dims,
                   keys=((3, "m", "k"), (4, "k", "m")) if q.stochastic_rounding else ())
  outs = calls.call("jaxquant_quantize_nvfp4", results, req.x2d, row_amax, col_amax,
                    _key(req.row_key_words, q.stochastic_rounding),
                    _key(req.col_key_words, q.stochastic_rounding), layout=layout,
                    rowwise=req.rowwise,
                    columnwise=req.columnwise, row_scaled=q.row_scaled, block_2d=q.block_2d,
                    rht=q.rht, stochastic=q.stochastic_rounding)
  row, row_s, col, col_s = _split(req, outs, with_scales=True)
  return _pair(req, q, row, row_s, row_amax, col, col_s, col_amax, col_rht=q.rht)


# ------------------------------------------- registry -----------------------------------------

# The wrapper of each FFI quantize family a format names (`Format.quantize_kernel`).
KERNEL_FORMATS: dict[str, Callable[[Request, Quantizer], Pair]] = {
    "fp8-current": lambda req, q: _fp8_tensor(req, q, delayed=False),
    "fp8-delayed": lambda req, q: _fp8_tensor(req, q, delayed=True),
    "mxfp8": _mxfp8,
    "fp8-block": _fp8_block,
    "nvfp4": _nvfp4,
}


def kernel_reason(quantizer: Quantizer) -> Optional[str]:
  """Why no FFI quantize kernel serves `quantizer`'s format (None: one does)."""
  if format_of(quantizer).quantize_kernel(quantizer) not in KERNEL_FORMATS:
    return f"no FFI quantize kernel for {type(quantizer).__name__}"
  return None


def unsupported(x2d, quantizer: Quantizer, *, rowwise: bool, columnwise: bool) -> Optional[str]:
  """None when a kernel serves this quantize, else the reason (the reference path is taken)."""
  reason = kernel_reason(quantizer)
  if reason is not None:
    return reason
  if x2d.ndim != 2 or 0 in x2d.shape:
    return f"the FFI kernels need a non-empty 2-D matrix; got shape {tuple(x2d.shape)}"
  if np.dtype(x2d.dtype) not in HIGH_PRECISION_DTYPES:
    return f"the FFI kernels read bfloat16/float16/float32, not {np.dtype(x2d.dtype).name}"
  if max(x2d.shape) > _MAX_DIM:
    return f"shape {tuple(x2d.shape)} has a dimension >= 2^31"
  if (columnwise and format_of(quantizer).uses_rht(quantizer, "columnwise")
      and x2d.shape[0] % 16):
    return "NVFP4 rht needs a row count that is a multiple of 16"
  return None


def quantize_single(x2d, quantizer: Quantizer, *, rowwise: bool, columnwise: bool,
                    orig_dtype: Any, row_key_words=None, col_key_words=None,
                    state=None) -> Pair:
  """Same contract as `jaxquant.backends.reference.ops.quantize_single`, through the FFI kernels."""
  reason = unsupported(x2d, quantizer, rowwise=rowwise, columnwise=columnwise)
  if reason is not None:
    raise ValueError(f"FFI quantize cannot serve {quantizer}: {reason}")
  req = Request(x2d, rowwise, columnwise, orig_dtype, row_key_words, col_key_words, state)
  return KERNEL_FORMATS[format_of(quantizer).quantize_kernel(quantizer)](req, quantizer)


def gathered_kernel(quantizer: Quantizer) -> Optional[str]:
  """The grouped target that quantizes a token layout gathered from x through group offsets in
  `quantizer`'s format (MXFP8, Float8Block), or None (the layout is gathered by XLA first)."""
  kind = format_of(quantizer).quantize_kernel(quantizer)
  single = {"mxfp8": "jaxquant_quantize_mxfp8", "fp8-block": "jaxquant_quantize_fp8_block"}
  return GATHERED_TARGETS.get(single.get(kind, ""))


def quantize_gathered(x2d, starts: jax.Array, pstarts: jax.Array, length: int,
                      quantizer: Quantizer, *, rowwise: bool, columnwise: bool,
                      orig_dtype: Any, expert_rows: int = 0, row_packed: bool = False,
                      raw: bool = False, col_in_x_layout: bool = False,
                      row_flags: bool = False) -> Pair:
  """`quantize_single` of the token layout of `length` positions gathered from `x2d`'s rows
  (position pstarts[g] + i holds row starts[g] + i while inside group g, else zeros), bit for
  bit, with no gathered copy: `gathered_kernel(quantizer)` reads x through the offsets.

  `expert_rows` > 0: x2d is expert weights `[G expert_rows, cols]` (starts = pstarts = g
  expert_rows), which the kernel reads directly; the columnwise copy comes back as
  `[G, cols, expert_rows]` with its scales likewise (each expert's copy, written so by the
  kernel: no regrouping transpose), the rowwise copy as `[G expert_rows, cols]`.

  `row_packed` (tokens, a format with one-row blocks): the rowwise copy of the packed layout
  (`quantize_gathered(x2d, starts, starts, T, ...)`'s) and the columnwise copy of this one from
  one launch, one read of x.

  `raw` (MXFP8): each copy's data is its raw values in bfloat16 (code x block scale, the bits
  the grouped decode would give; `jaxquant.formats.mxfp8.stores_raw`), its scales and amax as
  always.

  `col_in_x_layout` (raw bfloat16 expert weights): the columnwise copy in the weights' layout,
  `[G, expert_rows, cols]` with scales `[G, expert_rows / 32, cols]`: each expert's columnwise
  storage transposed, for GEMMs that read bfloat16 operands along N (the kernel then writes
  whole rows of both copies).

  `row_flags` (with `col_in_x_layout` and `rowwise`): the rowwise values are not written; the
  rowwise `ScaledTensor`'s data is instead `u8[x_layout_flag_count(length, cols)]`, 1 for each
  row block whose rowwise values differ from the columnwise copy's (its scales and amax as
  always), for `patch_mxfp8_rows` (design decision 56)."""
  if row_flags and not (col_in_x_layout and rowwise):
    raise ValueError(f"row_flags: needs col_in_x_layout and a rowwise copy (the flags stand in "
                     f"for its values); got col_in_x_layout={col_in_x_layout}, "
                     f"rowwise={rowwise}")
  if raw and format_of(quantizer).name != "mxfp8":
    raise ValueError(f"raw: only MXFP8 copies are written raw; got {quantizer}")
  if col_in_x_layout and not (raw and expert_rows and columnwise
                              and np.dtype(x2d.dtype) == np.dtype(jnp.bfloat16)):
    raise ValueError(f"col_in_x_layout: needs raw copies of bfloat16 expert weights with a "
                     f"columnwise copy; got raw={raw}, expert_rows={expert_rows}, "
                     f"columnwise={columnwise}, {np.dtype(x2d.dtype).name} weights")
  if gathered_kernel(quantizer) is None:
    raise ValueError(f"no gathered quantize kernel for {quantizer}")
  if row_packed and (not rowwise or expert_rows or length < x2d.shape[0]
                     or format_of(quantizer).block_shape(quantizer)[0] != 1):
    raise ValueError(f"row_packed: needs the rowwise copy of tokens in one-row blocks and a "
                     f"layout of at least {x2d.shape[0]} positions; got {quantizer}, "
                     f"rowwise={rowwise}, expert_rows={expert_rows}, length={length}")
  if expert_rows and length % expert_rows:
    raise ValueError(f"expert_rows={expert_rows}: needs a length ({length}) of whole experts")
  reason = unsupported(x2d, quantizer, rowwise=rowwise, columnwise=columnwise)
  if reason is not None:
    raise ValueError(f"FFI quantize cannot serve {quantizer}: {reason}")
  req = Request(x2d, rowwise, columnwise, orig_dtype,
                gather=(starts.astype(jnp.int32), pstarts.astype(jnp.int32), int(length)),
                expert_rows=int(expert_rows), row_packed=bool(row_packed), raw=bool(raw),
                col_in_x_layout=bool(col_in_x_layout), row_flags=bool(row_flags))
  return KERNEL_FORMATS[format_of(quantizer).quantize_kernel(quantizer)](req, quantizer)
