"""Grouped ops: quantize tokens by group, quantize expert weights, multiply them.

`quantize(x, group_sizes, quantizer)` quantizes tokens `x[T, C]` sorted by group so that every
group's storage is bit-for-bit `jaxquant.ops.quantize` of that group alone (per-group amax, scales,
second-level scales, delayed-scaling state and stochastic-rounding key), in one program for all
groups. `quantize_experts(w, quantizer)` quantizes `w[G, rows, cols]` one expert at a time (a
`vmap`). `gemm` runs the two ragged GEMMs of `jaxquant.backends.reference.grouped`.

Each op validates its arguments, asks the FFI backend (`jaxquant.backends.ffi.grouped.ops`) whether
a grouped kernel can serve it, and records the path taken and why for `jaxquant.explain` (op names
`grouped_quantize` and `grouped_gemm`).
"""

from __future__ import annotations

from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant.explain import Decision, record
from jaxquant.backends.ffi.grouped import ops as kernels
from jaxquant.backends.reference import grouped as reference
from jaxquant.grouping import formats
from jaxquant.grouping.formats import GroupedContext
from jaxquant.grouping.layout import TokenLayout, clip_sizes
from jaxquant.grouping.tensors import (GroupedQuantizedTensor, GroupedScaledTensor,
                                       PendingRowwise, TransposedExperts)
from jaxquant.numerics import rht16
from jaxquant.numerics.random_bits import key_words
from jaxquant.ops import dispatch
from jaxquant.backends.reference import ops as matrix_reference
from jaxquant.formats import format_of
from jaxquant.quantizers import HIGH_PRECISION_DTYPES, Quantizer
from jaxquant.tensors import QuantizedTensor, ScaledTensor

__all__ = ["quantize", "quantize_experts", "gemm", "to_tokens", "check_group_sizes"]

DIRECTIONS = ("rowwise", "columnwise")


# ----------------------------------------- layouts --------------------------------------------

def wgrad_token_block(x_quantizer: Quantizer, dy_quantizer: Quantizer) -> int:
  """The token-layout block of the wgrad operands (the columnwise copies of x and dy): each
  format's scale block along the tokens, and what the kernel that will run the wgrad GEMM needs
  (16-aligned group starts for the CUTLASS Hopper kernel)."""
  block = max(formats.token_block(x_quantizer, "columnwise"),
              formats.token_block(dy_quantizer, "columnwise"))
  if dispatch.requested_backend() != "reference":
    block = max(block, kernels.sm90_wgrad_block(x_quantizer, dy_quantizer))
  return block


# ----------------------------------------- validation -----------------------------------------

def check_group_sizes(group_sizes: Any, groups: Optional[int] = None,
                      tokens: Optional[int] = None) -> jax.Array:
  """`group_sizes` as an int32 `[G]` array, after checking its dtype and shape (and, when it is
  concrete, that the sizes are >= 0 and sum to at most `tokens`)."""
  if not hasattr(group_sizes, "shape") or not hasattr(group_sizes, "dtype"):
    if isinstance(group_sizes, (list, tuple)) and all(
        isinstance(v, (int, np.integer)) for v in group_sizes):
      group_sizes = np.asarray(group_sizes, np.int32)
    else:
      raise TypeError(f"group_sizes: expected an integer array of shape [groups], got "
                      f"{type(group_sizes).__name__}")
  dtype = np.dtype(group_sizes.dtype)
  if not np.issubdtype(dtype, np.integer):
    raise TypeError(f"group_sizes: dtype {dtype.name} is not an integer dtype; expected int32 "
                    "token counts (e.g. jnp.bincount(expert_ids, length=experts))")
  if group_sizes.ndim != 1 or group_sizes.shape[0] == 0:
    raise ValueError(f"group_sizes: expected a non-empty 1-D array [groups], got shape "
                     f"{tuple(group_sizes.shape)}")
  if groups is not None and group_sizes.shape[0] != groups:
    raise ValueError(f"group_sizes: shape {tuple(group_sizes.shape)} does not match the "
                     f"{groups} groups of the kernel; expected ({groups},)")
  if not isinstance(group_sizes, jax.core.Tracer):
    values = np.asarray(group_sizes).astype(np.int64)
    if (values < 0).any():
      raise ValueError(f"group_sizes: negative sizes {values.tolist()}; expected counts >= 0")
    if tokens is not None and values.sum() > tokens:
      raise ValueError(f"group_sizes: the sizes sum to {int(values.sum())}, more than the "
                       f"{tokens} rows of x")
  return jnp.asarray(group_sizes).astype(jnp.int32)


