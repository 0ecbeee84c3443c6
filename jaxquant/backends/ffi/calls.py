"""Calling FFI targets, partitioned when the program is sharded, and the amax target."""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant.backends.ffi import partitioning, targets
from jaxquant.backends.ffi.partitioning import Layout

# Bit set of `jaxquant_amax` outputs (ffi/quantize/quantize_args.h, AmaxOutput); results come in
# bit order.
AMAX_TENSOR, AMAX_TENSOR_RHT, AMAX_ROWS, AMAX_COLS, AMAX_COLS_RHT = 1, 2, 4, 8, 16


def call(target: str, results: Sequence[jax.ShapeDtypeStruct], *args, layout=None, **attrs):
  """Calls FFI `target`; `attrs` are typed here (bool -> i1, float -> f32, int -> i32/i64).

  With a `layout` (`jaxquant.backends.ffi.partitioning.Layout`) the call is partitioned when the
  program is sharded: each shard runs the target on its local block."""
  if layout is not None:
    return partitioning.call(target, results, *args, layout=layout, **attrs)
  return targets.call(target, results, *args, **attrs)


# Per output bit: (shape as logical axes, the axes it reduces over, a Hadamard chunk along m).
_AMAX_OUTPUTS = {AMAX_TENSOR: ((), ("m", "k"), False), AMAX_TENSOR_RHT: ((), ("m", "k"), True),
                 AMAX_ROWS: (("m",), ("k",), False), AMAX_COLS: (("k",), ("m",), False),
                 AMAX_COLS_RHT: (("k",), ("m",), True)}


def amax(x2d: jax.Array, outputs: int, gate: Optional[jax.Array] = None) -> list[jax.Array]:
  """The `jaxquant_amax` reductions named by the bit set `outputs`, in bit order.

  Partitioned: each shard reduces its block, then a `pmax` over the mesh axes that shard the
  reduced axes (all of them for a per-tensor amax; the columns' for a per-row amax) makes the
  result global before any scale is derived from it.

  With a float32 scalar `gate` (`jaxquant_amax_gated`) the reductions run only when the gate
  is 0, else every output is 0: a delayed-scaling state reads the tensor's amax only while it
  has no scale yet, at the cost of one kernel launch on the other steps."""
  lengths = dict(zip("mk", x2d.shape))
  bits = [bit for bit in _AMAX_OUTPUTS if outputs & bit]
  results = [jax.ShapeDtypeStruct(tuple(lengths[a] for a in _AMAX_OUTPUTS[bit][0]), np.float32)
             for bit in bits]
  target = "jaxquant_amax" if gate is None else "jaxquant_amax_gated"
  operands = (x2d,) if gate is None else (x2d, jnp.asarray(gate, jnp.float32).reshape(()))
  layout = Layout(
      operands=((("m", 1), ("k", 1)),) + (((),) if gate is not None else ()),
      results=tuple(tuple((a, 1) for a in _AMAX_OUTPUTS[bit][0]) for bit in bits),
      reduce=tuple((i, _AMAX_OUTPUTS[bit][1]) for i, bit in enumerate(bits)),
      blocks=(("m", 16),) if any(_AMAX_OUTPUTS[bit][2] for bit in bits) else (),
      what=target)
  return call(target, results, *operands, layout=layout, outputs=np.int32(outputs))
