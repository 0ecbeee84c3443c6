"""`jaxquant.grouped_dense` without a recipe: `jax.lax.ragged_dot`, or its three GEMMs on the
bfloat16 CUTLASS grouped kernel where that kernel runs.

`jax.lax.ragged_dot` (and JAX's autodiff of it) is the specification and the path everywhere
the kernel does not run (CPU, other GPUs, float16 / float32 operands, unaligned shapes,
`JAXQUANT_BACKEND=reference`). On CUDA with the kernel built (`jaxquant_grouped_gemm_bf16`),
bfloat16 tokens `x[T, K]` and kernel `W[G, K, N]` (K and N multiples of 8) take a `custom_vjp`
whose GEMMs read the operands as they are stored, with no transpose:
  forward  y  = x . W[g]         layout NN (W is N-major)
  dgrad    dx = dy . W[g]^T      layout TN (W read as [N_out = K, K_c = N])
  wgrad    dW[g] = x_g^T . dy_g  layout NT (x and dy token-major), mode 1 over each group
float32 sums, one rounding to bfloat16 (ragged_dot's semantics; XLA's ragged_dot sums in float32
too, in another order). Rows past `sum(group_sizes)` give zeros; `precision` does not apply to
bfloat16 operands.

A kernel stored in another dtype than x (float32 parameters with bfloat16 compute, Flax's
default) is cast to x's dtype for the products, and its gradient is the float32 sums of each
group's `x_g^T dy_g` rounded once to the kernel's own dtype: the wgrad GEMM writes float32
directly (TransformerEngine's float32 weight gradient), instead of a bfloat16 gradient that an
XLA convert pass widens (0.9 ms a step for 8 experts of 4096 x 14336 on an H100). The reference
path computes the same with one `ragged_dot_general` writing float32.
`jaxquant.explain` records which path ran and why (op "grouped_gemm").
Without a recipe nothing is quantized, so JAXQUANT_BACKEND=ffi does not turn the ragged_dot
path into an error (it stays the layer's definition); JAXQUANT_BACKEND=reference selects it.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxquant.backends.ffi.grouped import bf16
from jaxquant.explain import Decision, record
from jaxquant.ops import dispatch

_GEMMS = (  # (label, mode, a_k_major, b_k_major)
    ("fprop", 0, True, False),
    ("dgrad", 0, True, True),
    ("wgrad", 1, False, False),
)


def _shapes(label: str, x, kernel):
  """The operand shapes of one of the three GEMMs."""
  tokens, k = x.shape
  groups, _, n = kernel.shape
  return {"fprop": ((tokens, k), (groups, k, n)), "dgrad": ((tokens, n), (groups, k, n)),
          "wgrad": ((tokens, k), (tokens, n))}[label]


def _out_dtype(label: str, x, kernel):
  """fprop and dgrad write x's dtype; the wgrad writes the kernel's gradient in its dtype."""
  return kernel.dtype if label == "wgrad" else x.dtype


def kernel_reason(x: jax.Array, kernel: jax.Array) -> Optional[str]:
  """Why the three GEMMs cannot run on the bfloat16 CUTLASS kernel (None: they can)."""
  if dispatch.requested_backend() == "reference":
    return "JAXQUANT_BACKEND=reference"
  reason = bf16.device_reason()
  if reason is not None:
    return reason
  for label, mode, a_k, b_k in _GEMMS:
    a_shape, b_shape = _shapes(label, x, kernel)
    reason = bf16.shape_reason(mode, a_shape, b_shape, a_dtype=x.dtype, b_dtype=x.dtype,
                               out_dtype=_out_dtype(label, x, kernel), a_k_major=a_k,
                               b_k_major=b_k)
    if reason is not None:
      return f"{label}: {reason}"
  return None


def _record(x, kernel, reason: Optional[str]) -> None:
  groups = kernel.shape[0]
  what = f"{x.dtype.name} x {kernel.dtype.name} [{groups} groups, no recipe]"
  if reason is not None:
    record(Decision("grouped_gemm", "fprop+dgrad+wgrad", what, "reference",
                    f"jax.lax.ragged_dot and its autodiff: {reason}"))
    return
  path = dispatch.ffi_module().path_name()
  for label, mode, a_k, b_k in _GEMMS:
    a_shape, b_shape = _shapes(label, x, kernel)
    kernel_name = bf16.kernel_label(mode, a_shape, groups, _out_dtype(label, x, kernel),
                                    a_k_major=a_k, b_k_major=b_k, b_shape=b_shape)
    record(Decision("grouped_gemm", label, f"{what}; kernel: {kernel_name}", path))


def ragged_matmul(x: jax.Array, kernel: jax.Array, group_sizes: jax.Array,
                  precision: Any = None) -> jax.Array:
  """`jax.lax.ragged_dot(x, kernel.astype(x.dtype), group_sizes)` (sizes already clipped), on
  the kernel where `kernel_reason` allows; the path is recorded for `jaxquant.explain`. A kernel
  in another dtype gets the float32 sums as its gradient (the module docstring)."""
  reason = kernel_reason(x, kernel)
  _record(x, kernel, reason)
  if reason is not None:
    if kernel.dtype == x.dtype:
      return jax.lax.ragged_dot(x, kernel, group_sizes, precision=precision)
    return _cast_reference(x, kernel, group_sizes, precision)
  return _matmul(x, kernel, group_sizes)


def _starts(group_sizes):
  return bf16.group_starts(group_sizes)


@jax.custom_vjp
def _matmul(x, kernel, group_sizes):
  return _fwd(x, kernel, group_sizes)[0]


def _fwd(x, kernel, group_sizes):
  # the cast kernel is the residual (the dgrad reads it); a zero-size array carries its dtype
  cast = kernel.astype(x.dtype)
  y = bf16.gemm(x, cast, _starts(group_sizes), mode=0, out_dtype=x.dtype, b_k_major=False)
  return y, (x, cast, group_sizes, jnp.zeros((0,), kernel.dtype))


def _bwd(residuals, dy):
  x, kernel, group_sizes, like = residuals
  starts = _starts(group_sizes)
  dy = dy.astype(x.dtype)
  dx = bf16.gemm(dy, kernel, starts, mode=0, out_dtype=x.dtype)
  dkernel = bf16.gemm(x, dy, starts, mode=1, out_dtype=like.dtype, a_k_major=False,
                      b_k_major=False)
  return dx, dkernel, None


_matmul.defvjp(_fwd, _bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _cast_reference(x, kernel, group_sizes, precision):
  """The specification of a kernel in another dtype than x: ragged_dot on the cast kernel,
  its autodiff for dx, and the kernel's gradient as float32 sums of x_g^T dy_g
  (`ragged_dot_general` with a float32 result) rounded once to the kernel's dtype."""
  return _cast_reference_fwd(x, kernel, group_sizes, precision)[0]


