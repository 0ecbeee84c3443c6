"""Hybrid: one format per direction (`HybridQuantizer`), delegating to its two halves.

A Hybrid has no storage of its own: its rowwise copy is its `rowwise` half's storage and its
columnwise copy its `columnwise` half's, each quantized separately (with its own state, and a
stochastic-rounding key derived apart from the other's), the columnwise one from the decoded
rowwise copy when `columnwise_source="rowwise_dequantized"`. Its format answers the questions
about the quantizer as a whole (state, keys, how the copies are made) and passes questions about
one direction to that direction's half; questions about a single storage are an error.
"""

from __future__ import annotations

from typing import Any, Optional

from jaxquant.formats.base import Format, format_of, register
from jaxquant.quantizers import (Float8CurrentScalingQuantizer, Float8DelayedScalingQuantizer,
                                 HybridQuantizer, IdentityQuantizer, MXFP8Quantizer,
                                 NVFP4Quantizer, Quantizer)


class HybridFormat(Format):
  name = "hybrid"

  def _no_storage(self, what: str):
    return TypeError(f"quantizer: a HybridQuantizer has no {what} of its own; ask its "
                     "direction's half (quantizer.for_direction(direction))")

  def _half(self, quantizer: HybridQuantizer, direction: str) -> tuple[Format, Quantizer]:
    half = quantizer.for_direction(direction)
    return format_of(half), half

  # ---- storage questions: each direction's half answers them ----

  def quantize(self, mat, quantizer, ctx):
    raise self._no_storage("quantize")

  def dequantize_raw(self, t):
    raise self._no_storage("storage")

  def grouped_quantize(self, mat, quantizer, ctx):
    raise self._no_storage("grouped quantize")

  def blocks(self, quantizer):
    raise self._no_storage("scale blocks")

  def scale_layout(self, quantizer):
    raise self._no_storage("scale layout")

  def amax_layout(self, quantizer):
    raise self._no_storage("amax layout")

  def scale_dtype(self, quantizer):
    raise self._no_storage("scale dtype")

  def quantize_kernel(self, quantizer):
    raise self._no_storage("quantize kernel")

  def gemm_family(self, quantizer):
    raise self._no_storage("GEMM family")

  def grouped_gemm_scaling(self, quantizer):
    raise self._no_storage("grouped GEMM scaling")

  # ---- per direction: delegated ----

  def uses_rht(self, quantizer, direction: str) -> bool:
    fmt, half = self._half(quantizer, direction)
    return fmt.uses_rht(half, direction)

  def copy_block(self, quantizer, direction: str) -> tuple[int, int]:
    fmt, half = self._half(quantizer, direction)
    return fmt.copy_block(half, direction)

  def grouped_quantize_kernel(self, quantizer, direction: str):
    fmt, half = self._half(quantizer, direction)
    return fmt.grouped_quantize_kernel(half, direction)

  def expert_rows_multiple(self, quantizer, direction: str):
    fmt, half = self._half(quantizer, direction)
    return fmt.expert_rows_multiple(half, direction)

  # ---- the quantizer as a whole ----

  def halves(self, quantizer: HybridQuantizer) -> tuple[Quantizer, Quantizer]:
    return quantizer.rowwise, quantizer.columnwise

  def split_state(self, quantizer, state: Any) -> tuple[Any, Any]:
    return state if state is not None else (None, None)

  def columnwise_from_rowwise(self, quantizer: HybridQuantizer) -> bool:
    return quantizer.columnwise_source == "rowwise_dequantized"

  def key_path(self, quantizer, direction: str) -> tuple[int, ...]:
    # `jaxquant.ops.quantize` gives the columnwise half fold_in(key, 2), which then takes its
    # columnwise fold_in(., 1); the rowwise half keeps the key (then its fold_in(., 0)).
    return (0,) if direction == "rowwise" else (2, 1)

  def needs_key(self, quantizer: HybridQuantizer) -> bool:
    return any(format_of(q).needs_key(q) for q in quantizer.leaves())

  def init_state(self, quantizer: HybridQuantizer) -> Any:
    if not quantizer.stateful:
      return None
    return tuple(format_of(q).init_state(q) for q in quantizer.leaves())

  def copies_swap_with_transpose(self, quantizer) -> bool:
    return False  # a format per direction: the copies are not one quantize

  def transposed_quantizer(self, quantizer: HybridQuantizer) -> Optional[Quantizer]:
    # Hybrid(A, B) of W^T has A's rowwise copy of W^T (= A's columnwise copy of W) and B's
    # columnwise copy of W^T (= B's rowwise copy of W): Hybrid(B, A) of W, swapped, where each
    # half's copies swap and nothing ties the halves (an independent columnwise source, no
    # state or key, whose split follows the direction).
    rowwise, columnwise = quantizer.rowwise, quantizer.columnwise
    if (quantizer.columnwise_source != "original" or quantizer.stateful
        or self.needs_key(quantizer)
        or not all(format_of(q).copies_swap_with_transpose(q) for q in (rowwise, columnwise))):
      return None
    return HybridQuantizer(rowwise=columnwise, columnwise=rowwise)

  def variants(self):
    return (HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer(rht=True, stochastic_rounding=True)),
            HybridQuantizer(NVFP4Quantizer(row_scaled=True), MXFP8Quantizer(),
                            columnwise_source="rowwise_dequantized"),
            HybridQuantizer(Float8DelayedScalingQuantizer(amax_history_len=4),
                            Float8CurrentScalingQuantizer()),
            HybridQuantizer(Float8CurrentScalingQuantizer(), IdentityQuantizer()))


register(HybridQuantizer, HybridFormat(), storage=False)
