"""The 16-point random Hadamard transform (RHT) used before NVFP4 wgrad quantization.

Each 16-long chunk `c` of the contraction axis becomes `c @ (diag(RHT_SIGNS) @ H16 / 4)`:
the signs are applied, then a Walsh-Hadamard butterfly (Sylvester order, stages h = 1, 2, 4, 8,
pairs (a + b, a - b)), then the exact scaling by 1/4. The butterfly fixes the float32 summation
order, so kernels reproduce it bit-for-bit. The matrix is orthogonal: applied to both operands
of a GEMM over that axis, it cancels.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

RHT_SIGNS = np.array([1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1], np.float32)
RHT_SIZE = 16


def rht_matrix() -> np.ndarray:
  """The 16x16 float64 matrix `diag(RHT_SIGNS) @ H16 / 4` (for tests and float64 references)."""
  h = np.array([[1.0]])
  while h.shape[0] < RHT_SIZE:
    h = np.block([[h, h], [h, -h]])
  return np.diag(RHT_SIGNS.astype(np.float64)) @ h / 4.0


def rht16(x: jnp.ndarray) -> jnp.ndarray:
  """Apply the RHT along the last axis (its length must be a multiple of 16), in float32."""
  *lead, n = x.shape
  if n % RHT_SIZE:
    raise ValueError(f"rht16: the last axis has length {n}; it must be a multiple of {RHT_SIZE}")
  v = x.astype(jnp.float32).reshape(*lead, n // RHT_SIZE, RHT_SIZE) * jnp.asarray(RHT_SIGNS)
  return (_butterfly(v, lead, n) * jnp.float32(0.25)).reshape(*lead, n)


def _butterfly(v: jnp.ndarray, lead: list, n: int) -> jnp.ndarray:
  h = 1
  while h < RHT_SIZE:
    v = v.reshape(*lead, n // RHT_SIZE, RHT_SIZE // (2 * h), 2, h)
    a, b = v[..., 0, :], v[..., 1, :]
    v = jnp.stack([a + b, a - b], axis=-2)
    h *= 2
  return v.reshape(*lead, n // RHT_SIZE, RHT_SIZE)


def rht16_inverse(y: jnp.ndarray) -> jnp.ndarray:
  """Undo `rht16` along the last axis: `y @ (H16 @ diag(signs) / 4)` (the transpose)."""
  *lead, n = y.shape
  v = _butterfly(y.astype(jnp.float32), lead, n) * jnp.float32(0.25) * jnp.asarray(RHT_SIGNS)
  return v.reshape(*lead, n)
