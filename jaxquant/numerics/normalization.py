"""LayerNorm and RMSNorm in the fused kernels' exact float32 arithmetic (the specification).

Per row of `x[rows, K]` (float32; K the normalized, last axis), `ffi/jaxquant_numerics.h`
mirrors every step:

  LayerNorm   mean   = S(x) / K
              var    = S(mul_rn(d, d)) / K,  d = x - mean      (two passes: no cancellation)
              rsigma = 1 / sqrt(var + eps)
  RMSNorm     rsigma = 1 / sqrt(S(mul_rn(x, x)) / K + eps)     (no mean)

with S the fixed-order row sum of `reductions.row_sum`, IEEE division (`ieee_div`) and square
root (`ieee_sqrt`), and `eps` rounded to float32. Each element is then

  t = d * rsigma                     (d = x - mean; d = x for RMSNorm)
  y = t * g                          with a scale g, else y = t
  y = mul_rn(t, g) + beta            with a bias (mul_rn(d, rsigma) + beta without a scale)

where g is the scale parameter as float32, plus 1 with `zero_centered_gamma` (added before the
kernel, so both sides add the same floats). Finally y is rounded to the output dtype (bfloat16
or float16 round to nearest even), the value the quantizer sees.

This is not `flax.linen.LayerNorm`'s arithmetic (E[x^2] - E[x]^2 and XLA's own reduction
order); an unquantized `jaxquant.flax.LayerNormDense` keeps Flax's, so an Identity recipe still
equals `nn.LayerNorm -> nn.Dense` bit for bit.
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp

from jaxquant.numerics.division import ieee_div
from jaxquant.numerics.exact import ieee_sqrt, mul_rn
from jaxquant.numerics.reductions import row_sum

NORM_TYPES = ("layernorm", "rmsnorm")


def norm_statistics(x: jnp.ndarray, *, norm_type: str,
                    epsilon: float) -> tuple[Optional[jnp.ndarray], jnp.ndarray]:
  """(mean `[rows]` or None for RMSNorm, rsigma `[rows]`) of `x[rows, K]`, float32."""
  if norm_type not in NORM_TYPES:
    raise ValueError(f"norm_type={norm_type!r}; expected one of {NORM_TYPES}")
  x = jnp.asarray(x, jnp.float32)
  k = jnp.float32(x.shape[1])
  eps = jnp.float32(epsilon)
  if norm_type == "layernorm":
    mean = ieee_div(row_sum(x), k)
    d = x - mean[:, None]
    var = ieee_div(row_sum(mul_rn(d, d)), k)
  else:
    mean = None
    var = ieee_div(row_sum(mul_rn(x, x)), k)
  return mean, ieee_div(jnp.float32(1.0), ieee_sqrt(var + eps))


def norm_apply(x: jnp.ndarray, mean: Optional[jnp.ndarray], rsigma: jnp.ndarray,
               scale: Optional[jnp.ndarray], bias: Optional[jnp.ndarray]) -> jnp.ndarray:
  """The normalized float32 `[rows, K]` (before rounding to the output dtype).

  Args:
    x: `[rows, K]`.
    mean: `[rows]` (LayerNorm) or None (RMSNorm).
    rsigma: `[rows]`.
    scale: the effective float32 scale `g[K]` (zero-centered already shifted), or None.
    bias: float32 `[K]` or None.
  """
  x = jnp.asarray(x, jnp.float32)
  d = x if mean is None else x - mean[:, None]
  r = rsigma[:, None]
  if bias is None:
    t = d * r
    return t if scale is None else t * scale[None, :]
  if scale is None:
    return mul_rn(d, r) + bias[None, :]
  return mul_rn(d * r, scale[None, :]) + bias[None, :]


def normalize(x: jnp.ndarray, scale: Optional[jnp.ndarray], bias: Optional[jnp.ndarray], *,
              norm_type: str, epsilon: float, out_dtype) -> tuple:
  """(y in `out_dtype`, mean or None, rsigma) of `x[rows, K]`: the spec end to end."""
  mean, rsigma = norm_statistics(x, norm_type=norm_type, epsilon=epsilon)
  y = norm_apply(x, mean, rsigma, scale, bias)
  return y.astype(out_dtype), mean, rsigma
