"""Quantizer state: fresh state and its update for any quantizer (docs/design.md §5 "Numerics",
delayed scaling).

State lives outside the quantizer so quantizers stay static and hashable. A plain quantizer's
state is what its format keeps (`DelayedScalingState` for delayed scaling, `None` when
stateless); a `HybridQuantizer`'s is the pair `(rowwise_state, columnwise_state)`. Which
formats keep state and how they update it is the format's answer (`jaxquant.formats`); the
delayed-scaling math is `jaxquant.formats.delayed`, re-exported here.
"""

from __future__ import annotations

from typing import Any, Optional

from jaxquant.formats import format_of
from jaxquant.formats.delayed import (DelayedScalingState, delayed_scaling_update,
                                      needs_current_amax, quantize_scale)
from jaxquant.quantizers import Quantizer

__all__ = ["DelayedScalingState", "delayed_scaling_update", "init_state", "needs_current_amax",
           "quantize_scale", "update_state"]


def init_state(quantizer: Quantizer) -> Any:
  """Fresh state for `quantizer`: zero history and scale 0 ("no scale yet", for
  `first_scale="current"`) or 1 (`first_scale="one"`); `None` for stateless quantizers."""
  return format_of(quantizer).init_state(quantizer)


def update_state(quantizer: Quantizer, state: Any, qtensor) -> Any:
  """New state after `qtensor = quantize(x, quantizer, state=state)` (any quantizer)."""
  if state is None or not quantizer.stateful:
    return state
  fmt = format_of(quantizer)
  halves = fmt.halves(quantizer)
  if halves is not None:
    row_state, col_state = fmt.split_state(quantizer, state)
    return (_update_leaf(halves[0], row_state, qtensor.rowwise),
            _update_leaf(halves[1], col_state, qtensor.columnwise))
  scaled = qtensor.rowwise if qtensor.rowwise is not None else qtensor.columnwise
  return _update_leaf(quantizer, state, scaled)


def _update_leaf(quantizer: Quantizer, state: Optional[DelayedScalingState], scaled):
  fmt = format_of(quantizer)
  if not fmt.stateful(quantizer) or scaled is None:
    return state
  return fmt.update_state(quantizer, state, scaled.amax)
