"""Quantizer factories: `role -> Quantizer` functions for `CustomRecipe`.

The first group reproduces each built-in recipe exactly (the built-ins are defined through them,
and `CustomRecipe(factories.X) == recipes.X()` bit-for-bit). The second group is a zoo of hybrid
(per-direction) and per-layer factories. Every factory must accept `None` (a slot whose consumer
is unknown) and return a quantizer for it.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import jax.numpy as jnp

from jaxquant.quantizers import (Float8BlockQuantizer, Float8CurrentScalingQuantizer,
                                 Float8DelayedScalingQuantizer, HybridQuantizer,
                                 IdentityQuantizer, MXFP8Quantizer, NVFP4Quantizer, Quantizer)
from jaxquant.roles import QuantizerRole

Factory = Callable[[Optional[QuantizerRole]], Quantizer]

FP8_FORMATS = ("HYBRID", "E4M3", "E5M2")


def _fp8_dtype(fp8_format: str, role: Optional[QuantizerRole]):
  """TE's formats: HYBRID = E4M3 forward, E5M2 for gradients; E4M3/E5M2 = that everywhere."""
  if fp8_format not in FP8_FORMATS:
    raise ValueError(f"fp8_format={fp8_format!r}; expected one of {FP8_FORMATS}")
  if fp8_format == "E5M2" or (fp8_format == "HYBRID" and _is_grad(role)):
    return jnp.float8_e5m2
  return jnp.float8_e4m3fn


def _is_grad(role: Optional[QuantizerRole]) -> bool:
  return role is not None and role.tensor_type == "grad_output"


def _tensor_type(role: Optional[QuantizerRole]) -> str:
  return role.tensor_type if role is not None else ""


# ----------------------------------------------------------------------------------------------
# Reference factories of the built-in recipes (TransformerEngine defaults).


def float8_current_scaling(role: Optional[QuantizerRole], *, fp8_format: str = "HYBRID",
                           pow2_scale: bool = False, amax_epsilon: float = 0.0) -> Quantizer:
  """Per-tensor FP8 from the current amax; E4M3 forward, E5M2 gradients (HYBRID)."""
  return Float8CurrentScalingQuantizer(_fp8_dtype(fp8_format, role), pow2_scale, amax_epsilon)


def delayed_scaling(role: Optional[QuantizerRole], *, fp8_format: str = "HYBRID",
                    margin: int = 0, amax_history_len: int = 1024,
                    amax_compute_algo: str = "max", first_scale: str = "current") -> Quantizer:
  """Per-tensor FP8 from an amax history; E4M3 forward, E5M2 gradients (HYBRID). The first
  quantization takes its scale from the current amax (`first_scale="current"`) or is 1
  (`"one"`, TransformerEngine's start)."""
  return Float8DelayedScalingQuantizer(_fp8_dtype(fp8_format, role), amax_history_len,
                                       amax_compute_algo, margin, first_scale)


def mxfp8_block_scaling(role: Optional[QuantizerRole], *, fp8_format: str = "E4M3") -> Quantizer:
  """MXFP8 (1x32 blocks, E8M0 scales), E4M3 everywhere by default."""
  return MXFP8Quantizer(_fp8_dtype(fp8_format, role))


def float8_block_scaling(role: Optional[QuantizerRole], *, fp8_format: str = "E4M3",
                         x_block_scaling_dim: int = 1, w_block_scaling_dim: int = 2,
                         grad_block_scaling_dim: int = 1, pow2_scale: bool = True,
                         amax_epsilon: float = 0.0) -> Quantizer:
  """FP8 with FP32 block scales: 1x128 activations and gradients, 128x128 weights."""
  dims = {"weight": w_block_scaling_dim, "grad_output": grad_block_scaling_dim}
  dim = dims.get(_tensor_type(role), x_block_scaling_dim)
  if dim not in (1, 2):
    raise ValueError(f"block scaling dim {dim!r} for {role}; expected 1 (1x128) or 2 (128x128)")
  block = (1, 128) if dim == 1 else (128, 128)
  return Float8BlockQuantizer(block, _fp8_dtype(fp8_format, role), pow2_scale, amax_epsilon)


