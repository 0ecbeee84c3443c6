"""Float32 sums in a fixed order, so a kernel and XLA add the same numbers the same way.

XLA chooses its own order for a `reduce` (and a different one on CPU and GPU), so the fused
producers' sums are written here as explicit elementwise additions of slices, an order the
kernels reproduce (`ffi/jaxquant_numerics.h`, section "Fixed-order sums"):

* `row_sum` (normalization statistics, per row of `[rows, K]`): the row is cut into chunks of
  8 consecutive elements (zero-padded to `8 * P`, `P` = the next power of two >= ceil(K / 8));
  each chunk is summed left to right, `((v0 + v1) + v2) + ... + v7`; then the `P` chunk sums
  are added pairwise, neighbours first: `c'[j] = c[2j] + c[2j+1]`, until one is left. (A warp
  holding chunk `l` in lane `l` does the pairwise levels with xor-shuffles 1, 2, 4, ...)
* `column_tile_sums` (a bias gradient, per column of `[rows, C]`): rows are zero-padded to
  tiles of 128; within a tile each column is cut into 8 chunks of 16 rows, each chunk summed
  top to bottom, then the 8 chunk sums pairwise, neighbours first. One partial per tile and
  column: `[tiles, C]`. (The quantize kernels' column phase: a thread owns 16 rows of a column,
  8 neighbouring lanes a 128-row column.)
* `pairwise_sum` adds those partials over the tiles (pairwise, neighbours first, zero-padded
  to a power of two); it runs as XLA code after the kernel as well, so it is shared, not
  mirrored.

Zero padding is part of the definition: adding +0 turns a -0 into +0, so the padding the
kernels see (their loads return +0 outside the matrix) is the padding written here.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

ROW_CHUNK = 8  # elements summed left to right before the pairwise levels (one 16-byte bf16 load)
TILE_ROWS = 128  # rows of a quantize tile
TILE_CHUNK = 16  # rows a thread sums top to bottom in the column phase


def next_pow2(n: int) -> int:
  return 1 << max(0, (int(n) - 1).bit_length())


def _sequential(blocks: jnp.ndarray, axis: int) -> jnp.ndarray:
  """Left-to-right sum along `axis` (one slice at a time)."""
  take = lambda i: lax.index_in_dim(blocks, i, axis, keepdims=False)
  total = take(0)
  for i in range(1, blocks.shape[axis]):
    total = total + take(i)
  return total


def _pairwise(values: jnp.ndarray, axis: int) -> jnp.ndarray:
  """Neighbours-first pairwise sum along `axis`, whose length is a power of two."""
  n = values.shape[axis]
  assert n & (n - 1) == 0, n
  while values.shape[axis] > 1:
    length = values.shape[axis]
    values = (lax.slice_in_dim(values, 0, length, 2, axis) +
              lax.slice_in_dim(values, 1, length, 2, axis))
  return jnp.squeeze(values, axis)


def row_sum(x: jnp.ndarray) -> jnp.ndarray:
  """Sum of each row of a float32 `[rows, K]` in the kernels' order: `[rows]`."""
  x = jnp.asarray(x, jnp.float32)
  rows, k = x.shape
  chunks = next_pow2(-(-k // ROW_CHUNK))
  x = jnp.pad(x, ((0, 0), (0, chunks * ROW_CHUNK - k)))
  sums = _sequential(x.reshape(rows, chunks, ROW_CHUNK), axis=2)
  return _pairwise(sums, axis=1)


def column_tile_sums(x: jnp.ndarray) -> jnp.ndarray:
  """Per 128-row tile, the sum of each column of float32 `[rows, C]`: `[ceil(rows/128), C]`."""
  x = jnp.asarray(x, jnp.float32)
  rows, cols = x.shape
  tiles = -(-rows // TILE_ROWS)
  x = jnp.pad(x, ((0, tiles * TILE_ROWS - rows), (0, 0)))
  chunks = x.reshape(tiles, TILE_ROWS // TILE_CHUNK, TILE_CHUNK, cols)
  return _pairwise(_sequential(chunks, axis=2), axis=1)


def pairwise_sum(x: jnp.ndarray, axis: int = 0) -> jnp.ndarray:
  """Neighbours-first pairwise sum along `axis`, zero-padded to a power of two."""
  x = jnp.asarray(x, jnp.float32)
  n = x.shape[axis]
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, next_pow2(n) - n)
  return _pairwise(jnp.pad(x, pad), axis)
