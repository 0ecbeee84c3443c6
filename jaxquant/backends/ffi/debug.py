"""Probes of the extension used by the tests (not part of the public API).

`raw_bytes` reads the first bytes of an array's device buffer as XLA stores it (how the tests
check that `float4_e2m1fn` arrays are packed two codes a byte, first element in the low nibble);
`encoder_mismatches` counts float32 inputs where the fast E4M3/E5M2/E2M1 encoders (hardware
conversion on the GPU, threshold ladder for E2M1) differ from the spec-form encoders of the
numerics header.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant.backends.ffi import calls


def raw_bytes(x: jax.Array, nbytes: int) -> jax.Array:
  """uint8[nbytes]: the first `nbytes` bytes of `x`'s buffer (must not exceed its storage)."""
  (out,) = calls.call("jaxquant_debug_raw_bytes", [jax.ShapeDtypeStruct((nbytes,), jnp.uint8)],
                      x)
  return out


def encoder_mismatches(start: int, count: int, stride: int = 1) -> np.ndarray:
  """uint32[6]: mismatch counts (E4M3, E5M2, E2M1) over the float32 bit patterns
  start + i * stride (i < count, mod 2^32), then the largest mismatching pattern of each."""
  (out,) = calls.call("jaxquant_debug_encoder_mismatches",
                      [jax.ShapeDtypeStruct((6,), jnp.uint32)], start=np.int64(start),
                      count=np.int64(count), stride=np.int64(stride))
  return np.asarray(out)
