"""Delayed scaling's state and its pure update (docs/design.md §5 "Numerics", delayed scaling).

The state of a `Float8DelayedScalingQuantizer` lives outside the quantizer so quantizers stay
static and hashable: `DelayedScalingState` holds the scale to quantize with and the amax
history. The per-tensor FP8 format quantizes with `quantize_scale` and `jaxquant.state` updates
the state with `delayed_scaling_update`; both live here, with the format, because the format's
quantize reads them.

First step: with `first_scale="current"` (the default) a fresh state holds scale 0, "no scale
yet", and `quantize_scale` then takes the scale just in time from the tensor's own amax (the
same `fmax / amax / 2^margin` the update would store; with margin 0 exactly current scaling's
scale). The update rule stores a scale only from a finite, positive amax, so the state stays
"no scale yet" until such an amax has been seen. The marker is the scale rather than an empty
history because a history of length 1 is empty again after every update (it rolls and zeroes
its only slot). With `first_scale="one"` the fresh scale is 1, as in TransformerEngine.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxquant.numerics import FLT_MAX, spec_for_dtype
from jaxquant.numerics.division import ieee_div
from jaxquant.quantizers import Float8DelayedScalingQuantizer


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DelayedScalingState:
  """`scale` (float32 `()`) used to quantize now (0: none yet, take it from the current amax);
  `amax_history` (float32 `[L]`)."""

  scale: jax.Array
  amax_history: jax.Array


NO_SCALE_YET = 0.0


def fresh_state(quantizer: Float8DelayedScalingQuantizer) -> DelayedScalingState:
  """Zero history and scale 0 ("no scale yet", `first_scale="current"`) or 1 (`"one"`)."""
  scale = NO_SCALE_YET if quantizer.first_scale == "current" else 1.0
  return DelayedScalingState(jnp.full((), scale, jnp.float32),
                             jnp.zeros((quantizer.amax_history_len,), jnp.float32))


def _scale_from_amax(a: jax.Array, quantizer: Float8DelayedScalingQuantizer) -> jax.Array:
  """`fmax / a / 2^margin`, clamped to FLT_MAX (meaningful for finite a > 0). At margin 0 the
  division by 1, exact, is not written out (each `ieee_div` is ~110 XLA operations)."""
  fmax = spec_for_dtype(quantizer.dtype).fmax
  scale = ieee_div(jnp.float32(fmax), a)
  if quantizer.margin:
    scale = ieee_div(scale, jnp.float32(2.0**quantizer.margin))
  return jnp.minimum(scale, jnp.float32(FLT_MAX))


def _max_abs(values: jax.Array) -> jax.Array:
  """max |values| over the last axis by the float bits: NaN-propagating on every backend
  (XLA:CPU's float max reduction drops NaN), as the kernels reduce."""
  bits = jax.lax.bitcast_convert_type(values.astype(jnp.float32), jnp.uint32) & 0x7FFFFFFF
  return jax.lax.bitcast_convert_type(jnp.max(bits, axis=-1), jnp.float32)


def _usable(a: jax.Array) -> jax.Array:
  return jnp.isfinite(a) & (a > 0)


def needs_current_amax(quantizer: Float8DelayedScalingQuantizer) -> bool:
  """Whether quantizing needs the tensor's amax *before* the scale is known (a state may still
  have no scale): true for `first_scale="current"`. Kernels that take the scale as an input
  compute the amax first then."""
  return quantizer.first_scale == "current"


def quantize_scale(scale: jax.Array, amax: jax.Array,
                   quantizer: Float8DelayedScalingQuantizer) -> jax.Array:
  """The scale to quantize with: the state's `scale`, or, while it holds none yet (0), the one
  this tensor's `amax` gives (`fmax / amax / 2^margin`; 1 if the amax is 0, inf or NaN, as in
  current scaling). Elementwise, so per-group states (`[G]`) work as they are."""
  scale = scale.astype(jnp.float32)
  if not needs_current_amax(quantizer):
    return scale
  a = amax.astype(jnp.float32)
  just_in_time = jnp.where(_usable(a), _scale_from_amax(a, quantizer), jnp.float32(1.0))
  return jnp.where(scale == NO_SCALE_YET, just_in_time, scale)


def delayed_scaling_update(state: DelayedScalingState, amax: jax.Array,
                           quantizer: Float8DelayedScalingQuantizer) -> DelayedScalingState:
  """One step of delayed scaling, after quantizing a tensor whose amax was `amax`.

  `hist[0] = amax`; `a = max(hist)` ("max", NaN-propagating) or `hist[0]` ("most_recent"); if
  `a` is finite and > 0 the new scale is `fmax / a / 2^margin` (clamped to FLT_MAX), else the
  old one is kept; then the history rolls by -1 and `hist[0]` is zeroed. (`jaxquant.ops.
  update_state` runs this as one FFI kernel where the extension is built.)
  """
  if not isinstance(quantizer, Float8DelayedScalingQuantizer):
    raise TypeError(f"quantizer: expected Float8DelayedScalingQuantizer, got {quantizer!r}")
  hist = state.amax_history.at[0].set(amax.astype(jnp.float32))
  a = _max_abs(hist) if quantizer.amax_compute_algo == "max" else hist[0]
  scale = jnp.where(_usable(a), _scale_from_amax(a, quantizer), state.scale)
  hist = jnp.roll(hist, -1).at[0].set(0.0)
  return DelayedScalingState(scale.astype(jnp.float32), hist)
