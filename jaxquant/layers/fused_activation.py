"""An MLP's activation fused with the quantizations around it.

Forward: the activation kernel writes the quantized input of `fc2` (`act(h)`, or `act(h0) * h1`
for a gated unit) instead of `act(h)` in high precision. Backward: the activation-gradient
kernel reads `fc2`'s data gradient `da` and `h` and writes the quantized gradient of `fc1`'s
output (`dh = da * act'(h)`) and `fc1`'s bias gradient, instead of `dh` in high precision for
`fc1` to quantize.

The backward fusion belongs to `fc1`'s custom backward pass (its GEMMs consume the quantized
`dh`), so it is an *epilogue* of `fc1` (`jaxquant.dense(..., epilogue=ActivationEpilogue(...))`):
`fc1` then returns `(a, h)`, a placeholder `a` of the activation's shape whose cotangent is
`da`, and `h` (no gradient flows through it). The forward fusion belongs to `fc2`'s input:

  forward and backward fused:  a, h = fc1(epilogue);  a, qa = activation_routed(a, h)
  forward only:                h = fc1();             a, qa = activation_quantized(h)
  backward only:               a, h = fc1(epilogue);  a = activation_routed_hp(a, h)

then `fc2 = jaxquant.dense(a, ..., x_quantized=qa)` (or plain `dense(a, ...)`). The fused values
follow the spec's arithmetic (`jaxquant.numerics.activations`); the unfused halves use JAX's
own activation (`jax.nn`), as the unfused MLP does.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from jaxquant.explain import Decision, record
from jaxquant import ops
from jaxquant.numerics import activations as _act
from jaxquant.ops import fused as fused_ops
from jaxquant.quantizers import Quantizer

# JAX's own activations (the unfused MLP's), for the high-precision halves.
JAX_ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "gelu": jax.nn.gelu,
    "silu": jax.nn.silu,
    "relu": jax.nn.relu,
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "squared_relu": lambda x: jnp.square(jax.nn.relu(x)),
}


def _split(h: jax.Array, gated: bool):
  """(h0, h1) of a gated unit's `[..., 2, N]` output, (h, None) otherwise."""
  return (h[..., 0, :], h[..., 1, :]) if gated else (h, None)


def jax_activation(activation: str, gated: bool, h: jax.Array) -> jax.Array:
  """The activation in JAX's arithmetic: `act(h)`, or `act(h0) * h1` of `h[..., 2, N]`."""
  f = JAX_ACTIVATIONS[_act.canonical(activation)]
  h0, h1 = _split(h, gated)
  return f(h0) * h1 if gated else f(h0)


_GELU_C = math.sqrt(2.0 / math.pi)
_GELU_K = 0.044715


def gelu_gradient(da: jax.Array, h: jax.Array) -> jax.Array:
  """`da * gelu'(h)` (tanh approximation) in float32 from one `tanh`, rounded to h's dtype.

  The gradient of the GEMM epilogue's gelu (`in_gemm`): XLA runs this form in 290 µs against
  347 for `jax.vjp` of `jax.nn.gelu` at fc1's d2048 shape on an H200 (bench/gelu_grad.py,
  RESULTS "Session 37"), and it rounds once where the vjp rounds its bf16 intermediates.
  """
  x = h.astype(jnp.float32)
  t = jnp.tanh(_GELU_C * (x + _GELU_K * x * x * x))
  slope = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _GELU_C * (1.0 + 3.0 * _GELU_K * x * x)
  return (da.astype(jnp.float32) * slope).astype(h.dtype)


def _activation_shape(h_shape: tuple, gated: bool) -> tuple:
  return tuple(h_shape[:-2]) + tuple(h_shape[-1:]) if gated else tuple(h_shape)


