"""Thin `jax.ffi.ffi_call` helpers shared by the per-op wrappers."""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from jaxquant.kernels import registry

# Bit set of `jaxquant_amax` outputs (ffi/handler_common.h, AmaxOutput); results come in bit order.
AMAX_TENSOR, AMAX_TENSOR_RHT, AMAX_ROWS, AMAX_COLS, AMAX_COLS_RHT = 1, 2, 4, 8, 16


def call(target: str, results: Sequence[jax.ShapeDtypeStruct], *args, **attrs):
  """Calls FFI `target`; `attrs` are typed here (bool -> i1, float -> f32, int -> i32/i64)."""
  registry.registered_platforms()  # registers the handlers on first use
  typed = {}
  for name, value in attrs.items():
    if isinstance(value, (bool, np.bool_)):
      typed[name] = np.bool_(value)
    elif isinstance(value, float):
      typed[name] = np.float32(value)
    else:
      typed[name] = value
  out = jax.ffi.ffi_call(target, list(results), vmap_method="sequential")(*args, **typed)
  return list(out)


def amax(x2d: jax.Array, outputs: int) -> list[jax.Array]:
  """The `jaxquant_amax` reductions named by the bit set `outputs`, in bit order."""
  rows, cols = x2d.shape
  shapes = {AMAX_TENSOR: (), AMAX_TENSOR_RHT: (), AMAX_ROWS: (rows,), AMAX_COLS: (cols,),
            AMAX_COLS_RHT: (cols,)}
  results = [jax.ShapeDtypeStruct(shape, np.float32) for bit, shape in shapes.items()
             if outputs & bit]
  return call("jaxquant_amax", results, x2d, outputs=np.int32(outputs))