def _check_tokens(x: Any, name: str = "x") -> None:
  if not hasattr(x, "dtype") or not hasattr(x, "shape"):
    raise TypeError(f"{name}: expected a jax array, got {type(x).__name__}")
  if np.dtype(x.dtype) not in HIGH_PRECISION_DTYPES:
    raise TypeError(f"{name}: dtype {np.dtype(x.dtype).name} cannot be quantized; expected "
                    "bfloat16, float16 or float32")
  if x.ndim != 2:
    raise ValueError(f"{name}: expected 2-D tokens [tokens, features] sorted by group, got "
                     f"shape {tuple(x.shape)}")


def _check_keys(keys, quantizer: Quantizer, groups: int) -> None:
  if keys is None:
    if format_of(quantizer).needs_key(quantizer):
      raise ValueError(f"keys: {quantizer} uses stochastic rounding and needs one PRNG key "
                       f"per group (shape [{groups}])")
    return
  lead = keys.shape[0] if keys.ndim else None
  if lead != groups:
    raise ValueError(f"keys: expected one PRNG key per group (shape [{groups}]), got shape "
                     f"{tuple(keys.shape)}")


def _direction_words(keys, quantizer: Quantizer) -> dict[str, Optional[jax.Array]]:
  """Per group, the stochastic-rounding words `jaxquant.ops.quantize` derives from that group's
  key for each direction (plain: fold_in(key, 0 | 1); Hybrid: the rowwise half fold_in(key, 0),
  the columnwise half fold_in(fold_in(key, 2), 1))."""
  fmt = format_of(quantizer)
  words = {}
  for direction in DIRECTIONS:
    words[direction] = None
    leaf = quantizer.for_direction(direction)
    if keys is not None and format_of(leaf).needs_key(leaf):

      def derive(key, path=fmt.key_path(quantizer, direction)):
        for i in path:
          key = jax.random.fold_in(key, i)
        return key_words(key)

      words[direction] = jax.vmap(derive)(keys)
  return words


def _layout_block(leaf: Quantizer, direction: str, requested: Optional[int]) -> int:
  need = formats.token_block(leaf, direction)
  if requested is None:
    return need
  if requested < 1 or requested & (requested - 1) or requested % need:
    raise ValueError(f"{'row' if direction == 'rowwise' else 'col'}_block={requested}: the "
                     f"{direction} copy of {leaf} needs a power-of-two token block that is a "
                     f"multiple of {need}")
  return requested


def _record(op: str, role, detail: str, quantizer: Optional[Quantizer], reason_fn,
            ffi_note_fn=None) -> str:
  """Choose and record the path; on the FFI path `ffi_note_fn()` gives (detail suffix, why a
  slower kernel serves it or "")."""
  if quantizer is not None and format_of(quantizer).high_precision:
    path, reason = "reference", ""  # nothing to compute
  else:
    path, reason = dispatch.choose(op.replace("_", " "), reason_fn())
  if path == "ffi" and ffi_note_fn is not None:
    suffix, reason = ffi_note_fn()
    detail = f"{detail}; {suffix}"
  shown = path if path == "reference" else dispatch.ffi_module().path_name()  # ffi-cpu|ffi-cuda
  record(Decision(op, role, detail, shown, reason))
  return path


# ------------------------------------------- quantize -----------------------------------------

def _kernel_note(leaf: Quantizer, decoded: bool = False, direction: str = "rowwise"):
  """The `_record` note of an FFI quantize: for per-tensor FP8 (the grouped FP8 kernel) the
  launches that run (delayed scaling has no amax pass); for copies written raw for the decoded
  GEMMs (`decoded` on CUDA: MXFP8, NVFP4 on its grouped kernel) that they are; else None."""
  if kernels.quantize_route(leaf, "rowwise")[0] == "fp8":
    return lambda: (kernels.fp8_kernel_note(leaf), "")
  if decoded and (kernels.raw_copies_reason(leaf) is None
                  or kernels.nvfp4_raw_reason(leaf, direction) is None):
    return lambda: ("written as raw bfloat16 values for the GEMMs on decoded operands (no "
                    "decode pass)", "")
  return None


