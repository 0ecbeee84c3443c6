"""The delayed-scaling state update as one FFI call (`jaxquant_delayed_update`).

The same arithmetic as `jaxquant.formats.delayed.delayed_scaling_update` (the numerics header's
`delayed_scale`, IEEE division on host and device), in one small kernel per state instead of
the exact integer division `ieee_div` written out in XLA ops: that division is ~110 operations,
twice per update, and with the just-in-time first scale (now inside the quantize kernel,
`jaxquant_quantize_fp8_delayed`) it made a delayed-scaling step's program several times
larger than a current-scaling one, and its compile time with it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant.backends.ffi import calls
from jaxquant.backends.ffi.partitioning import Layout
from jaxquant.numerics import spec_for_dtype
from jaxquant.quantizers import Float8DelayedScalingQuantizer
from jaxquant.formats.delayed import DelayedScalingState


def update(state: DelayedScalingState, amax: jax.Array,
           quantizer: Float8DelayedScalingQuantizer) -> DelayedScalingState:
  """The state after quantizing a tensor whose amax was `amax` (states may carry leading batch
  axes: `scale[...]`, `amax_history[..., L]`, `amax[...]`)."""
  history = state.amax_history.astype(jnp.float32)
  scale = state.scale.astype(jnp.float32)
  amax = jnp.asarray(amax, jnp.float32).reshape(scale.shape)
  replicated = lambda a: tuple((None, 1) for _ in a.shape)  # a state is never sharded
  # The new history and scale are written over the old ones (aliased): with the state donated
  # to the step, XLA then needs no copy of each into the donated buffer (two copy kernels a
  # state, ~150 launches a d2048 step, whose host time a loss-fetching loop exposes).
  layout = Layout(operands=(replicated(history), replicated(scale), replicated(amax)),
                  results=(replicated(history), replicated(scale)),
                  what="jaxquant_delayed_update", aliases=((0, 0), (1, 1)))
  results = [jax.ShapeDtypeStruct(history.shape, np.float32),
             jax.ShapeDtypeStruct(scale.shape, np.float32)]
  new_history, new_scale = calls.call(
      "jaxquant_delayed_update", results, history, scale, amax, layout=layout,
      fmax=float(spec_for_dtype(quantizer.dtype).fmax), margin=np.int32(quantizer.margin),
      most_recent=quantizer.amax_compute_algo == "most_recent")
  return DelayedScalingState(new_scale, new_history)
