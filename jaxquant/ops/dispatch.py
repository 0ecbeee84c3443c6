"""Choosing between the reference path, the FFI kernels and the XLA-fused path.

`JAXQUANT_BACKEND` = `auto` (default), `reference`, `ffi` or `xla`. Under `auto` an op takes
the FFI kernel where the extension is loaded and supports the case, else the reference; a
quantize takes the XLA-fused path (`jaxquant.backends.xla`) instead where that backend says it
measured faster on the platform. `ffi` and `xla` force that path for the ops it implements
(forcing it where it cannot serve the case is an error, never a silent fallback); `xla` has
only a quantize, so under it GEMMs and transposes keep the automatic FFI/reference choice.
Every choice is recorded for `jaxquant.explain` with its reason.
"""

from __future__ import annotations

from typing import Optional

from jaxquant.backends.ffi import ops as ffi
from jaxquant.backends.ffi import registry
from jaxquant.backends.platform import current_platform
from jaxquant.settings import env_choice

BACKENDS = ("auto", "reference", "ffi", "xla")


def requested_backend() -> str:
  return env_choice("JAXQUANT_BACKEND", BACKENDS, "auto")


def ffi_module():
  """The FFI backend (`jaxquant.backends.ffi.ops`), or None when the extension is not built."""
  return ffi if ffi.available() else None


def ffi_missing_reason() -> str:
  """Why `ffi_module()` is None: the extension is not built, failed to load, or serves nothing."""
  return registry.unserved_reason(current_platform()) or "jaxquant FFI extension not built"


def choose(op: str, unsupported_reason: Optional[str]) -> tuple[str, str]:
  """("ffi" | "reference", reason) for an op whose FFI support check gave `unsupported_reason`
  (None = the FFI can serve it). Ops without an XLA-fused form treat `xla` as `auto`."""
  mode = requested_backend()
  if mode == "reference":
    return "reference", "JAXQUANT_BACKEND=reference"
  if unsupported_reason is None:
    return "ffi", ""
  if mode == "ffi":
    raise RuntimeError(f"JAXQUANT_BACKEND=ffi, but the FFI path cannot serve this {op}: "
                       f"{unsupported_reason}. Unset JAXQUANT_BACKEND or set it to 'reference'.")
  return "reference", unsupported_reason


def choose_quantize(ffi_reason: Optional[str], xla_reason: Optional[str],
                    xla_auto_reason: Optional[str]) -> tuple[str, str]:
  """("xla" | "ffi" | "reference", reason) for a quantize.

  Args:
    ffi_reason: why the FFI cannot serve it (None: it can).
    xla_reason: why the XLA-fused path cannot serve it (None: it can).
    xla_auto_reason: why `auto` prefers the XLA-fused path here (None: it prefers the FFI).
  """
  mode = requested_backend()
  if mode == "xla":
    if xla_reason is not None:
      raise RuntimeError(f"JAXQUANT_BACKEND=xla, but the XLA-fused path cannot serve this "
                         f"quantize: {xla_reason}. Unset JAXQUANT_BACKEND or set it to 'ffi' "
                         "or 'reference'.")
    return "xla", "JAXQUANT_BACKEND=xla"
  if mode == "auto" and xla_reason is None and xla_auto_reason is not None:
    return "xla", xla_auto_reason
  return choose("quantize", ffi_reason)