def _tokens(x, sizes, leaf: Quantizer, direction: str, layout: TokenLayout, words, state,
            orig_dtype, role, decoded: bool = False) -> GroupedScaledTensor:
  detail = (f"{direction}: {leaf} [{layout.groups} groups, "
            f"{'packed' if not layout.padded else f'token block {layout.block}'}]")
  path = _record("grouped_quantize", role, detail, leaf,
                 lambda: kernels.quantize_unsupported(leaf, direction, tuple(x.shape)),
                 _kernel_note(leaf, decoded, direction))
  if path == "ffi":
    return kernels.quantize_tokens(x, sizes, leaf, direction, layout, words, state, orig_dtype,
                                   decoded)
  return _tokens_reference(x, sizes, leaf, direction, layout, words, state, orig_dtype)


def _tokens_reference(x, sizes, leaf: Quantizer, direction: str, layout: TokenLayout, words,
                      state, orig_dtype) -> GroupedScaledTensor:
  mat = layout.gather(x, sizes)
  group, local, _ = layout.positions(sizes)
  token_axis, rht = 0, format_of(leaf).uses_rht(leaf, direction)
  if direction == "columnwise":
    mat, token_axis = mat.T, 1
    if rht:
      mat = rht16(mat)
  ctx = GroupedContext(orig_dtype, token_axis, layout.groups, group, local, words, state, rht)
  data, scale_inv, amax = formats.quantize(mat, leaf, ctx)
  return GroupedScaledTensor(data, scale_inv, amax, sizes, leaf, orig_dtype, rht, token_axis,
                             layout)


def quantize(x: jax.Array, group_sizes: jax.Array, quantizer: Quantizer, *,
             rowwise: bool = True, columnwise: bool = True, row_block: Optional[int] = None,
             col_block: Optional[int] = None, keys: Optional[jax.Array] = None,
             state: Any = None, role: Any = None,
             decoded: bool = False) -> GroupedQuantizedTensor:
  """Quantize tokens `x[T, C]` sorted by group, each group as if it were alone.

  Group `g` (rows `[n_0 + ... + n_{g-1}, ... + n_g)`) gets bit-for-bit the storage that
  `jaxquant.ops.quantize(x_g, quantizer, key=keys[g], state=state[g])` gives its rows
  zero-padded to the copy's token block (`GroupedScaledTensor.group(g)` is that storage):
  per-tensor formats keep one amax and scale per group in both directions; block scales never
  span two groups (the copy whose blocks run along tokens uses the padded layout of
  `jaxquant.grouping.layout`); the RHT transforms 16-token chunks of one group; stochastic
  rounding uses each group's key at the token's index within the group. Rows past
  `sum(group_sizes)` belong to no group (quantized as zeros).

  Args:
    x: bfloat16, float16 or float32 `[T, C]`.
    group_sizes: integer `[G]` tokens per group (>= 0, summing to at most T).
    quantizer: any jaxquant quantizer (a Hybrid quantizes each direction with its own half).
    rowwise, columnwise: which copies to produce (columnwise is stored transposed, `[C, L]`).
    row_block, col_block: token-layout block of each copy (a power of two and a multiple of
      what the format needs; default: what it needs, 1 = packed). The two columnwise operands
      of a weight-gradient GEMM must share one block (`jaxquant.grouped_dense` picks it).
    keys: one PRNG key per group (`[G]`), required for stochastic rounding.
    state: per-group state (`jaxquant.grouped.init_state(quantizer, G)`) for delayed scaling.
    role: optional `QuantizerRole` for `jaxquant.explain`.
    decoded: the copies feed only `gemm`; where the backend's grouped GEMMs decode a format to
      bfloat16 anyway (MXFP8 on CUDA), its quantize kernel may store that format's copies as
      their raw values in bfloat16 (`Format.stores_raw`: the decode's bits, no decode pass).
      Such copies dequantize and multiply exactly as the codes do.
  """
  if not isinstance(quantizer, Quantizer):
    raise TypeError(f"quantizer: expected a jaxquant Quantizer, got {type(quantizer).__name__}")
  if not (rowwise or columnwise):
    raise ValueError("rowwise and columnwise are both False; ask for at least one direction")
  _check_tokens(x)
  tokens = x.shape[0]
  sizes = check_group_sizes(group_sizes, tokens=tokens)
  groups = sizes.shape[0]
  _check_keys(keys, quantizer, groups)
  if quantizer.stateful and state is None:
    raise ValueError(f"state: {quantizer} is stateful; pass state=jaxquant.grouped.init_state("
                     f"quantizer, {groups})")
  sizes = clip_sizes(sizes, tokens)
  words = _direction_words(keys, quantizer)
  orig_dtype = np.dtype(x.dtype)
  requested = {"rowwise": row_block, "columnwise": col_block}

  def copy(source, leaf, direction, leaf_state):
    layout = TokenLayout(tokens, groups, _layout_block(leaf, direction, requested[direction]))
    return _tokens(source, sizes, leaf, direction, layout, words[direction], leaf_state,
                   orig_dtype, role, decoded)

  fmt = format_of(quantizer)
  halves = fmt.halves(quantizer)
  if halves is None:  # one quantizer makes both copies
    layouts = {d: TokenLayout(tokens, groups, _layout_block(quantizer, d, requested[d]))
               for d in DIRECTIONS}
    if rowwise and columnwise and kernels.pair_served(quantizer, *layouts.values(),
                                                      tuple(x.shape)):
      return _token_pair(x, sizes, quantizer, layouts, words, state, orig_dtype, role, decoded)
    row = copy(x, quantizer, "rowwise", state) if rowwise else None
    col = copy(x, quantizer, "columnwise", state) if columnwise else None
    return GroupedQuantizedTensor(row, col, quantizer)
  row_state, col_state = fmt.split_state(quantizer, state)
  from_rowwise = columnwise and fmt.columnwise_from_rowwise(quantizer)
  row = col = None
  if rowwise or from_rowwise:
    row = copy(x, halves[0], "rowwise", row_state)
  if columnwise:
    source = row.tokens(jnp.float32) if from_rowwise else x
    col = copy(source, halves[1], "columnwise", col_state)
  return GroupedQuantizedTensor(row if rowwise else None, col, quantizer)


