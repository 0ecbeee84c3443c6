"""What a fused producer computes and returns, shared by its FFI kernels
(`jaxquant.backends.ffi.fused`) and its reference composition
(`jaxquant.backends.reference.fused`), which take the same arguments.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant.numerics import activations as _act
from jaxquant.tensors import ScaledTensor

PRODUCER_KINDS = ("layernorm", "rmsnorm", "activation", "activation_grad", "parts")


@dataclasses.dataclass(frozen=True)
class Producer:
  """What computes the matrix a fused target quantizes (static).

  Attributes:
    kind: "layernorm", "rmsnorm", "activation", "activation_grad" or "parts" (column parts
      side by side, `[a | *more]`: a packed projection's dq, dk and dv, read where they are).
    out_dtype: the produced values are rounded to it (bfloat16, float16 or float32).
    epsilon: the normalization's epsilon.
    has_scale, has_bias: a normalization's scale (already `1 + gamma` when zero-centered) and
      bias, float32 `[K]`.
    activation: `jaxquant.numerics.activations.ACTIVATIONS` name (activations).
    gated: a gated unit: the activation's input is `[h0 | h1]` and its output `act(h0) * h1`.
    approximate: an ungated gelu the CUDA kernels may compute with the hardware's exp2 and
      reciprocal approximations (~2^-21 relative before rounding; Float8Block's whole-tile MLP
      kernel, docs/design.md decision 62): the tolerance class of the GEMM epilogue's gelu, not
      the spec's bits. The CPU handler and the reference compute the spec's gelu.
  """

  kind: str
  out_dtype: Any = np.dtype(jnp.bfloat16)
  epsilon: float = 1e-6
  has_scale: bool = False
  has_bias: bool = False
  activation: str = "gelu"
  gated: bool = False
  approximate: bool = False

  def __post_init__(self):
    if self.kind not in PRODUCER_KINDS:
      raise ValueError(f"Producer.kind={self.kind!r}; expected one of {PRODUCER_KINDS}")
    object.__setattr__(self, "out_dtype", np.dtype(self.out_dtype))
    if self.kind in ("activation", "activation_grad"):
      object.__setattr__(self, "activation", _act.canonical(self.activation))
    if self.approximate and (self.kind != "activation" or self.activation != "gelu"
                             or self.gated):
      raise ValueError(f"Producer.approximate is an ungated gelu activation's; got kind="
                       f"{self.kind!r}, activation={self.activation!r}, gated={self.gated}")

  @property
  def norm(self) -> bool:
    return self.kind in ("layernorm", "rmsnorm")


@dataclasses.dataclass(frozen=True)
class Inputs:
  """The producer's arrays: `a` = x (norms), h (activation), dy (gradient) or the first part;
  `b` = h (gradient); per-row `mean`, `rsigma` and per-column `scale`, `bias` of a
  normalization; `more` = the other parts (each `a`'s shape and dtype)."""

  a: jax.Array
  b: Optional[jax.Array] = None
  mean: Optional[jax.Array] = None
  rsigma: Optional[jax.Array] = None
  scale: Optional[jax.Array] = None
  bias: Optional[jax.Array] = None
  more: tuple = ()


def output_shape(producer: Producer, inputs: Inputs) -> tuple[int, int]:
  rows, cols = inputs.a.shape
  if producer.kind == "activation" and producer.gated:
    return rows, cols // 2
  if producer.kind == "activation_grad" and producer.gated:
    return rows, 2 * cols
  if producer.kind == "parts":
    return rows, cols * (1 + len(inputs.more))
  return rows, cols


@dataclasses.dataclass(frozen=True)
class Fused:
  """What `fused_quantize` returns: the rowwise / columnwise copies (None where not asked), the
  normalized output in high precision (`write_y`), the per-tile column sums (`col_sums`)."""

  rowwise: Optional[ScaledTensor]
  columnwise: Optional[ScaledTensor]
  y: Optional[jax.Array] = None
  col_sums: Optional[jax.Array] = None
