"""Quantizer state: fresh state and its update for any quantizer (docs/design.md §5 "Numerics",
delayed scaling).

State lives outside the quantizer so quantizers stay static and hashable. A plain quantizer's
state is what its format keeps (`DelayedScalingState` for delayed scaling, `None` when
stateless); a `HybridQuantizer`'s is the pair `(rowwise_state, columnwise_state)`. Which
formats keep state and how they update it is the format's answer (`jaxquant.formats`); the
delayed-scaling math is `jaxquant.formats.delayed`, re-exported here.
"""

from __future__ import annotations

from typing import Any, Callable

from jaxquant.formats import format_of
from jaxquant.formats.delayed import (DelayedScalingState, delayed_scaling_update,
                                      needs_current_amax, quantize_scale)
from jaxquant.quantizers import Quantizer

__all__ = ["DelayedScalingState", "delayed_scaling_update", "init_state", "needs_current_amax",
           "quantize_scale", "update_each_direction", "update_state"]


def init_state(quantizer: Quantizer) -> Any:
  """Fresh state for `quantizer`: zero history and scale 0 ("no scale yet", for
  `first_scale="current"`) or 1 (`first_scale="one"`); `None` for stateless quantizers."""
  return format_of(quantizer).init_state(quantizer)


def update_state(quantizer: Quantizer, state: Any, qtensor) -> Any:
  """New state after `qtensor = quantize(x, quantizer, state=state)` (any quantizer)."""
  return update_each_direction(
      quantizer, state, qtensor,
      lambda q, leaf, scaled: format_of(q).update_state(q, leaf, scaled.amax))


def update_each_direction(quantizer: Quantizer, state: Any, qtensor,
                          update_leaf: Callable[[Quantizer, Any, Any], Any]) -> Any:
  """The walk every state update shares: `update_leaf(q, leaf_state, scaled)` for each
  stateful single-format quantizer `q` of `quantizer` (a Hybrid's two halves, each with its own
  direction's copy of `qtensor`; otherwise the one copy there is), the rest kept as they are.
  `qtensor` is anything with `rowwise` / `columnwise` copies carrying `amax` (single or
  grouped tensors)."""
  if state is None or not quantizer.stateful:
    return state
  fmt = format_of(quantizer)

  def leaf(q, leaf_state, scaled):
    if not format_of(q).stateful(q) or scaled is None:
      return leaf_state
    return update_leaf(q, leaf_state, scaled)

  halves = fmt.halves(quantizer)
  if halves is not None:
    row_state, col_state = fmt.split_state(quantizer, state)
    return (leaf(halves[0], row_state, qtensor.rowwise),
            leaf(halves[1], col_state, qtensor.columnwise))
  scaled = qtensor.rowwise if qtensor.rowwise is not None else qtensor.columnwise
  return leaf(quantizer, state, scaled)