def _token_pair(x, sizes, leaf: Quantizer, layouts: dict, words: dict, state, orig_dtype, role,
                decoded: bool = False) -> GroupedQuantizedTensor:
  """Both copies of per-tensor FP8, NVFP4, MXFP8 or Float8Block tokens, each in its layout
  (`layouts[direction]`: one layout, or a packed rowwise one beside a padded columnwise one):
  one FFI call reads x once (`kernels.pair_served`); `words`: the stochastic-rounding words
  by direction."""
  name = lambda layout: "packed" if not layout.padded else f"token block {layout.block}"
  row_layout, col_layout = layouts["rowwise"], layouts["columnwise"]
  shape = (name(row_layout) if row_layout == col_layout
           else f"rowwise {name(row_layout)}, columnwise {name(col_layout)}")
  detail = f"rowwise+columnwise: {leaf} [{row_layout.groups} groups, {shape}]"
  path = _record("grouped_quantize", role, detail, leaf,
                 lambda: kernels.quantize_unsupported(leaf, "rowwise"),
                 _kernel_note(leaf, decoded))
  if path == "ffi":
    row, col = kernels.quantize_token_pair(x, sizes, leaf, row_layout, col_layout, state,
                                           orig_dtype, decoded, words)
  else:
    row, col = (_tokens_reference(x, sizes, leaf, d, layouts[d], words[d], state, orig_dtype)
                for d in DIRECTIONS)
  return GroupedQuantizedTensor(row, col, leaf)


