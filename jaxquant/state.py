"""Delayed-scaling state and its pure update (DESIGN.md section 3, "Delayed scaling").

State lives outside the quantizer so quantizers stay static and hashable. A plain quantizer's
state is `DelayedScalingState` (or `None` when stateless); a `HybridQuantizer`'s is the pair
`(rowwise_state, columnwise_state)`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxquant.numerics import FLT_MAX, spec_for_dtype
from jaxquant.numerics.division import ieee_div
from jaxquant.quantizers import Float8DelayedScalingQuantizer, HybridQuantizer, Quantizer


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DelayedScalingState:
  """`scale` (float32 `()`) used to quantize now; `amax_history` (float32 `[L]`)."""

  scale: jax.Array
  amax_history: jax.Array


def init_state(quantizer: Quantizer) -> Any:
  """Fresh state for `quantizer`: scale 1, zero history; `None` for stateless quantizers."""
  if isinstance(quantizer, HybridQuantizer):
    if not quantizer.stateful:
      return None
    return (init_state(quantizer.rowwise), init_state(quantizer.columnwise))
  if isinstance(quantizer, Float8DelayedScalingQuantizer):
    return DelayedScalingState(jnp.ones((), jnp.float32),
                               jnp.zeros((quantizer.amax_history_len,), jnp.float32))
  return None


def delayed_scaling_update(state: DelayedScalingState, amax: jax.Array,
                           quantizer: Float8DelayedScalingQuantizer) -> DelayedScalingState:
  """One step of delayed scaling, after quantizing a tensor whose amax was `amax`.

  `hist[0] = amax`; `a = max(hist)` ("max") or `hist[0]` ("most_recent"); if `a` is finite and
  > 0 the new scale is `fmax / a / 2^margin` (clamped to FLT_MAX), else the old one is kept; then
  the history rolls by -1 and `hist[0]` is zeroed.
  """
  if not isinstance(quantizer, Float8DelayedScalingQuantizer):
    raise TypeError(f"quantizer: expected Float8DelayedScalingQuantizer, got {quantizer!r}")
  fmax = spec_for_dtype(quantizer.dtype).fmax
  hist = state.amax_history.at[0].set(amax.astype(jnp.float32))
  a = jnp.max(hist) if quantizer.amax_compute_algo == "max" else hist[0]
  new_scale = ieee_div(ieee_div(jnp.float32(fmax), a), jnp.float32(2.0**quantizer.margin))
  new_scale = jnp.minimum(new_scale, jnp.float32(FLT_MAX))
  scale = jnp.where(jnp.isfinite(a) & (a > 0), new_scale, state.scale)
  hist = jnp.roll(hist, -1).at[0].set(0.0)
  return DelayedScalingState(scale.astype(jnp.float32), hist)


def update_state(quantizer: Quantizer, state: Any, qtensor) -> Any:
  """New state after `qtensor = quantize(x, quantizer, state=state)` (any quantizer)."""
  if state is None or not quantizer.stateful:
    return state
  if isinstance(quantizer, HybridQuantizer):
    row_state, col_state = state
    return (_update_leaf(quantizer.rowwise, row_state, qtensor.rowwise),
            _update_leaf(quantizer.columnwise, col_state, qtensor.columnwise))
  scaled = qtensor.rowwise if qtensor.rowwise is not None else qtensor.columnwise
  return _update_leaf(quantizer, state, scaled)


def _update_leaf(quantizer: Quantizer, state: Optional[DelayedScalingState], scaled):
  if not isinstance(quantizer, Float8DelayedScalingQuantizer) or scaled is None:
    return state
  return delayed_scaling_update(state, scaled.amax, quantizer)
