"""A normalization whose kernel writes the quantized input of the dense layer after it.

`norm_quantized(x, scale, bias, state, config)` returns `(ln_out, qx)`: `qx` is the
`QuantizedTensor` (rowwise for the forward GEMM, columnwise for the weight gradient) of the
normalized `x`, for `jaxquant.dense(..., x_quantized=qx)`; `ln_out` is the normalized output in
high precision when `config.write_y` (something else reads it, e.g. `return_layernorm_output`),
else a placeholder of its shape and dtype that nothing computes: the dense layer reads `qx`,
and the placeholder only carries the gradient of the normalized output back here.

The backward pass is the normalization's, in float32 from the saved statistics:
  xhat = (x - mean) * rsigma  (RMSNorm: x * rsigma),  g = dy * scale,
  dx = rsigma * (g - mean(g) - xhat * mean(g * xhat))  (RMSNorm without the mean(g) term),
  dscale = sum over rows of dy * xhat,  dbias = sum over rows of dy.
Both directions are quantized whether or not the weight gradient is needed (a custom_vjp's
value cannot depend on what is differentiated).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant.ops import fused as fused_ops
from jaxquant.quantizers import Quantizer


@dataclasses.dataclass(frozen=True)
class NormConfig:
  """Static description of a fused normalization.

  Attributes:
    norm_type: "layernorm" or "rmsnorm".
    epsilon: added to the variance.
    zero_centered_gamma: the scale parameter stores `gamma - 1`.
    out_dtype: dtype of the normalized output (its values are rounded to it).
    dense_dtype: dtype of the dense layer's input (the placeholder's; the quantized tensors'
      `orig_dtype`).
    quantizer: the dense layer's input quantizer (`jaxquant.ops.fused.fusion_unsupported` is
      None for it).
    write_y: return the normalized output itself.
    role: the input role, for `jaxquant.explain`.
  """

  norm_type: str
  epsilon: float
  zero_centered_gamma: bool
  out_dtype: Any
  dense_dtype: Any
  quantizer: Quantizer
  write_y: bool = False
  role: Any = None


def _effective_scale(scale: Optional[jax.Array], config: NormConfig) -> Optional[jax.Array]:
  if scale is None:
    return None
  g = scale.astype(jnp.float32)
  return g + jnp.float32(1.0) if config.zero_centered_gamma else g


def _forward(config: NormConfig, x, scale, bias, state):
  k = x.shape[-1]
  x2d = x.reshape(-1, k)
  result = fused_ops.norm_quantize(
      x2d, _effective_scale(scale, config), None if bias is None else bias.astype(jnp.float32),
      norm_type=config.norm_type, epsilon=config.epsilon, out_dtype=config.out_dtype,
      quantizer=config.quantizer, rowwise=True, columnwise=True, state=state,
      write_y=config.write_y, orig_dtype=config.dense_dtype, role=config.role)
  if config.write_y:
    ln_out = result.y.reshape(x.shape)
  else:
    ln_out = jnp.zeros(x.shape, config.dense_dtype)
  return (ln_out, result.quantized), (result.mean, result.rsigma)


def _primal(config, x, scale, bias, state):
  out, _ = _forward(config, x, scale, bias, state)
  return out


def _fwd(config, x, scale, bias, state):
  out, (mean, rsigma) = _forward(config, x, scale, bias, state)
  return out, (x, scale, bias, mean, rsigma)


def _bwd(config, residuals, cotangents):
  x, scale, bias, mean, rsigma = residuals
  dy, _ = cotangents  # the quantized copies carry no gradient
  k = x.shape[-1]
  xf = x.reshape(-1, k).astype(jnp.float32)
  dyf = dy.reshape(-1, k).astype(jnp.float32)
  r = rsigma[:, None]
  xhat = (xf - mean[:, None]) * r if mean is not None else xf * r
  g = _effective_scale(scale, config)
  dxhat = dyf * g[None, :] if g is not None else dyf
  proj = jnp.mean(dxhat * xhat, axis=-1, keepdims=True)
  if mean is not None:
    dx = r * (dxhat - jnp.mean(dxhat, axis=-1, keepdims=True) - xhat * proj)
  else:
    dx = r * (dxhat - xhat * proj)
  dscale = None if scale is None else jnp.sum(dyf * xhat, axis=0).astype(scale.dtype)
  dbias = None if bias is None else jnp.sum(dyf, axis=0).astype(bias.dtype)
  return dx.reshape(x.shape).astype(x.dtype), dscale, dbias, None


_norm_quantized = jax.custom_vjp(_primal, nondiff_argnums=(0,))
_norm_quantized.defvjp(_fwd, _bwd)


def norm_quantized(x: jax.Array, scale: Optional[jax.Array], bias: Optional[jax.Array],
                   state: Any, config: NormConfig):
  """`(ln_out, qx)` of `x[..., K]` normalized over K (see the module docstring).

  Args:
    x: the input (bfloat16 / float16 / float32).
    scale, bias: the normalization's parameters `[K]` (any float dtype), or None.
    state: the delayed-scaling state of the input quantizer (None for stateless ones); its
      update is the dense layer's (`jaxquant.dense` sees `qx`'s amax).
    config: `NormConfig`.
  """
  if not isinstance(config, NormConfig):
    raise TypeError(f"config: expected a NormConfig, got {type(config).__name__}")
  reason = fused_ops.fusion_unsupported(config.quantizer)
  if reason is not None:
    raise ValueError(f"config.quantizer: {reason}")
  return _norm_quantized(config, x, scale, bias, state)


def out_dtypes(x_dtype, param_dtypes, kernel_dtypes, dtype) -> tuple[np.dtype, np.dtype]:
  """(normalized output dtype, dense input dtype) as Flax computes them for an unfused norm
  followed by a dense layer: `canonicalize_dtype(x, *norm params, dtype=dtype)`, then
  `promote_dtype(ln_out, kernel, bias, dtype=dtype)`."""
  if dtype is not None:
    return np.dtype(dtype), np.dtype(dtype)
  out = jnp.result_type(x_dtype, *param_dtypes)
  return np.dtype(out), np.dtype(jnp.result_type(out, *kernel_dtypes))
