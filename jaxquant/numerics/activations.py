"""Activations and their derivatives in the fused kernels' exact float32 arithmetic (the spec).

XLA's `exp`, `tanh` and float32 `/` are its own approximations (different on CPU and GPU), so
the fused activation kernels cannot match `jax.nn.gelu` bit for bit; they match these instead,
written from additions, products (`mul_rn` where a product feeds an addition), `ieee_div` and
exact power-of-two scaling. `ffi/jaxquant_numerics.h` mirrors every operation in this order.

exp(x) (`exp_f32`): x clamped to [-104, 89] (NaN stays NaN); n = round_half_even(x * log2(e));
r = (x - n * LN2_HI) - mul_rn(n, LN2_LO) (LN2_HI has 9 significant bits, so n * LN2_HI is
exact); p = 1 + r (1 + r (1/2 + ... r / 5040)) by Horner with mul_rn; exp = (p * 2^n1) * 2^n2,
n1 = clip(n, -126, 127), n2 = n - n1 (two normal factors, so a subnormal result rounds once;
the last product is a mul_rn: every caller adds 1 to it).

The "x * sigmoid(v)" family, one rounding for the value:
  silu(x)       = x / (1 + exp(-x))
  gelu(x)       = x / (1 + exp(-v)),  v = x * (mul_rn(C2, x*x) + C1)    (tanh approximation:
                  0.5 x (1 + tanh(u)) = x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3))
  quick_gelu(x) = x / (1 + exp(-v)),  v = x * 1.702
and their derivatives, s = 1 / (1 + exp(-v)):  act'(x) = s * (mul_rn(q, 1 - s) + 1) with
q = x * dv/dx (silu: x; gelu: x * (mul_rn(C3, x*x) + C1); quick_gelu: v).
  relu(x) = x if x > 0, NaN if x is NaN, else +0;  squared_relu(x) = relu(x) * relu(x).
Backward products (g the incoming gradient): g * act'(x); relu: g where x > 0 else +0;
squared_relu: g * (2 x) where x > 0 else +0 (select, as JAX's relu derivative).
Gated units (`fc1` makes [h0 | h1]): a = act(h0) * h1; dh0 = backward(dy * h1, h0),
dh1 = dy * act(h0).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from jaxquant.numerics.division import ieee_div
from jaxquant.numerics.exact import mul_rn
from jaxquant.numerics.scales import exp2i

LOG2E = np.float32(1.4426950408889634)
LN2_HI = np.float32(0.693359375)  # 355 / 512
LN2_LO = np.float32(math.log(2.0) - 0.693359375)
EXP_COEFFS = tuple(np.float32(1.0 / math.factorial(i)) for i in range(7, -1, -1))  # r^7 .. r^0
_GELU_K = 2.0 * math.sqrt(2.0 / math.pi)
GELU_C1 = np.float32(_GELU_K)
GELU_C2 = np.float32(_GELU_K * 0.044715)
GELU_C3 = np.float32(3.0 * _GELU_K * 0.044715)
QUICK_GELU_C = np.float32(1.702)

#: Activations with a fused kernel (the names of `jaxquant.flax.layernorm.ACTIVATIONS`).
ACTIVATIONS = ("gelu", "silu", "relu", "quick_gelu", "squared_relu")
ALIASES = {"swish": "silu"}
#: Gated units: the activation of the first half (the second half is linear).
GATED = {"swiglu": "silu", "geglu": "gelu", "reglu": "relu", "qgeglu": "quick_gelu"}


def canonical(name: str) -> str:
  name = ALIASES.get(name, name)
  if name not in ACTIVATIONS:
    raise ValueError(f"activation {name!r} has no fused kernel; expected one of "
                     f"{ACTIVATIONS + tuple(ALIASES)}")
  return name


def exp_f32(x) -> jnp.ndarray:
  """e^x in float32, in the kernels' order of operations."""
  x = jnp.asarray(x, jnp.float32)
  xc = jnp.minimum(jnp.maximum(x, jnp.float32(-104.0)), jnp.float32(89.0))
  n = jnp.round(xc * LOG2E)
  r = (xc - n * LN2_HI) - mul_rn(n, LN2_LO)
  p = jnp.full_like(r, EXP_COEFFS[0])
  for c in EXP_COEFFS[1:]:
    p = mul_rn(p, r) + c
  ni = jnp.where(jnp.isnan(n), jnp.float32(0.0), n).astype(jnp.int32)
  n1 = jnp.clip(ni, -126, 127)
  # mul_rn: the callers add 1 to the result, and the last product must round on its own.
  return mul_rn(p * exp2i(n1), exp2i(ni - n1))


def _relu(x):
  return jnp.where(x > 0, x, jnp.where(jnp.isnan(x), x, jnp.float32(0.0)))


def _sigmoid_argument(name: str, x):
  """(v, q) of the x * sigmoid(v) family: the sigmoid's argument and q = x * dv/dx."""
  if name == "silu":
    return x, x
  if name == "quick_gelu":
    v = x * QUICK_GELU_C
    return v, v
  w = x * x  # gelu
  return x * (mul_rn(GELU_C2, w) + GELU_C1), x * (mul_rn(GELU_C3, w) + GELU_C1)


def activation(name: str, x) -> jnp.ndarray:
  """act(x), float32."""
  name = canonical(name)
  x = jnp.asarray(x, jnp.float32)
  if name == "relu":
    return _relu(x)
  if name == "squared_relu":
    r = _relu(x)
    return r * r
  v, _ = _sigmoid_argument(name, x)
  return ieee_div(x, exp_f32(-v) + jnp.float32(1.0))


def activation_backward(name: str, g, x) -> jnp.ndarray:
  """The incoming gradient `g` times act'(x), float32."""
  name = canonical(name)
  g, x = jnp.asarray(g, jnp.float32), jnp.asarray(x, jnp.float32)
  if name == "relu":
    return jnp.where(x > 0, g, jnp.float32(0.0))
  if name == "squared_relu":
    return jnp.where(x > 0, g * (x * jnp.float32(2.0)), jnp.float32(0.0))
  v, q = _sigmoid_argument(name, x)
  s = ieee_div(jnp.float32(1.0), exp_f32(-v) + jnp.float32(1.0))
  return g * (s * (mul_rn(q, jnp.float32(1.0) - s) + jnp.float32(1.0)))


def gated_activation(name: str, h0, h1) -> jnp.ndarray:
  """act(h0) * h1, float32."""
  return activation(name, h0) * jnp.asarray(h1, jnp.float32)


def gated_activation_backward(name: str, dy, h0, h1) -> tuple[jnp.ndarray, jnp.ndarray]:
  """(dh0, dh1) of a = act(h0) * h1 for the incoming gradient `dy`, float32."""
  dy, h1 = jnp.asarray(dy, jnp.float32), jnp.asarray(h1, jnp.float32)
  return activation_backward(name, dy * h1, h0), dy * activation(name, h0)
