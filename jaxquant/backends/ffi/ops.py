"""The FFI backend's entry points for `jaxquant.ops`: what the kernels can serve, and the ops.

`available()` is False when the extension was not built (or registered nothing); the ops then
take the reference path and `jaxquant.explain` says why. Each `*_unsupported` returns None when a
kernel serves the case, else the reason.
"""

from __future__ import annotations

from typing import Optional

from jaxquant.backends.ffi import delayed as _delayed
from jaxquant.backends.ffi import gemm as _gemm
from jaxquant.backends.ffi import quantize as _quantize
from jaxquant.backends.ffi import registry as _registry
from jaxquant.backends.ffi import transpose as _transpose
from jaxquant.backends.platform import current_platform as _platform


def available() -> bool:
  """Whether the extension is built and registered handlers for at least one platform."""
  return bool(_registry.registered_platforms())


def path_name() -> str:
  """The implementation name `jaxquant.explain` shows: "ffi-cuda" or "ffi-cpu"."""
  return f"ffi-{_platform()}"


def quantize_unsupported(x2d, quantizer, *, rowwise: bool, columnwise: bool) -> Optional[str]:
  reason = _registry.unserved_reason(_platform())
  if reason is not None:
    return reason
  return _quantize.unsupported(x2d, quantizer, rowwise=rowwise, columnwise=columnwise)


def quantize_single(x2d, quantizer, *, rowwise: bool, columnwise: bool, orig_dtype,
                    row_key_words=None, col_key_words=None, state=None):
  """Same contract as `jaxquant.backends.reference.ops.quantize_single`."""
  return _quantize.quantize_single(x2d, quantizer, rowwise=rowwise, columnwise=columnwise,
                                   orig_dtype=orig_dtype, row_key_words=row_key_words,
                                   col_key_words=col_key_words, state=state)


def quantize_with_update_unsupported(x2d, quantizer, *, rowwise: bool, columnwise: bool,
                                     state) -> Optional[str]:
  """None when one call quantizes and updates `state` (`quantize_single_with_update`)."""
  return (quantize_unsupported(x2d, quantizer, rowwise=rowwise, columnwise=columnwise)
          or _quantize.update_in_quantize_reason(quantizer, state))


def quantize_single_with_update(x2d, quantizer, *, rowwise: bool, columnwise: bool, orig_dtype,
                                state):
  """(`quantize_single`'s pair, the updated state) from one call."""
  return _quantize.quantize_single_with_update(x2d, quantizer, rowwise=rowwise,
                                               columnwise=columnwise, orig_dtype=orig_dtype,
                                               state=state)


def transpose_unsupported(t) -> Optional[str]:
  reason = _registry.unserved_reason(_platform())
  return reason if reason is not None else _transpose.unsupported(t)


def transpose(t):
  return _transpose.transpose(t)


def gemm_unsupported(a, b) -> Optional[str]:
  return _gemm.gemm_unsupported(a, b)


def gemm_path(a, b) -> str:
  return _gemm.gemm_path(a, b)


def gemm_path_reason(a, b) -> str:
  return _gemm.gemm_path_reason(a, b)


def gemm(a, b, *, out_dtype, bias=None, precision=None, **kwargs):
  return _gemm.gemm(a, b, out_dtype=out_dtype, bias=bias, precision=precision, **kwargs)


def gemm_gelu_unsupported(a, b, out_dtype, bias) -> Optional[str]:
  return _gemm.gemm_gelu_unsupported(a, b, out_dtype, bias)


def gemm_gelu(a, b, *, bias=None, precision=None, role=None):
  return _gemm.gemm_gelu(a, b, bias=bias, precision=precision, role=role)


STATE_UPDATE_KERNELS = ("delayed-update",)  # `Format.state_update_kernel` names


def state_update_unsupported(kernel: str) -> Optional[str]:
  if kernel not in STATE_UPDATE_KERNELS:
    return f"no FFI state-update kernel {kernel!r}; built: {STATE_UPDATE_KERNELS}"
  return _registry.unserved_reason(_platform())


def state_update(kernel: str, state, amax, quantizer):
  """Same contract as the format's `update_state` (`jaxquant.formats.delayed.
  delayed_scaling_update` for "delayed-update")."""
  return _delayed.update(state, amax, quantizer)