def _expert(w2d, quantizer: Quantizer, rowwise: bool, columnwise: bool, words, state,
            orig_dtype) -> QuantizedTensor:
  """One expert's `jaxquant.ops.quantize` on the reference path (run under `vmap`)."""
  single = lambda m, q, r, c, s: matrix_reference.quantize_single(
      m, q, rowwise=r, columnwise=c, orig_dtype=orig_dtype, row_key_words=words["rowwise"],
      col_key_words=words["columnwise"], state=s)
  fmt = format_of(quantizer)
  halves = fmt.halves(quantizer)
  if halves is None:
    row, col = single(w2d, quantizer, rowwise, columnwise, state)
    return QuantizedTensor(row, col, quantizer)
  row_state, col_state = fmt.split_state(quantizer, state)
  from_rowwise = columnwise and fmt.columnwise_from_rowwise(quantizer)
  row = col = None
  if rowwise or from_rowwise:
    row, _ = single(w2d, halves[0], True, False, row_state)
  if columnwise:
    source = row.dequantize(jnp.float32) if from_rowwise else w2d
    _, col = single(source, halves[1], False, True, col_state)
  return QuantizedTensor(row if rowwise else None, col, quantizer)


def quantize_experts(w: jax.Array, quantizer: Quantizer, *, rowwise: bool = True,
                     columnwise: bool = True, keys: Optional[jax.Array] = None,
                     state: Any = None, role: Any = None, decoded: bool = False,
                     columnwise_along_n: bool = False,
                     rowwise_pending: bool = False) -> QuantizedTensor:
  """Quantize one matrix per expert: `w[G, rows, cols]` (contraction axis last).

  Returns a `QuantizedTensor` whose `ScaledTensor`s carry a leading `[G]` axis; expert `g`'s
  slice is bit-for-bit `jaxquant.ops.quantize(w[g], quantizer, key=keys[g], state=state[g])`
  (its own amax, scales, delayed-scaling state and key). `decoded` as for `quantize`.

  `columnwise_along_n`: where the FFI kernel writes raw MXFP8 copies of bfloat16 weights
  (`experts_along_n`), the columnwise copy comes back as a `TransposedExperts` holding its raw
  values in w's own `[G, rows, cols]` layout (whole-row stores, no transpose), for a GEMM that
  reads it along N; elsewhere as always, and `explain` says why (`along_n_reason`).

  `rowwise_pending` (with `columnwise_along_n`, for `jaxquant.grouped_dense`): where that
  layout is written and `JAXQUANT_EXPERTS_DGRAD_COPY` is not "written", the rowwise copy comes
  back as a `PendingRowwise` (design decision 56), which `write_pending` turns into the rowwise
  copy after the forward GEMM has read the columnwise one; elsewhere as always.
  """
  if not isinstance(quantizer, Quantizer):
    raise TypeError(f"quantizer: expected a jaxquant Quantizer, got {type(quantizer).__name__}")
  if not (rowwise or columnwise):
    raise ValueError("rowwise and columnwise are both False; ask for at least one direction")
  if not hasattr(w, "dtype") or np.dtype(w.dtype) not in HIGH_PRECISION_DTYPES or w.ndim != 3:
    raise ValueError(f"w: expected a bfloat16/float16/float32 [experts, rows, cols] array, got "
                     f"{getattr(w, 'dtype', type(w).__name__)} {tuple(getattr(w, 'shape', ()))}")
  groups = w.shape[0]
  _check_keys(keys, quantizer, groups)
  if quantizer.stateful and state is None:
    raise ValueError(f"state: {quantizer} is stateful; pass state=jaxquant.grouped.init_state("
                     f"quantizer, {groups})")
  if columnwise and format_of(quantizer).uses_rht(quantizer, "columnwise") and w.shape[1] % 16:
    raise ValueError(f"w: NVFP4Quantizer(rht=True) transforms the columnwise copy along the "
                     f"rows in chunks of 16; got {w.shape[1]} rows")
  along_n_refused = (kernels.along_n_reason(quantizer, tuple(w.shape), decoded, w.dtype)
                     if columnwise and columnwise_along_n else None)
  kernel_along_n = columnwise and columnwise_along_n and along_n_refused is None
  pending = (rowwise and rowwise_pending and kernel_along_n
             and kernels.dgrad_copy_choice() == "patched")
  paths = []
  for direction in DIRECTIONS:
    if (rowwise, columnwise)[DIRECTIONS.index(direction)]:
      leaf = quantizer.for_direction(direction)
      note = _kernel_note(leaf, decoded, direction)
      if direction == "columnwise" and kernel_along_n:
        note = lambda n=note: (n()[0] + "; in the weights' own layout, read along N", n()[1])
      elif direction == "columnwise" and along_n_refused is not None:
        note = lambda n=note: (n()[0] + "; transposed, not in the weights' own layout as asked: "
                               + along_n_refused, n()[1])
      elif direction == "rowwise" and pending:
        note = lambda n=note: (n()[0] + "; " + PENDING_NOTE, n()[1])
      elif direction == "rowwise" and rowwise_pending and kernel_along_n:
        note = lambda n=note: (n()[0] + "; written by the quantize kernel ("
                               f"{kernels.DGRAD_COPY_ENV}={kernels.dgrad_copy_choice()})", n()[1])
      paths.append(_record("grouped_quantize", role, f"{direction}: {leaf} [{groups} experts]",
                           leaf, lambda d=direction: kernels.quantize_experts_unsupported(
                               quantizer, tuple(w.shape), d), note))
  orig_dtype = np.dtype(w.dtype)
  words = _direction_words(keys, quantizer)
  if all(p == "ffi" for p in paths):
    return kernels.quantize_experts(w, quantizer, rowwise=rowwise, columnwise=columnwise,
                                    state=state, orig_dtype=orig_dtype, words=words,
                                    decoded=decoded, columnwise_along_n=kernel_along_n,
                                    rowwise_pending=pending)
  return jax.vmap(lambda m, wd, s: _expert(m, quantizer, rowwise, columnwise, wd, s,
                                           orig_dtype))(w, words, state)


