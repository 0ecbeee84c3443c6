"""The normalization in front of `LayerNormDense` and `LayerNormMLP`.

The arithmetic is Flax's (`flax.linen.LayerNorm` / `RMSNorm`: statistics in at least float32,
`E[x^2] - E[x]^2` clipped at zero, `(x - mean) * (rsqrt(var + eps) * scale) + bias`), so a
module with an Identity recipe reproduces `nn.LayerNorm -> nn.Dense`. Where the dense layer's
input format has fused kernels, the modules normalize with those instead
(`jaxquant.flax.fusion`; the spec's arithmetic, `jaxquant.numerics.normalization`), from the
same `norm_parameters`. Parameters are named as in
TransformerEngine's fused modules: `scale` and `ln_bias`, next to the dense `kernel`/`bias`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

NORM_TYPES = ("layernorm", "rmsnorm")


def check_norm_type(norm_type: str) -> None:
  if norm_type not in NORM_TYPES:
    raise ValueError(f"norm_type={norm_type!r}; expected one of {NORM_TYPES}")


def norm_parameters(module: nn.Module, features: int, *, use_scale: bool, use_bias: bool,
                    zero_centered_gamma: bool, scale_init: Optional[Callable],
                    bias_init: Callable, param_dtype: Any) -> tuple[Optional[jax.Array],
                                                                   Optional[jax.Array]]:
  """Create the normalization's `scale` and `ln_bias` in `module`'s scope (None where off).

  `scale_init` None: ones, or zeros with `zero_centered_gamma` (the parameter is `gamma - 1`).
  """
  scale = bias = None
  if use_scale:
    if scale_init is None:
      scale_init = nn.initializers.zeros_init() if zero_centered_gamma else nn.initializers.ones
    scale = module.param("scale", scale_init, (features,), param_dtype)
  if use_bias:
    bias = module.param("ln_bias", bias_init, (features,), param_dtype)
  return scale, bias


def apply_norm(x: jax.Array, scale: Optional[jax.Array], bias: Optional[jax.Array], *,
               norm_type: str, epsilon: float, zero_centered_gamma: bool,
               dtype: Any) -> jax.Array:
  """Normalize `x` over its last axis in Flax's arithmetic (see the module docstring).

  Args:
    scale, bias: the parameters from `norm_parameters` (None where off).
    dtype: output dtype (None: inferred from `x` and the parameters, as Flax does).
  """
  check_norm_type(norm_type)
  stats_dtype = jnp.promote_types(x.dtype, jnp.float32)
  xf = x.astype(stats_dtype)
  if norm_type == "layernorm":
    mean = xf.mean(-1, keepdims=True)
    var = jnp.maximum(0.0, jnp.square(xf).mean(-1, keepdims=True) - jnp.square(mean))
    y = x - mean
  else:
    var = jnp.square(xf).mean(-1, keepdims=True)
    y = xf
  mul = jax.lax.rsqrt(var + epsilon)
  args = [x]
  if scale is not None:
    args.append(scale)
    mul = mul * (scale + 1 if zero_centered_gamma else scale)
  y = y * mul
  if bias is not None:
    args.append(bias)
    y = y + bias
  return jnp.asarray(y, nn.dtypes.canonicalize_dtype(*args, dtype=dtype))


def normalize(module: nn.Module, x: jax.Array, *, norm_type: str, epsilon: float,
              use_scale: bool, use_bias: bool, zero_centered_gamma: bool,
              scale_init: Optional[Callable], bias_init: Callable, dtype: Any,
              param_dtype: Any) -> jax.Array:
  """Normalize `x` over its last axis, creating `scale`/`ln_bias` in `module`'s scope.

  Args:
    norm_type: "layernorm" (subtract the mean) or "rmsnorm" (no mean).
    zero_centered_gamma: the `scale` parameter is stored as `gamma - 1` (initialized to 0) and
      `1 + scale` multiplies the normalized input (TransformerEngine's option).
    scale_init: None: ones, or zeros with `zero_centered_gamma`.
    dtype: output dtype (None: inferred from `x` and the parameters, as Flax does).
  """
  check_norm_type(norm_type)
  scale, bias = norm_parameters(module, x.shape[-1], use_scale=use_scale, use_bias=use_bias,
                                zero_centered_gamma=zero_centered_gamma, scale_init=scale_init,
                                bias_init=bias_init, param_dtype=param_dtype)
  return apply_norm(x, scale, bias, norm_type=norm_type, epsilon=epsilon,
                    zero_centered_gamma=zero_centered_gamma, dtype=dtype)
