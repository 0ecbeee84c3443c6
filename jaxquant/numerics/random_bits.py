"""Counter-based random bits for stochastic rounding, reproducible by any kernel.

The bits for element (row, col) of the matrix being quantized depend only on two 32-bit key
words and the element's global index, so kernels, CPU handlers and shards all draw the same
numbers without sharing RNG state:

    h = mix(row * 0x9E3779B9 + k0)
    h = mix(h ^ (col * 0x85EBCA6B + k1))
    u = (h >> 8) * 2^-24          # uniform in [0, 1), 24 bits

with `mix` the "lowbias32" integer hash (x ^= x>>16; x *= 0x7feb352d; x ^= x>>15;
x *= 0x846ca68b; x ^= x>>16). The key words come from `jax.random.key_data(key)`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _mix(x: jnp.ndarray) -> jnp.ndarray:
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x7FEB352D)
  x = x ^ (x >> 15)
  x = x * jnp.uint32(0x846CA68B)
  return x ^ (x >> 16)


def key_words(key: jax.Array) -> jnp.ndarray:
  """The two uint32 words (k0, k1) that seed the stream of a JAX PRNG key."""
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    data = jax.random.key_data(key)
  else:
    data = key
  data = jnp.asarray(data).reshape(-1).astype(jnp.uint32)
  if data.shape[0] < 2:
    raise ValueError(f"key: expected a JAX PRNG key, got an array of shape {key.shape}")
  return data[:2]


def stochastic_round_bits(words: jnp.ndarray, rows: int, cols: int, row_offset=0,
                          col_offset=0) -> jnp.ndarray:
  """Uniform float32 draws in [0, 1) for a [rows, cols] matrix (global index offsets allowed)."""
  r = (jnp.arange(rows, dtype=jnp.uint32) + jnp.uint32(row_offset))[:, None]
  c = (jnp.arange(cols, dtype=jnp.uint32) + jnp.uint32(col_offset))[None, :]
  h = _mix(r * jnp.uint32(0x9E3779B9) + words[0])
  h = _mix(h ^ (c * jnp.uint32(0x85EBCA6B) + words[1]))
  return (h >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)
