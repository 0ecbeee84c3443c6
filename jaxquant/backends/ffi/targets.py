"""Calling one FFI target on whole (unsharded) operands: `jax.ffi.ffi_call` with typed
attributes."""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import numpy as np

from jaxquant.backends.ffi import registry


def call(target: str, results: Sequence[jax.ShapeDtypeStruct], *args,
         aliases: Optional[dict[int, int]] = None, **attrs) -> list:
  """Calls FFI `target`; `attrs` are typed here (bool -> i1, float -> f32, int -> i32/i64).
  `aliases`: {operand index: result index} written in place (`input_output_aliases`)."""
  registry.registered_platforms()  # registers the handlers on first use
  typed = {}
  for name, value in attrs.items():
    if isinstance(value, (bool, np.bool_)):
      typed[name] = np.bool_(value)
    elif isinstance(value, float):
      typed[name] = np.float32(value)
    else:
      typed[name] = value
  out = jax.ffi.ffi_call(target, list(results), vmap_method="sequential",
                         input_output_aliases=aliases or None)(*args, **typed)
  return list(out)