# What `explain` adds to the record of a rowwise copy left pending (design decision 56).
PENDING_NOTE = ("written after the forward GEMM over the forward copy, in place, where the two "
                "differ (row blocks of general-path rows)")


def write_pending(qw: QuantizedTensor, forward: Any, after: jax.Array) -> QuantizedTensor:
  """`qw` with a `PendingRowwise` copy (from `quantize_experts(rowwise_pending=True)`, in either
  slot) written: the forward copy `forward` (the `TransposedExperts` that copy is written over,
  which nothing may read after this) rewritten where the two differ. `after` is computed from
  `forward` (the forward GEMM's output), which orders the rewrite after that read. A `qw`
  without one is returned as it is."""
  def write(t):
    if not isinstance(t, PendingRowwise):
      return t
    if not isinstance(forward, TransposedExperts):
      raise TypeError(f"forward: a PendingRowwise is written over a TransposedExperts, got "
                      f"{type(forward).__name__}")
    return kernels.write_pending(t, forward, after)
  return QuantizedTensor(write(qw.rowwise), write(qw.columnwise), qw.quantizer)


# --------------------------------------------- GEMM -------------------------------------------

Operand = Union[GroupedScaledTensor, ScaledTensor, TransposedExperts, jax.Array]


def _describe(operand: Operand) -> str:
  if isinstance(operand, (ScaledTensor, GroupedScaledTensor)):
    name = type(operand.quantizer).__name__.replace("Quantizer", "")
    return name + ("+rht" if operand.rht else "")
  return np.dtype(operand.dtype).name


def _check_experts(b: Operand, groups: int, contraction: int) -> None:
  if isinstance(b, GroupedScaledTensor) or not hasattr(b, "shape"):
    raise TypeError("b: expected expert matrices [G, N, K] (a ScaledTensor with a leading "
                    "expert axis, e.g. from quantize_experts, or an array)")
  if not isinstance(b, ScaledTensor) and np.dtype(b.dtype) not in HIGH_PRECISION_DTYPES:
    raise TypeError(f"b: dtype {np.dtype(b.dtype).name}; expected bfloat16/float16/float32")
  if len(b.shape) != 3 or b.shape[0] != groups or b.shape[2] != contraction:
    raise ValueError(f"b: expected [G={groups}, N, K={contraction}], got {tuple(b.shape)}")


