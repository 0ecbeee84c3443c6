"""Quantizer descriptions: one frozen, hashable dataclass per format.

A quantizer holds no arrays; it is static under `jit` and says *how* to quantize. The math and
every fact the layers ask about a format (blocks, scale layout, state, kernels) live in its
`jaxquant.formats` object (`jaxquant.formats.format_of(quantizer)`), registered by quantizer
class; stateful quantizers (delayed scaling) keep their state outside (`jaxquant.state`).
Every invalid option combination raises `ValueError` at construction, naming the option.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax.numpy as jnp
import numpy as np

FP8_DTYPES = (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2))
HIGH_PRECISION_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32))


def _fp8_dtype(value: Any, cls: str) -> np.dtype:
  try:
    dtype = np.dtype(value)
  except TypeError:
    dtype = None
  if dtype not in FP8_DTYPES:
    raise ValueError(
        f"{cls}: dtype={value!r} is not a supported float8 format; expected "
        "jnp.float8_e4m3fn (E4M3) or jnp.float8_e5m2 (E5M2)")
  return dtype


def _check_eps(value: float, cls: str) -> float:
  if not (isinstance(value, (int, float)) and np.isfinite(value) and value >= 0):
    raise ValueError(f"{cls}: amax_epsilon={value!r} must be a finite float >= 0")
  return float(value)


class Quantizer:
  """Base class of every quantizer (a marker: subclasses are frozen dataclasses)."""

  #: whether the quantizer keeps state between steps (delayed scaling)
  stateful: bool = False

  def leaves(self) -> tuple["Quantizer", ...]:
    """The single-format quantizers this one is made of (itself, or a Hybrid's halves)."""
    return (self,)

  def for_direction(self, direction: str) -> "Quantizer":
    """The quantizer serving `direction` ("rowwise" or "columnwise")."""
    _check_direction(direction)
    return self


FIRST_SCALES = ("current", "one")


def check_first_scale(value: Any, owner: str) -> None:
  """ValueError unless `value` is a delayed-scaling `first_scale` option."""
  if value not in FIRST_SCALES:
    raise ValueError(f"{owner}: first_scale={value!r}; expected 'current' (the first "
                     "quantization takes its scale from the tensor's own amax) or 'one' "
                     "(TransformerEngine's scale-1 start)")


def _check_direction(direction: str) -> None:
  if direction not in ("rowwise", "columnwise"):
    raise ValueError(f"direction={direction!r}; expected 'rowwise' or 'columnwise'")


@dataclasses.dataclass(frozen=True)
class Float8CurrentScalingQuantizer(Quantizer):
  """Per-tensor FP8 with the scale computed from this tensor's own amax."""

  dtype: Any = jnp.float8_e4m3fn
  pow2_scale: bool = False
  amax_epsilon: float = 0.0

  def __post_init__(self):
    object.__setattr__(self, "dtype", _fp8_dtype(self.dtype, type(self).__name__))
    object.__setattr__(self, "amax_epsilon", _check_eps(self.amax_epsilon, type(self).__name__))


@dataclasses.dataclass(frozen=True)
class Float8DelayedScalingQuantizer(Quantizer):
  """Per-tensor FP8 with the scale taken from an amax history of earlier steps.

  Attributes:
    first_scale: the scale of a quantization made before any usable amax was recorded:
      "current" (default) takes it just in time from the tensor's own amax, exactly as current
      scaling would (`fmax / amax / 2^margin`), so the first step is not lost; "one" starts
      from scale 1 (TransformerEngine's and Flax's convention), which lets gradients underflow
      E5M2 at step 1.
  """

  dtype: Any = jnp.float8_e4m3fn
  amax_history_len: int = 1024
  amax_compute_algo: Literal["max", "most_recent"] = "max"
  margin: int = 0
  first_scale: Literal["current", "one"] = "current"
  stateful = True

  def __post_init__(self):
    name = type(self).__name__
    object.__setattr__(self, "dtype", _fp8_dtype(self.dtype, name))
    if not (isinstance(self.amax_history_len, int) and self.amax_history_len >= 1):
      raise ValueError(f"{name}: amax_history_len={self.amax_history_len!r} must be an int >= 1")
    if self.amax_compute_algo not in ("max", "most_recent"):
      raise ValueError(f"{name}: amax_compute_algo={self.amax_compute_algo!r}; expected "
                       "'max' or 'most_recent'")
    if not (isinstance(self.margin, int) and self.margin >= 0):
      raise ValueError(f"{name}: margin={self.margin!r} must be an int >= 0")
    check_first_scale(self.first_scale, name)


@dataclasses.dataclass(frozen=True)
class MXFP8Quantizer(Quantizer):
  """MXFP8: 1x32 blocks along the contraction axis, E8M0 (power-of-two) scales."""

  dtype: Any = jnp.float8_e4m3fn

  def __post_init__(self):
    object.__setattr__(self, "dtype", _fp8_dtype(self.dtype, type(self).__name__))


@dataclasses.dataclass(frozen=True)
class NVFP4Quantizer(Quantizer):
  """NVFP4: E2M1 payload, E4M3 scale per 1x16 block (or 16x16 tile), FP32 second-level scale.

  Attributes:
    row_scaled: second-level scale per row ("per-token") instead of per tensor.
    block_2d: 16x16 tiles (weights): rowwise and columnwise copies share tile scales.
    rht: random Hadamard transform of the columnwise copy (used for the wgrad operands).
    stochastic_rounding: round E2M1 stochastically (needs a PRNG key).
  """

  row_scaled: bool = False
  block_2d: bool = False
  rht: bool = False
  stochastic_rounding: bool = False

  def __post_init__(self):
    name = type(self).__name__
    for field in ("row_scaled", "block_2d", "rht", "stochastic_rounding"):
      if not isinstance(getattr(self, field), bool):
        raise ValueError(f"{name}: {field}={getattr(self, field)!r} must be a bool")
    if self.row_scaled and self.block_2d:
      raise ValueError(f"{name}: row_scaled=True cannot be combined with block_2d=True "
                       "(a 16x16 tile spans 16 rows with different row scales)")
    if self.rht and self.block_2d:
      raise ValueError(f"{name}: rht=True cannot be combined with block_2d=True (the Hadamard "
                       "transform mixes the 1x16 blocks of the wgrad operands; 2-D tiles are "
                       "for weights)")

  @property
  def dtype(self) -> np.dtype:
    return np.dtype(jnp.float4_e2m1fn)


@dataclasses.dataclass(frozen=True)
class Float8BlockQuantizer(Quantizer):
  """DeepSeek-V3-style FP8 with FP32 scales per (1, 128) block or (128, 128) tile."""

  block: tuple[int, int] = (1, 128)
  dtype: Any = jnp.float8_e4m3fn
  pow2_scale: bool = True
  amax_epsilon: float = 0.0

  def __post_init__(self):
    name = type(self).__name__
    block = tuple(self.block) if isinstance(self.block, (tuple, list)) else self.block
    if block not in ((1, 128), (128, 128)):
      raise ValueError(f"{name}: block={self.block!r}; expected (1, 128) or (128, 128)")
    object.__setattr__(self, "block", block)
    object.__setattr__(self, "dtype", _fp8_dtype(self.dtype, name))
    object.__setattr__(self, "amax_epsilon", _check_eps(self.amax_epsilon, name))


@dataclasses.dataclass(frozen=True)
class IdentityQuantizer(Quantizer):
  """High-precision passthrough (optionally cast to `dtype`): "do not quantize this"."""

  dtype: Any = None

  def __post_init__(self):
    if self.dtype is not None:
      try:
        dtype = np.dtype(self.dtype)
      except TypeError:
        dtype = None
      if dtype not in HIGH_PRECISION_DTYPES:
        raise ValueError(f"IdentityQuantizer: dtype={self.dtype!r}; expected None, "
                         "jnp.bfloat16, jnp.float16 or jnp.float32")
      object.__setattr__(self, "dtype", dtype)


ColumnwiseSource = Literal["original", "rowwise_dequantized"]


@dataclasses.dataclass(frozen=True)
class HybridQuantizer(Quantizer):
  """One format for the rowwise (forward) operand, another for the columnwise (backward) one.

  `columnwise_source="rowwise_dequantized"` quantizes the columnwise copy from
  `dequantize(rowwise(x))` instead of `x`, so the backward pass sees the forward's error.
  """

  rowwise: Quantizer = dataclasses.field(default_factory=IdentityQuantizer)
  columnwise: Quantizer = dataclasses.field(default_factory=IdentityQuantizer)
  columnwise_source: ColumnwiseSource = "original"

  def __post_init__(self):
    for field in ("rowwise", "columnwise"):
      sub = getattr(self, field)
      if isinstance(sub, HybridQuantizer):
        raise ValueError(f"HybridQuantizer: {field} is a HybridQuantizer; hybrids cannot nest "
                         "(give a single-format quantizer for each direction)")
      if not isinstance(sub, Quantizer):
        raise ValueError(f"HybridQuantizer: {field}={sub!r} is not a jaxquant Quantizer")
    if self.columnwise_source not in ("original", "rowwise_dequantized"):
      raise ValueError(f"HybridQuantizer: columnwise_source={self.columnwise_source!r}; "
                       "expected 'original' or 'rowwise_dequantized'")

  @property
  def stateful(self) -> bool:  # type: ignore[override]
    return self.rowwise.stateful or self.columnwise.stateful

  def leaves(self) -> tuple[Quantizer, ...]:
    return (self.rowwise, self.columnwise)

  def for_direction(self, direction: str) -> Quantizer:
    _check_direction(direction)
    return self.rowwise if direction == "rowwise" else self.columnwise