@dataclasses.dataclass(frozen=True)
class ActivationEpilogue:
  """`fc1`'s epilogue (static): returns `(a, h)` and quantizes `dh` from `da` in one kernel.

  With `in_gemm` the GEMM itself applies the activation (`jaxquant.ops.gemm_gelu`: gelu only,
  ungated) and `a` is the activation; otherwise `a` is a placeholder and the forward activation
  is `fc2`'s fused input (`activation_routed`), with `in_quantize` the approximate gelu of
  Float8Block's whole-tile quantize kernel (`ActivationConfig.approximate`, gelu only, ungated).
  With `fused_gradient=False` the gradient runs unfused: the activation's derivative at `h`
  (`gelu_gradient` for the GEMM's or the quantize kernel's gelu, else JAX's), then the
  quantize.

  Attributes:
    activation: `jaxquant.numerics.activations.ACTIVATIONS` name (or an alias).
    gated: `fc1`'s output is `[..., 2, N]`, the activation `act(h0) * h1`.
    in_gemm: the forward GEMM writes `(act(h), h)` (its epilogue).
    in_quantize: the forward gelu runs in `fc2`'s input quantize (`activation_routed` with an
      approximate `ActivationConfig`).
    fused_gradient: the activation-gradient kernel quantizes `dh` (where the format has one).
  """

  activation: str
  gated: bool = False
  in_gemm: bool = False
  fused_gradient: bool = True
  in_quantize: bool = False

  def __post_init__(self):
    object.__setattr__(self, "activation", _act.canonical(self.activation))
    for name, kernel in (("in_gemm", "the GEMM's epilogue"),
                         ("in_quantize", "the quantize kernel")):
      if getattr(self, name) and (self.activation != "gelu" or self.gated):
        raise ValueError(f"{name}: {kernel} applies gelu (ungated) only; got "
                         f"activation={self.activation!r}, gated={self.gated}")
    if self.in_gemm and self.in_quantize:
      raise ValueError("in_gemm and in_quantize: the gelu runs in one kernel, not both")

  def outputs(self, h: jax.Array):
    """`(a, h)`: `a` a placeholder of the activation's shape (its cotangent is `da`)."""
    return jnp.zeros(_activation_shape(h.shape, self.gated), h.dtype), h

  def gemm(self, x_row, w_row, *, bias, out_dtype, role, precision):
    """`(act(h), h)` of `h = x_row w_row^T (+ bias)` (`in_gemm`): one GEMM with the gelu in its
    epilogue where the FFI serves the pair (`jaxquant.ops.gemm_gelu`), else the GEMM and then
    JAX's gelu of the rounded `h` (the unfused arithmetic), recorded for `jaxquant.explain`."""
    reason = ops.gemm_gelu_unsupported(x_row, w_row, out_dtype=out_dtype, bias=bias)
    if reason is None:
      return ops.gemm_gelu(x_row, w_row, out_dtype=out_dtype, bias=bias, role=role,
                           precision=precision)
    record(Decision("producer", role, "gelu in fc1's GEMM epilogue", "unfused", reason))
    h = ops.gemm(x_row, w_row, out_dtype=out_dtype, bias=bias, role=role, precision=precision)
    return jax_activation(self.activation, False, h), h

  def gradient(self, cotangent, h: jax.Array, quantizer: Quantizer, state: Any, *,
               rowwise: bool, columnwise: bool, dbias: bool, key=None, role=None):
    """(`dh` quantized by `quantizer`, float32 bias gradient or None) from `da` (the
    cotangent of `a`; `h`'s own cotangent is ignored: nothing differentiates through it)."""
    da, _ = cotangent
    n = h.shape[-1]
    h2d = h.reshape(-1, 2 * n if self.gated else n)
    if isinstance(da, SymbolicZero) or da is None:
      da = jnp.zeros(_activation_shape(h.shape, self.gated), h.dtype)
    da2d = da.reshape(-1, n).astype(h.dtype)
    rowwise = rowwise or not columnwise  # a bias-only gradient still runs one direction
    reason = (fused_ops.fusion_unsupported(quantizer) if self.fused_gradient
              else "the activation gradient runs unfused here (fuse_producers)")
    if reason is None:
      return fused_ops.activation_grad_quantize(da2d, h2d, activation=self.activation,
                                                gated=self.gated, quantizer=quantizer,
                                                rowwise=rowwise, columnwise=columnwise,
                                                state=state, dbias=dbias, role=role)
    if self.fused_gradient:  # (otherwise the module's fusion plan recorded why)
      record(Decision(
          "producer", role, f"activation gradient {self.activation}, then quantize", "unfused",
          reason))
    if self.in_gemm or self.in_quantize:
      dh = gelu_gradient(da, h)
    else:
      _, vjp = jax.vjp(lambda v: jax_activation(self.activation, self.gated, v), h)
      (dh,) = vjp(da)
    dh2d = dh.reshape(h2d.shape)
    qdh = ops.quantize(dh2d, quantizer, rowwise=rowwise, columnwise=columnwise, key=key,
                       state=state, role=role)
    if not dbias:
      return qdh, None
    if not self.fused_gradient:  # the unfused dense's reduction (jaxquant.layers.dense._bwd),
      # in dh's dtype: the unfused MLP's bias gradient
      batch_axes = tuple(range(dh.ndim - 1))
      return qdh, jax.lax.reduce(dh, jnp.zeros((), dh.dtype), jax.lax.add,
                                 batch_axes).astype(jnp.float32)
    return qdh, jnp.sum(dh2d.astype(jnp.float32), axis=0)