def gemm(a: GroupedScaledTensor, b: Operand, *, out_dtype=None,
         bias: Optional[jax.Array] = None, precision=None, role: Any = None) -> jax.Array:
  """A grouped GEMM on the TN convention; the mode follows from `a.token_axis`.

  - `a.token_axis == 0` (`a[L, K]`, rows are token positions) and experts `b[G, N, K]` (a
    `ScaledTensor` with a leading expert axis, a `TransposedExperts`, or an array):
    `out[r] = a[r] . b[group(r)]^T (+ bias[group(r)])`, `[L, N]` in `a`'s layout (`to_tokens`
    packs it). Forward and dgrad.
  - `a.token_axis == 1` (`a[M, L]`) and `b[N, L]` in the same token layout: `out[g] = a_g .
    b_g^T` over group `g`'s positions, `[G, M, N]` (zero for an empty group). Wgrad.

  Args:
    out_dtype: output dtype; default: `a`'s original dtype.
    bias: optional `[G, N]` per-group bias (first mode only), added in float32.
    precision: for two high-precision operands, as `jax.lax.ragged_dot`.
    role: label for `jaxquant.explain` (an FFI decision's detail ends in the kernel that runs
      it, "kernel: CUTLASS sm90 wgmma" (FP8), "kernel: CUTLASS sm90 bf16 wgmma" (bfloat16 or
      decoded operands; either with its configuration when it is not the default) or "kernel:
      mma.sync", the latter with the reason). Its last component ("fprop", "dgrad", "wgrad")
      also sets the FP8 accumulation, as for `jaxquant.ops.gemm`: fast for fprop, split
      otherwise (design decision 57).
  """
  if not isinstance(a, GroupedScaledTensor):
    raise TypeError(f"a: expected a GroupedScaledTensor (from jaxquant.grouped.quantize), got "
                    f"{type(a).__name__}")
  out_dtype = a.orig_dtype if out_dtype is None else out_dtype
  transposed = b if isinstance(b, TransposedExperts) else None
  if transposed is not None:
    if a.token_axis != 0:
      raise TypeError("b: TransposedExperts are expert matrices; a columnwise (token_axis=1) a "
                      "needs a columnwise GroupedScaledTensor b")
    b = transposed.materialize()  # unused (and removed by XLA) where the kernel reads `stored`
  rht_b = isinstance(b, (ScaledTensor, GroupedScaledTensor)) and b.rht
  if a.rht != rht_b:
    raise ValueError(f"a and b disagree on the random Hadamard transform (a.rht={a.rht}, "
                     f"b.rht={rht_b}); the transform cancels only when both operands carry it")
  if a.token_axis == 0:
    _check_experts(b, a.groups, a.shape[1])
    if bias is not None and tuple(bias.shape) != (a.groups, b.shape[1]):
      raise ValueError(f"bias: expected shape ({a.groups}, {b.shape[1]}), got "
                       f"{tuple(bias.shape)}")
    mode, impl = "ragged rows x experts", reference.ragged_gemm
  else:
    if not isinstance(b, GroupedScaledTensor) or b.token_axis != 1:
      raise TypeError("b: a columnwise (token_axis=1) a needs a columnwise GroupedScaledTensor b "
                      "over the same tokens")
    if b.layout != a.layout:
      raise ValueError(f"a and b: token layouts differ ({a.layout} vs {b.layout}); quantize "
                       "both with the same col_block")
    if bias is not None:
      raise ValueError("bias: the per-group (wgrad) GEMM takes no bias")
    mode, impl = "per-group over tokens", reference.per_group_gemm
  detail = f"{_describe(a)} x {_describe(b)} [{a.groups} groups, {mode}]"

  stored = None if transposed is None else transposed.stored
  # FP8 products sum as the dense FP8 GEMM's do: fast for the forward, split for the gradients
  # (`role`'s last component), unless JAXQUANT_FP8_ACCUMULATION or Precision.HIGHEST says split
  accumulation = kernels.fp8_accumulation(None, role, precision)
  path = _record("grouped_gemm", role, detail, None,
                 lambda: kernels.gemm_unsupported(a, b, out_dtype),
                 lambda: kernels.gemm_kernel_note(a, b, out_dtype, bias, stored_kn=stored,
                                                  accumulation=accumulation))
  if path == "ffi":
    return kernels.gemm(a, b, out_dtype=out_dtype, bias=bias, precision=precision,
                        stored_kn=stored, accumulation=accumulation)
  kwargs = dict(out_dtype=out_dtype, precision=precision)
  if a.token_axis == 0:
    kwargs["bias"] = bias
  return impl(a, b, **kwargs)


def to_tokens(y: jax.Array, like: GroupedScaledTensor) -> jax.Array:
  """`y[L, ...]` in the layout of `like` (a `gemm` output) -> packed `[T, ...]`."""
  return like.layout.to_packed(y, like.group_sizes)
