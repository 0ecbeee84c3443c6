"""Quantized storages: `ScaledTensor` (one direction, one format) and `QuantizedTensor` (both).

Storage convention (docs/design.md §3 "Storage convention"): every quantized operand is a 2-D
`[rows, cols]` matrix whose last axis is the GEMM's contraction axis; block scales run along
`cols`; a columnwise copy
is stored transposed. Both classes are pytrees whose arrays are the leaves and whose quantizer and
flags are static aux data, so they pass through `jit`, `vmap`, `tree_map` and donation.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant.quantizers import Quantizer


# Decoders by quantizer class. The formats (`jaxquant.formats`) build on this module, so each
# registers its decoder here when it registers itself, rather than this module importing them.
_DECODERS: dict[type, Callable[[ScaledTensor], jax.Array]] = {}


def register_decoder(quantizer_type: type, decode: Callable[[ScaledTensor], jax.Array]) -> None:
  """Makes `ScaledTensor.dequantize` use `decode` (float32 values) for `quantizer_type`."""
  _DECODERS[quantizer_type] = decode


def _decoder(quantizer: Quantizer) -> Callable[[ScaledTensor], jax.Array]:
  try:
    return _DECODERS[type(quantizer)]
  except KeyError:
    raise TypeError(f"quantizer: no format decodes {type(quantizer).__name__}; expected one of "
                    f"{sorted(t.__name__ for t in _DECODERS)}") from None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ScaledTensor:
  """One quantized `[rows, cols]` matrix in one format.

  Attributes:
    data: payload in the element dtype (`float8_e4m3fn`, `float8_e5m2`, `float4_e2m1fn`, or the
      high-precision dtype for Identity).
    scale_inv: decode scale(s): `()` per tensor, `[rows, ceil(cols/b)]` for 1-D blocks,
      `[ceil(rows/b), ceil(cols/b)]` for 2-D blocks; `None` for Identity.
    amax: `()` float32, or `[rows]` for row-scaled NVFP4; `None` for Identity.
    quantizer: the single-format quantizer that produced it (static).
    orig_dtype: dtype of the tensor that was quantized (static; the default GEMM output dtype).
    rht: whether the random Hadamard transform was applied along `cols` (static).
  """

  data: jax.Array
  scale_inv: Optional[jax.Array]
  amax: Optional[jax.Array]
  quantizer: Quantizer = dataclasses.field(metadata=dict(static=True))
  orig_dtype: Any = dataclasses.field(default=np.dtype(jnp.float32), metadata=dict(static=True))
  rht: bool = dataclasses.field(default=False, metadata=dict(static=True))

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.data.shape)

  @property
  def ndim(self) -> int:
    return self.data.ndim

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """The high-precision `[rows, cols]` matrix this storage encodes (RHT undone)."""
    return _decoder(self.quantizer)(self).astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedTensor:
  """What a quantizer returns: the rowwise copy `[rows, cols]` and/or the transposed columnwise
  copy `[cols, rows]`. For a `HybridQuantizer` the two come from different formats."""

  rowwise: Optional[ScaledTensor]
  columnwise: Optional[ScaledTensor]
  quantizer: Quantizer = dataclasses.field(metadata=dict(static=True))

  @property
  def shape(self) -> tuple[int, ...]:
    """The logical `[rows, cols]` shape (of the rowwise view)."""
    if self.rowwise is not None:
      return self.rowwise.shape
    return tuple(reversed(self.columnwise.shape))

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """The `[rows, cols]` matrix, from the rowwise copy if present, else the columnwise one."""
    if self.rowwise is not None:
      return self.rowwise.dequantize(dtype)
    if self.columnwise is None:
      raise ValueError("QuantizedTensor holds neither a rowwise nor a columnwise copy")
    return jnp.swapaxes(self.columnwise.dequantize(dtype), -1, -2)
