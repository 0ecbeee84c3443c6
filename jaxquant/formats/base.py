"""The format registry: one reference implementation per quantizer class.

A format implements three functions of a 2-D matrix whose last axis is the contraction axis:
`quantize` (matrix -> ScaledTensor), `dequantize_raw` (ScaledTensor -> float32, blocks times block
scales) and `gemm_factor` (the per-tensor or per-row factor a GEMM applies to its accumulator,
or None). Adding a format means adding one module here plus its kernel.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from jaxquant.numerics.hadamard import rht16_inverse
from jaxquant.quantizers import Quantizer
from jaxquant.tensors import ScaledTensor, register_decoder


@dataclasses.dataclass(frozen=True)
class QuantizeContext:
  """Per-call inputs a format may need besides the matrix and the quantizer.

  Attributes:
    orig_dtype: dtype of the tensor being quantized.
    key_words: uint32[2] stochastic-rounding seed for this direction, or None.
    state: the quantizer's state (delayed scaling), or None.
    rht: whether `mat` has already been through the Hadamard transform.
  """

  orig_dtype: Any
  key_words: Optional[jax.Array] = None
  state: Any = None
  rht: bool = False


@dataclasses.dataclass(frozen=True)
class Format:
  name: str
  quantize: Callable[[jax.Array, Quantizer, QuantizeContext], ScaledTensor]
  dequantize_raw: Callable[[ScaledTensor], jax.Array]
  gemm_factor: Callable[[ScaledTensor], Optional[jax.Array]] = lambda t: None
  # (block_rows, block_cols) of the scales, or None for one scale per tensor (or no scale).
  blocks: Callable[[Quantizer], Optional[tuple[int, int]]] = lambda q: None


_REGISTRY: dict[type, Format] = {}


def register(quantizer_type: type, fmt: Format) -> None:
  _REGISTRY[quantizer_type] = fmt
  register_decoder(quantizer_type, dequantize_scaled)


def format_of(quantizer: Quantizer) -> Format:
  try:
    return _REGISTRY[type(quantizer)]
  except KeyError:
    raise TypeError(f"quantizer: no format is registered for {type(quantizer).__name__}; "
                    f"expected one of {sorted(t.__name__ for t in _REGISTRY)}") from None


def dequantize_scaled(t: ScaledTensor) -> jax.Array:
  """Float32 values of a ScaledTensor: raw blocks times the GEMM factor, RHT undone."""
  fmt = format_of(t.quantizer)
  values = fmt.dequantize_raw(t)
  factor = fmt.gemm_factor(t)
  if factor is not None:
    values = values * (factor[..., None] if factor.ndim else factor)
  if t.rht:
    values = rht16_inverse(values)
  return values


def pad_to_blocks(mat: jax.Array, block_rows: int, block_cols: int) -> jax.Array:
  """Zero-pad a `[rows, cols]` matrix up to whole blocks (zeros never change a block's amax)."""
  rows, cols = mat.shape[-2:]
  pad_rows = -rows % block_rows
  pad_cols = -cols % block_cols
  if pad_rows == 0 and pad_cols == 0:
    return mat
  return jnp.pad(mat, [(0, 0)] * (mat.ndim - 2) + [(0, pad_rows), (0, pad_cols)])


def block_view(mat: jax.Array, block_rows: int, block_cols: int) -> jax.Array:
  """`[R, C]` (already padded) -> `[R/br, br, C/bc, bc]`."""
  rows, cols = mat.shape
  return mat.reshape(rows // block_rows, block_rows, cols // block_cols, block_cols)


def abs_max(x: jax.Array, axis=None) -> jax.Array:
  """Max |x| over `axis` as float32, NaN-propagating on every backend.

  Taken over the bits of |x|: for non-negative floats the uint32 order is the float order and
  every NaN sorts above +inf. (A float `jnp.max` is not enough: XLA:CPU's YNN reduction fusion,
  on by default in jax 0.10.2, drops NaNs from float max reductions and can even return -inf.)
  """
  bits = jax.lax.bitcast_convert_type(jnp.abs(x.astype(jnp.float32)), jnp.uint32)
  return jax.lax.bitcast_convert_type(jnp.max(bits, axis=axis), jnp.float32)


def block_amax(mat: jax.Array, block_rows: int, block_cols: int) -> jax.Array:
  """Max |x| per block of a padded matrix: `[R/br, C/bc]` float32, NaN-propagating."""
  return abs_max(block_view(mat, block_rows, block_cols), axis=(1, 3))


def expand_blocks(per_block: jax.Array, block_rows: int, block_cols: int) -> jax.Array:
  """Broadcast a `[R/br, C/bc]` array to the padded `[R, C]` element grid."""
  return jnp.repeat(jnp.repeat(per_block, block_rows, axis=0), block_cols, axis=1)


def tensor_amax(mat: jax.Array) -> jax.Array:
  return abs_max(mat)