def _cast_reference_fwd(x, kernel, group_sizes, precision):
  cast = kernel.astype(x.dtype)
  y = jax.lax.ragged_dot(x, cast, group_sizes, precision=precision)
  return y, (x, cast, group_sizes, jnp.zeros((0,), kernel.dtype))


# The wgrad as one ragged-contraction `ragged_dot_general`: x [T, K] and dy [T, N] contracted
# over their ragged token axis, one [K, N] sum per group ([G, K, N]).
_WGRAD_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[])


def _cast_reference_bwd(precision, residuals, dy):
  x, cast, group_sizes, like = residuals
  _, vjp_x = jax.vjp(lambda x: jax.lax.ragged_dot(x, cast, group_sizes, precision=precision), x)
  (dx,) = vjp_x(dy)
  # the operands as they are (XLA's bfloat16 GEMM, float32 sums written as float32): as fast
  # as ragged_dot's own wgrad, where float32 copies of x and dy ran 5x slower on an H100
  dkernel = jax.lax.ragged_dot_general(x, dy.astype(x.dtype), group_sizes, _WGRAD_DIMS,
                                       precision=precision, preferred_element_type=jnp.float32)
  return dx, dkernel.astype(like.dtype), None


_cast_reference.defvjp(_cast_reference_fwd, _cast_reference_bwd)