def nvfp4_block_scaling(role: Optional[QuantizerRole], *, disable_rht: bool = False,
                        disable_stochastic_rounding: bool = False,
                        disable_2d_quantization: bool = False,
                        row_scaled_activation: bool = False) -> Quantizer:
  """NVFP4: 16x16 weight tiles, RHT on the wgrad operands (input and grad_output), stochastic
  rounding on gradients; optionally row-scaled ("per-token") activations."""
  tensor_type = _tensor_type(role)
  if tensor_type == "weight":
    return NVFP4Quantizer(block_2d=not disable_2d_quantization)
  if tensor_type == "grad_output":
    return NVFP4Quantizer(rht=not disable_rht,
                          stochastic_rounding=not disable_stochastic_rounding)
  return NVFP4Quantizer(row_scaled=row_scaled_activation and role is not None,
                        rht=not disable_rht and role is not None)


# ----------------------------------------------------------------------------------------------
# The zoo.


def mxfp8_forward_nvfp4_backward(role: Optional[QuantizerRole]) -> Quantizer:
  """MXFP8 for the forward GEMM; NVFP4 (with RHT and stochastic rounding where the NVFP4 recipe
  uses them) for both backward GEMMs."""
  backward = nvfp4_block_scaling(role)
  if _tensor_type(role) == "grad_output":
    return backward
  return HybridQuantizer(rowwise=MXFP8Quantizer(), columnwise=backward)


def moe_nvfp4_forward_mxfp8_backward(role: Optional[QuantizerRole]) -> Quantizer:
  """Composer-style MoE recipe: for `grouped_linear` experts, row-scaled NVFP4 activations and
  NVFP4 weights forward, MXFP8 backward; MXFP8 everywhere else."""
  if role is not None and role.module_type == "grouped_linear":
    if role.tensor_type == "input":
      return HybridQuantizer(rowwise=NVFP4Quantizer(row_scaled=True), columnwise=MXFP8Quantizer())
    if role.tensor_type == "weight":
      return HybridQuantizer(rowwise=NVFP4Quantizer(), columnwise=MXFP8Quantizer())
  return MXFP8Quantizer()


def high_precision_backward(role: Optional[QuantizerRole]) -> Quantizer:
  """FP8 (current scaling) forward GEMM; both backward GEMMs in the original precision."""
  if _tensor_type(role) == "grad_output":
    return IdentityQuantizer()
  return HybridQuantizer(rowwise=Float8CurrentScalingQuantizer(), columnwise=IdentityQuantizer())


def nvfp4_forward_backward_sees_forward_error(role: Optional[QuantizerRole]) -> Quantizer:
  """NVFP4 forward; MXFP8 backward operands built from the *dequantized* forward operands
  (`columnwise_source="rowwise_dequantized"`), so wgrad/dgrad see what the forward used."""
  if _tensor_type(role) == "grad_output":
    return MXFP8Quantizer(jnp.float8_e5m2)
  rowwise = NVFP4Quantizer(block_2d=_tensor_type(role) == "weight")
  return HybridQuantizer(rowwise=rowwise, columnwise=MXFP8Quantizer(),
                         columnwise_source="rowwise_dequantized")


def keep_layers_in_high_precision(names: Iterable[str], base: Factory) -> Factory:
  """Wrap `base` so that modules whose name is in `names` are not quantized (Identity)."""
  names = frozenset(names)

  def factory(role: Optional[QuantizerRole]) -> Quantizer:
    if role is not None and role.name in names:
      return IdentityQuantizer()
    return base(role)

  factory.__name__ = f"keep_{'_'.join(sorted(names))}_in_high_precision"
  return factory


def first_and_last_layers_bf16(role: Optional[QuantizerRole]) -> Quantizer:
  """Per-layer example: MXFP8 everywhere except the layers named "embed_proj" and "lm_head"."""
  return keep_layers_in_high_precision(("embed_proj", "lm_head"), mxfp8_block_scaling)(role)


ZOO: dict[str, Factory] = {
    "mxfp8_fwd_nvfp4_bwd": mxfp8_forward_nvfp4_backward,
    "moe_nvfp4_fwd_mxfp8_bwd": moe_nvfp4_forward_mxfp8_backward,
    "high_precision_bwd": high_precision_backward,
    "nvfp4_fwd_mxfp8_bwd_from_fwd": nvfp4_forward_backward_sees_forward_error,
    "mxfp8_bf16_ends": first_and_last_layers_bf16,
}
