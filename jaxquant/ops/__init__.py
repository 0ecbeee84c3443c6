"""Public ops: `quantize`, `dequantize`, `transpose`, `gemm` (docs/design.md §2.4 "Ops,
dispatch and backends").

Each op validates its arguments, picks the reference, FFI or (quantize only) XLA-fused
implementation (`jaxquant.ops.dispatch`) and records the choice for `jaxquant.explain`.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant import explain as _explain
from jaxquant.backends import xla as _xla
from jaxquant.numerics.random_bits import key_words
from jaxquant.backends.reference import ops as reference
from jaxquant.ops import dispatch
from jaxquant.formats import format_of
from jaxquant.quantizers import HIGH_PRECISION_DTYPES, Quantizer
from jaxquant.state import update_each_direction
from jaxquant.tensors import QuantizedTensor, ScaledTensor

Operand = Union[ScaledTensor, jax.Array]

__all__ = ["quantize", "quantize_and_update", "dequantize", "transpose", "gemm", "gemm_gelu",
           "update_state"]


def _as_matrix(x: jax.Array) -> jax.Array:
  if not hasattr(x, "dtype") or not hasattr(x, "shape"):
    raise TypeError(f"x: expected a jax array, got {type(x).__name__}")
  if np.dtype(x.dtype) not in HIGH_PRECISION_DTYPES:
    raise TypeError(f"x: dtype {np.dtype(x.dtype).name} cannot be quantized; expected "
                    "bfloat16, float16 or float32")
  if x.ndim == 0:
    raise ValueError("x: a scalar cannot be quantized; expected at least 1 dimension")
  return x.reshape(-1, x.shape[-1]) if x.ndim != 2 else x


def _needs_key(quantizer: Quantizer) -> bool:
  return format_of(quantizer).needs_key(quantizer)


def _check_rht_shape(x2d: jax.Array, quantizer: Quantizer) -> None:
  if format_of(quantizer).uses_rht(quantizer, "columnwise") and x2d.shape[0] % 16:
    raise ValueError(
        f"x: NVFP4Quantizer(rht=True) transforms the columnwise copy along x's rows (the "
        f"wgrad contraction axis) in chunks of 16; got {x2d.shape[0]} rows. Use a row count "
        "(tokens) that is a multiple of 16, or rht=False.")


def _directions(rowwise: bool, columnwise: bool) -> str:
  return "+".join(d for d, on in (("rowwise", rowwise), ("columnwise", columnwise)) if on)


def _quantize_path(x2d, quantizer, *, rowwise, columnwise):
  """(the FFI module or None, the path a quantize takes: "ffi" / "xla" / "reference", why)."""
  ffi = dispatch.ffi_module()
  reason = dispatch.ffi_missing_reason() if ffi is None else ffi.quantize_unsupported(
      x2d, quantizer, rowwise=rowwise, columnwise=columnwise)
  if format_of(quantizer).high_precision:
    return ffi, "reference", ""  # nothing to compute
  path, reason = dispatch.choose_quantize(
      reason, _xla.unsupported(x2d, quantizer, rowwise=rowwise, columnwise=columnwise),
      _xla.auto_reason(quantizer, dispatch.current_platform()))
  return ffi, path, reason


def _single_with_update(x2d, quantizer, *, rowwise, columnwise, orig_dtype, state, role):
  """(row, col, the updated state) from one FFI call, where the quantize takes the FFI path and
  its kernel updates this state (`jaxquant_quantize_fp8_delayed_update`); else None."""
  ffi, path, reason = _quantize_path(x2d, quantizer, rowwise=rowwise, columnwise=columnwise)
  if path != "ffi" or ffi.quantize_with_update_unsupported(
      x2d, quantizer, rowwise=rowwise, columnwise=columnwise, state=state) is not None:
    return None
  _explain.record(_explain.Decision("quantize", role,
                                    f"{_directions(rowwise, columnwise)}: {quantizer}",
                                    ffi.path_name(), reason))
  _explain.record(_explain.Decision(
      "state-update", role, str(quantizer), ffi.path_name(),
      "inside the quantize call (jaxquant_quantize_fp8_delayed_update)"))
  (row, col), new_state = ffi.quantize_single_with_update(
      x2d, quantizer, rowwise=rowwise, columnwise=columnwise, orig_dtype=orig_dtype, state=state)
  return row, col, new_state


def _single(x2d, quantizer, *, rowwise, columnwise, orig_dtype, key, state, role):
  """Quantize with one single-format quantizer via the selected backend."""
  if columnwise:
    _check_rht_shape(x2d, quantizer)
  fmt = format_of(quantizer)
  row_words = col_words = None
  if fmt.needs_key(quantizer):
    row_words = key_words(jax.random.fold_in(key, 0))
    col_words = key_words(jax.random.fold_in(key, 1))
  directions = _directions(rowwise, columnwise)
  ffi, path, reason = _quantize_path(x2d, quantizer, rowwise=rowwise, columnwise=columnwise)
  impl = {"ffi": ffi.quantize_single if ffi is not None else None,
          "xla": _xla.quantize_single}.get(path, reference.quantize_single)
  path_name = {"ffi": ffi.path_name() if ffi is not None else None,
               "xla": _xla.PATH_NAME}.get(path, path)
  kwargs = dict(orig_dtype=orig_dtype, row_key_words=row_words, col_key_words=col_words,
                state=state)
  if path == "xla" and columnwise and _xla.columnwise_mode() == "transpose-op":
    # XLA fuses the rowwise quantize into the producer; the columnwise copy is the same bytes
    # transposed by the transpose op (FFI kernel where built), recorded as its own decision.
    _explain.record(_explain.Decision("quantize", role, f"rowwise: {quantizer}", path_name,
                                      reason))
    row, _ = impl(x2d, quantizer, rowwise=True, columnwise=False, **kwargs)
    return (row if rowwise else None), transpose(row)
  _explain.record(_explain.Decision("quantize", role, f"{directions}: {quantizer}", path_name,
                                    reason))
  return impl(x2d, quantizer, rowwise=rowwise, columnwise=columnwise, **kwargs)


def quantize(x: jax.Array, quantizer: Quantizer, *, rowwise: bool = True,
             columnwise: bool = True, key: Optional[jax.Array] = None, state: Any = None,
             role: Any = None) -> QuantizedTensor:
  """Quantize `x` (leading axes flattened into rows; the last axis is the contraction axis).

  Args:
    x: bfloat16, float16 or float32 array.
    quantizer: any jaxquant quantizer; a `HybridQuantizer` quantizes each direction with its own
      half.
    rowwise, columnwise: which copies to produce (the columnwise copy is stored transposed).
    key: PRNG key, required when a quantizer uses stochastic rounding.
    state: the quantizer's state (`jaxquant.init_state`), required for delayed scaling.
    role: optional `QuantizerRole`, used only to label `jaxquant.explain` output.

  Returns:
    A `QuantizedTensor` with the requested copies.
  """
  if not isinstance(quantizer, Quantizer):
    raise TypeError(f"quantizer: expected a jaxquant Quantizer, got {type(quantizer).__name__}")
  if not (rowwise or columnwise):
    raise ValueError("rowwise and columnwise are both False; ask for at least one direction")
  x2d = _as_matrix(x)
  orig_dtype = np.dtype(x.dtype)
  if _needs_key(quantizer) and key is None:
    raise ValueError(f"key: {quantizer} uses stochastic rounding and needs a PRNG key")
  if quantizer.stateful and state is None:
    raise ValueError(f"state: {quantizer} is stateful; pass state=jaxquant.init_state(quantizer)")
  common = dict(orig_dtype=orig_dtype, key=key, role=role)
  fmt = format_of(quantizer)
  halves = fmt.halves(quantizer)
  if halves is None:  # one quantizer makes both copies, in one pass
    row, col = _single(x2d, quantizer, rowwise=rowwise, columnwise=columnwise, state=state,
                       **common)
    return QuantizedTensor(row, col, quantizer)
  row_state, col_state = fmt.split_state(quantizer, state)
  from_rowwise = columnwise and fmt.columnwise_from_rowwise(quantizer)
  row = col = None
  if rowwise or from_rowwise:
    row, _ = _single(x2d, halves[0], rowwise=True, columnwise=False, state=row_state,
                     **common)
  if columnwise:
    source = row.dequantize(jnp.float32) if from_rowwise else x2d
    key_col = None if key is None else jax.random.fold_in(key, 2)
    _, col = _single(source, halves[1], rowwise=False, columnwise=True,
                     state=col_state, **dict(common, key=key_col))
  return QuantizedTensor(row if rowwise else None, col, quantizer)


def quantize_and_update(x: jax.Array, quantizer: Quantizer, *, rowwise: bool = True,
                        columnwise: bool = True, key: Optional[jax.Array] = None,
                        state: Any = None, role: Any = None) -> tuple[QuantizedTensor, Any]:
  """`(quantize(x, ...), update_state(quantizer, state, that))`, the two in one FFI call where
  the quantize takes the FFI path and its kernel updates the state (delayed scaling, one state:
  one command a tensor and step instead of two, design decision 36); bit-identical either way.
  `jaxquant.explain` records where the update ran."""
  if (state is not None and isinstance(quantizer, Quantizer) and quantizer.stateful
      and format_of(quantizer).halves(quantizer) is None and (rowwise or columnwise)
      and not _needs_key(quantizer)):
    x2d = _as_matrix(x)
    if columnwise:
      _check_rht_shape(x2d, quantizer)
    served = _single_with_update(x2d, quantizer, rowwise=rowwise, columnwise=columnwise,
                                 orig_dtype=np.dtype(x.dtype), state=state, role=role)
    if served is not None:
      row, col, new_state = served
      return QuantizedTensor(row, col, quantizer), new_state
  qtensor = quantize(x, quantizer, rowwise=rowwise, columnwise=columnwise, key=key, state=state,
                     role=role)
  return qtensor, update_state(quantizer, state, qtensor, role=role)


def update_state(quantizer: Quantizer, state: Any, qtensor: QuantizedTensor, *,
                 role: Any = None) -> Any:
  """`jaxquant.update_state` (the state after `qtensor = quantize(x, quantizer, state=state)`)
  on the selected implementation: the FFI's state-update kernel the format names
  (`Format.state_update_kernel`: `jaxquant_delayed_update` for delayed scaling, one call per
  state) where the extension is built, else the format's reference update; bit-identical.
  The choice is recorded for `jaxquant.explain` as a "state-update" decision."""
  return update_each_direction(quantizer, state, qtensor,
                               lambda q, leaf, scaled: _update_leaf(q, leaf, scaled, role))


def _update_leaf(quantizer: Quantizer, state: Any, scaled: ScaledTensor, role: Any):
  fmt = format_of(quantizer)
  kernel = fmt.state_update_kernel(quantizer)
  ffi = dispatch.ffi_module()
  if kernel is None:
    reason = f"no FFI state-update kernel for format {fmt.name!r}"
  else:
    reason = (dispatch.ffi_missing_reason() if ffi is None
              else ffi.state_update_unsupported(kernel))
  path, reason = dispatch.choose("state update", reason)
  _explain.record(_explain.Decision("state-update", role, str(quantizer),
                                    path if path == "reference" else ffi.path_name(), reason))
  if path == "ffi":
    return ffi.state_update(kernel, state, scaled.amax, quantizer)
  return fmt.update_state(quantizer, state, scaled.amax)


def dequantize(t: Union[QuantizedTensor, ScaledTensor], dtype=jnp.float32) -> jax.Array:
  """High-precision values of a quantized tensor (`[rows, cols]`)."""
  if not isinstance(t, (QuantizedTensor, ScaledTensor)):
    raise TypeError(f"t: expected a QuantizedTensor or ScaledTensor, got {type(t).__name__}")
  return t.dequantize(dtype)


def transpose(t: ScaledTensor) -> ScaledTensor:
  """Columnwise copy of a per-tensor FP8 `ScaledTensor` by transposing its bytes (no
  re-quantization). Block-scaled formats cannot be transposed this way: quantize columnwise."""
  if not isinstance(t, ScaledTensor):
    raise TypeError(f"t: expected a ScaledTensor, got {type(t).__name__}")
  if not reference.is_transposable(t):
    raise ValueError(f"t: transpose needs per-tensor FP8 data; {t.quantizer} has block scales "
                     "along its rows, so quantize the columnwise direction instead")
  ffi = dispatch.ffi_module()
  reason = dispatch.ffi_missing_reason() if ffi is None else ffi.transpose_unsupported(t)
  path, reason = dispatch.choose("transpose", reason)
  _explain.record(_explain.Decision("transpose", None, str(t.quantizer),
                                    path if path == "reference" else ffi.path_name(), reason))
  return (ffi.transpose if path == "ffi" else reference.transpose)(t)


def _check_operand(name: str, operand: Operand) -> None:
  if isinstance(operand, QuantizedTensor):
    raise TypeError(f"{name}: pass one direction of the QuantizedTensor (its .rowwise or "
                    ".columnwise ScaledTensor), not the pair")
  if not isinstance(operand, ScaledTensor):
    if not hasattr(operand, "dtype") or np.dtype(operand.dtype) not in HIGH_PRECISION_DTYPES:
      raise TypeError(f"{name}: expected a ScaledTensor or a bfloat16/float16/float32 array")
  if operand.ndim != 2:
    raise ValueError(f"{name}: expected a 2-D [rows, contraction] operand, got shape "
                     f"{tuple(operand.shape)}")


def gemm_path_unsupported(a: Operand, b: Operand) -> Optional[str]:
  ffi = dispatch.ffi_module()
  return dispatch.ffi_missing_reason() if ffi is None else ffi.gemm_unsupported(a, b)


def gemm(a: Operand, b: Operand, *, out_dtype=None, bias: Optional[jax.Array] = None,
         role: Any = None, precision=None) -> jax.Array:
  """`C[m, n] = sum_k a[m, k] * b[n, k] (+ bias[n])` on the TN storage convention.

  Args:
    a, b: `ScaledTensor`s or plain high-precision arrays, each `[rows, K]`.
    out_dtype: output dtype; default: `a`'s original (pre-quantization) dtype.
    bias: optional `[n]` bias, added once in float32 after accumulation.
    role: optional label for `jaxquant.explain`.
  """
  _check_operand("a", a)
  _check_operand("b", b)
  if a.shape[1] != b.shape[1]:
    raise ValueError(f"a and b: contraction lengths differ ({a.shape[1]} vs {b.shape[1]}); "
                     "both operands are [rows, K]")
  rht_a = isinstance(a, ScaledTensor) and a.rht
  rht_b = isinstance(b, ScaledTensor) and b.rht
  if rht_a != rht_b:
    raise ValueError(f"a and b disagree on the random Hadamard transform (a.rht={rht_a}, "
                     f"b.rht={rht_b}); the transform cancels only when both operands carry it")
  if bias is not None and tuple(bias.shape) != (b.shape[0],):
    raise ValueError(f"bias: expected shape ({b.shape[0]},), got {tuple(bias.shape)}")
  if out_dtype is None:
    out_dtype = a.orig_dtype if isinstance(a, ScaledTensor) else a.dtype
  path, reason = dispatch.choose("gemm", gemm_path_unsupported(a, b))
  ffi = dispatch.ffi_module()
  detail = f"{_describe(a)} x {_describe(b)}"
  if path == "ffi":  # why the FFI took a slower path than the pair's kernel, if it did
    reason = ffi.gemm_path_reason(a, b)
  _explain.record(_explain.Decision("gemm", role, detail,
                                    "reference" if path == "reference" else ffi.gemm_path(a, b),
                                    reason))
  if path == "ffi":  # the role's direction (fprop/dgrad/wgrad) picks the FP8 accumulation
    return ffi.gemm(a, b, out_dtype=out_dtype, bias=bias, precision=precision, role=role)
  return reference.gemm(a, b, out_dtype=out_dtype, bias=bias, precision=precision)


def gemm_gelu_unsupported(a: Operand, b: Operand, *, out_dtype,
                          bias: Optional[jax.Array] = None) -> Optional[str]:
  """None when the FFI computes `gemm_gelu(a, b)` in one GEMM (cuBLASLt's gelu epilogue on
  CUDA, the target's CPU handler on CPU), else why not."""
  ffi = dispatch.ffi_module()
  if ffi is None:
    return dispatch.ffi_missing_reason()
  return ffi.gemm_gelu_unsupported(a, b, out_dtype, bias)


def gemm_gelu(a: Operand, b: Operand, *, out_dtype=None, bias: Optional[jax.Array] = None,
              role: Any = None, precision=None) -> tuple[jax.Array, jax.Array]:
  """`(gelu(h), h)` with `h = a b^T (+ bias)` on the TN convention: an MLP's fc1 with its
  activation (tanh approximation) in the GEMM's epilogue, `h` kept for the activation's
  gradient. The FFI path is one cuBLASLt GEMM (per-tensor FP8 operands, bfloat16 outputs:
  `gemm_gelu_unsupported`); the reference computes the gelu of the float32 `h` with the spec's
  arithmetic. Both outputs are rounded once from float32 (the unfused `gelu(gemm(a, b))`
  rounds `h` before the gelu, so the two differ by the rounding of `h`).

  Args:
    a, b: `[rows, K]` operands, as `gemm`'s.
    out_dtype: of both outputs; default: `a`'s original dtype.
    bias: optional `[n]`, added in float32 before the gelu.
    role: label for `jaxquant.explain` (its last part picks the FP8 accumulation, as `gemm`).
  """
  _check_operand("a", a)
  _check_operand("b", b)
  if a.shape[1] != b.shape[1]:
    raise ValueError(f"a and b: contraction lengths differ ({a.shape[1]} vs {b.shape[1]}); "
                     "both operands are [rows, K]")
  if bias is not None and tuple(bias.shape) != (b.shape[0],):
    raise ValueError(f"bias: expected shape ({b.shape[0]},), got {tuple(bias.shape)}")
  if out_dtype is None:
    out_dtype = a.orig_dtype if isinstance(a, ScaledTensor) else a.dtype
  path, reason = dispatch.choose(
      "gemm", gemm_gelu_unsupported(a, b, out_dtype=out_dtype, bias=bias))
  _explain.record(_explain.Decision(
      "gemm", role, f"{_describe(a)} x {_describe(b)}, gelu epilogue",
      "reference" if path == "reference" else _gelu_path_name(), reason))
  if path == "ffi":
    return dispatch.ffi_module().gemm_gelu(a, b, bias=bias, precision=precision, role=role)
  return reference.gemm_gelu(a, b, out_dtype=out_dtype, bias=bias, precision=precision)


def _gelu_path_name() -> str:
  return "ffi-cpu gemm-fp8-gelu" if dispatch.current_platform() == "cpu" else "cublaslt-fp8-gelu"


def _describe(operand: Operand) -> str:
  if isinstance(operand, ScaledTensor):
    return type(operand.quantizer).__name__.replace("Quantizer", "") + ("+rht" if operand.rht
                                                                         else "")
  return np.dtype(operand.dtype).name