@dataclasses.dataclass(frozen=True)
class ActivationConfig:
  """Static description of `fc2`'s fused input.

  Attributes:
    activation, gated: as `ActivationEpilogue`'s.
    quantizer: `fc2`'s input quantizer (`jaxquant.ops.fused.fusion_unsupported` is None).
    role: `fc2`'s input role, for `jaxquant.explain`.
    approximate: an ungated gelu computed with the CUDA kernels' hardware approximations
      (`jaxquant.backends.producers.Producer.approximate`).
  """

  activation: str
  gated: bool
  quantizer: Quantizer
  role: Any = None
  approximate: bool = False


def _quantize_activation(config: ActivationConfig, h: jax.Array, state):
  n = h.shape[-1]
  h2d = h.reshape(-1, 2 * n if config.gated else n)
  qa = fused_ops.activation_quantize(h2d, activation=config.activation, gated=config.gated,
                                     quantizer=config.quantizer, rowwise=True, columnwise=True,
                                     state=state, role=config.role,
                                     approximate=config.approximate)
  return jnp.zeros(_activation_shape(h.shape, config.gated), h.dtype), qa


# activation_quantized(h): the gradient of h is the high-precision one (JAX's activation).
def _aq_primal(config, h, state):
  return _quantize_activation(config, h, state)


def _aq_fwd(config, h, state):
  return _quantize_activation(config, h, state), h


def _aq_bwd(config, h, cotangents):
  da, _ = cotangents
  _, vjp = jax.vjp(lambda v: jax_activation(config.activation, config.gated, v), h)
  (dh,) = vjp(da.astype(h.dtype))
  return dh, None


_activation_quantized = jax.custom_vjp(_aq_primal, nondiff_argnums=(0,))
_activation_quantized.defvjp(_aq_fwd, _aq_bwd)


def activation_quantized(h: jax.Array, state: Any, config: ActivationConfig):
  """`(a, qa)`: `qa` the quantized activation of `fc1`'s output `h` (`[..., N]`, gated
  `[..., 2, N]`), `a` a placeholder carrying its gradient back to `h` in high precision."""
  return _activation_quantized(config, h, state)


# activation_routed(a, h): fc1's epilogue computes dh; the cotangent of `a` goes straight to it.
def _ar_primal(config, a, h, state):
  del a
  return _quantize_activation(config, h, state)


def _ar_fwd(config, a, h, state):
  del a
  return _quantize_activation(config, h, state), None


def _ar_bwd(config, residuals, cotangents):
  da, _ = cotangents
  return da, None, None


_activation_routed = jax.custom_vjp(_ar_primal, nondiff_argnums=(0,))
_activation_routed.defvjp(_ar_fwd, _ar_bwd)


def activation_routed(a: jax.Array, h: jax.Array, state: Any, config: ActivationConfig):
  """`(a', qa)` from `fc1`'s epilogue outputs `(a, h)`: the cotangent of `a'` is `a`'s."""
  return _activation_routed(config, a, h, state)


# activation_routed_hp(a, h): the activation in high precision, its cotangent routed to `a`.
def _rh_primal(activation, gated, a, h):
  del a
  return jax_activation(activation, gated, h)


def _rh_fwd(activation, gated, a, h):
  return _rh_primal(activation, gated, a, h), None


def _rh_bwd(activation, gated, residuals, da):
  return da, None


_routed_hp = jax.custom_vjp(_rh_primal, nondiff_argnums=(0, 1))
_routed_hp.defvjp(_rh_fwd, _rh_bwd)


def activation_routed_hp(a: jax.Array, h: jax.Array, activation: str, gated: bool) -> jax.Array:
  """`act(h)` in high precision (JAX's), whose cotangent goes to `fc1`'s placeholder `a`."""
  return _routed_hp(_act.canonical(activation), gated, a, h)
